//! Errors that say what failed and what to do.

use std::path::PathBuf;

/// An fgds error.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No fgds node for this PCI address.
    #[error(
        "no fgds device for GPU {bdf}: is the fgds module loaded and the GPU listed in its devices= parameter?"
    )]
    NoSuchGpu { bdf: String },
    /// The node exists but cannot be opened.
    #[error("cannot open {}: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Reading fgds's sysfs failed.
    #[error("cannot read {}: {source}", path.display())]
    Sysfs {
        path: PathBuf,
        source: std::io::Error,
    },
    /// FGDS_IOCTL_REG_BUFFER failed; the kernel log has the driver's reason.
    #[error("registering the dma-buf failed: {errno}{hint}", hint = reg_hint(*.errno))]
    Register { errno: rustix::io::Errno },
    /// mmap of a registered token failed.
    #[error("mapping the registered buffer failed: {errno}")]
    Map { errno: rustix::io::Errno },
    /// An argument that would make the kernel refuse the I/O, caught before the system call.
    #[error("{0}")]
    Invalid(String),
    /// An I/O system call failed.
    #[error("{op} failed after {done} of {len} bytes: {source}")]
    Io {
        op: &'static str,
        done: u64,
        len: u64,
        source: std::io::Error,
    },
    /// The file ended before the requested range did.
    #[error("{op} stopped at end of file after {done} of {len} bytes")]
    ShortTransfer {
        op: &'static str,
        done: u64,
        len: u64,
    },
}

impl Error {
    /// For a transfer that failed part-way, the bytes from the start of the range that are
    /// known to be complete (no byte past them is); 0 for other errors.
    pub fn bytes_done(&self) -> u64 {
        match self {
            Error::Io { done, .. } | Error::ShortTransfer { done, .. } => *done,
            _ => 0,
        }
    }
}

fn reg_hint(errno: rustix::io::Errno) -> &'static str {
    use rustix::io::Errno;
    match errno {
        Errno::INVAL => {
            " (offset and size must be page aligned and inside the dma-buf, and the dma-buf must be GPU memory of this GPU; see the kernel log)"
        }
        Errno::MFILE => {
            " (too many registrations on this open file: unregister some, or raise fgds's max_buffers_per_file)"
        }
        Errno::NOSPC => {
            " (the GPU's registered-bytes limit is reached: unregister some, or raise fgds's max_bytes_per_gpu)"
        }
        Errno::OPNOTSUPP => {
            " (fgds cannot map this GPU's memory safely here; the kernel log says why)"
        }
        Errno::NODEV => " (the GPU is gone or has no driver)",
        _ => "",
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
