//! Helpers for in-guest tests: the rig's environment, page-aligned RAM buffers, O_DIRECT files
//! and the test exporter `vgpu`.

use std::fs::{File, OpenOptions};
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
        Ok(AlignedBuf {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"),
            len,
        })
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

/// The modules the rig loaded, in load order, as the init loaded them (`/run/fgds/modules`):
/// one `path params` line each.
pub fn rig_modules() -> anyhow::Result<Vec<(String, String)>> {
    let text =
        std::fs::read_to_string("/run/fgds/modules").context("cannot read /run/fgds/modules")?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split_once(' ') {
            Some((path, params)) => (path.to_owned(), params.to_owned()),
            None => (l.to_owned(), String::new()),
        })
        .collect())
}

/// Why fgds refuses to serve the rig's GPU in this setup (GENERIC pages under a translating
/// IOMMU, EOPNOTSUPP by design), if it does: registers one page of vgpu memory to find out.
/// Programs that need registrations skip with this reason; fgds_badinput checks the refusal.
pub fn fgds_refusal() -> Option<String> {
    use std::os::fd::AsFd;
    let probe = || -> Result<(), fgds::Error> {
        let info = fgds::Gpu::list()?
            .into_iter()
            .next()
            .ok_or_else(|| fgds::Error::NoSuchGpu {
                bdf: "any".to_owned(),
            })?;
        let gpu = fgds::Gpu::open(&info.bdf)?;
        let (dmabuf, _) = fgds::vgpu::alloc(&fgds::vgpu::open(0)?, 4096)?;
        gpu.register(dmabuf.as_fd(), 0, 4096).map(drop)
    };
    match probe() {
        Err(fgds::Error::Register { errno: rustix::io::Errno::OPNOTSUPP }) => {
            Some("fgds refuses this setup by design (EOPNOTSUPP: see fgds_badinput::unsafe_setup_refused)".to_owned())
        }
        _ => None,
    }
}

/// Exits with the kselftest skip code, and the reason on the plan line, if fgds refuses the
/// setup (see [`fgds_refusal`]).
pub fn skip_if_fgds_refuses() {
    if let Some(reason) = fgds_refusal() {
        println!("KTAP version 1\n1..0 # SKIP {reason}");
        std::process::exit(4);
    }
}
