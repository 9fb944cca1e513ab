//! fgds cases the host checks after the run in the GPU's backing file: data read from the NVMe
//! really landed in device memory, and a revoked range received no write after the revocation.
//! Runs after the other fgds programs and keeps its buffers until it exits, so nothing reuses
//! the checked ranges.

#[path = "../fgds_common.rs"]
mod common;

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use anyhow::{Context, ensure};
use common::{MIB, Map};
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;
use rustix::io::Errno;

/// NVMe scratch area for this program (beyond the pattern, apart from fgds_data's).
const SCRATCH: u64 = 192 * MIB;

fn main() {
    ktap::run(&[
        Case {
            name: "host_sees_nvme_data_in_gpu_memory",
            run: host_sees_data,
        },
        Case {
            name: "host_sees_no_write_after_revoke",
            run: no_write_after_revoke,
        },
    ])
}

/// Keeps a dma-buf open until the program exits, so vgpu never hands its range out again.
fn keep(fd: OwnedFd) {
    std::mem::forget(fd);
}

fn host_sees_data() -> CaseResult {
    let len = 4 * MIB;
    let seed = 0x484f_5354;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(true)?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    // Put on the NVMe the pattern the host will expect at this BAR offset, then read it into
    // GPU memory through fgds.
    let mut ram = AlignedBuf::new(len as usize)?;
    pattern::fill(seed, bar_off, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), SCRATCH)?;
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    common::pread_raw(&nvme, map.ptr, len as usize, SCRATCH).context("pread into GPU")?;
    let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    ensure!(
        pattern::first_mismatch(seed, bar_off, &got).is_none(),
        "guest sees wrong data in GPU memory"
    );
    ktap::host_check_gpu_pattern(bar_off, len, seed);
    keep(dmabuf);
    ktap::pass()
}

/// Writes the pattern of `seed` for BAR offset `off` straight into BAR2 through sysfs
/// resourceN, bypassing vgpu (whose own mapping of a revoked buffer is gone).
fn write_bar(off: u64, len: u64, seed: u64) -> anyhow::Result<()> {
    let bdf = common::vgpu_bdf()?;
    let path = format!("/sys/bus/pci/devices/{bdf}/resource2");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)?;
    // SAFETY: a new shared mapping of the BAR range, used only through volatile writes.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            off as libc::off_t,
        )
    };
    ensure!(
        p != libc::MAP_FAILED,
        "mmap {path}: {}",
        std::io::Error::last_os_error()
    );
    let mut data = vec![0u8; len as usize];
    pattern::fill(seed, off, &mut data);
    for (i, w) in data.chunks_exact(8).enumerate() {
        // SAFETY: inside the mapping just made.
        unsafe {
            p.cast::<u64>()
                .add(i)
                .write_volatile(u64::from_ne_bytes(w.try_into().expect("8 bytes")));
        }
    }
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, len as usize) };
    Ok(())
}

fn no_write_after_revoke() -> CaseResult {
    let len = 16 * MIB;
    let seed = 0x5245_564b;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let ptr = map.ptr as usize;
    // I/O keeps running into the buffer while it is revoked.
    let reader = std::thread::spawn(move || -> Option<Errno> {
        let nvme = common::nvme(false).ok()?;
        loop {
            if let Err(e) = common::pread_raw(&nvme, ptr as *mut u8, len as usize, 0) {
                return Some(e);
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    common::revoke(bar_off).context("revoke")?;
    // The revocation has returned: whatever was in flight is done. Mark the range.
    write_bar(bar_off, len, seed)?;
    let err = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    ensure!(
        err == Some(Errno::FAULT),
        "reader ended with {err:?}, want EFAULT"
    );
    let nvme = common::nvme(false)?;
    ensure!(
        common::pread_raw(&nvme, map.ptr, len as usize, 0) == Err(Errno::FAULT),
        "pread into the revoked buffer did not fail with EFAULT"
    );
    std::thread::sleep(Duration::from_millis(200));
    ktap::host_check_gpu_pattern(bar_off, len, seed);
    drop(map);
    keep(dmabuf);
    ktap::pass()
}
