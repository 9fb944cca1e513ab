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
        // SAFETY: a new shared mapping at a kernel-chosen address aliases no Rust object; it is
        // only accessed through the volatile copies below.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                dmabuf,
                0,
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
        for (i, chunk) in src.chunks_exact(8).enumerate() {
            let word = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
            // SAFETY: in bounds and 8-byte aligned (checked above; the mapping is page aligned).
            unsafe {
                self.ptr
                    .as_ptr()
                    .add(offset + 8 * i)
                    .cast::<u64>()
                    .write_volatile(word)
            };
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
        for (i, chunk) in dst.chunks_exact_mut(8).enumerate() {
            // SAFETY: in bounds and 8-byte aligned (checked above).
            let word = unsafe {
                self.ptr
                    .as_ptr()
                    .add(offset + 8 * i)
                    .cast::<u64>()
                    .read_volatile()
            };
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
    }
}

impl Drop for CpuMapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
