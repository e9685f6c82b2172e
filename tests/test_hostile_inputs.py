"""Hostile and careless inputs to the command line: one row per input, run through the real CLI
(``flowseam.cli.main``, in this process) against real tiny checkpoints.

Every row must be *handled cleanly*: the exit status it names (2: bad input), a one-line
``flowseam: error:`` message containing every word the row lists, no traceback, no output file,
and no model component built (the input is refused before any model loads).

To add a case, add a :class:`Hostile` row to :data:`ROWS`. ``argv`` may use ``{placeholders}``:
``{t2v}``, ``{i2v}``, ``{flux}`` (tiny checkpoints), ``{out}`` (the output path the row must not
create), ``{tmp}`` (a scratch directory), and any file name of :data:`MAKERS` (built on demand,
e.g. ``{truncated.png}``). A training row gives ``config`` (a method name and the keys that
replace those of that method's valid base config) or ``config_text`` (a YAML file, verbatim);
``{config}`` in ``argv`` is that file.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import yaml
from PIL import Image

import flowseam
from flowseam import cli
from flowseam.testing.tiny import write_tiny_checkpoint


@dataclass(frozen=True)
class Hostile:
    """One hostile input: what is given, the exit status, the words the message must contain."""

    area: str
    given: str
    argv: tuple[str, ...]
    words: tuple[str, ...]
    exit: int = 2
    config: tuple[str, dict[str, Any]] | None = None
    config_text: str | None = None

    @property
    def id(self) -> str:
        return f"{self.area}: {self.given}"


GEN_T2V = ("generate", "--model", "{t2v}", "--prompt", "a cat", "--steps", "1", "--frames", "5",
           "--height", "32", "--width", "32", "--output", "{out}.mp4")
GEN_I2V = ("generate", "--model", "{i2v}", "--prompt", "a cat", "--steps", "1", "--frames", "5",
           "--height", "32", "--width", "32", "--output", "{out}.mp4")
GEN_T2I = ("generate", "--model", "{flux}", "--prompt", "a cat", "--steps", "1", "--height", "32",
           "--width", "32", "--output", "{out}.png")
TRAIN = ("train", "--config", "{config}")

ROWS = [
    # -- numeric options of generate: finite and in range, before any model loads ---------------
    Hostile("numbers", "guidance NaN", GEN_T2V + ("--guidance", "nan"),
            ("--guidance=nan", "finite number")),
    Hostile("numbers", "guidance inf (Flux)", GEN_T2I + ("--guidance", "inf"),
            ("--guidance=inf", "finite number")),
    Hostile("numbers", "guidance negative", GEN_T2V + ("--guidance", "-2"),
            ("--guidance", ">= 0")),
    Hostile("numbers", "guidance-2 NaN", GEN_T2V + ("--guidance-2", "nan"),
            ("--guidance-2=nan", "finite number")),
    Hostile("numbers", "flow shift NaN", GEN_T2V + ("--flow-shift", "nan"),
            ("--flow-shift=nan",)),
    Hostile("numbers", "flow shift inf", GEN_T2V + ("--flow-shift", "inf"),
            ("--flow-shift=inf",)),
    Hostile("numbers", "flow shift 0", GEN_T2V + ("--flow-shift", "0"),
            ("--flow-shift", "> 0")),
    Hostile("numbers", "seed negative", GEN_T2V + ("--seed", "-1"),
            ("--seed=-1", ">= 0")),
    Hostile("numbers", "seed past the generator's range", GEN_T2V + ("--seed", str(2**64)),
            ("--seed", str(2**64), str(2**64 - 1))),
    Hostile("numbers", "fps 0", GEN_T2V + ("--fps", "0"), ("--fps=0.0", "> 0")),
    Hostile("numbers", "fps negative (GIF)", GEN_T2V[:-1] + ("{out}.gif", "--fps", "-4"),
            ("--fps", "> 0")),
    Hostile("numbers", "fps NaN", GEN_T2V + ("--fps", "nan"), ("--fps", "finite")),
    Hostile("numbers", "steps 0", GEN_T2V + ("--steps", "0"), ("--steps=0",)),
    Hostile("numbers", "steps not an integer", GEN_T2V + ("--steps", "1.5"),
            ("--steps", "invalid int value")),
    Hostile("numbers", "absurd steps", GEN_T2V + ("--steps", str(10**12)),
            ("--steps", "needs at least", "GiB of memory", "this machine has")),
    Hostile("numbers", "absurd size", GEN_T2I + ("--height", "200000", "--width", "200000"),
            ("--height", "needs at least", "GiB of memory")),
    Hostile("numbers", "absurd frame count", GEN_T2V + ("--frames", "400000001"),
            ("needs at least", "GiB of memory")),
    Hostile("numbers", "height 0", GEN_T2V + ("--height", "0"), ("--height=0",)),
    # -- images: refused before the model loads --------------------------------------------------
    Hostile("images", "missing image", GEN_I2V + ("--image", "{tmp}/nope.png"),
            ("nope.png", "does not exist")),
    Hostile("images", "truncated PNG", GEN_I2V + ("--image", "{truncated.png}"),
            ("truncated.png", "cannot be decoded", "truncated")),
    Hostile("images", "decompression bomb", GEN_I2V + ("--image", "{bomb.png}"),
            ("bomb.png", "pixel", "decompression bomb", "not decoded")),
    Hostile("images", "not an image", GEN_I2V + ("--image", "{text.png}"),
            ("text.png", "not an image")),
    Hostile("images", "32-bit float image", GEN_I2V + ("--image", "{float.tif}"),
            ("float.tif", "32-bit float", "white")),
    # -- checkpoints and output paths ------------------------------------------------------------
    Hostile("paths", "relative path with ./ that does not exist",
            ("generate", "--model", "./no-such-ckpt") + GEN_T2V[3:],
            ("directory", "no-such-ckpt", "does not exist")),
    Hostile("paths", "relative path under an existing folder", ("generate", "--model",
            "sub/no-such-ckpt") + GEN_T2V[3:], ("directory", "sub/no-such-ckpt", "does not exist")),
    Hostile("paths", "nested relative path", ("generate", "--model", "a/b/no-such-ckpt")
            + GEN_T2V[3:], ("directory", "a/b/no-such-ckpt", "does not exist")),
    Hostile("paths", "checkpoint is a file", ("generate", "--model", "{text.png}") + GEN_T2V[3:],
            ("is a file, not a directory",)),
    Hostile("paths", "output is a directory", GEN_T2V[:-1] + ("{folder.mp4}",), ("is a directory",)),
    Hostile("paths", "output folder not writable", GEN_T2V[:-1] + ("{text.png}/x.mp4",),
            ("cannot be written",)),
    Hostile("paths", "output suffix", GEN_T2V[:-1] + ("{out}.txt",), ("unsupported suffix '.txt'",)),
    # -- training configs: typed and range-checked before the model loads ------------------------
    Hostile("train config", "prompts is a string", TRAIN + ("--method", "flowgrpo"),
            ("prompts='a ball'", "valid list"), config=("flowgrpo", {"prompts": "a ball"})),
    Hostile("train config", "max_grad_norm = -1", TRAIN + ("--method", "flowgrpo"),
            ("[grpo] max_grad_norm=-1", "greater than 0"),
            config=("flowgrpo", {"grpo": {"max_grad_norm": -1}})),
    Hostile("train config", "adv_clip_max = -5", TRAIN + ("--method", "flowgrpo"),
            ("[grpo] adv_clip_max=-5", "greater than 0"),
            config=("flowgrpo", {"grpo": {"adv_clip_max": -5}})),
    Hostile("train config", "lr = inf", TRAIN + ("--method", "flowgrpo"),
            ("[optim] lr=inf", "finite number"), config=("flowgrpo", {"optim": {"lr": float("inf")}})),
    Hostile("train config", "steps = 1.5", TRAIN + ("--method", "flowgrpo"),
            ("steps=1.5", "valid integer"), config=("flowgrpo", {"steps": 1.5})),
    Hostile("train config", "steps = -1", TRAIN + ("--method", "flowgrpo"),
            ("steps=-1", "greater than or equal to 1"), config=("flowgrpo", {"steps": -1})),
    Hostile("train config", "checkpoint_every = -1", TRAIN + ("--method", "flowgrpo"),
            ("checkpoint_every=-1",), config=("flowgrpo", {"checkpoint_every": -1})),
    Hostile("train config", "beta = -1", TRAIN + ("--method", "flowgrpo"),
            ("[grpo] beta=-1", "greater than or equal to 0"),
            config=("flowgrpo", {"grpo": {"beta": -1}})),
    Hostile("train config", "group_size = 1", TRAIN + ("--method", "flowgrpo"),
            ("group_size=1",), config=("flowgrpo", {"group_size": 1})),
    Hostile("train config", "guidance NaN in [sampling]", TRAIN + ("--method", "flowgrpo"),
            ("[sampling] guidance_scale=nan", "finite"),
            config=("flowgrpo", {"sampling": {"guidance_scale": float("nan")}})),
    Hostile("train config", "sde_window out of order", TRAIN + ("--method", "flowgrpo"),
            ("sde_window",), config=("flowgrpo", {"sampling": {"sde_window": [2, 1]}})),
    Hostile("train config", "unknown key", TRAIN + ("--method", "flowgrpo"),
            ("[optim] has unknown key(s) ['learning_rate']", "allowed"),
            config=("flowgrpo", {"optim": {"learning_rate": 1e-3}})),
    Hostile("train config", "YAML reads 1e-4 as a string", TRAIN + ("--method", "flowgrpo"),
            ("[optim] lr='1e-4'", "valid number"),
            config_text="model: {flux}\nprompts: [a ball]\noutput_dir: {tmp}/run\noptim:\n  lr: 1e-4\n"),
    Hostile("train config", "--set steps=abc", TRAIN + ("--method", "flowgrpo", "--set", "steps=abc"),
            ("steps='abc'", "valid integer"), config=("flowgrpo", {})),
    Hostile("train config", "finetune p_uncond = 2", TRAIN + ("--method", "finetune"),
            ("[train] p_uncond=2", "less than or equal to 1"),
            config=("finetune", {"train": {"p_uncond": 2}})),
    Hostile("train config", "finetune sigma_sampling", TRAIN + ("--method", "finetune"),
            ("[train] sigma_sampling='normal'", "'logit_normal' or 'uniform'"),
            config=("finetune", {"train": {"sigma_sampling": "normal"}})),
    Hostile("train config", "finetune batch_size = 0", TRAIN + ("--method", "finetune"),
            ("batch_size=0",), config=("finetune", {"batch_size": 0})),
    Hostile("train config", "workflow_rl [t2i_optim] lr = 0", TRAIN + ("--method", "workflow_rl"),
            ("[t2i_optim] lr=0", "greater than 0"),
            config=("workflow_rl", {"t2i_optim": {"lr": 0}})),
    Hostile("train config", "joint_multi_rl [experts.transformer] lr = inf",
            TRAIN + ("--method", "joint_multi_rl"), ("[experts.transformer] lr=inf", "finite number"),
            config=("joint_multi_rl", {"experts": {"transformer": {"lr": float("inf")}}})),
    Hostile("train config", "joint_multi_rl [grpo] max_grad_norm = -1",
            TRAIN + ("--method", "joint_multi_rl"), ("[grpo] max_grad_norm=-1", "greater than 0"),
            config=("joint_multi_rl", {"grpo": {"max_grad_norm": -1}})),
    Hostile("train config", "unknown method", TRAIN + ("--method", "ppo"),
            ("unknown training method 'ppo'",), config=("flowgrpo", {})),
]

# -- files the rows use -------------------------------------------------------------------------


def png_bytes(pixels: np.ndarray, bit_depth: int, color_type: int, height: int | None = None,
              width: int | None = None, rows: Callable[[int], bytes] | None = None) -> bytes:
    """A PNG file written by hand (PNG spec: IHDR, one zlib IDAT, IEND), so a test can state
    bit depths and sizes PIL would not write."""
    h, w = (height, width) if height else pixels.shape[:2]
    dtype = ">u2" if bit_depth == 16 else "u1"
    raw = zlib.compressobj()
    data = b""
    for y in range(h):
        line = rows(y) if rows else pixels[y].astype(dtype).tobytes()
        data += raw.compress(b"\x00" + line)
    data += raw.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def _truncated(path: Path) -> None:
    Image.fromarray((np.random.RandomState(0).rand(64, 64, 3) * 255).astype(np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:600])


def _bomb(path: Path) -> None:
    # 30000 x 30000 1-bit greyscale (900 megapixels, 10x PIL's limit) in ~100 kB of zeros
    zero = bytes(30000 // 8)
    path.write_bytes(png_bytes(np.zeros((1, 1)), 1, 0, height=30000, width=30000, rows=lambda y: zero))


MAKERS: dict[str, Callable[[Path], None]] = {
    "truncated.png": _truncated,
    "bomb.png": _bomb,
    "text.png": lambda p: p.write_text("not a picture\n"),
    "float.tif": lambda p: Image.fromarray(np.random.RandomState(0).rand(16, 16).astype(np.float32)).save(p),
    "folder.mp4": lambda p: p.mkdir(),
    "sub": lambda p: p.mkdir(),
}

BASE_CONFIGS = {
    "flowgrpo": {"model": "{flux}", "prompts": ["a ball"], "group_size": 2, "steps": 1,
                 "output_dir": "{tmp}/run",
                 "sampling": {"num_steps": 2, "height": 32, "width": 32, "max_sequence_length": 16}},
    "finetune": {"model": "{flux}", "data": "{files}/data.jsonl", "steps": 1, "batch_size": 1,
                 "output_dir": "{tmp}/run"},
    "workflow_rl": {"t2i_model": "{flux}", "i2v_model": "{i2v}", "prompts": ["a ball"],
                    "group_size": 2, "steps": 1, "output_dir": "{tmp}/run"},
    "joint_multi_rl": {"model": "{t2v}", "prompts": ["a ball"], "group_size": 2, "steps": 1,
                       "output_dir": "{tmp}/run"},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-ckpt")
    return {"t2v": write_tiny_checkpoint("wan2.1-t2v", root / "t2v"),
            "i2v": write_tiny_checkpoint("wan2.1-i2v", root / "i2v"),
            "flux": write_tiny_checkpoint("flux.1-t2i", root / "flux")}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Every file of :data:`MAKERS`, and a one-example finetune dataset, built once."""
    root = tmp_path_factory.mktemp("hostile-files")
    for name, make in MAKERS.items():
        make(root / name)
    (root / "data.jsonl").write_text('{"prompt": "a ball", "image": "ball.png"}\n')
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(root / "ball.png")
    return root


@pytest.fixture()
def built(monkeypatch):
    """Every component a platform builds during the test (observed, then built as usual)."""
    seen: list[str] = []
    original = flowseam.Platform.build_component

    def observe(self, kind, spec):
        seen.append(f"{spec.name} ({kind})")
        return original(self, kind, spec)

    monkeypatch.setattr(flowseam.Platform, "build_component", observe)
    return seen


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _fill(value: Any, names: dict[str, str]) -> Any:
    """``value`` with every ``{name}`` replaced by ``names[name]`` (in strings, lists, dicts)."""
    if isinstance(value, str):
        for name, path in names.items():
            value = value.replace("{" + name + "}", path)
        return value
    if isinstance(value, dict):
        return {k: _fill(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, names) for v in value]
    return value


def row_argv(row: Hostile, ckpts: dict[str, Path], files: Path, tmp_path: Path) -> list[str]:
    """The row's command line, placeholders filled (and its config file written)."""
    names = {**{k: str(v) for k, v in ckpts.items()}, "out": str(tmp_path / "out" / "result"),
             "tmp": str(tmp_path), "files": str(files)}
    names.update({name: str(files / name) for name in MAKERS})
    if row.config is not None or row.config_text is not None:
        path = tmp_path / "config.yaml"
        if row.config_text is not None:
            path.write_text(_fill(row.config_text, names))
        else:
            method, over = row.config
            path.write_text(yaml.safe_dump(_fill(_merge(BASE_CONFIGS[method], over), names)))
        names["config"] = str(path)
    return [_fill(a, names) for a in row.argv]


def run_row(row: Hostile, ckpts: dict[str, Path], files: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    """Run the row's command line in this process (``flowseam.cli.main``: the same checks as
    the ``flowseam`` command, without starting a Python per row); return (exit status, stderr)."""
    argv = row_argv(row, ckpts, files, tmp_path)
    try:
        status = cli.main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        status = exc.code
    return status, capsys.readouterr().err


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_input_is_refused_cleanly(row, ckpts, files, tmp_path, capsys, built, monkeypatch):
    monkeypatch.chdir(files)  # relative --model paths resolve here ("sub/" exists)
    status, err = run_row(row, ckpts, files, tmp_path, capsys)
    assert status == row.exit, err
    for word in row.words:
        assert word in err, f"{word!r} not in: {err}"
    assert "Traceback" not in err
    assert built == [], f"a model was loaded before the input was refused: {built}"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


#: rows also run as a real ``python -m flowseam`` process: what the in-process rows cannot see —
#: the process's exit status, and stderr holding exactly one line (one row: every command reports
#: through the same ``flowseam.cli.main``, and a process start costs seconds)
SUBPROCESS_ROWS = ["numbers: guidance NaN"]


@pytest.mark.parametrize("row_id", SUBPROCESS_ROWS)
def test_the_flowseam_process_exits_with_one_error_line(row_id, ckpts, files, tmp_path):
    import subprocess
    import sys

    row = next(r for r in ROWS if r.id == row_id)
    argv = row_argv(row, ckpts, files, tmp_path)
    proc = subprocess.run([sys.executable, "-m", "flowseam", *argv], cwd=files, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == row.exit, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowseam: error: "), proc.stderr
    assert all(word in lines[0] for word in row.words), lines[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_table_covers_every_area():
    """The areas of issue 11's survey that the table exercises (the note reports the counts)."""
    areas = {r.area for r in ROWS}
    assert areas == {"numbers", "images", "paths", "train config"}
    assert len({r.id for r in ROWS}) == len(ROWS)
