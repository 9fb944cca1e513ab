//! The exporter's own CPU mapping of a dma-buf (`mmap` of the dma-buf fd), for programs that
//! must touch GPU memory with the CPU (the `bounce` benchmark, tests).

use std::os::fd::BorrowedFd;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A shared CPU mapping of a dma-buf.
///
/// Device memory is never exposed as a Rust slice: DMA can change it under a reference, and the
/// exporter can revoke it (SIGBUS), so every access is a volatile copy.
#[derive(Debug)]
pub struct CpuMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: an address range with no thread affinity; accesses are volatile copies.
unsafe impl Send for CpuMapping {}
// SAFETY: as above.
unsafe impl Sync for CpuMapping {}

impl CpuMapping {
    /// Maps the first `len` bytes of `dmabuf` read-write.
    pub fn new(dmabuf: BorrowedFd<'_>, len: usize) -> Result<CpuMapping> {
        CpuMapping::new_at(dmabuf, 0, len)
    }

    /// Maps `len` bytes of `dmabuf` from `offset` (a multiple of the page size) read-write.
    pub fn new_at(dmabuf: BorrowedFd<'_>, offset: u64, len: usize) -> Result<CpuMapping> {
        // SAFETY: a new shared mapping at a kernel-chosen address aliases no Rust object; it is
        // only accessed through the volatile copies below.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                dmabuf,
                offset,
            )
        }
        .map_err(|errno| Error::Map { errno })?;
        Ok(CpuMapping {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"),
            len,
        })
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` into the mapping at `offset`, 8 bytes at a time.
    pub fn write(&self, offset: usize, src: &[u8]) {
        assert!(
            offset.is_multiple_of(8)
                && src.len().is_multiple_of(8)
                && offset + src.len() <= self.len,
            "unaligned or out of bounds"
        );
        // A plain loop over raw words: unoptimised builds (the rig's) copy at a sixth of the
        // cost of the slice iterators, optimised ones at the same.
        let from = src.as_ptr().cast::<u64>();
        let to = self.ptr.as_ptr().wrapping_add(offset).cast::<u64>();
        let (words, mut i) = (src.len() / 8, 0);
        while i < words {
            // SAFETY: word `i` lies in `src` (read unaligned) and in the mapping, whose offset
            // and start are 8-byte aligned (checked above; the mapping is page aligned).
            unsafe { to.add(i).write_volatile(from.add(i).read_unaligned()) };
            i += 1;
        }
    }

    /// Copies from the mapping at `offset` into `dst`, 8 bytes at a time.
    pub fn read(&self, offset: usize, dst: &mut [u8]) {
        assert!(
            offset.is_multiple_of(8)
                && dst.len().is_multiple_of(8)
                && offset + dst.len() <= self.len,
            "unaligned or out of bounds"
        );
        let from = self.ptr.as_ptr().wrapping_add(offset).cast::<u64>();
        let to = dst.as_mut_ptr().cast::<u64>();
        let (words, mut i) = (dst.len() / 8, 0);
        while i < words {
            // SAFETY: as in `write`, with the roles of the two swapped.
            unsafe { to.add(i).write_unaligned(from.add(i).read_volatile()) };
            i += 1;
        }
    }
}

impl CpuMapping {
    /// Copies `src` into the mapping at `offset`, at any alignment: single bytes up to an
    /// 8-byte boundary and after the last, 8 bytes at a time between.
    pub fn copy_in(&self, offset: usize, src: &[u8]) {
        let end = offset.checked_add(src.len());
        assert!(end.is_some_and(|e| e <= self.len), "out of bounds");
        let head = (offset.next_multiple_of(8) - offset).min(src.len());
        let body = (src.len() - head) / 8 * 8;
        for (i, byte) in src[..head].iter().enumerate() {
            // SAFETY: in bounds (checked above).
            unsafe { self.ptr.as_ptr().add(offset + i).write_volatile(*byte) };
        }
        if body > 0 {
            self.write(offset + head, &src[head..head + body]);
        }
        for (i, byte) in src[head + body..].iter().enumerate() {
            // SAFETY: in bounds (checked above).
            unsafe {
                self.ptr
                    .as_ptr()
                    .add(offset + head + body + i)
                    .write_volatile(*byte)
            };
        }
    }

    /// Copies from the mapping at `offset` into `dst`, at any alignment (as [`Self::copy_in`]).
    pub fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        let end = offset.checked_add(dst.len());
        assert!(end.is_some_and(|e| e <= self.len), "out of bounds");
        let head = (offset.next_multiple_of(8) - offset).min(dst.len());
        let body = (dst.len() - head) / 8 * 8;
        for (i, byte) in dst[..head].iter_mut().enumerate() {
            // SAFETY: in bounds (checked above).
            *byte = unsafe { self.ptr.as_ptr().add(offset + i).read_volatile() };
        }
        if body > 0 {
            self.read(offset + head, &mut dst[head..head + body]);
        }
        for (i, byte) in dst[head + body..].iter_mut().enumerate() {
            // SAFETY: in bounds (checked above).
            *byte = unsafe {
                self.ptr
                    .as_ptr()
                    .add(offset + head + body + i)
                    .read_volatile()
            };
        }
    }
}

/// `struct dma_buf_sync`.
#[repr(C)]
struct DmabufSync {
    flags: u64,
}

/// `DMA_BUF_SYNC_READ`, `_WRITE`, `_START` (0) and `_END`.
pub(crate) const SYNC_READ: u64 = 1;
pub(crate) const SYNC_WRITE: u64 = 2;
pub(crate) const SYNC_END: u64 = 4;

/// `DMA_BUF_IOCTL_SYNC`: brackets CPU access to a dma-buf's mapping (flags `SYNC_READ` and/or
/// `SYNC_WRITE`, with `SYNC_END` for the closing call), so that the exporter can make caches
/// and device writes coherent. Exporters without CPU-access hooks accept it as a no-op.
pub(crate) fn dmabuf_sync(dmabuf: BorrowedFd<'_>, flags: u64) -> Result<()> {
    const IOCTL_SYNC: rustix::ioctl::Opcode = rustix::ioctl::opcode::write::<DmabufSync>(b'b', 0);
    // SAFETY: `DmabufSync` is `struct dma_buf_sync` and the opcode encodes its size; the
    // kernel only reads it.
    unsafe {
        rustix::ioctl::ioctl(
            dmabuf,
            rustix::ioctl::Setter::<IOCTL_SYNC, DmabufSync>::new(DmabufSync { flags }),
        )
    }
    .map_err(|errno| Error::Io {
        op: "DMA_BUF_IOCTL_SYNC",
        done: 0,
        len: 0,
        source: errno.into(),
    })
}

impl Drop for CpuMapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
