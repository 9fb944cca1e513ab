//! Helpers for in-guest tests: the rig's environment, page-aligned RAM buffers, O_DIRECT files
//! and the test exporter `vgpu`.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::ptr::NonNull;

use anyhow::{Context, bail};

/// The raw NVMe namespace the rig attached (env `FGDS_NVME`).
pub fn nvme_path() -> anyhow::Result<PathBuf> {
    match std::env::var_os("FGDS_NVME") {
        Some(path) => Ok(PathBuf::from(path)),
        None => bail!("FGDS_NVME is not set: run this test inside the rig (cargo xtask test-vm)"),
    }
}

/// Opens `path` with `O_DIRECT`, for reading, or for reading and writing.
pub fn open_direct(path: &std::path::Path, write: bool) -> anyhow::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))
}

/// A page-aligned, zero-filled anonymous RAM buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> anyhow::Result<AlignedBuf> {
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing aliases
        // no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .with_context(|| format!("cannot map a {len}-byte buffer"))?;
        Ok(AlignedBuf { ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"), len })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, and no borrow outlives self.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The UAPI of the rig's test exporter (driver/include/uapi/linux/vgpu.h).
pub mod vgpu {
    use super::*;

    /// `struct vgpu_alloc`.
    #[repr(C)]
    #[derive(Debug, Default, Clone, Copy)]
    pub struct Alloc {
        pub size: u64,
        pub flags: u32,
        pub fd: i32,
        pub bar_offset: u64,
    }

    /// `VGPU_IOCTL_ALLOC`.
    pub const IOCTL_ALLOC: rustix::ioctl::Opcode = rustix::ioctl::opcode::read_write::<Alloc>(b'V', 0x01);

    /// The first vgpu node, `/dev/vgpu0`.
    pub fn open_first() -> anyhow::Result<File> {
        OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/vgpu0")
            .context("cannot open /dev/vgpu0: is the vgpu module loaded and the ivshmem device present?")
    }

    /// Allocates `size` bytes of GPU memory; returns the dma-buf and its offset in BAR2.
    pub fn alloc(dev: &File, size: u64) -> anyhow::Result<(OwnedFd, u64)> {
        let mut arg = Alloc { size, ..Alloc::default() };
        // SAFETY: `Alloc` matches `struct vgpu_alloc`, the opcode encodes its size and the
        // kernel writes only within it.
        unsafe {
            rustix::ioctl::ioctl(dev.as_fd(), rustix::ioctl::Updater::<IOCTL_ALLOC, Alloc>::new(&mut arg))
        }
        .with_context(|| format!("VGPU_IOCTL_ALLOC of {size} bytes failed"))?;
        // SAFETY: on success the kernel installed a new dma-buf fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(arg.fd) };
        Ok((fd, arg.bar_offset))
    }

    /// A CPU mapping (write-combined) of a vgpu dma-buf.
    ///
    /// Device memory is never exposed as a Rust slice: it may change under us (DMA) and may be
    /// revoked (SIGBUS), so every access is a volatile copy.
    pub struct Mapping {
        ptr: NonNull<u8>,
        len: usize,
    }

    impl Mapping {
        pub fn new(dmabuf: &OwnedFd, len: usize) -> anyhow::Result<Mapping> {
            // SAFETY: a shared mapping of a dma-buf at a kernel-chosen address aliases no Rust
            // object; it is only accessed through volatile copies below.
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
            .context("cannot mmap the vgpu dma-buf")?;
            Ok(Mapping { ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"), len })
        }

        pub fn as_ptr(&self) -> *mut u8 {
            self.ptr.as_ptr()
        }

        /// Copies `src` into the mapping at `offset`, 8 bytes at a time.
        pub fn write(&self, offset: usize, src: &[u8]) {
            assert!(offset % 8 == 0 && src.len() % 8 == 0 && offset + src.len() <= self.len);
            for (i, chunk) in src.chunks_exact(8).enumerate() {
                let word = u64::from_ne_bytes(chunk.try_into().unwrap());
                // SAFETY: in bounds and 8-byte aligned (checked above; the mapping is page aligned).
                unsafe { self.ptr.as_ptr().add(offset + 8 * i).cast::<u64>().write_volatile(word) };
            }
        }

        /// Copies from the mapping at `offset` into `dst`, 8 bytes at a time.
        pub fn read(&self, offset: usize, dst: &mut [u8]) {
            assert!(offset % 8 == 0 && dst.len() % 8 == 0 && offset + dst.len() <= self.len);
            for (i, chunk) in dst.chunks_exact_mut(8).enumerate() {
                // SAFETY: in bounds and 8-byte aligned (checked above).
                let word = unsafe { self.ptr.as_ptr().add(offset + 8 * i).cast::<u64>().read_volatile() };
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: exactly the mapping made in `new`.
            let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

/// The modules the rig loaded, in load order, as the init loaded them (`/run/fgds/modules`):
/// one `path params` line each.
pub fn rig_modules() -> anyhow::Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string("/run/fgds/modules").context("cannot read /run/fgds/modules")?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split_once(' ') {
            Some((path, params)) => (path.to_owned(), params.to_owned()),
            None => (l.to_owned(), String::new()),
        })
        .collect())
}
