"""The accel backend (torch.compile): discovery and its device-dependent priority, the arch walk,
its compiled kernels against the numpy oracle, C2, warm starts from torch.compile's own caches,
its compiled dit and vae against the cpu build of the same weights, provenance, and the
text_encoder fallback.

Compiling costs seconds per graph on a small CPU: the models here are shrunk below the default
tiny checkpoint, every compiled test shares one checkpoint (module scope) and few shapes, and
inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR) makes reruns faster.
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
    reg = flowseam.seam.discovery.discover(refresh=True)
    rec = reg.records.get(name)
    if rec is None or not rec.usable:
        pytest.skip(f"backend {name!r} is not usable here: "
                    f"{'not installed' if rec is None else f'{rec.status}: {rec.reason}'}")
    return flowseam.Platform(name, registry=reg)


@pytest.fixture(scope="module")
def accel():
    yield _platform("accel")
    flowseam.seam.discovery._CACHE = None


@pytest.fixture(scope="module")
def cpu():
    yield _platform("cpu")
    flowseam.seam.discovery._CACHE = None


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _entry(name: str) -> dict:
    """accel's compile/run booking of one compiled entry point (zeros before its first call)."""
    empty = {"compile_s": 0.0, "run_s": 0.0, "calls": 0, "compiles": 0, "signatures": []}
    return compiled.compile_report()["entries"].get(name, empty)


def _graphs_built() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# -- discovery, priority, availability, arch chain ---------------------------------------------

def test_found_through_its_entry_point_as_device_accel():
    eps = {ep.name: ep for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["accel"].value == "flowseam_accel.plugin"
    assert eps["accel"].dist.metadata["Name"] == "flowseam-accel"
    # like flowseam-cpu, it does not depend on flowseam (no packaging cycle)
    assert not any(req.startswith("flowseam") for req in metadata.requires("flowseam-accel") or [])
    reg = flowseam.seam.discovery.discover(refresh=True)
    try:
        rec = reg.records["accel"]
        if rec.status == "blocked":
            pytest.skip(f"accel is blocked here: {rec.reason}")
        assert (rec.status, rec.distribution, rec.device) == \
            ("available", "flowseam-accel", "accel")
        assert rec.component_kinds == ("dit", "vae")
        assert {(k.op, k.arch) for k in rec.kernels} == {
            (ops.FLOW_MATCH_STEP, "generic"), (ops.FLOW_SDE_STEP, device.arch_chain()[0]),
            (ops.FLOW_RENOISE, "generic"), (ops.SEQUENCE_PARALLEL_ATTENTION, "generic")}
    finally:
        flowseam.seam.discovery._CACHE = None


@pytest.mark.parametrize("torch_device,priority,detected", [
    ("cpu", -10, "cpu"),          # this machine: a first `flowseam generate` compiles nothing
    ("cuda:0", 50, "accel"),      # a GPU host (no GPU needed: the device answer is replaced)
    ("mps", 50, "accel"),
])
def test_priority_depends_on_the_device_and_backend_accel_still_selects_it(
        monkeypatch, torch_device, priority, detected):
    """Below cpu's 0 where accel's torch device is the CPU, 50 on a GPU or MPS (above cpu,
    below cuda's 100); either way Platform("accel") (``--backend accel``) selects accel."""
    monkeypatch.setattr(accel_plugin, "torch_device", lambda: torch.device(torch_device))
    reg = flowseam.seam.discovery.discover(refresh=True)
    try:
        rec = reg.records["accel"]
        if not rec.usable:
            pytest.skip(f"accel is not usable here: {rec.status}: {rec.reason}")
        assert rec.priority == priority
        cuda = reg.records.get("cuda")
        if cuda is None or not cuda.usable:
            assert flowseam.Platform.detect(registry=reg).name == detected
        assert flowseam.Platform("accel", registry=reg).device_chain == ("accel", "cpu")
    finally:
        flowseam.seam.discovery._CACHE = None


def test_here_detect_picks_cpu_and_the_cli_lists_accel_available():
    if device.torch_device().type != "cpu":
        pytest.skip("accel's torch device is not the CPU here")
    run = subprocess.run([sys.executable, "-m", "flowseam", "backends", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {r["name"]: r for r in json.loads(run.stdout)}
    if rows["accel"]["status"] == "blocked":
        pytest.skip(f"accel is blocked here: {rows['accel']['reason']}")
    assert rows["accel"]["status"] == "available" and rows["accel"]["priority"] < 0
    assert rows["cpu"]["status"] == "active"


def test_unavailable_with_the_reason_when_torch_compile_cannot_run(monkeypatch):
    assert accel_plugin.flowseam_backend_available() == flowseam.Availability(True, "")
    monkeypatch.setattr(accel_plugin, "compile_unsupported_reason",
                        lambda: "torch.compile's CPU code generator needs a C++ compiler")
    assert accel_plugin.flowseam_backend_available() == flowseam.Availability(
        False, "torch.compile's CPU code generator needs a C++ compiler")


def _clear_device_caches() -> None:
    for fn in (device.torch_device, device.arch_chain, device.compile_unsupported_reason):
        fn.cache_clear()


@pytest.mark.parametrize("forced,reason", [
    ("bogus", "FLOWSEAM_ACCEL_DEVICE='bogus' is not a torch device"),
    ("xpu", "FLOWSEAM_ACCEL_DEVICE='xpu': accel runs on cpu, cuda[:N] or mps"),
    # one more CUDA device than this host has (none here)
    (f"cuda:{torch.cuda.device_count()}", "FLOWSEAM_ACCEL_DEVICE='cuda:"),
])
def test_a_forced_device_that_cannot_run_makes_accel_unavailable_naming_the_variable(
        monkeypatch, forced, reason):
    """A bad override is reported as the reason accel is unavailable (no traceback from a
    hook); accel's device and arch chain are then what detection picks without it."""
    _clear_device_caches()
    detected, chain = device.torch_device(), device.arch_chain()
    monkeypatch.setenv("FLOWSEAM_ACCEL_DEVICE", forced)
    _clear_device_caches()
    try:
        assert device.compile_unsupported_reason().startswith(reason)
        assert (device.torch_device(), device.arch_chain()) == (detected, chain)
        assert accel_plugin.flowseam_backend_available().ok is False
    finally:
        monkeypatch.delenv("FLOWSEAM_ACCEL_DEVICE")
        _clear_device_caches()
    assert not device.compile_unsupported_reason().startswith("FLOWSEAM_ACCEL_DEVICE")


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
    row = next(line for line in accel.explain().splitlines()
               if line.startswith(ops.CACHED_ATTENTION))
    assert row.split()[1:4] == ["cpu/generic", "cpu", "yes"], row
    renoise = accel.kernels.get(ops.FLOW_RENOISE).provenance
    assert (renoise.plugin, renoise.device, renoise.arch) == ("accel", "accel", "generic")


# -- kernels against the oracle ----------------------------------------------------------------

def test_flow_match_step_matches_oracle_float32_and_bf16(accel, cpu):
    step = accel.kernels.get(ops.FLOW_MATCH_STEP)
    x, v = _rand(2, 4, 3, 8, 8, seed=1), _rand(2, 4, 3, 8, 8, seed=2)
    out = step(x, v, 0.75, 0.5)
    assert out.dtype == torch.float32 and out.shape == x.shape
    np.testing.assert_allclose(out.numpy(),
                               reference.flow_match_step(x.numpy(), v.numpy(), 0.75, 0.5),
                               rtol=RTOL, atol=ATOL)
    assert out.dtype == cpu.kernels.get(ops.FLOW_MATCH_STEP)(x, v, 0.75, 0.5).dtype
    xb, vb = _rand(2, 16, seed=3, dtype=torch.bfloat16), _rand(2, 16, seed=4, dtype=torch.bfloat16)
    outb = step(xb, vb, 1.0, 0.9)
    assert outb.dtype == torch.bfloat16
    rtol, atol = reference.TOLERANCES["bfloat16"]
    np.testing.assert_allclose(outb.float().numpy(),
                               reference.flow_match_step(xb.float().numpy(), vb.float().numpy(),
                                                         1.0, 0.9),
                               rtol=rtol, atol=atol)


@pytest.mark.parametrize("sigma,sigma_next,sigma_max", [
    (1.0, 0.9, 0.9),     # first step: sigma == 1 uses sigma_max
    (0.6, 0.45, None),   # a middle step
    (0.1, 0.0, None),    # the last step, to sigma_next = 0
])
def test_flow_sde_step_matches_oracle(accel, sigma, sigma_next, sigma_max):
    step = accel.kernels.get(ops.FLOW_SDE_STEP)
    x, v, noise = (_rand(3, 4, 2, 6, 6, seed=s) for s in (5, 6, 7))
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
    np.testing.assert_allclose(rollout.log_prob.numpy(), on_cpu.log_prob.numpy(),
                               rtol=RTOL, atol=ATOL)
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
    # the elementwise graph has dynamic sizes (the log-prob reduction may add a size-range
    # guard in inductor's codegen, so a very different resolution can cost it one recompile)
    euler(_rand(2, 16, 2, 12, 12, seed=14), _rand(2, 16, 2, 12, 12, seed=15), 0.5, 0.4)
    assert _graphs_built() == graphs
    after = compiled.compile_report()["entries"]
    for name in ("flow_match_step+flow_renoise", "flow_sde_step.sample", "flow_sde_step.log_prob"):
        assert after[name]["compiles"] == report[name]["compiles"], name
        assert after[name]["calls"] > report[name]["calls"]


_KERNELS_IN_A_NEW_PROCESS = """
import json
import torch
from flowseam.ops import reference
from flowseam_accel import kernels

g = torch.Generator().manual_seed(1)
x, v, noise = (torch.randn(2, 4, 3, 6, generator=g) for _ in range(3))
rtol, atol = reference.TOLERANCES["float32"]
out = kernels.flow_sde_step(x, v, 0.6, 0.45, noise=noise)
ref = reference.flow_sde_step(x.numpy(), v.numpy(), 0.6, 0.45, noise=noise.numpy())
ok = bool(torch.allclose(out.sample, torch.from_numpy(ref.sample).float(), rtol=rtol, atol=atol))
kernels.flow_match_step(x, v, 0.6, 0.45)
from torch._dynamo.utils import counters
print(json.dumps({"ok": ok, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def test_a_new_process_loads_the_kernels_from_torch_compiles_cache(accel):
    """Warm starts are torch.compile's own: once a process compiled the kernels, a new process
    on the same inductor cache (TORCHINDUCTOR_CACHE_DIR) finds every graph in the FX graph
    cache and compiles none."""
    x, v = _rand(2, 4, 3, 6, seed=1), _rand(2, 4, 3, 6, seed=2)
    accel.kernels.get(ops.FLOW_SDE_STEP)(x, v, 0.6, 0.45, noise=_rand(2, 4, 3, 6, seed=3))
    accel.kernels.get(ops.FLOW_MATCH_STEP)(x, v, 0.6, 0.45)
    run = subprocess.run([sys.executable, "-c", _KERNELS_IN_A_NEW_PROCESS], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["ok"] and result["hits"] >= 3 and result["misses"] == 0, result


# -- components --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    """A Wan 2.1 T2V checkpoint shrunk below the default tiny one (2 DiT layers, a 2-level VAE),
    so that the graphs compile in seconds; two layers, so that one block's graphs serve both."""
    from flowseam.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(
        "wan2.1-t2v", tmp_path_factory.mktemp("accel") / "wan", transformer={"num_layers": 2},
        vae={"dim_mult": [1, 1], "temperal_downsample": [False], "z_dim": 4})


def _dit_inputs(dit, seed=20):
    return (_rand(1, dit.config.in_channels, 1, 8, 8, seed=seed), torch.tensor([700.0]),
            _rand(1, 6, dit.config.text_dim, seed=seed + 1))


def test_dit_blocks_are_compiled_once_for_all_and_the_model_equals_the_cpu_build(accel, cpu,
                                                                                 tiny_wan):
    """Regional compilation: every WanTransformerBlock compiled in place, the first block's call
    compiles, the second reuses its graphs; attention stays routed through the platform (the
    routed processors run eagerly and count their SDPA calls); the result equals the cpu build."""
    import diffusers
    from flowseam.attention import route_attention

    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan),
                         "transformer")
    dit, ref = accel.build_component("dit", spec), cpu.build_component("dit", spec)
    assert type(dit) is diffusers.WanTransformer3DModel and dit.config == ref.config
    assert getattr(dit, "_compiled_call_impl", None) is None          # not the whole model ...
    assert len(dit.blocks) == 2 and all(b._compiled_call_impl is not None
                                        for b in dit.blocks)          # ... its repeated blocks
    assert next(dit.parameters()).dtype == torch.float32
    route_attention(dit, accel.kernels.get(ops.ATTENTION))
    route_attention(ref, cpu.kernels.get(ops.ATTENTION))
    procs = list(dit.attn_processors.values())
    latents, t, text = _dit_inputs(dit)
    name = "dit:transformer"
    before, sdpa_calls, graphs = _entry(name), sum(p.calls for p in procs), _graphs_built()
    with torch.no_grad():
        out = dit(latents, t, text, return_dict=False)[0]
        again = dit(latents, t * 0.5, text, return_dict=False)[0]    # new timestep: no recompile
        want = ref(latents, t, text, return_dict=False)[0]
    assert out.shape == want.shape
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    assert again.shape == out.shape and not torch.equal(again, out)
    # 2 model calls x 2 blocks x (self + cross) attention, all through the platform's kernel
    assert sum(p.calls for p in procs) - sdpa_calls == 8
    # the first call compiled at most one block's graphs (none if an earlier instance of this
    # config compiled the shape), the second none; compile time is booked apart from run time
    after = _entry(name)
    assert after["calls"] - before["calls"] == 2 and after["compiles"] - before["compiles"] <= 1
    assert len(after["signatures"]) == after["compiles"]
    if after["compiles"] > before["compiles"]:
        assert after["compile_s"] - before["compile_s"] > after["run_s"] - before["run_s"]
        assert _graphs_built() > graphs


def test_a_first_call_says_it_may_compile_when_notices_are_on(accel, tiny_wan, monkeypatch,
                                                              capsys):
    """flowseam generate turns notices on: the first call of a compiled component with new
    input shapes announces itself (a cold compile takes minutes on 2 cores and would look like
    a hang), and says afterwards whether it compiled, with the seconds it took; later calls
    with the same shapes say nothing, and library use (notices off) is silent."""
    from flowseam.seam import notices

    notices.enable_notices(True)  # conftest restores the setting
    monkeypatch.setitem(compiled._SEEN, "dit:transformer", set())  # as in a new process
    spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan),
                         "transformer")
    dit = accel.build_component("dit", spec)
    latents, t, text = _dit_inputs(dit)
    with torch.no_grad():
        dit(latents, t, text, return_dict=False)
        dit(latents, t * 0.5, text, return_dict=False)
    err = capsys.readouterr().err.splitlines()
    message = ("accel: preparing dit:transformer for new input shapes "
               "(compiled on the first call, cached on disk)")
    assert err[0] == f"{message} ..."  # stderr is not a terminal here: a start and an end line
    assert re.fullmatch(re.escape(message) + r": (compiled|ready \(compiled before\)) in "
                        r"[0-9.]+ s", err[1]), err
    assert len(err) == 2
    notices.enable_notices(False)
    with torch.no_grad():
        accel.build_component("dit", spec)(latents, t, text, return_dict=False)
    assert capsys.readouterr().err == ""


def test_a_dit_without_repeated_blocks_is_compiled_whole(accel):
    """The fallback of regional compilation: a model that lists no ``_repeated_blocks``."""
    from flowseam_accel.components import compile_repeated_blocks

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    assert compile_repeated_blocks(model, "dit:plain") is model
    assert model._compiled_call_impl is not None
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in model)


def test_vae_is_built_by_accel_compiled_and_decodes_as_the_cpu_build(accel, cpu, tiny_wan):
    """The VAE's encoder and decoder are compiled in place (the VAE stays AutoencoderKLWan);
    a decode and an encode give the cpu build's outputs on the same weights, and are booked."""
    import diffusers

    spec = ComponentSpec("vae", "diffusers.AutoencoderKLWan", str(tiny_wan), "vae")
    vae, ref = accel.build_component("vae", spec), cpu.build_component("vae", spec)
    assert type(vae) is diffusers.AutoencoderKLWan
    assert all(part._compiled_call_impl is not None for part in (vae.encoder, vae.decoder))
    record = accel.components[-1]
    assert (record.kind, record.device, record.plugin, record.fallback) == \
        ("vae", "accel", "accel", False)
    before = _entry("vae:vae.decode")["calls"]
    z = _rand(1, vae.config.z_dim, 1, 8, 8, seed=50)
    frame = _rand(1, 3, 1, 16, 16, seed=51)
    with torch.no_grad():
        got, want = vae.decode(z).sample, ref.decode(z).sample
        enc, enc_want = vae.encode(frame).latent_dist.mean, ref.encode(frame).latent_dist.mean
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(enc.numpy(), enc_want.numpy(), rtol=1e-4, atol=1e-4)
    assert _entry("vae:vae.decode")["calls"] == before + 1


def test_provenance_dit_and_vae_by_accel_text_encoder_falls_back(accel, tiny_wan):
    """A loaded model on accel: dit and vae built by accel, the text encoder by cpu, recorded
    as a fallback with the reason, in model.provenance() and platform.explain() (loading
    compiles nothing: compiling happens at the first call)."""
    model = flowseam.load(tiny_wan, platform=accel, quiet=True)
    records = {r.kind: r for r in model.component_records.values()}
    for kind in ("dit", "vae"):
        assert (records[kind].device, records[kind].plugin, records[kind].fallback) == \
            ("accel", "accel", False), records[kind]
    text = records["text_encoder"]
    assert (text.device, text.plugin, text.fallback) == ("cpu", "cpu", True)
    assert text.reason == "no plugin serving 'accel' builds 'text_encoder'"
    assert next(model.components[text.name].parameters()).device.type == "cpu"
    line = model.provenance()
    for name in ("transformer", "vae"):
        assert re.search(rf"\b{name}=accel/accel float32[,;]", line), line
    assert "text_encoder=cpu/cpu float32 (fallback)" in line
    assert "no plugin serving 'accel' builds 'text_encoder'" in accel.explain()


@pytest.mark.slow
def test_a_split_generation_runs_accels_ring_attention_and_equals_one_cpu_process(
        cpu, tiny_wan, tmp_path):
    """accel registers its own sequence_parallel_attention, ring attention (cpu's is Ulysses):
    a generation on accel with ``Parallel(sp=2)`` on 2 gloo ranks resolves accel's kernel (the
    provenance names it) and gives the frames of the same request in one cpu process."""
    from conftest import HELPERS, torchrun

    from flowseam import DiffusionParams

    sys.path.insert(0, str(HELPERS))
    from accel_split_job import PARAMS

    out = tmp_path / "split.npz"
    torchrun("accel_split_job.py", tiny_wan, out)
    got = np.load(out)
    impl = str(got["impl_id"])
    assert impl.startswith("accel:sequence_parallel_attention:accel:"), impl
    assert f"sequence_parallel_attention={impl}" in str(got["provenance"])
    assert "parallel: sp=2" in str(got["provenance"])
    want = flowseam.load(tiny_wan, platform=cpu, quiet=True).generate(
        ["a red ball"], seeds=[7], params=DiffusionParams(**PARAMS)).frames
    assert got["frames"].shape == want.shape
    np.testing.assert_allclose(got["frames"], want, rtol=RTOL, atol=ATOL)
