//! Registrations as io_uring fixed buffers (`FGDS_URING_CMD_REGISTER`), where the kernel can
//! revoke an io_uring kernel buffer (vm-images/kernel-patches/io-uring-revocable-kbuf): reads
//! and writes through a slot move the data with no mapping and no pin; a revocation makes new
//! requests on the slot fail at once, its fence waits for those in flight and for nothing else
//! (not for the ring's user to empty the slot), and nothing of a held request lands after it.
//! Elsewhere every case skips with the kernel's EOPNOTSUPP.

#[path = "../fgds_common.rs"]
mod common;
#[path = "../fgds_fault_common.rs"]
mod fault;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, PAGE};
use fgds::uapi;
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};
use io_uring::{IoUring, opcode, types};

/// NVMe scratch area of this program: reads come from here, writes go 4 MiB further.
const SCRATCH: u64 = 224 * MIB;
const SEED_SENTINEL: u64 = 0x5552_494e;
const SEED_READ: u64 = 0x5552_5244;
const SEED_AGAIN: u64 = 0x5552_4147;
/// How long the held-read case keeps its read held.
const HOLD: Duration = Duration::from_secs(2);
/// Why every case skips on a kernel without the commands.
const UNSUPPORTED: &str = "EOPNOTSUPP: this kernel cannot revoke io_uring kernel buffers (the \
                           kernel change io-uring-revocable-kbuf)";
/// The blkdebug breakpoint tag.
const TAG: &str = "fgds_uring";

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "slot_reads_and_writes_with_no_mapping",
            run: slot_reads_and_writes_with_no_mapping,
        },
        Case {
            name: "held_slot_read_never_lands_after_revocation",
            run: held_slot_read_never_lands_after_revocation,
        },
        Case {
            name: "idle_slot_revocation_needs_no_ring",
            run: idle_slot_revocation_needs_no_ring,
        },
        Case {
            name: "bad_commands_fail_with_their_errno",
            run: bad_commands_fail_with_their_errno,
        },
        Case {
            name: "readonly_dmabuf_slot_is_write_only",
            run: readonly_dmabuf_slot_is_write_only,
        },
        Case {
            name: "crate_transfer_goes_through_a_slot",
            run: crate_transfer_goes_through_a_slot,
        },
    ])
}

/// A ring with a sparse fixed-buffer table of `slots` slots.
fn new_ring(slots: u32) -> anyhow::Result<IoUring> {
    let ring = IoUring::new(8).context("io_uring_setup")?;
    if slots > 0 {
        ring.submitter()
            .register_buffers_sparse(slots)
            .context("IORING_REGISTER_BUFFERS2 (sparse)")?;
    }
    Ok(ring)
}

/// Issues one fgds command on an idle ring; returns its CQE's result.
fn uring_cmd(ring: &mut IoUring, node: &File, op: u32, arg: uapi::UringBuffer) -> i32 {
    let sqe = opcode::UringCmd16::new(types::Fd(node.as_raw_fd()), op)
        .cmd(arg.to_cmd())
        .build();
    // SAFETY: the command carries its argument inline and refers to no memory.
    if unsafe { ring.submission().push(&sqe) }.is_err() {
        return -libc::EBUSY;
    }
    match ring.submit_and_wait(1) {
        Ok(_) => ring.completion().next().map_or(-libc::EIO, |c| c.result()),
        Err(err) => -err.raw_os_error().unwrap_or(libc::EIO),
    }
}

fn register(ring: &mut IoUring, node: &File, idx: u64, slot: u32) -> i32 {
    let arg = uapi::UringBuffer {
        idx,
        index: slot,
        flags: 0,
    };
    uring_cmd(ring, node, uapi::URING_CMD_REGISTER, arg)
}

/// Registers token `idx` into slot 0 of a new ring; `Ok(None)` means this kernel cannot (the
/// case skips, with the reason).
fn ring_with_slot(node: &File, idx: u64) -> anyhow::Result<Result<IoUring, String>> {
    let mut ring = new_ring(1)?;
    match register(&mut ring, node, idx, 0) {
        0 => Ok(Ok(ring)),
        res if res == -libc::EOPNOTSUPP => Ok(Err(UNSUPPORTED.to_owned())),
        res => bail!(
            "FGDS_URING_CMD_REGISTER failed: {}",
            std::io::Error::from_raw_os_error(-res)
        ),
    }
}

/// One READ_FIXED (`write` false) or WRITE_FIXED of `len` bytes at byte `buf_off` of slot 0
/// and `nvme_off` of the drive, on an idle ring; returns the CQE's result.
fn fixed_io(
    ring: &mut IoUring,
    nvme: &File,
    write: bool,
    buf_off: u64,
    len: u32,
    nvme_off: u64,
) -> i32 {
    let fd = types::Fd(nvme.as_raw_fd());
    // A slot made by fgds is addressed by offset from the registration's start.
    let addr = buf_off as *mut u8;
    let sqe = if write {
        opcode::WriteFixed::new(fd, addr, len, 0)
            .offset(nvme_off)
            .build()
    } else {
        opcode::ReadFixed::new(fd, addr, len, 0)
            .offset(nvme_off)
            .build()
    };
    // SAFETY: the address is an offset into the kernel's buffer, not memory of ours.
    if unsafe { ring.submission().push(&sqe) }.is_err() {
        return -libc::EBUSY;
    }
    match ring.submit_and_wait(1) {
        Ok(_) => ring.completion().next().map_or(-libc::EIO, |c| c.result()),
        Err(err) => -err.raw_os_error().unwrap_or(libc::EIO),
    }
}

/// A 4 MiB read from the drive into slot 0 of a new ring lands in GPU memory, and a write from
/// the slot puts GPU memory on the drive: the registration is never mapped.
fn slot_reads_and_writes_with_no_mapping() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, 2 * LEN)?;
    fault::vgpu_fill(bar_off, 2 * LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, 2 * LEN)?;
    let mut ring = match ring_with_slot(&node, idx)? {
        Ok(ring) => ring,
        Err(reason) => return ktap::skip(reason),
    };
    let nvme = common::nvme(true)?;
    // Into the second half, at an offset that is not a folio boundary.
    let at = LEN + 64 * 1024;
    let res = fixed_io(
        &mut ring,
        &nvme,
        false,
        at,
        (LEN - 128 * 1024) as u32,
        SCRATCH,
    );
    ensure!(
        res == (LEN - 128 * 1024) as i32,
        "READ_FIXED into the slot gave {res}"
    );
    ctl::gpu_check_at(bar_off + at, LEN - 128 * 1024, SEED_READ, 0)
        .context("the host's look at GPU memory after the read through the slot")?;
    ctl::gpu_check(bar_off, LEN, SEED_SENTINEL)
        .context("GPU memory before the read's range was written")?;

    let res = fixed_io(&mut ring, &nvme, true, 0, LEN as u32, SCRATCH + LEN);
    ensure!(res == LEN as i32, "WRITE_FIXED from the slot gave {res}");
    let mut back = AlignedBuf::new(LEN as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), SCRATCH + LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_SENTINEL, 0, back.as_slice()) {
        bail!("the drive's byte {at:#x} is not GPU memory's after the write from the slot");
    }
    // Past the registration's end: refused before any I/O.
    let res = fixed_io(
        &mut ring,
        &nvme,
        false,
        2 * LEN - PAGE,
        2 * PAGE as u32,
        SCRATCH,
    );
    ensure!(
        res == -libc::EFAULT,
        "a read past the registration's end gave {res}, want EFAULT"
    );
    drop(ring);
    drop(node);
    drop(dmabuf);
    fault::wait_counters_zero("the ring and the node closed")?;
    ktap::pass()
}

/// A read through a slot held in flight while the exporter revokes the registration: the
/// invalidation returns while the read is held, a new request on the slot fails with EFAULT at
/// once, the fence signals only after the held read ended, and nothing of it lands once the
/// exporter reuses the memory. The slot is never emptied: the revocation needs no ring.
fn held_slot_read_never_lands_after_revocation() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    // A deadline shorter than the hold: no timer may give the memory back.
    let _timeout = fault::RevokeTimeout::set(500)?;
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let ring = match ring_with_slot(&node, idx)? {
        Ok(ring) => ring,
        Err(reason) => return ktap::skip(reason),
    };
    let nvme = common::nvme(false)?;

    let bp = common::Breakpoint::arm(TAG)?;
    let reader = {
        let nvme = nvme.try_clone()?;
        let mut ring = ring;
        std::thread::spawn(move || {
            let res = fixed_io(&mut ring, &nvme, false, 0, LEN as u32, SCRATCH);
            (res, ring)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    ensure!(
        !reader.is_finished(),
        "the read was not held by the breakpoint: {:?}",
        fault::join(reader, "read")?.0
    );
    fault::host_log("fgds_uring: vgpu revokes a buffer with a read through a slot held")?;
    let started = Instant::now();
    let revoker = std::thread::spawn(move || common::revoke(bar_off));
    // A new request on the same registration, through a second ring's slot made before the
    // revocation, fails at once (a second slot of the same registration).
    fault::wait_until(
        "the revocation to reach fgds (mmap of the token refused)",
        Duration::from_secs(10),
        || Ok(common::Map::shared(&node, idx, LEN as usize).is_err()),
    )?;
    let mut other = new_ring(1)?;
    let res = register(&mut other, &node, idx, 0);
    ensure!(
        res == -libc::ENODEV,
        "FGDS_URING_CMD_REGISTER of the revoked registration gave {res}, want ENODEV"
    );
    std::thread::sleep(HOLD.saturating_sub(started.elapsed()));
    ensure!(
        !revoker.is_finished(),
        "the exporter's revocation returned while a read through the slot was in flight: it got \
         the memory back early ({:?})",
        fault::join(revoker, "revoked")?
    );
    let resumed = started.elapsed();
    bp.resume()?;
    let (read, mut ring) = fault::join(reader, "read")?;
    fault::join(revoker, "revoked")?.context("revoke")?;
    fault::check_held_revocation(bar_off, resumed, read)?;
    ensure!(
        read == LEN as i32,
        "the held read ended with {read}, want {LEN} bytes (it took the slot before the \
         revocation)"
    );
    let late = fixed_io(&mut ring, &nvme, false, 0, PAGE as u32, SCRATCH);
    ensure!(
        late == -libc::EFAULT,
        "a read through the slot of the revoked registration gave {late}, want EFAULT"
    );

    // The exporter reuses the memory: anything of the read landing from now on would show.
    fault::reuse_and_check(bar_off, LEN, SEED_SENTINEL)?;
    drop(ring);
    drop(other);
    drop(node);
    drop(dmabuf);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// A revocation of a registration whose slot is idle ends without the ring's user doing
/// anything: the slot stays in the ring, requests on it fail with EFAULT, and the slot keeps
/// only the registration's bookkeeping until the ring goes.
fn idle_slot_revocation_needs_no_ring() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let mut ring = match ring_with_slot(&node, idx)? {
        Ok(ring) => ring,
        Err(reason) => return ktap::skip(reason),
    };
    let nvme = common::nvme(false)?;
    ensure!(
        fixed_io(&mut ring, &nvme, false, 0, PAGE as u32, SCRATCH) == PAGE as i32,
        "a read through the slot failed before the revocation"
    );
    let started = Instant::now();
    common::revoke(bar_off)?;
    let took = started.elapsed();
    let (_, invalidate, fences) = fault::last_revoke()?;
    ktap::diag(format_args!(
        "revocation with an idle slot: {took:?} (invalidation {invalidate:?}, fences {fences:?})"
    ));
    ensure!(
        took < Duration::from_secs(5),
        "the revocation of a registration with an idle slot took {took:?}: it waited for the ring"
    );
    let late = fixed_io(&mut ring, &nvme, false, 0, PAGE as u32, SCRATCH);
    ensure!(
        late == -libc::EFAULT,
        "a read through the slot after the revocation gave {late}, want EFAULT"
    );
    common::unreg(&node, idx)?;
    drop(node);
    drop(dmabuf);
    // The slot still holds the registration's bookkeeping (not its memory: vgpu got it back).
    let (buffers, _) = fault::counters()?;
    ensure!(
        buffers == 1,
        "fgds counts {buffers} registrations while a ring's slot holds the revoked one, want 1"
    );
    drop(ring);
    fault::wait_counters_zero("the ring closed")?;
    ktap::pass()
}

/// Each documented error of the commands, with its errno.
fn bad_commands_fail_with_their_errno() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let mut ring = match ring_with_slot(&node, idx)? {
        Ok(ring) => ring,
        Err(reason) => return ktap::skip(reason),
    };
    let reg = uapi::URING_CMD_REGISTER;
    let unreg = uapi::URING_CMD_UNREGISTER;
    let arg = |idx: u64, index: u32, flags: u32| uapi::UringBuffer { idx, index, flags };
    let mut fresh = new_ring(4)?;
    let mut tableless = new_ring(0)?;
    let checks: [(&str, i32, i32); 11] = [
        (
            "flags not 0",
            uring_cmd(&mut fresh, &node, reg, arg(idx, 1, 1)),
            libc::EINVAL,
        ),
        (
            "token not page aligned",
            uring_cmd(&mut fresh, &node, reg, arg(idx + 1, 1, 0)),
            libc::EINVAL,
        ),
        (
            "no such token",
            uring_cmd(&mut fresh, &node, reg, arg(idx + 64 * PAGE, 1, 0)),
            libc::ENOENT,
        ),
        (
            "slot outside the table",
            uring_cmd(&mut fresh, &node, reg, arg(idx, 4, 0)),
            libc::EINVAL,
        ),
        (
            "a ring without a table",
            uring_cmd(&mut tableless, &node, reg, arg(idx, 0, 0)),
            libc::EINVAL,
        ),
        (
            "slot in use",
            uring_cmd(&mut ring, &node, reg, arg(idx, 0, 0)),
            libc::EBUSY,
        ),
        (
            "unregister of an empty slot",
            uring_cmd(&mut fresh, &node, unreg, arg(0, 2, 0)),
            libc::EINVAL,
        ),
        (
            "unregister with a token",
            uring_cmd(&mut ring, &node, unreg, arg(idx, 0, 0)),
            libc::EINVAL,
        ),
        (
            "unknown command",
            uring_cmd(&mut fresh, &node, unreg + 1, arg(0, 0, 0)),
            libc::ENOTTY,
        ),
        (
            "unregister",
            uring_cmd(&mut ring, &node, unreg, arg(0, 0, 0)),
            0,
        ),
        (
            "register again",
            uring_cmd(&mut ring, &node, reg, arg(idx, 0, 0)),
            0,
        ),
    ];
    for (what, got, want) in checks {
        ensure!(
            got == -want,
            "{what}: the command gave {got}, want {}",
            if want == 0 {
                "0".to_owned()
            } else {
                std::io::Error::from_raw_os_error(want).to_string()
            }
        );
    }
    drop((ring, fresh, tableless, node, dmabuf));
    fault::wait_counters_zero("the rings and the node closed")?;
    ktap::pass()
}

/// A registration of a dma-buf opened read-only can be written from through a slot, never read
/// into.
fn readonly_dmabuf_slot_is_write_only() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = fgds::vgpu::alloc_with(&vgpu, LEN, fgds::vgpu::ALLOC_RDONLY)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let mut ring = match ring_with_slot(&node, idx)? {
        Ok(ring) => ring,
        Err(reason) => return ktap::skip(reason),
    };
    let nvme = common::nvme(true)?;
    let into = fixed_io(&mut ring, &nvme, false, 0, LEN as u32, SCRATCH + 4 * MIB);
    ensure!(
        into == -libc::EFAULT,
        "a read into the read-only registration's slot gave {into}, want EFAULT"
    );
    let from = fixed_io(&mut ring, &nvme, true, 0, LEN as u32, SCRATCH + 4 * MIB);
    ensure!(from == LEN as i32, "a write from the slot gave {from}");
    let mut back = AlignedBuf::new(LEN as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), SCRATCH + 4 * MIB)?;
    ensure!(
        pattern::first_mismatch(SEED_SENTINEL, 0, back.as_slice()).is_none(),
        "the drive did not get the GPU memory's data"
    );
    ktap::pass()
}

/// The crate's `Transfer` (the CLI's and Python's path) reads through its ring's slot where
/// the kernel has the commands, and the data arrives.
fn crate_transfer_goes_through_a_slot() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    const OTHER_LEN: u64 = 2 * MIB;
    // Whether the kernel has the commands: a token no file has gives ENOENT if so.
    let mut probe = new_ring(1)?;
    match register(
        &mut probe,
        &common::open_node()?,
        (u64::from(u32::MAX) + 1) << 12,
        0,
    ) {
        res if res == -libc::ENOENT => {}
        res if res == -libc::EOPNOTSUPP => return ktap::skip(UNSUPPORTED),
        res => bail!("FGDS_URING_CMD_REGISTER of an unknown token gave {res}, want ENOENT"),
    }
    drop(probe);
    let gpu = fgds::Gpu::open(&common::vgpu_bdf()?)?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    let buffer = gpu.register(dmabuf.as_fd(), 0, LEN)?;
    let file = common::nvme(false)?;
    let mut transfer = fgds::Transfer::new(fgds::TransferConfig::DEFAULT)?;
    // Two runs on the same buffer: the slot keeps it in between.
    for (run, seed) in [(1, SEED_READ), (2, SEED_AGAIN)] {
        fault::write_nvme_pattern(seed, LEN as usize, SCRATCH)?;
        let n = transfer.run(
            fgds::Direction::Read,
            &buffer,
            0..LEN as usize,
            &file,
            SCRATCH,
        )?;
        ensure!(n == LEN as usize, "run {run} moved {n} bytes");
        ensure!(
            transfer.last_run_in_slot(),
            "run {run} read through the mapping, not through its ring's slot"
        );
        ctl::gpu_check(bar_off, LEN, seed)
            .with_context(|| format!("GPU memory after run {run}"))?;
        ensure!(
            slots_of_len(LEN)? == 1,
            "after run {run} no ring's slot holds the {LEN}-byte buffer: the transfer emptied it"
        );
    }
    // Another buffer takes the slot; dropping it empties the slot while the transfer lives.
    let (other_dmabuf, other_off) = common::alloc(&vgpu, OTHER_LEN)?;
    let other = gpu.register(other_dmabuf.as_fd(), 0, OTHER_LEN)?;
    transfer.run(
        fgds::Direction::Read,
        &other,
        0..OTHER_LEN as usize,
        &file,
        SCRATCH,
    )?;
    ctl::gpu_check(other_off, OTHER_LEN, SEED_AGAIN).context("the other buffer's GPU memory")?;
    let held = (slots_of_len(LEN)?, slots_of_len(OTHER_LEN)?);
    ensure!(
        held == (0, 1),
        "slots holding the first and the second buffer after the second's run: {held:?}, want \
         (0, 1)"
    );
    drop(other);
    let left = slots_of_len(OTHER_LEN)?;
    ensure!(
        left == 0,
        "{left} slot(s) still hold the dropped buffer: dropping a Buffer must empty the slots \
         that hold it"
    );
    drop((transfer, buffer, gpu, dmabuf, other_dmabuf));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// How many slots of this process's io_uring instances hold a kernel buffer of `len` bytes,
/// from `/proc/self/fdinfo` (io_uring lists its table as `<slot>: 0x<addr>/<len>`, empty slots
/// as `<none>`).
fn slots_of_len(len: u64) -> anyhow::Result<usize> {
    let want = format!(": 0x0/{len}");
    let mut n = 0;
    for entry in std::fs::read_dir("/proc/self/fdinfo").context("/proc/self/fdinfo")? {
        let Ok(info) = std::fs::read_to_string(entry?.path()) else {
            continue; // closed since the listing
        };
        let Some(table) = info.split("UserBufs:").nth(1) else {
            continue;
        };
        n += table
            .lines()
            .skip(1)
            .take_while(|l| l.starts_with(' '))
            .filter(|l| l.trim_end().ends_with(&want))
            .count();
    }
    Ok(n)
}
