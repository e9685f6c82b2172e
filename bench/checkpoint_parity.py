"""flowseam's default call vs diffusers' default call on diffusers' own dummy pipelines: the
rows of issue #10's table, measured.

Builds the pipelines exactly as ``tests/test_checkpoint_parity.py`` does (diffusers'
``get_dummy_components()``, rebuilt locally), writes each row's scheduler into the checkpoint,
and prints, per row, the max abs difference of the frames of ``flowseam.load(path).generate(...)``
(no scheduler parameter) and ``DiffusionPipeline.from_pretrained(path)(...)`` on the same prompt
and seed, and which solver flowseam ran.

Run: .venv/bin/python bench/checkpoint_parity.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

ROWS = [  # (row of the table, pipeline, scheduler factory, request changes)
    ("Wan T2V, scheduler shift=7.0", "wan-t2v", lambda T: T.EULER(shift=7.0), {}),
    ("Wan I2V, same", "wan-i2v", lambda T: T.EULER(shift=7.0), {}),
    ("Flux, use_dynamic_shifting=False, shift 1.0", "flux", lambda T: T.EULER(), {}),
    ("Flux, static shift 3.0", "flux", lambda T: T.EULER(shift=3.0), {}),
    ("Wan with UniPCMultistepScheduler (Wan2.1-Diffusers)", "wan-t2v",
     lambda T: T.UNIPC(flow_shift=3.0), {}),
    ("Wan2.2 layout (transformer_2, boundary_ratio 0.875)", "wan22-t2v",
     lambda T: T.UNIPC(flow_shift=3.0), {}),
    ("FlowMatchEuler with stochastic_sampling=True", "wan-t2v",
     lambda T: T.EULER(shift=7.0, stochastic_sampling=True), {}),
]


def main() -> None:
    import diffusers
    import transformers

    import flowseam
    import test_checkpoint_parity as T

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    checkpoints = T.Checkpoints(Path(tempfile.mkdtemp(prefix="fs-parity-")))
    cpu = flowseam.Platform("cpu")
    print(f"{'checkpoint':<55} {'max |flowseam - diffusers|':>27}  solver")
    for i, (row, name, scheduler, changes) in enumerate(ROWS):
        path = checkpoints.variant(name, f"row{i}", scheduler(T))
        ours = T.ours(path, name, cpu, **changes)
        theirs = T.theirs(path, name, **changes)
        print(f"{row:<55} {T._diff(ours.frames, theirs):>27.2e}  {'+'.join(ours.kernels)}")


if __name__ == "__main__":
    main()
