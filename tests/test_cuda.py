"""The cuda backend (torch CUDA + cupy).

On any machine: it imports without cupy or a GPU, is discovered through its entry point, says
exactly what is missing, shows up in ``flowseam backends``; its pure parts (arch chain, kernel
source generation, dtype rules, the torch fallbacks and the attention op on CPU tensors) are
checked here too. The rest needs a GPU and skips, with the reason, everywhere else; run it on a
GPU machine with ``plugins/cuda/gpu_check.sh``.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
import types
from importlib import metadata

import flowseam
import numpy as np
import pytest
import torch
from conftest import run_main
from flowseam import ComponentSpec, ops
from flowseam.ops import reference

pytest.importorskip("flowseam_cuda")
from flowseam_cuda import components, cupy_kernels, device, torch_kernels
from flowseam_cuda import plugin as cuda_plugin

RTOL, ATOL = reference.TOLERANCES["float32"]
HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
#: the ops with sm80 (cupy / flash-attention) kernels; the others are core's eager kernels
FUSED_OPS = (ops.FLOW_MATCH_STEP, ops.FLOW_SDE_STEP, ops.ATTENTION)
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (torch.cuda.is_available() is False)")
needs_cupy = pytest.mark.skipif(not (HAS_CUDA and HAS_CUPY),
                                reason="needs a CUDA device and cupy (pip install 'flowseam-cuda[cupy]')")


def _rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _cuda_record():
    reg = flowseam.seam.discovery.discover(refresh=True)
    rec = reg.records.get("cuda")
    if rec is None or rec.status == "blocked":
        pytest.skip(f"cuda plugin is {'not installed' if rec is None else 'blocked: ' + rec.reason}")
    return reg, rec


@pytest.fixture(autouse=True)
def _fresh_discovery():
    yield
    flowseam.seam.discovery._CACHE = None


# -- on every machine: import, discovery, availability -----------------------------------------

def test_plugin_imports_without_importing_cupy():
    code = "import sys, flowseam_cuda.plugin; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_found_through_its_entry_point_with_cupy_an_optional_extra():
    eps = {ep.name: ep for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["cuda"].value == "flowseam_cuda.plugin"
    assert eps["cuda"].dist.metadata["Name"] == "flowseam-cuda"
    requires = metadata.requires("flowseam-cuda") or []
    required = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("torch") for r in required)
    assert not any(r.startswith(("flowseam", "cupy")) for r in required)
    assert any(r.startswith("cupy-cuda12x") and 'extra == "cupy"' in r for r in requires)
    _, rec = _cuda_record()
    assert (rec.distribution, rec.device, rec.priority) == ("flowseam-cuda", "cuda", 100)
    assert set(rec.component_kinds) == {"dit", "vae", "text_encoder", "image_encoder"}
    assert {(k.op, k.arch) for k in rec.kernels} == {
        (op, arch) for op in FUSED_OPS for arch in ("sm80", "generic")} | {
        (op, "generic") for op in set(ops.ALL_OPS) - set(FUSED_OPS)}


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA; the unavailable path is not taken")
def test_unavailable_without_cuda_with_the_reason():
    reg, rec = _cuda_record()
    assert rec.status == "unavailable"
    assert "CUDA" in rec.reason
    if not HAS_CUPY:
        assert "cupy is not installed" in rec.reason and "flowseam-cuda[cupy]" in rec.reason
    with pytest.raises(flowseam.BackendUnavailableError, match="'cuda' is unavailable"):
        flowseam.Platform("cuda", registry=reg)
    assert flowseam.Platform.detect(registry=reg).name != "cuda"


def test_reason_names_everything_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # find_spec raises for a None entry
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cupy" else importlib.machinery.PathFinder.find_spec(name))
    reason = device.unavailable_reason()
    assert "CPU-only build" in reason and "cupy is not installed" in reason

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "sees no CUDA device" in device.unavailable_reason()

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, but no cupy
    reason = device.unavailable_reason()
    assert reason.startswith("cupy is not installed") and "CUDA" in reason  # "[cupy-cuda13] for CUDA 13"
    assert cuda_plugin.flowseam_backend_available() == flowseam.Availability(False, reason)

    broken = types.ModuleType("cupy")  # installed but unusable (e.g. wrong CUDA major)
    broken.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    broken.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(
        getDeviceCount=lambda: (_ for _ in ()).throw(RuntimeError("libcudart.so.12 not found"))))
    monkeypatch.setitem(sys.modules, "cupy", broken)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: broken.__spec__)
    assert "cupy does not work: RuntimeError: libcudart.so.12 not found" in device.unavailable_reason()


@pytest.mark.backends
def test_flowseam_backends_lists_it():
    out = run_main("backends", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    if "cuda" not in rows:
        pytest.skip("cuda plugin not installed")
    row = rows["cuda"]
    if row["status"] == "blocked":  # the blocked-backend pass: not even imported
        assert row["distribution"] == "flowseam-cuda" and "FLOWSEAM_DISABLE_PLUGINS" in row["reason"]
        return
    assert (row["distribution"], row["device"], row["priority"]) == ("flowseam-cuda", "cuda", 100)
    assert "flow_sde_step@sm80" in row["ops"] and "flow_sde_step@generic" in row["ops"]
    if HAS_CUDA and HAS_CUPY:
        assert row["status"] == "active"
    else:
        assert row["status"] == "unavailable" and row["reason"]
        text = run_main("backends")
        flat = " ".join(text.stdout.split())  # the table wraps a long reason at 100 columns
        assert "cuda" in text.stdout and f"reason: {row['reason']}" in flat


# -- on every machine: the pure parts ----------------------------------------------------------

@pytest.mark.parametrize("capability,chain", [
    ((9, 0), ["sm90", "sm80", "generic"]),
    ((8, 0), ["sm80", "generic"]),
    ((8, 9), ["sm89", "sm80", "generic"]),
    ((10, 0), ["sm100", "sm80", "generic"]),
    ((7, 5), ["sm75", "generic"]),
])
def test_arch_chain_from_compute_capability(capability, chain):
    assert device.arch_chain_for(capability) == chain


def test_kernel_source_is_specialized_per_dtype():
    src = cupy_kernels.kernel_source(cupy_kernels._FLOW_SDE_STEP, torch.bfloat16, torch.float32, torch.float16)
    assert "#define CT float" in src and "#define X_T unsigned short" in src
    assert "#define LOAD_X(u) ((CT)bf16_to_f32((u)))" in src and "cvt.rn.bf16.f32" in src
    assert "#define LOAD_N(u) ((CT)f16_to_f32((u)))" in src and "__fmaf_rn" in src
    src64 = cupy_kernels.kernel_source(cupy_kernels._FLOW_MATCH_STEP, torch.float64, torch.float32)
    assert "#define CT double" in src64 and "__fma_rn" in src64 and "#define X_T double" in src64
    with pytest.raises(TypeError, match="v is torch.int64"):
        cupy_kernels.kernel_source(cupy_kernels._FLOW_MATCH_STEP, torch.float32, torch.int64)


def test_cupy_kernels_reject_cpu_tensors_before_touching_cupy():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="CUDA tensors; x is on cpu"):
        cupy_kernels.flow_match_step(x, x, 0.5, 0.4)
    with pytest.raises(ValueError, match="CUDA tensors; x is on cpu"):
        cupy_kernels.flow_sde_step(x, x, 0.5, 0.4)
    with pytest.raises(ValueError, match="sigma_max"):  # the shared contract checks come first
        cupy_kernels.flow_sde_step(x, x, 1.0, 0.9)


def test_component_dtypes_and_fp32_modules_kept(tmp_path):
    import diffusers

    assert components.resolve_dtype("dit", ComponentSpec("t", "x.Y", config={})) == torch.bfloat16
    assert components.resolve_dtype("vae", ComponentSpec("v", "x.Y", config={})) == torch.float32
    assert components.resolve_dtype("dit", ComponentSpec("t", "x.Y", config={}, dtype="float32")) == torch.float32
    with pytest.raises(ValueError, match="dtype='int8'"):
        components.resolve_dtype("dit", ComponentSpec("t", "x.Y", config={}, dtype="int8"))
    dit = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    keep = dit._keep_in_fp32_modules
    assert keep  # Wan keeps its time embedder, norms, ... in float32
    components.cast_keeping_fp32_modules(dit, torch.bfloat16)
    for name, p in dit.named_parameters():
        want = torch.float32 if any(k in name.split(".") for k in keep) else torch.bfloat16
        assert p.dtype == want, name
    assert {p.dtype for p in dit.parameters()} == {torch.float32, torch.bfloat16}


# the generic rung is plain torch: check it against the oracle on CPU tensors here

def test_torch_fallbacks_match_the_oracle_on_any_device():
    x, v, noise = _rand(2, 4, 2, 6, 6, seed=1), _rand(2, 4, 2, 6, 6, seed=2), _rand(2, 4, 2, 6, 6, seed=3)
    np.testing.assert_allclose(torch_kernels.flow_match_step(x, v, 0.75, 0.5).numpy(),
                               reference.flow_match_step(x.numpy(), v.numpy(), 0.75, 0.5), rtol=RTOL, atol=ATOL)
    out = torch_kernels.flow_sde_step(x, v, 1.0, 0.9, noise=noise, sigma_max=0.9)
    ref = reference.flow_sde_step(x.numpy(), v.numpy(), 1.0, 0.9, noise=noise.numpy(), sigma_max=0.9)
    for got, want in zip(out, ref):
        np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=ATOL)
    again = torch_kernels.flow_sde_step(x, v, 1.0, 0.9, prev_sample=out.sample, sigma_max=0.9)
    assert torch.equal(out.log_prob, again.log_prob)


def test_attention_ops_match_the_oracle_on_cpu():
    q, k, v = _rand(2, 2, 5, 8, seed=4), _rand(2, 2, 7, 8, seed=5), _rand(2, 2, 7, 8, seed=6)
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(7)) > 0.3
    mask[..., 0] = True
    for attn in (torch_kernels.attention, torch_kernels.attention_fast):
        for m in (None, mask):
            np.testing.assert_allclose(
                attn(q, k, v, attn_mask=m, scale=0.3).numpy(),
                reference.attention(q.numpy(), k.numpy(), v.numpy(), None if m is None else m.numpy(), scale=0.3),
                rtol=1e-5, atol=1e-5)


# -- GPU only ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_platform():
    reg = flowseam.seam.discovery.discover(refresh=True)
    rec = reg.records.get("cuda")
    if rec is None or not rec.usable:
        pytest.skip(f"cuda backend not usable: {rec.reason if rec else 'not installed'}")
    yield flowseam.Platform("cuda", registry=reg)
    flowseam.seam.discovery._CACHE = None


def _gpu_kernels(platform):
    chain = platform.arch_chain
    if "sm80" not in chain:
        pytest.skip(f"the cupy kernels need sm80+, this GPU's chain is {chain}")
    return platform.kernels.get(ops.FLOW_MATCH_STEP), platform.kernels.get(ops.FLOW_SDE_STEP)


@needs_cupy
def test_gpu_arch_chain_and_resolution(cuda_platform):
    cap = torch.cuda.get_device_capability()
    assert list(cuda_platform.arch_chain) == device.arch_chain_for(cap)
    assert cuda_platform.device_chain == ("cuda", "cpu")
    for op in ops.ALL_OPS:
        prov = cuda_platform.kernels.get(op).provenance
        assert (prov.plugin, prov.device) == ("cuda", "cuda")
        assert prov.arch == ("sm80" if cap >= (8, 0) and op in FUSED_OPS else "generic")


@needs_cupy
@pytest.mark.parametrize("x_dtype,v_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float32, torch.bfloat16), (torch.float16, torch.float32),
                                             (torch.float64, torch.float64)])
def test_gpu_flow_match_step_matches_oracle(cuda_platform, x_dtype, v_dtype):
    euler, _ = _gpu_kernels(cuda_platform)
    x = _rand(2, 16, 3, 20, 24, seed=1, dtype=x_dtype, device="cuda")
    v = _rand(2, 16, 3, 20, 24, seed=2, dtype=v_dtype, device="cuda")
    out = euler(x, v, 0.75, 0.5)
    assert out.dtype == x_dtype and out.shape == x.shape and out.is_cuda
    rtol, atol = reference.TOLERANCES[str(x_dtype).removeprefix("torch.")]
    want = reference.flow_match_step(x.double().cpu().numpy(), v.double().cpu().numpy(), 0.75, 0.5)
    np.testing.assert_allclose(out.double().cpu().numpy(), want, rtol=rtol, atol=atol)
    generic = torch_kernels.flow_match_step(x, v, 0.75, 0.5)  # same rounding to x's dtype
    np.testing.assert_allclose(out.double().cpu().numpy(), generic.double().cpu().numpy(), rtol=rtol, atol=atol)


@needs_cupy
@pytest.mark.parametrize("sigma,sigma_next,sigma_max", [(1.0, 0.9, 0.9), (0.6, 0.45, None), (0.1, 0.0, None)])
@pytest.mark.parametrize("shape", [(3, 4, 2, 6, 6), (2, 16, 21, 30, 52)])  # one block / many blocks per sample
def test_gpu_flow_sde_step_matches_oracle(cuda_platform, sigma, sigma_next, sigma_max, shape):
    _, sde = _gpu_kernels(cuda_platform)
    x, v, noise = (_rand(*shape, seed=s, device="cuda") for s in (5, 6, 7))
    out = sde(x, v, sigma, sigma_next, noise=noise, noise_level=0.7, sigma_max=sigma_max)
    ref = reference.flow_sde_step(x.cpu().numpy(), v.cpu().numpy(), sigma, sigma_next, noise=noise.cpu().numpy(),
                                  noise_level=0.7, sigma_max=sigma_max)
    assert out.sample.dtype == torch.float32 and out.log_prob.shape == (shape[0],) and out.std.shape == ()
    for got, want in zip(out, ref):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=RTOL, atol=ATOL)


@needs_cupy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_flow_sde_step_c2_exact_and_close_to_torch(cuda_platform, dtype):
    _, sde = _gpu_kernels(cuda_platform)
    x, v = _rand(2, 16, 5, 30, 52, seed=8, dtype=dtype, device="cuda"), _rand(2, 16, 5, 30, 52, seed=9, dtype=dtype, device="cuda")
    rollout = sde(x, v, 0.8, 0.6, generator=torch.Generator("cuda").manual_seed(3))
    assert rollout.sample.dtype == dtype and rollout.log_prob.dtype == torch.float32
    again = sde(x, v, 0.8, 0.6, prev_sample=rollout.sample)
    assert torch.equal(rollout.log_prob, again.log_prob)                 # C2, bit for bit
    v_grad = v.clone().requires_grad_(True)
    update = sde(x, v_grad, 0.8, 0.6, prev_sample=rollout.sample)
    assert torch.equal(rollout.log_prob, update.log_prob.detach())
    # the torch fallback draws the same noise from the same generator state
    ref = torch_kernels.flow_sde_step(x, v, 0.8, 0.6, generator=torch.Generator("cuda").manual_seed(3))
    rtol, atol = reference.TOLERANCES[str(dtype).removeprefix("torch.")]
    np.testing.assert_allclose(rollout.sample.float().cpu().numpy(), ref.sample.float().cpu().numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(rollout.log_prob.cpu().numpy(), ref.log_prob.cpu().numpy(), rtol=RTOL, atol=ATOL)
    # gradients through mean only, equal to autograd through the torch ops
    v_ref = v.clone().requires_grad_(True)
    ref_update = torch_kernels.flow_sde_step(x, v_ref, 0.8, 0.6, prev_sample=rollout.sample)
    (update.log_prob.sum() + update.mean.square().mean()).backward()
    (ref_update.log_prob.sum() + ref_update.mean.square().mean()).backward()
    np.testing.assert_allclose(v_grad.grad.float().cpu().numpy(), v_ref.grad.float().cpu().numpy(), rtol=rtol, atol=atol)


@needs_cupy
def test_gpu_kernels_run_on_the_current_torch_stream(cuda_platform):
    euler, sde = _gpu_kernels(cuda_platform)
    x, v, noise = (_rand(4, 16, 9, 60, 104, seed=s, device="cuda") for s in (10, 11, 12))
    want_x, want = euler(x, v, 0.5, 0.4), sde(x, v, 0.5, 0.4, noise=noise)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got_x, got = euler(x, v, 0.5, 0.4), sde(x, v, 0.5, 0.4, noise=noise)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(got_x, want_x) and torch.equal(got.log_prob, want.log_prob) and torch.equal(got.sample, want.sample)


@needs_cupy
def test_gpu_attention_matches_the_oracle(cuda_platform):
    attn = cuda_platform.kernels.get(ops.ATTENTION)
    q, k, v = (_rand(2, 4, 64, 64, seed=s, dtype=torch.bfloat16, device="cuda") for s in (13, 14, 15))
    want = reference.attention(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy())
    np.testing.assert_allclose(attn(q, k, v).float().cpu().numpy(), want, rtol=2e-2, atol=2e-2)
    mask = torch.rand(2, 1, 64, 64, device="cuda") > 0.3
    mask[..., 0] = True
    qf, kf, vf = q.float(), k.float(), v.float()
    want = reference.attention(qf.cpu().numpy(), kf.cpu().numpy(), vf.cpu().numpy(), mask.cpu().numpy())
    np.testing.assert_allclose(attn(qf, kf, vf, attn_mask=mask).cpu().numpy(), want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from flowseam.testing.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint("wan2.1-t2v", tmp_path_factory.mktemp("cuda") / "wan",
                                 transformer={"num_layers": 1})


@needs_gpu
def test_gpu_components_dtypes_and_parity_with_cpu(cuda_platform, tiny_wan):
    cpu = flowseam.Platform("cpu")
    dit_spec = ComponentSpec("transformer", "diffusers.WanTransformer3DModel", str(tiny_wan), "transformer")
    vae_spec = ComponentSpec("vae", "diffusers.AutoencoderKLWan", str(tiny_wan), "vae")
    dit = cuda_platform.build_component("dit", dit_spec)
    assert next(dit.parameters()).is_cuda
    assert {p.dtype for p in dit.parameters()} == {torch.bfloat16, torch.float32}  # + kept fp32 modules
    ref_dit = cpu.build_component("dit", dit_spec)
    dit32 = cuda_platform.build_component("dit", dataclasses.replace(dit_spec, dtype="float32"))
    latents, t, text = _rand(1, 16, 2, 8, 8, seed=20), torch.tensor([700.0]), _rand(1, 6, 32, seed=21)
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            want = ref_dit(latents, t, text, return_dict=False)[0]
            got32 = dit32(latents.cuda(), t.cuda(), text.cuda(), return_dict=False)[0].cpu()
            # like a pipeline, feed the bf16 DiT bf16 inputs
            got16 = dit(latents.cuda().bfloat16(), t.cuda(), text.cuda().bfloat16(),
                        return_dict=False)[0].float().cpu()
            vae, ref_vae = cuda_platform.build_component("vae", vae_spec), cpu.build_component("vae", vae_spec)
            video = _rand(1, 3, 5, 32, 32, seed=22).clamp(-1, 1)
            z = vae.encode(video.cuda()).latent_dist.mode()
            z_ref = ref_vae.encode(video).latent_dist.mode()
            decoded, decoded_ref = vae.decode(z).sample.cpu(), ref_vae.decode(z_ref).sample
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert (got32 - want).abs().max().item() < 1e-4
    assert (got16 - want).norm() / want.norm() < 5e-2  # bf16 DiT: relative error
    assert (z.cpu() - z_ref).abs().max().item() < 1e-4
    assert (decoded - decoded_ref).abs().max().item() < 1e-4
    assert cuda_platform.component_plan("tokenizer") == ("cpu", "cpu", True)


@needs_gpu
def test_gpu_offload_model_keeps_each_component_on_the_gpu_only_while_it_runs(cuda_platform, tiny_wan):
    """``offload="model"`` (diffusers' ``enable_model_cpu_offload``): after loading, every module
    is on the CPU; the text encoder, the DiT and the VAE each run on the GPU and the previous
    one goes back; the frames equal a run without offload (the same kernels, the same device)."""
    params = flowseam.DiffusionParams(num_steps=2, height=32, width=32, num_frames=5,
                                      guidance_scale=5.0, seed=3)
    plain = flowseam.load(tiny_wan, platform=cuda_platform, quiet=True, dtype="float32")
    want = plain.generate("a red ball", params=params).frames
    del plain
    model = flowseam.load(tiny_wan, platform=cuda_platform, quiet=True, dtype="float32",
                          offload="model")
    names = [n for n, c in model.components.items() if isinstance(c, torch.nn.Module)]
    assert all(next(model.components[n].parameters()).device.type == "cpu" for n in names)
    ran = []  # (component, the device it ran on, the other modules on the GPU meanwhile)
    on_gpu = lambda n: next(model.components[n].parameters()).is_cuda  # noqa: E731
    for name in names:  # the VAE decodes through vae.decode: its decoder's forward runs then
        module = model.components[name]
        watched = module.decoder if hasattr(module, "decoder") else module
        watched.register_forward_hook(lambda m, args, out, name=name: ran.append(
            (name, on_gpu(name), sorted(o for o in names if o != name and on_gpu(o)))))
    got = model.generate("a red ball", params=params).frames
    assert {(n, gpu) for n, gpu, _ in ran} == {(n, True) for n in names}, ran
    assert all(others == [] for _, _, others in ran), ran
    assert np.abs(got - want).max() <= 1e-5
