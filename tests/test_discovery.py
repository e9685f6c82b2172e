"""Discovery through real installed entry points, broken and invalid plugin packages, strict
mode, allow/block lists and the kernel conflict policy."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from conftest import plugin_env, run_main

import flowseam
from flowseam import PluginLoadError

#: discovery and the backend table depends on which backends are installed: rerun in the blocked-backend pass
pytestmark = pytest.mark.backends


def test_cpu_backend_is_found_through_its_installed_entry_point():
    eps = {ep.name: ep for ep in metadata.entry_points(group="flowseam.plugins")}
    assert eps["cpu"].value == "flowseam_cpu.plugin"
    assert eps["cpu"].dist.metadata["Name"] == "flowseam-cpu"
    with plugin_env() as reg:
        rec = reg.records["cpu"]
        assert (rec.status, rec.distribution, rec.device) == ("available", "flowseam-cpu", "cpu")
        assert rec.version == metadata.version("flowseam-cpu")
        assert {k.op for k in rec.kernels} == set(flowseam.ops.ALL_OPS)


def test_core_never_imports_the_cpu_backend():
    import pathlib

    src = pathlib.Path(flowseam.__file__).parent
    offenders = [p for p in src.rglob("*.py") if "flowseam_cpu" in p.read_text()]
    assert offenders == []


def test_broken_plugins_are_reported_and_the_rest_keep_working(fixture_plugins_dir):
    allow = "cpu,broken_import,bad_signature,unknown_hook,raising_availability,unavailable_dev"
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS=allow) as reg:
        r = reg.records
        assert r["broken_import"].status == "broken"
        assert "flowseam_vendor_sdk_that_does_not_exist" in r["broken_import"].reason
        assert "Traceback" in r["broken_import"].traceback
        assert r["bad_signature"].status == "broken"
        assert "stream" in r["bad_signature"].reason  # pluggy names the unknown argument
        assert r["unknown_hook"].status == "broken"
        assert "flowseam_register_kernel" in r["unknown_hook"].reason
        assert r["raising_availability"].status == "broken"
        assert "driver handshake failed" in r["raising_availability"].reason
        assert r["unavailable_dev"].status == "unavailable"
        assert "no NPU driver" in r["unavailable_dev"].reason
        assert r["cpu"].status == "available"
        # the broken ones are unregistered from pluggy; cpu still serves
        assert not reg.pm.has_plugin("bad_signature")
        platform = flowseam.Platform.detect(registry=reg)
        assert platform.name == "cpu"
        assert platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP).provenance.plugin == "cpu"


def test_strict_mode_raises_naming_the_broken_plugin(fixture_plugins_dir):
    with pytest.raises(PluginLoadError, match="'broken_import'"):
        with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,broken_import", FLOWSEAM_STRICT="1"):
            pass
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,unavailable_dev", FLOWSEAM_STRICT="1") as reg:
        assert reg.records["unavailable_dev"].status == "unavailable"  # unavailable is not broken


def test_a_strict_switch_that_is_neither_on_nor_off_is_refused_naming_it(fixture_plugins_dir):
    # "ture" would otherwise read as off and let a broken plugin pass silently
    with pytest.raises(ValueError, match=r"FLOWSEAM_STRICT='ture' is not a switch: use one of 1, true"):
        with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,broken_import", FLOWSEAM_STRICT="ture"):
            pass
    for spelled in (" TRUE ", "on", "Yes"):
        with pytest.raises(PluginLoadError, match="'broken_import'"):
            with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,broken_import", FLOWSEAM_STRICT=spelled):
                pass
    for spelled in ("", "0", "Off"):
        with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,broken_import", FLOWSEAM_STRICT=spelled) as reg:
            assert reg.records["broken_import"].status == "broken"
    out = run_main("backends", path=fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu", FLOWSEAM_STRICT="2")
    assert out.returncode == 2, out.stderr
    assert "FLOWSEAM_STRICT='2' is not a switch" in out.stderr and "Traceback" not in out.stderr


def test_allow_and_block_lists(fixture_plugins_dir):
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu") as reg:
        assert reg.records["broken_import"].status == "blocked"
        assert "FLOWSEAM_PLUGINS" in reg.records["broken_import"].reason
        assert reg.records["cpu"].status == "available"
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS=None,
                    FLOWSEAM_DISABLE_PLUGINS="broken_import,bad_signature,unknown_hook,"
                                             "raising_availability,arch_raises,str_kinds,"
                                             "exits_on_import,dup_name") as reg:
        assert reg.records["bad_signature"].status == "blocked"
        assert "FLOWSEAM_DISABLE_PLUGINS" in reg.records["bad_signature"].reason
        assert reg.broken() == []
    with plugin_env(FLOWSEAM_DISABLE_PLUGINS="cpu") as reg:
        assert reg.records["cpu"].status == "blocked"
        with pytest.raises(flowseam.BackendUnavailableError, match="cpu .*blocked"):
            flowseam.Platform("cpu", registry=reg)


def test_conflict_same_priority_is_won_by_name_and_reported(fixture_plugins_dir):
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_b,testdev_a") as reg:
        platform = flowseam.Platform("testdev_b", registry=reg)
        k = platform.kernels.get(flowseam.ops.FLOW_MATCH_STEP)
        # arch walk: tdv2 has nothing, tdv1 hits; a and b tie on priority 7, 'testdev_a' < 'testdev_b'
        assert (k.provenance.plugin, k.provenance.device, k.provenance.arch) == ("testdev_a", "testdev", "tdv1")
        conflicts = [c for c in platform.conflicts if c.arch == "tdv1"]
        assert len(conflicts) == 1 and conflicts[0].winner.startswith("testdev_a:")
        assert conflicts[0].losers[0].startswith("testdev_b:")
        assert "conflicts:" in platform.explain()


def test_conflict_higher_priority_wins_regardless_of_name(fixture_plugins_dir):
    with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS="cpu,testdev_a,testdev_b,testdev_z") as reg:
        for order in ("testdev_a", "testdev_z"):
            k = flowseam.Platform(order, registry=reg).kernels.get(flowseam.ops.FLOW_MATCH_STEP)
            assert k.provenance.plugin == "testdev_z"
        assert flowseam.Platform.detect(registry=reg).name == "testdev_z"


def test_backends_cli_json_and_strict(fixture_plugins_dir):
    out = run_main("backends", "--json", path=fixture_plugins_dir,
                   FLOWSEAM_PLUGINS="cpu,broken_import,unavailable_dev")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    for r in rows.values():
        assert {"name", "distribution", "version", "status", "reason", "device", "ops",
                "components", "methods"} <= set(r)
    assert rows["cpu"]["status"] == "active" and rows["cpu"]["distribution"] == "flowseam-cpu"
    assert rows["broken_import"]["status"] == "broken"
    assert rows["unavailable_dev"]["status"] == "unavailable"
    assert rows["testdev_a"]["status"] == "blocked"
    strict = run_main("backends", "--strict", path=fixture_plugins_dir,
                      FLOWSEAM_PLUGINS="cpu,broken_import")
    assert strict.returncode != 0
    assert "broken_import" in strict.stdout + strict.stderr
    ok = run_main("backends", "--strict", FLOWSEAM_PLUGINS="cpu")
    assert ok.returncode == 0, ok.stderr
    assert "flow_sde_step" in ok.stdout and "cpu → " not in ok.stdout.splitlines()[0]


def test_misbehaving_hooks_mark_only_that_plugin_broken(fixture_plugins_dir):
    allow = "cpu,arch_raises,str_kinds,exits_on_import,dup_name"
    with pytest.warns(UserWarning, match="'nosuch'"):
        with plugin_env(fixture_plugins_dir, FLOWSEAM_PLUGINS=allow + ",nosuch") as reg:
            r = reg.records
            assert r["arch_raises"].status == "broken"
            assert "compute capability" in r["arch_raises"].reason
            assert r["str_kinds"].status == "broken" and "expected a list of names" in r["str_kinds"].reason
            assert r["exits_on_import"].status == "broken" and "SystemExit" in r["exits_on_import"].reason
            # two distributions claim "dup_name": neither is loaded, both are named
            for key in ("dup_name", "dup_name@flowseam-fixture-unknown-hook"):
                assert r[key].status == "broken" and r[key].methods == {}
                assert "claimed by 2 distributions" in r[key].reason
                assert "flowseam-fixture-misbehaving" in r[key].reason
                assert "flowseam-fixture-unknown-hook" in r[key].reason
            assert flowseam.Platform.detect(registry=reg).name == "cpu"
    out = run_main("backends", "--json", path=fixture_plugins_dir, FLOWSEAM_PLUGINS=allow)
    assert out.returncode == 0, out.stderr
    assert {r["name"]: r["status"] for r in json.loads(out.stdout)}["arch_raises"] == "broken"


def test_empty_allow_list_means_no_allow_list():
    with plugin_env(FLOWSEAM_PLUGINS=" , ") as reg:
        assert reg.records["cpu"].status == "available"


def test_discovery_imports_no_training_code():
    """Every flowseam.load discovers the plugins; the built-in methods are registered by import
    path, so a process that only generates imports none of them (nor pydantic, which their
    configs use)."""
    import subprocess
    import sys

    code = ("import sys, flowseam; reg = flowseam.seam.discovery.discover(); "
            "print(sorted(m for m in sys.modules if m.startswith('flowseam.training.') "
            "or m == 'pydantic')); print(sorted(reg.records['methods'].methods))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    imported, methods = out.stdout.splitlines()
    assert imported == "['flowseam.training.builtin']"
    assert methods == "['finetune', 'flowgrpo']"


def test_a_method_registered_by_import_path_is_imported_when_asked_for(monkeypatch):
    """A method given as "module:Class" resolves to the class on first use; a path that does not
    import is an error naming the plugin and the path; a value that is not a path breaks the
    plugin at discovery."""
    from flowseam.seam.hookspecs import hookimpl
    from flowseam.seam.discovery import PluginRegistry
    from flowseam.training import get_method
    from flowseam.training.finetune import Finetune

    class Lazy:
        @staticmethod
        @hookimpl
        def flowseam_training_methods():
            return {"tuned": "flowseam.training.finetune:Finetune",
                    "gone": "flowseam_no_such_package.methods:Gone"}

    class Malformed:
        @staticmethod
        @hookimpl
        def flowseam_training_methods():
            return {"odd": "flowseam.training.finetune.Finetune"}  # no ':'

    reg = PluginRegistry()
    reg.load("lazy", "tests:Lazy", "fixture-lazy", "1.0", lambda: Lazy)
    bad = reg.load("malformed", "tests:Malformed", "fixture-malformed", "1.0", lambda: Malformed)
    assert bad.status == "broken" and "'package.module:Class'" in bad.reason
    assert reg.records["lazy"].methods["tuned"] == "flowseam.training.finetune:Finetune"
    monkeypatch.setattr(flowseam.seam.discovery, "_CACHE", reg)
    assert get_method("tuned") is Finetune
    with pytest.raises(PluginLoadError, match=r"plugin 'lazy' \(fixture-lazy 1.0\) registers "
                                              r"'flowseam_no_such_package.methods:Gone', which "
                                              r"cannot be imported: ModuleNotFoundError"):
        get_method("gone")


def test_a_kernel_for_an_unknown_op_is_the_plugins_fault(capsys):
    """A plugin that registers a kernel for an op flowseam does not have broke its hook's
    contract: the plugin is broken with a plugin fault naming it (not "bad input"), and in
    strict mode the command exits 3 naming it."""
    from flowseam.cli.boundary import EXIT_PLUGIN_FAULT, report
    from flowseam.seam import BackendInfo, KernelRegistration, PluginFaultError, hookimpl
    from flowseam.seam.discovery import PluginRegistry, raise_if_broken

    class Typo:
        @staticmethod
        @hookimpl
        def flowseam_backend():
            return BackendInfo(device="typodev")

        @staticmethod
        @hookimpl
        def flowseam_register_kernels():
            return [KernelRegistration("flow_match_stpe", lambda x, v, s, n: x)]

    reg = PluginRegistry()
    rec = reg.load("typo", "tests:Typo", "flowseam-typo", "1.0", lambda: Typo)
    assert rec.status == "broken"
    assert rec.reason.startswith("PluginFaultError: plugin 'typo' (flowseam-typo 1.0): kernel for "
                                 "unknown op 'flow_match_stpe'; known ops are ['flow_match_step'")
    with pytest.raises(PluginFaultError) as info:
        raise_if_broken(reg)
    assert info.value.plugin == "typo" and report(info.value) == EXIT_PLUGIN_FAULT
    assert "flowseam: plugin fault: broken flowseam plugin(s) 'typo'" in capsys.readouterr().err
