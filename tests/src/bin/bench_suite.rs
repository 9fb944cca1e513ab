//! The benchmark grid `cargo xtask bench` runs in the guest (not part of the test suite): `fgds
//! bench` over block sizes, queue depths and both directions, every mode side by side, plus the
//! cost of registering and mapping 1 GiB next to the time to read 1 GiB.
//!
//! Each result goes out as a KTAP diagnostic, `# fgds-bench: <json>`, for the host to collect.
//! `FGDS_BENCH=quick` (kernel parameter `fgds.bench=quick`) runs a small grid.

use std::os::fd::AsFd;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, ensure};
use fgds::{Direction, Transfer, TransferConfig};
use fgds_tests::ktap::{self, Case, CaseResult};

fn main() {
    ktap::run(&[
        Case {
            name: "registration_cost",
            run: registration_cost,
        },
        Case {
            name: "grid",
            run: grid,
        },
    ])
}

fn quick() -> bool {
    std::env::var("FGDS_BENCH").is_ok_and(|v| v == "quick")
}

fn grid() -> CaseResult {
    let nvme = fgds_tests::guest::nvme_path()?
        .to_string_lossy()
        .into_owned();
    let (sizes, depths, repeat): (&[u64], &[u64], &str) = if quick() {
        (&[64 << 10, 1 << 20, 4 << 20], &[1, 32], "2")
    } else {
        (
            &[
                4 << 10,
                64 << 10,
                256 << 10,
                1 << 20,
                4 << 20,
                16 << 20,
                64 << 20,
            ],
            &[1, 8, 32],
            "3",
        )
    };
    for op in ["read", "write"] {
        // Reads cycle through the pattern area; writes through scratch clear of the fault areas.
        let (offset, span) = if op == "read" {
            (0u64, 64u64 << 20)
        } else {
            (64 << 20, 128 << 20)
        };
        for &bs in sizes {
            for &qd in depths {
                // Enough bytes for a stable figure, few enough for TCG.
                let total = (bs * qd * 8).clamp(16 << 20, 256 << 20).max(bs);
                let args = [
                    "bench",
                    "--vgpu",
                    "0",
                    "--file",
                    &nvme,
                    "--op",
                    op,
                    "--block-size",
                    &bs.to_string(),
                    "--queue-depth",
                    &qd.to_string(),
                    "--total",
                    &total.to_string(),
                    "--file-offset",
                    &offset.to_string(),
                    "--span",
                    &span.to_string(),
                    "--repeat",
                    repeat,
                    "--json",
                ];
                let out = Command::new("/bin/fgds")
                    .args(args)
                    .output()
                    .context("cannot run /bin/fgds")?;
                ensure!(
                    out.status.success(),
                    "fgds {} failed: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
                let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
                for row in rows {
                    ktap::diag(format_args!("fgds-bench: {row}"));
                }
            }
        }
    }
    ktap::pass()
}

/// REG plus mmap of 1 GiB of GPU memory, and reading 1 GiB into it.
fn registration_cost() -> CaseResult {
    const GIB: u64 = 1 << 30;
    let gpu = fgds::Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    if gpu.bar_size < GIB {
        return ktap::skip(format_args!(
            "the GPU's BAR is {} MiB: run through `cargo xtask bench`, which gives it 1 GiB",
            gpu.bar_size >> 20
        ));
    }
    let dev = fgds::vgpu::open(0)?;
    let (dmabuf, _) = fgds::vgpu::alloc(&dev, GIB)?;
    let gpu = fgds::Gpu::open(&gpu.bdf)?;
    let started = Instant::now();
    let buffer = gpu.register(dmabuf.as_fd(), 0, GIB)?;
    let reg_map_s = started.elapsed().as_secs_f64();
    let file = fgds::open_direct(&fgds_tests::guest::nvme_path()?, false)?;
    let mut transfer = Transfer::new(TransferConfig {
        chunk_size: 4 << 20,
        queue_depth: 8,
    })?;
    // The drive's first 128 MiB eight times over (clear of its fault areas at 240 MiB).
    let eighth = (GIB / 8) as usize;
    let started = Instant::now();
    for part in 0..8 {
        let range = part * eighth..(part + 1) * eighth;
        transfer.run(Direction::Read, &buffer, range, &file, 0)?;
    }
    let read_s = started.elapsed().as_secs_f64();
    let row = serde_json::json!({
        "kind": "registration",
        "reg_map_s": reg_map_s,
        "read_1gib_s": read_s,
        "reg_map_fraction_of_read": reg_map_s / read_s,
    });
    ktap::diag(format_args!("fgds-bench: {row}"));
    ktap::pass()
}
