//! The host-side images of a run: the NVMe drive (pattern, then scratch) and the GPU's memory.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, bail};
use fgds_pattern as pattern;

/// Writes a fresh NVMe image: [`pattern::NVME_PATTERN_BYTES`] of the pattern, then zeroes up to
/// [`pattern::NVME_IMAGE_BYTES`] (sparse).
pub fn write_nvme_image(path: &Path) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = BufWriter::with_capacity(1 << 20, &file);
    let mut chunk = vec![0u8; 1 << 20];
    let mut offset = 0;
    while offset < pattern::NVME_PATTERN_BYTES {
        pattern::fill(pattern::NVME_SEED, offset, &mut chunk);
        w.write_all(&chunk)?;
        offset += chunk.len() as u64;
    }
    w.flush()?;
    drop(w);
    file.set_len(pattern::NVME_IMAGE_BYTES)?;
    Ok(())
}

/// Creates a fresh, zeroed file of `bytes` (sparse): the GPU's memory, or a blank drive.
pub fn write_gpu_backing(path: &Path, bytes: u64) -> anyhow::Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    file.set_len(bytes)?;
    Ok(())
}

/// Bytes of the ext4 namespace and of the second drive.
pub const SMALL_DRIVE_BYTES: u64 = 128 << 20;

/// Bytes of the xfs namespace: mkfs.xfs takes no less than 300 MiB (the image is sparse).
pub const XFS_DRIVE_BYTES: u64 = 320 << 20;
/// Bytes of the btrfs namespace: room for what copy-on-write leaves behind when a benchmark
/// rewrites a file for seconds (the image is sparse).
pub const BTRFS_DRIVE_BYTES: u64 = 512 << 20;

/// Writes a fresh, empty ext4 filesystem image of `bytes` (with `mkfs.ext4` from e2fsprogs).
pub fn write_ext4_image(path: &Path, bytes: u64) -> anyhow::Result<()> {
    write_fs_image(path, "ext4", bytes)
}

/// Writes a fresh, empty filesystem image of `bytes`: `ext4` (e2fsprogs), `xfs` (xfsprogs) or
/// `btrfs` (btrfs-progs).
pub fn write_fs_image(path: &Path, fs: &str, bytes: u64) -> anyhow::Result<()> {
    write_gpu_backing(path, bytes)?;
    let (tool, args, package): (&str, &[&str], &str) = match fs {
        "ext4" => (
            "mkfs.ext4",
            &[
                "-F",
                "-q",
                "-L",
                "fgds",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
            ],
            "e2fsprogs",
        ),
        "xfs" => ("mkfs.xfs", &["-f", "-q", "-L", "fgds"], "xfsprogs"),
        "btrfs" => ("mkfs.btrfs", &["-f", "-q", "-L", "fgds"], "btrfs-progs"),
        other => bail!("no image for file system {other:?} (ext4, xfs or btrfs)"),
    };
    let out = std::process::Command::new(tool)
        .args(args)
        .arg(path)
        .output()
        .with_context(|| format!("cannot run {tool}: install {package}"))?;
    if !out.status.success() {
        bail!(
            "{tool} {} failed: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
