"""``flowseam serve``: the OpenAI-compatible HTTP server (see :mod:`flowseam.serve`)."""

from __future__ import annotations

import argparse

from .parsing import add_memory_options, add_parallel_options, memory_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` command and its options (their defaults: ``serve.server.ServeOptions``)."""
    from ..serve.server import ServeOptions as serve_defaults

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server: images, video jobs with "
                                     "progress and cancellation, a web page")
    s.add_argument("--model", action="append", required=True, metavar="PATH",
                   help="diffusers-format checkpoint directory or hub id (repeat to serve several; "
                        "each is served under its directory's name)")
    s.add_argument("--workflow",
                   help="also serve a cross-model workflow, e.g. t2i-i2v (its stages: the first "
                        "text-to-image and the first image-to-video --model)")
    s.add_argument("--backend", action="append",
                   help="backend name (default: the highest-priority available); once, or once "
                        "per --model")
    s.add_argument("--host", default=serve_defaults.host,
                   help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=serve_defaults.port,
                   help="port (default %(default)s; 0: a free one)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but "
                                     "/health (default: $FLOWSEAM_API_KEY; none: no key)")
    s.add_argument("--max-queue", type=int, default=serve_defaults.max_queue,
                   help="jobs that may wait per model before requests get 429 (default "
                        "%(default)s)")
    s.add_argument("--max-batch", type=int, default=serve_defaults.max_batch,
                   help="samples one loop run may batch (default %(default)s; 1: no batching)")
    s.add_argument("--output-dir", default=serve_defaults.output_dir,
                   help="the job table and outputs (default %(default)s)")
    s.add_argument("--expire-after", type=float, default=serve_defaults.expire_after,
                   help="seconds finished outputs and their jobs are kept (default %(default)s)")
    s.add_argument("--max-upload-mb", type=float, default=serve_defaults.max_upload_mb,
                   help="largest request body, in MiB (default %(default)s)")
    s.add_argument("--log-level", default=serve_defaults.log_level,
                   help="uvicorn and server log level (default %(default)s)")
    s.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's, one per core); on a shared or "
                        "small CPU machine fewer threads than cores often run faster")
    add_parallel_options(s, "rank 0 serves HTTP, the others follow it")
    add_memory_options(s)
    s.add_argument("--lora", action="append", metavar="PATH",
                   help="a LoRA .safetensors file loaded at start into every model it fits; "
                        "requests name loaded files in their 'lora' field (repeatable)")
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the models over HTTP (see flowseam.serve)."""
    import os

    from ..serve.server import ServeOptions, run

    return run(ServeOptions(
        models=args.model, workflow=args.workflow, backends=args.backend or [], host=args.host,
        port=args.port, api_key=args.api_key or os.environ.get("FLOWSEAM_API_KEY"),
        max_queue=args.max_queue, max_batch=args.max_batch, output_dir=args.output_dir,
        expire_after=args.expire_after, max_upload_mb=args.max_upload_mb,
        log_level=args.log_level, threads=args.threads, loras=args.lora or [],
        nproc=args.nproc, sp=args.sp, cfg_parallel=args.cfg_parallel,
        load_options=memory_options(args)), argv=args.argv)

