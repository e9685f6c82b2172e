"""The command line as a newcomer meets it: --version, help without markup, the backends table
in 100 columns (and its long form, and another backend's platform), quiet pipes, the hookspec
docstrings a backend author reads."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import plugin_env, run_cli, run_main

import flowseam
from flowseam.cli import build_parser


def test_version_names_flowseam_and_its_installed_plugins():
    r = run_cli("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"flowseam {metadata.version('flowseam')}")
    assert f"flowseam-cpu {metadata.version('flowseam-cpu')}" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 1


def _help_texts(parser) -> list[str]:
    """--help of the parser and of every subcommand, formatted as argparse prints them."""
    texts = [parser.format_help()]
    for action in parser._actions:
        for sub in getattr(action, "choices", None) and action.choices.values() or []:
            texts.append(sub.format_help())
    return texts


def test_help_has_no_rst_markup_and_names_every_command():
    texts = _help_texts(build_parser())
    assert len(texts) >= 5  # flowseam, backends, generate, train, demo, ...
    for text in texts:
        assert "``" not in text and ":param" not in text, text
    for command in ("backends", "generate", "train", "demo", "models"):
        assert command in texts[0]


@pytest.mark.backends
def test_backends_table_fits_100_columns_with_rewards_in_their_own_column():
    r = run_main("backends")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    too_wide = [line for line in lines if len(line) > 100]
    assert not too_wide, too_wide
    header = next(line for line in lines if line.startswith("plugin "))
    assert header.split() == ["plugin", "distribution", "version", "status", "methods", "rewards"]
    methods_row = next(line for line in lines if line.startswith("methods "))
    rewards_at = header.index("rewards")
    assert "brightness" in methods_row[rewards_at:] and "flowgrpo" in methods_row[:rewards_at]
    # the long form: every op at its arch rung, the implementation ids
    long = run_main("backends", "-v")
    assert long.returncode == 0, long.stderr
    assert re.search(r"\w+:flow_match_step:\w+:\S+:flowseam-\w+==", long.stdout)
    assert "flow_sde_step@generic" in long.stdout  # op@arch, as --json lists them
    assert "impl_id" in long.stdout and "impl_id" not in r.stdout


@pytest.mark.backends
def test_backends_shows_the_platform_of_a_named_backend():
    r = run_main("backends", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    assert "Platform: backend 'cpu'" in r.stdout
    assert re.search(r"^cpu +flowseam-cpu +\S+ +active", r.stdout, flags=re.M)
    bad = run_main("backends", "--backend", "tpu9000")
    assert bad.returncode == 2 and "unknown flowseam backend 'tpu9000'" in bad.stderr
    assert "Traceback" not in bad.stderr
    # one line naming the option; the table of backends is flowseam backends' job
    assert bad.stderr.strip().count("\n") == 0 and "--backend" in bad.stderr, bad.stderr


def test_a_closed_pipe_ends_the_command_quietly():
    """flowseam backends --json | head: the reader goes away before flowseam writes."""
    proc = subprocess.Popen([sys.executable, "-m", "flowseam", "backends", "--json", "-v"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before discovery is done, so every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 0, err
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err


@pytest.mark.backends
def test_explain_columns_stay_apart_for_a_long_arch_rung(fixture_plugins_dir):
    """The op table sizes its columns to their contents: a long device/arch never runs into
    the plugin column; the component table names each component's dtype."""
    long_arch = "tdv1-with-a-rather-long-rung-name"
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a") as reg:
        rec = reg.records["testdev_a"]
        rec.arch_chain = (long_arch, "tdv1", "generic")
        rec.kernels = [dataclasses.replace(k, arch=long_arch) if k.arch == "tdv1" else k
                       for k in rec.kernels]
        platform = flowseam.Platform("testdev_a", registry=reg)
        text = platform.explain()
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    row = next(line for line in lines if line.startswith("flow_match_step"))
    at = header.index("plugin")
    assert f"testdev/{long_arch}" in row and row[at - 2:at] == "  " and row[at:].startswith("testdev_a")
    assert max(len(line) for line in lines) <= 100


def test_hookspec_docstrings_start_with_one_whole_sentence():
    """Each hook's docstring opens with its summary (a sentence ending in a period) before the
    ``firstresult`` line, as pytest's hookspecs do."""
    from flowseam.seam import hookspecs

    for name in dir(hookspecs):
        if not name.startswith("flowseam_"):
            continue
        doc = getattr(hookspecs, name).__doc__
        summary = doc.split("\n\n")[0]
        assert "firstresult" not in summary, name
        assert summary.rstrip().endswith("."), (name, summary)


def test_train_help_lists_the_registered_methods_and_how_to_see_their_config(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for name in ("finetune", "flowgrpo", "workflow_rl"):
        assert re.search(rf"^  {name} +\S", text, flags=re.M), text
    assert "--show-config" in text and "``" not in text


@pytest.mark.parametrize("name", ["flowgrpo", "workflow_rl", "finetune", "unified_rl", "joint_multi_rl"])
def test_show_config_prints_every_key_with_its_default_as_toml(name, capsys):
    import tomllib

    from flowseam.cli import main
    from flowseam.training import get_method

    assert main(["train", "--method", name, "--show-config"]) == 0
    text = capsys.readouterr().out
    parsed = tomllib.loads(text)  # a valid config to start from
    defaults = get_method(name).default_config()

    def without_none(d):
        return {k: without_none(v) if isinstance(v, dict) else v for k, v in d.items()
                if v is not None}

    assert parsed == without_none(defaults)
    for key, value in defaults.items():  # no default: shown commented out
        if value is None:
            assert f"\n# {key} =" in text, key
    assert "steps = " in text and "[optim]" in text


def test_show_config_of_an_unknown_method_lists_the_registered_ones(capsys):
    from flowseam.cli import main

    assert main(["train", "--method", "nosuch", "--show-config"]) == 2
    assert "registered methods" in capsys.readouterr().err


def test_load_and_tiny_checkpoints_keep_the_libraries_quiet_unless_verbose(tmp_path, capfd):
    """No weight-loading bars, shard-writing bars or "experimental feature" notices from
    diffusers and transformers unless asked; the program's own library settings survive."""
    import diffusers
    import transformers

    from flowseam.testing.tiny import write_tiny_checkpoint

    libs = (diffusers.utils.logging, transformers.utils.logging)
    saved = [(lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs]
    try:
        for lib in libs:  # the libraries' own defaults, as a fresh program has them
            lib.set_verbosity_warning()
            lib.enable_progress_bar()
        capfd.readouterr()
        path = write_tiny_checkpoint("wan2.1-i2v", tmp_path / "quiet")
        flowseam.load(path, platform=flowseam.Platform("cpu"))
        quiet = capfd.readouterr()
        # flowseam's own load line (the solver and where its settings came from), nothing else
        lines = quiet.err.splitlines()
        assert quiet.out == "" and len(lines) == 1 and lines[0].startswith(
            "flowseam: loaded wan2.1-i2v from "), quiet.err
        flowseam.load(path, platform=flowseam.Platform("cpu"), quiet=True)
        assert capfd.readouterr() == ("", "")
        assert [(lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs] == \
            [(30, True), (30, True)]  # WARNING and bars on again: restored
        write_tiny_checkpoint("wan2.1-i2v", tmp_path / "loud", verbose=True)
        flowseam.load(tmp_path / "loud", platform=flowseam.Platform("cpu"), verbose=True)
        loud = capfd.readouterr().err
        assert "Writing model shards" in loud or "Loading weights" in loud, loud
    finally:
        for lib, (level, bars) in zip(libs, saved):
            lib.set_verbosity(level)
            (lib.enable_progress_bar if bars else lib.disable_progress_bar)()


def test_dir_and_help_show_the_lazy_public_names():
    import pydoc

    names = dir(flowseam)
    for name in ("load", "run_loop", "rollout_loop", "ExecutionProfile", "Platform", "DiffusionParams"):
        assert name in names and name in flowseam.__all__
    text = pydoc.render_doc(flowseam, renderer=pydoc.plaintext)
    for name in ("load(", "run_loop(", "rollout_loop("):
        assert name in text


def test_the_console_script_runs_the_package_main():
    from flowseam import cli

    (script,) = metadata.entry_points(group="console_scripts", name="flowseam")
    assert script.value == "flowseam.cli:main" and script.load() is cli.main


@pytest.mark.parametrize("error,status,first", [
    (MemoryError(), 1, "flowseam: out of memory: MemoryError (the request needs more memory"),
    (OSError(28, "No space left on device"), 1, "Traceback (most recent call last):"),
], ids=["out of memory", "OSError"])
def test_the_machine_refusing_is_neither_bad_input_nor_a_bug(monkeypatch, error, status, first):
    """Out of memory: one line, exit 1; an operating-system error: the traceback and a line
    naming it, exit 1; neither is called bad input (exit 2) or a bug."""
    def detect(cls, *args, **kwargs):  # the platform flowseam backends shows
        raise error

    monkeypatch.setattr(flowseam.Platform, "detect", classmethod(detect))
    r = run_main("backends")
    assert r.returncode == status, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith(first), r.stderr
    if isinstance(error, OSError):
        assert lines[-1] == ("flowseam: system error: [Errno 28] No space left on device (the "
                             "operating system refused; the traceback above shows what flowseam "
                             "was doing)"), r.stderr
    else:
        assert len(lines) == 1, r.stderr
    assert "internal error" not in r.stderr and "flowseam: error:" not in r.stderr


def test_a_config_schema_error_is_bad_input_naming_the_field(tmp_path, monkeypatch):
    """A training method that validates its config with its own pydantic model (not flowseam's
    validate_config): pydantic's ValidationError is bad input, one line naming the field and the
    value; a valid value runs the method."""
    import pydantic

    from flowseam.cli import train
    from flowseam.seam import TrainingMethod
    from flowseam.seam.discovery import PluginRecord

    class Config(pydantic.BaseModel):
        steps: int

    class CountingMethod(TrainingMethod):
        """Counts its steps."""

        name = "counting"

        def __init__(self, config):
            self.steps = Config.model_validate(config).steps

        def run(self, progress=False):
            return {"steps": self.steps, "records": [{"step": s} for s in range(self.steps)]}

    record = PluginRecord(name="tests", value="test_cli:CountingMethod", distribution="tests",
                          version="0")
    monkeypatch.setattr(train, "resolve_method", lambda name: (record, CountingMethod))
    config = tmp_path / "counting.toml"
    config.write_text('steps = "many"\n')
    argv = ["train", "--method", "counting", "--config", str(config), "--output-dir", str(tmp_path)]
    bad = run_main(*argv)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.splitlines() == ["flowseam: error: Config: steps='many': Input should be a "
                                       "valid integer, unable to parse string as an integer"]
    ok = run_main(*argv, "--set", "steps=3")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("counting: 3 steps; last: {'step': 2}"), ok.stdout
