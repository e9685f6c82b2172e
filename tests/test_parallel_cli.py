"""``flowseam generate --nproc`` and ``flowseam serve --nproc``: one generation split over ranks
started by the command itself (torchrun), refused layouts, and a rank that dies.

The reference of every split output is the same request run in one process
(``flowseam generate`` without ``--nproc``): flowseam's own unsplit loop, which
tests/test_models.py checks against diffusers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
from conftest import run_cli, run_main

import flowseam
from flowseam.launch import EXIT_PEER_LOST, first_failure
from flowseam.testing.tiny import write_tiny_checkpoint

SMALL = ["--steps", "2", "--height", "32", "--width", "32", "--frames", "5", "--seed", "7",
         "--guidance", "4"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-cli")
    return {c: write_tiny_checkpoint(c, root / c) for c in ("wan2.1-t2v", "wan2.1-causal-t2v")}


def _frames(path: Path) -> np.ndarray:
    return iio.imread(path, extension=".mp4").astype(np.int16)


def assert_same_video(got: Path, want: Path) -> None:
    """The two mp4 files decode to the same frames up to rounding: the split runs its GEMMs on
    part of the tokens, so float sums round differently, a pixel may land one 8-bit level off,
    and the lossy H.264 encoder may carry that to a neighbour: at most 3 levels anywhere, and
    fewer than 1% of the values differ at all."""
    a, b = _frames(got), _frames(want)
    assert a.shape == b.shape == (5, 32, 32, 3)
    diff = np.abs(a - b)
    assert diff.max() <= 3 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


@pytest.mark.slow
def test_generate_nproc_2_writes_the_one_process_video_once(ckpts, tmp_path):
    """--nproc 2 (--sp 2 implied): rank 0 alone loads loudly, reports and writes; the video
    decodes to the one-process frames (:func:`assert_same_video`)."""
    import tempfile

    temp = Path(tempfile.gettempdir())
    before = {p.name for p in temp.iterdir()}
    split = run_cli("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "a red ball",
                    *SMALL, "--nproc", "2", "--output", str(tmp_path / "split.mp4"))
    left = {p.name for p in temp.iterdir()} - before  # torchrun's log dir is removed
    assert not [n for n in left if n.startswith(("torchelastic_", "flowseam-ranks-"))], left
    assert split.returncode == 0, split.stderr[-3000:]
    one = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "a red ball",
                   *SMALL, "--output", str(tmp_path / "one.mp4"))
    assert one.returncode == 0, one.stderr
    assert_same_video(tmp_path / "split.mp4", tmp_path / "one.mp4")
    assert split.stdout.count("wrote ") == 1 and "parallel: sp=2 (rank 0)" in split.stdout
    assert split.stderr.count("flowseam: loaded wan2.1-t2v") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.mp4", "split.mp4"]


@pytest.fixture
def many_slots(monkeypatch):
    """A machine with 8 devices, and no rank may start: each case is refused before."""
    import flowseam.parallel

    def refuse(*args, **kwargs):
        raise AssertionError("the ranks were started before the layout was refused")

    monkeypatch.setattr(flowseam.parallel, "device_slots", lambda platform=None: (8, "CPU cores"))
    monkeypatch.setattr(flowseam.launch, "launch", refuse)
    monkeypatch.setattr(flowseam.Platform, "build_component", refuse)


@pytest.mark.parametrize("card, args, message", [
    ("wan2.1-t2v", ["--sp", "4"],
     "--sp 4: wan2.1-t2v's transformer has 2 attention heads, not a multiple of 4"),
    ("wan2.1-t2v", ["--sp", "2", "--height", "48", "--width", "48", "--frames", "1"],
     "--sp 2: the request makes 9 tokens after patching, not a multiple of 2"),
    ("wan2.1-t2v", ["--nproc", "3", "--sp", "2"], "--nproc 3 does not match --sp 2 = 2 ranks"),
    ("wan2.1-t2v", ["--nproc", "3", "--cfg-parallel"], "need an even number of ranks"),
    ("wan2.1-t2v", ["--cfg-parallel", "--guidance", "1"],
     "--cfg-parallel: --guidance=1.0 runs no unconditional branch"),
    ("wan2.1-t2v", ["--sp", "2", "--cache", "reuse:0.1"], "step caching decides per rank"),
    ("wan2.1-t2v", ["--nproc", "0"], "--nproc=0 must be >= 1"),
    ("wan2.1-causal-t2v", ["--sp", "2"], "cannot split its sequence (the causal loop"),
    ("wan2.1-causal-t2v", ["--nproc", "2", "--stream"], "--stream (the causal loop, chunk by "
                                                        "chunk) is not split"),
])
def test_bad_layouts_are_refused_before_any_rank_starts(ckpts, tmp_path, many_slots, card, args,
                                                        message):
    r = run_main("generate", "--model", str(ckpts[card]), "--prompt", "a red ball",
                 "--output", str(tmp_path / "out.mp4"), *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out.mp4").exists()


def test_more_ranks_than_devices_are_refused(ckpts, tmp_path, monkeypatch):
    import flowseam.parallel

    have, what = flowseam.parallel.device_slots(flowseam.Platform.detect())
    monkeypatch.setattr(flowseam.launch, "launch", lambda *a: pytest.fail("ranks started"))
    r = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "x",
                 "--output", str(tmp_path / "out.mp4"), "--nproc", str(have + 1))
    assert r.returncode == 2
    assert (f"--nproc {have + 1} (--sp {have + 1}): this machine has {have} {what}, one per "
            f"rank") in r.stderr


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(c) for c in children]
        todo += [int(c) for c in children]
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def _failure(exitcode: int, timestamp: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="<N/A>")
    failure.timestamp = timestamp
    return failure


@pytest.mark.parametrize("failures, named", [
    # the rank that died aborted its peer (gloo: SIGABRT) and the launcher saw both at once
    ({0: (-signal.SIGABRT, 100), 1: (-signal.SIGKILL, 100)}, 1),
    # the peer noticed first and said so (exit 69), with an earlier timestamp
    ({0: (EXIT_PEER_LOST, 99), 1: (-signal.SIGKILL, 100)}, 1),
    # the launcher stopped the others (SIGTERM, 143) after a rank refused its input
    ({0: (143, 100), 1: (2, 101), 2: (-signal.SIGTERM, 100)}, 1),
    # an abort of its own comes before the ranks that stopped because of it
    ({0: (EXIT_PEER_LOST, 100), 1: (-signal.SIGABRT, 100)}, 1),
    # two ranks failing on their own: the earlier, then the lower rank
    ({0: (1, 101), 1: (3, 100)}, 1), ({2: (1, 100), 1: (1, 100)}, 1),
    # nothing but consequences: still one of them, the earliest
    ({0: (143, 101), 1: (EXIT_PEER_LOST, 100)}, 1),
])
def test_the_failure_named_is_the_cause_whatever_order_the_launcher_saw(failures, named):
    """torchrun's own first failure is the earliest timestamp (whole seconds), ties to the
    lowest rank: a rank that stopped because its peer died would be named instead of the peer."""
    rank, failure = first_failure({r: _failure(*f) for r, f in failures.items()})
    assert rank == named and failure.exitcode == failures[named][0]


@pytest.mark.slow
def test_a_rank_killed_mid_generation_ends_the_job_on_every_rank(ckpts, tmp_path):
    """SIGKILL rank 1 while the ranks denoise: the command exits non-zero naming rank 1, rank 0
    is stopped too, no process is left and no output (or temporary file) is written."""
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowseam", "generate", "--model", str(ckpts["wan2.1-t2v"]),
         "--prompt", "x", "--steps", "5000", "--height", "32", "--width", "32", "--frames", "5",
         "--nproc", "2", "--output", str(out / "video.mp4")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(64), b"")),
                              daemon=True)
    reader.start()
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while b"denoise" not in b"".join(err):  # rank 0's progress bar: the ranks are stepping
            assert proc.poll() is None, b"".join(err).decode()[-3000:]
            assert time.monotonic() < deadline, "the ranks never started denoising"
            time.sleep(0.1)
        ranks = _descendants(proc.pid)
        victim = [p for p in ranks if _rank_of(p) == 1]
        assert victim, ranks
        os.kill(victim[0], signal.SIGKILL)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    stderr = b"".join(err).decode(errors="replace")
    assert code == 1, stderr[-3000:]
    assert "flowseam: rank 1 of 2 was killed by SIGKILL; the other ranks were stopped" in stderr
    assert "internal error" not in stderr and "plugin fault" not in stderr
    # rank 0 stops either way (its collective fails, or the launcher stops it first: which one
    # comes first is timing), says why, and is never named as the rank that failed
    assert ("flowseam: rank 0 of 2: another rank of this job went away" in stderr
            or "flowseam: rank 0 of 2: stopped (SIGTERM" in stderr), stderr[-3000:]
    assert "rank 0 of 2 was killed" not in stderr and "rank 0 of 2 exited" not in stderr
    assert list(out.iterdir()) == []
    assert [p for p in ranks if Path(f"/proc/{p}").exists()] == []


@pytest.mark.slow
def test_serve_nproc_2_answers_as_one_process_and_stops_every_rank(ckpts, tmp_path):
    """flowseam serve --nproc 2 with the openai SDK: a video job decodes to one-process flowseam
    generate's frames (:func:`assert_same_video`: not the same bytes, the split rounds
    differently); a size the split cannot divide is a 400 and the next job still runs
    (the other rank followed); SIGINT stops every rank with status 130."""
    import openai
    from test_serve import Server

    srv = Server(["--model", str(ckpts["wan2.1-t2v"]), "--nproc", "2",
                  "--output-dir", str(tmp_path / "srv")], tmp_path / "server.log")
    srv.start()
    try:
        client = srv.client(key=None)
        with pytest.raises(openai.BadRequestError, match="9 tokens after patching"):
            client.videos.create(model="wan2.1-t2v", prompt="a dog runs", size="48x48",
                                 extra_body={"frames": 1, "steps": 2})
        video = client.videos.create_and_poll(model="wan2.1-t2v", prompt="a dog runs",
                                              size="32x32", extra_body={"frames": 5, "steps": 2,
                                                                        "seed": 7})
        assert video.status == "completed", video
        content = client.videos.download_content(video.id).content
        ranks = _descendants(srv.proc.pid)
        assert sorted(_rank_of(p) for p in ranks) == [0, 1]
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(60) == 130
    finally:
        srv.stop()
    assert [p for p in ranks if Path(f"/proc/{p}").exists()] == []
    one = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "a dog runs",
                   "--width", "32", "--height", "32", "--frames", "5", "--steps", "2", "--seed",
                   "7", "--output", str(tmp_path / "one.mp4"))
    assert one.returncode == 0, one.stderr
    (tmp_path / "served.mp4").write_bytes(content)
    assert_same_video(tmp_path / "served.mp4", tmp_path / "one.mp4")
    assert "parallel: sp=2 (rank 0)" in (tmp_path / "server.log").read_text()


def test_serve_refuses_a_layout_before_any_rank_starts(ckpts, tmp_path, many_slots):
    r = run_main("serve", "--model", str(ckpts["wan2.1-causal-t2v"]), "--sp", "2",
                 "--output-dir", str(tmp_path / "srv"))
    assert r.returncode == 2
    assert "cannot split its sequence" in r.stderr and str(ckpts["wan2.1-causal-t2v"]) in r.stderr


def test_parallel_from_options():
    from flowseam.parallel import Parallel, parallel_from_options

    assert parallel_from_options(None, None, False) is None
    assert parallel_from_options(1, None, False) is None
    assert parallel_from_options(4, None, True) == Parallel(sp=2, cfg=True)
    assert parallel_from_options(None, 2, True) == Parallel(sp=2, cfg=True)
    assert parallel_from_options(2, 2, False) == Parallel(sp=2)
    with pytest.raises(flowseam.InvalidInputError, match="--sp=0 must be >= 1"):
        parallel_from_options(None, 0, False)


def test_a_kernel_that_takes_any_heads_lifts_the_heads_rule(tmp_path):
    """Ulysses (cpu) needs heads divisible by --sp; accel's ring attention says it takes any
    (``any_heads``), so the same layout passes the checks made before the ranks start."""
    from flowseam.loading import check_parallel_checkpoint
    from flowseam.parallel import Parallel, takes_any_heads

    path = write_tiny_checkpoint("wan2.1-t2v", tmp_path / "wan3",
                                 transformer=dict(num_attention_heads=3))
    params = flowseam.DiffusionParams(height=32, width=32, num_frames=5)
    cpu = flowseam.Platform("cpu")
    assert not takes_any_heads(cpu)
    with pytest.raises(flowseam.InvalidInputError, match="has 3 attention heads, not a multiple"):
        check_parallel_checkpoint(path, Parallel(sp=2), params, cpu)
    flowseam.seam.discovery._CACHE = None
    accel = flowseam.seam.discovery.discover().records.get("accel")
    if accel is None or not accel.usable:
        pytest.skip("the accel backend is not usable here")
    platform = flowseam.Platform("accel")
    assert takes_any_heads(platform)
    check_parallel_checkpoint(path, Parallel(sp=2), params, platform)


def test_an_inherited_world_size_does_not_make_this_process_a_rank(ckpts, tmp_path, monkeypatch):
    """WORLD_SIZE=1 from the environment (a cluster's, an outer job's) is not a 2-rank job:
    --nproc 2 starts its own ranks."""
    import flowseam.parallel

    started = []
    monkeypatch.setattr(flowseam.launch, "launch",
                        lambda argv, nproc: started.append((argv, nproc)) or 0)
    monkeypatch.setattr(flowseam.parallel, "device_slots", lambda platform=None: (8, "CPU cores"))
    r = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "x", "--steps", "2",
                 "--height", "32", "--width", "32", "--frames", "5", "--nproc", "2",
                 "--output", str(tmp_path / "x.mp4"), WORLD_SIZE="1", RANK="0")
    assert r.returncode == 0, r.stderr
    assert started and started[0][1] == 2 and "--nproc" in started[0][0]
