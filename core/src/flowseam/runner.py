"""How a loaded model reaches the denoising loops that serve it.

``ModelInstance.generate`` and ``generate_stream`` (the model layer, :mod:`flowseam.models.base`)
serve a request through the card's loop. The loops stand a layer above the models — each loop
drives a model's ``encode`` / ``velocity`` / ``decode`` — so the model layer must not import
them. The dependency is inverted here, in the seam both stand on:

* :mod:`flowseam.loops` registers its two entry points when it is imported (:func:`register`
  with ``run_loop`` and ``stream_loop``);
* the model layer calls them through :func:`run` and :func:`stream`, without knowing the loops.

:mod:`flowseam.loading`, which builds every model ``flowseam.load`` returns, imports
:mod:`flowseam.loops`, so a loaded model always finds them. A model built by hand, in a process
that never imported :mod:`flowseam.loops`, gets a ``RuntimeError`` saying so.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

#: "run" / "stream" → the loops' entry point, filled by :func:`register`
_ENTRY: dict[str, Callable[..., Any]] = {}


def register(run: Callable[..., Any], stream: Callable[..., Iterator[Any]]) -> None:
    """Install the loops' entry points (:mod:`flowseam.loops` calls this once, on import).

    :param run: ``run(model, request, profile=..., progress=..., decode=...,
        step_callback=...) -> LoopResult``: the card's loop, to the end
        (:func:`flowseam.loops.run_loop`).
    :param stream: the same, yielding one ``Chunk`` at a time
        (:func:`flowseam.loops.stream_loop`).
    """
    _ENTRY.update(run=run, stream=stream)


def _entry(name: str) -> Callable[..., Any]:
    try:
        return _ENTRY[name]
    except KeyError:
        raise RuntimeError(
            "flowseam's loops are not imported in this process, so the model has no loop to run "
            "it: import flowseam.loops (flowseam.load does) before calling generate") from None


def run(model: Any, request: Any, **options: Any) -> Any:
    """Run ``request`` (a :class:`~flowseam.request.GenerationRequest`) on ``model`` through the
    card's loop: the registered ``run_loop``, with ``options`` passed on. Returns its
    ``LoopResult``.

    :raises RuntimeError: if no loops are registered (:mod:`flowseam.loops` is not imported).
    """
    return _entry("run")(model, request, **options)


def stream(model: Any, request: Any, **options: Any) -> Iterator[Any]:
    """Run ``request`` on ``model`` chunk by chunk: the registered ``stream_loop``, with
    ``options`` passed on. Returns its iterator of ``Chunk``.

    :raises RuntimeError: if no loops are registered (:mod:`flowseam.loops` is not imported).
    """
    return _entry("stream")(model, request, **options)
