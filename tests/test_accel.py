"""The accel backend (torch.compile): discovery, the arch walk, its compiled kernels against the
numpy oracle, C2, its compiled dit against the cpu build, the vae and text_encoder fallbacks,
and that a new sigma never recompiles.

Compiling costs seconds per graph on a small CPU; inductor's on-disk cache
(TORCHINDUCTOR_CACHE_DIR) makes reruns fast, and the models here are shrunk further than the
default tiny checkpoint to keep the cold compile short.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from itertools import pairwise

import flowseam
import numpy as np
import pytest
import torch
from flowseam import ComponentSpec, ops
from flowseam.ops import reference

flowseam_accel = pytest.importorskip("flowseam_accel")
from flowseam_accel import compiled, device
from flowseam_accel import plugin as accel_plugin

RTOL, ATOL = reference.TOLERANCES["float32"]


def _platform(name: str) -> flowseam.Platform:
    reg = flowseam.plugins.discover(refresh=True)
    rec = reg.records.get(name)
    if rec is None or not rec.usable:
        pytest.skip(f"backend {name!r} is not usable here: "
                    f"{'not installed' if rec is None else f'{rec.status}: {rec.reason}'}")
    return flowseam.Platform(name, registry=reg)


@pytest.fixture(scope="module")
def accel():
    yield _platform("accel")
    flowseam.plugins._CACHE = None


@pytest.fixture(scope="module")
def cpu():
    yield _platform("cpu")
    flowseam.plugins._CACHE = None


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _entry(name: str) -> dict:
    """accel's compile/run booking of one compiled entry point (zeros before its first call)."""
    empty = {"compile_s": 0.0, "run_s": 0.0, "calls": 0, "compiles": 0, "loads": 0,
             "signatures": []}
    return compiled.compile_report()["entries"].get(name, empty)


def _graphs_built() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# -- discovery, availability, arch chain -------------------------------------------------------

def test_found_through_its_entry_point_as_device_accel_priority_50():
    eps = {ep.name: ep for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["accel"].value == "flowseam_accel.plugin"
    assert eps["accel"].dist.metadata["Name"] == "flowseam-accel"
    # like flowseam-cpu, it does not depend on flowseam (no packaging cycle)
    assert not any(req.startswith("flowseam") for req in metadata.requires("flowseam-accel") or [])
    reg = flowseam.plugins.discover(refresh=True)
    try:
        rec = reg.records["accel"]
        if rec.status == "blocked":
            pytest.skip(f"accel is blocked here: {rec.reason}")
        assert (rec.status, rec.distribution, rec.device, rec.priority) == \
            ("available", "flowseam-accel", "accel", 50)
        assert rec.component_kinds == ("dit",)
        assert {(k.op, k.arch) for k in rec.kernels} == {
            (ops.FLOW_MATCH_STEP, "generic"), (ops.FLOW_SDE_STEP, device.arch_chain()[0]),
            (ops.FLOW_RENOISE, "generic")}
    finally:
        flowseam.plugins._CACHE = None


def test_unavailable_with_the_reason_when_torch_compile_cannot_run(monkeypatch):
    assert accel_plugin.flowseam_backend_available() == flowseam.Availability(True, "")
    monkeypatch.setattr(accel_plugin, "compile_unsupported_reason",
                        lambda: "torch.compile's CPU code generator needs a C++ compiler")
    assert accel_plugin.flowseam_backend_available() == flowseam.Availability(
        False, "torch.compile's CPU code generator needs a C++ compiler")


@pytest.mark.parametrize("machine,capability,chain", [
    ("x86_64", "AVX512", ["x86_64-avx512", "x86_64-avx2", "x86_64", "generic"]),
    ("AMD64", "AVX2", ["x86_64-avx2", "x86_64", "generic"]),
    ("aarch64", "SVE256", ["aarch64-sve256", "aarch64", "generic"]),
    ("arm64", "DEFAULT", ["aarch64", "generic"]),
    ("x86_64", "NO AVX", ["x86_64", "generic"]),
])
def test_cpu_arch_chain(machine, capability, chain):
    assert device.cpu_arch_chain(machine, capability) == chain


def test_arch_walk_fallback_for_flow_match_step_direct_hit_for_flow_sde_step(accel):
    chain = accel.arch_chain
    assert chain == device.arch_chain() and chain[-1] == "generic" and len(chain) >= 2
    assert accel.device_chain == ("accel", "cpu")
    euler = accel.kernels.get(ops.FLOW_MATCH_STEP).provenance
    assert (euler.plugin, euler.device, euler.arch) == ("accel", "accel", "generic")
    assert accel.kernels.walks[ops.FLOW_MATCH_STEP] == tuple(f"accel/{a}" for a in chain)
    sde = accel.kernels.get(ops.FLOW_SDE_STEP).provenance
    assert (sde.plugin, sde.device, sde.arch) == ("accel", "accel", chain[0])
    assert accel.kernels.walks[ops.FLOW_SDE_STEP] == (f"accel/{chain[0]}",)
    attn = accel.kernels.get(ops.ATTENTION).provenance
    assert (attn.plugin, attn.device) == ("cpu", "cpu")  # accel registers no attention kernel
    # nor the causal loop's cached attention: it falls back to cpu too, and says so
    cached = accel.kernels.get(ops.CACHED_ATTENTION).provenance
    assert (cached.plugin, cached.device) == ("cpu", "cpu")
    row = next(line for line in accel.explain().splitlines() if line.startswith(ops.CACHED_ATTENTION))
    assert row.split()[1:4] == ["cpu/generic", "cpu", "yes"], row
    renoise = accel.kernels.get(ops.FLOW_RENOISE).provenance
    assert (renoise.plugin, renoise.device, renoise.arch) == ("accel", "accel", "generic")


# -- kernels against the oracle ----------------------------------------------------------------

def test_flow_match_step_matches_oracle_float32_and_bf16(accel, cpu):
    step = accel.kernels.get(ops.FLOW_MATCH_STEP)
    x, v = _rand(2, 4, 3, 8, 8, seed=1), _rand(2, 4, 3, 8, 8, seed=2)
    out = step(x, v, 0.75, 0.5)
    assert out.dtype == torch.float32 and out.shape == x.shape
    np.testing.assert_allclose(out.numpy(), reference.flow_match_step(x.numpy(), v.numpy(), 0.75, 0.5),
                               rtol=RTOL, atol=ATOL)
    # on the CPU accel's Euler step is cpu's eager call (kernels.py: a package saved nothing)
    assert torch.equal(out, cpu.kernels.get(ops.FLOW_MATCH_STEP)(x, v, 0.75, 0.5))
    xb, vb = _rand(2, 16, seed=3, dtype=torch.bfloat16), _rand(2, 16, seed=4, dtype=torch.bfloat16)
    outb = step(xb, vb, 1.0, 0.9)
    assert outb.dtype == torch.bfloat16
    rtol, atol = reference.TOLERANCES["bfloat16"]
    np.testing.assert_allclose(outb.float().numpy(),
                               reference.flow_match_step(xb.float().numpy(), vb.float().numpy(), 1.0, 0.9),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("sigma,sigma_next,sigma_max", [
    (1.0, 0.9, 0.9),     # first step: sigma == 1 uses sigma_max
    (0.6, 0.45, None),   # a middle step
    (0.1, 0.0, None),    # the last step, to sigma_next = 0
])
def test_flow_sde_step_matches_oracle(accel, sigma, sigma_next, sigma_max):
    step = accel.kernels.get(ops.FLOW_SDE_STEP)
    x, v, noise = _rand(3, 4, 2, 6, 6, seed=5), _rand(3, 4, 2, 6, 6, seed=6), _rand(3, 4, 2, 6, 6, seed=7)
    out = step(x, v, sigma, sigma_next, noise=noise, noise_level=0.7, sigma_max=sigma_max)
    ref = reference.flow_sde_step(x.numpy(), v.numpy(), sigma, sigma_next, noise=noise.numpy(),
                                  noise_level=0.7, sigma_max=sigma_max)
    assert out.sample.dtype == torch.float32 and out.log_prob.shape == (3,)
    assert out.mean.shape == x.shape and out.std.shape == ()
    for got, want in ((out.sample, ref.sample), (out.mean, ref.mean), (out.log_prob, ref.log_prob),
                      (out.std, ref.std)):
        np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=ATOL)


def test_bad_arguments_raise_like_every_backend(accel):
    euler, sde = accel.kernels.get(ops.FLOW_MATCH_STEP), accel.kernels.get(ops.FLOW_SDE_STEP)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="v has shape"):
        euler(x, torch.zeros(2, 4), 0.5, 0.4)
    with pytest.raises(ValueError, match="sigma_next=0.6"):
        euler(x, x, 0.5, 0.6)
    with pytest.raises(ValueError, match="sigma_max"):
        sde(x, x, 1.0, 0.9)


# -- C2 and gradients --------------------------------------------------------------------------

def test_flow_sde_step_c2_recompute_is_exact_and_equals_cpu(accel, cpu):
    step, cpu_step = accel.kernels.get(ops.FLOW_SDE_STEP), cpu.kernels.get(ops.FLOW_SDE_STEP)
    x, v = _rand(2, 3, 8, 8, seed=8), _rand(2, 3, 8, 8, seed=9)
    rollout = step(x, v, 0.8, 0.6, generator=torch.Generator().manual_seed(3))
    again = step(x, v, 0.8, 0.6, prev_sample=rollout.sample)
    assert again.sample is rollout.sample
    assert torch.equal(rollout.log_prob, again.log_prob)              # C2: bit for bit
    # the recompute of an RL update records gradients: still the same bits
    v_grad = v.clone().requires_grad_(True)
    update = step(x, v_grad, 0.8, 0.6, prev_sample=rollout.sample)
    assert torch.equal(rollout.log_prob, update.log_prob.detach())
    # same generator, same noise draw as cpu; log-prob within the float32 tolerance of cpu's
    on_cpu = cpu_step(x, v, 0.8, 0.6, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(rollout.sample.numpy(), on_cpu.sample.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(rollout.log_prob.numpy(), on_cpu.log_prob.numpy(), rtol=RTOL, atol=ATOL)
    # gradients reach the log-prob through mean only, and equal cpu's (autograd through eager torch)
    v_cpu = v.clone().requires_grad_(True)
    sample = rollout.sample.clone().requires_grad_(True)
    cpu_update = cpu_step(x, v_cpu, 0.8, 0.6, prev_sample=sample)
    (update.log_prob.sum() + update.mean.square().mean()).backward()
    (cpu_update.log_prob.sum() + cpu_update.mean.square().mean()).backward()
    np.testing.assert_allclose(v_grad.grad.numpy(), v_cpu.grad.numpy(), rtol=RTOL, atol=ATOL)
    assert sample.grad is None


def test_flow_sde_step_bf16_recompute_is_exact_and_logprob_float32(accel):
    step = accel.kernels.get(ops.FLOW_SDE_STEP)
    x, v = _rand(2, 64, seed=10, dtype=torch.bfloat16), _rand(2, 64, seed=11, dtype=torch.bfloat16)
    out = step(x, v, 0.5, 0.4, generator=torch.Generator().manual_seed(0))
    assert out.sample.dtype == torch.bfloat16 and out.log_prob.dtype == torch.float32
    again = step(x, v, 0.5, 0.4, prev_sample=out.sample)
    assert torch.equal(out.log_prob, again.log_prob)
    ref = reference.flow_sde_step(x.float().numpy(), v.float().numpy(), 0.5, 0.4,
                                  prev_sample=out.sample.float().numpy())
    np.testing.assert_allclose(out.log_prob.numpy(), ref.log_prob, rtol=RTOL, atol=ATOL)


def test_a_new_sigma_resolution_or_storage_dtype_never_recompiles(accel):
    euler, sde = accel.kernels.get(ops.FLOW_MATCH_STEP), accel.kernels.get(ops.FLOW_SDE_STEP)
    x, v = _rand(2, 16, 2, 8, 8, seed=12), _rand(2, 16, 2, 8, 8, seed=13)
    euler(x, v, 1.0, 0.95)                                           # warm (compiles at most once)
    sde(x, v, 0.95, 0.9, generator=torch.Generator().manual_seed(0))
    graphs, report = _graphs_built(), compiled.compile_report()["entries"]
    sigmas = torch.linspace(0.9, 0.0, 9).tolist()
    for sigma, sigma_next in pairwise(sigmas):
        x = euler(x, v, sigma, sigma_next)
        sde(x, v, sigma, sigma_next, generator=torch.Generator().manual_seed(1))
    # storage dtypes are converted outside the graphs: they share the float32 graph
    for xd, vd in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                   (torch.float32, torch.bfloat16)):
        euler(x.to(xd), v.to(vd), 0.5, 0.4)
        sde(x.to(xd), v.to(vd), 0.5, 0.4, generator=torch.Generator().manual_seed(2))
    # the elementwise Euler graph has dynamic sizes (the log-prob reduction may add a size-range
    # guard in inductor's codegen, so a very different resolution can cost it one recompile)
    euler(_rand(2, 16, 2, 12, 12, seed=14), _rand(2, 16, 2, 12, 12, seed=15), 0.5, 0.4)
    assert _graphs_built() == graphs
    after = compiled.compile_report()["entries"]
    assert "flow_match_step" not in after   # on the CPU the Euler step compiles nothing
    for name in ("flow_sde_step.sample", "flow_sde_step.log_prob"):
        assert after[name]["compiles"] == report[name]["compiles"], name
        assert after[name]["calls"] > report[name]["calls"]


_KERNELS_IN_A_NEW_PROCESS = """
import json, sys
import numpy as np, torch
from flowseam.ops import eager, reference
from flowseam_accel import compiled, kernels

def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

x64, v64, n64 = rand(2, 4, 3, 6, seed=1), rand(2, 4, 3, 6, seed=2), rand(2, 4, 3, 6, seed=3)
x, v, noise = x64.float(), v64.float(), n64.float()
rtol, atol = reference.TOLERANCES["float32"]
diffs = {}  # max |got - want| / (atol + rtol |want|): within the float32 tolerance when <= 1

def check(name, got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    diffs[name] = float(np.max(np.abs(got - want) / (atol + rtol * np.abs(want))))

check("flow_match_step", kernels.flow_match_step(x, v, 0.6, 0.45), reference.flow_match_step(x, v, 0.6, 0.45))
sde = kernels.flow_sde_step(x, v, 0.6, 0.45, noise=noise)
ref = reference.flow_sde_step(x, v, 0.6, 0.45, noise=noise)
for field in ("sample", "mean", "log_prob"):
    check(f"flow_sde_step.{field}", getattr(sde, field), getattr(ref, field))
v_grad, v_cpu = v.clone().requires_grad_(True), v.clone().requires_grad_(True)
kernels.flow_sde_step(x, v_grad, 0.6, 0.45, prev_sample=sde.sample).log_prob.sum().backward()
eager.flow_sde_step(x, v_cpu, 0.6, 0.45, prev_sample=sde.sample).log_prob.sum().backward()
check("flow_sde_step.grad_v", v_grad.grad, v_cpu.grad)
check("flow_renoise", kernels.flow_renoise(x, noise, 0.3), reference.flow_renoise(x, noise, 0.3))
from torch._dynamo.utils import counters
report = compiled.compile_report()
print(json.dumps({"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["total"],
                  "diffs": diffs,
                  "compiles": {k: e["compiles"] for k, e in report["entries"].items()},
                  "compiler_imported": "torch._inductor.compile_fx" in sys.modules}))
"""


def test_float32_solver_kernels_run_aot_packages_a_new_process_traces_nothing(accel):
    """flowseam_accel.compiled.AOTFunction: on the CPU, accel's float32 solver kernels (SDE
    sample, log-prob and its backward, re-noise) run AOTInductor packages and the Euler step is
    cpu's eager call, so a new process on a filled cache calls all five without dynamo building
    a graph or inductor's compiler being imported, and their results equal the float64 oracle
    (the backward: cpu's autograd)."""
    x, v = _rand(2, 4, 3, 6, seed=1), _rand(2, 4, 3, 6, seed=2)
    out = accel.kernels.get(ops.FLOW_SDE_STEP)(x, v.requires_grad_(True), 0.6, 0.45)
    out.log_prob.sum().backward()                  # fills the cache (loaded, or built once)
    accel.kernels.get(ops.FLOW_MATCH_STEP)(x, v.detach(), 0.6, 0.45)
    accel.kernels.get(ops.FLOW_RENOISE)(x, v.detach(), 0.3)
    run = subprocess.run([sys.executable, "-c", _KERNELS_IN_A_NEW_PROCESS], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert (result["graphs"], result["frames"], result["compiler_imported"]) == (0, 0, False), result
    # each kernel loaded its package once: booked as one compile, nothing traced; Euler: none
    assert result["compiles"] == {"flow_renoise": 1, "flow_sde_step.backward": 1,
                                  "flow_sde_step.log_prob": 1, "flow_sde_step.sample": 1}
    assert len(result["diffs"]) == 6 and max(result["diffs"].values()) <= 1, result["diffs"]


# -- components --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    """A Wan 2.1 T2V checkpoint shrunk below the default tiny one (2 DiT layers, a 2-level VAE),
    so that the DiT block's graphs compile in seconds; two layers, so that one block's graphs
    serve both."""
    from flowseam.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        "wan2.1-t2v", tmp_path_factory.mktemp("accel") / "wan", transformer={"num_layers": 2},
        vae={"dim_mult": [1, 1], "temperal_downsample": [False], "z_dim": 4})


def test_dit_blocks_are_compiled_once_for_all_and_the_model_equals_the_cpu_build(accel, cpu, tiny_wan):
    """Regional compilation: every WanTransformerBlock compiled in place, the first block's call
    compiles, the second reuses its graphs; attention stays routed through the platform (the
    routed processors run eagerly and count their SDPA calls); the result equals the cpu build."""
    import diffusers
    from flowseam import step_constants
    from flowseam.attention import route_attention
    from flowseam.models.wan import WanT2V

    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    dit, ref = accel.build_component("dit", spec), cpu.build_component("dit", spec)
    assert type(dit) is diffusers.WanTransformer3DModel and dit.config == ref.config
    assert getattr(dit, "_compiled_call_impl", None) is None          # not the whole model ...
    assert len(dit.blocks) == 2 and all(isinstance(b._compiled_call_impl, compiled.Timed)
                                        for b in dit.blocks)          # ... its repeated blocks
    assert next(dit.parameters()).dtype == torch.float32
    route_attention(dit, accel.kernels.get(ops.ATTENTION))
    route_attention(ref, cpu.kernels.get(ops.ATTENTION))
    # as a loaded model has them; the no-grad calls then share the AOT tests' package
    step_constants.install(dit, WanT2V.STEP_CONSTANTS)
    procs = list(dit.attn_processors.values())
    z = dit.config.in_channels
    latents, t = _rand(1, z, 1, 8, 8, seed=20), torch.tensor([700.0])
    text = _rand(1, 6, dit.config.text_dim, seed=21)
    name = "dit:transformer.WanTransformerBlock"
    before, sdpa_calls = _entry(name), sum(p._mode.calls for p in procs)
    with torch.no_grad():
        out = dit(latents, t, text, return_dict=False)[0]
        again = dit(latents, t * 0.5, text, return_dict=False)[0]    # new timestep: no recompile
        want = ref(latents, t, text, return_dict=False)[0]
    assert out.shape == want.shape
    assert (out - want).abs().max().item() < 1e-4
    assert again.shape == out.shape and not torch.equal(again, out)
    # 2 model calls x 2 blocks x (self + cross) attention, all through the platform's kernel
    assert sum(p._mode.calls for p in procs) - sdpa_calls == 8
    # 4 block calls, of which at most one compiled (none if an earlier instance of this config
    # compiled the shape): the second block reuses the first one's graphs; compile time is
    # booked apart from run time
    after = _entry(name)
    assert after["calls"] - before["calls"] == 4 and after["compiles"] - before["compiles"] <= 1
    assert len(after["signatures"]) == after["compiles"] >= 1
    if after["compiles"] > before["compiles"]:
        assert after["compile_s"] - before["compile_s"] > after["run_s"] - before["run_s"]


def test_a_first_call_says_it_may_compile_when_notices_are_on(accel, tiny_wan, monkeypatch,
                                                              capsys):
    """flowseam generate turns notices on: the first call of a compiled component with new
    input shapes announces itself (a cold compile takes minutes on 2 cores and would look like
    a hang), and says afterwards whether it compiled or only loaded a package compiled before
    (a new model's first no-grad call, as in a new process: the package is on disk by then),
    with the seconds it took; later calls say nothing."""
    from flowseam import console

    monkeypatch.setattr(console, "_NOTICES", True)
    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    dit = accel.build_component("dit", spec)
    z = dit.config.in_channels
    latents, t = _rand(1, z, 1, 8, 8, seed=20), torch.tensor([700.0])
    text = _rand(1, 6, dit.config.text_dim, seed=21)
    with torch.no_grad():
        dit(latents, t, text, return_dict=False)
        dit(latents, t * 0.5, text, return_dict=False)
    err = capsys.readouterr().err.splitlines()
    # one notice for both blocks: they share the entry "<name>.<block class>" and its graphs
    message = ("accel: preparing dit:transformer.WanTransformerBlock for new input shapes "
               "(compiled on the first call, cached on disk)")
    assert err[0] == f"{message} ..."  # stderr is not a terminal here: a start and an end line
    assert re.fullmatch(re.escape(message) + r": (compiled|loaded \(compiled before\)) in [0-9.]+ s",
                        err[1]), err
    assert len(err) == 2  # the second call, same shapes: no notice
    # a new model of this config, whose signatures are announced afresh: loads, compiles nothing
    monkeypatch.setitem(compiled._SEEN, "dit:transformer.WanTransformerBlock", set())
    with torch.no_grad():
        accel.build_component("dit", spec)(latents, t, text, return_dict=False)
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(re.escape(message) + r": loaded \(compiled before\) in [0-9]+\.[0-9] s",
                        err[1]), err
    monkeypatch.setattr(console, "_NOTICES", False)  # library use: silent
    with torch.no_grad():
        accel.build_component("dit", spec)(latents, t, text, return_dict=False)
    assert capsys.readouterr().err == ""


def test_no_grad_calls_run_an_aot_package_a_new_model_loads_without_tracing(accel, cpu, tiny_wan):
    """flowseam_accel.aot: a block's no-grad call runs its AOTInductor package, with the
    attention projections inside and the attention kernel called back (still the platform's,
    still counted), and the text keys/values that flowseam.step_constants reuses across steps
    called back and reused (Wan's STEP_CONSTANTS installed, as a loaded model has them); a new
    model of the same config (as in a new process) loads that package from disk and dynamo
    traces nothing; a batch size outside a package's size pattern gets a package of its own,
    never a wrong one."""
    from pathlib import Path

    from flowseam import step_constants
    from flowseam.attention import route_attention
    from flowseam.models.wan import WanT2V
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    ref = cpu.build_component("dit", spec)
    route_attention(ref, cpu.kernels.get(ops.ATTENTION))

    def routed_dit():
        dit = accel.build_component("dit", spec)
        route_attention(dit, accel.kernels.get(ops.ATTENTION))
        step_constants.install(dit, WanT2V.STEP_CONSTANTS)
        return dit

    def inputs(batch):
        return (_rand(batch, ref.config.in_channels, 1, 8, 8, seed=30), torch.tensor([700.0] * batch),
                _rand(batch, 6, ref.config.text_dim, seed=31))

    name = "dit:transformer.WanTransformerBlock"
    with torch.no_grad():
        routed_dit()(*inputs(1), return_dict=False)   # builds the package (or loads it)
        graphs, before = _graphs_built(), _entry(name)
        dit = routed_dit()
        procs = list(dit.attn_processors.values())
        sdpa_calls = sum(p._mode.calls for p in procs)
        out = dit(*inputs(1), return_dict=False)[0]
        want = ref(*inputs(1), return_dict=False)[0]
        assert _graphs_built() == graphs                          # dynamo traced nothing
        assert _entry(name)["compiles"] - before["compiles"] == 1  # the load, booked once ...
        assert _entry(name)["loads"] - before["loads"] == 1        # ... as a load
        assert (out - want).abs().max().item() < 1e-4
        assert sum(p._mode.calls for p in procs) - sdpa_calls == 4   # 2 blocks x 2 attentions
        aot = dit.blocks[0]._compiled_call_impl.fn.aot
        assert aot._inline == ("attn1", "attn2")                   # traced into the package
        assert set(aot._callbacks) == {"attn2.to_k", "attn2.to_v", "attn2.norm_k"}
        # inside a loop's scope the second step reuses every block's text K/V: each module's
        # kept entry is untouched (a miss replaces it); norm_k's input is to_k's copy, swapped
        # back for to_k's own output, so it matches by identity
        reused = [dit.get_submodule(f"blocks.{i}.{n}") for i in range(2) for n in aot._callbacks]
        with step_constants.reuse_across_steps():
            first = dit(*inputs(1), return_dict=False)[0]
            kept = [step_constants._LOCAL.outputs[id(m)] for m in reused]
            second = dit(*inputs(1), return_dict=False)[0]
            assert all(step_constants._LOCAL.outputs[id(m)] is k for m, k in zip(reused, kept))
        assert torch.equal(first, out) and torch.equal(second, out)
        assert sum(p._mode.calls for p in procs) - sdpa_calls == 12
        out, want = dit(*inputs(2), return_dict=False)[0], ref(*inputs(2), return_dict=False)[0]
    assert out.shape[0] == 2 and (out - want).abs().max().item() < 1e-4
    assert _graphs_built() == graphs
    assert _entry(name)["compiles"] - before["compiles"] == 2     # batch 2: its own package
    packages = sorted((Path(cache_dir()) / "flowseam_accel_aot").glob("*.pt2"))
    assert len(packages) >= 2 and all(p.with_suffix(".json").is_file() for p in packages)


def test_threads_calling_one_compiled_dit_at_once_all_finish_with_the_right_result(accel, cpu,
                                                                                 tiny_wan):
    """The serve engine runs requests in threads: block calls through a package's runner, whose
    attention callback needs the GIL, once deadlocked when a second thread entered the same
    runner (flowseam_accel.aot.dispatcher runs them one at a time). Without that lock this test
    hangs: the waiting thread holds the GIL, so not even the join's timeout returns."""
    import threading

    from flowseam import step_constants
    from flowseam.attention import route_attention
    from flowseam.models.wan import WanT2V

    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    dit, ref = accel.build_component("dit", spec), cpu.build_component("dit", spec)
    route_attention(dit, accel.kernels.get(ops.ATTENTION))
    route_attention(ref, cpu.kernels.get(ops.ATTENTION))
    step_constants.install(dit, WanT2V.STEP_CONSTANTS)   # as loaded: the previous test's package
    latents, t = _rand(1, dit.config.in_channels, 1, 8, 8, seed=40), torch.tensor([500.0])
    text = _rand(1, 6, dit.config.text_dim, seed=41)
    with torch.no_grad():
        want = ref(latents, t, text, return_dict=False)[0]
        dit(latents, t, text, return_dict=False)               # the package, built or loaded
    diffs: list[float] = []

    def run():
        with torch.no_grad():
            for _ in range(10):
                diffs.append((dit(latents, t, text, return_dict=False)[0] - want).abs().max().item())

    threads = [threading.Thread(target=run, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "block calls deadlocked"
    assert len(diffs) == 20 and max(diffs) < 1e-4


def test_models_built_and_dropped_leave_no_block_registered(accel, tiny_wan):
    """flowseam_accel.aot registers each compiled block (a weak reference, for its ops'
    callbacks): a model built and dropped (a trainer's copies, a server's swaps) takes its
    blocks' entries with it, so the registry does not grow with every model built."""
    import gc

    from flowseam_accel import aot

    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    gc.collect()
    before = len(aot._BLOCKS)
    for _ in range(2):
        dit = accel.build_component("dit", spec)
        assert len(aot._BLOCKS) == before + 2   # tiny_wan has 2 blocks
        del dit
        gc.collect()
    assert len(aot._BLOCKS) == before


def test_a_failed_export_is_recorded_only_when_the_program_is_why(tmp_path, monkeypatch):
    """flowseam_accel.store: a failure of the program (g++ rejects the code) is recorded in
    ``<key>.failed``, and a later process goes straight to torch.compile; a failure of the run
    (the compiler killed by a signal, its cc1plus killed as the OOM killer does, out of memory
    while lowering, a timeout) is said but not recorded, and a later process tries again. The
    compiler errors are torch's own: inductor's ``run_compile_cmd`` running the real g++."""
    import subprocess

    from flowseam_accel import store
    from torch._inductor.cpp_builder import run_compile_cmd
    from torch._inductor.exc import LoweringException

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    (tmp_path / "bad.cpp").write_text("int f() { return undeclared; }\n")
    (tmp_path / "ok.cpp").write_text("int f() { return 0; }\n")

    def compile_error(command: str) -> Exception:
        with pytest.raises(Exception) as info:
            run_compile_cmd(command, cwd=str(tmp_path))
        return info.value

    def lowering_out_of_memory() -> Exception:   # as inductor's GraphLowering re-raises
        try:
            try:
                raise MemoryError
            except MemoryError as exc:
                raise LoweringException(exc, "aten.mm", [], {}) from None
        except LoweringException as exc:
            return exc

    failures = {   # key: (exception, recorded)
        "rejected": (compile_error("g++ -c bad.cpp"), True),
        "signal": (compile_error("sh -c 'kill -KILL $$'"), False),
        "oom-killer": (compile_error("g++ -wrapper sh,-c,'kill -KILL $$' -c ok.cpp"), False),
        "lowering": (lowering_out_of_memory(), False),
        "timeout": (subprocess.TimeoutExpired("g++", 600), False),
    }
    for key, (exc, recorded) in failures.items():
        exports, said = [], []

        def export(path, exc=exc):
            exports.append(path)
            raise exc

        for _process in range(2):
            monkeypatch.setattr(store, "_FAILED_HERE", {})   # a new process
            assert store.obtain(key, ((1,),), set(), [], export, said.append) is store.FAILED
        # a new model of the same config in the same process: not exported again
        assert store.obtain(key, ((1,),), set(), [], export, said.append) is store.FAILED
        said.pop()
        record = tmp_path / "flowseam_accel_aot" / f"{key}.failed"
        assert record.is_file() == recorded and len(exports) == (1 if recorded else 2), key
        first = f"runs through torch.compile: exporting it for AOTInductor failed ({type(exc).__name__}"
        assert said[0].startswith(first), said
        if recorded:
            assert said[0].endswith(f"(recorded in {record})")
            assert said[1].endswith(f"(recorded in {record}; delete it to try again)")
            continue
        for n in (1, 2):
            assert said[n - 1].endswith(f"; {n} of 3 such failures in a row (not recorded: the "
                                        "next process tries again)"), said
        # the third process in a row that fails so: recorded, a fourth does not try again
        for _process in range(2):
            monkeypatch.setattr(store, "_FAILED_HERE", {})
            assert store.obtain(key, ((1,),), set(), [], export, said.append) is store.FAILED
        assert len(exports) == 3 and record.read_text().endswith("; 3 failures of the run in a "
                                                                 "row"), (key, said)
        assert said[-1].endswith(f"(recorded in {record}; delete it to try again)")


def test_a_successful_export_resets_the_count_of_failures_of_the_run(tmp_path, monkeypatch):
    """flowseam_accel.store: the count in ``<key>.transient`` is of failures *in a row*: an
    export that succeeds removes it, so two failures of the run, a success, then two more
    record nothing. (The successful export writes nothing and ``store.Package`` is replaced by
    a class that accepts every shape: what is tested is the count, not AOTInductor's loader,
    whose real use the other tests here cover; a real compile would add ~18 s.)"""
    import subprocess

    from flowseam_accel import store

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    class Accepting:   # in place of the loader: accepts every shape
        def __init__(self, path, meta):
            pass

        def accepts(self, shapes):
            return True

    monkeypatch.setattr(store, "Package", Accepting)

    def failing(path):
        raise subprocess.TimeoutExpired("g++", 600)

    def succeeding(path):
        return {"pattern": [[3]]}

    for export in (failing, failing, succeeding, failing, failing):
        monkeypatch.setattr(store, "_FAILED_HERE", {})   # a new process
        store.obtain("k", ((3,),), set(), [], export, lambda line: None)
    folder = tmp_path / "flowseam_accel_aot"
    assert (folder / "k.transient").read_text() == "2"
    assert not (folder / "k.failed").exists()


def test_a_failure_of_the_program_is_recorded_whatever_the_caller_was_handling(tmp_path,
                                                                              monkeypatch):
    """flowseam_accel.store: torch.export's real error on data-dependent control flow is
    recorded although the export ran while its caller handled a timeout or an out-of-memory
    error (Python makes that the error's ``__context__``), and although the user's source line
    it quotes mentions memory."""
    from flowseam_accel import store

    class Branches(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # the other branch: can't allocate memory for it
                return x * 2
            return x - 1

    def export(path):
        torch.export.export(Branches(), (torch.ones(3),))

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    for key, outer in (("timeout", TimeoutError("upstream timed out")),
                       ("oom", torch.OutOfMemoryError("out of memory, batch halved"))):
        said = []
        try:
            raise outer
        except type(outer):
            assert store.obtain(key, ((3,),), set(), [], export, said.append) is store.FAILED
        record = tmp_path / "flowseam_accel_aot" / f"{key}.failed"
        assert record.is_file() and said[0].endswith(f"(recorded in {record})"), said


def test_a_bad_aot_switch_is_refused_naming_it_before_the_dit_loads(accel, tiny_wan, monkeypatch):
    from flowseam_accel import components

    monkeypatch.setenv("FLOWSEAM_ACCEL_AOT", "maybe")
    monkeypatch.setattr(components, "instantiate", lambda *a, **k: pytest.fail("weights loaded"))
    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    with pytest.raises(ValueError, match=r"FLOWSEAM_ACCEL_AOT='maybe' is not a switch: use one of "
                                         r"1, true, yes, on \(on\) or 0, false, no, off \(off\)"):
        components.build_dit(spec)


def test_a_dit_without_repeated_blocks_is_compiled_whole(accel):
    """The fallback of regional compilation: a model that lists no ``_repeated_blocks``."""
    from flowseam_accel.components import compile_repeated_blocks

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    assert compile_repeated_blocks(model, "dit:plain") is model
    assert isinstance(model._compiled_call_impl, compiled.Timed)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model)


@pytest.mark.parametrize("kind,name,cls", [
    ("vae", "vae", "diffusers.AutoencoderKLWan"),
    ("text_encoder", "text_encoder", "transformers.UMT5EncoderModel"),
])
def test_vae_and_text_encoder_fall_back_to_cpu_and_the_platform_says_why(accel, tiny_wan, kind,
                                                                         name, cls):
    """accel builds neither: the VAE is cpu's eager oneDNN build (compiling it cost most of a
    cold start, see flowseam_accel.components), the text encoder is left out on purpose."""
    spec = ComponentSpec(name, cls, str(tiny_wan), name)
    assert accel.component_plan(kind) == ("cpu", "cpu", True)
    component = accel.build_component(kind, spec)
    assert next(component.parameters()).device.type == "cpu"
    assert getattr(component, "_compiled_call_impl", None) is None   # built by cpu, not compiled
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in component.modules())
    record = [c for c in accel.components if c.kind == kind][-1]
    assert (record.device, record.plugin, record.fallback) == ("cpu", "cpu", True)
    assert record.reason == f"no plugin serving 'accel' builds '{kind}'"
    assert f"no plugin serving 'accel' builds '{kind}'" in accel.explain()
