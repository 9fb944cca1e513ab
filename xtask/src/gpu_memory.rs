//! Where the rig keeps the GPU's memory (the ivshmem BAR's `memory-backend-file`): host RAM
//! with huge pages, because device memory has no page cache, no writeback and no 4 KiB host
//! page tables, and guest RAM, the `ram` benchmark's target, has transparent huge pages (QEMU
//! asks for them with `MADV_HUGEPAGE`). A backing of 4 KiB pages made every DMA into the "GPU"
//! cost the host more than the same DMA into RAM (docs/performance.md, section 6).
//!
//! As root, `cargo xtask` enters a mount namespace of its own when it starts
//! ([`enter_private_namespace`]), and each run mounts a tmpfs with `huge=always` in its run
//! directory for the backing file. Only the rig and its QEMU see the mount; it is unmounted
//! when the run ends, and goes with the namespace if the rig is killed, so nothing stays
//! mounted on the host. Without the namespace the backing is a file in `/dev/shm`, whose pages
//! are 4 KiB unless the host's `shmem_enabled` says otherwise.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, bail};
use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};

static PRIVATE_NAMESPACE: AtomicBool = AtomicBool::new(false);

/// Gives this process a mount namespace of its own, where mounts do not propagate to the host.
/// Must run before any thread starts (`unshare(CLONE_NEWNS)` refuses a multi-threaded process).
/// Without the privilege, the rig keeps the GPU's memory in `/dev/shm`.
pub fn enter_private_namespace() {
    // SAFETY: only NEWNS is unshared, not FILES, so no thread can lose its file descriptors;
    // and main calls this before it starts any thread.
    let unshared = unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) };
    let private = unshared.and_then(|()| {
        rustix::mount::mount_change(
            "/",
            MountPropagationFlags::PRIVATE | MountPropagationFlags::REC,
        )
    });
    PRIVATE_NAMESPACE.store(private.is_ok(), Ordering::Relaxed);
}

/// The GPU's memory of one run. Dropping it removes the backing file and unmounts its tmpfs:
/// the run's verdicts must be in by then (the host checks what the guest wrote there).
pub struct GpuMemory {
    /// The backing file QEMU maps.
    pub path: PathBuf,
    mount: Option<PathBuf>,
}

impl Drop for GpuMemory {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(mount) = &self.mount {
            let _ = rustix::mount::unmount(mount, UnmountFlags::DETACH);
        }
    }
}

/// Makes room for `bytes` of GPU memory for the run in `run_dir`, with a link
/// `run_dir/gpu-vram.bin` to the backing file.
pub fn create(run_dir: &Path, bytes: u64) -> anyhow::Result<GpuMemory> {
    let memory = if PRIVATE_NAMESPACE.load(Ordering::Relaxed) {
        huge_tmpfs(run_dir, bytes)?
    } else {
        dev_shm(run_dir)?
    };
    let link = run_dir.join("gpu-vram.bin");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&memory.path, &link).with_context(|| {
        format!(
            "cannot link {} to {}",
            link.display(),
            memory.path.display()
        )
    })?;
    Ok(memory)
}

fn huge_tmpfs(run_dir: &Path, bytes: u64) -> anyhow::Result<GpuMemory> {
    let dir = run_dir.join("gpu-memory");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // One huge page of slack: the file is rounded up to whole huge pages.
    let options = format!("size={},huge=always,mode=0700", bytes + (2 << 20));
    rustix::mount::mount(
        "fgds-gpu-memory",
        &dir,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(std::ffi::CString::new(options)?.as_c_str()),
    )
    .with_context(|| {
        format!(
            "cannot mount a tmpfs for the GPU's memory on {}",
            dir.display()
        )
    })?;
    Ok(GpuMemory {
        path: dir.join("gpu-vram.bin"),
        mount: Some(dir),
    })
}

fn dev_shm(run_dir: &Path) -> anyhow::Result<GpuMemory> {
    let shm = Path::new("/dev/shm");
    const TMPFS_MAGIC: u64 = 0x0102_1994; // include/uapi/linux/magic.h
    let on_tmpfs = rustix::fs::statfs(shm).is_ok_and(|fs| fs.f_type as u64 == TMPFS_MAGIC);
    if !on_tmpfs {
        bail!(
            "{} is not a tmpfs: without root the rig keeps the GPU's memory there (mount one: `mount -t tmpfs tmpfs /dev/shm`)",
            shm.display()
        );
    }
    let name = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(GpuMemory {
        path: shm.join(format!("fgds-{name}-gpu-vram.bin")),
        mount: None,
    })
}
