"""Fixtures of the conformance suite.

``flowseam_platform`` (the backend under test) comes from flowseam's pytest plugin. Everything
expensive is built once per session: the tiny checkpoints, and one serve run per (backend, card)
that the component and loop tests share (a compiling backend compiles each graph once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from flowseam.testing.conformance._support import CARDS, Call, recording, request_for
from flowseam.testing.pytest_plugin import backend_expectations
from flowseam.testing.tiny import write_tiny_checkpoint


@dataclass
class Run:
    """A model loaded on one platform and its serve run of the card's standard request.

    :ivar calls: component name → the calls the loop made into it (backend runs only).
    """

    model: Any
    result: Any
    calls: dict[str, list[Call]] = field(default_factory=dict)


class Runs:
    """Loads each card once per platform and serves its standard request once (cached)."""

    def __init__(self, checkpoints: dict[str, Path], reference: Any) -> None:
        self.checkpoints = checkpoints
        self.reference_platform = reference
        self._runs: dict[tuple[int, str], Run] = {}

    def _run(self, platform: Any, card: str, record: bool) -> Run:
        key = (id(platform), card)
        if key not in self._runs:
            import flowseam

            model = flowseam.load(self.checkpoints[card], platform=platform)
            calls: dict[str, list[Call]] = {}
            if record:
                with recording(model) as calls:
                    result = flowseam.run_loop(model, request_for(card))
            else:
                result = flowseam.run_loop(model, request_for(card))
            self._runs[key] = Run(model, result, calls)
        return self._runs[key]

    def reference(self, card: str) -> Run:
        """``card`` on the cpu backend: the reference builds and outputs."""
        return self._run(self.reference_platform, card, record=False)

    def backend(self, platform: Any, card: str) -> Run:
        """``card`` on the backend under test, with the calls into its components recorded."""
        return self._run(platform, card, record=True)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random checkpoint of every card the suite runs (real diffusers format), written
    once."""
    root = tmp_path_factory.mktemp("flowseam-conformance-checkpoints")
    return {card: write_tiny_checkpoint(card, root / card) for card in CARDS}


@pytest.fixture(scope="session")
def reference_platform(flowseam_registry: Any) -> Any:
    """The cpu backend's platform: what every other build and output is compared with."""
    from flowseam.seam.platform import Platform

    rec = flowseam_registry.records.get("cpu")
    if rec is None or not rec.usable:
        status = "not installed" if rec is None else f"{rec.status}: {rec.reason}"
        pytest.skip(f"the cpu backend, the conformance reference, is {status} "
                    "(pip install flowseam-cpu; do not block it)")
    return Platform("cpu", registry=flowseam_registry)


@pytest.fixture(scope="session")
def conformance_runs(tiny_checkpoints: dict[str, Path], reference_platform: Any) -> Runs:
    return Runs(tiny_checkpoints, reference_platform)


@pytest.fixture(scope="session")
def diffusers_pipelines() -> dict:
    """diffusers pipelines of the tiny checkpoints, loaded once (card → pipeline)."""
    return {}


@pytest.fixture
def expectations(flowseam_platform: Any, request: pytest.FixtureRequest) -> Any:
    """The backend's :class:`~flowseam.testing.conformance.expectations.Expectations`."""
    return backend_expectations(request.config, flowseam_platform.name)
