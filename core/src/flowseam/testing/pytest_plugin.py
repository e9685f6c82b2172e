"""flowseam's pytest plugin: run tests once per flowseam backend.

Registered as the ``pytest11`` entry point ``flowseam`` of the ``flowseam`` distribution, so pytest
loads it in every run of an environment where flowseam is installed. Importing it is therefore
cheap (pytest and the standard library only): plugins are discovered, and torch imported, only
when a collected test asks for a backend. It adds the option ``--flowseam-backend``
(:func:`pytest_addoption`), the session fixtures ``flowseam_platform`` (a test that takes it runs
once per selected backend) and ``flowseam_registry``, the marker ``flowseam_cases`` for
backend-dependent cases (:func:`pytest_generate_tests`), and the conformance suite's expected
failures (:func:`pytest_collection_modifyitems`). For backend authors:
docs/writing-a-backend.md, section 6.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

#: The directory of the conformance suite; its tests get the backend's expected failures.
CONFORMANCE_DIR = Path(__file__).resolve().parent / "conformance"


@dataclass(frozen=True)
class BackendChoice:
    """One selected backend, usable or not.

    :ivar name: the plugin's entry-point name (the test id).
    :ivar status: ``available``, ``unavailable``, ``broken`` or ``blocked``.
    :ivar reason: why it is not available (empty when it is).
    :ivar record: its :class:`flowseam.seam.discovery.PluginRecord` (declarations: kernels,
        kinds, ...).
    """

    name: str
    status: str
    reason: str
    record: Any

    @property
    def usable(self) -> bool:
        return self.status == "available"

    @property
    def skip_reason(self) -> str:
        return f"flowseam backend {self.name!r} is {self.status}: {self.reason or self.status}"


@dataclass
class _State:
    """The plugin's per-session state (in ``config.stash``)."""

    registry: Any
    choices: dict[str, BackendChoice]
    platforms: dict[str, Any] = field(default_factory=dict)
    expectations: dict[str, Any] = field(default_factory=dict)


_STATE = pytest.StashKey[_State]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--flowseam-backend NAME`` (repeatable, or comma-separated): the backends to test, by
    plugin (entry-point) name, as ``flowseam backends`` lists them. Default: every installed
    backend, in detection order (priority, then name). A name that is not installed is a usage
    error."""
    group = parser.getgroup("flowseam", "flowseam backends")
    group.addoption(
        "--flowseam-backend", action="append", dest="flowseam_backends", default=None,
        metavar="NAME",
        help="run tests that use the flowseam_platform fixture (and flowseam's conformance "
             "suite) against this backend; repeatable or comma-separated; default: every "
             "installed backend")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "flowseam_cases(cases=fn, empty=''): parametrize a flowseam_platform test "
                   "with backend-dependent cases; fn(backend) yields (id, value) pairs passed as "
                   "flowseam_case")


def _requested(config: pytest.Config) -> list[str]:
    raw = config.getoption("flowseam_backends", default=None) or []
    return list(dict.fromkeys(n.strip() for item in raw for n in item.split(",") if n.strip()))


def _state(config: pytest.Config) -> _State:
    """Scan the plugins and resolve the selection, once per session."""
    state = config.stash.get(_STATE, None)
    if state is not None:
        return state
    from flowseam.errors import PluginLoadError
    from flowseam.seam.discovery import scan

    try:
        registry = scan()
    except PluginLoadError as exc:  # strict mode
        raise pytest.UsageError(f"flowseam: {exc}") from None
    installed = [r.name for r in registry.backends()]
    names = _requested(config) or installed
    choices = {}
    for name in names:
        rec = registry.records.get(name)
        if rec is None or (rec.backend is None and rec.status in ("available", "unavailable")):
            what = "is not installed" if rec is None else "is a plugin but not a backend"
            raise pytest.UsageError(
                f"--flowseam-backend {name!r}: that flowseam backend {what}; installed backends: "
                f"{', '.join(installed) or 'none'} (`flowseam backends` lists them with their "
                "status)")
        choices[name] = BackendChoice(name, rec.status, rec.reason, rec)
    state = _State(registry=registry, choices=choices)
    config.stash[_STATE] = state
    return state


def selected_backends(config: pytest.Config) -> list[BackendChoice]:
    """The backends this session tests, in order (scans the plugins on first use)."""
    return list(_state(config).choices.values())


def platform_for(config: pytest.Config, name: str) -> Any:
    """The session's :class:`flowseam.Platform` for backend ``name``; skips the calling test when
    the backend is not usable."""
    state = _state(config)
    choice = state.choices.get(name)
    if choice is None:
        raise pytest.UsageError(f"flowseam backend {name!r} was not selected; selected: "
                                f"{', '.join(state.choices) or 'none'}")
    if not choice.usable:
        pytest.skip(choice.skip_reason)
    if name not in state.platforms:
        from flowseam.seam.platform import Platform

        state.platforms[name] = Platform(name, registry=state.registry)
    return state.platforms[name]


def backend_expectations(config: pytest.Config, name: str) -> Any:
    """The resolved conformance expectations of backend ``name`` (cached per session), see
    :func:`flowseam.testing.conformance.expectations.resolve`."""
    state = _state(config)
    if name not in state.expectations:
        from .conformance.expectations import resolve

        state.expectations[name] = resolve(state.choices[name].record, state.registry)
    return state.expectations[name]


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def flowseam_registry(request: pytest.FixtureRequest) -> Any:
    """The :class:`flowseam.seam.discovery.PluginRegistry` the session's backends were chosen
    from: its own scan, honouring ``FLOWSEAM_PLUGINS`` / ``FLOWSEAM_DISABLE_PLUGINS`` (the
    process-wide :func:`flowseam.discover` cache is not touched)."""
    return _state(request.config).registry


@pytest.fixture(scope="session")
def flowseam_platform(request: pytest.FixtureRequest) -> Any:
    """A :class:`flowseam.Platform` for one selected backend (the test's id says which).

    Every test that uses it, directly or through another fixture, is parametrized over the
    selected backends, with the backend name as its id (``test_generate[accel]``). A selected
    backend that is unavailable, broken or blocked is skipped with its reason; set
    ``FLOWSEAM_STRICT=1`` to make a broken plugin an error instead."""
    name = getattr(request, "param", None)
    if name is None:
        raise pytest.UsageError("flowseam_platform is parametrized by flowseam's pytest plugin; "
                                "do not call it outside a test collected by pytest")
    return platform_for(request.config, name)


@pytest.fixture
def flowseam_case() -> Any:
    raise pytest.UsageError("flowseam_case is only set by @pytest.mark.flowseam_cases(cases) on a "
                            "test that also takes flowseam_platform")


# -- parametrization ---------------------------------------------------------------------------

def _explicitly_parametrized(metafunc: pytest.Metafunc) -> bool:
    for mark in metafunc.definition.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if "flowseam_platform" in names:
            return True
    return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test that takes ``flowseam_platform`` over the selected backends.

    With ``@pytest.mark.flowseam_cases(cases=fn, empty="...")`` the test also takes
    ``flowseam_case``: ``fn(backend: BackendChoice)`` yields ``(id, value)`` pairs, each one test
    with the id ``<backend>-<id>``; a usable backend with no cases gets one skipped test saying
    ``empty``. The conformance suite uses it for "every kernel this backend registers". Pass
    ``fn`` by keyword: a marker called with a lone function would decorate that function."""
    if "flowseam_platform" not in metafunc.fixturenames or _explicitly_parametrized(metafunc):
        return
    choices = selected_backends(metafunc.config)
    marker = metafunc.definition.get_closest_marker("flowseam_cases")
    if marker is None:
        params = [pytest.param(c.name, id=c.name,
                               marks=() if c.usable else pytest.mark.skip(reason=c.skip_reason))
                  for c in choices]
        metafunc.parametrize("flowseam_platform", params, indirect=True, scope="session")
        return
    cases: Callable[[BackendChoice], Iterable[tuple[str, Any]]] | None = (
        marker.kwargs.get("cases") or (marker.args[0] if marker.args else None))
    if not callable(cases):
        raise pytest.UsageError(f"{metafunc.definition.nodeid}: @pytest.mark.flowseam_cases needs "
                                "cases=<function of the backend yielding (id, value) pairs>")
    empty = marker.kwargs.get("empty", "it has nothing this test checks")
    params = []
    for c in choices:
        if not c.usable:
            params.append(pytest.param(c.name, None, id=c.name,
                                       marks=pytest.mark.skip(reason=c.skip_reason)))
            continue
        found = [pytest.param(c.name, value, id=f"{c.name}-{case_id}")
                 for case_id, value in cases(c)]
        params += found or [pytest.param(c.name, None, id=c.name, marks=pytest.mark.skip(
            reason=f"nothing to check for flowseam backend {c.name!r}: {empty}"))]
    metafunc.parametrize(("flowseam_platform", "flowseam_case"), params,
                         indirect=["flowseam_platform"], scope="session")


# -- expected failures of the conformance suite ------------------------------------------------

def _backend_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("flowseam_platform") if callspec is not None else None


def _in_conformance_suite(item: pytest.Item) -> bool:
    try:
        return Path(str(item.path)).resolve().is_relative_to(CONFORMANCE_DIR)
    except (OSError, ValueError):
        return False


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselect: entries match against every test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the conformance suite's tests (:mod:`flowseam.testing.conformance`) listed in their
    backend's expected-failures file ``xfail(strict=True)``: they must fail, and an unexpected
    pass fails the run. An entry that matches no collected test is a warning."""
    by_backend: dict[str, list[pytest.Item]] = {}
    for item in items:
        name = _backend_of(item)
        if name is not None and _in_conformance_suite(item):
            by_backend.setdefault(name, []).append(item)
    for name, its in by_backend.items():
        state = _state(config)
        if name not in state.choices or not state.choices[name].usable:
            continue
        try:
            expectations = backend_expectations(config, name)
        except Exception as exc:  # a mistake in the hook or the file fails the run, loudly
            raise pytest.UsageError(f"flowseam backend {name!r}: bad conformance expectations "
                                    f"({type(exc).__name__}): {exc}") from None
        for entry in expectations.mark_expected_failures(its):
            warnings.warn(pytest.PytestWarning(
                f"{entry.where}: expected failure {entry.pattern!r} of flowseam backend {name!r} "
                "matches no collected conformance test (stale entry, or a test id of another "
                "host?)"), stacklevel=1)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not _requested(config):  # keep unrelated pytest runs free of plugin discovery
        return None
    lines = []
    for c in selected_backends(config):
        rec = c.record
        where = f"{rec.distribution} {rec.version}" if rec is not None else "?"
        lines.append(f"flowseam backend {c.name} ({where}): {c.status}"
                     + (f" — {c.reason}" if c.reason else ""))
    return lines
