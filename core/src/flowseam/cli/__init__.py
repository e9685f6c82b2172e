"""The flowseam command line: the ``flowseam`` script and ``python -m flowseam``.

One module per command (:data:`COMMANDS`), each with ``add_parser(sub)`` (the command and its
options) and ``cmd_<name>(args)`` (what it does; its exit status); :func:`main` puts them
together and runs the command inside :mod:`.boundary`, the error boundary that decides what an
error means for the user and the exit status. The command modules import nothing of this package
but :mod:`.parsing` (the parser classes, ``--version``), and nothing below :mod:`flowseam`
imports the command line. A command module imports the model runtime (torch, diffusers) inside
the functions that run the command, never at module level, so that ``flowseam --help`` imports
none of it. A test that replaces a command replaces its module's ``cmd_<name>``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..seam.notices import enable_notices
from . import backends, boundary, demo, generate, models, reward_serve, serve, train
from .boundary import EXIT_BUG, EXIT_PLUGIN_FAULT, EXIT_TERMINATED, EXIT_USAGE
from .parsing import HelpFormatter, Parser, VersionAction

__all__ = ["main", "build_parser", "EXIT_USAGE", "EXIT_PLUGIN_FAULT", "EXIT_BUG", "EXIT_TERMINATED"]

#: the commands, in the order ``flowseam --help`` lists them
COMMANDS = (backends, generate, train, serve, reward_serve, models, demo)


def build_parser() -> argparse.ArgumentParser:
    """The ``flowseam`` parser: ``--version`` and every command of :data:`COMMANDS`."""
    parser = Parser(
        prog="flowseam", description="Serve and RL-post-train flow-matching diffusion models "
                                     "through backend plugins.",
        epilog="Run flowseam COMMAND --help for a command's options.",
        formatter_class=HelpFormatter)
    parser.add_argument("--version", action=VersionAction, nargs=0,
                        help="print flowseam's version and its installed plugins', then exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status (see :mod:`flowseam.cli.boundary`: 2 bad input, 3 a
    plugin fault, 1 a bug, with a traceback, 143 after SIGTERM; argparse's usage errors raise
    ``SystemExit(2)``)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --nproc reruns on each rank
    enable_notices()  # a backend compiling on its first call says so (flowseam.seam.long_wait)
    return boundary.run(args.func, args)
