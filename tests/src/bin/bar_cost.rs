//! What fgds spends on a GPU's BAR: the first open of its node (the page provider's set-up),
//! a second open, a first 2 MiB registration (which makes the struct pages of the 64 MiB
//! chunk it lies in), a second one in the same chunk, and a 1 GiB one (a quarter of a smaller BAR), in time and in the
//! guest's free memory. A measurement, not in the default suite: `cargo xtask test-vm --exec`
//! it with `--gpu-bytes` (docs/driver.md, Page providers, has the numbers).

use fgds_tests::common;

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
    let made = || common::sysfs_u64("pages_made");
    // (time, KiB of MemFree it took, bytes of pages made after it)
    let register = |bytes: u64| -> anyhow::Result<(f64, u64, u64, (std::os::fd::OwnedFd, u64))> {
        let (dmabuf, _) = common::alloc(&vgpu, bytes)?;
        let before = mem_free_kib()?;
        let started = Instant::now();
        let idx = common::reg(&node, dmabuf.as_fd(), 0, bytes)?;
        let took = started.elapsed().as_secs_f64() * 1e3;
        let free = before.saturating_sub(mem_free_kib()?);
        Ok((took, free, made()?, (dmabuf, idx)))
    };
    let (reg_ms, reg_kib, reg_made, first_reg) = register(2 << 20)?;
    let (reg2_ms, reg2_kib, reg2_made, second_reg) = register(2 << 20)?;
    // 1 GiB, or a quarter of a smaller BAR.
    let big = (1u64 << 30).min(bar / 4);
    let (gib_ms, gib_kib, gib_made, gib_reg) = register(big)?;
    for (_, idx) in [first_reg, second_reg, gib_reg] {
        common::unreg(&node, idx)?;
    }
    ktap::diag(format_args!(
        "fgds-report: bar bytes={bar} first_open_ms={first_ms:.1} second_open_ms={:.2} \
         first_open_free_kib={} reg_2mib_ms={reg_ms:.2} reg_free_kib={reg_kib} \
         reg_made={reg_made} reg2_2mib_ms={reg2_ms:.2} reg2_free_kib={reg2_kib} \
         reg2_made={reg2_made} big_bytes={big} reg_big_ms={gib_ms:.1} reg_big_free_kib={gib_kib} \
         reg_big_made={gib_made}",
        second.as_secs_f64() * 1e3,
        before.saturating_sub(after_open),
        first_ms = first.as_secs_f64() * 1e3,
    ));
    ktap::pass()
}
