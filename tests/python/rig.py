"""The rig for Python tests in the guest: KTAP output, the control channel (the host's
``gpu_check`` of GPU memory), the test exporter vgpu, udmabuf, and the rig's environment.

The Python counterpart of tests/src/{ktap,ctl,guest,pattern}.rs: the same port, requests,
ioctls and constants.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import sys
import time
import traceback
from typing import Callable, List, NoReturn, Optional, Tuple

MIB = 1 << 20
#: The seed of the pattern in the raw drive's first 64 MiB (tests/pattern/src/lib.rs).
NVME_SEED = 0x66676473
NVME_PATTERN_BYTES = 64 * MIB
#: Reads touching this MiB of the raw drive fail every time (tests/pattern/src/lib.rs, fault).
READ_ALWAYS = 240 * MIB


class Skip(Exception):
    """Raised by a case that skips; its message is the reason."""


def _ioc(direction: int, kind: str, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord(kind) << 8) | nr


_VGPU_ALLOC = _ioc(3, "V", 0x01, 24)  # _IOWR('V', 1, struct vgpu_alloc)
_UDMABUF_CREATE = _ioc(1, "u", 0x42, 24)  # _IOW('u', 0x42, struct udmabuf_create)
VGPU_ALLOC_RDONLY = 1


def env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: run inside the rig (cargo xtask test-vm)")
    return value


def nvme() -> str:
    """The raw NVMe namespace: the pattern, then scratch."""
    return env("FGDS_NVME")


def vgpu_open() -> int:
    names = sorted(os.listdir("/sys/class/vgpu"))
    if not names:
        raise RuntimeError("no vgpu device bound")
    return os.open(f"/dev/{names[0]}", os.O_RDWR | os.O_CLOEXEC)


def vgpu_alloc(size: int, flags: int = 0) -> Tuple[int, int]:
    """``size`` bytes of vgpu memory: its dma-buf fd and its offset in the GPU's BAR2."""
    dev = vgpu_open()
    try:
        arg = bytearray(struct.pack("=QIiQ", size, flags, -1, 0))
        fcntl.ioctl(dev, _VGPU_ALLOC, arg)
        _, _, fd, bar_offset = struct.unpack("=QIiQ", arg)
        return fd, bar_offset
    finally:
        os.close(dev)


def udmabuf(size: int) -> Tuple[int, int]:
    """A dma-buf of ``size`` bytes of system RAM: (dma-buf fd, memfd), or Skip without
    /dev/udmabuf."""
    if not os.path.exists("/dev/udmabuf"):
        raise Skip("no /dev/udmabuf: the kernel has no CONFIG_UDMABUF")
    memfd = os.memfd_create("fgds-python", os.MFD_ALLOW_SEALING)
    os.ftruncate(memfd, size)
    fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    dev = os.open("/dev/udmabuf", os.O_RDWR | os.O_CLOEXEC)
    try:
        arg = bytearray(struct.pack("=IIQQ", memfd, 1, 0, size))
        fd = fcntl.ioctl(dev, _UDMABUF_CREATE, arg)
    finally:
        os.close(dev)
    return fd, memfd


def cpu_map(fd: int, size: int) -> mmap.mmap:
    """The dma-buf's CPU mapping (vgpu and udmabuf have one)."""
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def drive_bytes(offset: int, size: int) -> bytes:
    """``size`` bytes of the raw drive at ``offset``, read plainly (the page cache)."""
    fd = os.open(nvme(), os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _control_port() -> str:
    for port in os.listdir("/sys/class/virtio-ports"):
        with open(f"/sys/class/virtio-ports/{port}/name") as f:
            if f.read().strip() == "fgds.ctl":
                return f"/dev/{port}"
    raise RuntimeError("no virtio-serial port named fgds.ctl: run inside the rig")


def request(line: str) -> str:
    """One request on the control channel; the detail of its ``ok`` reply, or an error with
    the host's reason (tests/src/ctl.rs)."""
    path = _control_port()
    deadline = time.monotonic() + 60
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            break
        except OSError as err:
            if err.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    try:
        os.write(fd, (line + "\n").encode())
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            reply += chunk
    finally:
        os.close(fd)
    text = reply.decode().strip()
    word, _, detail = text.partition(" ")
    if word == "ok":
        return detail
    if word == "error":
        raise AssertionError(f"the host could not {line!r}: {detail}")
    raise AssertionError(f"malformed reply to {line!r}: {text!r}")


def gpu_check(bar_offset: int, size: int, seed: int, pattern_offset: int = 0) -> None:
    """Asks the host to check that ``size`` bytes at ``bar_offset`` of the GPU's memory hold
    the pattern of ``seed`` as it stands at ``pattern_offset`` of its stream, now."""
    request(f"gpu_check {bar_offset:#x} {size:#x} {seed:#x} {pattern_offset:#x}")


def fgds_node() -> str:
    """The sysfs directory of the GPU fgds serves."""
    nodes = sorted(os.listdir("/sys/class/fgds"))
    if not nodes:
        raise RuntimeError("fgds serves no GPU")
    return f"/sys/class/fgds/{nodes[0]}"


def sysfs(attr: str) -> str:
    with open(f"{fgds_node()}/{attr}") as f:
        return f.read().strip()


def diag(message: str) -> None:
    for line in message.splitlines():
        print(f"# {line}")
    sys.stdout.flush()


Case = Tuple[str, Callable[[], None]]


def skip_program(reason: str) -> NoReturn:
    """The whole program skips (exit 4, the reason on the plan line)."""
    print(f"KTAP version 1\n1..0 # SKIP {reason}")
    sys.stdout.flush()
    sys.exit(4)


def run(cases: List[Case]) -> NoReturn:
    """Runs the cases in order as one KTAP document (tests/src/ktap.rs) and exits: 0 if none
    failed. Cases named on the command line run alone."""
    wanted = sys.argv[1:]
    selected = [c for c in cases if not wanted or any(w in c[0] for w in wanted)]
    print("KTAP version 1")
    print(f"1..{len(selected)}")
    sys.stdout.flush()
    failed = 0
    for n, (name, case) in enumerate(selected, 1):
        outcome: Optional[str] = None
        try:
            case()
        except Skip as skip:
            outcome = f"ok {n} {name} # SKIP {' '.join(str(skip).split())}"
        except BaseException:  # noqa: BLE001 - a case's every failure is its result
            failed += 1
            diag(f"{name}: " + traceback.format_exc())
            outcome = f"not ok {n} {name}"
        print(outcome or f"ok {n} {name}")
        sys.stdout.flush()
    sys.exit(1 if failed else 0)
