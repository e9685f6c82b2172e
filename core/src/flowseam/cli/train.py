"""``flowseam train``: a registered training method with a TOML or YAML config, on one rank or
``--nproc`` ranks; ``--show-config`` prints a method's keys."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import InvalidInputError
from ..quiet import quiet_libraries
from ..seam.method_contract import Checked, TrainingSummary, method_summaries, resolve_method
from .parsing import HelpFormatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``train`` command and its options (the registered methods listed in its help)."""
    t = sub.add_parser(
        "train", help="run a training method (finetune, flowgrpo, workflow_rl, ...)",
        description="Run a registered training method with a TOML or YAML config. The run "
                    "writes its metrics, its checkpoints (always one at the last step) and, at "
                    "the end, the trained model in diffusers format (OUTPUT_DIR/model, what "
                    "flowseam generate --model takes; a LoRA run also writes "
                    "OUTPUT_DIR/pytorch_lora_weights.safetensors). Rerunning the same command "
                    "resumes from the latest checkpoint.",
        epilog=_registered_methods_text, formatter_class=HelpFormatter)
    t.add_argument("--method", required=True, help="a registered training method (listed below)")
    t.add_argument("--config", metavar="FILE", help="a .toml or .yaml config file")
    t.add_argument("--show-config", action="store_true",
                   help="print every key of the method's config with its default, then exit")
    t.add_argument("--output-dir", metavar="DIR",
                   help="where the run writes (overrides the config's output_dir)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, TABLE.KEY for a key of a table "
                        "(e.g. sampling.height=64); the value is parsed as JSON when it can be")
    t.add_argument("--dtype", metavar="DTYPE",
                   help="the loaded models' dtype: float32, bfloat16, float16, or per kind "
                        "(dit=bfloat16,vae=float32); overrides the config's dtype. With [optim] "
                        "mixed_precision = \"bf16\" the trained weights stay float32 masters")
    t.add_argument("--nproc", type=int, metavar="N",
                   help="data-parallel training on N ranks of this machine (torchrun: gloo on CPU, "
                        "nccl on GPU, one GPU per rank); rank 0 writes metrics and checkpoints")
    t.set_defaults(func=cmd_train)


def show_config(name: str, method: Checked) -> str:
    """What ``flowseam train --method NAME --show-config`` prints: the method's summary and every
    config key with its default, as TOML (or its documentation, for a method that publishes no
    keys)."""
    import inspect

    from ..training.config import as_toml

    cls = method.cls
    config = method.default_config()
    if not config:
        module_doc = inspect.getdoc(inspect.getmodule(cls)) or inspect.getdoc(cls) or ""
        return (f"# {name}: {cls.summary()}\n# this method publishes no config keys "
                f"(default_config() is empty); its documentation:\n\n{module_doc}\n")
    where = ("docs/training.md, \"Config keys\"" if cls.__module__.startswith("flowseam.")
             else f"python -c \"import {cls.__module__} as m; help(m)\"")
    head = f"{name}: {cls.summary()}\nEvery key with its default; a commented key has none " \
           f"(required, or chosen at run time).\nWhat each key means: {where}"
    return as_toml(config, cls.config_tables, head)


def _set_override(config: dict, override: str) -> None:
    """``--set KEY=VALUE``: a top-level key, or ``table.key`` (the value parsed as JSON when it
    can be, else kept as a string)."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise InvalidInputError(f"--set {override!r} must look like key=value or table.key=value")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:  # not JSON: the string itself
        parsed = value
    *tables, last = key.split(".")
    target = config
    for table in tables:
        target = target.setdefault(table, {})
        if not isinstance(target, dict):
            raise InvalidInputError(f"--set {override!r}: {table!r} is not a table of the config")
    target[last] = parsed


def cmd_train(args: argparse.Namespace) -> int:
    """Run a registered training method with a TOML/YAML config (on ``--nproc`` ranks), every
    call to it checked against the training-method contract (:class:`Checked`)."""
    import os

    from ..parallel import is_rank_of

    quiet_libraries()
    method = Checked(args.method, *resolve_method(args.method))  # unknown: lists the registered
    if args.show_config:
        print(show_config(args.method, method), end="")
        return 0
    config = _config(args)
    launcher = args.nproc is not None and args.nproc > 1 and not is_rank_of(args.nproc)
    if launcher:  # not yet a rank: e.g. a batch that does not split fails before spawning
        method.check_world_size(config, args.nproc)
    if not config.get("output_dir"):
        raise InvalidInputError(
            "the run needs somewhere to write its trained model: set output_dir in "
            "the config, or pass --output-dir DIR")
    if launcher:
        from ..launch import launch

        argv = ["train", "--method", args.method, "--config", args.config]
        argv += [a for s in args.set or [] for a in ("--set", s)]
        argv += ["--output-dir", config["output_dir"]]
        argv += ["--dtype", args.dtype] if args.dtype else []
        return launch(argv, args.nproc)
    summary = method.run(config, progress=True)
    if int(os.environ.get("RANK", "0")) == 0:  # rank 0 reports for the run
        _report(args.method, config, summary)
    return 0


def _config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` file with ``--set``, ``--output-dir`` and ``--dtype`` over it.

    :raises InvalidInputError: for a missing ``--config``, a bad ``--set`` or ``--nproc``.
    """
    from ..training.config import load_config

    if not args.config:
        raise InvalidInputError(
            "--config is required (a .toml or .yaml file); --show-config prints "
            f"every key of {args.method}'s config with its default")
    config = load_config(args.config)
    for override in args.set or []:
        _set_override(config, override)
    if args.output_dir:
        config["output_dir"] = args.output_dir
    if args.dtype:
        config["dtype"] = args.dtype
    if args.nproc is not None and args.nproc < 1:
        raise InvalidInputError(f"--nproc={args.nproc} must be >= 1")
    return config


def _report(name: str, config: dict[str, Any], summary: TrainingSummary) -> None:
    """What a finished run prints: its last step's main metrics and where it wrote."""
    last = summary["records"][-1] if summary["records"] else {}
    shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in last.items()
             if k.startswith(("step", "reward_mean", "loss", "ratio", "t2i_ratio", "i2v_ratio"))}
    print(f"{name}: {summary['steps']} steps; last: {shown}")
    exported = summary.get("exported") or {}
    for stage, paths in exported.items():
        where = f" ({stage})" if len(exported) > 1 else ""
        print(f"model{where}: {paths['model']} (diffusers format: flowseam generate --model "
              f"{paths['model']} ...)")
        if "lora" in paths:
            print(f"lora{where}: {paths['lora']} (diffusers: pipe.load_lora_weights)")
    out = config["output_dir"]
    print(f"checkpoints: {out}/checkpoints; metrics: {out}/metrics.jsonl")


def _registered_methods_text() -> str:
    """The train command's epilog: the registered methods (discovered when help is shown)."""
    try:
        methods = method_summaries()
    except Exception as exc:  # help must still print
        return f"(cannot list the training methods: {type(exc).__name__}: {exc})"
    lines = ["registered methods (--method NAME --show-config prints the keys of its config",
             "with their defaults):"]
    lines += [f"  {name:<15} {summary}" for name, summary in sorted(methods.items())]
    return "\n".join(lines)
