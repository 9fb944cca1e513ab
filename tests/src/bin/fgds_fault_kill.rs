//! Issue 7 (f): SIGKILL of a process with 32 io_uring reads in flight into GPU memory. The
//! process registered the buffer, closed its dma-buf fd (fgds holds the only reference) and
//! keeps 32 reads of 2 MiB in flight from the NVMe into it; it is killed in the middle. Then
//! every resource goes back: fgds's sysfs `buffers` and `bytes` return to 0, the exporter gets
//! its dma-buf back (vgpu lists no live buffer), nothing holds the module (`refcnt` 0), and the
//! node works. The host fails the case on any kernel splat.

#[path = "../fgds_common.rs"]
mod common;
#[path = "../fgds_fault_common.rs"]
mod fault;

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fault::{Child, SharedCounter};
use fgds_tests::ctl;
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
            run: || sigkill_case(false),
        },
        Case {
            name: "sigkill_with_32_fixed_buffer_reads_in_flight",
            run: || sigkill_case(true),
        },
        Case {
            name: "close_under_io_uring_fixed_buffer_keeps_dmabuf_pinned",
            run: close_under_fixed_buffer,
        },
        Case {
            name: "close_under_io_then_exporter_unbind",
            run: close_under_io_then_unbind,
        },
    ])
}

/// The child: registers, maps, and keeps DEPTH reads in flight until it is killed.
fn reader(parent: &mut fault::Parent, counts: &SharedCounter, fixed: bool) -> anyhow::Result<()> {
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
    if fixed {
        let iov = libc::iovec {
            iov_base: map.ptr.cast(),
            iov_len: LEN,
        };
        // SAFETY: the iovec covers our live mapping, which outlives the ring (the process is
        // killed with both).
        if let Err(e) = unsafe { ring.submitter().register_buffers(&[iov]) } {
            parent.ready(&format!("refused: {}", e.raw_os_error().unwrap_or(0)));
            parent.wait_released();
            return Ok(());
        }
    }
    let fd = types::Fd(nvme.as_raw_fd());
    let push = |ring: &mut IoUring, i: usize| -> anyhow::Result<()> {
        // SAFETY: chunk i lies inside the mapping.
        let ptr = unsafe { map.ptr.add(i * CHUNK) };
        let off = (i * CHUNK) as u64;
        let sqe = if fixed {
            opcode::ReadFixed::new(fd, ptr, CHUNK as u32, 0)
                .offset(off)
                .build()
        } else {
            opcode::Read::new(fd, ptr, CHUNK as u32).offset(off).build()
        }
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

fn sigkill_case(fixed: bool) -> CaseResult {
    fault::require_idle()?;
    fault::wait_vgpu_buffers_gone("before the case")?;
    let refcnt = module_refcnt()?;
    let counts = SharedCounter::new()?;
    let mut child = Child::spawn(|parent| reader(parent, &counts, fixed))?;
    let ready = child.wait_ready(Duration::from_secs(60));
    let ready = match ready {
        Ok(r) => r,
        Err(e) => {
            child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    if let Some(errno) = ready.strip_prefix("refused: ") {
        child.release();
        let _ = child.wait()?;
        fault::wait_counters_zero("after the child exited")?;
        let errno = errno.parse().context("the child's errno")?;
        return match fgds_tests::guest::fixed_buffer_refusal(errno) {
            Some(reason) => ktap::skip(reason),
            None => bail!(
                "the child's IORING_REGISTER_BUFFERS of the fgds mapping failed with {}",
                fgds_tests::errno::name(errno)
            ),
        };
    }
    // Let the reads run: at least two full rounds, so that every slot has been resubmitted.
    let started = Instant::now();
    let steady = fault::wait_until(
        "the child's reads to complete two rounds",
        Duration::from_secs(120),
        || Ok(counts.get(DONE).load(Ordering::SeqCst) >= 2 * DEPTH as u64),
    );
    let before = fault::counters();
    fault::host_log(&format!(
        "fgds_fault_kill: SIGKILL pid {} with {DEPTH} io_uring reads{} in flight",
        child.pid,
        if fixed { " (fixed buffer)" } else { "" }
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

/// An io_uring registered ("fixed") buffer pins the pages of an fgds mapping beyond the
/// mapping's life. Unmapping and closing the node must neither wait for that pin (close(2)
/// returns at once) nor give the memory back to the exporter while the ring can still DMA into
/// it: the dma-buf stays pinned until the ring lets the pages go, and I/O through the ring
/// still lands in the GPU buffer.
fn close_under_fixed_buffer() -> CaseResult {
    fault::require_idle()?;
    let len = 4 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let nvme = common::nvme(false)?;
    let mut ring = IoUring::new(4)?;
    let iov = libc::iovec {
        iov_base: map.ptr.cast(),
        iov_len: len as usize,
    };
    // SAFETY: the iovec covers our live mapping; the ring is dropped before the test returns.
    if let Err(e) = unsafe { ring.submitter().register_buffers(&[iov]) } {
        return fgds_tests::guest::fixed_buffer_refused(&e);
    }
    let map_ptr = map.ptr;
    let read_fixed = |ring: &mut IoUring, nvme_off: u64| -> anyhow::Result<i32> {
        let sqe = opcode::ReadFixed::new(types::Fd(nvme.as_raw_fd()), map_ptr, len as u32, 0)
            .offset(nvme_off)
            .build();
        // SAFETY: the registered buffer stays pinned by the ring; the NVMe fd outlives the
        // request, which is waited for here.
        unsafe { ring.submission().push(&sqe) }.map_err(|_| anyhow::anyhow!("SQ full"))?;
        ring.submit_and_wait(1)?;
        let cqe = ring.completion().next().context("no completion")?;
        Ok(cqe.result())
    };
    ensure!(
        read_fixed(&mut ring, 28 * MIB)? == len as i32,
        "fixed-buffer read while mapped"
    );
    common::check_nvme_pattern(
        28 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    // One pin from fgds, and one more from dma_buf_map_attachment() on kernels without
    // CONFIG_DMABUF_MOVE_NOTIFY.
    let pins = vgpu_pins(bar_off)?.context("vgpu does not list the buffer")?;
    ensure!(pins >= 1, "vgpu pin count {pins} while registered");

    // Unmap and close: the registration goes, the ring's pin stays.
    drop(map);
    let start = Instant::now();
    drop(node);
    let close_took = start.elapsed();
    ktap::diag(format_args!("close(2) of the node took {close_took:?}"));
    ensure!(
        close_took < Duration::from_secs(1),
        "close(2) of the node took {close_took:?}: it waited for the ring's pin"
    );
    fault::wait_counters_zero("after close")?;
    ensure!(
        vgpu_pins(bar_off)? == Some(pins),
        "vgpu pin count {:?} after close with the ring still pinning the pages, want {pins} \
         (the exporter would reuse memory the ring can still DMA into)",
        vgpu_pins(bar_off)?
    );
    // The ring still reaches the pages: the data must land in the same GPU memory.
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0)?;
    let res = read_fixed(&mut ring, 32 * MIB)?;
    ensure!(res == len as i32, "fixed-buffer read after close: {res}");
    common::check_nvme_pattern(
        32 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;

    // The ring goes: fgds unpins and gives the dma-buf back.
    drop(ring);
    fault::wait_until(
        "fgds to unpin the dma-buf once the ring is gone",
        Duration::from_secs(20),
        || Ok(vgpu_pins(bar_off)? == Some(0)),
    )?;
    drop(dmabuf);
    fault::wait_vgpu_buffers_gone("after the ring and the dma-buf are gone")?;
    ktap::pass()
}

/// The blkdebug breakpoint tag.
const TAG: &str = "fgds_fault_kill";

/// A qemu-io command on the raw drive's block node (blkdebug breakpoints), through the host.
fn qemu_io(cmd: &str) -> anyhow::Result<()> {
    let out = ctl::request(&format!("hmp qemu-io nvme0-disk \"{cmd}\""))?;
    ensure!(out.trim().is_empty(), "qemu-io {cmd:?}: {out}");
    Ok(())
}

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
    qemu_io(&format!("break read_aio {TAG}"))?;
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
        qemu_io(&format!("resume {TAG}"))?;
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
    let _ = qemu_io(&format!("remove_break {TAG}"));
    let _ = qemu_io(&format!("resume {TAG}"));
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
