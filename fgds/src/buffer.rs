//! A registered, mapped GPU buffer and synchronous direct I/O into and out of it.

use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::uapi;

/// A registered range of GPU memory, mapped into this process.
///
/// It is only a DMA target and source: the block layer moves data between the drive and the
/// GPU through its address. It deliberately offers no `&[u8]` or `&mut [u8]`: the memory is a
/// device BAR mapped write-combined, which the GPU (and any DMA) can change under a Rust
/// reference, and which the exporter can revoke at any time, after which a CPU access raises
/// SIGBUS. Use the GPU's own API to look at the data.
///
/// Dropping it unmaps the range and removes the registration.
#[derive(Debug)]
pub struct Buffer {
    node: Arc<File>,
    idx: u64,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is an address range plus a file; nothing in it is tied to a thread.
unsafe impl Send for Buffer {}
// SAFETY: `&Buffer` only hands out the raw address and issues system calls.
unsafe impl Sync for Buffer {}

impl Buffer {
    pub(crate) fn map(node: Arc<File>, idx: u64, len: u64) -> Result<Buffer> {
        let len_usize = usize::try_from(len).map_err(|_| {
            Error::Invalid(format!("length {len:#x} does not fit the address space"))
        })?;
        // SAFETY: a new shared mapping at an address the kernel chooses aliases no Rust object;
        // it is only ever used as a raw DMA address.
        let mapped = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len_usize,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::SHARED,
                node.as_fd(),
                idx,
            )
        };
        match mapped {
            Ok(ptr) => Ok(Buffer {
                node,
                idx,
                ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"),
                len: len_usize,
            }),
            Err(errno) => {
                unregister(&node, idx);
                Err(Error::Map { errno })
            }
        }
    }

    /// The start of the mapping: a user address for `read(2)`, `write(2)` and io_uring.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The length of the buffer in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never: registration refuses empty ranges).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The registration's token (the mmap offset).
    pub fn idx(&self) -> u64 {
        self.idx
    }

    /// Reads `range.len()` bytes of `file` at `file_offset` into `range` of the buffer, with
    /// `pread(2)` until done. `file` must be open with `O_DIRECT`, and the offsets and length
    /// aligned to its direct-I/O alignment.
    ///
    /// ```no_run
    /// # fn buffer() -> fgds::Buffer { unimplemented!() }
    /// let buffer = buffer();
    /// let file = fgds::open_direct("/dev/nvme0n1".as_ref(), false)?;
    /// let n = buffer.read_at(&file, 0, 0..buffer.len())?;
    /// assert_eq!(n, buffer.len());
    /// # Ok::<(), fgds::Error>(())
    /// ```
    pub fn read_at(&self, file: &File, file_offset: u64, range: Range<usize>) -> Result<usize> {
        self.sync_io("pread", file, file_offset, range, |fd, ptr, len, off| {
            // SAFETY: `ptr..ptr+len` lies inside this buffer's mapping (checked by `sync_io`).
            unsafe { libc::pread(fd, ptr.cast(), len, off) }
        })
    }

    /// Writes `range` of the buffer to `file` at `file_offset`, with `pwrite(2)` until done.
    /// The same alignment rules as [`Buffer::read_at`] apply.
    pub fn write_at(&self, file: &File, file_offset: u64, range: Range<usize>) -> Result<usize> {
        self.sync_io("pwrite", file, file_offset, range, |fd, ptr, len, off| {
            // SAFETY: `ptr..ptr+len` lies inside this buffer's mapping (checked by `sync_io`).
            unsafe { libc::pwrite(fd, ptr.cast(), len, off) }
        })
    }

    /// Reads `range.len()` bytes of `file` at `file_offset` into `range` of the buffer, moved by
    /// fgds itself (`FGDS_IOCTL_READ`): no mapping is used and nothing is pinned, on every
    /// kernel. The same rules as [`Buffer::read_at`] apply; a revocation waits for the call
    /// to return, and later calls fail with ENODEV.
    pub fn read_from(&self, file: &File, file_offset: u64, range: Range<usize>) -> Result<usize> {
        self.fgds_io(false, file, file_offset, range)
    }

    /// Writes `range` of the buffer to `file` at `file_offset`, moved by fgds itself
    /// (`FGDS_IOCTL_WRITE`), as [`Buffer::read_from`].
    pub fn write_to(&self, file: &File, file_offset: u64, range: Range<usize>) -> Result<usize> {
        self.fgds_io(true, file, file_offset, range)
    }

    /// The `struct fgds_io` that moves `len` bytes at byte `offset` of the buffer to or from
    /// `file` at `file_offset`.
    pub(crate) fn io_arg(
        &self,
        file: &File,
        offset: usize,
        len: usize,
        file_offset: u64,
    ) -> uapi::Io {
        uapi::Io {
            idx: self.idx,
            offset: offset as u64,
            len: len as u64,
            file_offset,
            fd: file.as_raw_fd(),
            flags: 0,
        }
    }

    /// Where fgds's own reads of `file` into this buffer (or, `write`, writes from it) would
    /// go, and why not direct: the driver's gate, asked without moving data
    /// (`FGDS_IOCTL_CHECK_FILE`).
    pub fn check_file(&self, file: &File, write: bool) -> Result<crate::gate::Verdict> {
        crate::gate::check(&self.node, self.idx, file, write)
    }

    /// The driver's verdict on each member of the stacked device (md) `file` is on, for the
    /// reasons of a fallback and `fgds doctor FILE`; empty where `file` is on no such device.
    pub fn check_members(
        &self,
        file: &File,
        write: bool,
    ) -> Vec<(String, std::result::Result<crate::gate::Verdict, String>)> {
        crate::gate::check_members(&self.node, self.idx, file, write)
    }

    /// The node the buffer is registered on (where its io_uring commands go).
    pub(crate) fn node(&self) -> &File {
        &self.node
    }

    /// The node's open file descriptor: where `FGDS_URING_CMD_*` commands for this buffer go
    /// (`sqe->fd`), with [`Buffer::idx`] as their token.
    pub fn node_fd(&self) -> std::os::fd::RawFd {
        self.node.as_raw_fd()
    }

    fn fgds_io(
        &self,
        write: bool,
        file: &File,
        file_offset: u64,
        range: Range<usize>,
    ) -> Result<usize> {
        check_direct_io(file, file_offset, &range, self.len)?;
        let op = if write {
            "FGDS_IOCTL_WRITE"
        } else {
            "FGDS_IOCTL_READ"
        };
        let request = if write {
            uapi::IOCTL_WRITE
        } else {
            uapi::IOCTL_READ
        };
        until_done(op, range.len(), |done, left| {
            // At most MAX_RW_COUNT per call (on 4 KiB pages), a multiple of any alignment.
            let n = left.min(0x7fff_f000);
            let arg = self.io_arg(file, range.start + done, n, file_offset + done as u64);
            // SAFETY: `Io` is `struct fgds_io`, which the kernel only reads; the call returns
            // a byte count or -1 with errno.
            Ok(unsafe { libc::ioctl(self.node.as_raw_fd(), request as _, &arg) } as isize)
        })
    }

    fn sync_io(
        &self,
        op: &'static str,
        file: &File,
        file_offset: u64,
        range: Range<usize>,
        call: impl Fn(i32, *mut u8, usize, i64) -> isize,
    ) -> Result<usize> {
        check_direct_io(file, file_offset, &range, self.len)?;
        until_done(op, range.len(), |done, left| {
            let off = i64::try_from(file_offset + done as u64).map_err(|_| {
                Error::Invalid(format!("file offset {file_offset:#x} is too large"))
            })?;
            // SAFETY: `range` is inside the mapping (checked above), and
            // `done + left` is its length.
            let ptr = unsafe { self.as_ptr().add(range.start + done) };
            Ok(call(file.as_raw_fd(), ptr, left, off))
        })
    }
}

/// Calls `step(done, left)`, a system call that moves up to `left` bytes and returns the
/// count or -1 with errno, until `len` bytes are done: an interrupted call is made again, an
/// error or a call that moves nothing ends it, with the bytes done so far.
fn until_done(
    op: &'static str,
    len: usize,
    mut step: impl FnMut(usize, usize) -> Result<isize>,
) -> Result<usize> {
    let mut done = 0;
    while done < len {
        let n = step(done, len - done)?;
        if n < 0 {
            let source = std::io::Error::last_os_error();
            if source.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Io {
                op,
                done: done as u64,
                len: len as u64,
                source,
            });
        }
        if n == 0 {
            return Err(Error::ShortTransfer {
                op,
                done: done as u64,
                len: len as u64,
            });
        }
        done += n as usize;
    }
    Ok(done)
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `map`; no reference into it exists.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        unregister(&self.node, self.idx);
    }
}

fn unregister(node: &File, idx: u64) {
    let arg = uapi::UnregBuffer { idx };
    // SAFETY: `UnregBuffer` is `struct fgds_ioctl_unreg_buffer`; the kernel only reads it.
    let _ = unsafe {
        rustix::ioctl::ioctl(
            node.as_fd(),
            rustix::ioctl::Setter::<{ uapi::UNREG_BUFFER }, _>::new(arg),
        )
    };
}

/// Opens `path` with `O_DIRECT`, read-only or read-write.
pub fn open_direct(path: &Path, write: bool) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|source| Error::Open {
            path: path.to_path_buf(),
            source,
        })
}

/// The direct-I/O alignment of `file`: its logical block size for a block device, else what
/// statx reports (`STATX_DIOALIGN`), else 512.
pub fn dio_alignment(file: &File) -> u64 {
    let is_block = file
        .metadata()
        .is_ok_and(|m| m.file_type().is_block_device());
    if is_block {
        let mut size: libc::c_int = 0;
        // SAFETY: BLKSSZGET writes one int through the pointer, which is valid.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut size) } == 0 && size > 0 {
            return size as u64;
        }
    }
    match rustix::fs::statx(
        file.as_fd(),
        "",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::DIOALIGN,
    ) {
        Ok(stx) if stx.stx_dio_offset_align > 0 => {
            u64::from(stx.stx_dio_offset_align.max(stx.stx_dio_mem_align))
        }
        _ => 512,
    }
}

/// Refuses, before the system call, I/O that O_DIRECT would refuse or silently not do.
pub(crate) fn check_direct_io(
    file: &File,
    file_offset: u64,
    range: &Range<usize>,
    buffer_len: usize,
) -> Result<()> {
    if range.start > range.end || range.end > buffer_len {
        return Err(Error::Invalid(format!(
            "range {range:?} is outside the {buffer_len}-byte buffer"
        )));
    }
    let flags = rustix::fs::fcntl_getfl(file.as_fd()).map_err(|errno| Error::Io {
        op: "fcntl",
        done: 0,
        len: range.len() as u64,
        source: errno.into(),
    })?;
    if !flags.contains(rustix::fs::OFlags::DIRECT) {
        return Err(Error::Invalid(
            "the file is not open with O_DIRECT: open it with fgds::open_direct, or the kernel would copy through the page cache".to_owned(),
        ));
    }
    let align = dio_alignment(file);
    for (what, value) in [
        ("file offset", file_offset),
        ("buffer offset", range.start as u64),
        ("length", range.len() as u64),
    ] {
        if value % align != 0 {
            return Err(Error::Invalid(format!(
                "{what} {value:#x} is not a multiple of the file's O_DIRECT alignment ({align} bytes)"
            )));
        }
    }
    Ok(())
}
