//! fgds's own reads and writes (`FGDS_IOCTL_READ`/`WRITE`, `FGDS_URING_CMD_READ`/`WRITE`), on
//! every kernel: data moves between a file and a registration with no mapping and no pin, on
//! the raw drive and on an ext4 file, across the runs of a registration that is not one run of
//! BAR2, many commands in flight on one ring; a revocation waits
//! for a call held in flight and for no timer, makes new calls fail with ENODEV at once, and
//! nothing of the held call lands once the exporter reuses the memory; bad calls fail with
//! the errno the header documents; the crate's `Transfer` uses the commands where there is no
//! io_uring slot; a command issued on a worker whose I/O completes before the file's method
//! returned ends only after that return.

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, PAGE, ioctl_io};
use fgds::uapi;
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};
use io_uring::squeue::Entry128;
use io_uring::{IoUring, opcode, types};

/// NVMe scratch area of this program: reads come from here, writes go 4 MiB further.
const SCRATCH: u64 = 232 * MIB;
const SEED_SENTINEL: u64 = 0x494f_534e;
const SEED_READ: u64 = 0x494f_5244;
const SEED_FILE: u64 = 0x494f_4654;
/// How long the held-call case keeps its read held.
const HOLD: Duration = Duration::from_secs(2);
/// The blkdebug breakpoint tag.
const TAG: &str = "fgds_io";

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "ioctl_reads_and_writes_with_no_mapping",
            run: ioctl_reads_and_writes_with_no_mapping,
        },
        Case {
            name: "ext4_file_both_directions",
            run: ext4_file_both_directions,
        },
        Case {
            name: "two_runs_both_directions",
            run: two_runs_both_directions,
        },
        Case {
            name: "uring_commands_many_in_flight",
            run: uring_commands_many_in_flight,
        },
        Case {
            name: "held_call_never_lands_after_revocation",
            run: || held_never_lands_after_revocation(false),
        },
        Case {
            name: "held_command_never_lands_after_revocation",
            run: || held_never_lands_after_revocation(true),
        },
        Case {
            name: "bad_calls_fail_with_their_errno",
            run: bad_calls_fail_with_their_errno,
        },
        Case {
            name: "crate_transfer_takes_the_commands",
            run: crate_transfer_takes_the_commands,
        },
        Case {
            name: "lookup_racing_unreg_takes_no_freed_registration",
            run: lookup_racing_unreg,
        },
        Case {
            name: "command_completing_inside_its_issue_waits_for_it",
            run: completing_inside_issue,
        },
    ])
}

/// Where fgds's debugfs counters are (uring.c).
const DEBUGFS: &str = "/sys/kernel/debug/fgds";

/// fgds's debugfs counters of its commands (uring.c): (issued again, completed inside their
/// issue on a worker).
fn uring_counters() -> anyhow::Result<(u64, u64)> {
    let read = |name: &str| -> anyhow::Result<u64> {
        let path = std::path::Path::new(DEBUGFS).join(name);
        let text =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        text.trim()
            .parse()
            .with_context(|| format!("{}: {text:?} is no number", path.display()))
    };
    Ok((read("uring_reissued")?, read("uring_completed_in_issue")?))
}

/// Read commands of an ext4 file issued on a worker, by io_uring's own (`IOSQE_ASYNC`) and by
/// fgds's (issued again after `IOCB_NOWAIT` met a writer holding the inode lock), whose I/O
/// completes before the file's method that queued it has returned. ext4's direct reads use
/// the kiocb and the file on their way out, so the command may end, and free them, only after
/// that return; before the fix the task work freed them under the method, which KASAN reported
/// in CI as a use after free in `ext4_file_read_iter()`. On kernels with fault injection fgds
/// keeps using the kiocb `issue_window_us` after the method queued the I/O, so that every
/// completion lands inside; elsewhere the completions land there as they come. The case runs
/// until fgds counted reissues and completions inside an issue (debugfs) and fails if they
/// never came; every command moves its 4 KiB, and GPU memory holds the file's bytes.
fn completing_inside_issue() -> CaseResult {
    fault::require_idle()?;
    let Some(dir) = std::env::var_os("FGDS_EXT4") else {
        return ktap::skip("the rig provides no ext4 filesystem (FGDS_EXT4 unset)");
    };
    let node = common::open_node()?;
    if !has_commands(&node)? {
        return ktap::skip(NO_COMMANDS);
    }
    if !std::path::Path::new(DEBUGFS).exists() {
        return ktap::skip(format!("no {DEBUGFS}: the kernel has no debugfs"));
    }
    /// The file's bytes that the commands read; a writer rewrites the next megabyte.
    const LEN: u64 = 8 * MIB;
    const PIECE: u64 = 4096;
    const DEPTH: u64 = 16;
    /// Completions inside an issue on a worker, and reissues, that the case waits for.
    const WANT: u64 = 8;
    let deadline = Duration::from_secs(60);
    let path = std::path::Path::new(&dir).join("fgds-issue.bin");
    let mut ram = AlignedBuf::new((LEN + MIB) as usize)?;
    pattern::fill(SEED_FILE, 0, ram.as_mut_slice());
    std::fs::write(&path, ram.as_slice())?;
    let file = fgds_tests::guest::open_direct(&path, false)?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let _window = fault::Window::set("issue_window_us", 2000)?;

    // Buffered writes take the inode lock for writing: a NOWAIT read meets it and fgds
    // issues it again, waiting, from its workqueue.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let tail = ram.as_slice()[LEN as usize..].to_vec();
        let file = std::fs::OpenOptions::new().write(true).open(&path)?;
        std::thread::spawn(move || -> anyhow::Result<u64> {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let at = (n % (MIB / PIECE)) * PIECE;
                file.write_all_at(&tail[at as usize..(at + PIECE) as usize], LEN + at)?;
                n += 1;
            }
            Ok(n)
        })
    };
    let before = uring_counters()?;
    let mut ring = IoUring::<Entry128>::builder()
        .build(DEPTH as u32)
        .context("io_uring_setup with 128-byte entries")?;
    let started = Instant::now();
    let (mut next, mut in_flight) = (0u64, 0u64);
    let result = loop {
        let now = uring_counters()?;
        let counted = (now.0 - before.0, now.1 - before.1);
        if counted.0 >= WANT && counted.1 >= WANT {
            break Ok(());
        }
        if started.elapsed() > deadline {
            break Err(anyhow::anyhow!(
                "{next} commands in {deadline:?}: fgds counted {} reissues and {} completions \
                 inside an issue on a worker, want {WANT} of each: the race this case is for \
                 did not happen",
                counted.0,
                counted.1
            ));
        }
        while in_flight < DEPTH {
            let at = (next % (LEN / PIECE)) * PIECE;
            let mut sqe =
                common::io_cmd(&node, false, &io_arg(idx, at, PIECE, &file, at)).user_data(next);
            if next % 2 == 0 {
                sqe = sqe.flags(io_uring::squeue::Flags::ASYNC);
            }
            // SAFETY: the command carries its argument inline; it refers to no memory.
            unsafe { ring.submission().push(&sqe) }.context("submission queue full")?;
            next += 1;
            in_flight += 1;
        }
        ring.submit_and_wait(1)?;
        let mut bad = None;
        for cqe in ring.completion() {
            in_flight -= 1;
            if cqe.result() != PIECE as i32 {
                bad.get_or_insert((cqe.user_data(), cqe.result()));
            }
        }
        if let Some((n, res)) = bad {
            break Err(anyhow::anyhow!("command {n} gave {res}, want {PIECE}"));
        }
    };
    while in_flight > 0 {
        ring.submit_and_wait(1)?;
        in_flight -= ring.completion().count() as u64;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = fault::join(writer, "writer")?.context("the buffered writer")?;
    let now = uring_counters()?;
    let counted = (now.0 - before.0, now.1 - before.1);
    ktap::diag(format_args!(
        "{next} commands, {writes} buffered writes beside them, in {:?}: {} reissued, {} \
         completed inside their issue on a worker",
        started.elapsed(),
        counted.0,
        counted.1
    ));
    result?;
    ctl::gpu_check(bar_off, LEN.min(next * PIECE), SEED_FILE)
        .context("GPU memory after the commands")?;
    drop((ring, file, node, dmabuf));
    std::fs::remove_file(&path)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// A read's lookup of its registration racing the UNREG that drops its last reference: the
/// lookup finds the entry under RCU and takes a reference only if the last one has not gone,
/// so a read that found a registration going fails with ENOENT, and the registration's memory
/// outlives the lookup (freed a grace period later). fgds spins `lookup_window_us` between
/// finding the entry and taking the reference, and the UNREG lands in that spin; a read that
/// took the whole spin and got ENOENT found the entry before the UNREG and lost to it. On the
/// debug kernels KASAN reports the use after free of a lookup without the grace period.
fn lookup_racing_unreg() -> CaseResult {
    const WINDOW: Duration = Duration::from_millis(10);
    const ROUNDS: u32 = 20;
    const LEN: u64 = 64 * 1024;
    let Some(_window) = fault::Window::set("lookup_window_us", WINDOW.as_micros() as u32)? else {
        return ktap::skip(
            "no lookup_window_us: fgds's fault-injection windows need CONFIG_FAULT_INJECTION \
             (the build:X.Y+debug kernels)",
        );
    };
    fault::require_idle()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    let mut lost = 0;
    for _ in 0..ROUNDS {
        let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN).context("REG")?;
        drop(dmabuf);
        let arg = io_arg(idx, 0, PAGE, &nvme, SCRATCH);
        // The registration in use (its @users switched on), as a busy one is.
        ioctl_io(&node, false, &arg)
            .map_err(std::io::Error::from_raw_os_error)
            .context("FGDS_IOCTL_READ before the race")?;
        let (read, took) = std::thread::scope(|scope| {
            let reader = scope.spawn(|| {
                let started = Instant::now();
                (ioctl_io(&node, false, &arg), started.elapsed())
            });
            // Inside the reader's spin, after its lookup found the entry.
            std::thread::sleep(WINDOW / 5);
            let unreg = common::unreg(&node, idx);
            let read = reader
                .join()
                .map_err(|_| anyhow::format_err!("the reading thread panicked"))?;
            ensure!(unreg.is_ok(), "UNREG of a live token: {unreg:?}");
            Ok(read)
        })?;
        match read {
            Err(libc::ENOENT) if took >= WINDOW => lost += 1,
            // The read came before the UNREG, or its lookup after it.
            Ok(n) if n == PAGE as usize => {}
            Err(libc::ENOENT) => {}
            other => bail!("a read racing UNREG: {other:?} (wanted {PAGE} bytes or ENOENT)"),
        }
    }
    ktap::diag(format_args!(
        "{ROUNDS} rounds; the read found the registration and lost it to the UNREG in {lost}"
    ));
    ensure!(
        lost > 0,
        "in {ROUNDS} rounds no read's lookup found the registration before the UNREG and lost \
         it: the race never happened"
    );
    drop(node);
    fault::wait_counters_zero("after the races")?;
    fault::wait_vgpu_buffers_gone("after the races: fgds let every buffer go")?;
    ktap::pass()
}

/// `struct fgds_io` for `len` bytes at `offset` of token `idx` and `file_offset` of `file`.
fn io_arg(idx: u64, offset: u64, len: u64, file: &File, file_offset: u64) -> uapi::Io {
    uapi::Io {
        idx,
        offset,
        len,
        file_offset,
        fd: file.as_raw_fd(),
        flags: 0,
    }
}

/// A way to make one call: [`ioctl_io`] or [`command_io`].
type IoFn = fn(&File, bool, &uapi::Io) -> Result<usize, i32>;

/// Why the io_uring cases skip where fgds has no io_uring commands.
const NO_COMMANDS: &str = "EOPNOTSUPP: this kernel's io_uring loses the byte count of a \
                           driver's command (Linux 6.1): fgds offers only the ioctls";

/// Whether fgds takes `FGDS_URING_CMD_READ` here: one of no length gives EINVAL if so,
/// EOPNOTSUPP where not (anything else fails the case).
fn has_commands(node: &File) -> anyhow::Result<bool> {
    let mut ring = IoUring::<Entry128>::builder()
        .build(2)
        .context("io_uring_setup with 128-byte entries")?;
    let sqe = common::io_cmd(node, false, &uapi::Io::default());
    // SAFETY: the command carries its argument inline; it refers to no memory.
    unsafe { ring.submission().push(&sqe) }.context("submission queue full")?;
    ring.submit_and_wait(1)?;
    match ring.completion().next().map(|c| c.result()) {
        Some(res) if res == -libc::EINVAL => Ok(true),
        Some(res) if res == -libc::EOPNOTSUPP => Ok(false),
        res => bail!("FGDS_URING_CMD_READ of no length gave {res:?}, want EINVAL or EOPNOTSUPP"),
    }
}

/// One `FGDS_URING_CMD_READ` (`write` false) or `WRITE` on a ring of its own; the bytes moved
/// or the errno.
fn command_io(node: &File, write: bool, arg: &uapi::Io) -> Result<usize, i32> {
    let Ok(mut ring) = IoUring::<Entry128>::builder().build(2) else {
        return Err(libc::ENOMEM);
    };
    // SAFETY: the command carries its argument inline; it refers to no memory.
    if unsafe { ring.submission().push(&common::io_cmd(node, write, arg)) }.is_err() {
        return Err(libc::EBUSY);
    }
    if let Err(err) = ring.submit_and_wait(1) {
        return Err(err.raw_os_error().unwrap_or(libc::EIO));
    }
    match ring.completion().next().map(|c| c.result()) {
        Some(res) if res >= 0 => Ok(res as usize),
        Some(res) => Err(-res),
        None => Err(libc::EIO),
    }
}

/// Reads the drive into part of a registration and writes another part back, through the
/// ioctls: the data lands where asked and nowhere else, and the registration is never mapped.
fn ioctl_reads_and_writes_with_no_mapping() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, 2 * LEN)?;
    fault::vgpu_fill(bar_off, 2 * LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, 2 * LEN)?;
    let nvme = common::nvme(true)?;
    // Into the second half, at an offset that is not a folio boundary.
    let at = LEN + 64 * 1024;
    let len = LEN - 128 * 1024;
    let n = ioctl_io(&node, false, &io_arg(idx, at, len, &nvme, SCRATCH))
        .map_err(std::io::Error::from_raw_os_error)
        .context("FGDS_IOCTL_READ")?;
    ensure!(
        n == len as usize,
        "FGDS_IOCTL_READ moved {n} of {len} bytes"
    );
    ctl::gpu_check_at(bar_off + at, len, SEED_READ, 0)
        .context("the host's look at GPU memory after FGDS_IOCTL_READ")?;
    ctl::gpu_check(bar_off, LEN, SEED_SENTINEL)
        .context("GPU memory before the read's range was written")?;

    let n = ioctl_io(&node, true, &io_arg(idx, 0, LEN, &nvme, SCRATCH + LEN))
        .map_err(std::io::Error::from_raw_os_error)
        .context("FGDS_IOCTL_WRITE")?;
    ensure!(
        n == LEN as usize,
        "FGDS_IOCTL_WRITE moved {n} of {LEN} bytes"
    );
    let mut back = AlignedBuf::new(LEN as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), SCRATCH + LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_SENTINEL, 0, back.as_slice()) {
        bail!("the drive's byte {at:#x} is not GPU memory's after FGDS_IOCTL_WRITE");
    }
    drop((node, dmabuf));
    fault::wait_counters_zero("the node closed")?;
    ktap::pass()
}

/// A file of an ext4 filesystem (iomap direct I/O) both ways through the ioctls, then a read
/// across the file's end: it comes up short, as `pread` would.
fn ext4_file_both_directions() -> CaseResult {
    fault::require_idle()?;
    let Some(dir) = std::env::var_os("FGDS_EXT4") else {
        return ktap::skip("the rig provides no ext4 filesystem (FGDS_EXT4 unset)");
    };
    const LEN: u64 = 8 * MIB;
    let path = std::path::Path::new(&dir).join("fgds-io.bin");
    let mut ram = AlignedBuf::new(LEN as usize)?;
    pattern::fill(SEED_FILE, 0, ram.as_mut_slice());
    std::fs::write(&path, ram.as_slice())?;
    let file = fgds_tests::guest::open_direct(&path, true)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let n = ioctl_io(&node, false, &io_arg(idx, 0, LEN, &file, 0))
        .map_err(std::io::Error::from_raw_os_error)
        .context("FGDS_IOCTL_READ from the file")?;
    ensure!(
        n == LEN as usize,
        "FGDS_IOCTL_READ moved {n} of {LEN} bytes"
    );
    ctl::gpu_check(bar_off, LEN, SEED_FILE).context("GPU memory after the file's read")?;
    let n = ioctl_io(&node, true, &io_arg(idx, 0, LEN, &file, LEN))
        .map_err(std::io::Error::from_raw_os_error)
        .context("FGDS_IOCTL_WRITE to the file")?;
    ensure!(
        n == LEN as usize,
        "FGDS_IOCTL_WRITE moved {n} of {LEN} bytes"
    );
    file.read_exact_at(ram.as_mut_slice(), LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_FILE, 0, ram.as_slice()) {
        bail!("the file's byte {at:#x} past 8 MiB is not GPU memory's after FGDS_IOCTL_WRITE");
    }
    // Across the file's end (now 16 MiB): the read stops there, and its megabyte lands.
    let n = ioctl_io(&node, false, &io_arg(idx, 0, 2 * MIB, &file, 2 * LEN - MIB))
        .map_err(std::io::Error::from_raw_os_error)
        .context("FGDS_IOCTL_READ across the file's end")?;
    ensure!(
        n == MIB as usize,
        "a 2 MiB read 1 MiB before the file's end moved {n} bytes, want 1 MiB"
    );
    ctl::gpu_check_at(bar_off, MIB, SEED_FILE, LEN - MIB)
        .context("GPU memory after the read across the file's end")?;
    drop((file, node, dmabuf));
    std::fs::remove_file(&path)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// A registration of two runs of BAR2 (vgpu's skewed buffer: the first 2 MiB at BAR offset
/// +4 KiB, the rest from +4 MiB), as a real GPU's memory comes in several: a read and a write
/// across the runs' boundary, by ioctl and, where fgds has them, by io_uring command, each
/// byte at its own place in each run and nothing between the runs touched.
fn two_runs_both_directions() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 8 * MIB;
    // Bytes [AT, AT + SPAN) of the buffer: 1 MiB in the first run, 3 MiB in the second.
    const AT: u64 = MIB;
    const SPAN: u64 = 4 * MIB;
    let mode = std::fs::read_to_string(fault::vgpu_sysfs("mode")?)?;
    if mode.trim() != "plain" {
        return ktap::skip(format!(
            "vgpu in mode {} has no buffers of two runs (VGPU_ALLOC_SKEW needs mode=plain)",
            mode.trim()
        ));
    }
    fault::write_nvme_pattern(SEED_READ, SPAN as usize, SCRATCH)?;
    let node = common::open_node()?;
    let commands = has_commands(&node)?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = fgds::vgpu::alloc_with(&vgpu, LEN, fgds::vgpu::ALLOC_SKEW)?;
    // vgpu took [bar_off, bar_off + LEN + 2 MiB); the buffer's byte x lies at BAR offset
    // bar_off + 4 KiB + x in the first run, bar_off + 2 MiB + x in the second.
    let bar = |x: u64| {
        if x < 2 * MIB {
            bar_off + PAGE + x
        } else {
            bar_off + 2 * MIB + x
        }
    };
    let nvme = common::nvme(true)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let ways: &[(&str, IoFn)] = if commands {
        &[("ioctl", ioctl_io), ("command", command_io)]
    } else {
        &[("ioctl", ioctl_io)]
    };
    for &(how, io) in ways {
        fault::vgpu_fill(bar_off, LEN + 2 * MIB, SEED_SENTINEL)?;
        let n = io(&node, false, &io_arg(idx, AT, SPAN, &nvme, SCRATCH))
            .map_err(std::io::Error::from_raw_os_error)
            .with_context(|| format!("read across the runs by {how}"))?;
        ensure!(
            n == SPAN as usize,
            "{how}: the read moved {n} of {SPAN} bytes"
        );
        ctl::gpu_check_at(bar(AT), 2 * MIB - AT, SEED_READ, 0)
            .with_context(|| format!("{how}: the first run after the read"))?;
        ctl::gpu_check_at(bar(2 * MIB), AT + SPAN - 2 * MIB, SEED_READ, 2 * MIB - AT)
            .with_context(|| format!("{how}: the second run after the read"))?;
        for (from, to, what) in [
            (bar_off, bar(AT), "before the read's range"),
            (bar(2 * MIB - 1) + 1, bar(2 * MIB), "between the runs"),
            (
                bar(AT + SPAN),
                bar_off + LEN + 2 * MIB,
                "after the read's range",
            ),
        ] {
            ctl::gpu_check_at(from, to - from, SEED_SENTINEL, from - bar_off)
                .with_context(|| format!("{how}: BAR2 {what}, which the read must not touch"))?;
        }
        let n = io(&node, true, &io_arg(idx, AT, SPAN, &nvme, SCRATCH + SPAN))
            .map_err(std::io::Error::from_raw_os_error)
            .with_context(|| format!("write across the runs by {how}"))?;
        ensure!(
            n == SPAN as usize,
            "{how}: the write moved {n} of {SPAN} bytes"
        );
        let mut back = AlignedBuf::new(SPAN as usize)?;
        nvme.read_exact_at(back.as_mut_slice(), SCRATCH + SPAN)?;
        if let Some(at) = pattern::first_mismatch(SEED_READ, 0, back.as_slice()) {
            bail!("{how}: the drive's byte {at:#x} is not the registration's after the write");
        }
    }
    common::unreg(&node, idx)?;
    drop((node, dmabuf));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// Sixteen 256 KiB reads, eight in flight on one ring, then the same back to the drive: each
/// lands at its own offset (io_uring runs them in its workers).
fn uring_commands_many_in_flight() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    const PIECE: u64 = 256 * 1024;
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let node = common::open_node()?;
    if !has_commands(&node)? {
        return ktap::skip(NO_COMMANDS);
    }
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let nvme = common::nvme(true)?;
    let mut ring = IoUring::<Entry128>::builder()
        .build(8)
        .context("io_uring_setup with 128-byte entries")?;
    for write in [false, true] {
        let file_base = if write { SCRATCH + LEN } else { SCRATCH };
        let mut next = 0;
        let mut done = 0;
        let mut in_flight = 0;
        while done < LEN / PIECE {
            while in_flight < 8 && next < LEN / PIECE {
                // Pieces in reverse order of the drive's, so a mix-up shows.
                let at = LEN - (next + 1) * PIECE;
                let arg = io_arg(idx, at, PIECE, &nvme, file_base + at);
                let sqe = common::io_cmd(&node, write, &arg).user_data(next);
                // SAFETY: the command carries its argument inline; it refers to no memory.
                unsafe { ring.submission().push(&sqe) }.context("submission queue full")?;
                next += 1;
                in_flight += 1;
            }
            ring.submit_and_wait(1)?;
            for cqe in ring.completion().collect::<Vec<_>>() {
                in_flight -= 1;
                done += 1;
                ensure!(
                    cqe.result() == PIECE as i32,
                    "command {} ({}) gave {}",
                    cqe.user_data(),
                    if write { "write" } else { "read" },
                    cqe.result()
                );
            }
        }
        if !write {
            ctl::gpu_check(bar_off, LEN, SEED_READ).context("GPU memory after the reads")?;
        }
    }
    let mut back = AlignedBuf::new(LEN as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), SCRATCH + LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_READ, 0, back.as_slice()) {
        bail!("the drive's byte {at:#x} is not GPU memory's after the write commands");
    }
    drop((ring, node, dmabuf));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// A read held in flight (a blkdebug breakpoint), by the ioctl or (`by_command`) an io_uring
/// command, while the exporter revokes the registration: the invalidation returns at once, a
/// new call fails with ENODEV at once, the fence signals only after the held read ended
/// although the revocation deadline is shorter, and nothing of it lands once the exporter
/// reuses the memory.
fn held_never_lands_after_revocation(by_command: bool) -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    if by_command && !has_commands(&common::open_node()?)? {
        return ktap::skip(NO_COMMANDS);
    }
    // A deadline shorter than the hold: no timer may give the memory back.
    let _timeout = fault::RevokeTimeout::set(500)?;
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let nvme = common::nvme(false)?;

    let bp = common::Breakpoint::arm(TAG)?;
    let reader = {
        // The drive's fd stays open in this thread until the reader is joined.
        let node = node.try_clone()?;
        let arg = io_arg(idx, 0, LEN, &nvme, SCRATCH);
        std::thread::spawn(move || match by_command {
            true => command_io(&node, false, &arg),
            false => ioctl_io(&node, false, &arg),
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    ensure!(
        !reader.is_finished(),
        "the read was not held by the breakpoint: {:?}",
        fault::join(reader, "read")?
    );
    fault::host_log(if by_command {
        "fgds_io: vgpu revokes a buffer with FGDS_URING_CMD_READ held"
    } else {
        "fgds_io: vgpu revokes a buffer with FGDS_IOCTL_READ held"
    })?;
    let started = Instant::now();
    let revoker = std::thread::spawn(move || common::revoke(bar_off));
    fault::wait_until(
        "the revocation to reach fgds (mmap of the token refused)",
        Duration::from_secs(10),
        || Ok(common::Map::shared(&node, idx, LEN as usize).is_err()),
    )?;
    let late = ioctl_io(&node, false, &io_arg(idx, 0, PAGE, &nvme, SCRATCH));
    ensure!(
        late == Err(libc::ENODEV),
        "FGDS_IOCTL_READ of the revoked registration gave {late:?}, want ENODEV"
    );
    std::thread::sleep(HOLD.saturating_sub(started.elapsed()));
    ensure!(
        !revoker.is_finished(),
        "the exporter's revocation returned while the read was in flight: it got the memory \
         back early ({:?})",
        fault::join(revoker, "revoked")?
    );
    let resumed = started.elapsed();
    bp.resume()?;
    let read = fault::join(reader, "read")?;
    fault::join(revoker, "revoked")?.context("revoke")?;
    fault::check_held_revocation(bar_off, resumed, read)?;
    ensure!(
        read == Ok(LEN as usize),
        "the held read ended with {read:?}, want {LEN} bytes (it started before the revocation)"
    );
    // The exporter reuses the memory: anything of the read landing from now on would show.
    fault::reuse_and_check(bar_off, LEN, SEED_SENTINEL)?;
    drop((node, dmabuf));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// Every documented refusal, through the ioctl and (for the ring's entry size) io_uring.
fn bad_calls_fail_with_their_errno() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let nvme = common::nvme(false)?;
    let buffered = File::open(fgds_tests::guest::nvme_path()?)?;
    let good = io_arg(idx, 0, PAGE, &nvme, SCRATCH);
    let cases: [(&str, bool, uapi::Io, i32); 10] = [
        (
            "flags set",
            false,
            uapi::Io { flags: 1, ..good },
            libc::EINVAL,
        ),
        (
            "token not page aligned",
            false,
            uapi::Io {
                idx: idx + 1,
                ..good
            },
            libc::EINVAL,
        ),
        (
            "no length",
            false,
            uapi::Io { len: 0, ..good },
            libc::EINVAL,
        ),
        (
            "past the end",
            false,
            uapi::Io {
                offset: LEN - PAGE,
                len: 2 * PAGE,
                ..good
            },
            libc::EINVAL,
        ),
        (
            "file without O_DIRECT",
            false,
            io_arg(idx, 0, PAGE, &buffered, SCRATCH),
            libc::EINVAL,
        ),
        (
            "unknown token",
            false,
            uapi::Io {
                idx: idx + (1 << 20) * PAGE,
                ..good
            },
            libc::ENOENT,
        ),
        (
            "no such fd",
            false,
            uapi::Io {
                fd: 1 << 20,
                ..good
            },
            libc::EBADF,
        ),
        ("write to a read-only fd", true, good, libc::EBADF),
        (
            "O_DIRECT-misaligned offset",
            false,
            uapi::Io {
                file_offset: SCRATCH + 1,
                ..good
            },
            libc::EINVAL,
        ),
        (
            "length too large",
            false,
            uapi::Io {
                len: 1 << 31,
                ..good
            },
            libc::EINVAL,
        ),
    ];
    for (what, write, arg, want) in cases {
        let got = ioctl_io(&node, write, &arg);
        ensure!(
            got == Err(want),
            "{what}: gave {got:?}, want {}",
            std::io::Error::from_raw_os_error(want)
        );
    }
    // A ring of 64-byte entries cannot carry the command (where fgds has commands).
    let want = match has_commands(&node)? {
        true => -libc::EINVAL,
        false => -libc::EOPNOTSUPP,
    };
    let mut narrow = IoUring::new(2).context("io_uring_setup")?;
    let sqe = opcode::UringCmd16::new(types::Fd(node.as_raw_fd()), uapi::URING_CMD_READ).build();
    // SAFETY: the command refers to no memory.
    unsafe { narrow.submission().push(&sqe) }.context("submission queue full")?;
    narrow.submit_and_wait(1)?;
    let res = narrow.completion().next().map(|c| c.result());
    ensure!(
        res == Some(want),
        "FGDS_URING_CMD_READ on a ring of 64-byte entries gave {res:?}, want {want}"
    );

    // A read-only dma-buf's registration can be written from, never read into.
    let (ro, ro_off) = fgds::vgpu::alloc_with(&vgpu, LEN, fgds::vgpu::ALLOC_RDONLY)?;
    fault::vgpu_fill(ro_off, LEN, SEED_SENTINEL)?;
    let ro_idx = common::reg(&node, ro.as_fd(), 0, LEN)?;
    let rw_nvme = common::nvme(true)?;
    let into = ioctl_io(
        &node,
        false,
        &io_arg(ro_idx, 0, LEN, &rw_nvme, SCRATCH + 4 * MIB),
    );
    ensure!(
        into == Err(libc::EACCES),
        "a read into the read-only registration gave {into:?}, want EACCES"
    );
    let from = ioctl_io(
        &node,
        true,
        &io_arg(ro_idx, 0, LEN, &rw_nvme, SCRATCH + 4 * MIB),
    );
    ensure!(from == Ok(LEN as usize), "a write from it gave {from:?}");
    ctl::gpu_check(ro_off, LEN, SEED_SENTINEL).context("the read-only buffer's memory")?;
    drop((narrow, node, dmabuf, ro));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// The crate's `Transfer` (the CLI's and Python's path) takes fgds's commands, and the data
/// arrives both ways; so do the buffer's synchronous `read_from` and `write_to`.
fn crate_transfer_takes_the_commands() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    if !has_commands(&common::open_node()?)? {
        return ktap::skip(NO_COMMANDS);
    }
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let gpu = fgds::Gpu::open(&common::vgpu_bdf()?)?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    let buffer = gpu.register(dmabuf.as_fd(), 0, LEN)?;
    let file = common::nvme(true)?;
    let mut transfer = fgds::Transfer::new(fgds::TransferConfig {
        chunk_size: 512 * 1024,
        queue_depth: 4,
    })?;
    let n = transfer.run(
        fgds::Direction::Read,
        &buffer,
        0..LEN as usize,
        &file,
        SCRATCH,
    )?;
    ensure!(n == LEN as usize, "the read moved {n} bytes");
    let path = transfer.last_run_path();
    ktap::diag(format_args!("the crate's Transfer took {path:?}"));
    ensure!(
        path == Some(fgds::TransferPath::Command),
        "the read went {path:?}: through the mapping, pinning GPU memory per request"
    );
    ctl::gpu_check(bar_off, LEN, SEED_READ).context("GPU memory after the read")?;
    let n = transfer.run(
        fgds::Direction::Write,
        &buffer,
        0..LEN as usize,
        &file,
        SCRATCH + LEN,
    )?;
    ensure!(n == LEN as usize, "the write moved {n} bytes");
    let mut back = AlignedBuf::new(LEN as usize)?;
    file.read_exact_at(back.as_mut_slice(), SCRATCH + LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_READ, 0, back.as_slice()) {
        bail!("the drive's byte {at:#x} differs after the crate's write");
    }
    // The synchronous calls of the crate's buffer, too, on data neither side held before: the
    // GPU's half a sentinel, the drive's another pattern; half the buffer each way, at an
    // offset, so that a call that moves the wrong range or nothing shows.
    let half = LEN as usize / 2;
    fault::write_nvme_pattern(SEED_FILE, half, SCRATCH)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let n = buffer.read_from(&file, SCRATCH, half..LEN as usize)?;
    ensure!(n == half, "Buffer::read_from moved {n} of {half} bytes");
    ctl::gpu_check_at(bar_off + half as u64, half as u64, SEED_FILE, 0)
        .context("GPU memory after Buffer::read_from")?;
    ctl::gpu_check(bar_off, half as u64, SEED_SENTINEL)
        .context("GPU memory before the range Buffer::read_from was given")?;
    let n = buffer.write_to(&file, SCRATCH + LEN, half..LEN as usize)?;
    ensure!(n == half, "Buffer::write_to moved {n} of {half} bytes");
    let mut back = AlignedBuf::new(half)?;
    file.read_exact_at(back.as_mut_slice(), SCRATCH + LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_FILE, 0, back.as_slice()) {
        bail!("the drive's byte {at:#x} differs after Buffer::write_to");
    }
    drop((transfer, buffer, gpu, dmabuf));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}
