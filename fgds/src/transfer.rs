//! Large direct I/O through io_uring: a range is split into sub-requests of `chunk_size`, with
//! up to `queue_depth` in flight.
//!
//! GPU memory is never pinned as an io_uring fixed buffer: such a pin would outlive a
//! revocation, and the kernel refuses it for fgds mappings (docs/driver.md, "Revocation
//! contract"). [`Transfer::run_dmabuf`] takes the kernel's own dma-buf registered buffers
//! (`crate::upstream`, where a kernel has them: the NVMe driver imports the dma-buf, no fgds);
//! [`Transfer::run`], on an fgds registration, takes the first of two paths that the kernel
//! offers:
//!
//! 1. fgds's own commands (`FGDS_URING_CMD_READ`/`WRITE`, from Linux 6.12): fgds hands the
//!    file an iterator over the registration's pages, nothing pinned, and the I/O completes
//!    asynchronously (docs/driver.md, "fgds's own reads and writes"), where fgds takes the file
//!    (a block device or an ext4/xfs file whose NVMe drive reaches the GPU; `EREMOTEIO`
//!    otherwise, and the run goes the second way);
//! 2. the mapped address: every request pins the pages it moves while it is in flight.
//!
//! The ring has 128-byte entries, which the commands need.

use std::fs::File;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};

use io_uring::squeue::Entry128;
use io_uring::{IoUring, opcode, types};

use crate::buffer::{Buffer, check_direct_io};
use crate::error::{Error, Result};

/// How a [`Transfer`] splits and queues I/O.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferConfig {
    /// Bytes per sub-request; a multiple of the file's O_DIRECT alignment.
    pub chunk_size: usize,
    /// Sub-requests in flight at once.
    pub queue_depth: u32,
}

impl TransferConfig {
    /// 1 MiB sub-requests, 8 in flight.
    pub const DEFAULT: TransferConfig = TransferConfig {
        chunk_size: 1 << 20,
        queue_depth: 8,
    };
}

/// Direction of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From the file into the GPU buffer.
    Read,
    /// From the GPU buffer into the file.
    Write,
}

/// An io_uring instance for moving data between files and GPU buffers.
///
/// ```no_run
/// # fn buffer() -> fgds::Buffer { unimplemented!() }
/// use fgds::{Direction, Transfer, TransferConfig};
/// let buffer = buffer();
/// let file = fgds::open_direct("/data/shard-0.bin".as_ref(), false)?;
/// let mut transfer = Transfer::new(TransferConfig::DEFAULT)?;
/// match transfer.run(Direction::Read, &buffer, 0..buffer.len(), &file, 0) {
///     Ok(n) => println!("{n} bytes in GPU memory"),
///     Err(err) => println!("the first {} bytes arrived, then: {err}", err.bytes_done()),
/// }
/// # Ok::<(), fgds::Error>(())
/// ```
pub struct Transfer {
    uring: IoUring<Entry128>,
    /// Whether fgds takes `FGDS_URING_CMD_READ`/`WRITE`; `None` until asked.
    commands: Option<bool>,
    config: TransferConfig,
    last_path: Option<TransferPath>,
    /// The dma-buf registered in the ring's buffer slot 0 and the file it is for
    /// ([`Transfer::run_dmabuf`]); `None` before the first, the table made on first use.
    dmabuf_slot: Option<Option<DmabufSlot>>,
}

/// What a [`Transfer`]'s buffer slot holds: the dma-buf and the open file, by identity.
#[derive(Clone, Copy, PartialEq, Eq)]
struct DmabufSlot {
    dmabuf: (u64, u64),
    file: (u64, u64, RawFd),
}

/// A file's device and inode.
fn identity(fd: BorrowedFd<'_>) -> std::io::Result<(u64, u64)> {
    let st = rustix::fs::fstat(fd)?;
    Ok((st.st_dev, st.st_ino))
}

/// How a [`Transfer::run`] moved its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferPath {
    /// The kernel's dma-buf registered buffers (`READ_FIXED`/`WRITE_FIXED` at offsets into
    /// the dma-buf, which the NVMe driver imported): no fgds.
    KernelDmabuf,
    /// By fgds's commands (`FGDS_URING_CMD_READ`/`WRITE`): nothing pinned.
    Command,
    /// Through the mapped address: each request pinned its pages while in flight.
    Mapped,
}

impl TransferPath {
    /// As reports name it.
    pub fn as_str(self) -> &'static str {
        match self {
            TransferPath::KernelDmabuf => "uring-dmabuf",
            TransferPath::Command => "fgds-commands",
            TransferPath::Mapped => "fgds-mapping",
        }
    }
}

/// What one `run` call moves, shared by its sub-requests.
struct Job<'a> {
    dir: Direction,
    /// The fgds registration; `None` for [`TransferPath::KernelDmabuf`] (slot 0).
    buffer: Option<&'a Buffer>,
    range: Range<usize>,
    file: &'a File,
    file_offset: u64,
    path: TransferPath,
}

/// One sub-request: where it is in the range and how much of it is done.
#[derive(Clone)]
struct Chunk {
    start: usize,
    len: usize,
    done: usize,
    /// Spurious `EAGAIN`s of the kernel's dma-buf buffers, issued again.
    again: u32,
}

/// The most spurious `EAGAIN`s one sub-request is issued again for.
const MAX_AGAIN: u32 = 64;

fn io_error(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Io {
        op,
        done: 0,
        len: 0,
        source,
    }
}

impl Transfer {
    pub fn new(config: TransferConfig) -> Result<Transfer> {
        if config.chunk_size == 0 || config.queue_depth == 0 {
            return Err(Error::Invalid(format!(
                "chunk size and queue depth must be non-zero: {config:?}"
            )));
        }
        let ring = IoUring::<Entry128>::builder()
            .build(config.queue_depth.next_power_of_two())
            .map_err(|source| Error::Io {
                op: "io_uring_setup",
                done: 0,
                len: 0,
                source,
            })?;
        Ok(Transfer {
            uring: ring,
            commands: None,
            config,
            last_path: None,
            dmabuf_slot: None,
        })
    }

    /// Moves `range` of the dma-buf `dmabuf` (byte offsets into it) to or from `file` at
    /// `file_offset` through the kernel's dma-buf registered buffers (`crate::upstream`): the
    /// NVMe driver imports the dma-buf, no fgds is involved. `file` must be an `O_DIRECT` NVMe
    /// block device; the registration stays in the ring for the next call with the same
    /// dma-buf and file. Errors as [`Transfer::run`]'s; a registration the kernel refuses is an
    /// [`Error::Refused`] whose errno and reason say why (`EOPNOTSUPP`: not an NVMe device).
    pub fn run_dmabuf(
        &mut self,
        dir: Direction,
        dmabuf: BorrowedFd<'_>,
        range: Range<usize>,
        file: &File,
        file_offset: u64,
    ) -> Result<usize> {
        let size = crate::dmabuf::DmabufInfo::of(dmabuf)?.size;
        check_direct_io(file, file_offset, &range, size as usize)?;
        crate::upstream::supported().map_err(|not| Error::Refused {
            errno: not.errno,
            reason: not.reason,
        })?;
        let wanted = DmabufSlot {
            dmabuf: identity(dmabuf).map_err(io_error("fstat of the dma-buf"))?,
            file: {
                let (dev, ino) = identity(file.as_fd()).map_err(io_error("fstat of the file"))?;
                (dev, ino, file.as_raw_fd())
            },
        };
        match self.dmabuf_slot {
            Some(Some(held)) if held == wanted => {}
            held => {
                if held.is_none() {
                    self.uring
                        .submitter()
                        .register_buffers_sparse(1)
                        .map_err(io_error("a sparse io_uring buffer table"))?;
                } else {
                    crate::upstream::unregister(&self.uring, 0)
                        .map_err(io_error("emptying the io_uring buffer slot"))?;
                }
                self.dmabuf_slot = Some(None);
                crate::upstream::register_in(&self.uring, 0, dmabuf, file.as_fd()).map_err(
                    |err| {
                        let not = crate::upstream::refusal(&err);
                        Error::Refused {
                            errno: not.errno,
                            reason: not.reason,
                        }
                    },
                )?;
                self.dmabuf_slot = Some(Some(wanted));
            }
        }
        let job = Job {
            dir,
            buffer: None,
            range: range.clone(),
            file,
            file_offset,
            path: TransferPath::KernelDmabuf,
        };
        self.last_path = Some(TransferPath::KernelDmabuf);
        let op = match dir {
            Direction::Read => "io_uring READ_FIXED (dma-buf)",
            Direction::Write => "io_uring WRITE_FIXED (dma-buf)",
        };
        let chunks = self.chunks(range.len());
        run_job(&mut self.uring, self.config, &job, chunks, op, range.len())
    }

    /// Sub-requests of `chunk_size` covering `total` bytes.
    fn chunks(&self, total: usize) -> Vec<Chunk> {
        (0..total)
            .step_by(self.config.chunk_size)
            .map(|start| Chunk {
                start,
                len: self.config.chunk_size.min(total - start),
                done: 0,
                again: 0,
            })
            .collect()
    }

    /// Moves `range` of `buffer` to or from `file` at `file_offset`; returns the bytes moved.
    ///
    /// On failure the error's [`Error::bytes_done`] is exact: every byte of the range before it
    /// arrived, and the sub-request at that point failed or came up short. Requests already in
    /// flight are always waited for before returning.
    pub fn run(
        &mut self,
        dir: Direction,
        buffer: &Buffer,
        range: Range<usize>,
        file: &File,
        file_offset: u64,
    ) -> Result<usize> {
        check_direct_io(file, file_offset, &range, buffer.len())?;
        if !(self.config.chunk_size as u64).is_multiple_of(crate::buffer::dio_alignment(file)) {
            return Err(Error::Invalid(format!(
                "chunk size {} is not a multiple of the file's O_DIRECT alignment",
                self.config.chunk_size
            )));
        }
        let op = match dir {
            Direction::Read => "io_uring read",
            Direction::Write => "io_uring write",
        };
        let total = range.len();
        let chunks = self.chunks(total);
        let path = if takes_commands(&mut self.uring, &mut self.commands, buffer) {
            TransferPath::Command
        } else {
            TransferPath::Mapped
        };
        // Without the commands (Linux 6.1), the gate still says where the mapping would go.
        if path == TransferPath::Mapped && !mapping_may_take(buffer, file, dir, true) {
            return Err(Error::Io {
                op,
                done: 0,
                len: total as u64,
                source: std::io::Error::from_raw_os_error(libc::EREMOTEIO),
            });
        }
        let job = Job {
            dir,
            buffer: Some(buffer),
            range: range.clone(),
            file,
            file_offset,
            path,
        };
        self.last_path = Some(path);
        match run_job(
            &mut self.uring,
            self.config,
            &job,
            chunks.clone(),
            op,
            total,
        ) {
            // fgds refuses its commands for this file (driver/fgds/gate.c) before moving a
            // byte. Where that is a queue that may merge or a disk it cannot check (md), the
            // mapped address goes through the kernel's own P2PDMA checks for user pages, which
            // may take it; where the file cannot be reached by DMA at all, the mapping would
            // only let the CPU copy (GENERIC pages are RAM to the kernel), which is not this
            // path: the refusal stands.
            Err(err)
                if path == TransferPath::Command
                    && err.errno() == libc::EREMOTEIO
                    && err.bytes_done() == 0
                    && mapping_may_take(buffer, file, dir, false) =>
            {
                let job = Job {
                    path: TransferPath::Mapped,
                    ..job
                };
                self.last_path = Some(TransferPath::Mapped);
                run_job(&mut self.uring, self.config, &job, chunks, op, total)
            }
            done => done,
        }
    }

    /// How the last [`Transfer::run`] moved its data; `None` before the first.
    pub fn last_run_path(&self) -> Option<TransferPath> {
        self.last_path
    }
}

/// Whether the mapped path may take `file`: the driver's gate takes it (`direct`: asked
/// before any command), or refused it only for merges (user pages never merge), or for a disk
/// without a PCI device (md) every member of which the gate takes; or there is no gate to ask.
fn mapping_may_take(buffer: &Buffer, file: &File, dir: Direction, direct: bool) -> bool {
    use crate::gate::Gate;
    let write = dir == Direction::Write;
    match buffer.check_file(file, write) {
        Ok(verdict) => match verdict.gate {
            Gate::Merges => true,
            Gate::Direct => direct,
            // GENERIC pages are RAM to the kernel, which checks nothing for them: each member
            // must pass the gate itself (a member that cannot be opened to ask does not).
            Gate::NoPci => {
                let members = buffer.check_members(file, write);
                !members.is_empty()
                    && members
                        .iter()
                        .all(|(_, v)| v.as_ref().is_ok_and(crate::gate::Verdict::mapping_reaches))
            }
            _ => false,
        },
        Err(_) => true,
    }
}

/// Whether fgds takes `FGDS_URING_CMD_READ`/`WRITE` on this ring, asked once (`known`): a
/// command of no length is refused with EINVAL by a driver that has them (ENOTTY or EOPNOTSUPP
/// where not).
fn takes_commands(
    uring: &mut IoUring<Entry128>,
    known: &mut Option<bool>,
    buffer: &Buffer,
) -> bool {
    if let Some(known) = *known {
        return known;
    }
    let arg = crate::uapi::Io {
        idx: buffer.idx(),
        ..Default::default()
    };
    let sqe = opcode::UringCmd80::new(
        types::Fd(buffer.node().as_raw_fd()),
        crate::uapi::URING_CMD_READ,
    )
    .cmd(arg.to_cmd())
    .build();
    // SAFETY: the command carries its argument inline; it refers to no memory of ours.
    let pushed = unsafe { uring.submission().push(&sqe) }.is_ok();
    let res = match pushed && uring.submit_and_wait(1).is_ok() {
        true => uring.completion().next().map(|cqe| cqe.result()),
        false => None,
    };
    let takes = res == Some(-libc::EINVAL);
    *known = Some(takes);
    takes
}

fn run_job(
    uring: &mut IoUring<Entry128>,
    config: TransferConfig,
    job: &Job<'_>,
    mut chunks: Vec<Chunk>,
    op: &'static str,
    total: usize,
) -> Result<usize> {
    let mut next = 0;
    let mut in_flight = 0usize;
    // The first failure in range order: (chunk index, error).
    let mut failure: Option<(usize, std::io::Error)> = None;
    let mut short: Option<usize> = None;
    loop {
        while failure.is_none()
            && short.is_none()
            && next < chunks.len()
            && in_flight < config.queue_depth as usize
        {
            submit(uring, job, &chunks[next], next)?;
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        uring.submit_and_wait(1).map_err(|source| Error::Io {
            op,
            done: 0,
            len: total as u64,
            source,
        })?;
        let completions = uring
            .completion()
            .map(|cqe| (cqe.user_data() as usize, cqe.result()))
            .collect::<Vec<_>>();
        for (index, res) in completions {
            in_flight -= 1;
            let chunk = &mut chunks[index];
            // The kernel's dma-buf buffers may answer EAGAIN while the NVMe driver maps the
            // dma-buf again after an invalidation (the series says callers must expect it).
            if res == -libc::EAGAIN
                && job.path == TransferPath::KernelDmabuf
                && chunk.again < MAX_AGAIN
                && failure.is_none()
            {
                chunk.again += 1;
                submit(uring, job, &chunks[index], index)?;
                in_flight += 1;
                continue;
            }
            if res < 0 {
                let err = std::io::Error::from_raw_os_error(-res);
                if failure.as_ref().is_none_or(|(i, _)| index < *i) {
                    failure = Some((index, err));
                }
                continue;
            }
            chunk.done += res as usize;
            if res == 0 {
                short = Some(short.map_or(index, |s| s.min(index)));
            } else if chunk.done < chunk.len && failure.is_none() {
                // A partial completion: ask for the rest.
                submit(uring, job, &chunks[index], index)?;
                in_flight += 1;
            }
        }
    }
    let done = chunks
        .iter()
        .take_while(|c| c.done == c.len)
        .map(|c| c.len)
        .sum::<usize>();
    let first_bad = chunks.iter().position(|c| c.done < c.len);
    match (first_bad, failure) {
        (None, _) => Ok(done),
        (Some(bad), Some((index, source))) if index == bad => Err(Error::Io {
            op,
            done: done as u64,
            len: total as u64,
            source,
        }),
        (Some(_), _) => Err(Error::ShortTransfer {
            op,
            done: done as u64,
            len: total as u64,
        }),
    }
}

fn submit(uring: &mut IoUring<Entry128>, job: &Job<'_>, chunk: &Chunk, index: usize) -> Result<()> {
    let (dir, file, file_offset) = (job.dir, job.file, job.file_offset);
    let offset = job.range.start + chunk.start + chunk.done;
    let len = (chunk.len - chunk.done) as u32;
    let file_off = file_offset + (chunk.start + chunk.done) as u64;
    let fd = types::Fd(file.as_raw_fd());
    let sqe: Entry128 = match (job.path, job.buffer) {
        (TransferPath::KernelDmabuf, _) => {
            // The address of a dma-buf registered buffer is a byte offset into the dma-buf.
            let at = offset as *mut u8;
            match dir {
                Direction::Read => opcode::ReadFixed::new(fd, at, len, 0)
                    .offset(file_off)
                    .build(),
                Direction::Write => opcode::WriteFixed::new(fd, at, len, 0)
                    .offset(file_off)
                    .build(),
            }
            .into()
        }
        (TransferPath::Command, Some(buffer)) => {
            let op = match dir {
                Direction::Read => crate::uapi::URING_CMD_READ,
                Direction::Write => crate::uapi::URING_CMD_WRITE,
            };
            let arg = buffer.io_arg(file, offset, len as usize, file_off);
            opcode::UringCmd80::new(types::Fd(buffer.node().as_raw_fd()), op)
                .cmd(arg.to_cmd())
                .build()
        }
        (TransferPath::Mapped, Some(buffer)) => {
            // SAFETY: `offset + (len - done)` stays inside `range`, which is inside the buffer.
            let ptr = unsafe { buffer.as_ptr().add(offset) };
            match dir {
                Direction::Read => opcode::Read::new(fd, ptr, len).offset(file_off).build(),
                Direction::Write => opcode::Write::new(fd, ptr, len).offset(file_off).build(),
            }
            .into()
        }
        (_, None) => return Err(Error::Invalid("an fgds path without a registration".into())),
    }
    .user_data(index as u64);
    // SAFETY: the buffer and file outlive the request: `run` waits for every completion
    // before returning, also on errors.
    unsafe { uring.submission().push(&sqe) }
        .map_err(|_| Error::Invalid("io_uring submission queue is full".to_owned()))?;
    Ok(())
}
