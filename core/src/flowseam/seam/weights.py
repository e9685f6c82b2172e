"""Loading a diffusers model in another dtype than its safetensors files store, one copy at a time.

``ModelMixin.from_pretrained(path, torch_dtype=torch.bfloat16)`` keeps every file page the
conversion touched mapped until the end, so its peak is the whole stored file plus the converted
model. :func:`load_converted` builds the same model (the class on the meta device, keep-in-float32
modules in float32: diffusers' ``load_model_dict_into_meta`` rule), converting each tensor
straight from the memory map and then dropping its file pages (``madvise MADV_DONTNEED``; they
stay in the kernel's page cache), so the peak is the converted model plus one tensor's pages. A
load that needs no conversion keeps diffusers' own path (its memory map is already one copy), and
so do layouts this loader does not read (``.bin`` weights, variants, deprecated attention-block
keys that diffusers renames on load): :func:`load_converted` returns None and the caller falls
back to ``from_pretrained``.
"""

from __future__ import annotations

import json
import mmap
import warnings
from pathlib import Path
from typing import Any

#: safetensors' dtype names → torch's
STORED = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
          "BOOL": "bool"}
FLOATING = ("F64", "F32", "F16", "BF16")


def checkpoint_files(folder: Path) -> list[Path] | None:
    """The safetensors files of a diffusers model folder (sharded through its index, or the one
    ``diffusion_pytorch_model.safetensors``); None for any other layout."""
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    single = folder / "diffusion_pytorch_model.safetensors"
    return [single] if single.is_file() else None


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (name → dtype, shape, data_offsets) and where its data
    starts."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def needs_conversion(files: list[Path], dtype: Any) -> bool:
    """Whether a floating-point tensor of ``files`` is stored in another dtype than ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    return any(info["dtype"] in FLOATING and STORED[info["dtype"]] != name
               for path in files for info in read_header(path)[0].values())


def load_converted(cls: type, folder: Path, dtype: Any) -> tuple[Any, dict[str, Any]] | None:
    """``cls`` (a diffusers ``ModelMixin``) with the weights of ``folder`` in ``dtype`` (its
    ``_keep_in_fp32_modules`` in float32), reading one tensor at a time; and the loading info
    ``from_pretrained(output_loading_info=True)`` gives (missing, unexpected, mismatched keys).

    :returns: None when the layout is not one this reads (see the module docstring), or no
        tensor needs converting: the caller uses ``from_pretrained``.
    """
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    files = checkpoint_files(folder)
    if files is None or not needs_conversion(files, dtype):
        return None
    with init_empty_weights():
        model = cls.from_config(cls.load_config(folder))
    if any(getattr(m, "_from_deprecated_attn_block", False) for m in model.modules()):
        return None  # its old checkpoints' keys are renamed by diffusers' loader
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    keep = list(cls._keep_in_fp32_modules or [])
    loaded, unexpected, mismatched = set(), [], []
    for path in files:
        header, start = read_header(path)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                shape = tuple(info["shape"])
                if name not in expected:
                    unexpected.append(name)
                    continue
                if shape != expected[name]:
                    mismatched.append((name, shape, expected[name]))
                    continue
                stored = getattr(torch, STORED[info["dtype"]])
                target = stored
                if info["dtype"] in FLOATING:
                    target = torch.float32 if any(k in name.split(".") for k in keep) else dtype
                begin, end = (start + o for o in info["data_offsets"])
                value = _read(mm, begin, end, stored, shape).to(target, copy=True)
                _drop_pages(mm, begin, end)  # the file pages leave this process's memory
                set_module_tensor_to_device(model, name, "cpu", value=value, dtype=target)
                loaded.add(name)
    missing = sorted(set(expected) - loaded)
    model.register_to_config(_name_or_path=str(folder.parent))
    model.eval()
    return model, {"missing_keys": missing, "unexpected_keys": unexpected,
                   "mismatched_keys": mismatched, "error_msgs": []}


def _read(mm: mmap.mmap, begin: int, end: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """The bytes ``[begin, end)`` of the mapped file as a tensor of ``dtype`` and ``shape``
    (a view of the mapping: copy it before the mapping closes)."""
    import numpy as np
    import torch

    raw = np.frombuffer(mm, dtype=np.uint8, count=end - begin, offset=begin)
    with warnings.catch_warnings():  # read-only: it is only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw).view(dtype).reshape(shape)


def _drop_pages(mm: mmap.mmap, begin: int, end: int) -> None:
    """Drop the mapped pages of ``[begin, end)`` from this process (``MADV_DONTNEED``; they stay
    in the kernel's page cache, and come back from it if read again)."""
    page = mmap.PAGESIZE
    first = begin - begin % page
    if end > first and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        mm.madvise(mmap.MADV_DONTNEED, first, end - first)
