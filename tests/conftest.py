"""Shared fixtures: real plugin packages installed into a scratch ``--target`` directory, and a
context manager that puts them on ``sys.path`` and rediscovers plugins."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
PLUGIN_FIXTURES = sorted(p for p in (FIXTURES / "plugins").iterdir() if (p / "pyproject.toml").is_file())


def pip_install_target(packages: list[Path], target: Path) -> None:
    """``pip install --no-deps --no-build-isolation --target`` real packages (their dist-info
    and entry points included) into ``target``: built by the test environment's setuptools and
    installed with uv where the environment has it (scripts/setup-venv installs it; about half
    of pip's CPU seconds for the plugin fixtures), built afresh every time
    (``--no-cache``: uv would otherwise serve a fixture whose source changed from its cache) and
    offline; else with pip."""
    uv = Path(sys.executable).with_name("uv")
    if uv.is_file():
        installer = [str(uv), "pip", "install", "--python", sys.executable, "--no-cache", "--offline"]
    else:
        installer = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run(
        [*installer, "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target),
         *map(str, packages)],
        check=True, capture_output=True, text=True)


@pytest.fixture(scope="session")
def fixture_plugins_dir(tmp_path_factory) -> Path:
    """A directory holding every test plugin package of tests/fixtures/plugins, installed."""
    target = tmp_path_factory.mktemp("fixture-plugins")
    pip_install_target(PLUGIN_FIXTURES, target)
    return target


#: Plugin packages that must not share a target with the others (they hang, exit, or claim the
#: name 'cpu'): each is installed alone, on demand, by :func:`isolated_plugin`.
ISOLATED_FIXTURES = FIXTURES / "plugins" / "isolated"


@pytest.fixture(scope="session")
def isolated_plugin(tmp_path_factory):
    """``isolated_plugin("flowseam-fixture-hostile")`` → a target directory holding only that
    package of tests/fixtures/plugins/isolated, pip-installed (once per session)."""
    installed: dict[str, Path] = {}

    def install(name: str) -> Path:
        if name not in installed:
            target = tmp_path_factory.mktemp(name)
            pip_install_target([ISOLATED_FIXTURES / name], target)
            installed[name] = target
        return installed[name]

    return install


@contextlib.contextmanager
def plugin_env(path: Path | None = None, **env: str | None):
    """Put an install target on sys.path, set FLOWSEAM_* variables, rediscover; undo on exit."""
    import flowseam.seam.discovery

    with _path_and_env(path, **env):
        yield flowseam.seam.discovery.discover(refresh=True)


@contextlib.contextmanager
def _path_and_env(path: Path | None = None, **env: str | None):
    """Put an install target on sys.path and set FLOWSEAM_* variables, with no plugins
    discovered yet (the next :func:`flowseam.seam.discovery.discover` finds them); undo on exit."""
    import flowseam.seam.discovery

    saved_env = {k: os.environ.get(k) for k in env}
    saved_path = list(sys.path)
    try:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if path is not None:
            sys.path.insert(0, str(path))
        flowseam.seam.discovery._CACHE = None
        yield
    finally:
        sys.path[:] = saved_path
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        flowseam.seam.discovery._CACHE = None


def run_cli(*args: str, path: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run ``python -m flowseam ARGS`` in a subprocess with extra sys.path entries and env.

    Like the tests themselves (:func:`_clean_flowseam_env`), the subprocess sees no FLOWSEAM_*
    variable but FLOWSEAM_DISABLE_PLUGINS, so the blocked-backend pass blocks its backends too."""
    full = {k: v for k, v in os.environ.items()
            if not k.startswith("FLOWSEAM_") or k == "FLOWSEAM_DISABLE_PLUGINS"}
    full.update(env)
    if path is not None:
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), full.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "flowseam", *args], capture_output=True,
                          text=True, env=full, timeout=300)


#: the helper scripts tests run as ranks under torchrun
HELPERS = Path(__file__).parent / "helpers"


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 600) -> None:
    """Run ``tests/helpers/SCRIPT ARGS`` as ``nproc`` ranks of one ``torchrun --standalone``
    job (gloo, one torch thread a rank, no FLOWSEAM_* variable); fail the test, with the ranks'
    stderr, if the job fails."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWSEAM_")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={nproc}", str(HELPERS / script), *map(str, args)],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any component is built: a refusal must come before the weights load."""
    import flowseam

    def refuse(*args, **kwargs):
        raise AssertionError("a component was built before the request was refused")

    monkeypatch.setattr(flowseam.Platform, "build_component", refuse)


@pytest.fixture(autouse=True)
def _clean_flowseam_env(monkeypatch):
    """Tests start from the environment's real plugins with no FLOWSEAM_* variables set,
    except FLOWSEAM_DISABLE_PLUGINS, which .ci/run uses for the blocked-backends pass."""
    for k in list(os.environ):
        if k.startswith("FLOWSEAM_") and k != "FLOWSEAM_DISABLE_PLUGINS":
            monkeypatch.delenv(k)
    yield


@pytest.fixture(autouse=True)
def _notices_restored():
    """Every test leaves flowseam's notices (:func:`flowseam.notices.enable_notices`) as it
    found them: off, the library default.

    Tests that call :func:`flowseam.cli.main` in this process (test_demo, test_cli, test_serve,
    test_ltx2) turn them on, as the command does for its own process, and left them on; a later
    test then announced what it compiled, and accel announces a signature once per process, so
    test_accel's notice test found its DiT signature already announced (after test_demo ran
    first). Decision: restore here, once for every in-process ``main`` call now and later,
    rather than in each caller, or by giving the accel test shapes no other test uses (a fresh
    compile on every run, and the next leak would still go unnoticed)."""
    from flowseam.seam import notices

    saved = notices.notices_enabled()
    yield
    notices.enable_notices(saved)


def run_main(*args: str, path: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """``flowseam ARGS`` in this process: :func:`flowseam.cli.main` (the code behind the console
    script and ``python -m flowseam``), with ``path`` on sys.path and ``env`` set as :func:`run_cli`
    gets them, the plugins discovered afresh by the command itself (a discovery error is its
    error), at no interpreter start and torch import.

    What a process would print comes back as it would: stdout and stderr (warnings formatted
    onto stderr as the interpreter prints them), the exit status of ``main`` or of a
    ``SystemExit`` (argparse's errors, ``--help``), and an uncaught exception as a traceback on
    stderr with status 1. The global state the command sets (notices, diffusers'/transformers'
    verbosity and bars, torch's thread count) is restored afterwards. Use :func:`run_cli` where
    the process itself is what is tested (its exit, a closed pipe, the console script)."""
    import io
    import traceback
    import warnings

    import diffusers
    import torch
    import transformers

    from flowseam import cli
    from flowseam.seam import notices

    out, err = io.StringIO(), io.StringIO()
    libs = (diffusers.utils.logging, transformers.utils.logging)
    saved = ([(lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs],
             notices.notices_enabled(), torch.get_num_threads())
    try:
        with _path_and_env(path, **env), warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("default")
            try:
                status = cli.main(list(args))
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                status = 1
        for w in caught:
            err.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line))
    finally:
        for lib, (level, bars) in zip(libs, saved[0]):
            lib.set_verbosity(level)
            (lib.enable_progress_bar if bars else lib.disable_progress_bar)()
        notices.enable_notices(saved[1])
        torch.set_num_threads(saved[2])
    return subprocess.CompletedProcess(["flowseam", *args], status, out.getvalue(), err.getvalue())
