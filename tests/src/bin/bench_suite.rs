//! The benchmark grid `cargo xtask bench` runs in the guest (not part of the test suite): `fgds
//! bench` over block sizes, queue depths and both directions, every mode side by side, plus the
//! cost of registering and mapping 1 GiB next to the time to read 1 GiB.
//!
//! Each result goes out as a KTAP diagnostic, `# fgds-bench: <json>`, for the host to collect.
//! `FGDS_BENCH=quick` (kernel parameter `fgds.bench=quick`) runs a small grid;
//! `FGDS_FIXED_BUFFERS` (`fgds.fixed_buffers`, default `auto`) is passed to `fgds bench
//! --fixed-buffers`. For experiments (`cargo xtask bench --append`), `fgds.bench_sizes`,
//! `fgds.bench_depths` and `fgds.bench_modes` (comma lists: bytes, depths, `fgds bench` modes)
//! replace the grid's.

use std::os::fd::AsFd;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, ensure};
use fgds::{Direction, Transfer, TransferConfig};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::profile;

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
        Case {
            name: "profile",
            run: profile,
        },
        Case {
            name: "files",
            run: files,
        },
        Case {
            name: "raid0",
            run: raid0,
        },
    ])
}

/// Where each drive's part of an array starts: past the raw drive's pattern (its first 64 MiB)
/// and clear of its fault areas (240 MiB on); the same on every drive.
const RAID0_MEMBER_OFFSET: u64 = 64 << 20;
/// Bytes of each drive in an array (the second drive and those after it have 128 MiB).
const RAID0_MEMBER_BYTES: u64 = 64 << 20;
/// md's chunk: mdadm's default.
const RAID0_CHUNK: u64 = 512 << 10;

/// Several drives (`fgds.bench=raid0`, `cargo xtask bench --drives N --raid0`): md RAID0 over
/// the first 1, 2, 4 (and 8) of the machine's drives in turn, the same 64 MiB of each, in
/// chunks of 512 KiB, and the first drive's range alone beside them ([`raid0_point`]). fgds's own
/// commands refuse md (its disk has no PCI device to check), so the GPU's side is the
/// registration's mapped address (`direct-mapped`), as the crate reads md, which the mode takes
/// only where fgds's gate takes every member. Each row carries `drives` and `array`; where the
/// mapped address cannot be measured (a kernel whose md takes no P2PDMA pages), a row with
/// `refused` (the bench's error) stands for it and `ram` runs alone.
fn raid0() -> CaseResult {
    if kind() != "raid0" {
        return ktap::skip("only with fgds.bench=raid0");
    }
    let drives = fgds_tests::guest::drives()?;
    for drive in &drives {
        // Requests up to the driver's limit reach each member whole (md takes its limits
        // from its members when it is assembled, and caps requests at its chunk).
        fgds_tests::guest::max_sectors_to_hw(drive)?;
        fill_member(drive)?;
    }
    let counts = [1usize, 2, 4, 8]
        .into_iter()
        .filter(|&n| n <= drives.len())
        .collect::<Vec<_>>();
    ktap::diag(format_args!(
        "md RAID0 over {counts:?} of the {} drives: {}",
        drives.len(),
        drives
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    // The first drive's range itself, without md, beside the arrays: what md costs, and
    // fgds's own commands (`direct`) where they take the drive.
    raid0_point(&drives[0], RAID0_MEMBER_OFFSET, 1, "raw")?;
    for n in counts {
        let members = drives[..n]
            .iter()
            .map(|d| (d.as_path(), RAID0_MEMBER_OFFSET))
            .collect::<Vec<_>>();
        let md = fgds_tests::guest::Md::raid0(
            &format!("md_bench{n}"),
            &members,
            RAID0_MEMBER_BYTES,
            RAID0_CHUNK,
        )?;
        match fgds_tests::guest::max_sectors_to_hw(&md.path) {
            Ok(kb) => ktap::diag(format_args!(
                "{}: requests of up to {kb} KiB",
                md.path.display()
            )),
            Err(err) => ktap::diag(format_args!("{}: {err:#}", md.path.display())),
        }
        raid0_point(&md.path, 0, n, "md raid0")?;
        drop(md);
    }
    ktap::pass()
}

/// One array (or the raw drive's range at `offset`) of `drives` drives: `ram`, `direct-mapped`
/// and `ram-again` (with fgds's `direct` after them on the raw drive) at 1 and 4 MiB, depth 32,
/// then `ram` and `direct-mapped` again with no fixed buffers (both pinning their pages per
/// request: what the mapped address costs beyond that). Emits the rows.
fn raid0_point(
    path: &std::path::Path,
    offset: u64,
    drives: usize,
    array: &str,
) -> anyhow::Result<()> {
    let path = path.to_string_lossy().into_owned();
    let span = drives as u64 * RAID0_MEMBER_BYTES;
    for bs in [1u64 << 20, 4 << 20] {
        let qd = 32;
        let bench = |fixed: &str, modes: &[&str]| {
            fgds_bench_fixed(
                fixed,
                &path,
                "read",
                bs,
                qd,
                Amount::Seconds(1.0),
                offset,
                span,
                "5",
                modes,
            )
        };
        let emit = |fixed: &str, rows: Vec<serde_json::Value>| {
            for mut row in rows {
                row["drives"] = serde_json::Value::from(drives);
                row["array"] = serde_json::Value::from(array);
                row["chunk"] = serde_json::Value::from(RAID0_CHUNK);
                row["fixed_buffers_asked"] = serde_json::Value::from(fixed);
                row["set"] = serde_json::Value::from("raid0");
                ktap::diag(format_args!("fgds-bench: {row}"));
            }
        };
        let modes: &[&str] = if array == "raw" {
            &["ram", "direct-mapped", "ram-again", "direct"]
        } else {
            &["ram", "direct-mapped", "ram-again"]
        };
        match bench("auto", modes) {
            Ok(rows) => {
                emit("auto", rows);
                emit("off", bench("off", &["ram", "direct-mapped"])?);
            }
            Err(err) if !format!("{err:#}").contains(MAPPED_REFUSAL) => return Err(err),
            // The mapped address does not reach the array here (fgds bench's refusal): `ram`
            // alone, and why. Any other failure fails the case.
            Err(err) => {
                let text = format!("{err:#}");
                let reason = text.rsplit("fgds: ").next().unwrap_or_default().trim();
                let row = serde_json::json!({
                    "drives": drives, "array": array, "set": "raid0", "op": "read",
                    "block_size": bs, "queue_depth": qd, "mode": "direct-mapped",
                    "fixed_buffers_asked": "auto", "refused": reason,
                });
                ktap::diag(format_args!("fgds-bench: {row}"));
                emit("auto", bench("auto", &["ram", "ram-again"])?);
            }
        }
    }
    Ok(())
}

/// What `fgds bench` says where `direct-mapped`'s mapped address would not reach the file.
const MAPPED_REFUSAL: &str = "its mapped address does not reach the file by DMA";

/// Writes data over a drive's part of the arrays once, so that the bench reads data the
/// host's image holds rather than holes (which the host reads as zeroes, without memory).
fn fill_member(drive: &std::path::Path) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    const CHUNK: usize = 4 << 20;
    let file = fgds_tests::guest::open_direct(drive, true)?;
    let mut buf = fgds_tests::guest::AlignedBuf::new(CHUNK)?;
    for at in (0..RAID0_MEMBER_BYTES).step_by(CHUNK) {
        let offset = RAID0_MEMBER_OFFSET + at;
        fgds_tests::pattern::fill(0x3a1d, offset, buf.as_mut_slice());
        file.write_all_at(buf.as_slice(), offset)
            .with_context(|| format!("cannot write {} at {offset}", drive.display()))?;
    }
    file.sync_all()
        .with_context(|| format!("cannot flush {}", drive.display()))
}

/// What the file system costs: `ram` and `direct` reading and writing a file on each file
/// system the rig mounts, and the raw namespace beside them, at 4 KiB depth 1 and 1 MiB depth
/// 8 (`fgds.bench=files`, `cargo xtask bench --files`). Each row carries `fs`; a file system
/// fgds's commands refuse gives a row with `refused` (the bench's error) instead.
fn files() -> CaseResult {
    if kind() != "files" {
        return ktap::skip("only with fgds.bench=files");
    }
    // What the smallest of the file systems (ext4 in 128 MiB) takes.
    const LEN: u64 = 32 << 20;
    let nvme = fgds_tests::guest::nvme_path()?
        .to_string_lossy()
        .into_owned();
    fgds_tests::guest::max_sectors_to_hw(std::path::Path::new(&nvme))?;
    let mut targets = vec![("raw".to_owned(), nvme, 64u64 << 20)];
    for (fs, var) in [
        ("ext4", "FGDS_EXT4"),
        ("xfs", "FGDS_XFS"),
        ("btrfs", "FGDS_BTRFS"),
    ] {
        let Ok(dir) = std::env::var(var) else {
            ktap::diag(format_args!("no {fs} in this kernel ({var} unset)"));
            continue;
        };
        let path = format!("{dir}/bench.dat");
        let mut data = vec![0u8; LEN as usize];
        fgds_tests::pattern::fill(0xf11e, 0, &mut data);
        std::fs::write(&path, &data)?;
        // SAFETY: sync(2) takes no arguments.
        unsafe { libc::sync() };
        targets.push((fs.to_owned(), path, 0));
    }
    for (fs, path, offset) in &targets {
        let emit = |rows: Vec<serde_json::Value>| {
            for mut row in rows {
                row["fs"] = serde_json::Value::from(fs.as_str());
                row["set"] = serde_json::Value::from("files");
                ktap::diag(format_args!("fgds-bench: {row}"));
            }
        };
        for op in ["read", "write"] {
            for (bs, qd) in [(4u64 << 10, 1u64), (1 << 20, 8)] {
                let amount = Amount::Seconds(if bs == 4 << 10 { 1.5 } else { 0.5 });
                let bench =
                    |modes: &[&str]| fgds_bench(path, op, bs, qd, amount, *offset, LEN, "3", modes);
                match bench(&["ram", "direct"]) {
                    Ok(rows) => emit(rows),
                    // `direct` cannot be set up here (btrfs): `ram` alone, and why.
                    Err(err) => {
                        // The CLI's own error, after its progress lines.
                        let text = format!("{err:#}");
                        let reason = text.rsplit("fgds: ").next().unwrap_or_default().trim();
                        let row = serde_json::json!({
                            "fs": fs, "set": "files", "op": op, "block_size": bs,
                            "queue_depth": qd, "mode": "direct", "refused": reason,
                        });
                        ktap::diag(format_args!("fgds-bench: {row}"));
                        emit(bench(&["ram"])?);
                    }
                }
            }
        }
    }
    ktap::pass()
}

/// The grid to run: `FGDS_BENCH` (kernel parameter `fgds.bench`): `quick`, `profile`, or
/// `full` (or unset) for the full grid.
fn kind() -> String {
    std::env::var("FGDS_BENCH").unwrap_or_default()
}

fn quick() -> bool {
    kind() == "quick"
}

/// Whether this boot is `cargo xtask bench`'s second (`fgds.bench_set=p2pmem`): vgpu with
/// published P2PDMA pages of its own, so that `ram`, `direct` (on those pages) and upstream's
/// `p2pmem` (on the same pages) run side by side, over part of the grid.
fn p2pmem_set() -> bool {
    std::env::var("FGDS_BENCH_SET").is_ok_and(|set| set == "p2pmem")
}

/// How much each repetition of `fgds bench` moves.
#[derive(Clone, Copy)]
enum Amount {
    Bytes(u64),
    Seconds(f64),
}

/// Runs `fgds bench` once and returns its JSON rows, one per mode.
#[allow(clippy::too_many_arguments)]
fn fgds_bench(
    nvme: &str,
    op: &str,
    bs: u64,
    qd: u64,
    amount: Amount,
    offset: u64,
    span: u64,
    repeat: &str,
    modes: &[&str],
) -> anyhow::Result<Vec<serde_json::Value>> {
    let fixed = std::env::var("FGDS_FIXED_BUFFERS").unwrap_or_else(|_| "auto".to_owned());
    fgds_bench_fixed(
        &fixed, nvme, op, bs, qd, amount, offset, span, repeat, modes,
    )
}

/// [`fgds_bench`] with `fgds bench --fixed-buffers FIXED`.
#[allow(clippy::too_many_arguments)]
fn fgds_bench_fixed(
    fixed: &str,
    nvme: &str,
    op: &str,
    bs: u64,
    qd: u64,
    amount: Amount,
    offset: u64,
    span: u64,
    repeat: &str,
    modes: &[&str],
) -> anyhow::Result<Vec<serde_json::Value>> {
    let (amount_flag, amount) = match amount {
        Amount::Bytes(n) => ("--total", n.to_string()),
        Amount::Seconds(s) => ("--seconds", s.to_string()),
    };
    let (bs, qd, offset, span) = (
        bs.to_string(),
        qd.to_string(),
        offset.to_string(),
        span.to_string(),
    );
    let mut args = vec![
        "bench",
        "--vgpu",
        "0",
        "--file",
        nvme,
        "--op",
        op,
        "--block-size",
        &bs,
        "--queue-depth",
        &qd,
        amount_flag,
        &amount,
        "--file-offset",
        &offset,
        "--span",
        &span,
        "--repeat",
        repeat,
        "--fixed-buffers",
        fixed,
        "--json",
    ];
    for mode in modes {
        args.extend(["--mode", mode]);
    }
    // QEMU's own CPU per turn, through the control channel, where the rig has one.
    let port = fgds_tests::ctl::port_path().ok();
    let port = port.as_ref().and_then(|p| p.to_str());
    if let Some(port) = port {
        args.extend(["--host-cpu-port", port]);
    }
    let out = Command::new("/bin/fgds")
        .args(&args)
        .output()
        .context("cannot run /bin/fgds")?;
    ensure!(
        out.status.success(),
        "fgds {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn grid() -> CaseResult {
    if matches!(kind().as_str(), "profile" | "files" | "raid0") {
        return ktap::skip("fgds.bench=profile, files and raid0 run only their own");
    }
    let nvme = fgds_tests::guest::nvme_path()?
        .to_string_lossy()
        .into_owned();
    let (sizes, depths, repeat, seconds): (&[u64], &[u64], &str, f64) = if quick() {
        (&[4 << 10, 64 << 10, 1 << 20, 4 << 20], &[1, 32], "2", 0.5)
    } else if p2pmem_set() {
        (&[64 << 10, 1 << 20, 4 << 20, 16 << 20], &[1, 32], "5", 1.0)
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
            // Five: the host's load comes in bursts of seconds, and the median of three
            // one-second repetitions was still moved by one.
            "5",
            1.0,
        )
    };
    // Requests up to the driver's own limit reach the drive whole, in every mode; `ram-split`
    // caps them at 512 KiB for its own turns (the old baseline, kept as a row).
    let max_kb = fgds_tests::guest::max_sectors_to_hw(std::path::Path::new(&nvme))?;
    ktap::diag(format_args!(
        "the drive takes requests of up to {max_kb} KiB"
    ));
    let sizes = list_override("FGDS_BENCH_SIZES")?.unwrap_or_else(|| sizes.to_vec());
    let depths = list_override("FGDS_BENCH_DEPTHS")?.unwrap_or_else(|| depths.to_vec());
    let modes_override = std::env::var("FGDS_BENCH_MODES").ok();
    for op in ["read", "write"] {
        // Reads cycle through the pattern area; writes through scratch clear of the fault areas.
        let (offset, span) = if op == "read" {
            (0u64, 64u64 << 20)
        } else {
            (64 << 20, 128 << 20)
        };
        for &bs in &sizes {
            for &qd in &depths {
                // A second per repetition (ten turns where at most 512 MiB is in flight). Three
                // at 4 KiB depth 1, where what sets direct apart from bounce, the copy of 4 KiB,
                // is about 1% of a request: the paired turns need that many to show it.
                let amount = Amount::Seconds(if bs == 4 << 10 && qd == 1 {
                    3.0 * seconds
                } else {
                    seconds
                });
                // `ram-again`, a second `ram`, is the control: its ratio to `ram` is the rig's
                // noise at the point. `ram-split` where a request is larger than 512 KiB.
                let mut modes: Vec<&str> = match &modes_override {
                    Some(list) => list.split(',').collect(),
                    None if p2pmem_set() => vec!["ram", "direct", "p2pmem"],
                    None if bs > 512 << 10 => {
                        vec!["ram", "direct", "ram-again", "bounce", "ram-split"]
                    }
                    None => vec!["ram", "direct", "ram-again", "bounce"],
                };
                // Where the kernel has its own dma-buf registered buffers (the comparator
                // kernel), the same GPU memory through them, in the same turns.
                if modes_override.is_none() && fgds::upstream::supported().is_ok() {
                    modes.push("uring-dmabuf");
                }
                let rows = fgds_bench(&nvme, op, bs, qd, amount, offset, span, repeat, &modes)?;
                for row in rows {
                    ktap::diag(format_args!("fgds-bench: {row}"));
                }
            }
        }
    }
    ktap::pass()
}

/// A comma list of numbers from the environment (an experiment's grid), if set.
fn list_override(var: &str) -> anyhow::Result<Option<Vec<u64>>> {
    let Ok(list) = std::env::var(var) else {
        return Ok(None);
    };
    let values = list
        .split(',')
        .map(|v| v.trim().parse::<u64>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("{var}={list}: want a comma list of whole numbers"))?;
    ensure!(!values.is_empty(), "{var} is empty");
    Ok(Some(values))
}

/// REG plus mmap of 1 GiB of GPU memory, and reading 1 GiB into it; also the first open of the
/// GPU's node, which sets its page provider up, and pinning the buffer as a fixed buffer.
fn registration_cost() -> CaseResult {
    const GIB: u64 = 1 << 30;
    if matches!(kind().as_str(), "profile" | "files" | "raid0") {
        return ktap::skip("fgds.bench=profile, files and raid0 run only their own");
    }
    if p2pmem_set() {
        return ktap::skip("the p2pmem boot runs only the grid (fgds takes vgpu's pages there)");
    }
    let info = fgds::Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    if info.bar_size < GIB {
        return ktap::skip(format_args!(
            "the GPU's BAR is {} MiB: run through `cargo xtask bench`, which gives it 1 GiB",
            info.bar_size >> 20
        ));
    }
    let dev = fgds::vgpu::open(0)?;
    let (dmabuf, _) = fgds::vgpu::alloc(&dev, GIB)?;
    // The first open since the GPU's driver bound sets the page provider up: the struct pages
    // over the whole BAR (memremap_pages), once per GPU and bind, not per buffer.
    let unset = info.mode == "none";
    let started = Instant::now();
    let gpu = fgds::Gpu::open(&info.bdf)?;
    let open_s = started.elapsed().as_secs_f64();
    // The first registration after boot took 2.6 ms where every later one, of a new dma-buf
    // on a new file too, took 0.1-0.25 ms: a cost of the code path's first run (under TCG the
    // emulator translates guest code when it first runs), not of the buffer. It is reported
    // as `cold_reg_map_s`, and the next registration is the one measured.
    let started = Instant::now();
    drop(gpu.register(dmabuf.as_fd(), 0, GIB)?);
    let cold_reg_map_s = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let buffer = gpu.register(dmabuf.as_fd(), 0, GIB)?;
    let reg_map_s = started.elapsed().as_secs_f64();
    let nvme = fgds_tests::guest::nvme_path()?;
    fgds_tests::guest::max_sectors_to_hw(&nvme)?;
    let file = fgds::open_direct(&nvme, false)?;
    let mut transfer = Transfer::new(TransferConfig {
        chunk_size: 4 << 20,
        queue_depth: 8,
    })?;
    // The drive's first 128 MiB eight times over (clear of its fault areas at 240 MiB), once
    // unmeasured: the host backs the rig's GPU memory with pages on first touch, at about
    // 0.5 GB/s, which a GPU's memory never does.
    let eighth = (GIB / 8) as usize;
    let mut read_1gib = || -> anyhow::Result<f64> {
        let started = Instant::now();
        for part in 0..8 {
            let range = part * eighth..(part + 1) * eighth;
            transfer.run(Direction::Read, &buffer, range, &file, 0)?;
        }
        Ok(started.elapsed().as_secs_f64())
    };
    let first_read_s = read_1gib()?;
    let read_s = read_1gib()?;
    let row = serde_json::json!({
        "kind": "registration",
        "reg_map_s": reg_map_s,
        "cold_reg_map_s": cold_reg_map_s,
        "provider_setup_s": unset.then_some(open_s),
        "read_1gib_s": read_s,
        "first_read_1gib_s": first_read_s,
        "reg_map_fraction_of_read": reg_map_s / read_s,
    });
    ktap::diag(format_args!("fgds-bench: {row}"));
    ktap::pass()
}

/// Where the guest's CPU time goes while reading 1 GiB, `ram` against `direct`, at the block
/// sizes and queue depths of the acceptance: per function, CPU milliseconds per GiB moved.
fn profile() -> CaseResult {
    const TOTAL: u64 = 1 << 30;
    if kind() != "profile" {
        return ktap::skip("runs with fgds.bench=profile (`cargo xtask bench --profile`)");
    }
    let nvme = fgds_tests::guest::nvme_path()?;
    fgds_tests::guest::max_sectors_to_hw(&nvme)?;
    let nvme = nvme.to_string_lossy().into_owned();
    // Per workload: op, block size, queue depth, bytes. Small blocks move less, so that a
    // workload takes seconds, not minutes, at depth 1 under TCG.
    let workloads = [
        ("read", 1u64 << 20, 1u64, TOTAL),
        ("read", 4 << 20, 1, TOTAL),
        ("read", 4 << 20, 32, TOTAL),
        ("read", 16 << 20, 32, TOTAL),
        ("read", 64 << 10, 32, TOTAL),
        ("read", 4 << 10, 1, 64 << 20),
        ("read", 64 << 10, 1, 256 << 20),
        ("write", 64 << 10, 1, 256 << 20),
    ];
    for (op, bs, qd, total) in workloads {
        // `fgds bench` moves `total` twice: its warm-up repetition, then the measured one.
        let gib = 2.0 * total as f64 / (1u64 << 30) as f64;
        let per_gib = |n: u64| n as f64 * profile::SAMPLE_MS / gib;
        let top = |v: Vec<(String, u64)>, n: usize| {
            v.into_iter()
                .take(n)
                .map(|(f, c)| serde_json::json!([f, per_gib(c)]))
                .collect::<Vec<_>>()
        };
        for mode in ["ram", "direct"] {
            let (rows, prof) = profile::profile(|| {
                fgds_bench(
                    &nvme,
                    op,
                    bs,
                    qd,
                    Amount::Bytes(total),
                    0,
                    64 << 20,
                    "1",
                    &[mode],
                )
            })?;
            let row = serde_json::json!({
                "kind": "profile",
                "mode": mode,
                "op": op,
                "block_size": bs,
                "queue_depth": qd,
                "total_bytes": 2 * total,
                "mib_s": rows.first().map(|r| r["mib_s"].clone()),
                "busy_ms_per_gib": per_gib(prof.busy()),
                "user_ms_per_gib": per_gib(prof.user),
                "idle_samples": prof.idle,
                "lost_samples": prof.lost,
                "self": top(prof.self_time(), 30),
                "inclusive": top(prof.inclusive(), 60),
                "stacks": top(prof.folded(), 25),
            });
            ktap::diag(format_args!("fgds-bench: {row}"));
        }
    }
    // What the drive is asked to do in each mode: one 4 MiB read, its requests and commands.
    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !filesystems.lines().any(|l| l.ends_with("\ttracefs")) {
        return ktap::skip(
            "profiled, but the requests were not traced: this kernel has no tracefs (CONFIG_FTRACE)",
        );
    }
    for mode in ["ram", "direct"] {
        let (_, text) = profile::trace(&["block/block_rq_issue", "nvme/nvme_setup_cmd"], || {
            fgds_bench(
                &nvme,
                "read",
                4 << 20,
                1,
                Amount::Bytes(4 << 20),
                0,
                64 << 20,
                "1",
                &[mode],
            )
        })?;
        for line in text.lines().filter(|l| !l.starts_with('#')).take(40) {
            ktap::diag(format_args!("trace {mode}: {}", line.trim()));
        }
    }
    ktap::pass()
}
