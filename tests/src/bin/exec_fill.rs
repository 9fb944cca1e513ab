//! A program for `cargo xtask test-vm --exec`, not in the default suite: it allocates vgpu
//! memory from the start of BAR2 (vgpu hands memory out first fit, so after the suite that is
//! where earlier programs' buffers were), fills it with a pattern through vgpu's CPU mapping and
//! asks the host over the control channel to check the GPU's backing file. It shows that a
//! user's program can overwrite what the suite's programs had the host check (their checks were
//! made when asked), and that it can ask for checks of its own.
//!
//! Build: `RUSTFLAGS='-C target-feature=+crt-static' cargo build --release --target
//! x86_64-unknown-linux-gnu -p fgds-tests --bin exec_fill`, then
//! `cargo xtask test-vm --exec target/x86_64-unknown-linux-gnu/release/exec_fill`.

use std::os::fd::AsFd;

use anyhow::{Context, ensure};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, guest, pattern};

/// Bytes filled from BAR2 offset 0.
const LEN: u64 = 64 << 20;
const SEED: u64 = 0x6578_6563;

fn main() {
    ktap::run(&[Case {
        name: "fill_from_offset_0_and_host_check",
        run: fill_from_offset_0,
    }])
}

fn fill_from_offset_0() -> CaseResult {
    let (dmabuf, bar_off) = fgds::vgpu::alloc(&guest::vgpu_open()?, LEN)?;
    ensure!(
        bar_off == 0,
        "vgpu placed the buffer at BAR2 {bar_off:#x}, not at 0: a program before this one left \
         vgpu memory allocated"
    );
    let map = fgds::CpuMapping::new(dmabuf.as_fd(), LEN as usize)?;
    let mut chunk = vec![0u8; 4 << 20];
    for at in (0..LEN).step_by(chunk.len()) {
        pattern::fill(SEED, at, &mut chunk);
        map.write(at as usize, &chunk);
    }
    ctl::gpu_check(bar_off, LEN, SEED).context("the GPU's backing file, checked by the host")?;
    ktap::pass()
}
