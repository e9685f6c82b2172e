"""Writing outputs (PNG, MP4, GIF; atomically) and ``flowseam generate``."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli, run_main
from PIL import Image

from flowseam import media
from flowseam.errors import InvalidParameterError
from flowseam.testing.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-ckpt")
    return {c: write_tiny_checkpoint(c, root / c) for c in ("wan2.1-t2v", "wan2.1-i2v", "flux.1-t2i")}


def _frames(f=5, h=32, w=32, seed=0):
    return np.random.RandomState(seed).rand(f, h, w, 3).astype(np.float32)


def test_png_roundtrip_and_mode(tmp_path):
    img = _frames(1)[0]
    out = media.write_output(tmp_path / "a.png", img[None])
    back = np.asarray(Image.open(out)).astype(np.float32) / 255
    assert np.abs(back - img).max() <= 0.5 / 255 + 1e-6
    assert (out.stat().st_mode & 0o777) != 0o600


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_video_has_every_frame(tmp_path, suffix):
    import imageio.v3 as iio

    frames = _frames(9, 32, 48)
    out = media.write_output(tmp_path / f"v{suffix}", frames)
    data = iio.imread(out)
    assert data.shape[0] == 9 and data.shape[1:3] == (32, 48)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(imageio, "mimsave", broken)
    with pytest.raises(OSError, match="disk full"):
        media.write_output(tmp_path / "v.gif", _frames())
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unsupported suffix '.txt'"):
        media.write_output(tmp_path / "v.txt", _frames())
    with pytest.raises(ValueError, match="a PNG holds one frame, got 5"):
        media.write_output(tmp_path / "v.png", _frames())
    assert list(tmp_path.iterdir()) == []


def test_generate_video_and_summary_line(ckpts, tmp_path):
    out = tmp_path / "clip.mp4"
    r = run_main("generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "a cat", "--steps", "2",
                 "--frames", "5", "--height", "32", "--width", "32", "--backend", "cpu",
                 "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert out.is_file()
    assert len(r.stdout.strip().splitlines()) == 1  # one summary line
    assert "wrote" in r.stdout and " s" in r.stdout
    assert "transformer=cpu/cpu" in r.stdout and "flow_match_step=cpu:flow_match_step" in r.stdout


def test_generate_workflow_writes_a_gif(ckpts, tmp_path):
    out = tmp_path / "wf.gif"
    r = run_main("generate", "--workflow", "t2i-i2v", "--model", str(ckpts["flux.1-t2i"]),
                 "--model", str(ckpts["wan2.1-i2v"]), "--prompt", "a dog", "--steps", "2",
                 "--frames", "5", "--height", "32", "--width", "32", "--backend", "cpu",
                 "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert out.is_file() and "[flux.1-t2i]" in r.stdout and "[wan2.1-i2v]" in r.stdout


@pytest.mark.parametrize("args,match", [
    (["--frames", "6"], "--frames=6 is not of the form 4k+1"),  # the flag, not num_frames=
    (["--output-suffix", ".txt"], "unsupported suffix '.txt'"),
    (["--image", "/nonexistent.png"], "does not exist"),
    (["--backend", "nosuch"], "unknown flowseam backend 'nosuch'"),
    (["--model2"], "give one --model"),
])
def test_generate_bad_input_exits_nonzero_without_output(ckpts, tmp_path, args, match):
    out = tmp_path / "x.mp4"
    argv = ["generate", "--model", str(ckpts["wan2.1-t2v"]), "--prompt", "a", "--steps", "1",
            "--height", "32", "--width", "32", "--output", str(out)]
    if args == ["--output-suffix", ".txt"]:
        argv[-1] = str(tmp_path / "x.txt")
    elif args == ["--model2"]:
        argv += ["--model", str(ckpts["wan2.1-t2v"])]
    else:
        argv += args
    if "--frames" not in argv:
        argv += ["--frames", "5"]
    # in this process; the real `flowseam generate` process's exit status and single error line
    # are test_hostile_inputs.py::test_the_flowseam_process_exits_with_one_error_line
    r = run_main(*argv)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_generate_errors_use_the_commands_words_before_any_model_loads(ckpts, tmp_path, capsys):
    from flowseam.cli import main

    out = tmp_path / "x.gif"
    common = ["--prompt", "a dog", "--backend", "cpu", "--output", str(out)]
    assert main(["generate", "--model", str(ckpts["wan2.1-i2v"])] + common) == 2
    err = capsys.readouterr().err
    assert "--image is required" in err and "image=" not in err
    image = tmp_path / "first.png"
    media.write_output(image, _frames(1)[0][None])
    assert main(["generate", "--model", str(ckpts["wan2.1-t2v"]), "--image", str(image)] + common) == 2
    assert "--image: " in capsys.readouterr().err
    assert main(["generate", "--model", str(ckpts["flux.1-t2i"]), "--negative-prompt", "x",
                 "--height", "32", "--width", "32", "--steps", "1"] + common[:-1] + [str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "flowseam: error: --negative-prompt is not supported" in err, err  # before any step
    assert not out.exists() and not (tmp_path / "x.png").exists()


def _t2i_argv(ckpts, out, *extra):
    return ["generate", "--model", str(ckpts["flux.1-t2i"]), "--prompt", "a dog", "--steps", "1",
            "--height", "32", "--width", "32", "--backend", "cpu", "--output", str(out), *extra]


def test_the_process_names_the_bad_option_on_one_line_and_exits_2(ckpts, tmp_path):
    """The real ``python -m flowseam`` process: exit 2 and exactly one stderr line naming the
    option; the same command line with a valid value writes the image (in this process)."""
    out = tmp_path / "x.png"
    r = run_cli(*_t2i_argv(ckpts, out, "--steps", "0"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == ["flowseam: error: --steps=0 must be an integer >= 1"], r.stderr
    assert not out.exists()
    ok = run_main(*_t2i_argv(ckpts, out))
    assert ok.returncode == 0 and out.is_file(), ok.stderr


@pytest.mark.parametrize("error,status,line", [
    (ValueError("this request needs 3 GiB"), 1,
     "flowseam: internal error (a bug in flowseam or in one of its plugins, not in your "
     "input): ValueError: this request needs 3 GiB. Please report it"),
    (RuntimeError("expected scalar type Float but found Double"), 1,
     "flowseam: internal error (a bug in flowseam or in one of its plugins, not in your "
     "input): RuntimeError: expected scalar type Float but found Double. Please report it"),
    (InvalidParameterError("num_steps", "this request needs 3 GiB"), 2,
     "flowseam: error: --steps: this request needs 3 GiB"),
], ids=["ValueError", "RuntimeError", "InvalidParameterError"])
def test_a_bug_is_not_bad_input(ckpts, tmp_path, monkeypatch, error, status, line):
    """What decides is the error's class, not its message: a ``ValueError`` or ``RuntimeError``
    flowseam does not raise on purpose (torch's, or a mistake in flowseam) inside the command is
    a bug, exit 1 with the traceback and a line saying so (never "bad input" in the command's
    words); flowseam's own error with the same message is bad input, one line naming the option
    (``--steps`` for the field ``num_steps``)."""
    from flowseam import request

    def check_memory(params):  # the core check generate runs before any model loads
        raise error

    monkeypatch.setattr(request, "check_memory", check_memory)
    r = run_main(*_t2i_argv(ckpts, tmp_path / "x.png"))
    assert r.returncode == status, r.stderr
    lines = r.stderr.splitlines()
    assert lines[-1].startswith(line), r.stderr
    if status == 1:
        assert lines[0] == "Traceback (most recent call last):", r.stderr
        assert "in check_memory" in r.stderr  # the frame that raised
        assert "flowseam: error:" not in r.stderr
    else:
        assert lines == [line] and "Traceback" not in r.stderr
    assert not (tmp_path / "x.png").exists()
