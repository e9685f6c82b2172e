"""Component dtypes: what ``flowseam.load(dtype=...)``, ``--dtype`` and a training config's
``dtype`` ask for, parsed and checked where the request is made, before any weights load.

A request names one dtype for every torch component (``"bfloat16"``), or one per component kind
(``"dit=bfloat16,vae=float32"``; ``{"dit": "bfloat16", "vae": "float32"}``; ``"*"`` for the
kinds not named). The kinds are those of the card (:data:`flowseam.seam.components.KINDS`: ``dit``
covers every DiT expert of a Wan2.2 checkpoint). Each component is then loaded by its backend in
that dtype — with diffusers' and transformers' own ``from_pretrained(torch_dtype=...)``, so a
model's keep-in-float32 modules stay float32 and no float32 copy is made first — and a backend
builds a kind only in the dtypes it declares (``flowseam_component_dtypes``); anything else is
refused before loading, naming the backend and what it builds.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import InvalidInputError

#: the dtypes a component can be asked for, as torch names them
DTYPES = ("float32", "bfloat16", "float16")
#: other spellings users write (diffusers' and accelerate's ``fp16``/``bf16``, torch's ``half``)
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
           "half": "float16"}
#: a key that stands for every kind a request does not name
EVERY_KIND = "*"


def dtype_name(value: Any, what: str = "dtype") -> str:
    """The canonical name (:data:`DTYPES`) of ``value``: a name, an alias or a ``torch.dtype``.

    :raises InvalidInputError: naming the value and what is allowed.
    """
    text = str(value).removeprefix("torch.").strip().lower() if value is not None else ""
    name = ALIASES.get(text, text)
    if name not in DTYPES:
        raise InvalidInputError(f"{what}={value!r} is not a dtype flowseam loads components in; "
                                f"use one of {', '.join(DTYPES)} (or {', '.join(ALIASES)})")
    return name


def parse_dtypes(value: Any) -> dict[str, str]:
    """A dtype request as ``{kind or "*": dtype name}``; ``{}`` for None (each backend's own
    choice). Accepts a dtype (name, alias, ``torch.dtype``: every kind), ``"KIND=DTYPE,..."``
    (``--dtype dit=bfloat16,vae=float32``) or a mapping.

    :raises InvalidInputError: for a malformed entry, a key given twice or an unknown dtype.
    """
    if value is None:
        return {}
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, str) and "=" in value:
        items = []
        for part in value.split(","):
            key, sep, name = part.partition("=")
            if not sep or not key.strip():
                raise InvalidInputError(f"dtype={value!r}: {part!r} is not KIND=DTYPE (e.g. "
                                        "dit=bfloat16,vae=float32)")
            items.append((key.strip(), name))
    else:
        return {EVERY_KIND: dtype_name(value)}
    out: dict[str, str] = {}
    for key, name in items:
        if not isinstance(key, str) or not key:
            raise InvalidInputError(f"dtype: {key!r} is not a component kind")
        if key in out:
            raise InvalidInputError(f"dtype: {key!r} is given twice")
        out[key] = dtype_name(name, f"dtype[{key}]")
    return out


def for_kinds(request: Mapping[str, str], kinds: list[str], card: str) -> dict[str, str]:
    """``{kind: dtype}`` for the torch-module ``kinds`` of a card from a parsed request; a kind
    the request does not name (and no ``"*"``) is left out: its backend chooses.

    :raises InvalidInputError: for a key that is none of ``kinds``, listing them.
    """
    unknown = sorted(set(request) - set(kinds) - {EVERY_KIND})
    if unknown:
        raise InvalidInputError(
            f"dtype: {card} has no component of kind {', '.join(map(repr, unknown))}; its kinds "
            f"are {', '.join(kinds)} (or * for all)")
    return {k: request.get(k, request.get(EVERY_KIND)) for k in kinds
            if k in request or EVERY_KIND in request}


def torch_dtype(name: str) -> Any:
    """The ``torch.dtype`` of a canonical name."""
    import torch

    return getattr(torch, dtype_name(name))
