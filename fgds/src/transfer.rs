//! Large direct I/O through io_uring: a range is split into sub-requests of `chunk_size`, with
//! up to `queue_depth` in flight.
//!
//! A buffer registered with [`Transfer::register_buffer`] is an io_uring fixed buffer: the
//! kernel pins its pages once, instead of once per request (`pin_user_pages_fast()`, a page at
//! a time with interrupts off), which is most of what a large read into GPU memory would
//! otherwise cost the CPU (docs/performance.md). It is opt-in, because such a pin outlives a
//! revocation (see the method).

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
/// if let Err(err) = transfer.register_buffer(&buffer) {
///     println!("requests will pin their pages one by one: {err}");
/// }
/// match transfer.run(Direction::Read, &buffer, 0..buffer.len(), &file, 0) {
///     Ok(n) => println!("{n} bytes in GPU memory"),
///     Err(err) => println!("the first {} bytes arrived, then: {err}", err.bytes_done()),
/// }
/// # Ok::<(), fgds::Error>(())
/// ```
pub struct Transfer<'b> {
    ring: IoUring,
    config: TransferConfig,
    /// The buffer registered as the ring's fixed buffer 0, if any.
    fixed: Option<&'b Buffer>,
}

/// What one `run` call moves, shared by its sub-requests.
struct Job<'a> {
    dir: Direction,
    buffer: &'a Buffer,
    range: Range<usize>,
    file: &'a File,
    file_offset: u64,
}

/// One sub-request: where it is in the range and how much of it is done.
struct Chunk {
    start: usize,
    len: usize,
    done: usize,
}

impl<'b> Transfer<'b> {
    pub fn new(config: TransferConfig) -> Result<Transfer<'b>> {
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
            fixed: None,
        })
    }

    /// Registers `buffer` as the ring's fixed buffer, so that `run` on it pins nothing per
    /// request. The pages stay pinned until the `Transfer` is dropped.
    ///
    /// The pin outlives a revocation: fgds removes the buffer's mappings and waits for I/O in
    /// flight, but a request submitted through the fixed buffer afterwards still reaches the
    /// pages, and the GPU's unbind or removal waits `revoke_timeout_ms` for the pin and then
    /// gives up (docs/driver.md, "known limit"). Drop the `Transfer` when the GPU is going
    /// away; without this call, requests pin per request and a revocation stops them.
    ///
    /// Fails where the kernel will not pin the buffer's pages long-term: P2PDMA pages (Linux
    /// 7.x, `fgds list` mode `p2pdma` or `exporter-p2pdma`) give `EREMOTEIO`, Linux 6.1's
    /// io_uring takes no file-backed memory (`EOPNOTSUPP`), and without `CAP_IPC_LOCK` the
    /// pinned bytes count against `RLIMIT_MEMLOCK` (`ENOMEM`). The `Transfer` is unchanged
    /// then and works as before.
    pub fn register_buffer(&mut self, buffer: &'b Buffer) -> Result<()> {
        if self.fixed.is_some() {
            return Err(Error::Invalid(
                "this Transfer already has a fixed buffer: use one Transfer per buffer".to_owned(),
            ));
        }
        let iov = libc::iovec {
            iov_base: buffer.as_ptr().cast(),
            iov_len: buffer.len(),
        };
        // SAFETY: `buffer` is mapped for `'b`, which outlives the ring, and `Drop` unregisters
        // it before the ring goes.
        unsafe { self.ring.submitter().register_buffers(&[iov]) }.map_err(|source| Error::Io {
            op: "io_uring fixed buffer registration",
            done: 0,
            len: buffer.len() as u64,
            source,
        })?;
        self.fixed = Some(buffer);
        Ok(())
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
        let job = Job {
            dir,
            buffer,
            range: range.clone(),
            file,
            file_offset,
        };
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
                self.submit(&job, &chunks[next], next)?;
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
                    self.submit(&job, &chunks[index], index)?;
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
        // SAFETY: `offset + (len - done)` stays inside `range`, which is inside the buffer.
        let ptr = unsafe { job.buffer.as_ptr().add(offset) };
        let len = (chunk.len - chunk.done) as u32;
        let file_off = file_offset + (chunk.start + chunk.done) as u64;
        let fd = types::Fd(file.as_raw_fd());
        let fixed = self.fixed.is_some_and(|b| std::ptr::eq(b, job.buffer));
        let sqe = match (dir, fixed) {
            (Direction::Read, true) => opcode::ReadFixed::new(fd, ptr, len, 0)
                .offset(file_off)
                .build(),
            (Direction::Read, false) => opcode::Read::new(fd, ptr, len).offset(file_off).build(),
            (Direction::Write, true) => opcode::WriteFixed::new(fd, ptr, len, 0)
                .offset(file_off)
                .build(),
            (Direction::Write, false) => opcode::Write::new(fd, ptr, len).offset(file_off).build(),
        }
        .user_data(index as u64);
        // SAFETY: the buffer and file outlive the request: `run` waits for every completion
        // before returning, also on errors.
        unsafe { self.ring.submission().push(&sqe) }
            .map_err(|_| Error::Invalid("io_uring submission queue is full".to_owned()))?;
        Ok(())
    }
}

impl Drop for Transfer<'_> {
    fn drop(&mut self) {
        if self.fixed.is_some() {
            // Unpins the pages now; the kernel would otherwise do it later, from a worker,
            // after the buffer may already be gone.
            let _ = self.ring.submitter().unregister_buffers();
        }
    }
}
