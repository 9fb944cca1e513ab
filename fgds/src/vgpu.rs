//! The rig's test exporter `vgpu` (driver/vgpu, UAPI in driver/include/uapi/linux/vgpu.h).
//!
//! Real programs get their dma-buf from their GPU runtime (CUDA's
//! `cuMemGetHandleForAddressRange`, HIP's `hsa_amd_portable_export_dmabuf`, a DRM driver's
//! PRIME export); in the QEMU rig, vgpu exports ranges of an ivshmem device's BAR instead.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::PathBuf;

use crate::error::{Error, Result};

/// `struct vgpu_alloc`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    pub size: u64,
    pub flags: u32,
    pub fd: i32,
    pub bar_offset: u64,
}

/// `VGPU_IOCTL_ALLOC`.
pub const IOCTL_ALLOC: rustix::ioctl::Opcode =
    rustix::ioctl::opcode::read_write::<Alloc>(b'V', 0x01);

/// Opens `/dev/vgpu<n>`.
pub fn open(n: u32) -> Result<File> {
    let path = PathBuf::from(format!("/dev/vgpu{n}"));
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|source| Error::Open { path, source })
}

/// `VGPU_ALLOC_RDONLY`: the dma-buf is opened read-only.
pub const ALLOC_RDONLY: u32 = 1 << 0;
/// `VGPU_ALLOC_SKEW`: the buffer is two runs of BAR2 at different 2 MiB phases.
pub const ALLOC_SKEW: u32 = 1 << 1;

/// Allocates `size` bytes of vgpu memory; returns its dma-buf and its offset in BAR2.
pub fn alloc(dev: &File, size: u64) -> Result<(OwnedFd, u64)> {
    alloc_with(dev, size, 0)
}

/// [`alloc`] with `VGPU_ALLOC_*` flags.
pub fn alloc_with(dev: &File, size: u64, flags: u32) -> Result<(OwnedFd, u64)> {
    let mut arg = Alloc {
        size,
        flags,
        ..Alloc::default()
    };
    // SAFETY: `Alloc` is `struct vgpu_alloc` and the opcode encodes its size; the kernel
    // writes only within it.
    unsafe {
        rustix::ioctl::ioctl(
            dev.as_fd(),
            rustix::ioctl::Updater::<IOCTL_ALLOC, Alloc>::new(&mut arg),
        )
    }
    .map_err(|errno| Error::Io {
        op: "VGPU_IOCTL_ALLOC",
        done: 0,
        len: size,
        source: errno.into(),
    })?;
    // SAFETY: on success the kernel installed a new dma-buf fd that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(arg.fd) };
    Ok((fd, arg.bar_offset))
}
