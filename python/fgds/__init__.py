"""fgds for Python: reads and writes between files and GPU memory.

Direct where the fgds kernel driver can make the NVMe drive DMA straight into GPU memory (a
CUDA allocation exported as a dma-buf, or any dma-buf), through host RAM where it cannot, and
every transfer says which path it took and why not the direct one::

    import fgds, torch

    weights = torch.empty(n, dtype=torch.uint8, device="cuda")
    with fgds.open("/data/model.safetensors", "r") as f:
        done = f.pread(weights, n, file_offset=header).get()   # an IOFuture, as kvikio's
        print(int(done), done.path, done.reason)               # 1073741824 bounce "no fgds ..."

The API follows kvikio's ``CuFile``: ``pread(buf, size, file_offset, task_size)`` and
``pwrite`` return futures, ``read``/``write`` block, ``fgds.defaults`` holds the task size, the
queue depth and the compatibility mode; where fgds has more (``buf_offset``, the path and the
reason of every transfer), it is keyword-only or an attribute. ``docs/python.md`` is the guide.

The fallback through host RAM is on by default (compatibility mode ``"auto"``);
``defaults.set("compat_mode", "off")``, ``set_fallback(False)``, ``open(..., fallback=False)``
or ``FGDS_FALLBACK=0`` switch it off, and a transfer that cannot go direct then raises
:class:`DirectUnavailable` with the reason; ``"on"`` sends every transfer through RAM. Errors
are :class:`Error` (an ``OSError``): ``errno`` names what was wrong, ``strerror`` says what and
what to do.
"""

from __future__ import annotations

import errno as _errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Protocol, Tuple, Union

from . import _fgds
from ._fgds import DirectUnavailable, Error

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Completed",
    "CuFile",
    "DevicePointer",
    "DirectUnavailable",
    "DmaBuf",
    "Error",
    "File",
    "IOFuture",
    "clear_cache",
    "defaults",
    "doctor",
    "fallback_enabled",
    "is_direct",
    "open",
    "register",
    "set_fallback",
    "why_not_direct",
]


class SupportsCudaArrayInterface(Protocol):
    """An object with Numba's ``__cuda_array_interface__`` (PyTorch, CuPy, Numba, ...)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...


class SupportsDLPack(Protocol):
    """An object with ``__dlpack__`` and ``__dlpack_device__`` (the array API standard)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...

    def __dlpack_device__(self) -> Tuple[int, int]: ...


#: What a transfer can move data into or out of.
BufferLike = Union[
    "Buffer", "DmaBuf", "DevicePointer", SupportsCudaArrayInterface, SupportsDLPack
]

#: kvikio's compatibility modes: the fallback through host RAM allowed, off, or always.
COMPAT_MODES = ("auto", "off", "on")


def _env(names: Tuple[str, ...], default: str) -> str:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            return value.strip()
    return default


def _compat_from_env() -> str:
    mode = _env(("FGDS_COMPAT_MODE", "KVIKIO_COMPAT_MODE"), "").lower()
    if mode in COMPAT_MODES:
        return mode
    fallback = _env(("FGDS_FALLBACK",), "1").lower()
    return "off" if fallback in ("0", "off", "no", "false") else "auto"


class _Setting:
    """What ``defaults.set`` returns: the change is made already; as a context manager it is
    undone at the end of the ``with`` block, as kvikio's is."""

    def __init__(self, previous: dict[str, object]) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        defaults._apply(self._previous)


class _Defaults:
    """The defaults of transfers, as kvikio's ``kvikio.defaults``: ``task_size`` (bytes per
    request of the direct path, ``FGDS_TASK_SIZE`` or ``KVIKIO_TASK_SIZE``, 1 MiB), ``queue_depth``
    (requests in flight per transfer, ``FGDS_QUEUE_DEPTH``, 8; kvikio has threads instead) and
    ``compat_mode`` (``"auto"``, ``"off"`` or ``"on"``, ``FGDS_COMPAT_MODE`` or
    ``KVIKIO_COMPAT_MODE``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, object] = {
            "compat_mode": _compat_from_env(),
            "task_size": int(_env(("FGDS_TASK_SIZE", "KVIKIO_TASK_SIZE"), str(1 << 20))),
            "queue_depth": int(_env(("FGDS_QUEUE_DEPTH",), "8")),
        }

    def compat_mode(self) -> str:
        return str(self._values["compat_mode"])

    def task_size(self) -> int:
        return int(str(self._values["task_size"]))

    def queue_depth(self) -> int:
        return int(str(self._values["queue_depth"]))

    @staticmethod
    def _check(key: str, value: object) -> object:
        if key == "compat_mode":
            mode = str(value).lower()
            if mode not in COMPAT_MODES:
                raise ValueError(f"compat_mode {value!r}: use one of {COMPAT_MODES}")
            return mode
        if key in ("task_size", "queue_depth"):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{key} must be a positive int, not {value!r}")
            return value
        raise KeyError(f"no default {key!r}: fgds has compat_mode, task_size and queue_depth")

    def _apply(self, values: dict[str, object]) -> dict[str, object]:
        checked = {key: self._check(key, value) for key, value in values.items()}
        with self._lock:
            previous = {key: self._values[key] for key in checked}
            self._values.update(checked)
        return previous

    def set(self, config: Union[str, dict[str, object]], value: object = None) -> _Setting:
        """Sets defaults: ``set("task_size", 4 << 20)`` or ``set({"task_size": ..., ...})``.
        Usable as a context manager that puts the old values back."""
        values = {config: value} if isinstance(config, str) else dict(config)
        return _Setting(self._apply(values))


#: The defaults of every transfer (kvikio's ``kvikio.defaults``).
defaults = _Defaults()


def set_fallback(enabled: bool) -> None:
    """Switches the fallback through host RAM on or off for files opened without ``fallback=``
    (``defaults.set("compat_mode", "auto" or "off")``)."""
    defaults.set("compat_mode", "auto" if enabled else "off")


def fallback_enabled() -> bool:
    """Whether transfers that cannot go direct go through host RAM (else they raise)."""
    return defaults.compat_mode() != "off"


def _error(code: int, message: str) -> Error:
    err = Error(code, message)
    err.bytes_done = 0
    return err


class DmaBuf:
    """``length`` bytes at ``offset`` of a dma-buf (an fd from a GPU runtime's export).

    Its fgds registration is made here (with GPU ``gpu``, a PCI address, or the first GPU fgds
    serves that accepts the dma-buf) and kept for the object's life; the fd is duplicated, so
    the caller may close its own. Where fgds cannot register it, transfers copy through the
    dma-buf's CPU mapping and say why.
    """

    def __init__(
        self,
        fd: int,
        offset: int = 0,
        length: Optional[int] = None,
        *,
        gpu: Optional[str] = None,
    ) -> None:
        _non_negative(offset=offset, fd=fd)
        if length is None:
            try:
                size = os.lseek(fd, 0, os.SEEK_END)
            except OSError as err:
                raise _error(
                    err.errno or _errno.EINVAL,
                    f"fd {fd} has no size ({err.strerror}): is it a dma-buf?",
                ) from None
            length = size - offset
        _non_negative(length=length)
        self.fd = fd
        self.offset = offset
        self.length = length
        self._memory = _fgds.dmabuf_memory(fd, offset, length, gpu)

    def __repr__(self) -> str:
        return f"DmaBuf(fd={self.fd}, offset={self.offset}, length={self.length})"


class DevicePointer:
    """``nbytes`` of CUDA device memory at address ``ptr`` (``cudaMalloc``'s, ``cuMemAlloc``'s).

    The memory must stay allocated while transfers use it; ``owner``, if given, is kept alive
    by every transfer that uses this pointer.
    """

    def __init__(self, ptr: int, nbytes: int, owner: object = None) -> None:
        _non_negative(ptr=ptr, nbytes=nbytes)
        self.ptr = ptr
        self.nbytes = nbytes
        self.owner = owner

    def __repr__(self) -> str:
        return f"DevicePointer({self.ptr:#x}, {self.nbytes})"


class Buffer:
    """GPU memory registered with fgds for as long as this object lives (``register``)."""

    def __init__(self, memory: _fgds.Memory, keep: object) -> None:
        self._memory: Optional[_fgds.Memory] = memory
        self._keep = keep

    @property
    def nbytes(self) -> int:
        return self._open().length

    @property
    def gpu(self) -> Optional[str]:
        """The GPU (PCI address) whose fgds node holds the registration."""
        return self._open().gpu

    @property
    def closed(self) -> bool:
        return self._memory is None

    def _open(self) -> _fgds.Memory:
        if self._memory is None:
            raise ValueError("the fgds.Buffer was closed")
        return self._memory

    def close(self) -> None:
        """Drops this registration (it goes once no transfer uses it)."""
        self._memory = None
        self._keep = None

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<fgds.Buffer {self._memory!r}>"


def _non_negative(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if value < 0:
            raise _error(_errno.EINVAL, f"{name} {value} is negative")


# DLPack device types (dlpack.h): memory a transfer can reach with CUDA.
_KDL_CUDA = 2
_KDL_CUDA_MANAGED = 13


def _cuda_array_interface(buf: Any) -> Tuple[int, int, bool]:
    """(address, nbytes, read-only) of a C-contiguous ``__cuda_array_interface__``."""
    cai = buf.__cuda_array_interface__
    ptr, readonly = cai["data"]
    shape = tuple(int(d) for d in cai["shape"])
    typestr = str(cai["typestr"])
    itemsize = int(typestr[2:])
    nbytes = itemsize
    for dim in shape:
        nbytes *= dim
    strides = cai.get("strides")
    if strides is not None:
        expect = itemsize
        for dim, stride in reversed(list(zip(shape, strides))):
            if dim != 1 and stride != expect:
                raise _error(
                    _errno.EINVAL,
                    f"the CUDA array is not C-contiguous (shape {shape}, strides {tuple(strides)}): "
                    "pass a contiguous one (.contiguous())",
                )
            expect *= dim
    if cai.get("mask") is not None:
        raise _error(_errno.EINVAL, "a masked CUDA array cannot be a transfer's buffer")
    return int(ptr or 0), nbytes, bool(readonly)


def _resolve(buf: object, writing_to_gpu: bool) -> Tuple[_fgds.Memory, object]:
    """The memory of ``buf`` and what must stay alive while a transfer uses it."""
    if isinstance(buf, Buffer):
        return buf._open(), buf
    if isinstance(buf, DmaBuf):
        return buf._memory, buf
    if isinstance(buf, DevicePointer):
        return _fgds.cuda_memory(buf.ptr, buf.nbytes), buf
    if hasattr(buf, "__cuda_array_interface__"):
        ptr, nbytes, readonly = _cuda_array_interface(buf)
        if readonly and writing_to_gpu:
            raise _error(_errno.EACCES, "the CUDA array is read-only: a read cannot fill it")
        return _fgds.cuda_memory(ptr, nbytes), buf
    if hasattr(buf, "__dlpack__") and hasattr(buf, "__dlpack_device__"):
        device_type, _ = buf.__dlpack_device__()
        if device_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            raise TypeError(
                f"the DLPack array is on device type {device_type}, not CUDA memory: "
                "fgds moves data to and from GPU memory"
            )
        try:
            capsule = buf.__dlpack__(stream=None)
        except TypeError:
            capsule = buf.__dlpack__()
        ptr, nbytes, _, _ = _fgds.dlpack_info(capsule)
        return _fgds.cuda_memory(ptr, nbytes), (buf, capsule)
    raise TypeError(
        f"{type(buf).__name__} is not GPU memory: pass a CUDA array (__cuda_array_interface__ "
        "or DLPack), fgds.DevicePointer(ptr, nbytes), fgds.DmaBuf(fd, offset, length) or an "
        "fgds.Buffer"
    )


def is_direct(buf: BufferLike) -> bool:
    """Whether fgds registered ``buf``'s memory: transfers into it can go direct (with
    offsets aligned to the file's O_DIRECT alignment)."""
    memory, _ = _resolve(buf, False)
    return memory.is_direct


def why_not_direct(buf: BufferLike) -> Optional[str]:
    """Why transfers into ``buf`` cannot go direct (``fgds doctor``'s reasoning where the
    machine is in the way); None where they can."""
    memory, _ = _resolve(buf, False)
    return memory.why_not_direct


def register(buf: BufferLike) -> Buffer:
    """Registers ``buf``'s memory with fgds and keeps the registration for the returned
    Buffer's life. Raises :class:`DirectUnavailable` (with the reason) where fgds cannot."""
    memory, keep = _resolve(buf, False)
    if not memory.is_direct:
        err = DirectUnavailable(
            memory.errno or _errno.ENODEV,
            f"fgds cannot register this memory: {memory.why_not_direct}",
        )
        err.bytes_done = 0
        raise err
    return Buffer(memory, keep)


def clear_cache() -> int:
    """Drops the cached registrations of CUDA allocations; returns how many there were."""
    return _fgds.clear_cache()


def doctor(json: bool = False) -> str:
    """``fgds doctor``: which path a read into GPU memory takes on this machine, and why not
    the direct one (text, or JSON)."""
    return _fgds.doctor(json)


class Completed(int):
    """A completed transfer: the number of bytes moved (an ``int``, as kvikio returns), with
    the path it took."""

    path: str
    """``uring-dmabuf`` (the kernel's own dma-buf registered buffers, where the kernel has
    them), ``direct`` (fgds) or ``bounce`` (through host RAM)."""
    reason: Optional[str]
    """Why not a better path: for ``bounce``, why not direct; for ``direct``, why not
    ``uring-dmabuf`` where the kernel has it; ``None`` where the best path was taken."""
    bounced: int
    """Bytes that went through host RAM: all of a bounce, a sub-block tail of a direct one."""

    def __new__(cls, nbytes: int, path: str, reason: Optional[str], bounced: int) -> Completed:
        done = super().__new__(cls, nbytes)
        done.path = path
        done.reason = reason
        done.bounced = bounced
        return done

    @property
    def direct(self) -> bool:
        """Whether the drive's DMA reached GPU memory with no copy through host RAM."""
        return self.path in ("direct", "uring-dmabuf")

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"Completed({int(self)}, path={self.path!r}{why})"


class IOFuture:
    """A transfer under way, as kvikio's ``IOFuture``: ``get()`` waits and returns its
    :class:`Completed`, or raises its :class:`Error`."""

    def __init__(self, future: Future[Completed], keep: object) -> None:
        self._future = future
        # The memory's owner lives until the transfer ends.
        self._keep: object = keep
        future.add_done_callback(lambda _: setattr(self, "_keep", None))

    def get(self, timeout: Optional[float] = None) -> Completed:
        return self._future.result(timeout)

    result = get

    def done(self) -> bool:
        return self._future.done()

    @property
    def path(self) -> str:
        """``direct`` or ``bounce`` (waits for the transfer)."""
        return self.get().path

    @property
    def reason(self) -> Optional[str]:
        """Why not direct (waits for the transfer)."""
        return self.get().reason


_executor_lock = threading.Lock()
_executor: Optional[ThreadPoolExecutor] = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            workers = int(os.environ.get("FGDS_THREADS", "8"))
            _executor = ThreadPoolExecutor(max(1, workers), thread_name_prefix="fgds")
        return _executor


class File:
    """A file open for transfers to and from GPU memory (kvikio's ``CuFile``)."""

    def __init__(
        self,
        path: Union[str, os.PathLike[str]],
        mode: str = "r",
        *,
        fallback: Optional[bool] = None,
        compat_mode: Optional[str] = None,
    ) -> None:
        self._native = _fgds.File(os.fspath(path), mode)
        self._fallback = fallback
        if compat_mode is not None:
            defaults._check("compat_mode", compat_mode)
        self._compat_mode = compat_mode

    @property
    def path(self) -> str:
        return str(self._native.path)

    @property
    def mode(self) -> str:
        return self._native.mode

    @property
    def closed(self) -> bool:
        return self._native.closed

    @property
    def alignment(self) -> int:
        """The file's O_DIRECT alignment: direct transfers need offsets that are multiples."""
        return self._native.alignment

    def phase(self, file_offset: int) -> int:
        """Where in a block of ``alignment`` bytes the memory of a transfer at ``file_offset``
        must start for all but its partial first and last blocks to go direct: a loader reading
        a region at any offset (a safetensors file's data starts at 8 + the header's length)
        allocates this many bytes more and reads into its buffer at this offset."""
        _non_negative(file_offset=file_offset)
        return file_offset % self.alignment

    @property
    def why_not_direct(self) -> Optional[str]:
        """Why the file cannot take direct I/O at all (its file system); None where it can."""
        return self._native.why_not_direct

    @property
    def compat_mode(self) -> str:
        """This file's compatibility mode: ``compat_mode=``, else ``"auto"``/``"off"`` from
        ``fallback=``, else ``defaults.compat_mode()``."""
        if self._compat_mode is not None:
            return self._compat_mode.lower()
        if self._fallback is not None:
            return "auto" if self._fallback else "off"
        return defaults.compat_mode()

    @property
    def fallback(self) -> bool:
        """Whether a transfer that cannot go direct goes through host RAM."""
        return self.compat_mode != "off"

    def fileno(self) -> int:
        return self._native.fileno()

    def nbytes(self) -> int:
        """The file's size in bytes."""
        return self._native.nbytes()

    def close(self) -> None:
        """Closes the file; transfers under way finish first."""
        self._native.close()

    def __enter__(self) -> File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _transfer(
        self,
        to_gpu: bool,
        buf: BufferLike,
        size: Optional[int],
        file_offset: int,
        task_size: Optional[int],
        buf_offset: int,
        dev_offset: Optional[int],
    ) -> Tuple[Callable[[], Completed], object]:
        """The transfer as a call, and what must stay alive while it runs."""
        if self._native.closed:
            raise ValueError("I/O operation on closed file")
        if dev_offset is not None:
            buf_offset = dev_offset
        _non_negative(file_offset=file_offset, buf_offset=buf_offset)
        if task_size is None:
            task_size = defaults.task_size()
        elif not isinstance(task_size, int) or isinstance(task_size, bool) or task_size <= 0:
            raise ValueError(f"task_size must be a positive int, not {task_size!r}")
        memory, keep = _resolve(buf, to_gpu)
        nbytes = max(0, memory.length - buf_offset) if size is None else size
        _non_negative(size=nbytes)
        call = self._native.read if to_gpu else self._native.write
        compat, depth = self.compat_mode, defaults.queue_depth()

        def run() -> Completed:
            return Completed(
                *call(memory, nbytes, file_offset, buf_offset, compat, task_size, depth)
            )

        return run, keep

    def pread(
        self,
        buf: BufferLike,
        size: Optional[int] = None,
        file_offset: int = 0,
        task_size: Optional[int] = None,
        *,
        buf_offset: int = 0,
        dev_offset: Optional[int] = None,
    ) -> IOFuture:
        """Reads ``size`` bytes (default: to the end of ``buf``) at ``file_offset`` into
        ``buf``, on a worker thread, as kvikio's ``CuFile.pread``: the direct path in requests
        of ``task_size`` bytes (default ``defaults.task_size()``), ``defaults.queue_depth()`` in
        flight. The future's result is the bytes read: fewer where the file ends first.
        ``buf_offset`` (or kvikio's ``dev_offset``) is where in ``buf`` the bytes go."""
        run, keep = self._transfer(
            True, buf, size, file_offset, task_size, buf_offset, dev_offset
        )
        return IOFuture(_pool().submit(run), keep)

    def pwrite(
        self,
        buf: BufferLike,
        size: Optional[int] = None,
        file_offset: int = 0,
        task_size: Optional[int] = None,
        *,
        buf_offset: int = 0,
        dev_offset: Optional[int] = None,
    ) -> IOFuture:
        """Writes ``size`` bytes of ``buf`` to the file at ``file_offset``, on a worker thread
        (see ``pread``)."""
        run, keep = self._transfer(
            False, buf, size, file_offset, task_size, buf_offset, dev_offset
        )
        return IOFuture(_pool().submit(run), keep)

    def read(
        self,
        buf: BufferLike,
        size: Optional[int] = None,
        file_offset: int = 0,
        task_size: Optional[int] = None,
        *,
        buf_offset: int = 0,
        dev_offset: Optional[int] = None,
    ) -> Completed:
        """``pread`` on this thread: returns when the data is in GPU memory."""
        args = (True, buf, size, file_offset, task_size, buf_offset, dev_offset)
        return self._transfer(*args)[0]()

    def write(
        self,
        buf: BufferLike,
        size: Optional[int] = None,
        file_offset: int = 0,
        task_size: Optional[int] = None,
        *,
        buf_offset: int = 0,
        dev_offset: Optional[int] = None,
    ) -> Completed:
        """``pwrite`` on this thread: returns when the data is in the file (written, not
        synced: ``os.fsync(f.fileno())`` for that)."""
        args = (False, buf, size, file_offset, task_size, buf_offset, dev_offset)
        return self._transfer(*args)[0]()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<fgds.File {self.path!r} mode={self.mode!r} {state}>"


#: kvikio's name: ``fgds.CuFile(path, "r")`` is ``fgds.open(path, "r")``.
CuFile = File


def open(
    path: Union[str, os.PathLike[str]],
    mode: str = "r",
    *,
    fallback: Optional[bool] = None,
    compat_mode: Optional[str] = None,
) -> File:
    """Opens ``path`` for transfers to and from GPU memory. ``mode``: ``r``, ``r+``, ``w``
    (create, truncate), ``w+``, ``a`` (create; writes still name their offsets), ``a+``.
    ``compat_mode`` (``"auto"``, ``"off"``, ``"on"``) or ``fallback`` overrides
    ``defaults.compat_mode()`` for this file."""
    return File(path, mode, fallback=fallback, compat_mode=compat_mode)
