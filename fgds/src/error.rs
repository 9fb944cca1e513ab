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
    #[error("cannot open {}: {source}{}", path.display(), open_hint(source))]
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
    /// The CUDA driver library cannot be loaded.
    #[error(
        "cannot load the CUDA driver ({reason}): install the NVIDIA driver's CUDA library (libcuda.so.1, e.g. Debian's libcuda1 or the driver's own installer), or pass a dma-buf instead (the CLI's --dmabuf-fd, Python's fgds.DmaBuf)"
    )]
    CudaUnavailable { reason: String },
    /// A CUDA driver API call failed.
    #[error("{call} failed: {name} ({code}): {text}{hint}", hint = cuda_hint(*.code))]
    Cuda {
        call: &'static str,
        code: i32,
        name: String,
        text: String,
    },
    /// The CUDA driver cannot export this device's memory as a dma-buf.
    #[error(
        "CUDA device {ordinal} cannot export its memory as a dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0): it needs NVIDIA's open kernel module (nvidia-open, not the proprietary one) and a Turing or newer GPU"
    )]
    CudaNoDmabuf { ordinal: i32 },
    /// The file ended before the requested range did.
    #[error("{op} stopped at end of file after {done} of {len} bytes")]
    ShortTransfer {
        op: &'static str,
        done: u64,
        len: u64,
    },
    /// A call the object or the machine does not allow, with the errno that names why (a read
    /// of a file open for writing only: EBADF; no CUDA library: ELIBACC).
    #[error("{reason}")]
    Refused { errno: i32, reason: String },
    /// The direct path is not there for this transfer and the fallback through host RAM is
    /// switched off ([`crate::GpuFile`]).
    #[error(
        "the direct path is not available: {reason}; the fallback through host RAM is off (switch it on to copy through RAM instead)"
    )]
    DirectUnavailable {
        /// The errno that best names the obstacle (ENODEV: no fgds node, EINVAL: alignment or
        /// memory fgds does not serve, EOPNOTSUPP: a refused setup, ...).
        errno: i32,
        reason: String,
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

impl Error {
    /// The errno that names this error: the system call's own where there was one, else the
    /// closest (EINVAL for a bad argument, ENODEV for a missing GPU, ELIBACC for a missing
    /// CUDA library, EIO for a CUDA error without a closer one).
    pub fn errno(&self) -> i32 {
        let os = |source: &std::io::Error| source.raw_os_error().unwrap_or(libc::EIO);
        match self {
            Error::NoSuchGpu { .. } => libc::ENODEV,
            Error::Open { source, .. } | Error::Sysfs { source, .. } | Error::Io { source, .. } => {
                os(source)
            }
            Error::Register { errno } | Error::Map { errno } => errno.raw_os_error(),
            Error::Invalid(_) => libc::EINVAL,
            Error::CudaUnavailable { .. } => libc::ELIBACC,
            Error::Cuda { code, .. } => match code {
                1 => libc::EINVAL,
                2 => libc::ENOMEM,
                100 | 101 => libc::ENODEV,
                801 => libc::EOPNOTSUPP,
                _ => libc::EIO,
            },
            Error::CudaNoDmabuf { .. } => libc::EOPNOTSUPP,
            Error::ShortTransfer { .. } => libc::EIO,
            Error::DirectUnavailable { errno, .. } | Error::Refused { errno, .. } => *errno,
        }
    }
}

/// Why a GPU's node cannot be opened: only root and the `fgds` group may (the package's udev
/// rule).
fn open_hint(source: &std::io::Error) -> &'static str {
    if source.kind() == std::io::ErrorKind::PermissionDenied {
        " (root and members of the fgds group may open fgds's nodes: sudo usermod -aG fgds \
         $USER, then log in again; the fgds package's udev rule sets the group)"
    } else {
        ""
    }
}

fn reg_hint(errno: rustix::io::Errno) -> String {
    use rustix::io::Errno;
    if errno == Errno::NOMEM {
        return memlock_hint();
    }
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
    .to_owned()
}

/// Why a registration can fail with ENOMEM: fgds charges it to the process's RLIMIT_MEMLOCK
/// (as io_uring and RDMA charge pinned memory), unless it has CAP_IPC_LOCK.
fn memlock_hint() -> String {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
    let now = match limit {
        Some(bytes) => format!("{} KiB", bytes >> 10),
        None => "unlimited".to_owned(),
    };
    format!(
        " (registrations count against RLIMIT_MEMLOCK, {now} for this process: raise it with \
         ulimit -l or limits.conf (the fgds package sets one for the fgds group), or grant \
         CAP_IPC_LOCK; else the kernel is short of memory)"
    )
}

fn cuda_hint(code: i32) -> &'static str {
    match code {
        // CUDA_ERROR_OUT_OF_MEMORY
        2 => " (free GPU memory or ask for less)",
        // CUDA_ERROR_NO_DEVICE
        100 => " (no GPU visible to CUDA: check nvidia-smi and CUDA_VISIBLE_DEVICES)",
        // CUDA_ERROR_INVALID_DEVICE
        101 => " (no such device ordinal: nvidia-smi -L lists them)",
        // CUDA_ERROR_NOT_SUPPORTED
        801 => {
            " (the driver cannot export this memory as a dma-buf: it needs NVIDIA's open kernel module)"
        }
        // CUDA_ERROR_INVALID_VALUE
        1 => " (the range must be page aligned and inside one allocation of this device)",
        _ => "",
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
