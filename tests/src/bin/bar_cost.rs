//! What fgds spends on a GPU's BAR: the first open of its node (the page provider's set-up:
//! struct pages over the whole BAR), a second open, and a registration, in time and in the
//! guest's free memory. A measurement, not in the default suite: `cargo xtask test-vm --exec`
//! it with `--gpu-bytes` (docs/driver.md, Page providers, has the numbers).

#[path = "../fgds_common.rs"]
mod common;

use std::os::fd::AsFd;
use std::time::Instant;

use anyhow::Context;
use fgds_tests::ktap::{self, Case, CaseResult};

fn main() {
    ktap::run(&[Case {
        name: "first_open_and_registration",
        run: first_open_and_registration,
    }])
}

/// `MemFree` of /proc/meminfo, in KiB.
fn mem_free_kib() -> anyhow::Result<u64> {
    let text = std::fs::read_to_string("/proc/meminfo")?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemFree:"))
        .and_then(|v| v.split_whitespace().next())
        .context("no MemFree in /proc/meminfo")?
        .parse()
        .context("MemFree")
}

fn first_open_and_registration() -> CaseResult {
    let bar = fgds::Gpu::list()?
        .first()
        .context("fgds serves no GPU")?
        .bar_size;
    let before = mem_free_kib()?;
    let started = Instant::now();
    let node = common::open_node()?;
    let first = started.elapsed();
    let after_open = mem_free_kib()?;
    let started = Instant::now();
    let again = common::open_node()?;
    let second = started.elapsed();
    drop(again);
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, 2 << 20)?;
    let started = Instant::now();
    let idx = common::reg(&node, dmabuf.as_fd(), 0, 2 << 20)?;
    let reg = started.elapsed();
    let after_reg = mem_free_kib()?;
    common::unreg(&node, idx)?;
    ktap::diag(format_args!(
        "fgds-report: bar bytes={bar} first_open_ms={:.1} second_open_ms={:.2} \
         first_open_free_kib={} reg_2mib_ms={:.2} reg_free_kib={}",
        first.as_secs_f64() * 1e3,
        second.as_secs_f64() * 1e3,
        before.saturating_sub(after_open),
        reg.as_secs_f64() * 1e3,
        after_open.saturating_sub(after_reg),
    ));
    ktap::pass()
}
