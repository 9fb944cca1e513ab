#!/usr/bin/env python3
"""Loads a safetensors-style file into CUDA memory with fgds, checks it byte for byte against a
plain read, and times it against the torch.load-style way (read the file into RAM, then
``.cuda()``).

    python3 load_safetensors.py FILE [--make-gib N] [--rounds R]

``--make-gib N`` first writes a file of N GiB of random tensors (a safetensors header padded so
that the data starts 4 KiB aligned, as an fgds-aware writer would). Needs PyTorch with CUDA,
else allocates with the CUDA driver API through ctypes and skips the torch-style timing.
What it prints is in docs/python.md ("On a real GPU").
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import struct
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import fgds

MIB = 1 << 20


def make(path: str, gib: int) -> None:
    tensors = gib * 16  # 64 MiB each
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "fgds example"}}
    for i in range(tensors):
        header[f"layer.{i}.weight"] = {
            "dtype": "F16",
            "shape": [8192, 4096],
            "data_offsets": [i * 64 * MIB, (i + 1) * 64 * MIB],
        }
    text = json.dumps(header).encode()
    # Pad with spaces (valid JSON) so that the data starts at a multiple of 4 KiB.
    pad = (-(8 + len(text))) % 4096
    text += b" " * pad
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _ in range(tensors):
            f.write(os.urandom(64 * MIB))
        f.flush()
        os.fsync(f.fileno())


def header(path: str) -> Tuple[int, int, Dict[str, Any]]:
    """(data start, data length, header) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    size = os.path.getsize(path)
    return 8 + n, size - 8 - n, meta


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(run: Callable[[], Any]) -> Tuple[float, Any]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--make-gib", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.make_gib:
        t, _ = timed(lambda: make(args.file, args.make_gib))
        print(f"made {args.file}: {os.path.getsize(args.file)} bytes in {t:.1f} s")
    start, length, meta = header(args.file)
    print(f"{len(meta) - 1} tensors, data {length} bytes at offset {start}")
    print("fgds doctor:")
    print("  " + fgds.doctor().rstrip().replace("\n", "\n  "))

    torch: Any
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
        gpu = torch.empty(length, dtype=torch.uint8, device="cuda")
        target: Any = gpu
        to_host: Callable[[], bytes] = lambda: gpu.cpu().numpy().tobytes()
    else:
        print("no torch with CUDA: CUDA memory from the driver API (ctypes)")
        import ctypes

        cu = ctypes.CDLL("libcuda.so.1")
        ctx = ctypes.c_void_p()
        assert cu.cuInit(0) == 0
        dev = ctypes.c_int()
        assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
        assert cu.cuCtxSetCurrent(ctx) == 0
        ptr = ctypes.c_uint64()
        assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(length)) == 0
        target = fgds.DevicePointer(ptr.value, length)

        def to_host() -> bytes:
            out = ctypes.create_string_buffer(length)
            assert cu.cuCtxSetCurrent(ctx) == 0
            assert cu.cuMemcpyDtoH_v2(out, ptr, ctypes.c_size_t(length)) == 0
            return out.raw

    print(f"is_direct: {fgds.is_direct(target)}; why not: {fgds.why_not_direct(target)}")

    def fgds_load() -> fgds.Completed:
        with fgds.open(args.file) as f:
            return f.pread(target, length, start).get()

    # Correctness: a cold read through fgds, then the bytes against a plain read.
    cold = drop_caches()
    t, done = timed(fgds_load)
    print(f"fgds: {int(done)} bytes, path {done.path}, bounced {done.bounced}, reason: {done.reason}")
    print(f"fgds first read{' (cold cache)' if cold else ''}: {t:.2f} s, {length / t / MIB:.0f} MiB/s")
    with open(args.file, "rb") as f:
        f.seek(start)
        plain = f.read(length)
    same = to_host() == plain
    print(f"byte for byte against a plain read: {'identical' if same else 'DIFFERENT'}")
    del plain
    if not same:
        return 1

    rows: List[Tuple[str, float]] = []

    def torch_style() -> None:
        assert torch is not None
        ram = bytearray(length)
        with open(args.file, "rb") as f:
            f.seek(start)
            f.readinto(ram)
        t = torch.frombuffer(ram, dtype=torch.uint8).cuda()
        torch.cuda.synchronize()
        del t

    for round_ in range(args.rounds):
        for name, run in (("fgds", fgds_load), ("torch-style", torch_style)):
            if name == "torch-style" and (torch is None or not torch.cuda.is_available()):
                continue
            for cache in ("cold", "warm"):
                if cache == "cold" and not drop_caches():
                    continue
                if cache == "warm":
                    with open(args.file, "rb") as f:  # make sure the page cache holds it
                        while f.read(64 * MIB):
                            pass
                t, _ = timed(run)
                rows.append((f"{name} {cache}", t))
                print(f"round {round_}: {name:11} {cache}: {t:.2f} s, {length / t / MIB:.0f} MiB/s")
    print("median MiB/s:")
    for label in sorted({r[0] for r in rows}):
        times = sorted(t for name, t in rows if name == label)
        median = times[len(times) // 2]
        print(f"  {label:18} {length / median / MIB:7.0f} MiB/s ({len(times)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
