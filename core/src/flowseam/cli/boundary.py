"""The error boundary every command runs inside: what an exception that leaves a command means,
what the user sees on stderr, and the exit status. The statuses are the command line's contract
(each case and message in full: docs/safety.md, "Exit statuses"):

- 0: success; also ``BrokenPipeError``, the reader went away (``flowseam backends | head``);
- 1: out of memory (``flowseam: out of memory:``, one line), an ``OSError`` (the traceback, then
  ``flowseam: system error:``) or a bug (the traceback, then ``flowseam: internal error:``);
- 2, ``flowseam: error:``: any other :class:`~flowseam.errors.FlowseamError` (bad input, a
  checkpoint that is unreadable, unsafe or untrusted, an unavailable backend, a config that does
  not validate) or a pydantic ``ValidationError``, naming the field;
- 3, ``flowseam: plugin fault:``: a :class:`~flowseam.errors.PluginFaultError`, naming the plugin;
- 69 (:data:`~flowseam.launch.EXIT_PEER_LOST`): a ``--nproc`` rank whose peer went away;
- 75 (:data:`EXIT_TEMPFAIL`), ``flowseam: reward server unavailable:``: retry, the run resumes;
- 143 (:data:`EXIT_TERMINATED`): SIGTERM; ``finally`` blocks ran, no temporary file is left.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import traceback
from typing import Callable

from ..errors import (
    BackendUnavailableError, FlowseamError, NotEnoughMemoryError, PluginFaultError,
    RewardServerError,
)
from ..launch import EXIT_PEER_LOST
from ..seam.faults import is_out_of_memory

#: Exit statuses: 2 for bad input (an option, a file, a config, a checkpoint), 3 for a plugin that
#: failed at run time (the message names it), 1 for a bug or the machine (out of memory, the file
#: system), 143 after SIGTERM.
EXIT_USAGE, EXIT_PLUGIN_FAULT, EXIT_BUG, EXIT_TERMINATED = 2, 3, 1, 128 + signal.SIGTERM
#: a service the run needs is down (a reward server that did not answer through every retry):
#: ``EX_TEMPFAIL`` of sysexits.h, "retry later". The message names the last complete checkpoint,
#: from which rerunning the same command resumes; a script tells it from bad input (2) by the
#: status alone.
EXIT_TEMPFAIL = 75

#: Set by the SIGTERM handler. The ``SystemExit`` it raises unwinds the command, unless the
#: handler happened to run inside a finalizer (``__del__``, a weakref callback), where CPython
#: prints the exception and drops it; :func:`run` then still returns 143, never 0.
_sigterm_received = threading.Event()


def _terminate(signum, frame):  # SIGTERM unwinds like Ctrl-C: temporary files are removed
    _sigterm_received.set()
    rank = _rank()
    if rank is not None:  # torchrun stops every rank when one fails: say why this one stopped
        _say(f"{rank}: stopped (SIGTERM: the launcher passes on a SIGTERM and stops every rank "
             "when one fails)")
    raise SystemExit(EXIT_TERMINATED)


def _rank() -> str | None:
    """``rank R of N`` when this process is a rank of a torchrun job (``--nproc``), else None."""
    import os

    world = os.environ.get("WORLD_SIZE", "1")
    return f"rank {os.environ.get('RANK', '?')} of {world}" if world.isdigit() and int(world) > 1 \
        else None


def is_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc``, or what it wraps (a kernel's or component's fault naming the plugin it
    ran in), is a torch.distributed collective that failed because another rank went away
    (gloo's "Connection reset/closed by peer", a ``DistNetworkError``), in a rank of a job."""
    torch = sys.modules.get("torch")
    if torch is None or _rank() is None:
        return False
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if isinstance(exc, RuntimeError) and (
                isinstance(exc, getattr(torch.distributed, "DistNetworkError", ()))
                or "by peer" in text or ("gloo" in text and "transport" in text)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """``command(args)``'s exit status, or the exit status of the exception it raised
    (:func:`report`; the list in the module docstring), having told the user on stderr.

    While the command runs, SIGTERM raises ``SystemExit(143)`` in the main thread, so that
    ``finally`` blocks run: an output being written, a checkpoint being saved, leave no temporary
    file behind (the default SIGTERM action would kill the process on the spot).
    ``KeyboardInterrupt`` and ``SystemExit`` (argparse's usage errors, exit 2) pass through as
    Python handles them. A rank of a ``--nproc`` job that stops with 69 or 143 leaves at once
    (:func:`_leave`, after its ``finally`` blocks and its message): tearing down a process group
    whose peer is gone would abort the process (``terminate called``, SIGABRT) and hide why it
    stopped.
    """
    previous = None
    if threading.current_thread() is threading.main_thread():
        _sigterm_received.clear()
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        status = command(args)
        sys.stdout.flush()  # a closed pipe fails here, not in the interpreter's final flush
        # a SIGTERM whose SystemExit a finalizer swallowed: the work finished (outputs whole,
        # no temporary file), but the process was told to stop, and says so
        return EXIT_TERMINATED if _sigterm_received.is_set() else status
    except SystemExit:
        if _sigterm_received.is_set() and _rank() is not None:
            _leave(EXIT_TERMINATED)
        raise
    except BrokenPipeError:
        # the reader went away (flowseam backends --json | head): stop quietly, as cat does.
        # Point stdout at devnull so that the interpreter's final flush cannot raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:
        status = report(exc)
        if status == EXIT_PEER_LOST:
            _leave(status)
        return status
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _leave(status: int) -> None:
    """End this rank now with ``status``: its output flushed, no interpreter teardown (which
    would tear down a process group whose peer is gone, and abort)."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(status)


def report(exc: Exception) -> int:
    """Tell the user what ``exc``, raised by a command, means (on stderr); its exit status.

    A ``ValueError`` is not bad input by itself: torch, numpy and Python raise it for their
    callers' mistakes, which are flowseam's, so it is a bug (exit 1, with the traceback). Core
    raises :class:`~flowseam.errors.InvalidInputError`, a ``ValueError`` too, for input it
    refuses; as a :class:`~flowseam.errors.FlowseamError` it is exit 2, one line. An
    ``InvalidParameterError`` names its field, which ``flowseam generate`` names as its option.
    """
    if is_lost_peer(exc):  # a rank died: not a bug here; the launcher names the one that failed
        _say(f"{_rank()}: another rank of this job went away ({_first_line(_lost(exc))})")
        return EXIT_PEER_LOST
    if isinstance(exc, PluginFaultError):  # before FlowseamError: a fault is one
        _say(f"plugin fault: {exc}")
        return EXIT_PLUGIN_FAULT
    if isinstance(exc, RewardServerError):  # before FlowseamError: a retry may succeed
        _say(f"reward server unavailable: {exc}")
        return EXIT_TEMPFAIL
    if isinstance(exc, BackendUnavailableError):  # one line; the table has the details
        first = (str(exc).strip().splitlines() or [""])[0].rstrip(" ;:").removesuffix("; backends")
        named = " (--backend, or backend = in a training config)" if "backend '" in first else ""
        _say(f"error: {first or type(exc).__name__}{named}; flowseam backends lists every backend "
             "and why an unusable one is")
        return EXIT_USAGE
    if isinstance(exc, FlowseamError):
        _say(f"error: {exc}")
        return EXIT_USAGE
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        _say(f"error: {_validation_message(exc)}")
        return EXIT_USAGE
    if isinstance(exc, NotEnoughMemoryError):  # says what it needed and what lowers it
        _say(f"out of memory: {' '.join(str(exc).split())}")
        return EXIT_BUG
    if is_out_of_memory(exc):
        _say(f"out of memory: {_first_line(exc)} (the request needs more memory than this machine "
             "has free: fewer or smaller frames, or another --backend)")
        return EXIT_BUG
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    if isinstance(exc, OSError):
        _say(f"system error: {exc} (the operating system refused; the traceback above shows "
             "what flowseam was doing)")
    else:
        _say(f"internal error (a bug in flowseam or in one of its plugins, not in your input): "
             f"{_first_line(exc)}. Please report it with the command you ran, the traceback "
             "above and the output of flowseam --version.")
    return EXIT_BUG


def _lost(exc: BaseException) -> BaseException:
    """The collective's own error inside ``exc``'s chain (what :func:`is_lost_peer` found)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        if "by peer" in str(exc) or "transport" in str(exc):
            return exc
        exc = exc.__cause__ or exc.__context__
    return exc


def _say(line: str) -> None:
    print(f"flowseam: {line}", file=sys.stderr)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return type(exc).__name__ + (f": {text[0]}" if text else "")


def _validation_message(exc) -> str:
    """pydantic's errors on one line, each naming its field: ``Config: steps='x': Input should
    be a valid integer``."""
    parts = [".".join(map(str, e["loc"])) + (f"={e['input']!r}" if e["type"] != "missing" else "")
             + f": {e['msg']}" for e in exc.errors()]
    return f"{exc.title}: " + "; ".join(parts)
