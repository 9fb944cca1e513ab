//! What the kernel says of a dma-buf fd (`/proc/self/fdinfo/N`): its exporter, size and flags.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;

use crate::error::{Error, Result};

/// A dma-buf as its fdinfo shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DmabufInfo {
    /// The exporter's name (`exp_name`): `nv_dmabuf` for CUDA, `vgpu` in the rig, `udmabuf`.
    pub exporter: String,
    /// The dma-buf's size in bytes.
    pub size: u64,
    /// The open file's flags (`O_RDWR`, `O_CLOEXEC`, ...).
    pub flags: u32,
}

impl DmabufInfo {
    /// Reads `/proc/self/fdinfo/<fd>`; an fd that is not a dma-buf is an error.
    pub fn of(fd: BorrowedFd<'_>) -> Result<DmabufInfo> {
        let path = PathBuf::from(format!("/proc/self/fdinfo/{}", fd.as_raw_fd()));
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Sysfs {
            path: path.clone(),
            source,
        })?;
        parse(&text).ok_or_else(|| Error::Sysfs {
            path,
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "no exp_name or size: the fd is not a dma-buf",
            ),
        })
    }

    /// Whether the fd is open for reading and writing.
    pub fn read_write(&self) -> bool {
        self.flags & libc::O_ACCMODE as u32 == libc::O_RDWR as u32
    }
}

/// Parses an fdinfo text; `None` if it has no `exp_name` and `size` (not a dma-buf).
fn parse(text: &str) -> Option<DmabufInfo> {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let (key, value) = l.split_once(':')?;
            (key.trim() == name).then(|| value.trim().to_owned())
        })
    };
    Some(DmabufInfo {
        exporter: field("exp_name")?,
        size: field("size")?.parse().ok()?,
        // The kernel prints the flags in octal.
        flags: u32::from_str_radix(&field("flags")?, 8).ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_cuda_dmabuf_fdinfo() {
        let text = "pos:\t0\nflags:\t02000002\nmnt_id:\t16\nino:\t1057\nsize:\t67108864\ncount:\t1\nexp_name:\tnv_dmabuf\nname:\t\n";
        let info = parse(text).unwrap();
        assert_eq!(info.exporter, "nv_dmabuf");
        assert_eq!(info.size, 64 << 20);
        assert_eq!(info.flags, 0o2000002);
        assert!(info.read_write());
    }

    #[test]
    fn a_read_only_or_plain_file_is_told_apart() {
        let ro = "pos:\t0\nflags:\t02000000\nsize:\t4096\nexp_name:\tudmabuf\n";
        assert!(!parse(ro).unwrap().read_write());
        let file = "pos:\t0\nflags:\t0100002\nmnt_id:\t25\nino:\t12\n";
        assert_eq!(parse(file), None);
    }
}
