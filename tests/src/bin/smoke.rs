//! Smoke tests of the rig itself: the NVMe pattern reads back with O_DIRECT into RAM (pread and
//! io_uring), and vgpu memory written through the dma-buf's CPU mapping reaches the GPU's
//! backing file on the host (checked by the host when asked, over the control channel).

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use anyhow::{Context, bail, ensure};
use std::os::fd::AsFd;

use fgds::vgpu;
use fgds_tests::ctl;
use fgds_tests::guest::{self, AlignedBuf};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;

fn main() {
    ktap::run(&[
        Case {
            name: "nvme_pattern_pread",
            run: nvme_pattern_pread,
        },
        Case {
            name: "nvme_pattern_io_uring",
            run: nvme_pattern_io_uring,
        },
        Case {
            name: "vgpu_mmap_reaches_backing_file",
            run: vgpu_mmap_reaches_backing_file,
        },
    ])
}

fn check_pattern(offset: u64, buf: &[u8]) -> anyhow::Result<()> {
    match pattern::first_mismatch(pattern::NVME_SEED, offset, buf) {
        None => Ok(()),
        Some(at) => bail!(
            "NVMe data differs from the pattern at byte {}",
            offset + at as u64
        ),
    }
}

fn nvme_pattern_pread() -> CaseResult {
    let nvme = guest::open_direct(&guest::nvme_path()?, false)?;
    let mut buf = AlignedBuf::new(4 << 20)?;
    for offset in [0, 4096, 17 << 20, pattern::NVME_PATTERN_BYTES - (4 << 20)] {
        let n = nvme
            .read_at(buf.as_mut_slice(), offset)
            .with_context(|| format!("pread at {offset}"))?;
        ensure!(
            n == buf.as_slice().len(),
            "short pread at {offset}: {n} bytes"
        );
        check_pattern(offset, buf.as_slice())?;
    }
    ktap::pass()
}

fn nvme_pattern_io_uring() -> CaseResult {
    const CHUNK: usize = 1 << 20;
    const DEPTH: usize = 8;
    let nvme = guest::open_direct(&guest::nvme_path()?, false)?;
    let mut ring = io_uring::IoUring::new(DEPTH as u32).context("io_uring_setup")?;
    let mut bufs = (0..DEPTH)
        .map(|_| AlignedBuf::new(CHUNK))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let base = 8u64 << 20;
    for (i, buf) in bufs.iter_mut().enumerate() {
        let slice = buf.as_mut_slice();
        let sqe = io_uring::opcode::Read::new(
            io_uring::types::Fd(nvme.as_raw_fd()),
            slice.as_mut_ptr(),
            CHUNK as u32,
        )
        .offset(base + (i * CHUNK) as u64)
        .build()
        .user_data(i as u64);
        // SAFETY: the buffer outlives the request: we wait for every completion below.
        unsafe { ring.submission().push(&sqe) }.context("submission queue full")?;
    }
    ring.submit_and_wait(DEPTH).context("io_uring_enter")?;
    let completions = ring
        .completion()
        .map(|cqe| (cqe.user_data(), cqe.result()))
        .collect::<Vec<_>>();
    ensure!(
        completions.len() == DEPTH,
        "{} of {DEPTH} completions",
        completions.len()
    );
    for (i, res) in completions {
        ensure!(res == CHUNK as i32, "request {i} returned {res}");
        check_pattern(base + i * CHUNK as u64, bufs[i as usize].as_slice())?;
    }
    ktap::pass()
}

fn vgpu_mmap_reaches_backing_file() -> CaseResult {
    if let Some(reason) = guest::vgpu_absence() {
        return ktap::skip(reason);
    }
    const LEN: usize = 2 << 20;
    const SEED: u64 = 0x5eed_0001;
    let dev = vgpu::open(0)?;
    let (dmabuf, bar_offset) = vgpu::alloc(&dev, LEN as u64)?;
    let map = fgds::CpuMapping::new(dmabuf.as_fd(), LEN)?;
    let mut data = vec![0u8; LEN];
    pattern::fill(SEED, 0, &mut data);
    map.write(0, &data);
    let mut back = vec![0u8; LEN];
    map.read(0, &mut back);
    if let Some(at) = pattern::first_mismatch(SEED, 0, &back) {
        bail!("vgpu memory read back differs at byte {at}");
    }
    ctl::gpu_check(bar_offset, LEN as u64, SEED)
        .context("the GPU's backing file, read by the host over the control channel")?;
    ktap::pass()
}
