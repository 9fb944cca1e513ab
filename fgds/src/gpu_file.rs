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

/// Whether a transfer may go through host RAM (kvikio's compatibility mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallback {
    /// Direct where it can, through host RAM where not, saying why (kvikio's `AUTO`).
    Allowed,
    /// Direct, or an [`Error::DirectUnavailable`] that says why not (kvikio's `OFF`).
    Off,
    /// Through host RAM, always (kvikio's `ON`): no registration, no direct I/O.
    Always,
}

/// How [`GpuFile::read`] and [`GpuFile::write`] go about a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub fallback: Fallback,
    /// The direct path's requests: their size (kvikio's task size, rounded down to the file's
    /// `O_DIRECT` alignment, at least one block) and how many are in flight at once.
    pub transfer: TransferConfig,
}

impl Options {
    /// Fallback allowed, 1 MiB requests, 8 in flight.
    pub const DEFAULT: Options = Options {
        fallback: Fallback::Allowed,
        transfer: TransferConfig::DEFAULT,
    };

    /// [`Options::DEFAULT`] with `fallback`.
    pub fn with_fallback(fallback: Fallback) -> Options {
        Options {
            fallback,
            ..Options::DEFAULT
        }
    }
}

impl Default for Options {
    fn default() -> Options {
        Options::DEFAULT
    }
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

/// How a transfer splits around the blocks `O_DIRECT` moves: `head` bytes up to the file's
/// first block boundary and `tail` bytes after the last whole block go through host RAM, the
/// `body` of whole blocks between them goes direct. A safetensors tensor at any offset of its
/// file is then direct but for less than two blocks, provided its memory sits at the same
/// place in a block as its offset in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Split {
    head: u64,
    body: u64,
    tail: u64,
}

impl Split {
    /// The split of `n` bytes at `file_offset` into memory at address (or dma-buf offset)
    /// `mem_addr`, or why there is no direct body: the two sit at different places in their
    /// blocks (`O_DIRECT` needs both on a boundary at once), or no whole block fits.
    fn new(
        align: u64,
        n: u64,
        file_offset: u64,
        mem_addr: u64,
    ) -> std::result::Result<Split, String> {
        let (f, m) = (file_offset % align, mem_addr % align);
        if f != m {
            return Err(format!(
                "file offset {file_offset:#x} is {f} bytes into a {align}-byte block and the GPU \
                 memory {m} bytes: O_DIRECT needs both on a block boundary at once, so put the \
                 memory {f} bytes past a boundary (GpuFile::phase)"
            ));
        }
        let head = ((align - f) % align).min(n);
        let body = (n - head) / align * align;
        if body == 0 && n > 0 {
            return Err(format!(
                "{n} bytes at file offset {file_offset:#x} fill no whole {align}-byte block, the \
                 least O_DIRECT moves"
            ));
        }
        Ok(Split {
            head,
            body,
            tail: n - head - body,
        })
    }

    /// Bytes through host RAM.
    fn edges(self) -> u64 {
        self.head + self.tail
    }
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

    /// Where in a block of [`GpuFile::alignment`] the memory of a transfer at `file_offset`
    /// must start for all but its first and last partial blocks to go direct. A loader reading
    /// a region at an arbitrary offset (a safetensors file's tensors start at 8 + the header's
    /// length) allocates this many bytes more and reads into its memory at this offset.
    pub fn phase(&self, file_offset: u64) -> u64 {
        file_offset % self.align
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

    /// Whether a transfer of `n` bytes between this file at `file_offset` and `mem` at
    /// `mem_offset` can go direct through fgds, or why not: the memory's registration, and how
    /// the transfer splits around the blocks `O_DIRECT` moves ([`Split`]).
    fn plan(
        &self,
        mem: &dyn GpuMemory,
        n: u64,
        file_offset: u64,
        mem_offset: u64,
    ) -> std::result::Result<(DirectRange, Split), NotDirect> {
        let range = mem.direct()?;
        if let Err(not) = &self.direct {
            return Err(not.clone());
        }
        let split = self.split(n, file_offset, range.offset + mem_offset)?;
        Ok((range, split))
    }

    /// [`Split::new`] with this file's alignment, its refusal as a [`NotDirect`].
    fn split(
        &self,
        n: u64,
        file_offset: u64,
        mem_addr: u64,
    ) -> std::result::Result<Split, NotDirect> {
        Split::new(self.align, n, file_offset, mem_addr).map_err(|why| {
            NotDirect::new(libc::EINVAL, format!("{} ({})", why, self.path.display()))
        })
    }

    /// Reads up to `size` bytes of the file at `file_offset` into `mem` at `mem_offset`; fewer
    /// where the file ends first. Direct where it can go direct (its whole blocks, where the
    /// memory sits at the file offset's place in a block), else through RAM as `opts.fallback`
    /// allows, else [`Error::DirectUnavailable`].
    pub fn read(
        &self,
        mem: &dyn GpuMemory,
        size: u64,
        file_offset: u64,
        mem_offset: u64,
        opts: &Options,
    ) -> Result<Completion> {
        self.start(Direction::Read, mem, size, file_offset, mem_offset, opts)
    }

    /// Writes `size` bytes of `mem` at `mem_offset` to the file at `file_offset`, as
    /// [`GpuFile::read`] reads.
    pub fn write(
        &self,
        mem: &dyn GpuMemory,
        size: u64,
        file_offset: u64,
        mem_offset: u64,
        opts: &Options,
    ) -> Result<Completion> {
        self.start(Direction::Write, mem, size, file_offset, mem_offset, opts)
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
        opts: &Options,
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
        if opts.fallback == Fallback::Always {
            if n > 0 {
                mem.synchronize()?;
            }
            self.bounce(dir, mem, file_offset, mem_offset, n)?;
            return Ok(Completion {
                bytes: n,
                path: IoPath::Bounce,
                reason: Some("the fallback was asked for (compatibility mode on)".to_owned()),
                bounced: n,
            });
        }
        let config = self.transfer_config(opts.transfer)?;
        let plan = self.plan(mem, n, file_offset, mem_offset);
        let fallback = opts.fallback == Fallback::Allowed;
        self.run(dir, mem, n, file_offset, mem_offset, plan, fallback, config)
    }

    /// `asked` with its request size a whole number of the file's blocks (at least one).
    fn transfer_config(&self, asked: TransferConfig) -> Result<TransferConfig> {
        if asked.chunk_size == 0 || asked.queue_depth == 0 {
            return Err(Error::Invalid(format!(
                "task size {} and queue depth {} must be positive",
                asked.chunk_size, asked.queue_depth
            )));
        }
        let align = self.align as usize;
        Ok(TransferConfig {
            chunk_size: (asked.chunk_size / align).max(1) * align,
            queue_depth: asked.queue_depth,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        dir: Direction,
        mem: &dyn GpuMemory,
        n: u64,
        file_offset: u64,
        mem_offset: u64,
        plan: std::result::Result<(DirectRange, Split), NotDirect>,
        fallback: bool,
        config: TransferConfig,
    ) -> Result<Completion> {
        if n > 0 {
            mem.synchronize()?;
        }
        // The kernel's own dma-buf buffers first; where they are not there, why, unless no
        // kernel here has them at all (then fgds's reason alone is the news).
        let kernel = match self.kernel_plan(mem, n, file_offset, mem_offset) {
            Ok((fd, start, split)) => {
                let body = |at: u64, len: u64| {
                    self.run_kernel(dir, fd, start + at, len, file_offset + at, config)
                };
                match self.run_split(dir, mem, file_offset, mem_offset, n, split, body) {
                    Ok(()) => {
                        return Ok(Completion {
                            bytes: n,
                            path: IoPath::UringDmabuf,
                            reason: None,
                            bounced: split.edges(),
                        });
                    }
                    Err(Refusal::Before(not)) => Some(not),
                    Err(Refusal::During(err)) => return Err(err),
                }
            }
            Err(not) => (not.errno != 0).then_some(not),
        };
        let not_kernel = |reason: String| match &kernel {
            Some(k) if k.reason != reason => {
                format!("{reason} (not uring-dmabuf either: {})", k.reason)
            }
            _ => reason,
        };
        let (range, split) = match plan {
            Ok(planned) => planned,
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
        let start = usize::try_from(range.offset + mem_offset)
            .map_err(|_| Error::Invalid("offset past the address space".to_owned()))?;
        let body = |at: u64, len: u64| {
            let at_mem = start + at as usize;
            Transfer::new(config)
                .and_then(|mut transfer| {
                    transfer.run(
                        dir,
                        &range.buffer,
                        at_mem..at_mem + len as usize,
                        direct,
                        file_offset + at,
                    )
                })
                .map(drop)
                .map_err(Refusal::During)
        };
        match self.run_split(dir, mem, file_offset, mem_offset, n, split, body) {
            Ok(()) => Ok(Completion {
                bytes: n,
                path: IoPath::Direct,
                reason: kernel.map(|k| format!("not uring-dmabuf: {}", k.reason)),
                bounced: split.edges(),
            }),
            Err(Refusal::During(err)) if fallback && p2p_refused(&err) => {
                let done = err.bytes_done();
                let rest = n - done;
                // The driver's gate says why, where it refused the file (an unprivileged
                // process cannot read the kernel log's line).
                let gate = range
                    .buffer
                    .check_file(direct, dir == Direction::Write)
                    .ok()
                    .filter(|verdict| !verdict.is_direct());
                self.bounce(dir, mem, file_offset + done, mem_offset + done, rest)
                    .map_err(|e| shifted(e, done, n))?;
                let reason = match gate {
                    // A stacked disk (md): say which member stopped it.
                    Some(verdict) if verdict.gate == crate::gate::Gate::NoPci => format!(
                        "fgds does not take this file for GPU {}: {}; its members: {} ({err})",
                        range.gpu,
                        verdict.explain(),
                        crate::gate::describe_members(
                            &range.buffer.check_members(direct, dir == Direction::Write)
                        )
                    ),
                    Some(verdict) => format!(
                        "fgds does not take this file for GPU {}: {} ({err})",
                        range.gpu,
                        verdict.explain()
                    ),
                    None => format!(
                        "the kernel refused P2P DMA between the drive and GPU {} after {done} bytes ({err}): the drive's queues or the PCIe topology do not allow it; fgds doctor FILE says more",
                        range.gpu
                    ),
                };
                Ok(Completion {
                    bytes: n,
                    path: IoPath::Bounce,
                    reason: Some(reason),
                    bounced: rest,
                })
            }
            Err(Refusal::During(err)) => Err(err),
            Err(Refusal::Before(not)) => Err(Error::DirectUnavailable {
                errno: not.errno,
                reason: not.reason,
            }),
        }
    }

    /// Moves a transfer's head through RAM, its body with `body(at, len)` (bytes `at..at + len`
    /// of the transfer, direct), then its tail through RAM. An error counts the bytes done from
    /// the transfer's start; a refusal of the body before it moved anything is returned as it is
    /// (the head, moved already, is moved again by the next path).
    #[allow(clippy::too_many_arguments)]
    fn run_split(
        &self,
        dir: Direction,
        mem: &dyn GpuMemory,
        file_offset: u64,
        mem_offset: u64,
        n: u64,
        split: Split,
        body: impl FnOnce(u64, u64) -> std::result::Result<(), Refusal>,
    ) -> std::result::Result<(), Refusal> {
        self.bounce(dir, mem, file_offset, mem_offset, split.head)
            .map_err(|e| Refusal::During(shifted(e, 0, n)))?;
        match body(split.head, split.body) {
            Ok(()) => {}
            Err(Refusal::During(err)) => return Err(Refusal::During(shifted(err, split.head, n))),
            Err(before) => return Err(before),
        }
        let at = split.head + split.body;
        self.bounce(dir, mem, file_offset + at, mem_offset + at, split.tail)
            .map_err(|e| Refusal::During(shifted(e, at, n)))
    }

    /// Whether the kernel's dma-buf registered buffers can take a transfer of `n` bytes between
    /// this file at `file_offset` and `mem` at `mem_offset`: the dma-buf, the byte of it where
    /// the memory's range starts, and the transfer's split; or why not (errno 0: this kernel
    /// has none, nothing to report).
    fn kernel_plan<'m>(
        &self,
        mem: &'m dyn GpuMemory,
        n: u64,
        file_offset: u64,
        mem_offset: u64,
    ) -> std::result::Result<(BorrowedFd<'m>, u64, Split), NotDirect> {
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
        let split = self.split(n, file_offset, at)?;
        Ok((fd, at, split))
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
        config: TransferConfig,
    ) -> std::result::Result<(), Refusal> {
        let direct = self
            .direct
            .as_ref()
            .expect("kernel_plan checked the O_DIRECT fd");
        let start = usize::try_from(start)
            .map_err(|_| Refusal::During(Error::Invalid("offset past the address space".into())))?;
        let mut transfer = Transfer::new(config).map_err(Refusal::During)?;
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

    /// A transfer at any offset goes direct but for its partial first and last blocks, where
    /// the memory sits at the file offset's place in a block; elsewhere, or under one block,
    /// the reason names the fix.
    #[test]
    fn split_puts_whole_blocks_direct() {
        let s = |n, f, m| Split::new(4096, n, f, m);
        // A safetensors body: header of 8 + 1234 bytes, memory at the same phase.
        assert_eq!(
            s(10_000_000, 1242, 1242),
            Ok(Split {
                head: 4096 - 1242,
                body: (10_000_000 - (4096 - 1242)) / 4096 * 4096,
                tail: (10_000_000 - (4096 - 1242)) % 4096,
            })
        );
        assert_eq!(
            s(8192, 4096, 0),
            Ok(Split {
                head: 0,
                body: 8192,
                tail: 0
            })
        );
        assert_eq!(
            s(0, 100, 100),
            Ok(Split {
                head: 0,
                body: 0,
                tail: 0
            })
        );
        let why = s(1 << 20, 1242, 0).unwrap_err();
        assert!(why.contains("GpuFile::phase"), "{why}");
        let why = s(5000, 1242, 1242).unwrap_err();
        assert!(why.contains("no whole"), "{why}");
    }

    #[test]
    fn bounce_read_stops_at_end_of_file_and_leaves_the_rest() {
        let bytes = data(3 * 4096 + 100);
        let path = temp_file("eof", &bytes);
        let file = GpuFile::open(&path, "r").unwrap();
        // Staging of one page: the pipelined path with many chunks.
        let mem = RamMemory::new(8 * 4096, 0xab, 4096);
        let done = file
            .read(&mem, 6 * 4096, 4096, 100, &Options::DEFAULT)
            .unwrap();
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
            file.read(&mem, 4096, bytes.len() as u64, 0, &Options::DEFAULT)
                .unwrap()
                .bytes,
            0
        );
        assert_eq!(
            file.read(&mem, 4096, 1 << 40, 0, &Options::DEFAULT)
                .unwrap()
                .bytes,
            0
        );
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
            .write(&mem, bytes.len() as u64 - 8, 13, 8, &Options::DEFAULT)
            .unwrap();
        assert_eq!(done.bytes, 5 * 4096);
        assert_eq!(done.bounced, 5 * 4096);
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!(on_disk.len(), 13 + 5 * 4096);
        assert_eq!(&on_disk[13..], &bytes[8..]);
        let back = RamMemory::new(5 * 4096, 0, 4096);
        assert_eq!(
            file.read(&back, 5 * 4096, 13, 0, &Options::DEFAULT)
                .unwrap()
                .bytes,
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
        let err = file
            .read(&mem, 4096, 0, 0, &Options::with_fallback(Fallback::Off))
            .unwrap_err();
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
        let err = file.read(&mem, 4096, 0, 1, &Options::DEFAULT).unwrap_err();
        assert_eq!(err.errno(), libc::EINVAL);
        assert!(err.to_string().contains("do not fit"), "{err}");
        let err = file.write(&mem, 4096, 0, 0, &Options::DEFAULT).unwrap_err();
        assert_eq!(err.errno(), libc::EBADF);
        let err = GpuFile::open(&path, "rw").err().expect("bad mode");
        assert_eq!(err.errno(), libc::EINVAL);
        let err = GpuFile::open(&path.with_extension("missing"), "r")
            .err()
            .unwrap();
        assert_eq!(err.errno(), libc::ENOENT);
        let write_only = GpuFile::open(&path, "a").unwrap();
        assert_eq!(
            write_only
                .read(&mem, 1, 0, 0, &Options::DEFAULT)
                .unwrap_err()
                .errno(),
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
