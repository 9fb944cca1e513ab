//! A file for reads into and writes from GPU memory of any kind ([`GpuMemory`]), by the best
//! path there is, in this order: the kernel's own dma-buf registered buffers where the kernel
//! has them and the memory is a dma-buf (`crate::upstream`: the NVMe driver imports it, no
//! fgds), then fgds (the io_uring [`Transfer`] between the file's `O_DIRECT` descriptor and the
//! memory's registration: fgds's commands, else the mapping), then host RAM (the fallback:
//! into a staging buffer, then the GPU runtime's copy). Every transfer says which path it took
//! and, by name, why each better one was not taken.
//!
//! The fallback is never silent: a [`Completion`] carries the path and the reason, and with the
//! fallback off the same reason is an [`Error::DirectUnavailable`]. Only the absence of the
//! direct path falls back; a failure of I/O on the direct path (a drive error, a revoked
//! buffer) is an error, except that a kernel refusing P2P DMA for the pair of devices
//! (`EREMOTEIO`) is the direct path being absent, found late: the rest goes through RAM, and
//! the completion says so.
//!
//! Reads stop at the end of the file: a read past it completes with fewer bytes, as `pread`
//! does. `O_DIRECT` moves whole blocks only, so the part of a transfer that does not fill its
//! last block (at most one block, at the end of a file of unaligned size) is copied through
//! RAM; bytes of the memory past the transfer are never written.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::buffer::dio_alignment;
use crate::error::{Error, Result};
use crate::memory::{DirectRange, GpuMemory, NotDirect, StagingPool};
use crate::transfer::{Direction, Transfer, TransferConfig};

/// The path a transfer took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoPath {
    /// DMA between the drive and the GPU's memory, the NVMe driver importing the dma-buf
    /// (the kernel's dma-buf registered buffers; a sub-block tail through RAM).
    UringDmabuf,
    /// DMA between the drive and the GPU's memory through fgds (a sub-block tail, if any,
    /// through RAM: [`Completion::bounced`]).
    Direct,
    /// Through host RAM: read into a staging buffer, then copied (or the reverse).
    Bounce,
}

impl IoPath {
    pub fn as_str(self) -> &'static str {
        match self {
            IoPath::UringDmabuf => "uring-dmabuf",
            IoPath::Direct => "direct",
            IoPath::Bounce => "bounce",
        }
    }
}

/// A completed transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// Bytes moved: the size asked for, or less for a read that reached the end of the file.
    pub bytes: u64,
    pub path: IoPath,
    /// Why not a better path: for [`IoPath::Bounce`], why not direct (and, where the kernel
    /// has its own dma-buf buffers, why not those); for [`IoPath::Direct`], why not the
    /// kernel's dma-buf buffers where they exist; `None` where the best path was taken.
    pub reason: Option<String>,
    /// Bytes that went through host RAM: all of them for a bounce, a sub-block tail for a
    /// direct transfer.
    pub bounced: u64,
}

/// How a file is opened, as Python's and kvikio's mode strings say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mode {
    read: bool,
    write: bool,
    create: bool,
    truncate: bool,
}

impl Mode {
    fn parse(mode: &str) -> Result<Mode> {
        let (read, write, create, truncate) = match mode {
            "r" | "rb" => (true, false, false, false),
            "r+" | "rb+" | "r+b" => (true, true, false, false),
            "w" | "wb" => (false, true, true, true),
            "w+" | "wb+" | "w+b" => (true, true, true, true),
            "a" | "ab" => (false, true, true, false),
            "a+" | "ab+" | "a+b" => (true, true, true, false),
            other => {
                return Err(Error::Invalid(format!(
                    "mode {other:?}: use r, r+, w, w+, a or a+ (a does not append: every write names its offset)"
                )));
            }
        };
        Ok(Mode {
            read,
            write,
            create,
            truncate,
        })
    }
}

/// Why the kernel's dma-buf buffers did not move a transfer: refused before a byte moved (the
/// next path takes it), or failed during it (an error: no silent fallback over a failure).
enum Refusal {
    Before(NotDirect),
    During(Error),
}

/// An open file for transfers to and from GPU memory.
pub struct GpuFile {
    path: PathBuf,
    mode: Mode,
    /// The file, without `O_DIRECT`: the fallback's I/O and sub-block tails.
    buffered: File,
    /// The same open file again with `O_DIRECT`, or why it cannot be.
    direct: std::result::Result<File, NotDirect>,
    /// The `O_DIRECT` alignment of offsets, lengths and memory addresses.
    align: u64,
}

impl GpuFile {
    /// Opens `path` with `mode` (`r`, `r+`, `w`, `w+`, `a`, `a+`) and, on the same open file,
    /// a second descriptor with `O_DIRECT` where its file system allows it.
    pub fn open(path: &Path, mode: &str) -> Result<GpuFile> {
        let mode = Mode::parse(mode)?;
        let buffered = OpenOptions::new()
            .read(mode.read)
            .write(mode.write)
            .create(mode.create)
            .truncate(mode.truncate)
            .mode(0o644)
            .open(path)
            .map_err(|source| Error::Open {
                path: path.to_path_buf(),
                source,
            })?;
        // Through /proc/self/fd: the same file even if `path` was replaced meanwhile.
        let again = PathBuf::from(format!("/proc/self/fd/{}", buffered.as_raw_fd()));
        let direct = OpenOptions::new()
            .read(mode.read)
            .write(mode.write)
            .custom_flags(libc::O_DIRECT)
            .open(&again)
            .map_err(|err| {
                NotDirect::new(
                    err.raw_os_error().unwrap_or(libc::EINVAL),
                    format!(
                        "{} cannot be opened with O_DIRECT ({err}): its file system does not do direct I/O; put the file on a block-device file system (ext4, xfs) or a raw NVMe namespace",
                        path.display()
                    ),
                )
            });
        let align = direct.as_ref().map_or(512, dio_alignment);
        Ok(GpuFile {
            path: path.to_path_buf(),
            mode,
            buffered,
            direct,
            align,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The descriptor without `O_DIRECT`.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.buffered.as_fd()
    }

    /// The `O_DIRECT` alignment of the file (offsets, lengths and memory addresses).
    pub fn alignment(&self) -> u64 {
        self.align
    }

    /// Why the file has no `O_DIRECT` descriptor; `None` when it has one.
    pub fn not_direct(&self) -> Option<&NotDirect> {
        self.direct.as_ref().err()
    }

    /// The file's length in bytes (a block device's size).
    pub fn len(&self) -> Result<u64> {
        (&self.buffered)
            .seek(SeekFrom::End(0))
            .map_err(|source| Error::Io {
                op: "lseek",
                done: 0,
                len: 0,
                source,
            })
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Whether transfers between this file at `file_offset` and `mem` at `mem_offset` can go
    /// direct, or why not.
    pub fn plan(
        &self,
        mem: &dyn GpuMemory,
        file_offset: u64,
        mem_offset: u64,
    ) -> std::result::Result<DirectRange, NotDirect> {
        let range = mem.direct()?;
        if let Err(not) = &self.direct {
            return Err(not.clone());
        }
        let align = self.align;
        if !file_offset.is_multiple_of(align) {
            return Err(NotDirect::new(
                libc::EINVAL,
                format!(
                    "file offset {file_offset:#x} is not a multiple of {}'s O_DIRECT alignment ({align} bytes)",
                    self.path.display()
                ),
            ));
        }
        if !(range.offset + mem_offset).is_multiple_of(align) {
            return Err(NotDirect::new(
                libc::EINVAL,
                format!(
                    "the GPU memory address at offset {mem_offset:#x} is not a multiple of {}'s O_DIRECT alignment ({align} bytes)",
                    self.path.display()
                ),
            ));
        }
        Ok(range)
    }

    /// Reads up to `size` bytes of the file at `file_offset` into `mem` at `mem_offset`; fewer
    /// where the file ends first. Direct where [`GpuFile::plan`] allows, else through RAM if
    /// `fallback`, else [`Error::DirectUnavailable`].
    pub fn read(
        &self,
        mem: &dyn GpuMemory,
        size: u64,
        file_offset: u64,
        mem_offset: u64,
        fallback: bool,
    ) -> Result<Completion> {
        self.start(
            Direction::Read,
            mem,
            size,
            file_offset,
            mem_offset,
            fallback,
        )
    }

    /// Writes `size` bytes of `mem` at `mem_offset` to the file at `file_offset`, as
    /// [`GpuFile::read`] reads.
    pub fn write(
        &self,
        mem: &dyn GpuMemory,
        size: u64,
        file_offset: u64,
        mem_offset: u64,
        fallback: bool,
    ) -> Result<Completion> {
        self.start(
            Direction::Write,
            mem,
            size,
            file_offset,
            mem_offset,
            fallback,
        )
    }

    /// Checks the file's mode and the memory's range, stops a read at the end of the file,
    /// plans the path and runs the transfer.
    fn start(
        &self,
        dir: Direction,
        mem: &dyn GpuMemory,
        size: u64,
        file_offset: u64,
        mem_offset: u64,
        fallback: bool,
    ) -> Result<Completion> {
        let (allowed, instead) = match dir {
            Direction::Read => (
                self.mode.read,
                "writing only: open it with mode r, r+, w+ or a+ to read",
            ),
            Direction::Write => (
                self.mode.write,
                "reading only: open it with mode r+, w, w+, a or a+ to write",
            ),
        };
        if !allowed {
            return Err(Error::Refused {
                errno: libc::EBADF,
                reason: format!("{} is open for {instead}", self.path.display()),
            });
        }
        check_fits(mem, size, mem_offset)?;
        let n = match dir {
            Direction::Read => size.min(self.len()?.saturating_sub(file_offset)),
            Direction::Write => size,
        };
        let plan = self.plan(mem, file_offset, mem_offset);
        self.run(dir, mem, n, file_offset, mem_offset, plan, fallback)
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        dir: Direction,
        mem: &dyn GpuMemory,
        n: u64,
        file_offset: u64,
        mem_offset: u64,
        plan: std::result::Result<DirectRange, NotDirect>,
        fallback: bool,
    ) -> Result<Completion> {
        if n > 0 {
            mem.synchronize()?;
        }
        let aligned = n / self.align * self.align;
        // The kernel's own dma-buf buffers first; where they are not there, why, unless no
        // kernel here has them at all (then fgds's reason alone is the news).
        let kernel = match self.kernel_plan(mem, file_offset, mem_offset) {
            Ok((fd, start)) if aligned > 0 => {
                match self.run_kernel(dir, fd, start, aligned, file_offset) {
                    Ok(()) => {
                        let tail = n - aligned;
                        self.bounce(dir, mem, file_offset + aligned, mem_offset + aligned, tail)
                            .map_err(|e| shifted(e, aligned, n))?;
                        return Ok(Completion {
                            bytes: n,
                            path: IoPath::UringDmabuf,
                            reason: None,
                            bounced: tail,
                        });
                    }
                    Err(Refusal::Before(not)) => Some(not),
                    Err(Refusal::During(err)) => return Err(shifted(err, 0, n)),
                }
            }
            Ok(_) => None,
            Err(not) => (not.errno != 0).then_some(not),
        };
        let not_kernel = |reason: String| match &kernel {
            Some(k) => format!("{reason} (not uring-dmabuf either: {})", k.reason),
            None => reason,
        };
        let range = match plan {
            Ok(range) => range,
            Err(not) if fallback => {
                self.bounce(dir, mem, file_offset, mem_offset, n)?;
                return Ok(Completion {
                    bytes: n,
                    path: IoPath::Bounce,
                    reason: Some(not_kernel(not.reason)),
                    bounced: n,
                });
            }
            Err(not) => {
                return Err(Error::DirectUnavailable {
                    errno: not.errno,
                    reason: not.reason,
                });
            }
        };
        let direct = self.direct.as_ref().expect("plan checked the O_DIRECT fd");
        if aligned == 0 && n > 0 {
            // Nothing fills one block: O_DIRECT cannot move any of it.
            let reason = format!(
                "{n} bytes are less than one block of {}'s O_DIRECT alignment ({} bytes), the least O_DIRECT moves",
                self.path.display(),
                self.align
            );
            if !fallback {
                return Err(Error::DirectUnavailable {
                    errno: libc::EINVAL,
                    reason,
                });
            }
            self.bounce(dir, mem, file_offset, mem_offset, n)?;
            return Ok(Completion {
                bytes: n,
                path: IoPath::Bounce,
                reason: Some(reason),
                bounced: n,
            });
        }
        if aligned > 0 {
            let start = usize::try_from(range.offset + mem_offset)
                .map_err(|_| Error::Invalid("offset past the address space".to_owned()))?;
            let moved = Transfer::new(TransferConfig::DEFAULT).and_then(|mut transfer| {
                transfer.run(
                    dir,
                    &range.buffer,
                    start..start + aligned as usize,
                    direct,
                    file_offset,
                )
            });
            match moved {
                Ok(_) => {}
                Err(err) if fallback && p2p_refused(&err) => {
                    let done = err.bytes_done();
                    let rest = n - done;
                    self.bounce(dir, mem, file_offset + done, mem_offset + done, rest)
                        .map_err(|e| shifted(e, done, n))?;
                    return Ok(Completion {
                        bytes: n,
                        path: IoPath::Bounce,
                        reason: Some(format!(
                            "the kernel refused P2P DMA between the drive and GPU {} after {done} bytes ({err}): the drive's queues or the PCIe topology do not allow it; fgds doctor says more",
                            range.gpu
                        )),
                        bounced: rest,
                    });
                }
                Err(err) => return Err(shifted(err, 0, n)),
            }
        }
        let tail = n - aligned;
        if tail > 0 {
            self.bounce(dir, mem, file_offset + aligned, mem_offset + aligned, tail)
                .map_err(|e| shifted(e, aligned, n))?;
        }
        Ok(Completion {
            bytes: n,
            path: IoPath::Direct,
            reason: kernel.map(|k| format!("not uring-dmabuf: {}", k.reason)),
            bounced: tail,
        })
    }

    /// Whether the kernel's dma-buf registered buffers can take a transfer between this file at
    /// `file_offset` and `mem` at `mem_offset`: the dma-buf and the byte of it where the
    /// memory's range starts, or why not (errno 0: this kernel has none, nothing to report).
    fn kernel_plan<'m>(
        &self,
        mem: &'m dyn GpuMemory,
        file_offset: u64,
        mem_offset: u64,
    ) -> std::result::Result<(BorrowedFd<'m>, u64), NotDirect> {
        if crate::upstream::supported().is_err() {
            return Err(NotDirect::new(0, ""));
        }
        let (fd, start) = mem.dmabuf().ok_or_else(|| {
            NotDirect::new(
                libc::EOPNOTSUPP,
                format!("{} is not a dma-buf this process holds", mem.describe()),
            )
        })?;
        if let Err(not) = &self.direct {
            return Err(not.clone());
        }
        let at = start + mem_offset;
        if !file_offset.is_multiple_of(self.align) || !at.is_multiple_of(self.align) {
            return Err(NotDirect::new(
                libc::EINVAL,
                format!(
                    "file offset {file_offset:#x} or dma-buf offset {at:#x} is not a multiple \
                     of {}'s O_DIRECT alignment ({} bytes)",
                    self.path.display(),
                    self.align
                ),
            ));
        }
        Ok((fd, at))
    }

    /// `len` bytes at byte `start` of the dma-buf `fd` to or from the file at `file_offset`,
    /// through the kernel's dma-buf registered buffers.
    fn run_kernel(
        &self,
        dir: Direction,
        fd: BorrowedFd<'_>,
        start: u64,
        len: u64,
        file_offset: u64,
    ) -> std::result::Result<(), Refusal> {
        let direct = self
            .direct
            .as_ref()
            .expect("kernel_plan checked the O_DIRECT fd");
        let start = usize::try_from(start)
            .map_err(|_| Refusal::During(Error::Invalid("offset past the address space".into())))?;
        let mut transfer = Transfer::new(TransferConfig::DEFAULT).map_err(Refusal::During)?;
        match transfer.run_dmabuf(dir, fd, start..start + len as usize, direct, file_offset) {
            Ok(_) => Ok(()),
            // Refused at registration: nothing moved, the next path takes it all.
            Err(Error::Refused { errno, reason }) => {
                Err(Refusal::Before(NotDirect::new(errno, reason)))
            }
            Err(err) => Err(Refusal::During(err)),
        }
    }

    /// Moves `len` bytes through host RAM, a staging buffer at a time; the file I/O of one
    /// buffer overlaps the GPU copy of the previous one.
    fn bounce(
        &self,
        dir: Direction,
        mem: &dyn GpuMemory,
        file_offset: u64,
        mem_offset: u64,
        len: u64,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let pool = mem.staging()?;
        let chunk = pool.chunk_size() as u64;
        if len <= chunk {
            let mut lease = pool.lease()?;
            let buf = &mut lease[..len as usize];
            return match dir {
                Direction::Read => {
                    pread_exact(&self.buffered, buf, file_offset)?;
                    mem.copy_in(mem_offset, buf)
                }
                Direction::Write => {
                    mem.copy_out(mem_offset, buf)?;
                    pwrite_all(&self.buffered, buf, file_offset)
                }
            };
        }
        match dir {
            Direction::Read => pipeline(
                &pool,
                len,
                |buf, at| pread_exact(&self.buffered, buf, file_offset + at),
                |buf, at| mem.copy_in(mem_offset + at, buf),
            ),
            Direction::Write => pipeline(
                &pool,
                len,
                |buf, at| mem.copy_out(mem_offset + at, buf),
                |buf, at| pwrite_all(&self.buffered, buf, file_offset + at),
            ),
        }
    }
}

/// Moves `len` bytes a staging buffer at a time in two overlapped stages: `fill` puts the
/// bytes at `at` into a buffer on this thread, `drain` takes them out of it on another, while
/// `fill` does the next. The first error in byte order is returned, counted from the start.
fn pipeline(
    pool: &Arc<StagingPool>,
    len: u64,
    mut fill: impl FnMut(&mut [u8], u64) -> Result<()>,
    drain: impl Fn(&[u8], u64) -> Result<()> + Send,
) -> Result<()> {
    let chunk = pool.chunk_size() as u64;
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(crate::memory::Lease, u64)>(1);
        let drainer = scope.spawn(move || -> Result<()> {
            for (lease, at) in rx {
                let n = chunk.min(len - at) as usize;
                drain(&lease[..n], at).map_err(|e| shifted(e, at, len))?;
            }
            Ok(())
        });
        let mut at = 0;
        let mut failed = None;
        while at < len {
            let n = chunk.min(len - at) as usize;
            let filled = pool.lease().and_then(|mut lease| {
                fill(&mut lease[..n], at)?;
                Ok(lease)
            });
            match filled {
                Ok(lease) => {
                    if tx.send((lease, at)).is_err() {
                        break; // The drain stopped on an error, which it returns.
                    }
                }
                Err(err) => {
                    failed = Some(shifted(err, at, len));
                    break;
                }
            }
            at += n as u64;
        }
        drop(tx);
        drainer.join().expect("the drain thread panicked")?;
        failed.map_or(Ok(()), Err)
    })
}

/// Refuses a range of the memory that is not there.
fn check_fits(mem: &dyn GpuMemory, size: u64, mem_offset: u64) -> Result<()> {
    if mem_offset
        .checked_add(size)
        .is_none_or(|end| end > mem.len())
    {
        return Err(Error::Invalid(format!(
            "{size} bytes at offset {mem_offset} do not fit in {}",
            mem.describe()
        )));
    }
    Ok(())
}

/// Whether a direct transfer failed because the kernel will not do P2P DMA between the drive
/// and the GPU (the block layer's answer for P2PDMA pages a queue cannot take).
fn p2p_refused(err: &Error) -> bool {
    matches!(err, Error::Io { source, .. } if source.raw_os_error() == Some(libc::EREMOTEIO))
}

/// `err` of a part that started `by` bytes into a transfer of `total` bytes, as an error of
/// the whole: bytes done count from the transfer's start.
fn shifted(err: Error, by: u64, total: u64) -> Error {
    match err {
        Error::Io {
            op, done, source, ..
        } => Error::Io {
            op,
            done: by + done,
            len: total,
            source,
        },
        Error::ShortTransfer { op, done, .. } => Error::ShortTransfer {
            op,
            done: by + done,
            len: total,
        },
        other => other,
    }
}

fn pread_exact(file: &File, buf: &mut [u8], offset: u64) -> Result<()> {
    let len = buf.len();
    all_of("pread", len, |done| {
        file.read_at(&mut buf[done..], offset + done as u64)
    })
}

fn pwrite_all(file: &File, buf: &[u8], offset: u64) -> Result<()> {
    all_of("pwrite", buf.len(), |done| {
        file.write_at(&buf[done..], offset + done as u64)
    })
}

/// Calls `io(done)` until `len` bytes are done: a call that moves nothing is the end of the
/// file ([`Error::ShortTransfer`]), EINTR is retried.
fn all_of(
    op: &'static str,
    len: usize,
    mut io: impl FnMut(usize) -> std::io::Result<usize>,
) -> Result<()> {
    let mut done = 0;
    while done < len {
        match io(done) {
            Ok(0) => {
                return Err(Error::ShortTransfer {
                    op,
                    done: done as u64,
                    len: len as u64,
                });
            }
            Ok(n) => done += n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(Error::Io {
                    op,
                    done: done as u64,
                    len: len as u64,
                    source,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Host RAM posing as GPU memory with no direct path: the fallback's logic on the host.
    struct RamMemory {
        bytes: Mutex<Vec<u8>>,
        pool: Arc<StagingPool>,
    }

    impl RamMemory {
        fn new(len: usize, fill: u8, chunk: usize) -> RamMemory {
            RamMemory {
                bytes: Mutex::new(vec![fill; len]),
                pool: StagingPool::new(chunk, None),
            }
        }
    }

    impl GpuMemory for RamMemory {
        fn len(&self) -> u64 {
            self.bytes.lock().unwrap().len() as u64
        }
        fn direct(&self) -> std::result::Result<DirectRange, NotDirect> {
            Err(NotDirect::new(
                libc::ENODEV,
                "test memory has no registration",
            ))
        }
        fn staging(&self) -> Result<Arc<StagingPool>> {
            Ok(Arc::clone(&self.pool))
        }
        fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()> {
            let at = offset as usize;
            self.bytes.lock().unwrap()[at..at + src.len()].copy_from_slice(src);
            Ok(())
        }
        fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
            let at = offset as usize;
            dst.copy_from_slice(&self.bytes.lock().unwrap()[at..at + dst.len()]);
            Ok(())
        }
        fn describe(&self) -> String {
            "test memory".to_owned()
        }
    }

    fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!("fgds-gpufile-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    #[test]
    fn bounce_read_stops_at_end_of_file_and_leaves_the_rest() {
        let bytes = data(3 * 4096 + 100);
        let path = temp_file("eof", &bytes);
        let file = GpuFile::open(&path, "r").unwrap();
        // Staging of one page: the pipelined path with many chunks.
        let mem = RamMemory::new(8 * 4096, 0xab, 4096);
        let done = file.read(&mem, 6 * 4096, 4096, 100, true).unwrap();
        assert_eq!(done.bytes, 2 * 4096 + 100);
        assert_eq!(done.path, IoPath::Bounce);
        assert_eq!(
            done.reason.as_deref(),
            Some("test memory has no registration")
        );
        let got = mem.bytes.lock().unwrap().clone();
        assert_eq!(&got[100..100 + done.bytes as usize], &bytes[4096..]);
        assert!(got[..100].iter().all(|&b| b == 0xab));
        assert!(got[100 + done.bytes as usize..].iter().all(|&b| b == 0xab));
        assert_eq!(
            file.read(&mem, 4096, bytes.len() as u64, 0, true)
                .unwrap()
                .bytes,
            0
        );
        assert_eq!(file.read(&mem, 4096, 1 << 40, 0, true).unwrap().bytes, 0);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn bounce_write_then_read_round_trips() {
        let path = temp_file("rw", b"");
        let file = GpuFile::open(&path, "w+").unwrap();
        let mem = RamMemory::new(5 * 4096 + 8, 0, 4096);
        let bytes = data(5 * 4096 + 8);
        mem.copy_in(0, &bytes).unwrap();
        let done = file
            .write(&mem, bytes.len() as u64 - 8, 13, 8, true)
            .unwrap();
        assert_eq!(done.bytes, 5 * 4096);
        assert_eq!(done.bounced, 5 * 4096);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(on_disk.len(), 13 + 5 * 4096);
        assert_eq!(&on_disk[13..], &bytes[8..]);
        let back = RamMemory::new(5 * 4096, 0, 4096);
        assert_eq!(
            file.read(&back, 5 * 4096, 13, 0, true).unwrap().bytes,
            5 * 4096
        );
        assert_eq!(&back.bytes.lock().unwrap()[..], &bytes[8..]);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn fallback_off_is_an_error_with_the_reason() {
        let path = temp_file("off", &data(4096));
        let file = GpuFile::open(&path, "r").unwrap();
        let mem = RamMemory::new(4096, 0, 4096);
        let err = file.read(&mem, 4096, 0, 0, false).unwrap_err();
        assert_eq!(err.errno(), libc::ENODEV);
        assert!(
            err.to_string().contains("test memory has no registration"),
            "{err}"
        );
        assert!(err.to_string().contains("fallback"), "{err}");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn bad_arguments_are_refused_with_an_errno() {
        let path = temp_file("bad", &data(4096));
        let mem = RamMemory::new(4096, 0, 4096);
        let file = GpuFile::open(&path, "r").unwrap();
        let err = file.read(&mem, 4096, 0, 1, true).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(err.to_string().contains("do not fit"), "{err}");
        let err = file.write(&mem, 4096, 0, 0, true).unwrap_err();
        assert_eq!(err.errno(), libc::EBADF);
        let err = GpuFile::open(&path, "rw").err().expect("bad mode");
        assert_eq!(err.errno(), libc::EINVAL);
        let err = GpuFile::open(&path.with_extension("missing"), "r")
            .err()
            .unwrap();
        assert_eq!(err.errno(), libc::ENOENT);
        let write_only = GpuFile::open(&path, "a").unwrap();
        assert_eq!(
            write_only.read(&mem, 1, 0, 0, true).unwrap_err().errno(),
            libc::EBADF
        );
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn errors_part_way_count_bytes_from_the_start() {
        let err = shifted(
            Error::Io {
                op: "pread",
                done: 10,
                len: 20,
                source: std::io::Error::from_raw_os_error(libc::EIO),
            },
            4096,
            8192,
        );
        assert_eq!(err.bytes_done(), 4106);
        assert!(err.to_string().contains("of 8192 bytes"), "{err}");
    }
}
