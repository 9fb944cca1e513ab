//! The block device behind the benchmark's file, as the guest's sysfs shows it: the queue
//! limits that decide whether a request reaches the drive whole or split, and the count of
//! requests the drive completed, so that each mode's row says how many requests one I/O took.
//! On a stacked device (md RAID0) the requests counted are its members' (sysfs `slaves`): the
//! drives', not the array's own count of the I/Os it was given.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::Context;

/// The disk (not a partition) under `file`: a block device, or the device of the file system
/// that holds a regular file.
pub struct Drive {
    /// `/sys/dev/block/<major>:<minor>`: a partition's directory or the disk's.
    dev: PathBuf,
    /// The disk's `queue/` directory.
    queue: PathBuf,
    /// The members' directories where the disk is stacked on others (md): `slaves/*`.
    members: Vec<PathBuf>,
}

/// Requests completed so far, reads and writes (`stat`, fields 1 and 5).
#[derive(Clone, Copy, Default)]
pub struct Completed {
    pub reads: u64,
    pub writes: u64,
}

impl Drive {
    pub fn of(file: &Path) -> anyhow::Result<Drive> {
        let meta =
            std::fs::metadata(file).with_context(|| format!("cannot stat {}", file.display()))?;
        let dev = if meta.file_type().is_block_device() {
            meta.rdev()
        } else {
            meta.dev()
        };
        let mut dev = PathBuf::from(format!(
            "/sys/dev/block/{}:{}",
            libc::major(dev),
            libc::minor(dev)
        ));
        // btrfs gives its files an anonymous device number: the mount's source is the disk.
        if !dev.exists()
            && let Some(source) = mount_source(file)
        {
            let rdev = std::fs::metadata(&source).map(|m| m.rdev()).ok();
            if let Some(rdev) = rdev.filter(|&r| r != 0) {
                dev = PathBuf::from(format!(
                    "/sys/dev/block/{}:{}",
                    libc::major(rdev),
                    libc::minor(rdev)
                ));
            }
        }
        let dev = dev.canonicalize().with_context(|| {
            format!(
                "cannot resolve {} (the block device of {})",
                dev.display(),
                file.display()
            )
        })?;
        // A partition's directory has `partition` and sits in its disk's.
        let disk = if dev.join("partition").exists() {
            dev.parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| dev.clone())
        } else {
            dev.clone()
        };
        let mut members = std::fs::read_dir(disk.join("slaves"))
            .map(|entries| {
                entries
                    .flatten()
                    .filter_map(|e| e.path().canonicalize().ok())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        members.sort();
        Ok(Drive {
            queue: disk.join("queue"),
            dev,
            members,
        })
    }

    /// A limit of the queue (`max_sectors_kb`, `nomerges`, ...).
    pub fn limit(&self, name: &str) -> anyhow::Result<u64> {
        let path = self.queue.join(name);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        text.trim()
            .parse()
            .with_context(|| format!("{}: {text:?} is not a number", path.display()))
    }

    /// Sets the largest request the block layer builds, in KiB (at most `max_hw_sectors_kb`).
    pub fn set_max_sectors_kb(&self, kib: u64) -> anyhow::Result<()> {
        let path = self.queue.join("max_sectors_kb");
        std::fs::write(&path, kib.to_string())
            .with_context(|| format!("cannot write {kib} to {} (run as root)", path.display()))
    }

    /// The limits that decide how a request is split, for the JSON.
    pub fn limits(&self) -> serde_json::Value {
        let get = |name: &str| self.limit(name).ok();
        serde_json::json!({
            "max_sectors_kb": get("max_sectors_kb"),
            "max_hw_sectors_kb": get("max_hw_sectors_kb"),
            "max_segments": get("max_segments"),
            "nomerges": get("nomerges"),
        })
    }

    /// Requests the drive completed so far; on a stacked device, its members' together.
    pub fn completed(&self) -> anyhow::Result<Completed> {
        if self.members.is_empty() {
            return completed(&self.dev);
        }
        self.members
            .iter()
            .try_fold(Completed::default(), |sum, m| {
                let c = completed(m)?;
                Ok(Completed {
                    reads: sum.reads + c.reads,
                    writes: sum.writes + c.writes,
                })
            })
    }
}

/// The counts of `dir/stat` (a disk's or a partition's sysfs directory).
fn completed(dir: &Path) -> anyhow::Result<Completed> {
    let path = dir.join("stat");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let field = |i: usize| {
        text.split_whitespace()
            .nth(i)
            .and_then(|v| v.parse::<u64>().ok())
            .with_context(|| format!("{}: no field {i} in {text:?}", path.display()))
    };
    Ok(Completed {
        reads: field(0)?,
        writes: field(4)?,
    })
}

/// The source of the mount that holds `file` (the longest mount point of /proc/self/mountinfo
/// above it).
fn mount_source(file: &Path) -> Option<PathBuf> {
    let file = file.canonicalize().ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines()
        .filter_map(|line| {
            let point = line.split(' ').nth(4)?;
            // After the optional fields: " - fstype source options".
            let source = line.split_once(" - ")?.1.split(' ').nth(1)?;
            file.starts_with(point)
                .then(|| (point.len(), PathBuf::from(source)))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, source)| source)
}
