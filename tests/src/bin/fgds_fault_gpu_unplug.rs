//! Issue 7 (a) and (b): GPU hot-unplug (QEMU `device_del` of the ivshmem GPU) while a 32 MiB
//! buffer is registered and mapped and large O_DIRECT reads (one 32 MiB pread(2), and the same
//! through the crate's io_uring `Transfer`) run into it; then the GPU is plugged back.
//!
//! (a) The reads end within a bounded time, never hang, pread(2) with EFAULT (io_uring with
//! ENODEV through fgds's commands, or through the mapping EFAULT, or EIO from the block layer's
//! multi-bio path); the mapping raises SIGBUS;
//! the node is gone; REG_BUFFER and mmap on the still-open fd fail with ENODEV (documented);
//! once the last fd is closed fgds unloads cleanly (and loads again). The host checks, once the
//! GPU is back (asked over the control channel), that the GPU memory under the buffer holds the
//! sentinel it held before: the readers copy that same sentinel from the drive until the
//! removal has completed and something else after, so any write that reached GPU memory after
//! the removal would show.
//!
//! (b) After `gpu_add` (same slot, same memory) a new node appears and data moves both ways.

use fgds_tests::common;
use fgds_tests::fault;

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fgds::{Direction, Gpu, Transfer, TransferConfig};
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};
use rustix::io::Errno;

/// The buffer, placed at BAR2 offset SENTINEL_AT, clear of what the node's later data checks
/// allocate first fit.
const LEN: u64 = 32 * MIB;
const SENTINEL_AT: u64 = 208 * MIB;
/// Drive scratch: source A holds the sentinel, source B other data.
const SRC_A: u64 = 64 * MIB;
const SRC_B: u64 = 96 * MIB;
const SEED_A: u64 = 0x4750_5541;
const SEED_B: u64 = 0x4750_5542;
/// How long a reader may take to fail once the removal has completed.
const BOUND: Duration = Duration::from_secs(10);

fn main() {
    common::run_unless_refused(&[Case {
        name: "gpu_unplug_during_large_reads_then_replug",
        run: gpu_unplug_during_large_reads,
    }])
}

/// A reader's end: full reads done, then the error.
type Ended = (&'static str, u32, Option<Errno>);

fn gpu_unplug_during_large_reads() -> CaseResult {
    fault::require_idle()?;
    let node_path = common::node_path()?;
    let nvme = common::nvme(true)?;
    let mut ram = AlignedBuf::new(LEN as usize)?;
    pattern::fill(SEED_A, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), SRC_A)?;
    pattern::fill(SEED_B, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), SRC_B)?;
    drop(ram);

    let vgpu = common::vgpu()?;
    let spacer = common::alloc(&vgpu, SENTINEL_AT).context("spacer (is BAR2 in use?)")?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    drop(spacer);
    ensure!(
        bar_off == SENTINEL_AT,
        "buffer at BAR2 {bar_off:#x}, want {SENTINEL_AT:#x}"
    );
    let mut sentinel = vec![0u8; LEN as usize];
    pattern::fill(SEED_A, 0, &mut sentinel);
    common::gpu_write(dmabuf.as_fd(), LEN as usize, 0, &sentinel)?;
    drop(sentinel);

    // Raw registration (its fd stays open), and the crate's for the io_uring reader.
    let node = common::open_node()?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = Map::shared(&node, idx, LEN as usize)?;
    let info = Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    let buffer = Arc::new(Gpu::open(&info.bdf)?.register(dmabuf.as_fd(), 0, LEN)?);

    let flipped = Arc::new(AtomicBool::new(false));
    // Full reads done by the pread reader and by the io_uring reader.
    let reads = Arc::new(AtomicU32::new(0));
    let uring_reads = Arc::new(AtomicU32::new(0));
    let (tx, rx) = mpsc::channel::<Ended>();
    {
        let (tx, flipped, reads) = (tx.clone(), flipped.clone(), reads.clone());
        let ptr = map.ptr as usize;
        std::thread::spawn(move || {
            let Ok(nvme) = common::nvme(false) else {
                let _ = tx.send(("pread", 0, None));
                return;
            };
            let mut ok = 0;
            let err = loop {
                let src = if flipped.load(Ordering::SeqCst) {
                    SRC_B
                } else {
                    SRC_A
                };
                // One system call for the whole 32 MiB.
                // SAFETY: the mapping is LEN bytes and outlives this thread (joined below).
                let n = unsafe {
                    libc::pread(
                        std::os::fd::AsRawFd::as_raw_fd(&nvme),
                        ptr as *mut libc::c_void,
                        LEN as usize,
                        src as i64,
                    )
                };
                if n < 0 {
                    break Some(Errno::from_raw_os_error(
                        std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
                    ));
                }
                ok += 1;
                reads.fetch_add(1, Ordering::SeqCst);
            };
            let _ = tx.send(("pread", ok, err));
        });
    }
    {
        let (tx, flipped, reads, buffer) = (
            tx.clone(),
            flipped.clone(),
            uring_reads.clone(),
            buffer.clone(),
        );
        std::thread::spawn(move || {
            let ended = (|| -> anyhow::Result<Ended> {
                let nvme = fgds::open_direct(&fgds_tests::guest::nvme_path()?, false)?;
                let mut t = Transfer::new(TransferConfig {
                    chunk_size: 4 * MIB as usize,
                    queue_depth: 8,
                })?;
                let mut ok = 0;
                // Which path the reads took, as the crate reports it: the errno of the end
                // depends on it.
                let mut who = "io_uring";
                loop {
                    let src = if flipped.load(Ordering::SeqCst) {
                        SRC_B
                    } else {
                        SRC_A
                    };
                    match t.run(Direction::Read, &buffer, 0..LEN as usize, &nvme, src) {
                        Ok(_) => {
                            ok += 1;
                            who = match t.last_run_path() {
                                Some(fgds::TransferPath::Command) => "io_uring commands",
                                _ => "io_uring mapping",
                            };
                            reads.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(fgds::Error::Io { source, .. }) => {
                            let errno = source.raw_os_error().map(Errno::from_raw_os_error);
                            return Ok((who, ok, errno));
                        }
                        Err(e) => bail!("io_uring reader: {e}"),
                    }
                }
            })();
            let _ = tx.send(ended.unwrap_or_else(|e| {
                ktap::diag(format_args!("{e:#}"));
                ("io_uring", 0, None)
            }));
        });
    }
    drop(tx);

    // Both readers under way (each has completed a read, however loaded the host is), then the
    // host pulls the GPU.
    let running = fault::wait_until("the readers' first reads", Duration::from_secs(60), || {
        Ok(reads.load(Ordering::SeqCst) >= 1 && uring_reads.load(Ordering::SeqCst) >= 1)
    });
    fault::host_log(&format!(
        "fgds_fault_gpu_unplug: device_del {} with 32 MiB pread and io_uring reads in flight \
         into GPU memory at BAR2 {bar_off:#x} (sentinel seed {SEED_A:#x})",
        ctl::GPU_ID
    ))?;
    let del_start = Instant::now();
    let removed = ctl::device_del(ctl::GPU_ID);
    let removed_at = Instant::now();
    // From now on any read that still lands would put B's data over the sentinel.
    flipped.store(true, Ordering::SeqCst);
    fault::host_log("fgds_fault_gpu_unplug: GPU removed; readers switched to source B")?;
    let mut ended = Vec::new();
    while ended.len() < 2 {
        match rx.recv_timeout((removed_at + BOUND).saturating_duration_since(Instant::now())) {
            Ok(e) => ended.push(e),
            Err(_) => break,
        }
    }
    // Whatever the checks find, the GPU is plugged back below: the programs after this one
    // need it.
    let checks = (|| -> anyhow::Result<()> {
        running?;
        removed.context("device_del of the GPU")?;
        ktap::diag(format_args!(
            "device_del took {:?}; readers: {ended:?}",
            removed_at - del_start
        ));
        ensure!(
            ended.len() == 2,
            "a reader did not end within {BOUND:?} of the GPU's removal: it hangs"
        );
        for (who, ok, err) in &ended {
            ensure!(*ok > 0, "the {who} reader never completed a read");
            // pread(2) gets GUP's EFAULT (the mapping was zapped; the fault handler refuses). The
            // crate's io_uring reader takes fgds's commands where the kernel has them, which
            // refuse the revoked registration with ENODEV and nothing else (an I/O error there
            // would be a DMA into a BAR that went away). Only through the mapping (6.1), an
            // io_uring read of more than 256 pages takes the block layer's multi-bio path
            // (__blkdev_direct_IO), which ends a bio whose pages it cannot get with
            // BLK_STS_IOERR: the completion then says EIO for GUP's refusal.
            let want: &[Errno] = match *who {
                "pread" => &[Errno::FAULT],
                "io_uring commands" => &[Errno::NODEV],
                _ => &[Errno::FAULT, Errno::IO],
            };
            ensure!(
                err.is_some_and(|e| want.contains(&e)),
                "the {who} reader ended with {err:?}, want one of {want:?}"
            );
        }

        // (a) What the still-open fd and mapping see.
        fault::wait_until("the node to go", Duration::from_secs(20), || {
            Ok(!node_path.exists())
        })?;
        let status = common::touch_in_child(map.ptr)?;
        ensure!(
            status == 128 + libc::SIGBUS,
            "access after unplug: status {status}, want SIGBUS"
        );
        match common::reg(&node, dmabuf.as_fd(), 0, LEN) {
            Err(Errno::NODEV) => {}
            other => bail!("REG_BUFFER on the open fd after unplug: {other:?}, want ENODEV"),
        }
        match Map::new(&node, idx, LEN as usize, libc::MAP_SHARED) {
            Err(Errno::NODEV) => {}
            other => bail!(
                "mmap on the open fd after unplug: {:?}, want ENODEV",
                other.map(|_| ())
            ),
        }
        fault::expect_unload_refused("while a removed GPU's node is still open")?;
        Ok(())
    })();
    drop(map);
    drop(node);
    drop(buffer);
    drop(dmabuf);
    drop(vgpu);
    fault::host_log("fgds_fault_gpu_unplug: unloading fgds with the GPU gone")?;
    let unloaded = fault::unload_fgds();
    let loaded = if std::path::Path::new("/sys/module/fgds").exists() {
        Ok(())
    } else {
        fault::load_fgds()
    };

    // (b) The GPU comes back: a new node, and data both ways.
    fault::host_log("fgds_fault_gpu_unplug: gpu_add")?;
    let added = ctl::gpu_add();
    let node_back = fault::wait_until(
        "vgpu and a new fgds node after gpu_add",
        Duration::from_secs(30),
        || Ok(common::node_path().is_ok()),
    );
    checks?;
    unloaded.context("unloading fgds after the GPU's removal")?;
    loaded?;
    added?;
    node_back?;
    ctl::gpu_check(bar_off, LEN, SEED_A)
        .context("the sentinel under the buffer, as the host sees it after the removal")?;
    fault::data_check(4 * MIB, 30 * MIB).context("NVMe -> GPU on the new node")?;
    write_check().context("GPU -> NVMe on the new node")?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// GPU -> NVMe through the crate on the new node: known data in GPU memory reaches the drive.
fn write_check() -> anyhow::Result<()> {
    let len = 4 * MIB;
    let seed = 0x4750_5557;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let mut data = vec![0u8; len as usize];
    pattern::fill(seed, 0, &mut data);
    common::gpu_write(dmabuf.as_fd(), len as usize, 0, &data)?;
    let info = Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    let buffer = Gpu::open(&info.bdf)?.register(dmabuf.as_fd(), 0, len)?;
    let nvme = fgds::open_direct(&fgds_tests::guest::nvme_path()?, true)?;
    Transfer::new(TransferConfig::DEFAULT)?.run(
        Direction::Write,
        &buffer,
        0..len as usize,
        &nvme,
        SRC_B,
    )?;
    let mut back = AlignedBuf::new(len as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), SRC_B)?;
    if let Some(at) = pattern::first_mismatch(seed, 0, back.as_slice()) {
        bail!("byte {at} written from GPU memory differs on the drive");
    }
    Ok(())
}
