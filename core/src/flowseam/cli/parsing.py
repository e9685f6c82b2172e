"""The parser classes every command's options are added to, and ``--version``."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a callable (computed only when help is shown, so
    that building the parser never discovers plugins), printed as is."""

    def format_help(self) -> str:
        epilog = self.epilog
        if callable(epilog):
            self.epilog = epilog()
        try:
            return super().format_help()
        finally:
            self.epilog = epilog


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a text with line breaks (an epilog listing the training
    methods) keeps its lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)


class VersionAction(argparse.Action):
    """``--version``, printed as is (argparse's own action rewraps the text)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """``flowseam 0.1.0`` and the version of every installed plugin distribution (without
    importing them)."""
    from importlib import metadata

    from .. import __version__
    from ..seam.discovery import ENTRY_POINT_GROUP

    dists = sorted({f"{ep.dist.metadata['Name']} {ep.dist.version}"
                    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
                    if ep.dist is not None and ep.dist.metadata["Name"] != "flowseam"})
    return f"flowseam {__version__}" + (f" (plugins: {', '.join(dists)})" if dists else "")


def add_parallel_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--nproc``, ``--sp`` and ``--cfg-parallel`` (:func:`flowseam.parallel.
    parallel_from_options`) of ``generate`` and ``serve``; ``what``: who writes the output
    (``"rank 0 writes the output"``)."""
    parser.add_argument(
        "--nproc", type=int, metavar="N",
        help="split each generation over N processes of this machine (torchrun; one torch "
             f"thread a rank on the CPU, one GPU a rank with CUDA); {what}. Default: N = --sp x "
             "(2 with --cfg-parallel)")
    parser.add_argument(
        "--sp", type=int, metavar="N",
        help="sequence parallelism (Ulysses): N ranks share the DiT's tokens, each attending "
             "with 1/N of them (default: --nproc, halved with --cfg-parallel); N must divide "
             "the DiT's heads and tokens")
    parser.add_argument(
        "--cfg-parallel", action="store_true",
        help="run the conditional and unconditional CFG passes on two groups of ranks")


def add_memory_options(parser: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--offload``, ``--vae-tiling`` and ``--vae-slicing`` of ``generate`` and
    ``serve`` (:func:`flowseam.load`'s ``dtype``, ``offload``, ``vae_tiling``, ``vae_slicing``)."""
    parser.add_argument(
        "--dtype", metavar="DTYPE",
        help="the dtype the components are loaded and run in: float32, bfloat16 or float16, or "
             "one per kind (dit=bfloat16,vae=float32); default: the backend's own (cpu: "
             "float32)")
    parser.add_argument(
        "--offload", choices=("model", "text-encoder"),
        help="model: each component on the accelerator only while it runs (diffusers' "
             "enable_model_cpu_offload); text-encoder: free the text encoder once the prompt "
             "is encoded")
    parser.add_argument("--vae-tiling", action="store_true",
                        help="decode in overlapping tiles (the VAE's own enable_tiling): "
                             "memory flat in the frame size")
    parser.add_argument("--vae-slicing", action="store_true",
                        help="decode one sample of a batch at a time")


def memory_options(args: argparse.Namespace) -> dict:
    """:func:`flowseam.load`'s keyword arguments from :func:`add_memory_options`'s options."""
    return {"dtype": args.dtype, "offload": args.offload, "vae_tiling": args.vae_tiling,
            "vae_slicing": args.vae_slicing}
