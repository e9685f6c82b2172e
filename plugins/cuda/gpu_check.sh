#!/usr/bin/env bash
# GPU check of the cuda backend: its tests (and flowseam's conformance suite for it, when the
# installed flowseam ships one), then a benchmark of its cupy kernels against torch eager
# (bench_kernels.py: effective GB/s next to the device's peak). A few minutes at most; never
# part of CI (which has no GPU).
#
#   plugins/cuda/gpu_check.sh                       # from anywhere in the checkout
#   PYTHON=/opt/conda/bin/python plugins/cuda/gpu_check.sh
#
# Interpreter: $PYTHON, else ./.venv/bin/python (scripts/setup-venv), else python3 on PATH: a
# fresh environment without a venv works. Whatever is missing is pip-installed into it: torch
# (PyPI's Linux wheels are CUDA builds), cupy-cuda12x or -cuda13x (matching torch's CUDA major),
# pytest, this checkout's core (which brings plugins/cpu and core's dependencies) and
# plugins/cuda (editable, so the tests run this checkout's code).
# Results go to $OUT (default outputs/gpu_check): tests.txt, conformance.txt, bench.txt/json.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/outputs/gpu_check}
mkdir -p "$OUT"

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=$(command -v python3)
fi
pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
has() { "$PY" -c "import $1" >/dev/null 2>&1; }
step() { printf '\n== %s\n' "$*"; }

step "interpreter $PY ($("$PY" --version 2>&1))"
has torch || pipi torch || exit 1
"$PY" - <<'PY' || exit 1
import torch, sys
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device; nothing to check here")
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {p.name}, sm{p.major}{p.minor}, "
      f"{p.total_memory / 2**30:.0f} GiB")
PY
CUDA_MAJOR=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")
has cupy || pipi "cupy-cuda${CUDA_MAJOR}x" || exit 1
has pytest || pipi pytest || exit 1
has flowseam || pipi ./core || exit 1
has flowseam_cpu || pipi --no-deps ./plugins/cpu || exit 1
# editable and without build isolation when the local setuptools can (offline machines),
# else an ordinary build
if ! "$PY" -c "import flowseam_cuda, sys; sys.exit(not flowseam_cuda.__file__.startswith('$ROOT/'))" 2>/dev/null; then
    pipi --no-deps --no-build-isolation -e ./plugins/cuda 2>/dev/null || pipi --no-deps ./plugins/cuda || exit 1
fi
"$PY" -m flowseam backends | tee "$OUT/backends.txt"

status=0
step "tests/test_cuda.py"
timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if has flowseam.testing.conformance; then
    step "conformance suite for cuda"
    timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider --pyargs flowseam.testing.conformance \
        --flowseam-backend cuda 2>&1 | tee "$OUT/conformance.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

step "benchmark: cupy kernels vs torch eager"
timeout 180 "$PY" plugins/cuda/bench_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done (status $status); results in $OUT"
exit $status
