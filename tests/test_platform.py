"""Platform, KernelTable, pinning, components and fallback, explain, and a spawn round trip."""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch
from conftest import plugin_env

import flowseam
from flowseam import ComponentSpec, KernelPinError, ops

#: platform resolution depends on which backends are installed: rerun in the blocked-backend pass
pytestmark = pytest.mark.backends

TINY_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                rope_max_seq_len=32)
TINY_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False])


def test_detect_picks_cpu_here_and_chain_ends_in_cpu():
    with plugin_env():
        p = flowseam.Platform.detect()
        assert p.device_chain[-1] == "cpu"
        assert p.arch_chain[-1] == "generic"


def test_unknown_backend_lists_backends_and_reasons(fixture_plugins_dir):
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,unavailable_dev") as reg:
        with pytest.raises(flowseam.BackendUnavailableError) as e:
            flowseam.Platform("tpu9000", registry=reg)
        msg = str(e.value)
        assert "'tpu9000'" in msg and "cpu (flowseam-cpu" in msg and "no NPU driver" in msg
        with pytest.raises(flowseam.BackendUnavailableError, match="unavailable: no NPU driver"):
            flowseam.Platform("unavailable_dev", registry=reg)


def test_kernel_lookup_provenance_unknown_op_and_pin():
    with plugin_env():
        p = flowseam.Platform("cpu")
        k = p.kernels.get(ops.FLOW_SDE_STEP)
        prov = k.provenance
        assert (prov.op, prov.plugin, prov.distribution, prov.device, prov.arch) == \
            (ops.FLOW_SDE_STEP, "cpu", "flowseam-cpu", "cpu", "generic")
        assert k.impl_id == f"cpu:flow_sde_step:cpu:generic:flowseam-cpu=={prov.version}"
        assert p.kernels.get(ops.FLOW_SDE_STEP) is k  # resolved once
        assert p.kernels.pin(k.impl_id) is k
        with pytest.raises(flowseam.UnknownOpError, match=r"'fused_rmsnorm'.*registered ops: \['attention'"):
            p.kernels.get("fused_rmsnorm")
        bogus = "cuda:flow_sde_step:cuda:sm90:flowseam-cuda==0.1.0"
        with pytest.raises(KernelPinError) as e:
            p.kernels.pin(bogus)
        assert bogus in str(e.value) and k.impl_id in str(e.value)


def test_lookups_never_call_pluggy(monkeypatch):
    with plugin_env():
        p = flowseam.Platform("cpu")

        def fail(*a, **k):
            raise AssertionError("pluggy was called during a kernel lookup")

        monkeypatch.setattr(p._registry, "call", fail)
        monkeypatch.setattr(p._registry.pm, "_hookexec", fail)
        for op in ops.ALL_OPS:
            p.kernels.pin(p.kernels.get(op).impl_id)


def test_arch_walk_skips_rungs_not_on_the_chain_and_losers_stay_pinnable(fixture_plugins_dir):
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a,testdev_b") as reg:
        p = flowseam.Platform("testdev_a", registry=reg)
        assert p.device_chain == ("testdev", "cpu")
        assert p.arch_chain == ("tdv2", "tdv1", "generic")
        ids = p.kernels.available_ids()
        assert not any(":tdv9:" in i for i in ids)  # not on testdev's chain
        assert "testdev_b:flow_match_step:testdev:tdv1:flowseam-fixture-testdev==0.0.1" in ids
        loser = p.kernels.pin("testdev_b:flow_match_step:testdev:tdv1:flowseam-fixture-testdev==0.0.1")
        assert loser.provenance.plugin == "testdev_b"
        # ops the testdev backends leave out fall back to cpu
        sde = p.kernels.get(ops.FLOW_SDE_STEP)
        assert sde.provenance.device == "cpu"
        x, v = torch.randn(2, 8), torch.randn(2, 8)
        torch.testing.assert_close(p.kernels.get(ops.FLOW_MATCH_STEP)(x, v, 0.5, 0.25), x - 0.25 * v)


def test_build_component_records_device_plugin_and_fallback(fixture_plugins_dir, tmp_path):
    import diffusers

    torch.manual_seed(0)
    diffusers.WanTransformer3DModel(**TINY_WAN).save_pretrained(tmp_path / "transformer")
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a") as reg:
        p = flowseam.Platform("testdev_a", registry=reg)
        dit = p.build_component("dit", ComponentSpec("transformer", "diffusers.WanTransformer3DModel",
                                                     path=str(tmp_path), subfolder="transformer"))
        vae = p.build_component("vae", ComponentSpec("vae", "diffusers.AutoencoderKLWan", config=TINY_VAE))
        assert isinstance(dit, diffusers.WanTransformer3DModel)
        assert next(dit.parameters()).dtype == torch.float32
        loaded = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "transformer")
        for a, b in zip(dit.state_dict().values(), loaded.state_dict().values()):
            assert torch.equal(a, b)
        assert isinstance(vae, diffusers.AutoencoderKLWan)
        rec_dit, rec_vae = p.components
        assert (rec_dit.device, rec_dit.plugin, rec_dit.fallback) == ("cpu", "cpu", True)
        assert "no plugin serving 'testdev' builds 'dit'" in rec_dit.reason
        assert (rec_vae.device, rec_vae.plugin, rec_vae.fallback) == ("testdev", "testdev_a", False)
        text = p.explain()
        assert "transformer" in text and "no plugin serving 'testdev' builds 'dit'" in text


def test_explain_lists_every_op():
    with plugin_env():
        text = flowseam.Platform("cpu").explain()
        for op in ops.ALL_OPS:
            assert op in text


def _worker(platform, x, v):
    import flowseam.seam.discovery

    step = platform.kernels.get(ops.FLOW_MATCH_STEP)
    return ({op: k.impl_id for op, k in platform.kernels.resolved().items()},
            flowseam.seam.discovery.DISCOVERY_SCANS, step(x, v, 0.5, 0.25), platform.device_chain)


def test_platform_round_trips_through_a_spawned_process(fixture_plugins_dir):
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a,testdev_b") as reg:
        p = flowseam.Platform("testdev_b", registry=reg)
        assert flowseam.Platform.from_dict(pickle.loads(pickle.dumps(p.to_dict()))).to_dict() == p.to_dict()
        x, v = torch.randn(2, 8), torch.randn(2, 8)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            ids, scans, out, chain = pool.apply(_worker, (p, x, v))
    assert ids == {op: k.impl_id for op, k in p.kernels.resolved().items()}
    assert scans == 0  # the worker imported the plugins it was given; it never scanned entry points
    assert chain == ("testdev", "cpu")
    torch.testing.assert_close(out, x - 0.25 * v)


def test_rebuilt_platform_refuses_a_different_plugin_version():
    """Another version of a plugin, or a plugin resolving other kernels here, is named as that
    plugin's fault (exit 3), never "bad input"."""
    from flowseam.cli.boundary import EXIT_PLUGIN_FAULT, report

    with plugin_env():
        data = flowseam.Platform("cpu").to_dict()
    wrong = {**data, "plugins": [{**data["plugins"][0], "version": "9.9.9"}, *data["plugins"][1:]]}
    with pytest.raises(flowseam.PluginLoadError, match="flowseam-cpu==9.9.9") as info:
        flowseam.Platform.from_dict(wrong)
    assert info.value.plugin == "cpu" and report(info.value) == EXIT_PLUGIN_FAULT
    # a plugin that registers other kernels on another host (accel registers at its host's own
    # arch rung): the plugins and kernels named, the user's setup to fix, never "bad input"
    other = "accel:flow_match_step:accel:x86_64-avx512:flowseam-accel==0.1.0"
    tampered = {**data, "kernels": {**data["kernels"], ops.FLOW_MATCH_STEP: other}}
    with pytest.raises(flowseam.PluginLoadError, match=r"plugin\(s\) accel, cpu resolve other "
                       r"kernels .* flow_match_step: cpu:flow_match_step:cpu:generic:flowseam-cpu"
                       r"==0.1.0 here, accel:flow_match_step") as info:
        flowseam.Platform.from_dict(tampered)
    assert report(info.value) == EXIT_PLUGIN_FAULT
