//! fgds and GPU hot-unplug: the host removes the GPU (QMP device_del) while a buffer is mapped
//! and while I/O runs into it; the mapping then raises SIGBUS, I/O fails with EFAULT, the open
//! node answers ENODEV, the node disappears; after the GPU is plugged back a new node works.
//! Each case plugs the GPU back whatever happened, so that a failure here does not leave the
//! programs after it without a GPU.

use fgds_tests::common;
use fgds_tests::fault;

use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fgds_tests::ctl;
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "unplug_with_live_mapping",
            run: unplug_with_live_mapping,
        },
        Case {
            name: "unplug_during_io",
            run: unplug_during_io,
        },
    ])
}

/// Kernel log lines about the GPU's removal since `mark`: what to read when a step times out.
fn removal_log(mark: u64) -> String {
    let lines = fgds_tests::guest::kernel_log_since(mark).unwrap_or_default();
    let lines: Vec<_> = lines
        .iter()
        .filter(|l| {
            ["pci", "vgpu", "fgds", "BAR", "hung", "blocked"]
                .iter()
                .any(|k| l.contains(k))
        })
        .map(String::as_str)
        .collect();
    if lines.is_empty() {
        "the kernel logged nothing about it".to_owned()
    } else {
        format!("the kernel logged:\n{}", lines.join("\n"))
    }
}

/// Waits up to `timeout` for `cond`; on timeout the error carries the kernel's removal log.
fn wait_for(
    what: &str,
    timeout: Duration,
    mark: u64,
    cond: impl Fn() -> bool,
) -> anyhow::Result<()> {
    fault::wait_until(what, timeout, || Ok(cond()))
        .map(drop)
        .map_err(|err| anyhow::anyhow!("{err:#}; {}", removal_log(mark)))
}

/// Unplugs the GPU and waits for its fgds node to go.
fn unplug(node: &Path, mark: u64) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    ctl::device_del(ctl::GPU_ID)?;
    ktap::diag(format_args!("device_del took {:?}", start.elapsed()));
    wait_for("the fgds node to go", Duration::from_secs(30), mark, || {
        !node.exists()
    })
}

/// Plugs the GPU back, whatever [`unplug`] returned: waits (up to 120 s) for a removal still
/// under way to end, plugs it in, waits for vgpu and a new fgds node, then checks that it
/// works.
fn replug_and_check(node: &Path, mark: u64) -> anyhow::Result<()> {
    wait_for(
        "the GPU's removal to end before plugging it back",
        Duration::from_secs(120),
        mark,
        || !node.exists(),
    )?;
    ctl::gpu_add()?;
    wait_for(
        "vgpu and the fgds node to come back",
        Duration::from_secs(60),
        mark,
        || common::node_path().is_ok(),
    )?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len).context("REG after replug")?;
    let map = Map::shared(&node, idx, len as usize)?;
    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 24 * MIB).context("I/O after replug")?;
    common::check_nvme_pattern(
        24 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )
}

fn unplug_with_live_mapping() -> CaseResult {
    let path = common::node_path()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 0).context("I/O before unplug")?;
    drop(vgpu);
    let mark = fgds_tests::guest::kernel_log_mark()?;
    if let Err(err) = unplug(&path, mark) {
        return Err(match replug_and_check(&path, mark) {
            Ok(()) => err,
            Err(again) => err.context(format!("and plugging the GPU back failed: {again:#}")),
        });
    }

    let checks = (|| -> anyhow::Result<()> {
        let status = common::touch_in_child(map.ptr)?;
        ensure!(
            status == 128 + libc::SIGBUS,
            "access after unplug: status {status}, want SIGBUS"
        );
        match common::pread_raw(&nvme, map.ptr, len as usize, 0) {
            Err(Errno::FAULT) => {}
            other => bail!("pread after unplug: {other:?}, want EFAULT"),
        }
        match Map::new(&node, idx, len as usize, libc::MAP_SHARED) {
            Err(Errno::NODEV) => {}
            other => bail!("mmap after unplug: {:?}, want ENODEV", other.map(|_| ())),
        }
        match common::reg(&node, dmabuf.as_fd(), 0, len) {
            Err(Errno::NODEV) => {}
            other => bail!("REG after unplug: {other:?}, want ENODEV"),
        }
        common::unreg(&node, idx).context("UNREG after unplug")?;
        Ok(())
    })();
    drop(map);
    drop(node);
    drop(dmabuf);
    let replugged = replug_and_check(&path, mark);
    checks?;
    replugged?;
    ktap::pass()
}

fn unplug_during_io() -> CaseResult {
    let path = common::node_path()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 16 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    drop(vgpu);
    let ptr = map.ptr as usize;
    // Set when the unplug failed: the reader would otherwise read on for a long time.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_reading = stop.clone();
    let reader = std::thread::spawn(move || -> (u32, Option<Errno>) {
        let Ok(nvme) = common::nvme(false) else {
            return (0, None);
        };
        let mut ok = 0;
        loop {
            match common::pread_raw(&nvme, ptr as *mut u8, len as usize, 0) {
                Ok(_) => ok += 1,
                Err(e) => return (ok, Some(e)),
            }
            if ok > 100_000 || stop_reading.load(std::sync::atomic::Ordering::Relaxed) {
                return (ok, None);
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let mark = fgds_tests::guest::kernel_log_mark()?;
    let unplugged = unplug(&path, mark);
    if unplugged.is_err() {
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    let (ok, err) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    ktap::diag(format_args!(
        "{ok} reads completed before the unplug; then {err:?}"
    ));
    drop(map);
    drop(node);
    drop(dmabuf);
    let replugged = replug_and_check(&path, mark);
    unplugged?;
    ensure!(
        err == Some(Errno::FAULT),
        "I/O after unplug ended with {err:?}, want EFAULT"
    );
    replugged?;
    ktap::pass()
}
