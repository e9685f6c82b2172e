"""CPU seconds per test: what a test costs on an idle machine, measured on a loaded one.

On the shared 2-core machine a test's wall time depends on everyone else's load; its CPU time
(user + system of the pytest process and of the subprocesses it waited for, setup and teardown
included, so a module fixture counts for the first test that uses it) hardly does. On an idle
machine the whole ``scripts/test`` took 1093 s wall for 1204 s of CPU, so CPU seconds are a
slightly high estimate of idle seconds.

As a pytest plugin it appends one JSON line per test (``id``, ``cpu``, ``children``, ``wall``,
``pass``) to ``$FLOWSEAM_CPU_TIMES``; only the outermost pytest process writes (a test's inner
pytest run counts as that test's children). ``pass`` is ``unit``, ``conformance:NAME`` or
``blocked`` (``FLOWSEAM_DISABLE_PLUGINS`` set), as ``scripts/test`` runs them.

Run (any pass of scripts/test, or all of it, with the plugin):

    FLOWSEAM_CPU_TIMES=before.jsonl PYTHONPATH=bench PYTEST_ADDOPTS="-p cpu_times" \\
        OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests -q -m "not slow"
    .venv/bin/python bench/cpu_times.py after.jsonl             # the costliest tests
    .venv/bin/python bench/cpu_times.py before.jsonl after.jsonl  # what changed
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

OUT = "FLOWSEAM_CPU_TIMES"
_ROOT = "FLOWSEAM_CPU_TIMES_PID"
os.environ.setdefault(_ROOT, str(os.getpid()))  # inner pytest runs inherit the outer one's pid


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def _pass() -> str:
    if "--flowseam-backend" in sys.argv[:-1]:
        return "conformance:" + sys.argv[sys.argv.index("--flowseam-backend") + 1]
    return "blocked" if os.environ.get("FLOWSEAM_DISABLE_PLUGINS") else "unit"


try:
    import pytest
except ImportError:  # the report below needs no pytest
    pytest = None

if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        own0, children0 = _cpu()
        wall0 = time.perf_counter()
        yield
        own1, children1 = _cpu()
        path = os.environ.get(OUT)
        if path and os.environ[_ROOT] == str(os.getpid()):
            with open(path, "a") as f:
                f.write(json.dumps({
                    "id": item.nodeid, "cpu": round(own1 - own0 + children1 - children0, 2),
                    "children": round(children1 - children0, 2),
                    "wall": round(time.perf_counter() - wall0, 2), "pass": _pass()}) + "\n")


def read(path: str) -> dict[tuple[str, str], dict]:
    rows = (json.loads(line) for line in open(path))
    return {(r["pass"], r["id"]): r for r in rows}


def report(path: str, top: int = 30) -> None:
    rows = read(path)
    per_pass = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for (name, _), r in rows.items():
        per_pass[name][0] += 1
        per_pass[name][1] += r["cpu"]
        per_pass[name][2] += r["wall"]
    for name, (n, cpu, wall) in per_pass.items():
        print(f"{name}: {n} tests, {cpu:.0f} s CPU, {wall:.0f} s wall")
    for (name, test), r in sorted(rows.items(), key=lambda kv: -kv[1]["cpu"])[:top]:
        print(f"{r['cpu']:8.1f} s CPU ({r['children']:6.1f} in subprocesses) {name:8.8} {test}")


def compare(before: str, after: str) -> None:
    b, a = read(before), read(after)
    for key in sorted(set(b) | set(a)):
        cb, ca = b.get(key, {}).get("cpu", 0.0), a.get(key, {}).get("cpu", 0.0)
        if abs(cb - ca) >= 1.0:
            print(f"{cb:8.1f} -> {ca:8.1f} s CPU  {key[0]:8.8} {key[1]}")
    total_b = sum(r["cpu"] for r in b.values())
    total_a = sum(r["cpu"] for r in a.values())
    print(f"total: {total_b:.1f} -> {total_a:.1f} s CPU ({len(b)} -> {len(a)} tests; "
          f"saved {total_b - total_a:.1f} s)")


if __name__ == "__main__":
    if len(sys.argv) == 2:
        report(sys.argv[1])
    elif len(sys.argv) == 3:
        compare(sys.argv[1], sys.argv[2])
    else:
        sys.exit("usage: bench/cpu_times.py TIMES.jsonl [AFTER.jsonl]")
