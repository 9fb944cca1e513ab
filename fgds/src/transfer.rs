//! Large direct I/O through io_uring: a range is split into sub-requests of `chunk_size`, with
//! up to `queue_depth` in flight.
//!
//! Every request pins the pages it moves for as long as it is in flight, and no longer. GPU
//! memory is never pinned as an io_uring fixed buffer: such a pin would outlive a revocation,
//! and the kernel refuses it for fgds mappings (docs/driver.md, "Revocation contract"). Where
//! the kernel can revoke an io_uring kernel buffer (`FGDS_URING_CMD_REGISTER`, not upstream),
//! each run puts the buffer into the ring's one slot instead and its requests pin nothing
//! (docs/driver.md, "io_uring slots"); elsewhere, and where the buffer cannot go into a slot,
//! the requests name its mapped address.

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;

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
    ring: IoUring,
    config: TransferConfig,
    slot: Slot,
    last_in_slot: bool,
}

/// Whether the ring's one fixed-buffer slot can take a buffer (`FGDS_URING_CMD_REGISTER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    /// Not asked yet.
    Unknown,
    /// The ring has a sparse table of one slot, empty between runs.
    Table,
    /// The kernel has no such slots (or no sparse table): requests pin as they go.
    Unsupported,
}

/// What one `run` call moves, shared by its sub-requests.
struct Job<'a> {
    dir: Direction,
    buffer: &'a Buffer,
    range: Range<usize>,
    file: &'a File,
    file_offset: u64,
    /// The buffer is in the ring's slot: requests name it by offset, not by address.
    in_slot: bool,
}

/// One sub-request: where it is in the range and how much of it is done.
struct Chunk {
    start: usize,
    len: usize,
    done: usize,
}

impl Transfer {
    pub fn new(config: TransferConfig) -> Result<Transfer> {
        if config.chunk_size == 0 || config.queue_depth == 0 {
            return Err(Error::Invalid(format!(
                "chunk size and queue depth must be non-zero: {config:?}"
            )));
        }
        let ring =
            IoUring::new(config.queue_depth.next_power_of_two()).map_err(|source| Error::Io {
                op: "io_uring_setup",
                done: 0,
                len: 0,
                source,
            })?;
        Ok(Transfer {
            ring,
            config,
            slot: Slot::Unknown,
            last_in_slot: false,
        })
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
        let mut chunks = Vec::new();
        let mut at = 0;
        while at < total {
            let len = self.config.chunk_size.min(total - at);
            chunks.push(Chunk {
                start: at,
                len,
                done: 0,
            });
            at += len;
        }
        let in_slot = self.fill_slot(buffer);
        self.last_in_slot = in_slot;
        let job = Job {
            dir,
            buffer,
            range: range.clone(),
            file,
            file_offset,
            in_slot,
        };
        let moved = self.run_job(&job, chunks, op, total);
        if in_slot {
            // Every request has completed (`run_job` waits for them); a failure to empty the
            // slot leaves the ring without one for later runs.
            if buffer.unregister_from_ring(&mut self.ring, 0).is_err() {
                self.slot = Slot::Unsupported;
            }
        }
        moved
    }

    /// Whether the last [`Transfer::run`] went through the ring's fixed-buffer slot
    /// (`FGDS_URING_CMD_REGISTER`: nothing pinned per request) rather than the mapped address.
    pub fn last_run_in_slot(&self) -> bool {
        self.last_in_slot
    }

    /// Puts `buffer` into the ring's slot where the kernel can; returns whether it did.
    fn fill_slot(&mut self, buffer: &Buffer) -> bool {
        if self.slot == Slot::Unknown {
            self.slot = match self.ring.submitter().register_buffers_sparse(1) {
                Ok(()) => Slot::Table,
                Err(_) => Slot::Unsupported,
            };
        }
        if self.slot != Slot::Table {
            return false;
        }
        match buffer.register_in_ring(&mut self.ring, 0) {
            Ok(()) => true,
            Err(Error::Refused { errno, .. }) if errno == libc::EOPNOTSUPP => {
                self.slot = Slot::Unsupported;
                false
            }
            // A revoked buffer (ENODEV) or memory short: the mapped address fails or works
            // on its own terms.
            Err(_) => false,
        }
    }

    fn run_job(
        &mut self,
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
                && in_flight < self.config.queue_depth as usize
            {
                self.submit(job, &chunks[next], next)?;
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            self.ring.submit_and_wait(1).map_err(|source| Error::Io {
                op,
                done: 0,
                len: total as u64,
                source,
            })?;
            let completions = self
                .ring
                .completion()
                .map(|cqe| (cqe.user_data() as usize, cqe.result()))
                .collect::<Vec<_>>();
            for (index, res) in completions {
                in_flight -= 1;
                let chunk = &mut chunks[index];
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
                    self.submit(job, &chunks[index], index)?;
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

    fn submit(&mut self, job: &Job<'_>, chunk: &Chunk, index: usize) -> Result<()> {
        let (dir, file, file_offset) = (job.dir, job.file, job.file_offset);
        let offset = job.range.start + chunk.start + chunk.done;
        let len = (chunk.len - chunk.done) as u32;
        let file_off = file_offset + (chunk.start + chunk.done) as u64;
        let fd = types::Fd(file.as_raw_fd());
        let sqe = if job.in_slot {
            // The slot is addressed by offset from the buffer's start.
            let at = offset as *mut u8;
            match dir {
                Direction::Read => opcode::ReadFixed::new(fd, at, len, 0)
                    .offset(file_off)
                    .build(),
                Direction::Write => opcode::WriteFixed::new(fd, at, len, 0)
                    .offset(file_off)
                    .build(),
            }
        } else {
            // SAFETY: `offset + (len - done)` stays inside `range`, which is inside the buffer.
            let ptr = unsafe { job.buffer.as_ptr().add(offset) };
            match dir {
                Direction::Read => opcode::Read::new(fd, ptr, len).offset(file_off).build(),
                Direction::Write => opcode::Write::new(fd, ptr, len).offset(file_off).build(),
            }
        }
        .user_data(index as u64);
        // SAFETY: the buffer and file outlive the request: `run` waits for every completion
        // before returning, also on errors.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| Error::Invalid("io_uring submission queue is full".to_owned()))?;
        Ok(())
    }
}
