"""flowseam serve under load: N concurrent image requests with batching vs the same requests one
after the other, latency percentiles, the server's overhead over calling generate directly, and
that every request finished exactly once.

It starts its own ``flowseam serve`` on a free port of 127.0.0.1 (loopback only; nothing else is
contacted) with the demo's shipped text-to-image model (FLUX.1 architecture, trained on digits;
``--model`` for another), then alternates, ``--rounds`` times:

* **sequential**: one client sends the N requests one after the other;
* **concurrent**: N clients (threads, official ``openai`` SDK) send one request each at once;
  the server batches the compatible queued ones into one loop run (``--max-batch``).

Every request has its own seed. Throughput is requests per second of wall time per phase; the
ratio concurrent/sequential is the gain from batching (goal >= 1.5 for 8 requests). Latency
p50/p95 are over every concurrent request of every round. Overhead: one request through the
server vs ``model.generate`` of the same request in this process (same checkpoint and backend),
alternating ``--rounds`` times, each measured alone; the goal is a median ratio <= 1.05.
Exactly once: every response carries its job id and its seed; the ids must be distinct, every
seed answered once, and the job table must hold exactly those ids, each ``completed``.

Bounded: N <= 64 clients, ``--timeout`` seconds per request, ``--max-seconds`` for the whole run.

Run: .venv/bin/python bench/serve_load.py [--clients 8] [--rounds 3] [--size 64] [--steps 8]
"""

from __future__ import annotations

import argparse
import base64
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=DeprecationWarning)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


class Served:
    """``flowseam serve`` on 127.0.0.1:0 in a subprocess."""

    def __init__(self, model: str, out: Path, backend: str, max_batch: int, threads: int) -> None:
        self.log = open(out / "server.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flowseam", "serve", "--model", model, "--backend", backend,
             "--host", "127.0.0.1", "--port", "0", "--output-dir", str(out / "serve"),
             "--max-batch", str(max_batch), "--max-queue", "64", "--log-level", "warning",
             "--threads", str(threads)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            text = (out / "server.log").read_text()
            if "listening on http://" in text:
                self.url = text.split("listening on ", 1)[1].split()[0]
                self.model_id = text.split("| models: ", 1)[1].split()[0].rstrip(",")
                self.db = out / "serve" / "jobs.sqlite3"
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"flowseam serve exited:\n{text}")
            time.sleep(0.2)
        self.stop()
        raise SystemExit("flowseam serve did not start in 300 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a text-to-image checkpoint (default: the demo's digits-t2i)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--clients", type=int, default=8, help="concurrent requests (<= 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", type=int, default=64, help="image side in pixels")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads, the same in the server and in this process")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per request")
    ap.add_argument("--max-seconds", type=float, default=1800, help="seconds for the whole run")
    args = ap.parse_args()
    if not 1 <= args.clients <= 64:
        raise SystemExit(f"--clients={args.clients} must be in [1, 64]")
    started = time.monotonic()

    import openai
    import torch

    import flowseam
    from flowseam.quiet import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(args.threads)
    model_path = args.model or str(Path(flowseam.__file__).parent / "demo" / "weights"
                                   / "digits-t2i")
    tmp = Path(tempfile.mkdtemp(prefix="flowseam-serve-load-"))
    server = Served(model_path, tmp, args.backend, args.max_batch, args.threads)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               timeout=args.timeout)
        size = f"{args.size}x{args.size}"
        answers: list[tuple[str, int]] = []  # (job id, seed) of every response
        sent: list[int] = []  # the seed of every request sent
        lock = threading.Lock()
        next_seed = [1000]

        def request(seed: int) -> float:
            with lock:
                sent.append(seed)
            t0 = time.perf_counter()
            out = client.images.generate(model=server.model_id, prompt="a digit 3", size=size,
                                         extra_body={"seed": seed, "steps": args.steps})
            elapsed = time.perf_counter() - t0
            body = out.model_dump()
            assert base64.b64decode(out.data[0].b64_json)[:4] == b"\x89PNG"
            with lock:
                answers.append((body["id"], body["data"][0]["seed"]))
            return elapsed

        def seeds(n: int) -> list[int]:
            first = next_seed[0]
            next_seed[0] += n
            return list(range(first, first + n))

        def out_of_time() -> bool:
            return time.monotonic() - started > args.max_seconds

        request(1)  # warm-up (first-call costs on both sides)
        sequential, concurrent, latencies = [], [], []
        for _ in range(args.rounds):
            if out_of_time():
                break
            t0 = time.perf_counter()
            for seed in seeds(args.clients):
                request(seed)
            sequential.append(args.clients / (time.perf_counter() - t0))

            barrier = threading.Barrier(args.clients)
            times: list[float] = []

            def one(seed: int) -> None:
                barrier.wait()
                t = request(seed)
                with lock:
                    times.append(t)

            threads = [threading.Thread(target=one, args=(s,)) for s in seeds(args.clients)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(args.timeout)
            concurrent.append(args.clients / (time.perf_counter() - t0))
            latencies += times

        # the server's overhead over generate() in this process, alternating, each alone
        model = flowseam.load(model_path, platform=flowseam.Platform(args.backend))
        params = flowseam.DiffusionParams(num_steps=args.steps, height=args.size,
                                          width=args.size, seed=1)
        model.generate("a digit 3", params=params)
        direct, served = [], []
        for i in range(max(3, args.rounds * 2)):
            if out_of_time():
                break
            seed = seeds(1)[0]
            t0 = time.perf_counter()
            model.generate("a digit 3", params=params.replace(seed=seed))
            direct.append(time.perf_counter() - t0)
            served.append(request(seed))

        with sqlite3.connect(server.db) as db:
            rows = dict(db.execute("SELECT id, status FROM jobs WHERE kind = 'image'"))
    finally:
        server.stop()

    ids = [a[0] for a in answers]
    table_ids = {i for i, status in rows.items() if status == "completed"}
    exactly_once = (sorted(a[1] for a in answers) == sorted(sent)  # every seed answered once
                    and len(ids) == len(set(ids))  # one job per request
                    and set(rows) == set(ids) == table_ids)  # no job lost, none extra
    seq, con = statistics.median(sequential), statistics.median(concurrent)
    ratio = statistics.median(s / d for s, d in zip(served, direct))
    print(f"model {server.model_id} ({args.backend}, {args.threads} torch thread(s) on both "
          f"sides), {size}, {args.steps} steps, {args.clients} clients, {len(sequential)} "
          f"rounds, max batch {args.max_batch}")
    print(f"throughput: sequential {seq:.2f} req/s, concurrent {con:.2f} req/s, "
          f"ratio {con / seq:.2f} (goal >= 1.5)")
    print(f"concurrent latency: p50 {percentile(latencies, 0.5):.3f} s, "
          f"p95 {percentile(latencies, 0.95):.3f} s")
    print(f"one request alone: generate() {statistics.median(direct):.3f} s, through the server "
          f"{statistics.median(served):.3f} s, median ratio {ratio:.3f} "
          f"(overhead {100 * (ratio - 1):+.1f} %, goal <= 5 %)")
    print(f"exactly once: {len(sent)} requests, {len(ids)} answers, {len(set(ids))} distinct "
          f"job ids, {len(rows)} rows in the job table, {len(table_ids)} completed -> "
          f"{'ok' if exactly_once else 'FAILED'}")
    return 0 if exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
