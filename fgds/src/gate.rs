//! Where fgds's own reads and writes of a file would go, as the driver's gate answers
//! (`FGDS_IOCTL_CHECK_FILE`, driver/fgds/gate.c): what `fgds doctor FILE` prints, and what
//! [`crate::GpuFile`] names when it falls back to RAM. The driver logs its refusals, but an
//! unprivileged process cannot read the kernel log: this is how it learns why.

use std::fs::File;
use std::os::fd::AsRawFd;

use crate::error::{Error, Result};
use crate::uapi;

/// The driver's verdict on a file (`enum fgds_path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// fgds takes the file: peer-to-peer DMA between its drive and the GPU.
    Direct,
    /// Neither a block device nor a regular file (a pipe, a socket, ...).
    FileType,
    /// The file cannot be read or written at an offset.
    NoOffset,
    /// Its file system's direct I/O is not the block layer's DMA (tmpfs, btrfs, NFS, FUSE).
    FileSystem,
    /// A DAX, encrypted or verity file: the CPU copies its data.
    CpuCopy,
    /// Its block device's queue takes no P2PDMA pages (loop, dm, NVMe over TCP, ...).
    Queue,
    /// Its disk hangs from no PCI device (md, NVMe multipath heads).
    NoPci,
    /// The PCI device doing its DMA cannot reach the GPU.
    NoP2p,
    /// P2PDMA pages, and the drive's queue may merge requests.
    Merges,
    /// fgds would take it, but it is not open with O_DIRECT.
    NotODirect,
    /// A value this crate does not know (a newer driver).
    Unknown(u32),
}

impl Gate {
    fn from_raw(raw: u32) -> Gate {
        match raw {
            0 => Gate::Direct,
            1 => Gate::FileType,
            2 => Gate::NoOffset,
            3 => Gate::FileSystem,
            4 => Gate::CpuCopy,
            5 => Gate::Queue,
            6 => Gate::NoPci,
            7 => Gate::NoP2p,
            8 => Gate::Merges,
            9 => Gate::NotODirect,
            other => Gate::Unknown(other),
        }
    }

    /// The name `fgds doctor --json` prints.
    pub fn name(self) -> &'static str {
        match self {
            Gate::Direct => "direct",
            Gate::FileType => "file-type",
            Gate::NoOffset => "no-offset",
            Gate::FileSystem => "file-system",
            Gate::CpuCopy => "cpu-copy",
            Gate::Queue => "queue",
            Gate::NoPci => "no-pci-device",
            Gate::NoP2p => "no-p2p-path",
            Gate::Merges => "merges",
            Gate::NotODirect => "not-o-direct",
            Gate::Unknown(_) => "unknown",
        }
    }
}

/// The driver's answer for one file and one registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub gate: Gate,
    /// The PCI device that does (or would do) the file's DMA, `DDDD:BB:DD.F`, where the
    /// driver found one.
    pub dma_dev: Option<String>,
}

impl Verdict {
    pub fn is_direct(&self) -> bool {
        self.gate == Gate::Direct
    }

    /// Whether the registration's mapped address reaches the file by DMA: fgds's gate takes it,
    /// or refused it only because its queue may merge (the kernel never merges user pages).
    pub fn mapping_reaches(&self) -> bool {
        matches!(self.gate, Gate::Direct | Gate::Merges)
    }

    /// What the verdict means, and what to do where it is not direct: one sentence.
    pub fn explain(&self) -> String {
        let dev = self.dma_dev.as_deref().unwrap_or("?");
        match self.gate {
            Gate::Direct => format!(
                "fgds moves the data by peer-to-peer DMA between the drive's controller {dev} \
                 and the GPU"
            ),
            Gate::FileType => "neither a block device nor a regular file: fgds takes block \
                               devices and files on ext4 or xfs"
                .to_owned(),
            Gate::NoOffset => "the file cannot be read or written at an offset".to_owned(),
            Gate::FileSystem => "its file system's direct I/O is not the block layer's DMA \
                                 (fgds takes files on ext4 or xfs; tmpfs, btrfs, NFS and FUSE \
                                 go through RAM)"
                .to_owned(),
            Gate::CpuCopy => {
                "a DAX, encrypted or verity file: the CPU copies its data, so it goes through RAM"
                    .to_owned()
            }
            Gate::Queue => "its block device's queue takes no P2PDMA pages (loop, brd, zram, dm \
                            such as dm-crypt, NVMe over TCP or RDMA, md where the kernel's md \
                            takes none): only NVMe drives on PCIe can DMA to the GPU"
                .to_owned(),
            Gate::NoPci => "its disk hangs from no PCI device (md, NVMe multipath), which \
                            fgds's own I/O cannot check: the mapped address takes it where \
                            every member passes"
                .to_owned(),
            Gate::NoP2p => format!(
                "the drive's controller {dev} has no peer-to-peer path to the GPU: put them \
                 behind one PCIe switch"
            ),
            Gate::Merges => format!(
                "the queue of the drive at {dev} may merge requests, and P2PDMA pages must not \
                 share one with RAM: echo 2 > /sys/block/<disk>/queue/nomerges"
            ),
            Gate::NotODirect => "the file is not open with O_DIRECT".to_owned(),
            Gate::Unknown(raw) => {
                format!("the driver answered {raw}, which this fgds crate does not know")
            }
        }
    }
}

/// Asks the driver where reads into (or, `write`, writes from) the registration `idx` of
/// `node` and `file` would go.
pub(crate) fn check(node: &File, idx: u64, file: &File, write: bool) -> Result<Verdict> {
    let mut arg = uapi::CheckFile {
        idx,
        fd: file.as_raw_fd(),
        flags: if write { uapi::CHECK_WRITE } else { 0 },
        ..uapi::CheckFile::default()
    };
    // SAFETY: `CheckFile` is `struct fgds_check_file`, which the kernel reads and writes in
    // place; the call returns 0 or -1 with errno.
    let ret = unsafe {
        libc::ioctl(
            node.as_raw_fd(),
            uapi::IOCTL_CHECK_FILE as _,
            &mut arg as *mut uapi::CheckFile,
        )
    };
    if ret < 0 {
        let source = std::io::Error::last_os_error();
        return Err(match source.raw_os_error() {
            Some(libc::ENOTTY) => Error::Refused {
                errno: libc::ENOTTY,
                reason: "the loaded fgds module has no FGDS_IOCTL_CHECK_FILE: install the \
                         driver of this release"
                    .to_owned(),
            },
            _ => Error::Io {
                op: "FGDS_IOCTL_CHECK_FILE",
                done: 0,
                len: 0,
                source,
            },
        });
    }
    Ok(Verdict {
        gate: Gate::from_raw(arg.path),
        dma_dev: arg.dma_dev(),
    })
}

/// The block device a file's I/O goes to: the device itself, or the one its file system is on,
/// as `MAJOR:MINOR`.
fn block_dev(file: &File) -> Option<(u32, u32)> {
    let st = rustix::fs::fstat(file).ok()?;
    let dev =
        if rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::BlockDevice {
            st.st_rdev
        } else {
            st.st_dev
        };
    Some((rustix::fs::major(dev), rustix::fs::minor(dev)))
}

/// The member disks of the stacked device (md, dm) a file's I/O goes to, by name (`nvme0n1`),
/// from sysfs `slaves`; empty where it has none.
pub fn members(file: &File) -> Vec<String> {
    let Some((major, minor)) = block_dev(file) else {
        return Vec::new();
    };
    let dir = format!("/sys/dev/block/{major}:{minor}/slaves");
    let mut names = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Each member of the stacked device `file` is on, with the driver's verdict on it (opened
/// `O_DIRECT` by its node, `/dev/NAME`), or why it could not be asked.
pub(crate) fn check_members(
    node: &File,
    idx: u64,
    file: &File,
    write: bool,
) -> Vec<(String, std::result::Result<Verdict, String>)> {
    members(file)
        .into_iter()
        .map(|name| {
            let path = std::path::PathBuf::from(format!("/dev/{name}"));
            let verdict = crate::buffer::open_direct(&path, write)
                .map_err(|e| e.to_string())
                .and_then(|member| check(node, idx, &member, write).map_err(|e| e.to_string()));
            (name, verdict)
        })
        .collect()
}

/// What [`crate::Buffer::check_members`] found, as one phrase: the members fgds's checks let through, and
/// those that would not be (with why).
pub fn describe_members(members: &[(String, std::result::Result<Verdict, String>)]) -> String {
    members
        .iter()
        .map(|(name, verdict)| match verdict {
            Ok(v) if v.mapping_reaches() => format!(
                "{name} direct through {}",
                v.dma_dev.as_deref().unwrap_or("?")
            ),
            Ok(v) => format!("{name} not: {}", v.explain()),
            Err(err) => format!("{name} not asked: {err}"),
        })
        .collect::<Vec<_>>()
        .join("; ")
}
