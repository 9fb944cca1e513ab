//! Issue 7 (d): drive I/O errors (QEMU blkdebug under the raw node, armed at the rig's fault
//! areas, `fgds_tests::pattern::fault`) during direct I/O between the NVMe and GPU memory,
//! reads and writes, persistent and once, through the crate's io_uring `Transfer` and through
//! raw pread/pwrite into an fgds mapping. Each case checks:
//! - the errno (EIO, or ENODATA for the NVMe media error the kernel makes of it);
//! - the exact partial transfer: the crate's `bytes_done` is every sub-request before the one
//!   that touched the failing sector, and those bytes are right;
//! - that later I/O succeeds (the rest of the range; all of it again after a once-error) and a
//!   persistent error stays;
//! - that GPU memory outside the I/O's range is intact, through vgpu's CPU mapping and by the
//!   host in the GPU's backing file, asked over the control channel (sentinels, the data read,
//!   the data that was the source of a failed write);
//! - that the error reaches the application: an I/O across a failing sector that succeeds,
//!   a once-error's first included, fails the case (the error was swallowed).
//!
//! The NVMe driver retries media errors, which hides a once-error from the application, and the
//! block layer merges adjacent sub-requests into one NVMe command, which then fails as a whole:
//! the cases set `nvme_core.max_retries` and the drive's `queue/nomerges` (to 0 and 2) while
//! they run, and put them back.
//!
//! Each case has its own 2 MiB of vgpu memory above 192 MiB of BAR2, allocated once and held
//! until the program exits.

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

use anyhow::{Context, bail, ensure};
use common::MIB;
use fgds::{Direction, Error, Gpu, Transfer, TransferConfig};
use fgds_tests::ctl;
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern::{self, fault as area};

const KIB: u64 = 1 << 10;
/// Each case's vgpu memory.
const CASE_BYTES: u64 = 2 * MIB;
/// Where the cases' memory starts in BAR2 (first fit after a spacer).
const HIGH: u64 = 192 * MIB;
/// Head sentinel, then the I/O's range, then the tail sentinel, in each case's memory.
const HEAD: u64 = 64 * KIB;
/// The I/O: from 960 KiB before the failing sector to 512 KiB after it, in sub-requests of
/// 256 KiB (the fourth one holds the failing sector).
const PRE: u64 = 960 * KIB;
const IO_LEN: u64 = PRE + 512 * KIB;
const CHUNK: u64 = 256 * KIB;
/// What the crate must report done: the three sub-requests before the failing one.
const DONE: u64 = PRE / CHUNK * CHUNK;
const TAIL: u64 = HEAD + IO_LEN;
/// 4 KiB around the failing sector, skipped when the test reads or writes the drive itself.
const FAULT_BLOCK: u64 = 4 * KIB;

const CASES: [&str; 6] = [
    "read_always_transfer",
    "read_always_pread",
    "write_always_transfer",
    "write_always_pwrite",
    "read_once_transfer",
    "write_once_transfer",
];

fn main() {
    common::run_unless_refused(&[
        Case {
            name: CASES[0],
            run: || read_case(0, area::READ_ALWAYS, false, Via::Transfer),
        },
        Case {
            name: CASES[1],
            run: || read_case(1, area::READ_ALWAYS, false, Via::Syscall),
        },
        Case {
            name: CASES[2],
            run: || write_case(2, area::WRITE_ALWAYS, false, Via::Transfer),
        },
        Case {
            name: CASES[3],
            run: || write_case(3, area::WRITE_ALWAYS, false, Via::Syscall),
        },
        Case {
            name: CASES[4],
            run: || read_case(4, area::READ_ONCE, true, Via::Transfer),
        },
        Case {
            name: CASES[5],
            run: || write_case(5, area::WRITE_ONCE, true, Via::Transfer),
        },
    ])
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    /// The crate's io_uring `Transfer`.
    Transfer,
    /// One raw pread/pwrite of the whole range into/from the fgds mapping.
    Syscall,
}

/// Seeds of case `k`: head sentinel, tail sentinel, data.
fn seeds(k: usize) -> (u64, u64, u64) {
    let base = 0x4452_0000 + 16 * k as u64;
    (base, base + 1, base + 2)
}

static BUFS: OnceLock<Vec<(OwnedFd, u64)>> = OnceLock::new();

/// The cases' vgpu memory, allocated once above HIGH and kept until the program exits.
fn case_buf(k: usize) -> anyhow::Result<(BorrowedFd<'static>, u64)> {
    if BUFS.get().is_none() {
        let vgpu = common::vgpu()?;
        let spacer = common::alloc(&vgpu, HIGH).context("spacer (is BAR2 in use?)")?;
        let bufs = (0..CASES.len())
            .map(|_| common::alloc(&vgpu, CASE_BYTES))
            .collect::<anyhow::Result<Vec<_>>>()?;
        drop(spacer);
        let _ = BUFS.set(bufs);
    }
    let (fd, off) = &BUFS.get().expect("set above")[k];
    ensure!(
        *off >= HIGH,
        "case memory at BAR2 offset {off:#x}, below {HIGH:#x}"
    );
    Ok((fd.as_fd(), *off))
}

/// Puts the sentinels and, in the I/O's range, `target_seed`'s pattern (or a fill byte) into
/// the case's GPU memory through vgpu's CPU mapping.
fn prepare_gpu(dmabuf: BorrowedFd<'_>, k: usize, target: Option<u64>) -> anyhow::Result<()> {
    let (head, tail, _) = seeds(k);
    let mut mem = vec![0x5au8; CASE_BYTES as usize];
    pattern::fill(head, 0, &mut mem[..HEAD as usize]);
    pattern::fill(tail, 0, &mut mem[TAIL as usize..]);
    if let Some(seed) = target {
        pattern::fill(seed, 0, &mut mem[HEAD as usize..TAIL as usize]);
    }
    common::gpu_write(dmabuf, CASE_BYTES as usize, 0, &mem)
}

/// Checks the sentinels through vgpu's CPU mapping; returns the I/O range's bytes.
fn check_gpu(dmabuf: BorrowedFd<'_>, k: usize) -> anyhow::Result<Vec<u8>> {
    let (head, tail, _) = seeds(k);
    let mem = common::gpu_read(dmabuf, CASE_BYTES as usize, 0, CASE_BYTES as usize)?;
    if let Some(at) = pattern::first_mismatch(head, 0, &mem[..HEAD as usize]) {
        bail!("the head sentinel before the I/O's range changed at byte {at}");
    }
    if let Some(at) = pattern::first_mismatch(tail, 0, &mem[TAIL as usize..]) {
        bail!("the tail sentinel after the I/O's range changed at byte {at}");
    }
    Ok(mem[HEAD as usize..TAIL as usize].to_vec())
}

/// Asks the host to check now, in the GPU's backing file, the case's sentinels and `len` bytes
/// of `data`'s pattern at the start of the I/O's range.
fn host_checks(k: usize, bar_off: u64, len: u64) -> anyhow::Result<()> {
    let (head, tail, data) = seeds(k);
    ctl::gpu_check(bar_off, HEAD, head).context("the head sentinel, seen by the host")?;
    ctl::gpu_check(bar_off + TAIL, CASE_BYTES - TAIL, tail)
        .context("the tail sentinel, seen by the host")?;
    if len > 0 {
        ctl::gpu_check(bar_off + HEAD, len, data).context("the data, seen by the host")?;
    }
    Ok(())
}

/// Sets `nvme_core.max_retries` to 0 until dropped, so that the drive's error reaches the
/// application instead of being retried away.
struct NoRetries {
    old: Option<String>,
}

const MAX_RETRIES: &str = "/sys/module/nvme_core/parameters/max_retries";

impl NoRetries {
    fn new() -> anyhow::Result<NoRetries> {
        let old = std::fs::read_to_string(MAX_RETRIES).ok();
        if old.is_some() {
            std::fs::write(MAX_RETRIES, "0")
                .with_context(|| format!("cannot write {MAX_RETRIES}"))?;
        }
        Ok(NoRetries { old })
    }

    fn active(&self) -> bool {
        self.old.is_some()
    }
}

impl Drop for NoRetries {
    fn drop(&mut self) {
        if let Some(old) = &self.old {
            let _ = std::fs::write(MAX_RETRIES, old.trim());
        }
    }
}

/// Sets the drive's `queue/nomerges` to 2 until dropped: the block layer would otherwise merge
/// adjacent sub-requests into one NVMe command, which then fails as a whole, so the failing
/// sub-request would not be the one that holds the failing sector.
struct NoMerges {
    path: std::path::PathBuf,
    old: String,
}

impl NoMerges {
    fn new() -> anyhow::Result<NoMerges> {
        let dev = fgds_tests::guest::nvme_path()?;
        let name = dev.file_name().context("FGDS_NVME has no file name")?;
        let path = std::path::Path::new("/sys/block")
            .join(name)
            .join("queue/nomerges");
        let old = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        std::fs::write(&path, "2").with_context(|| format!("cannot write {}", path.display()))?;
        Ok(NoMerges { path, old })
    }
}

impl Drop for NoMerges {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.path, self.old.trim());
    }
}

fn is_drive_errno(errno: Option<i32>) -> bool {
    matches!(errno, Some(libc::EIO) | Some(libc::ENODATA))
}

/// Writes `seed`'s pattern (stream offset 0 at `start`) to the drive over `[start, start+len)`
/// through RAM, skipping the 4 KiB around `fault` (a write there may be the injected error).
fn drive_fill(nvme: &File, start: u64, len: u64, seed: u64, fault: u64) -> anyhow::Result<()> {
    let mut ram = AlignedBuf::new(len as usize)?;
    pattern::fill(seed, 0, ram.as_mut_slice());
    let cut = (fault - start) as usize;
    let skip = FAULT_BLOCK as usize;
    nvme.write_all_at(&ram.as_slice()[..cut], start)
        .context("writing the source before the fault")?;
    nvme.write_all_at(&ram.as_slice()[cut + skip..], fault + FAULT_BLOCK)
        .context("writing the source after the fault")?;
    Ok(())
}

/// Reads `[start, start+len)` of the drive into RAM (the range must not touch a read fault).
fn drive_read(nvme: &File, start: u64, len: u64) -> anyhow::Result<Vec<u8>> {
    let mut ram = AlignedBuf::new(len as usize)?;
    nvme.read_exact_at(ram.as_mut_slice(), start)
        .with_context(|| format!("reading back the drive at {start:#x}+{len:#x}"))?;
    Ok(ram.as_slice().to_vec())
}

/// One pread or pwrite system call (no retry loop): the byte count or the errno.
fn one_syscall(
    dir: Direction,
    file: &File,
    ptr: *mut u8,
    len: u64,
    off: u64,
) -> Result<usize, i32> {
    // SAFETY: `ptr` is a live fgds mapping of at least `len` bytes; the kernel only DMAs.
    let n = unsafe {
        match dir {
            Direction::Read => libc::pread(file.as_raw_fd(), ptr.cast(), len as usize, off as i64),
            Direction::Write => {
                libc::pwrite(file.as_raw_fd(), ptr.cast(), len as usize, off as i64)
            }
        }
    };
    if n < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(n as usize)
    }
}

/// A registration of the case's memory, through the crate (for `Transfer`) and raw.
struct Reg {
    buffer: fgds::Buffer,
}

fn register(dmabuf: BorrowedFd<'_>) -> anyhow::Result<Reg> {
    let info = Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    let gpu = Gpu::open(&info.bdf)?;
    Ok(Reg {
        buffer: gpu.register(dmabuf, 0, CASE_BYTES)?,
    })
}

/// Runs the I/O over the case's whole range, `[fault - PRE, fault - PRE + IO_LEN)` of the
/// drive and `[HEAD, TAIL)` of the buffer: Ok(bytes) or (errno, bytes reported done).
fn io(
    reg: &Reg,
    dir: Direction,
    via: Via,
    nvme: &File,
    start: u64,
) -> Result<u64, (Option<i32>, u64)> {
    match via {
        Via::Transfer => {
            let mut t = Transfer::new(TransferConfig {
                chunk_size: CHUNK as usize,
                queue_depth: 4,
            })
            .map_err(|e| (e.source_errno(), 0))?;
            t.run(dir, &reg.buffer, HEAD as usize..TAIL as usize, nvme, start)
                .map(|n| n as u64)
                .map_err(|e| (e.source_errno(), e.bytes_done()))
        }
        Via::Syscall => {
            // SAFETY: HEAD is inside the buffer's mapping.
            let ptr = unsafe { reg.buffer.as_ptr().add(HEAD as usize) };
            match one_syscall(dir, nvme, ptr, IO_LEN, start) {
                Ok(n) if n as u64 == IO_LEN => Ok(IO_LEN),
                // A short count is a partial transfer the kernel reports itself.
                Ok(n) => Err((None, n as u64)),
                Err(errno) => Err((Some(errno), 0)),
            }
        }
    }
}

trait SourceErrno {
    fn source_errno(&self) -> Option<i32>;
}

impl SourceErrno for Error {
    fn source_errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// The bytes a failed I/O must report done: the crate's sub-requests before the failing one;
/// a raw system call reports none (or a short count, which must not reach the fault).
fn check_failure(
    what: &str,
    via: Via,
    res: Result<u64, (Option<i32>, u64)>,
) -> anyhow::Result<u64> {
    match (via, res) {
        (_, Ok(n)) => bail!("{what}: moved {n} bytes across the failing sector without an error"),
        (Via::Transfer, Err((errno, done))) => {
            ensure!(
                is_drive_errno(errno),
                "{what}: errno {errno:?}, want EIO or ENODATA"
            );
            ensure!(
                done == DONE,
                "{what}: the crate reports {done} bytes done, want exactly {DONE} (the \
                 sub-requests before the one that touched the failing sector)"
            );
            Ok(done)
        }
        (Via::Syscall, Err((None, n))) => {
            ensure!(
                n <= PRE,
                "{what}: a short count of {n} bytes reaches past the failing sector ({PRE})"
            );
            Ok(n)
        }
        (Via::Syscall, Err((errno, _))) => {
            ensure!(
                is_drive_errno(errno),
                "{what}: errno {errno:?}, want EIO or ENODATA"
            );
            Ok(0)
        }
    }
}

fn read_case(k: usize, fault: u64, once: bool, via: Via) -> CaseResult {
    fault::require_idle()?;
    let retries = NoRetries::new()?;
    let _merges = NoMerges::new()?;
    if once && !retries.active() {
        return ktap::skip(format!(
            "{MAX_RETRIES} is missing: the NVMe driver's retry would hide the once-error"
        ));
    }
    let (_, _, data) = seeds(k);
    let start = fault - PRE;
    let (dmabuf, bar_off) = case_buf(k)?;
    let nvme = common::nvme(true)?;
    drive_fill(&nvme, start, IO_LEN, data, fault)?;
    // The byte at the failing sector itself (skipped by drive_fill) is whatever the drive held;
    // give it the pattern too, through a write that does not touch a write-fault area.
    let mut block = AlignedBuf::new(FAULT_BLOCK as usize)?;
    pattern::fill(data, PRE, block.as_mut_slice());
    nvme.write_all_at(block.as_slice(), fault)?;
    prepare_gpu(dmabuf, k, None)?;
    let reg = register(dmabuf)?;

    let kind = if once { "once" } else { "always" };
    fault::host_log(&format!(
        "fgds_fault_drive {}: drive read error (blkdebug EIO, {kind}) expected at byte {fault:#x} \
         ({via:?} of {IO_LEN:#x} bytes from {start:#x} into GPU memory at BAR2 {:#x})",
        CASES[k],
        bar_off + HEAD
    ))?;
    let first = io(&reg, Direction::Read, via, &nvme, start);
    ktap::diag(format_args!("{via:?} across the failing sector: {first:?}"));
    if once && first.is_ok() {
        bail!(
            "the read across the once-error at READ_ONCE ({fault:#x}) succeeded: the drive's \
             error never reached the application (swallowed, retried away, or fired earlier by \
             another program's I/O there)"
        );
    }
    let done = check_failure("read across the failing sector", via, first)?;
    let got = check_gpu(dmabuf, k)?;
    if let Some(at) = pattern::first_mismatch(data, 0, &got[..done as usize]) {
        bail!("byte {at} of the {done} bytes reported done differs from the drive");
    }

    // Later I/O.
    let again = io(&reg, Direction::Read, via, &nvme, start);
    if once {
        ensure!(
            again == Ok(IO_LEN),
            "the same read after the once-error: {again:?}, want all {IO_LEN} bytes"
        );
        let got = check_gpu(dmabuf, k)?;
        if let Some(at) = pattern::first_mismatch(data, 0, &got) {
            bail!("after the retry byte {at} of the range differs from the drive");
        }
        host_checks(k, bar_off, IO_LEN)?;
    } else {
        check_failure("the same read again (a persistent error)", via, again)?;
        // The parts before and after the failing 4 KiB read fine.
        // SAFETY: both ranges lie inside the buffer's mapping.
        let (p0, p1) = unsafe {
            (
                reg.buffer.as_ptr().add(HEAD as usize),
                reg.buffer.as_ptr().add((HEAD + PRE + FAULT_BLOCK) as usize),
            )
        };
        let after = IO_LEN - PRE - FAULT_BLOCK;
        let r0 = one_syscall(Direction::Read, &nvme, p0, PRE, start);
        let r1 = one_syscall(Direction::Read, &nvme, p1, after, fault + FAULT_BLOCK);
        ensure!(
            r0 == Ok(PRE as usize) && r1 == Ok(after as usize),
            "reads beside the failing sector: {r0:?}, {r1:?}"
        );
        let got = check_gpu(dmabuf, k)?;
        if let Some(at) = pattern::first_mismatch(data, 0, &got[..PRE as usize]) {
            bail!("read before the failing sector: byte {at} differs");
        }
        let tail = &got[(PRE + FAULT_BLOCK) as usize..];
        if let Some(at) = pattern::first_mismatch(data, PRE + FAULT_BLOCK, tail) {
            bail!("read after the failing sector: byte {at} differs");
        }
        host_checks(k, bar_off, PRE)?;
    }
    drop(reg);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

fn write_case(k: usize, fault: u64, once: bool, via: Via) -> CaseResult {
    fault::require_idle()?;
    let retries = NoRetries::new()?;
    let _merges = NoMerges::new()?;
    if once && !retries.active() {
        return ktap::skip(format!(
            "{MAX_RETRIES} is missing: the NVMe driver's retry would hide the once-error"
        ));
    }
    let (_, _, data) = seeds(k);
    let old = data ^ 0xffff_0000;
    let start = fault - PRE;
    let (dmabuf, bar_off) = case_buf(k)?;
    let nvme = common::nvme(true)?;
    // The drive holds other data first, so that what the write put there shows.
    drive_fill(&nvme, start, IO_LEN, old, fault)?;
    prepare_gpu(dmabuf, k, Some(data))?;
    let reg = register(dmabuf)?;

    let kind = if once { "once" } else { "always" };
    fault::host_log(&format!(
        "fgds_fault_drive {}: drive write error (blkdebug EIO, {kind}) expected at byte {fault:#x} \
         ({via:?} of {IO_LEN:#x} bytes from GPU memory at BAR2 {:#x} to {start:#x})",
        CASES[k],
        bar_off + HEAD
    ))?;
    let first = io(&reg, Direction::Write, via, &nvme, start);
    ktap::diag(format_args!("{via:?} across the failing sector: {first:?}"));
    if once && first.is_ok() {
        bail!(
            "the write across the once-error at WRITE_ONCE ({fault:#x}) succeeded: the drive's \
             error never reached the application (swallowed, retried away, or fired earlier by \
             another program's I/O there)"
        );
    }
    let done = check_failure("write across the failing sector", via, first)?;
    // The source in GPU memory is untouched, sentinels included.
    let got = check_gpu(dmabuf, k)?;
    if let Some(at) = pattern::first_mismatch(data, 0, &got) {
        bail!("a failed write changed its source in GPU memory at byte {at}");
    }
    // What was reported done is on the drive.
    let on_drive = drive_read(&nvme, start, PRE)?;
    if let Some(at) = pattern::first_mismatch(data, 0, &on_drive[..done as usize]) {
        bail!("byte {at} of the {done} bytes reported written is not on the drive");
    }

    let again = io(&reg, Direction::Write, via, &nvme, start);
    if once {
        ensure!(
            again == Ok(IO_LEN),
            "the same write after the once-error: {again:?}, want all {IO_LEN} bytes"
        );
        let on_drive = drive_read(&nvme, start, IO_LEN)?;
        if let Some(at) = pattern::first_mismatch(data, 0, &on_drive) {
            bail!("after the retry byte {at} of the range on the drive differs");
        }
    } else {
        check_failure("the same write again (a persistent error)", via, again)?;
        // SAFETY: both ranges lie inside the buffer's mapping.
        let (p0, p1) = unsafe {
            (
                reg.buffer.as_ptr().add(HEAD as usize),
                reg.buffer.as_ptr().add((HEAD + PRE + FAULT_BLOCK) as usize),
            )
        };
        let after = IO_LEN - PRE - FAULT_BLOCK;
        let w0 = one_syscall(Direction::Write, &nvme, p0, PRE, start);
        let w1 = one_syscall(Direction::Write, &nvme, p1, after, fault + FAULT_BLOCK);
        ensure!(
            w0 == Ok(PRE as usize) && w1 == Ok(after as usize),
            "writes beside the failing sector: {w0:?}, {w1:?}"
        );
        let before = drive_read(&nvme, start, PRE)?;
        let behind = drive_read(&nvme, fault + FAULT_BLOCK, after)?;
        ensure!(
            pattern::first_mismatch(data, 0, &before).is_none()
                && pattern::first_mismatch(data, PRE + FAULT_BLOCK, &behind).is_none(),
            "the writes beside the failing sector did not reach the drive"
        );
    }
    let got = check_gpu(dmabuf, k)?;
    ensure!(
        pattern::first_mismatch(data, 0, &got).is_none(),
        "GPU memory changed by writes from it"
    );
    host_checks(k, bar_off, IO_LEN)?;
    drop(reg);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}
