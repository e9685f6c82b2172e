"""Keeping the libraries flowseam drives quiet: diffusers' and transformers' log messages and
progress bars, and huggingface_hub's download bars, off unless asked for (``--verbose``)."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def hub_output(verbose: bool = False) -> Iterator[None]:
    """Within the block, unless ``verbose``: huggingface_hub's progress bars (a checkpoint's
    download) are off, as :func:`library_output` turns them off, without importing diffusers and
    transformers; the previous setting is restored on exit."""
    if verbose:
        yield
        return
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    was_off = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            enable_progress_bars()


@contextlib.contextmanager
def library_output(verbose: bool = False) -> Iterator[None]:
    """Within the block, unless ``verbose``: diffusers' and transformers' log messages below
    ERROR (their "experimental feature" and fallback notices) and their progress bars (weight
    loading, shard writing) are off. Their previous settings are restored on exit, so a
    program's own choices survive a call to :func:`flowseam.load`."""
    if verbose:
        yield
        return
    import diffusers
    import transformers

    libs = (diffusers.utils.logging, transformers.utils.logging)
    saved = [(lib.get_verbosity(), lib.is_progress_bar_enabled()) for lib in libs]
    for lib in libs:
        lib.set_verbosity_error()
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib, (level, bars) in zip(libs, saved):
            lib.set_verbosity(level)
            (lib.enable_progress_bar if bars else lib.disable_progress_bar)()


def quiet_libraries() -> None:
    """Keep the console to flowseam's own progress bar and summary: diffusers' and transformers'
    info logs and weight-loading bars are silenced (warnings and errors still show)."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
