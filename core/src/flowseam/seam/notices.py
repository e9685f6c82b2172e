"""Notices of long waits: how a backend tells the user that a one-off wait (compiling a model on
its first call) is not a hang. Silent unless the program turns notices on, as the ``flowseam``
command does (:func:`enable_notices`)."""

from __future__ import annotations

import contextlib
from typing import Iterator


#: whether :func:`long_wait` tells the user (the command line turns it on)
_NOTICES = False


def enable_notices(on: bool = True) -> None:
    """Turn :func:`long_wait`'s notices on (the ``flowseam`` command does; a program that wants
    them calls this) or off (the default for library use)."""
    global _NOTICES
    _NOTICES = on


def notices_enabled() -> bool:
    """Whether :func:`long_wait` tells the user (:func:`enable_notices`)."""
    return _NOTICES


class Wait:
    """What :func:`long_wait` yields: set :attr:`outcome` to finish its closing line
    (``"compiled"``, ``"ready (compiled before)"``)."""

    outcome = "done"


@contextlib.contextmanager
def long_wait(message: str) -> Iterator[Wait]:
    """Tell the user about a one-off wait that would otherwise look like a hang, such as a
    backend compiling a model on its first call. While the block runs, ``message`` and the
    seconds elapsed on stderr (one line that ticks on a terminal; a start and an end line in a
    log), then ``<message>: <outcome> in N s``. Silent unless notices are on
    (:func:`enable_notices`). For backends: ``from flowseam.seam import long_wait``."""
    import sys
    import threading
    import time

    wait = Wait()
    if not _NOTICES:
        yield wait
        return
    stream, start = sys.stderr, time.perf_counter()
    ticking = stream.isatty()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            stream.write(f"\r{message} ... {time.perf_counter() - start:.0f} s")
            stream.flush()

    stream.write(f"{message} ...{'' if ticking else chr(10)}")
    stream.flush()
    thread = threading.Thread(target=tick, daemon=True) if ticking else None
    if thread is not None:
        thread.start()
    try:
        yield wait
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        stream.write(f"{chr(13) if ticking else ''}{message}: {wait.outcome} in "
                     f"{time.perf_counter() - start:.1f} s\n")
        stream.flush()
