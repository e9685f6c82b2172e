"""Issue 11's regression list: one test per example of its four rules (nothing unsafe is loaded;
no silent wrong output; a plugin fault is always named and never silently wins; files are safe
under faults and concurrency). The command-line inputs of the survey are rows of
tests/test_hostile_inputs.py; these are the cases that need a run, a plugin or a process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import plugin_env, run_cli
from PIL import Image
from test_hostile_inputs import png_bytes

import flowseam
from flowseam import (
    CheckpointError,
    ComponentFaultError,
    DiffusionParams,
    FlowseamError,
    KernelArgumentError,
    KernelFaultError,
    UnsafeCheckpointError,
    UntrustedComponentError,
    cli,
    media,
)
from flowseam.testing.tiny import write_tiny_checkpoint
from flowseam.training.checkpoint import latest_checkpoint, save_checkpoint
from flowseam.training.metrics import MetricsWriter, read_metrics

HOSTILE = "flowseam-fixture-hostile"
SMALL = dict(num_steps=2, height=32, width=32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening-ckpt")
    return {"flux": write_tiny_checkpoint("flux.1-t2i", root / "flux"),
            "t2v": write_tiny_checkpoint("wan2.1-t2v", root / "t2v")}


@pytest.fixture()
def cpu():
    flowseam.seam.discovery._CACHE = None
    return flowseam.Platform("cpu")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# == Rule 1: nothing unsafe is loaded ============================================================

def _module_and_optimizer():
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    module(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return module, optimizer


class _Payload:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_resume_refuses_a_planted_pickle_and_never_runs_it(tmp_path):
    module, optimizer = _module_and_optimizer()
    step = save_checkpoint(tmp_path, 1, {"dit": module}, {"dit": optimizer}, {})
    assert [p.name for p in step.glob("*.pt")] == ["optimizer-dit.pt"]  # no pickle but the optimizer's
    assert (step / "rng.safetensors").is_file() and (step / "rng.json").is_file()
    marker = tmp_path / "pwned"
    torch.save({"state": _Payload(f"touch {marker}"), "param_groups": []}, step / "optimizer-dit.pt")
    from flowseam.training.checkpoint import load_checkpoint

    with pytest.raises(UnsafeCheckpointError, match=r"optimizer-dit\.pt needs more than tensors.*system"):
        load_checkpoint(step, {"dit": module}, {"dit": optimizer})
    assert not marker.exists()
    # an RNG pickle from an older flowseam is refused by name too, never unpickled
    (step / "rng.safetensors").unlink()
    torch.save({"torch": torch.get_rng_state(), "numpy": _Payload(f"touch {marker}")}, step / "rng.pt")
    torch.save(optimizer.state_dict(), step / "optimizer-dit.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"rng\.pt, a pickle"):
        load_checkpoint(step, {"dit": module}, {"dit": optimizer})
    assert not marker.exists()
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(FlowseamError, match=r"names '\.\./\.\./etc', which is not a checkpoint"):
        latest_checkpoint(tmp_path)


def test_model_index_naming_any_module_is_refused_without_importing_it(ckpts, cpu, tmp_path,
                                                                       monkeypatch):
    bad = _copy(ckpts["flux"], tmp_path / "ckpt")
    marker = tmp_path / "imported"
    (bad / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                    "from diffusers import AutoencoderKL\n")
    index = json.loads((bad / "model_index.json").read_text())
    index["vae"] = ["evilmod", "AutoencoderKL"]
    (bad / "model_index.json").write_text(json.dumps(index))
    monkeypatch.syspath_prepend(str(bad))  # as if flowseam was started from that folder
    monkeypatch.chdir(bad)
    with pytest.raises(UntrustedComponentError, match=r"'vae'.*module 'evilmod'.*not imported"):
        flowseam.load(bad, platform=cpu)
    assert not marker.exists() and "evilmod" not in sys.modules
    index["vae"] = ["diffusers", "os.system"]
    (bad / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UntrustedComponentError, match="expected \\[library, ClassName\\]"):
        flowseam.load(bad, platform=cpu)


def test_a_class_a_plugin_declares_is_allowed(ckpts, isolated_plugin, tmp_path):
    ckpt = _copy(ckpts["flux"], tmp_path / "ckpt")
    index = json.loads((ckpt / "model_index.json").read_text())
    index["vae"] = ["fixture_hostile.models", "FixtureAutoencoderKL"]
    (ckpt / "model_index.json").write_text(json.dumps(index))
    with plugin_env(isolated_plugin(HOSTILE), FLOWSEAM_PLUGINS="cpu,models") as reg:
        assert reg.records["models"].component_classes == ("fixture_hostile.models.FixtureAutoencoderKL",)
        model = flowseam.load(ckpt, platform=flowseam.Platform("cpu", registry=reg))
        assert type(model.components["vae"]).__name__ == "FixtureAutoencoderKL"
    with plugin_env(isolated_plugin(HOSTILE), FLOWSEAM_PLUGINS="cpu") as reg:  # not installed
        with pytest.raises(UntrustedComponentError, match="fixture_hostile.models"):
            flowseam.load(ckpt, platform=flowseam.Platform("cpu", registry=reg))


# == Rule 2: no silent wrong output ==============================================================

def test_image_modes_are_converted_with_their_real_values(tmp_path):
    # 16-bit greyscale: value v is v / 257 in 8 bits (today's convert("RGB") clips it to white)
    grey16 = (np.arange(64).reshape(8, 8) * 1000).astype(np.uint16)
    (tmp_path / "g16.png").write_bytes(png_bytes(grey16, 16, 0))
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    rgb = np.asarray(media.read_image(tmp_path / "g16.png"))
    assert rgb.shape == (8, 8, 3)
    assert np.array_equal(rgb[..., 0], np.round(grey16 / 257.0).astype(np.uint8))
    assert np.array_equal(rgb[..., 0], rgb[..., 2]) and int(rgb.max()) < 255
    # 16-bit RGB: the high byte of each sample
    rgb16 = (np.random.RandomState(0).rand(4, 4, 3) * 65535).astype(np.uint16)
    (tmp_path / "rgb16.png").write_bytes(png_bytes(rgb16, 16, 2))
    assert np.abs(np.asarray(media.read_image(tmp_path / "rgb16.png")).astype(int) - rgb16 / 257.0).max() <= 1
    # palette: the palette's colours
    pal = Image.new("P", (2, 1))
    pal.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    pal.putpixel((1, 0), 1)
    pal.save(tmp_path / "p.png")
    assert np.asarray(media.read_image(tmp_path / "p.png")).tolist() == [[[10, 20, 30], [200, 100, 50]]]
    # CMYK without a profile: R = 255 (1 - C/255)(1 - K/255)
    Image.new("CMYK", (1, 1), (100, 50, 0, 40)).save(tmp_path / "c.jpg", quality=100)
    c = np.asarray(media.read_image(Image.new("CMYK", (1, 1), (100, 50, 0, 40))))[0, 0]
    assert c.tolist() == [round(255 * (1 - x / 255) * (1 - 40 / 255)) for x in (100, 50, 0)]
    # greyscale with alpha: the grey value (alpha dropped, as diffusers' load_image does)
    Image.new("LA", (1, 1), (77, 9)).save(tmp_path / "la.png")
    assert np.asarray(media.read_image(tmp_path / "la.png")).tolist() == [[[77, 77, 77]]]
    # arrays: NaN and out-of-range values are refused, not clipped
    with pytest.raises(ValueError, match="non-finite"):
        media.read_image(np.full((4, 4, 3), np.nan, np.float32))
    with pytest.raises(ValueError, match=r"values in \[2, 2\]; expected \[0, 1\]"):
        media.read_image(np.full((4, 4, 3), 2.0, np.float32))


@pytest.mark.parametrize("change,words", [
    ({"num_layers": 1}, ["unexpected", "in the weights but not in the model", "blocks.1."]),
    ({"num_layers": 3}, ["missing", "in the model but not in the weights", "blocks.2."]),
    ({"ffn_dim": 48}, ["blocks.0.ffn", "48", "64"]),
])
def test_a_config_that_disagrees_with_its_weights_is_an_error_naming_the_tensors(ckpts, cpu, tmp_path,
                                                                                   change, words):
    ckpt = _copy(ckpts["t2v"], tmp_path / "ckpt")
    config = json.loads((ckpt / "transformer" / "config.json").read_text())
    (ckpt / "transformer" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(CheckpointError) as info:
        flowseam.load(ckpt, platform=cpu)
    for word in words + ["'transformer'"]:
        assert word in str(info.value), str(info.value)


def _finetune_config(tmp_path: Path, ckpt: Path, **over) -> dict:
    (tmp_path / "data").mkdir(exist_ok=True)
    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(tmp_path / "data" / "a.png")
    (tmp_path / "data" / "d.jsonl").write_text('{"prompt": "a ball", "image": "a.png"}\n')
    return {"model": str(ckpt), "backend": "cpu", "data": str(tmp_path / "data" / "d.jsonl"),
            "batch_size": 1, "output_dir": str(tmp_path / "run"), "checkpoint_every": 1,
            "sampling": {"height": 32, "width": 32, "max_sequence_length": 16},
            "train": {"p_uncond": 0.0}, **over}


def test_non_finite_weights_stop_the_run_before_a_checkpoint_holds_them(ckpts, tmp_path):
    from flowseam.training.finetune import Finetune
    from flowseam.training.guards import NonFiniteTrainingError

    # lr 1e30 is finite (the schema refuses inf); the weights blow up after the first update
    ft = Finetune(_finetune_config(tmp_path, ckpts["flux"], steps=5, optim={"lr": 1e30}))
    with pytest.raises(NonFiniteTrainingError, match="not finite|gradient norm is"):
        ft.run(progress=False)
    for step in sorted((tmp_path / "run" / "checkpoints").glob("step-*")):
        from safetensors.torch import load_file

        weights = load_file(str(step / "weights-dit.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), step.name
    assert ft.step < 5


def test_resume_with_another_config_is_refused_listing_the_keys(ckpts, tmp_path):
    from flowseam.training.finetune import Finetune

    Finetune(_finetune_config(tmp_path, ckpts["flux"], steps=1)).run(progress=False)
    with pytest.raises(FlowseamError, match=r"optim\.lr: 0\.0001 -> 0\.0002.*train\.p_uncond"):
        Finetune(_finetune_config(tmp_path, ckpts["flux"], steps=2, optim={"lr": 2e-4},
                                  train={"p_uncond": 0.5}))
    # a torn last metrics line (a full disk) never blocks the resume; steps may change
    with open(tmp_path / "run" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "loss": 0.')
    (tmp_path / "run" / "checkpoints" / ".step-000002.x1y2").mkdir()  # an interrupted save
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:2: incomplete last line"):
        Finetune(_finetune_config(tmp_path, ckpts["flux"], steps=2)).run(progress=False)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert not list((tmp_path / "run" / "checkpoints").glob(".step-*"))


# == Rule 3: a plugin fault is always named, and never silently wins =============================

@pytest.fixture(scope="module")
def hostile_registry(isolated_plugin):
    """The hostile package's faulty backend, name-taking and cpu-serving plugins, discovered once.
    The registry outlives ``plugin_env`` (its plugins are imported), so nothing else in this
    process discovers the hostile package again."""
    with plugin_env(isolated_plugin(HOSTILE), FLOWSEAM_PLUGINS="cpu,faulty,aaa,methods,cpu_extra") as reg:
        pass
    return reg


@pytest.fixture(scope="module")
def faulty_model(hostile_registry, ckpts):
    os.environ.pop("FAULTY_MODE", None)
    return flowseam.load(ckpts["flux"], platform=flowseam.Platform("faulty", registry=hostile_registry))


def _names_the_plugin(exc: BaseException, what: str) -> None:
    text = str(exc)
    assert "plugin 'faulty'" in text and "flowseam-fixture-hostile 0.0.1" in text, text
    assert what in text and "--backend cpu" in text and "FLOWSEAM_DISABLE_PLUGINS=faulty" in text, text


@pytest.mark.parametrize("mode,words,cause", [
    ("raise", ["raised RuntimeError: faultydev: device lost"], RuntimeError),
    ("signature", ["raised TypeError", "positional argument"], TypeError),
    ("shape", ["shape (1, 4, 63)", "(1, 4, 64)", "at step 0"], None),
    ("dtype", ["dtype torch.float16", "at step 0"], None),
    ("device", ["device meta", "at step 0"], None),
    ("nan", ["non-finite latents from finite inputs at step 0 (sigma 1 ->"], None),
])
def test_a_faulty_kernel_is_named_with_its_impl_id(faulty_model, monkeypatch, mode, words, cause):
    monkeypatch.setenv("FAULTY_MODE", mode)
    with pytest.raises(KernelFaultError) as info:
        faulty_model.generate("a ball", params=DiffusionParams(**SMALL))
    impl = faulty_model.platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP).impl_id
    _names_the_plugin(info.value, "'flow_match_step'")
    assert info.value.impl_id == impl and impl in str(info.value)
    for word in words:
        assert word in str(info.value), str(info.value)
    if cause is not None:
        assert isinstance(info.value.__cause__, cause)


def test_running_out_of_memory_is_not_a_plugin_fault():
    """An allocator's error passes the kernel wrapper unchanged (the server answers it as
    ``out_of_memory``: tests/test_serve.py); any other exception is still named as the plugin's."""
    from flowseam.seam.declarations import Provenance
    from flowseam.seam.kernels import BoundKernel

    prov = Provenance("flow_match_step", "fixture", "flowseam-fixture", "0", "cpu", "any")
    cpu_oom = RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 1099511627776 bytes.")
    for exc in (MemoryError(), cpu_oom, torch.OutOfMemoryError("CUDA out of memory.")):
        def raising(*args, exc=exc):
            raise exc
        with pytest.raises(BaseException) as info:
            BoundKernel(raising, prov)(1)
        assert info.value is exc
    def crashing(*args):
        raise RuntimeError("boom")
    with pytest.raises(KernelFaultError, match="boom"):
        BoundKernel(crashing, prov)(1)


def test_the_step_check_is_one_sum_and_never_a_false_alarm():
    """The loops' finiteness test is one sum: a sum that overflows (finite float16 values) falls
    back to the element-wise test instead of raising; one NaN anywhere is still caught."""
    from flowseam.loops.checks import check_step

    kernel = flowseam.Platform("cpu").kernels.get(flowseam.ops.FLOW_MATCH_STEP)
    latents = torch.full((4, 1024), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(latents.sum())  # the cheap test alone would be a false alarm
    check_step(None, 0, kernel, latents, latents, latents.clone(), 1.0, 0.5)
    bad = latents.clone()
    bad[3, 17] = float("nan")
    with pytest.raises(KernelFaultError, match="non-finite latents from finite inputs at step 0"):
        check_step(None, 0, kernel, latents, latents, bad, 1.0, 0.5)


def test_a_faulty_sde_kernel_is_named_in_a_rollout(faulty_model, monkeypatch):
    monkeypatch.setenv("FAULTY_MODE", "nan")
    req = flowseam.GenerationRequest(["a ball"] * 2, flowseam.TaskType.T2I,
                                     DiffusionParams(sde_rollout=True, **SMALL), seeds=[1, 2])
    with pytest.raises(KernelFaultError, match="'flow_sde_step'.*non-finite latents"):
        flowseam.rollout_loop(faulty_model, req)
    # the contract's argument errors stay ValueErrors, named like every fault
    monkeypatch.setenv("FAULTY_MODE", "ok")
    step = faulty_model.platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP)
    with pytest.raises(KernelArgumentError, match="plugin 'faulty'.*sigma=1.5") as info:
        step(torch.zeros(1, 4), torch.zeros(1, 4), 1.5, 0.5)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("mode,words", [
    ("build_raise", ["failed to build transformer", "OSError: faultydev: firmware blob missing"]),
    ("build_str", ["returned a str ('transformer')", "instead of a component"]),
    ("dit_fp16", ["while predicting the velocity at step 0"]),
    ("dit_nan", ["predicted a non-finite velocity at step 0"]),
    ("dit_shape", ["velocity of shape (1, 4, 63)"]),
])
def test_a_faulty_component_is_named(hostile_registry, ckpts, monkeypatch, mode, words):
    monkeypatch.setenv("FAULTY_MODE", mode)
    with pytest.raises(ComponentFaultError) as info:
        model = flowseam.load(ckpts["flux"], platform=flowseam.Platform("faulty", registry=hostile_registry))
        monkeypatch.setenv("FAULTY_MODE", "ok")  # the kernels are fine; the DiT is not
        model.generate("a ball", params=DiffusionParams(**SMALL))
    _names_the_plugin(info.value, "'transformer' (kind dit)")
    for word in words:
        assert word in str(info.value), str(info.value)


@pytest.mark.parametrize("mode,error,words", [
    ("nan", KernelFaultError, ["'flow_match_step'", "non-finite latents from finite inputs at step 0"]),
    ("shape", KernelFaultError, ["'flow_match_step'", "at step 0"]),
    ("dit_nan", ComponentFaultError, ["'transformer' (kind dit)", "predicted a non-finite velocity at step 0"]),
])
def test_the_ltx2_loop_checks_every_step_like_the_others(hostile_registry, tmp_path_factory, monkeypatch,
                                                         mode, error, words):
    """LTX-2 steps its joint video+audio state with its own kernels: each step's velocity and
    kernel output are checked, and a fault names the plugin (and the kernel's impl_id)."""
    path = tmp_path_factory.getbasetemp() / "ltx2-faulty"
    if not path.exists():
        write_tiny_checkpoint("ltx2-t2v", path)
    monkeypatch.setenv("FAULTY_MODE", mode)
    model = flowseam.load(path, platform=flowseam.Platform("faulty", registry=hostile_registry), quiet=True)
    params = DiffusionParams(num_steps=2, height=64, width=64, num_frames=9, stages=1,
                             max_sequence_length=16)
    with pytest.raises(error) as info:
        model.generate("a dog", params=params)
    _names_the_plugin(info.value, words[0])
    for word in words[1:]:
        assert word in str(info.value), str(info.value)
    if error is KernelFaultError:
        assert info.value.impl_id == model.platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP).impl_id


def test_the_cli_names_a_plugin_fault_and_exits_3(hostile_registry, ckpts, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FAULTY_MODE", "raise")
    monkeypatch.setattr(flowseam.seam.discovery, "_CACHE", hostile_registry)  # what discover() returns
    status = cli.main(["generate", "--model", str(ckpts["flux"]), "--prompt", "a", "--steps", "1",
                       "--height", "32", "--width", "32", "--backend", "faulty",
                       "--output", str(tmp_path / "x.png")])
    err = capsys.readouterr().err
    assert status == cli.EXIT_PLUGIN_FAULT == 3
    assert "plugin fault: kernel 'flow_match_step' of plugin 'faulty'" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_method_and_reward_name_conflicts_never_win_silently(hostile_registry, monkeypatch):
    from flowseam.training import get_method, get_reward, registered_methods
    from flowseam.training.flowgrpo import FlowGRPO

    monkeypatch.setattr(flowseam.seam.discovery, "_CACHE", hostile_registry)
    with pytest.raises(FlowseamError, match=r"training method 'flowgrpo' is registered by 2 plugins: "
                                            r"'aaa' \(flowseam-fixture-hostile 0.0.1\), 'methods'"):
        get_method("flowgrpo")
    assert get_method("methods:flowgrpo") is FlowGRPO
    assert get_method("aaa:flowgrpo").__name__ == "NotFlowGRPO"
    assert "flowgrpo" not in registered_methods() and "aaa:flowgrpo" in registered_methods()
    with pytest.raises(FlowseamError, match="reward 'brightness' is registered by 2 plugins"):
        get_reward("brightness")
    conflicts = [str(c) for c in hostile_registry.name_conflicts()]
    assert conflicts == ["method 'flowgrpo': aaa (flowseam-fixture-hostile 0.0.1), methods (flowseam 0.1.0)",
                         "reward 'brightness': aaa (flowseam-fixture-hostile 0.0.1), methods (flowseam 0.1.0)"]
    assert "name conflicts" in flowseam.Platform("cpu", registry=hostile_registry).explain()


def test_a_third_party_plugin_serving_cpu_shows_in_the_main_table(hostile_registry):
    text = flowseam.Platform("cpu", registry=hostile_registry).explain()
    assert "cpu: cpu (flowseam-cpu 0.1.0), cpu_extra (flowseam-fixture-hostile 0.0.1)" in text
    row = next(line for line in text.splitlines() if line.startswith("  not chosen"))
    assert "cpu_extra" in row
    verbose = flowseam.Platform("cpu", registry=hostile_registry).explain(verbose=True)
    row = next(line for line in verbose.splitlines() if line.startswith("  not chosen"))
    assert "cpu_extra" in row and "cpu_extra:flow_match_step:cpu:generic" in row


def test_an_entry_point_named_cpu_from_another_distribution_displaces_nothing(isolated_plugin):
    with plugin_env(isolated_plugin("flowseam-fixture-cpu-squatter")) as reg:
        for key in ("cpu", "cpu@flowseam-fixture-cpu-squatter"):
            rec = reg.records[key]
            assert rec.status == "broken" and "claimed by 2 distributions" in rec.reason
            assert "flowseam-cpu 0.1.0" in rec.reason and "flowseam-fixture-cpu-squatter 0.0.1" in rec.reason
        with pytest.raises(flowseam.PluginLoadError,
                           match=r"'cpu' is broken \(flowseam-cpu 0.1.0\): entry-point name"):
            flowseam.Platform("cpu", registry=reg)


def test_discovery_survives_hangs_exits_prints_and_names_torch_patches(isolated_plugin, monkeypatch):
    target = isolated_plugin(HOSTILE)
    out = run_cli("backends", "--json", path=target, FLOWSEAM_PLUGINS="cpu,hangs,hard_exit,chatty,patcher",
                  FLOWSEAM_PLUGIN_TIMEOUT="3")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}  # print() at import did not corrupt it
    assert "chatty plugin: hello from import" in out.stderr and "registering rewards" in out.stderr
    assert rows["chatty"]["status"] == "active" and rows["chatty"]["rewards"] == ["chatty_constant"]
    assert rows["hangs"]["status"] == "broken"
    assert "did not finish importing plugin 'hangs'" in rows["hangs"]["reason"]
    assert "within 3 s" in rows["hangs"]["reason"]
    assert rows["hard_exit"]["status"] == "broken" and "called os._exit(7)" in rows["hard_exit"]["reason"]
    assert rows["patcher"]["patches"] == ["torch.nn.functional.scaled_dot_product_attention (import)"]
    assert rows["cpu"]["status"] == "active" and rows["cpu"]["patches"] == []
    table = run_cli("backends", path=target, FLOWSEAM_PLUGINS="cpu,patcher")
    assert "patches torch: torch.nn.functional.scaled_dot_product_attention (import)" in table.stdout
    assert "torch globals replaced by plugins:" in table.stdout
    from flowseam.seam.isolation import plugin_timeout  # read by discovery; a ValueError exits 2

    monkeypatch.setenv("FLOWSEAM_PLUGIN_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FLOWSEAM_PLUGIN_TIMEOUT='soon'"):
        plugin_timeout()
    monkeypatch.setenv("FLOWSEAM_PLUGIN_TIMEOUT", "0")
    assert plugin_timeout() is None


# == Rule 4: files are safe under faults and concurrency ==========================================

def test_a_second_run_on_an_output_dir_is_refused_naming_the_first(ckpts, tmp_path):
    from flowseam.training.finetune import Finetune

    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from flowseam.training.rundir import RunLock
            RunLock({str(tmp_path / 'run')!r}).acquire()
            print("locked", flush=True)
            time.sleep(120)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(FlowseamError, match=rf"in use by another run \(pid {holder.pid} on "):
            Finetune(_finetune_config(tmp_path, ckpts["flux"], steps=1))
    finally:
        holder.kill()
        holder.wait()
    from flowseam.training.rundir import RunLock

    RunLock(tmp_path / "run").check_free()  # the lock died with its process


def test_damaged_metrics_lines_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(FlowseamError, match=r"metrics\.jsonl:2: damaged metrics line"):
        read_metrics(path)
    path.write_text('{"step": 1}\n{"step": 2, "lo')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:2: incomplete last line"):
        assert read_metrics(path) == [{"step": 1}]


def test_a_full_disk_says_so_and_names_the_path(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # the kernel answers ENOSPC
    writer = MetricsWriter(tmp_path / "metrics.jsonl", append=True)
    with pytest.raises(FlowseamError, match=rf"no space left on device while writing {tmp_path}/metrics\.jsonl"):
        writer.write({"step": 1})
    writer.close()


def test_a_full_disk_during_a_checkpoint_or_an_output_keeps_the_previous_files(tmp_path):
    """On a real 256 kB tmpfs (in a private mount namespace, so the host sees nothing)."""
    script = textwrap.dedent("""
        import numpy as np, torch
        from flowseam import FlowseamError, media
        from flowseam.training.checkpoint import latest_checkpoint, save_checkpoint
        root = "/mnt/full"
        small = torch.nn.Linear(4, 4)
        save_checkpoint(root + "/ckpt", 1, {"dit": small}, {}, {})
        big = torch.nn.Linear(512, 512)  # 1 MB of weights on a 256 kB disk
        try:
            save_checkpoint(root + "/ckpt", 2, {"dit": big}, {}, {})
        except FlowseamError as exc:
            print("CKPT", exc)
        print("LATEST", latest_checkpoint(root + "/ckpt").name)
        import os; print("LEFT", sorted(os.listdir(root + "/ckpt")))
        try:
            media.write_output(root + "/x.png", np.random.RandomState(0).rand(512, 512, 3))
        except FlowseamError as exc:
            print("PNG", exc)
        print("FILES", sorted(os.listdir(root)))
    """)
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           f"mkdir -p /mnt/full && mount -t tmpfs -o size=256k tmpfs /mnt/full && "
           f"exec {sys.executable} -c \"$0\"", script]
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare -m (root or CAP_SYS_ADMIN) to mount a small tmpfs")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.strip().splitlines())
    assert "no space left on device while writing checkpoint /mnt/full/ckpt/.step-000002" in lines["CKPT"]
    assert lines["LATEST"] == "step-000001" and lines["LEFT"] == "['latest', 'step-000001']"
    assert "no space left on device while writing /mnt/full/x.png" in lines["PNG"]
    assert lines["FILES"] == "['ckpt']"


def test_overwriting_an_output_keeps_its_permissions(tmp_path):
    frames = np.random.RandomState(0).rand(1, 8, 8, 3)
    out = tmp_path / "a.png"
    media.write_output(out, frames)
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()
    out.chmod(0o640)
    media.write_output(out, frames)
    assert (out.stat().st_mode & 0o777) == 0o640


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_sigterm_while_writing_leaves_no_temporary_file(ckpts, tmp_path):
    """SIGTERM while the output is written (sent to this process by a watcher thread as soon as
    the atomic write's temporary file exists; the MP4 goes through an ffmpeg subprocess, a
    window of ~0.1-1 s) unwinds like Ctrl-C: exit status 143 and no temporary file, even when
    it lands right after the temporary file is created. A signal that lands after the rename (a
    loaded machine) finds a whole video."""
    import threading

    out = tmp_path / "clip.mp4"
    late: list[int] = []
    # while cli.main runs it installs its own handler; before and after, a late signal is only noted
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: late.append(signum))
    stop, sent = threading.Event(), threading.Event()

    def watch() -> None:
        while not stop.is_set():
            if list(tmp_path.glob(".clip.*.mp4")):
                sent.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        status = cli.main(["generate", "--model", str(ckpts["t2v"]), "--prompt", "a cat", "--steps", "1",
                           "--frames", "17", "--height", "64", "--width", "64", "--backend", "cpu",
                           "--output", str(out)])
    except SystemExit as exc:
        status = exc.code
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGTERM, previous)
    assert sent.is_set(), "the temporary file was never seen"
    assert [p.name for p in tmp_path.iterdir() if p != out] == []  # no temporary file
    assert status == (0 if late else cli.EXIT_TERMINATED) and cli.EXIT_TERMINATED == 143
    if out.exists():  # the signal came after the rename (a loaded machine): a whole video
        import imageio

        with imageio.get_reader(out, format="FFMPEG") as reader:
            assert reader.count_frames() == 17


def test_a_sigterm_a_finalizer_swallowed_still_exits_143(monkeypatch):
    """CPython runs a signal handler at the next bytecode, which may be inside a ``__del__``;
    there the handler's ``SystemExit`` is printed and dropped, and the command finishes. The
    process was still told to stop: ``main`` returns 143, never 0 (seen once in the test above
    on a quiet machine: exit 0, no signal recorded)."""
    class SignalsWhenCollected:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)  # _terminate runs here; its SystemExit is dropped

    real = cli.models.cmd_models  # the models command's module: its parser calls this name

    def models_then_collect(args):
        status = real(args)  # the real command runs, then an object is collected mid-command
        SignalsWhenCollected()
        return status

    dropped: list[type] = []  # what CPython reports as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: dropped.append(unraisable.exc_type))
    monkeypatch.setattr(cli.models, "cmd_models", models_then_collect)
    assert cli.main(["models"]) == cli.EXIT_TERMINATED
    assert dropped == [SystemExit]  # the handler ran and its exception was dropped
    monkeypatch.setattr(cli.models, "cmd_models", real)
    assert cli.main(["models"]) == 0  # the flag is per command


def test_a_streamed_output_creates_its_temporary_file_inside_with(tmp_path):
    """generate --stream: the writer creates nothing before its first frames (so no signal
    between building it and entering ``with`` can leave a file behind); a failure after them
    removes the temporary file and writes nothing at the output path."""
    from flowseam.media import StreamingVideoWriter

    out = tmp_path / "stream.mp4"
    writer = StreamingVideoWriter(out, fps=8)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="stopped"):
        with writer:
            writer.write(np.zeros((2, 16, 16, 3), np.float32))
            assert writer.tmp is not None and writer.tmp.exists()
            raise RuntimeError("stopped")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_hub_like_name_says_what_was_tried(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FlowseamError, match="'no-org/no-model' is not a local directory, and fetching "
                                            "it from the Hugging Face hub failed"):
        flowseam.load("no-org/no-model")
    (tmp_path / "outputs").mkdir()
    with pytest.raises(FlowseamError, match="directory 'outputs/ckpt' does not exist"):
        flowseam.load("outputs/ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FlowseamError, match="directory './ckpt' does not exist"):
            flowseam.load("./ckpt")
