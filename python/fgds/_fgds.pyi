"""Types of fgds._fgds, the native half of the fgds package (python/src/lib.rs)."""

import os
from typing import Any, Optional, Tuple, final

__all__ = [
    "DirectUnavailable",
    "Error",
    "File",
    "Memory",
    "cached",
    "clear_cache",
    "cuda_memory",
    "dlpack_info",
    "dmabuf_memory",
    "doctor",
]

class Error(OSError):
    """An fgds error: ``errno`` names it, ``strerror`` says what was wrong and what to do."""

    bytes_done: int
    """For a transfer that failed part-way: the bytes from its start known to be complete."""

class DirectUnavailable(Error):
    """The direct path is not there for a transfer and the fallback through host RAM is off."""

@final
class Memory:
    """GPU memory resolved for transfers, with its fgds registration or the reason for none."""

    @property
    def kind(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def is_direct(self) -> bool: ...
    @property
    def why_not_direct(self) -> Optional[str]: ...
    @property
    def errno(self) -> Optional[int]: ...
    @property
    def gpu(self) -> Optional[str]: ...

def cuda_memory(ptr: int, length: int) -> Memory: ...
def dmabuf_memory(fd: int, offset: int, length: int, gpu: Optional[str] = None) -> Memory: ...
def dlpack_info(capsule: Any) -> Tuple[int, int, int, int]:
    """``(address, nbytes, device_type, device_id)`` of a C-contiguous DLPack tensor."""

@final
class File:
    def __new__(cls, path: os.PathLike[str] | str, mode: str) -> File: ...
    @property
    def path(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    @property
    def alignment(self) -> int: ...
    @property
    def why_not_direct(self) -> Optional[str]: ...
    def read(
        self,
        memory: Memory,
        size: int,
        file_offset: int,
        memory_offset: int,
        compat_mode: str,
        task_size: int,
        queue_depth: int,
    ) -> Tuple[int, str, Optional[str], int]:
        """``(bytes, path, reason, bounced)``."""
    def write(
        self,
        memory: Memory,
        size: int,
        file_offset: int,
        memory_offset: int,
        compat_mode: str,
        task_size: int,
        queue_depth: int,
    ) -> Tuple[int, str, Optional[str], int]: ...
    def nbytes(self) -> int: ...
    def fileno(self) -> int: ...
    def close(self) -> None: ...

def clear_cache() -> int: ...
def cached() -> int: ...
def doctor(json: bool = False) -> str: ...
