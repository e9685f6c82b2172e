"""``flowseam reward-serve``: serve an installed reward over HTTP (see
:mod:`flowseam.rewards.reward_server`), for ``reward = "http://HOST:PORT/NAME"`` in a training
config."""

from __future__ import annotations

import argparse

from ..errors import InvalidInputError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``reward-serve`` command and its options (their defaults:
    ``rewards.reward_server.RewardServeOptions``)."""
    from ..rewards.reward_server import RewardServeOptions as defaults

    s = sub.add_parser(
        "reward-serve", help="serve an installed reward over HTTP, for reward = "
                             "\"http://HOST:PORT/NAME\" in a training config",
        description="Serve one installed reward (any plugin's) over HTTP: POST "
                    "http://HOST:PORT/NAME scores a batch (JSON; the samples as safetensors, "
                    "PNG or MP4 in base64, never pickle), GET http://HOST:PORT/NAME describes "
                    "it, GET /health says it is up. A training config names it as "
                    "reward = \"http://HOST:PORT/NAME\".")
    s.add_argument("--reward", required=True, metavar="NAME",
                   help="a registered reward (or PLUGIN:NAME), e.g. ocr, brightness")
    s.add_argument("--reward-args", default="{}", metavar="JSON",
                   help="the reward's keyword arguments as a JSON object, e.g. "
                        "'{\"channel\": 1}' (default: none)")
    s.add_argument("--host", default=defaults.host,
                   help="address to listen on (default %(default)s, this machine only; another "
                        "address exposes the reward to the network: use --api-key)")
    s.add_argument("--port", type=int, default=defaults.port,
                   help="port (default %(default)s; 0: a free one)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but "
                                     "/health (default: $FLOWSEAM_REWARD_API_KEY; none: no key)")
    s.add_argument("--max-batch", type=int, default=defaults.max_batch,
                   help="most samples one request may hold; more get 413 (default %(default)s)")
    s.add_argument("--max-body-mb", type=float, default=defaults.max_body_mb,
                   help="largest request body, in MiB (default %(default)s)")
    s.add_argument("--log-level", default=defaults.log_level,
                   help="uvicorn and server log level (default %(default)s)")
    s.add_argument("--threads", type=int,
                   help="torch CPU threads (default: torch's, one per core)")
    s.set_defaults(func=cmd_reward_serve)


def cmd_reward_serve(args: argparse.Namespace) -> int:
    """Serve the reward until interrupted (Ctrl-C, SIGTERM)."""
    import json
    import os

    from ..rewards.reward_server import RewardServeOptions, run

    try:
        reward_args = json.loads(args.reward_args)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"--reward-args {args.reward_args!r} is not JSON ({exc.msg}); "
                                "give a JSON object, e.g. '{\"channel\": 1}'") from None
    api_key = args.api_key if args.api_key is not None else \
        os.environ.get("FLOWSEAM_REWARD_API_KEY")
    return run(RewardServeOptions(
        reward=args.reward, reward_args=reward_args, host=args.host, port=args.port,
        api_key=api_key, max_batch=args.max_batch, max_body_mb=args.max_body_mb,
        log_level=args.log_level, threads=args.threads))
