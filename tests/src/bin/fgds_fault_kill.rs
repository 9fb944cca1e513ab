//! Issue 7 (f): SIGKILL of a process with 32 io_uring reads in flight into GPU memory. The
//! process registered the buffer, closed its dma-buf fd (fgds holds the only reference) and
//! keeps 32 reads of 2 MiB in flight from the NVMe into it; it is killed in the middle. Then
//! every resource goes back: fgds's sysfs `buffers` and `bytes` return to 0, the exporter gets
//! its dma-buf back (vgpu lists no live buffer), nothing holds the module (`refcnt` 0), and the
//! node works. The host fails the case on any kernel splat.

use fgds_tests::common;
use fgds_tests::fault;

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fault::{Child, SharedCounter};
use fgds_tests::ktap::{self, Case, CaseResult};
use io_uring::{IoUring, opcode, types};

/// Reads in flight.
const DEPTH: usize = 32;
/// Bytes per read.
const CHUNK: usize = 2 << 20;
/// The buffer: one chunk per read, over the NVMe pattern (the first 64 MiB).
const LEN: usize = DEPTH * CHUNK;

/// Shared counter slots.
const DONE: usize = 0;
const ERRORS: usize = 1;
const FIRST_ERRNO: usize = 2;

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "sigkill_with_32_io_uring_reads_in_flight",
            run: sigkill_case,
        },
        Case {
            name: "close_under_io_then_exporter_unbind",
            run: close_under_io_then_unbind,
        },
    ])
}

/// The child: registers, maps, and keeps DEPTH reads in flight until it is killed.
fn reader(parent: &mut fault::Parent, counts: &SharedCounter) -> anyhow::Result<()> {
    let node = common::open_node()?;
    let map = {
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, LEN as u64)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN as u64)?;
        Map::shared(&node, idx, LEN)?
        // The dma-buf and vgpu fds close here: the registration holds the dma-buf.
    };
    let nvme = common::nvme(false)?;
    let mut ring = IoUring::new(DEPTH as u32)?;
    let fd = types::Fd(nvme.as_raw_fd());
    let push = |ring: &mut IoUring, i: usize| -> anyhow::Result<()> {
        // SAFETY: chunk i lies inside the mapping.
        let ptr = unsafe { map.ptr.add(i * CHUNK) };
        let off = (i * CHUNK) as u64;
        let sqe = opcode::Read::new(fd, ptr, CHUNK as u32)
            .offset(off)
            .build()
            .user_data(i as u64);
        // SAFETY: the mapping and the NVMe fd outlive every request (the process dies with
        // them in flight, which is the point).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| anyhow::anyhow!("SQ full"))
    };
    for i in 0..DEPTH {
        push(&mut ring, i)?;
    }
    ring.submit()?;
    parent.ready("reading");
    loop {
        ring.submit_and_wait(1)?;
        let cqes = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect::<Vec<_>>();
        for (i, res) in cqes {
            if res < 0 {
                if counts.get(ERRORS).fetch_add(1, Ordering::SeqCst) == 0 {
                    counts
                        .get(FIRST_ERRNO)
                        .store((-res) as u64, Ordering::SeqCst);
                }
            } else {
                counts.get(DONE).fetch_add(1, Ordering::SeqCst);
            }
            push(&mut ring, i)?;
        }
        ring.submit()?;
    }
}

fn revoke_timeout_ms() -> anyhow::Result<u64> {
    let path = "/sys/module/fgds/parameters/revoke_timeout_ms";
    let s = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    Ok(s.trim().parse()?)
}

fn module_refcnt() -> anyhow::Result<u64> {
    let s = std::fs::read_to_string("/sys/module/fgds/refcnt")
        .context("cannot read /sys/module/fgds/refcnt")?;
    Ok(s.trim().parse()?)
}

fn sigkill_case() -> CaseResult {
    fault::require_idle()?;
    fault::wait_vgpu_buffers_gone("before the case")?;
    let refcnt = module_refcnt()?;
    let counts = SharedCounter::new()?;
    let mut child = Child::spawn(|parent| reader(parent, &counts))?;
    let ready = child.wait_ready(Duration::from_secs(60));
    let ready = match ready {
        Ok(r) => r,
        Err(e) => {
            child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    ensure!(ready == "reading", "the child said {ready:?}");
    // Let the reads run: at least two full rounds, so that every slot has been resubmitted.
    let started = Instant::now();
    let steady = fault::wait_until(
        "the child's reads to complete two rounds",
        Duration::from_secs(120),
        || Ok(counts.get(DONE).load(Ordering::SeqCst) >= 2 * DEPTH as u64),
    );
    let before = fault::counters();
    fault::host_log(&format!(
        "fgds_fault_kill: SIGKILL pid {} with {DEPTH} io_uring reads in flight",
        child.pid
    ))?;
    let kill_at = Instant::now();
    child.kill();
    let status = child.wait()?;
    let reaped = Instant::now();
    let exit_took = reaped - kill_at;
    steady?;
    let done = counts.get(DONE).load(Ordering::SeqCst);
    let errors = counts.get(ERRORS).load(Ordering::SeqCst);
    ktap::diag(format_args!(
        "{done} reads completed in {:?} before the kill, {errors} failed; exit took {exit_took:?}",
        kill_at - started
    ));
    ensure!(
        status == 128 + libc::SIGKILL,
        "the child ended with status {status}, not by the kill"
    );
    // Its exit waits for nothing but its own I/O, never for fgds's revocation timeout.
    let limit = Duration::from_millis(revoke_timeout_ms()? / 2);
    ensure!(
        exit_took < limit,
        "the killed process took {exit_took:?} to exit (limit {limit:?}, half of fgds's \
         revoke_timeout_ms): its exit waited for its own pins"
    );
    if errors != 0 {
        bail!(
            "{errors} reads failed before the kill, the first with errno {}",
            counts.get(FIRST_ERRNO).load(Ordering::SeqCst)
        );
    }
    ensure!(
        before? == (1, LEN as u64),
        "before the kill fgds counted {:?}, want 1 buffer of {LEN} bytes",
        fault::counters()?
    );
    let took = fault::wait_counters_zero("after the kill")?;
    fault::wait_vgpu_buffers_gone("after the kill")?;
    fault::wait_until(
        "fgds's module reference count to return",
        Duration::from_secs(20),
        || Ok(module_refcnt()? == refcnt),
    )?;
    ktap::diag(format_args!(
        "counters back to 0 within {took:?} of reaping the child; all released {:?} after it",
        reaped.elapsed()
    ));
    fault::data_check(4 * MIB, 20 * MIB).context("the node after the kill")?;
    fault::wait_counters_zero("after the check")?;
    ktap::pass()
}

/// The pin count vgpu reports for its buffer at `bar_off`.
fn vgpu_pins(bar_off: u64) -> anyhow::Result<Option<u32>> {
    Ok(fault::vgpu_buffers()?
        .into_iter()
        .find(|b| b.0 == bar_off)
        .map(|b| b.2))
}

/// The blkdebug breakpoint tag.
const TAG: &str = "fgds_fault_kill";

/// A registration released (munmap, close) while a read still pins its pages stays behind
/// holding the dma-buf pinned; the exporter's driver then unbinds, which revokes it: fgds
/// waits for the read, gives the dma-buf back, and everything is released and works after a
/// rebind.
fn close_under_io_then_unbind() -> CaseResult {
    fault::require_idle()?;
    let bdf = common::vgpu_bdf()?;
    let drv = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bdf}/driver"))
        .context("vgpu driver link")?;
    let len = 64 * MIB;
    let node = common::open_node()?;
    let (idx, bar_off) = {
        let vgpu = common::vgpu()?;
        let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
        (common::reg(&node, dmabuf.as_fd(), 0, len)?, bar_off)
    };
    let map = Map::shared(&node, idx, len as usize)?;
    // 16 io_uring reads of 4 MiB: all their pages are pinned when submit returns.
    let nvme = common::nvme(false)?;
    let mut ring = IoUring::new(16)?;
    let chunk = len as usize / 16;
    for i in 0..16 {
        // SAFETY: chunk i lies inside the mapping.
        let ptr = unsafe { map.ptr.add(i * chunk) };
        let sqe = opcode::Read::new(types::Fd(nvme.as_raw_fd()), ptr, chunk as u32)
            .offset((i * chunk) as u64)
            .build()
            .user_data(i as u64);
        // SAFETY: the pages stay pinned by the requests, the NVMe fd outlives them (waited for
        // below).
        unsafe { ring.submission().push(&sqe) }.map_err(|_| anyhow::anyhow!("SQ full"))?;
    }
    // QEMU suspends the first read that reaches the drive (a blkdebug breakpoint), so one
    // request stays in flight, its pages pinned, for as long as the test wants.
    common::qemu_io(&format!("break read_aio {TAG}"))?;
    let result = (|| -> anyhow::Result<()> {
        ring.submit()?;
        fault::wait_until(
            "15 of the 16 reads to complete (one is held by QEMU)",
            Duration::from_secs(30),
            || Ok(ring.completion().len() >= 15),
        )?;
        drop(map);
        drop(node);
        let pinned = vgpu_pins(bar_off)?.unwrap_or(0);
        let counted = fault::counters()?;
        ktap::diag(format_args!(
            "after close: {} of 16 reads done, vgpu pins {pinned}, fgds counts {counted:?}",
            ring.completion().len()
        ));
        ensure!(
            counted == (0, 0),
            "fgds still counts {counted:?} after munmap and close"
        );
        ensure!(
            pinned > 0,
            "fgds gave the dma-buf back (vgpu pins 0) while a read still pinned its pages"
        );
        fault::host_log("fgds_fault_kill: unbind vgpu with a released buffer pinned by a read")?;
        let (bdf2, drv2) = (bdf.clone(), drv.clone());
        let unbind = std::thread::spawn(move || std::fs::write(drv2.join("unbind"), bdf2));
        std::thread::sleep(Duration::from_millis(500));
        let waited_for_io = !unbind.is_finished();
        common::qemu_io(&format!("resume {TAG}"))?;
        let unbound = unbind
            .join()
            .map_err(|_| anyhow::anyhow!("unbind thread panicked"))?;
        let rebound = std::fs::write(drv.join("bind"), &bdf).context("rebind vgpu");
        unbound.context("unbind vgpu")?;
        rebound?;
        ensure!(
            waited_for_io,
            "the unbind returned while a read still pinned the pages"
        );
        ring.submit_and_wait(16)?;
        let results = ring.completion().map(|c| c.result()).collect::<Vec<_>>();
        // The reads completed into the pages they pinned before the mapping went.
        ensure!(
            results.len() == 16 && results.iter().all(|&r| r == chunk as i32),
            "read results {results:?}"
        );
        Ok(())
    })();
    // One-shot: gone once it fired; removed here if it never did.
    let _ = common::qemu_io(&format!("remove_break {TAG}"));
    let _ = common::qemu_io(&format!("resume {TAG}"));
    result?;
    fault::wait_until(
        "vgpu and the node after rebind",
        Duration::from_secs(20),
        || Ok(common::node_path().is_ok() && common::vgpu_name().is_ok()),
    )?;
    fault::wait_counters_zero("after the rebind")?;
    fault::data_check(4 * MIB, 36 * MIB).context("after the rebind")?;
    fault::wait_counters_zero("after the check")?;
    ktap::pass()
}
