//! fgds cases the host checks in the GPU's backing file, when asked over the control channel:
//! data read from the NVMe really landed in device memory, and a revoked range received no
//! write after the revocation.

use fgds_tests::common;

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, ensure};
use common::{MIB, Map};
use fgds_tests::ctl;
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;
use rustix::io::Errno;

/// NVMe scratch area for this program (beyond the pattern, apart from fgds_data's).
const SCRATCH: u64 = 192 * MIB;

fn main() {
    common::run_unless_refused(&[
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
    pattern::fill(seed, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), SCRATCH)?;
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    common::pread_raw(&nvme, map.ptr, len as usize, SCRATCH).context("pread into GPU")?;
    let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    ensure!(
        pattern::first_mismatch(seed, 0, &got).is_none(),
        "guest sees wrong data in GPU memory"
    );
    ctl::gpu_check(bar_off, len, seed).context("GPU memory as the host sees it")?;
    ktap::pass()
}

fn no_write_after_revoke() -> CaseResult {
    let len = 16 * MIB;
    let seed = 0x5245_564b;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(true)?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    // Source A holds exactly what the GPU range holds (the sentinel), source B something else.
    // Reads started before the revocation return copy A, so they leave the sentinel intact;
    // after the revocation has returned the reader switches to B, so any write that still
    // reached the range would show up as B's data on the host.
    let (src_a, src_b) = (SCRATCH + 8 * MIB, SCRATCH + 32 * MIB);
    let mut ram = AlignedBuf::new(len as usize)?;
    pattern::fill(seed, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), src_a)?;
    common::gpu_write(dmabuf.as_fd(), len as usize, 0, ram.as_slice())?;
    pattern::fill(seed ^ 0xffff, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), src_b)?;

    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let ptr = map.ptr as usize;
    let flipped = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&flipped);
    let reader = std::thread::spawn(move || -> Option<Errno> {
        let nvme = common::nvme(false).ok()?;
        loop {
            let src = if flag.load(Ordering::SeqCst) {
                src_b
            } else {
                src_a
            };
            if let Err(e) = common::pread_raw(&nvme, ptr as *mut u8, len as usize, src) {
                return Some(e);
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    common::revoke(bar_off).context("revoke")?;
    flipped.store(true, Ordering::SeqCst);
    let err = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    ensure!(
        err == Some(Errno::FAULT),
        "reader ended with {err:?}, want EFAULT"
    );
    ensure!(
        common::pread_raw(&nvme, map.ptr, len as usize, src_b) == Err(Errno::FAULT),
        "pread into the revoked buffer did not fail with EFAULT"
    );
    ctl::gpu_check(bar_off, len, seed)
        .context("the revoked range as the host sees it (a write after the revocation?)")?;
    drop(map);
    ktap::pass()
}
