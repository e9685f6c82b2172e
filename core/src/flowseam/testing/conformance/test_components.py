"""Components on tiny checkpoints of every card: where each was built (override or fallback, as
the backend's expectations say), and that every component the backend built computes what the
cpu build of the same weights computes."""

from __future__ import annotations

import pytest

from flowseam.seam.components import compute_dtype

from flowseam.testing.conformance._support import (
    built_component_cases,
    compare_outputs,
    component_cases,
)


@pytest.mark.flowseam_cases(cases=component_cases)
def test_component_placement(flowseam_platform, flowseam_case, conformance_runs, expectations):
    """Built by the backend when its expectations say ``override``; built on the next device
    (cpu) with ``fallback=True`` and a reason that ``platform.explain()`` shows when they say
    ``fallback``; otherwise at least a consistent record."""
    card, entry = flowseam_case
    platform = flowseam_platform
    run = conformance_runs.backend(platform, card)
    rec = run.model.component_records[entry.name]
    where = f"{card} {entry.name!r} (kind {entry.kind!r}) was built by plugin {rec.plugin!r} on " \
            f"{rec.device!r} (fallback={rec.fallback}{', ' + rec.reason if rec.reason else ''})"
    want = expectations.placement(entry.kind)
    if want == "override":
        assert (rec.plugin, rec.device, rec.fallback) == (platform.name, platform.device, False), \
            f"{where}; {platform.name!r} is expected to build {entry.kind!r} itself"
    elif want == "fallback":
        assert rec.plugin != platform.name and rec.device != platform.device, \
            f"{where}; {entry.kind!r} is expected to fall back past {platform.device!r}"
    if rec.device != platform.device:
        assert rec.fallback and f"{entry.kind!r}" in rec.reason, \
            f"{where}; a fallback must be recorded with fallback=True and a reason naming the kind"
        assert rec.reason in platform.explain(), "platform.explain() does not show the fallback"
    else:
        assert not rec.fallback and not rec.reason, \
            f"{where}; built on the first device, not a fallback"


@pytest.mark.flowseam_cases(cases=built_component_cases,
                            empty="it builds no component kind the tiny checkpoints use")
def test_overridden_component_matches_cpu(flowseam_platform, flowseam_case, conformance_runs):
    """Every call the serve loop made into the backend's build (forward, or a VAE's encode and
    decode; the first and the last) gives the outputs of the cpu build of the same weights on the
    same inputs, within the tolerance of the backend component's dtype — for a mixed-precision
    module (bf16 with float32 norms), the tolerance of its lowest precision."""
    card, entry = flowseam_case
    run = conformance_runs.backend(flowseam_platform, card)
    rec = run.model.component_records[entry.name]
    if rec.plugin != flowseam_platform.name:
        pytest.skip(f"{flowseam_platform.name!r} declined {entry.name!r} of {card}: built by "
                    f"{rec.plugin!r} on {rec.device!r} ({rec.reason})")
    calls = run.calls.get(entry.name)
    if calls is None:
        pytest.skip(f"{entry.name!r} is not a torch module; the serve-loop parity checks it")
    assert calls, f"the serve loop never called {entry.name!r}"
    component = run.model.components[entry.name]
    dtype = compute_dtype(component)  # a mixed-precision module: its lowest precision's tolerance
    reference = conformance_runs.reference(card).model.components[entry.name]
    for i, call in enumerate(calls):
        method = "forward" if call.method == "__call__" else call.method
        compare_outputs(call.outputs, call.replay(reference), dtype,
                        f"{card} {entry.name}.{method} (call {i})")


def test_expectations_agree_with_declarations(flowseam_platform, expectations):
    """Kinds promised as overrides are declared in ``flowseam_component_kinds``; kinds promised to
    fall back are not."""
    if not expectations.explicit:
        pytest.skip("no flowseam_conformance_expectations hook: expectations are derived from the "
                    "declarations")
    rec = flowseam_platform.backend
    undeclared = sorted(k for k in expectations.overrides if not rec.builds(k))
    assert not undeclared, f"expected overrides {undeclared} are not declared by {rec.name!r} " \
                           f"(flowseam_component_kinds: {list(rec.component_kinds)})"
    declared = sorted(k for k in expectations.falls_back if rec.builds(k))
    assert not declared, f"{declared} are expected to fall back but {rec.name!r} declares them"
