"""A safetensors loader on fgds: the tensors of a file into GPU memory in one transfer.

A safetensors file is an 8-byte header length, a JSON header, then the tensors back to back,
at any offset (8 + the header's length) and of any size. The loader reads the part of the
data region that holds the tensors asked for in one transfer, with the memory at the file
offset's place in a block (``File.phase``), so that everything but its first and last partial
blocks goes direct, and the direct path's requests are in flight together (the queue depth,
``fgds.defaults.queue_depth()``), not one thread per tensor. Each tensor says which path its
bytes took, and why not a better one::

    import fgds.safetensors
    model = fgds.safetensors.load("/data/model.safetensors")   # torch with CUDA: a new tensor
    for t in model.tensors.values():
        print(t.name, t.path, t.bounced, t.reason)
    weight = model.tensors["lm_head.weight"].tensor           # a torch view of the buffer
"""

from __future__ import annotations

import importlib
import json
import os
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import BufferLike, Completed, open as _open

#: safetensors dtypes and their torch names.
_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class Header(NamedTuple):
    """A safetensors file's header: where the data region starts, and per tensor its dtype,
    shape and byte range in the data region."""

    data_start: int
    tensors: Dict[str, Tuple[str, Tuple[int, ...], int, int]]
    metadata: Dict[str, str]


def read_header(path: Union[str, "os.PathLike[str]"]) -> Header:
    """Parses the header of the safetensors file at ``path``."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        text = f.read(n)
    if len(text) != n:
        raise ValueError(f"{path}: the header says {n} bytes, the file has {len(text)}")
    header = json.loads(text)
    metadata = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        if not 0 <= begin <= end:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets {t['data_offsets']}")
        tensors[name] = (t["dtype"], tuple(t["shape"]), begin, end)
    return Header(8 + n, tensors, metadata)


class Tensor(NamedTuple):
    """One tensor as loaded: where it is in the buffer, and how its bytes got there."""

    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int
    """Its first byte's offset in the loader's buffer."""
    nbytes: int
    path: str
    """``direct``, ``uring-dmabuf`` or ``bounce``: the transfer's path."""
    bounced: int
    """Bytes of this tensor that went through host RAM (the transfer's partial first or last
    block, or all of it for a bounce)."""
    reason: Optional[str]
    """Why its bytes did not all take a better path (the partial blocks: O_DIRECT moves whole
    blocks), or ``None``."""
    tensor: Any
    """A torch tensor viewing it where the buffer is a torch CUDA tensor, else ``None``."""


class Loaded(NamedTuple):
    """A load: the buffer, the transfer, and the tensors by name."""

    buffer: Any
    completed: Completed
    tensors: Dict[str, Tensor]


def load(
    path: Union[str, "os.PathLike[str]"],
    buf: Optional[BufferLike] = None,
    *,
    names: Optional[Sequence[str]] = None,
    task_size: Optional[int] = None,
) -> Loaded:
    """Reads the tensors of ``path`` (every one, or those in ``names``) into ``buf`` (GPU
    memory of at least ``File.phase(start) + span`` bytes; default: a new torch CUDA tensor of
    that size where torch and CUDA are there) in one transfer, and returns them with the path
    and the bytes through RAM of each."""
    header = read_header(path)
    wanted = list(header.tensors) if names is None else list(names)
    missing = [n for n in wanted if n not in header.tensors]
    if missing:
        raise KeyError(f"{path} has no tensor {missing[0]!r}")
    if not wanted:
        raise ValueError(f"{path}: no tensors to load")
    first = min(header.tensors[n][2] for n in wanted)
    last = max(header.tensors[n][3] for n in wanted)
    span = last - first
    start = header.data_start + first
    with _open(path) as f:
        phase = f.phase(start)
        align = f.alignment
        torch_buf = buf is None
        if buf is None:
            buf = _torch_buffer(phase + span)
        done = f.pread(buf, span, start, task_size, buf_offset=phase).get()
    if int(done) != span:
        raise ValueError(f"{path} ended after {int(done)} of the tensors' {span} bytes")
    head, tail = _edges(done, start, span, align)
    tensors = {}
    for name in wanted:
        dtype, shape, begin, end = header.tensors[name]
        at = phase + begin - first
        lo, hi = begin - first, end - first
        if done.path == "bounce":
            bounced = hi - lo
        else:
            bounced = max(0, min(hi, head) - lo) + max(0, hi - max(lo, span - tail))
        reason = done.reason
        if bounced and done.path != "bounce":
            why = (
                f"{bounced} bytes in a partial block at an end of the transfer (O_DIRECT moves "
                f"whole blocks of {align} bytes)"
            )
            reason = why if reason is None else f"{why}; {reason}"
        view = _torch_view(buf, at, end - begin, dtype, shape) if torch_buf else None
        tensors[name] = Tensor(
            name, dtype, shape, at, end - begin, done.path, bounced, reason, view
        )
    return Loaded(buf, done, tensors)


def _edges(done: Completed, start: int, span: int, align: int) -> Tuple[int, int]:
    """The bytes of a direct transfer of ``span`` bytes at file offset ``start`` that went
    through RAM: its head up to the first block boundary, its tail after the last."""
    head = min((align - start % align) % align, span)
    tail = (span - head) % align
    return head, tail


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def _torch_buffer(nbytes: int) -> Any:
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        raise ValueError(
            "no buffer: pass buf= (GPU memory: a CUDA array, fgds.DmaBuf or "
            "fgds.DevicePointer), or install torch with CUDA"
        )
    return torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _torch_view(buf: Any, at: int, nbytes: int, dtype: str, shape: Tuple[int, ...]) -> Any:
    torch = _torch()
    name = _TORCH_DTYPES.get(dtype)
    if name is None or not hasattr(torch, name):
        return buf[at : at + nbytes]
    view = buf[at : at + nbytes].view(getattr(torch, name))
    return view.reshape(shape) if list(shape) else view.reshape(())


__all__: List[str] = ["Header", "Loaded", "Tensor", "load", "read_header"]
