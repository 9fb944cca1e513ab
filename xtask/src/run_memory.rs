//! Where the rig keeps a run's GPU memory (the ivshmem BAR's `memory-backend-file`) and drive
//! images: host RAM with huge pages. Device memory has no page cache, no writeback and no
//! 4 KiB host page tables, and guest RAM, the `ram` benchmark's target, has transparent huge
//! pages (QEMU asks for them with `MADV_HUGEPAGE`): a GPU backing of 4 KiB pages made every DMA
//! into the "GPU" cost the host more than the same DMA into RAM, and drive images on the host's
//! disk made the host write back what the guest wrote, slowing later runs at random
//! (docs/performance-history.md, section 6).
//!
//! As root, `cargo xtask` enters a mount namespace of its own when it starts
//! ([`enter_private_namespace`]), and each run mounts a tmpfs with `huge=always` in its run
//! directory for these files. Only the rig and its QEMU see the mount; it is unmounted when the
//! run ends, and goes with the namespace if the rig is killed, so nothing stays mounted on the
//! host. Without the namespace the GPU's memory is a file in `/dev/shm` (4 KiB pages unless the
//! host's `shmem_enabled` says otherwise) and the drive images stay in the run directory.

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

/// A run's GPU memory and drive images. Dropping it removes the GPU's backing file and unmounts
/// the tmpfs: the run's verdicts must be in by then (the host checks what the guest wrote to the
/// GPU).
pub struct RunMemory {
    /// The GPU's backing file, which QEMU maps.
    pub gpu: PathBuf,
    run_dir: PathBuf,
    mount: Option<PathBuf>,
}

impl RunMemory {
    /// Where the drive image `name` goes: in host RAM when the run has its tmpfs (linked from
    /// the run directory), else in the run directory.
    pub fn drive(&self, name: &str) -> anyhow::Result<PathBuf> {
        let Some(mount) = &self.mount else {
            return Ok(self.run_dir.join(name));
        };
        let path = mount.join(name);
        link(&self.run_dir.join(name), &path)?;
        Ok(path)
    }
}

impl Drop for RunMemory {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.gpu);
        if let Some(mount) = &self.mount {
            let _ = rustix::mount::unmount(mount, UnmountFlags::DETACH);
        }
    }
}

/// Makes room for `gpu_bytes` of GPU memory and `drive_bytes` of drive images for the run in
/// `run_dir`, with a link `run_dir/gpu-vram.bin` to the GPU's backing file.
pub fn create(run_dir: &Path, gpu_bytes: u64, drive_bytes: u64) -> anyhow::Result<RunMemory> {
    let memory = if PRIVATE_NAMESPACE.load(Ordering::Relaxed) {
        huge_tmpfs(run_dir, gpu_bytes + drive_bytes)?
    } else {
        dev_shm(run_dir)?
    };
    link(&run_dir.join("gpu-vram.bin"), &memory.gpu)?;
    Ok(memory)
}

fn link(link: &Path, to: &Path) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(to, link)
        .with_context(|| format!("cannot link {} to {}", link.display(), to.display()))
}

fn huge_tmpfs(run_dir: &Path, bytes: u64) -> anyhow::Result<RunMemory> {
    let dir = run_dir.join("memory");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Slack of a few huge pages: each file is rounded up to whole huge pages.
    let options = format!("size={},huge=always,mode=0700", bytes + (8 << 20));
    rustix::mount::mount(
        "fgds-run-memory",
        &dir,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(std::ffi::CString::new(options)?.as_c_str()),
    )
    .with_context(|| {
        format!(
            "cannot mount a tmpfs for the run's memory on {}",
            dir.display()
        )
    })?;
    Ok(RunMemory {
        gpu: dir.join("gpu-vram.bin"),
        run_dir: run_dir.to_owned(),
        mount: Some(dir),
    })
}

fn dev_shm(run_dir: &Path) -> anyhow::Result<RunMemory> {
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
    Ok(RunMemory {
        gpu: shm.join(format!("fgds-{name}-gpu-vram.bin")),
        run_dir: run_dir.to_owned(),
        mount: None,
    })
}
