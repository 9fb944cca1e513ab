#!/usr/bin/python3.11
"""The Python package against the rig's vgpu memory: round trips the host checks (gpu_check),
futures in flight together, partial reads at the end of a file, bad arguments, drive errors,
and the fallback through host RAM with the reason it reports (or, switched off, raises).

Run by the guest's Python (xtask/src/python.rs stages it); KTAP on stdout.
"""

from __future__ import annotations

import errno
import json
import gc
import os
import re
import struct
import time
from typing import Any, Callable, Dict, Optional, Tuple

import fgds
import rig
from rig import MIB, NVME_SEED, Skip

#: Scratch areas of the raw drive for this program's writes (past the pattern, before the
#: failing areas).
SCRATCH = 160 * MIB
SCRATCH2 = 170 * MIB


def vgpu(size: int) -> Tuple[fgds.DmaBuf, int, int]:
    """``size`` bytes of vgpu memory as an fgds.DmaBuf, its BAR2 offset and its own fd (for a
    CPU mapping; the DmaBuf holds a duplicate)."""
    fd, bar = rig.vgpu_alloc(size)
    return fgds.DmaBuf(fd, 0, size), bar, fd


def expect_error(
    kind: type[BaseException], call: Callable[[], object], code: Optional[int] = None, text: str = ""
) -> BaseException:
    """``call()`` must raise ``kind`` (with errno ``code``, and ``text`` in its message)."""
    try:
        got = call()
    except kind as err:
        if code is not None:
            assert isinstance(err, OSError), f"{err!r} is not an OSError"
            assert err.errno == code, (
                f"errno {err.errno} ({errno.errorcode.get(err.errno or 0)}), expected "
                f"{errno.errorcode[code]}: {err}"
            )
        assert text in str(err), f"{text!r} is not in {str(err)!r}"
        return err
    raise AssertionError(f"expected {kind.__name__}, got {got!r}")


def check_direct(done: fgds.Completed, size: int, bounced: int = 0) -> None:
    assert int(done) == size, f"{int(done)} bytes, expected {size}: {done!r}"
    assert done.path == "direct" and done.reason is None, f"not direct: {done!r}"
    assert done.bounced == bounced, f"{done.bounced} bytes bounced, expected {bounced}"


def check_bounce(done: fgds.Completed, size: int, why: str) -> None:
    assert int(done) == size, f"{int(done)} bytes, expected {size}: {done!r}"
    assert done.path == "bounce", f"expected the fallback: {done!r}"
    assert done.reason and why in done.reason, f"{why!r} is not in the reason {done.reason!r}"
    assert done.bounced == size, f"{done.bounced} bytes bounced, expected {size}"


def read_direct_host_checked() -> None:
    mem, bar, fd = vgpu(8 * MIB)
    os.close(fd)
    assert fgds.is_direct(mem), fgds.why_not_direct(mem)
    assert fgds.why_not_direct(mem) is None
    with fgds.open(rig.nvme(), "r") as f:
        future = f.pread(mem, 8 * MIB, 4 * MIB, buf_offset=0)
        check_direct(future.get(), 8 * MIB)
        assert future.done() and future.path == "direct"
        # The blocking form, into the second half again, from another place of the drive.
        check_direct(f.read(mem, 4 * MIB, file_offset=32 * MIB, buf_offset=4 * MIB), 4 * MIB)
    rig.gpu_check(bar, 4 * MIB, NVME_SEED, 4 * MIB)
    rig.gpu_check(bar + 4 * MIB, 4 * MIB, NVME_SEED, 32 * MIB)


def write_direct_round_trip() -> None:
    a, bar_a, fd = vgpu(4 * MIB)
    os.close(fd)
    b, bar_b, fd = vgpu(6 * MIB)
    os.close(fd)
    with fgds.open(rig.nvme(), "r+") as f:
        check_direct(f.read(a, 4 * MIB, 8 * MIB), 4 * MIB)
        check_direct(f.pwrite(a, 4 * MIB, SCRATCH).get(), 4 * MIB)
        # kvikio's name for the buffer offset.
        check_direct(f.pread(b, 4 * MIB, SCRATCH, dev_offset=1 * MIB).get(), 4 * MIB)
    rig.gpu_check(bar_a, 4 * MIB, NVME_SEED, 8 * MIB)
    rig.gpu_check(bar_b + 1 * MIB, 4 * MIB, NVME_SEED, 8 * MIB)
    assert rig.drive_bytes(SCRATCH, 4 * MIB) == rig.drive_bytes(8 * MIB, 4 * MIB), (
        "the drive's scratch area differs from what was read into the GPU"
    )


def futures_in_flight_together() -> None:
    mem, bar, fd = vgpu(16 * MIB)
    os.close(fd)
    with fgds.open(rig.nvme()) as f:
        futures = [f.pread(mem, 2 * MIB, i * 2 * MIB, buf_offset=i * 2 * MIB) for i in range(8)]
        for future in futures:
            check_direct(future.get(timeout=120), 2 * MIB)
    rig.gpu_check(bar, 16 * MIB, NVME_SEED, 0)


def ext4_file(name: str, content: bytes) -> str:
    path = os.path.join(rig.env("FGDS_EXT4"), name)
    with open(path, "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    return path


def partial_read_at_end_of_file() -> None:
    size = 1 * MIB + 100
    content = rig.drive_bytes(12 * MIB, size)
    path = ext4_file("fgds-python-eof.bin", content)
    mem, bar, fd = vgpu(4 * MIB)
    cpu = rig.cpu_map(fd, 4 * MIB)
    cpu[:] = b"\xa5" * (4 * MIB)
    with fgds.open(path) as f:
        assert f.nbytes() == size, f"nbytes {f.nbytes()}"
        # Past the end: the bytes up to it, the aligned part direct, the 100-byte tail through RAM.
        check_direct(f.read(mem, 4 * MIB, 0, buf_offset=0), size, bounced=100)
        # At and past the end: nothing.
        assert int(f.read(mem, 4096, size)) == 0
        assert int(f.read(mem, 4096, 2 * size)) == 0
        # Less than one block left: all of it through RAM, and the completion says why.
        tail = f.read(mem, 1 * MIB, 1 * MIB, buf_offset=2 * MIB)
        check_bounce(tail, 100, "fill no whole")
    rig.gpu_check(bar, size - 4, NVME_SEED, 12 * MIB)
    assert cpu[size - 4 : size] == content[-4:], "the last bytes of the file differ"
    assert cpu[size : 2 * MIB] == b"\xa5" * (2 * MIB - size), "bytes past the file's end were written"
    assert cpu[2 * MIB : 2 * MIB + 100] == content[-100:], "the sub-block read differs"
    assert cpu[2 * MIB + 100 : 2 * MIB + 4096] == b"\xa5" * (4096 - 100), "bytes past a sub-block read were written"
    cpu.close()
    os.close(fd)
    os.unlink(path)


def write_unaligned_length_to_a_file() -> None:
    size = 1 * MIB + 100
    mem, bar, fd = vgpu(2 * MIB)
    os.close(fd)
    path = os.path.join(rig.env("FGDS_EXT4"), "fgds-python-write.bin")
    with fgds.open(rig.nvme()) as drive:
        check_direct(drive.read(mem, 2 * MIB, 20 * MIB), 2 * MIB)
    with fgds.open(path, "w") as f:
        check_direct(f.write(mem, size, 0), size, bounced=100)
    with open(path, "rb") as f:
        written = f.read()
    assert written == rig.drive_bytes(20 * MIB, size), f"the file ({len(written)} bytes) differs"
    os.unlink(path)


def fallback_misaligned_offsets_reported() -> None:
    mem, bar, fd = vgpu(2 * MIB)
    os.close(fd)
    assert fgds.is_direct(mem), fgds.why_not_direct(mem)
    with fgds.open(rig.nvme()) as f:
        # The file offset and the memory at different places in their blocks: all through RAM.
        check_bounce(f.read(mem, 1 * MIB, 4 * MIB + 8), 1 * MIB, "block boundary")
        rig.gpu_check(bar, 1 * MIB, NVME_SEED, 4 * MIB + 8)
        check_bounce(f.read(mem, 1 * MIB, 4 * MIB, buf_offset=8), 1 * MIB, "block boundary")
        rig.gpu_check(bar + 8, 1 * MIB, NVME_SEED, 4 * MIB)


def unaligned_offsets_in_phase_go_direct() -> None:
    """A transfer at an unaligned file offset into memory at the same place in a block: the
    whole blocks direct, the partial first and last block through RAM, every byte right."""
    mem, bar, fd = vgpu(2 * MIB)
    os.close(fd)
    with fgds.open(rig.nvme()) as f:
        at = f.phase(4 * MIB + 8)
        assert at == 8, f"phase {at}"
        done = f.read(mem, 1 * MIB, 4 * MIB + 8, buf_offset=at)
        # Head: a block less 8 bytes, tail: 8 bytes, through RAM; the rest direct.
        check_direct(done, 1 * MIB, bounced=f.alignment)
    rig.gpu_check(bar + 8, 1 * MIB, NVME_SEED, 4 * MIB + 8)


def safetensors_hf_layout_loads_direct() -> None:
    """A safetensors file as Hugging Face writes it (a header of any length, tensors back to
    back, sizes not multiples of 4 KiB) on ext4 loads into GPU memory with its data region at the
    file's phase: at least 99% of the bytes direct, every byte right."""
    sizes = [3 * MIB + 1234, 1000, 7 * 4096 + 12, 2 * MIB - 6, 5 * MIB + 777]
    offsets, at = [], 0
    for i, n in enumerate(sizes):
        offsets.append((f"layer{i}.weight", at, at + n))
        at += n
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            **{
                name: {"dtype": "U8", "shape": [b - a], "data_offsets": [a, b]}
                for name, a, b in offsets
            },
        }
    ).encode()
    data = bytearray(rig.drive_bytes(0, at))
    blob = struct.pack("<Q", len(header)) + header + bytes(data)
    path = ext4_file("fgds-python-model.safetensors", blob)
    start = 8 + len(header)
    assert start % 4096 != 0, "the header happened to end on a block boundary"
    with fgds.open(path) as f:
        phase = f.phase(start)
        size = (phase + at + MIB - 1) // MIB * MIB
        mem, bar, fd = vgpu(size)
        cpu = rig.cpu_map(fd, size)
        done = f.pread(mem, at, start, buf_offset=phase).get()
    rig.diag(f"safetensors data region: {done!r}, {done.bounced} of {at} bytes through RAM")
    assert int(done) == at and done.path == "direct", f"not direct: {done!r}"
    assert done.bounced * 100 <= at, f"{done.bounced} of {at} bytes through RAM, more than 1%"
    for name, a, b in offsets:
        got = cpu[phase + a : phase + b]
        assert got == data[a:b], f"tensor {name} differs"
    cpu.close()
    os.close(fd)
    os.unlink(path)


def safetensors_loader_reports_each_tensor() -> None:
    """fgds.safetensors.load reads the tensors of a Hugging Face layout file in one transfer
    into GPU memory at the file's phase: every tensor's bytes right, the big ones direct with
    none through RAM, those in the partial first or last block reported bounced with the
    reason, at most 1% of the bytes through RAM in all."""
    import fgds.safetensors

    sizes = [777, 4 * MIB + 3, 9000, 6 * MIB + 1, 100]
    header, offsets, at = {}, [], 0
    for i, n in enumerate(sizes):
        header[f"t{i}"] = {"dtype": "U8", "shape": [n], "data_offsets": [at, at + n]}
        offsets.append((f"t{i}", at, at + n))
        at += n
    text = json.dumps({"__metadata__": {"format": "pt"}, **header}).encode() + b"  "
    data = rig.drive_bytes(MIB, at)
    path = ext4_file("fgds-python-loader.safetensors", struct.pack("<Q", len(text)) + text + data)
    size = (at + 2 * 4096 + MIB - 1) // MIB * MIB
    mem, bar, fd = vgpu(size)
    cpu = rig.cpu_map(fd, size)
    loaded = fgds.safetensors.load(path, mem)
    rig.diag(f"loader: {loaded.completed!r}, {loaded.completed.bounced} of {at} bytes through RAM")
    assert loaded.completed.path == "direct", f"not direct: {loaded.completed!r}"
    assert loaded.completed.bounced * 100 <= at, "more than 1% through RAM"
    assert sum(t.bounced for t in loaded.tensors.values()) == loaded.completed.bounced, (
        "the tensors' bytes through RAM do not add up to the transfer's"
    )
    for name, a, b in offsets:
        t = loaded.tensors[name]
        assert t.nbytes == b - a and t.tensor is None, f"{t!r}"
        assert cpu[t.offset : t.offset + t.nbytes] == data[a:b], f"tensor {name} differs"
        if t.nbytes >= 2 * MIB:
            assert t.bounced == 0 and t.reason is None, f"a big tensor went through RAM: {t!r}"
        if t.bounced:
            assert t.reason and "partial block" in t.reason, f"{t!r}"
    assert loaded.tensors["t4"].bounced > 0, "the last 100 bytes cannot have gone direct"
    # A subset, read alone.
    only = fgds.safetensors.load(path, mem, names=["t3"])
    t3 = only.tensors["t3"]
    assert list(only.tensors) == ["t3"] and t3.path == "direct", f"{only!r}"
    a, b = offsets[3][1], offsets[3][2]
    assert cpu[t3.offset : t3.offset + t3.nbytes] == data[a:b], "t3 read alone differs"
    expect_error(KeyError, lambda: fgds.safetensors.load(path, mem, names=["nope"]))
    cpu.close()
    os.close(fd)
    os.unlink(path)


def kvikio_signatures_and_defaults() -> None:
    """kvikio's shapes: ``pread(buf, size, file_offset, task_size)``, ``defaults.set`` as a call
    and as a context manager, the three compatibility modes, ``CuFile(path, flags)``."""
    mem, bar, fd = vgpu(4 * MIB)
    os.close(fd)
    with fgds.CuFile(rig.nvme(), "r") as f:
        # The fourth positional argument is the task size, as kvikio's.
        check_direct(f.pread(mem, 4 * MIB, 16 * MIB, 64 * 1024).get(), 4 * MIB)
        rig.gpu_check(bar, 4 * MIB, NVME_SEED, 16 * MIB)
        check_direct(f.read(mem, 2 * MIB, 8 * MIB, 4096, buf_offset=2 * MIB), 2 * MIB)
        rig.gpu_check(bar + 2 * MIB, 2 * MIB, NVME_SEED, 8 * MIB)
        expect_error(ValueError, lambda: f.pread(mem, 4096, 0, 0), text="task_size")
    before = (fgds.defaults.task_size(), fgds.defaults.compat_mode(), fgds.defaults.queue_depth())
    with fgds.defaults.set({"task_size": 128 * 1024, "queue_depth": 2}):
        assert fgds.defaults.task_size() == 128 * 1024 and fgds.defaults.queue_depth() == 2
        with fgds.open(rig.nvme()) as f:
            check_direct(f.read(mem, 4 * MIB, 20 * MIB), 4 * MIB)
    assert (
        fgds.defaults.task_size(),
        fgds.defaults.compat_mode(),
        fgds.defaults.queue_depth(),
    ) == before, "defaults.set as a context manager did not put the old values back"
    rig.gpu_check(bar, 4 * MIB, NVME_SEED, 20 * MIB)
    with fgds.defaults.set("compat_mode", "on"):
        with fgds.open(rig.nvme()) as f:
            assert f.compat_mode == "on"
            check_bounce(f.read(mem, 1 * MIB, 28 * MIB), 1 * MIB, "compatibility mode on")
    rig.gpu_check(bar, 1 * MIB, NVME_SEED, 28 * MIB)
    with fgds.open(rig.nvme(), compat_mode="off") as f:
        assert not f.fallback
        expect_error(
            fgds.DirectUnavailable, lambda: f.read(mem, 1 * MIB, 4 * MIB + 8), errno.EINVAL
        )
    expect_error(KeyError, lambda: fgds.defaults.set("threads", 4), text="compat_mode")
    expect_error(ValueError, lambda: fgds.defaults.set("compat_mode", "maybe"))
    expect_error(ValueError, lambda: fgds.open(rig.nvme(), compat_mode="sometimes"))


def fallback_no_fgds_node_reported() -> None:
    fd, bar = rig.vgpu_alloc(2 * MIB)
    # A GPU fgds does not serve: as on a machine without the module.
    mem = fgds.DmaBuf(fd, 0, 2 * MIB, gpu="0000:ff:1f.7")
    os.close(fd)
    why = fgds.why_not_direct(mem)
    assert not fgds.is_direct(mem) and why and "no fgds device for GPU 0000:ff:1f.7" in why, why
    with fgds.open(rig.nvme(), "r+") as f:
        check_bounce(f.read(mem, 2 * MIB, 16 * MIB), 2 * MIB, "no fgds device")
        rig.gpu_check(bar, 2 * MIB, NVME_SEED, 16 * MIB)
        # Out through the dma-buf's CPU mapping too.
        check_bounce(f.write(mem, 2 * MIB, SCRATCH2), 2 * MIB, "no fgds device")
    assert rig.drive_bytes(SCRATCH2, 2 * MIB) == rig.drive_bytes(16 * MIB, 2 * MIB)


def fallback_system_ram_dmabuf() -> None:
    fd, memfd = rig.udmabuf(4 * MIB)
    mem = fgds.DmaBuf(fd, 0, 4 * MIB)
    os.close(fd)
    why = fgds.why_not_direct(mem)
    assert why and "udmabuf" in why, why
    expect_error(fgds.DirectUnavailable, lambda: fgds.register(mem), errno.EINVAL, "udmabuf")
    with fgds.open(rig.nvme()) as f:
        check_bounce(f.read(mem, 4 * MIB, 24 * MIB), 4 * MIB, "udmabuf")
    assert os.pread(memfd, 4 * MIB, 0) == rig.drive_bytes(24 * MIB, 4 * MIB), "RAM differs"
    os.close(memfd)


def fallback_tmpfs_file_says_why() -> None:
    """A file fgds's driver refuses (tmpfs: its direct I/O is no DMA) goes through RAM, and the
    reason is the driver's verdict (FGDS_IOCTL_CHECK_FILE), which no kernel log line has to
    give an unprivileged process."""
    mem, bar, fd = vgpu(2 * MIB)
    os.close(fd)
    path = "/tmp/fgds_python_tmpfs.bin"
    with open(path, "wb") as out:
        out.write(rig.drive_bytes(16 * MIB, 2 * MIB))
    try:
        with fgds.open(path) as f:
            done = f.read(mem, 2 * MIB, 0)
        rig.diag(f"a file on tmpfs: {done!r}")
        # Before Linux 6.6 tmpfs refuses O_DIRECT itself, and the package says that instead.
        major, minor = (int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
        why = "file system's direct I/O" if (major, minor) >= (6, 6) else "O_DIRECT"
        check_bounce(done, 2 * MIB, why)
        rig.gpu_check(bar, 2 * MIB, NVME_SEED, 16 * MIB)
    finally:
        os.unlink(path)


def fallback_off_raises_with_the_reason() -> None:
    mem, _, fd = vgpu(2 * MIB)
    os.close(fd)
    with fgds.open(rig.nvme(), fallback=False) as f:
        assert not f.fallback
        err = expect_error(
            fgds.DirectUnavailable, lambda: f.read(mem, 1 * MIB, 4 * MIB + 8), errno.EINVAL
        )
        assert "block boundary" in str(err) and "fallback" in str(err), str(err)
        expect_error(
            fgds.DirectUnavailable, lambda: f.pread(mem, 1 * MIB, 0, buf_offset=8).get(), errno.EINVAL
        )
        # Direct still works with the fallback off.
        check_direct(f.read(mem, 1 * MIB, 0), 1 * MIB)
    fd, _ = rig.vgpu_alloc(2 * MIB)
    elsewhere = fgds.DmaBuf(fd, 0, 2 * MIB, gpu="0000:ff:1f.7")
    os.close(fd)
    assert fgds.fallback_enabled()
    fgds.set_fallback(False)
    try:
        with fgds.open(rig.nvme()) as f:
            expect_error(
                fgds.DirectUnavailable,
                lambda: f.read(elsewhere, 2 * MIB, 0),
                errno.ENODEV,
                "no fgds device for GPU 0000:ff:1f.7",
            )
    finally:
        fgds.set_fallback(True)


class FakeCudaArray:
    """An object with a __cuda_array_interface__ (the guest has no CUDA)."""

    def __init__(self, strides: Optional[Tuple[int, ...]] = None) -> None:
        self.strides = strides

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        return {
            "data": (0x7F0000000000, False),
            "shape": (64, 1024),
            "typestr": "<f4",
            "strides": self.strides,
            "version": 3,
        }


class CpuDLPack:
    def __dlpack__(self, stream: Any = None) -> Any:
        raise AssertionError("a CPU array's capsule must not be asked for")

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (1, 0)  # kDLCPU


def bad_arguments_raise_with_errno() -> None:
    mem, _, fd = vgpu(4 * MIB)
    with fgds.open(rig.nvme()) as f:
        expect_error(fgds.Error, lambda: f.read(mem, 4 * MIB + 4096), errno.EINVAL, "do not fit")
        expect_error(fgds.Error, lambda: f.read(mem, 4096, 0, buf_offset=4 * MIB), errno.EINVAL, "do not fit")
        expect_error(fgds.Error, lambda: f.read(mem, 4096, -1), errno.EINVAL, "negative")
        expect_error(TypeError, lambda: f.read(mem, "4096"))  # type: ignore[arg-type]
        expect_error(TypeError, lambda: f.read(bytearray(4096)), text="not GPU memory")  # type: ignore[arg-type]
        expect_error(TypeError, lambda: f.read(CpuDLPack()), text="not CUDA memory")
        expect_error(fgds.Error, lambda: f.pwrite(mem, 4096).get(), errno.EBADF, "reading only")
        expect_error(
            fgds.Error, lambda: f.read(FakeCudaArray(strides=(8, 4096))), errno.EINVAL, "C-contiguous"
        )
        expect_error(fgds.Error, lambda: f.read(FakeCudaArray()), errno.ELIBACC, "CUDA")
        expect_error(
            fgds.Error, lambda: f.read(fgds.DevicePointer(0x7F0000000000, 4096)), errno.ELIBACC
        )
    expect_error(ValueError, lambda: f.read(mem, 4096), text="closed file")
    expect_error(fgds.Error, lambda: fgds.open("/nonexistent/file"), errno.ENOENT, "/nonexistent/file")
    expect_error(fgds.Error, lambda: fgds.open(rig.nvme(), "rw"), errno.EINVAL, "mode")
    null = os.open("/dev/null", os.O_RDONLY)
    expect_error(fgds.Error, lambda: fgds.DmaBuf(null, 0, 4096), errno.EINVAL, "not a dma-buf")
    os.close(null)
    expect_error(fgds.Error, lambda: fgds.DmaBuf(fd, 2 * MIB, 4 * MIB), errno.EINVAL, "run past the end")
    os.close(fd)
    err = expect_error(fgds.Error, lambda: fgds.open("/nonexistent/file"))
    assert isinstance(err, OSError) and isinstance(err, fgds.Error) and err.strerror


def drive_error_carries_errno_and_bytes_done() -> None:
    mem, _, fd = vgpu(8 * MIB)
    os.close(fd)
    with fgds.open(rig.nvme()) as f:
        # 4 MiB of good sectors, then the always-failing area: an error, not a fallback.
        future = f.pread(mem, 8 * MIB, rig.READ_ALWAYS - 4 * MIB)
        try:
            done = future.get()
        except fgds.Error as err:
            assert err.errno in (errno.EIO, errno.ENODATA), f"errno {err.errno}: {err}"
            assert err.bytes_done == 4 * MIB, f"bytes_done {err.bytes_done}: {err}"
            assert "after 4194304 of 8388608 bytes" in str(err), str(err)
        else:
            raise AssertionError(f"a read across the drive's failing area completed: {done!r}")


def registration_per_dmabuf_object() -> None:
    def buffers() -> int:
        return int(rig.sysfs("buffers"))

    # Earlier cases' memory may wait for the collector (a traceback's frames hold it).
    gc.collect()
    before = buffers()
    mem, bar, fd = vgpu(2 * MIB)
    os.close(fd)
    assert buffers() == before + 1, f"{buffers()} registrations, expected {before + 1}"
    with fgds.open(rig.nvme()) as f:
        for _ in range(3):
            check_direct(f.read(mem, 2 * MIB, 0), 2 * MIB)
        with fgds.register(mem) as registered:
            assert registered.gpu == mem._memory.gpu and registered.nbytes == 2 * MIB
            check_direct(f.read(registered, 1 * MIB, 6 * MIB, buf_offset=1 * MIB), 1 * MIB)
        assert buffers() == before + 1, f"{buffers()} registrations after reuse"
    rig.gpu_check(bar, 1 * MIB, NVME_SEED, 0)
    rig.gpu_check(bar + 1 * MIB, 1 * MIB, NVME_SEED, 6 * MIB)
    del mem, registered
    gc.collect()
    deadline = time.monotonic() + 10
    while buffers() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert buffers() == before, f"{buffers()} registrations after the DmaBuf went, expected {before}"
    assert fgds.clear_cache() == 0  # no CUDA allocation here


def probe() -> None:
    """Skips the program where fgds refuses this setup by design, as the Rust programs do
    (tests/src/guest.rs, fgds_refusal), and reports the mode sysfs shows; skips where vgpu is not
    loaded (tests/src/guest.rs, vgpu_absence)."""
    exporter = os.environ.get("FGDS_EXPORTER", "vgpu")
    if exporter != "vgpu":
        rig.skip_program(
            f"the GPU is bound to vfio-pci (--exporter {exporter}), not to vgpu, which is not "
            "loaded: this needs vgpu (fgds_vfio and uring_dmabuf cover vfio-pci)"
        )
    fd, _ = rig.vgpu_alloc(4096)
    try:
        mem = fgds.DmaBuf(fd, 0, 4096)
    finally:
        os.close(fd)
    mode = rig.sysfs("mode")
    print(f"# fgds-report: fgds mode={mode}")
    if json.loads(fgds.doctor(json=True))["uring_dmabuf"]["available"]:
        rig.skip_program(
            "this kernel has its own dma-buf registered buffers (the comparator series), which "
            "take dma-bufs before fgds: these cases assert fgds's path; uring_dmabuf and "
            "fgds_crate check the kernel's"
        )
    try:
        fgds.register(mem).close()
    except fgds.DirectUnavailable as err:
        if err.errno == errno.EOPNOTSUPP and mode == "refused":
            rig.skip_program(
                "EOPNOTSUPP: fgds refuses this setup as designed (sysfs mode refused; "
                "fgds_badinput::unsafe_setup_refused checks the refusal)"
            )
        rig.diag(f"the probe registration failed, and not as a refusal: {err}")

if __name__ == "__main__":
    probe()
    rig.run(
        [
            ("read_direct_host_checked", read_direct_host_checked),
            ("write_direct_round_trip", write_direct_round_trip),
            ("futures_in_flight_together", futures_in_flight_together),
            ("partial_read_at_end_of_file", partial_read_at_end_of_file),
            ("write_unaligned_length_to_a_file", write_unaligned_length_to_a_file),
            ("fallback_misaligned_offsets_reported", fallback_misaligned_offsets_reported),
            ("unaligned_offsets_in_phase_go_direct", unaligned_offsets_in_phase_go_direct),
            ("safetensors_hf_layout_loads_direct", safetensors_hf_layout_loads_direct),
            ("kvikio_signatures_and_defaults", kvikio_signatures_and_defaults),
            ("safetensors_loader_reports_each_tensor", safetensors_loader_reports_each_tensor),
            ("fallback_no_fgds_node_reported", fallback_no_fgds_node_reported),
            ("fallback_system_ram_dmabuf", fallback_system_ram_dmabuf),
            ("fallback_tmpfs_file_says_why", fallback_tmpfs_file_says_why),
            ("fallback_off_raises_with_the_reason", fallback_off_raises_with_the_reason),
            ("bad_arguments_raise_with_errno", bad_arguments_raise_with_errno),
            ("drive_error_carries_errno_and_bytes_done", drive_error_carries_errno_and_bytes_done),
            ("registration_per_dmabuf_object", registration_per_dmabuf_object),
        ]
    )
