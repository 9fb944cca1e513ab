//! `fgds bench`, in the manner of NVIDIA's gdsio: one workload (direction, block size, queue
//! depth, threads, bytes) through each mode, with throughput, latency and the whole machine's
//! CPU time per GiB, and each mode's throughput as a ratio of `ram` from the same run.
//! The CPU time is the scheduler's run time of every task on every CPU, from /proc/schedstat
//! (the JSON's `cpu_clock` says which clock; see [`CpuSource`]).
//!
//! Modes:
//! - `ram`: into (or out of) RAM as a reader that wants the drive's best has it: 2 MiB aligned,
//!   transparent huge pages asked for (`MADV_HUGEPAGE`), touched, and an io_uring fixed buffer
//!   where the kernel takes one: the drive's ceiling;
//! - `direct`: into a GPU buffer registered with fgds, and nothing of it pinned: fgds moves the
//!   data itself (`FGDS_URING_CMD_READ`/`WRITE`: no mapping, no pin); with
//!   `--fixed-buffers off`, requests name the mapped address and pin its pages
//!   one by one while in flight (GPU memory is never pinned long-term);
//! - `bounce`: what a loader without GPU-direct I/O does (cuFile's compatibility mode): reads
//!   into RAM staging like `ram`'s (pinned as a fixed buffer), then the fastest CPU copy into
//!   the GPU through the exporter's own mapping (`memcpy` or non-temporal stores, whichever
//!   copies faster at start-up), the copy of one slot overlapping the reads of the others: a
//!   slot more than the queue depth, so that the next read is in flight while a slot is copied;
//! - `bounce-serial` (only when asked for, not in `all`): `bounce` without the spare slot, one
//!   slot per request in flight, so that a completed read is copied before its slot takes the
//!   next request; at depth 1 the read and the copy take turns, as a synchronous `cuFileRead()`
//!   in compatibility mode does;
//! - `p2pmem`: into upstream P2PDMA memory, `/sys/bus/pci/devices/<bdf>/p2pmem/allocate`;
//! - `direct-mapped` (only when asked for): into the same registration as `direct`, through its
//!   mapped address: io_uring `READ`/`WRITE` of `O_DIRECT`, each request pinning its pages while
//!   in flight (GPU memory is never an io_uring fixed buffer), the block layer mapping them for
//!   each drive's DMA. This is how the crate reads what fgds's own commands refuse though the
//!   mapping reaches it: md RAID0 whose every member the gate takes (`fgds::gate`). The mode is
//!   refused, with the gate's reason, where the mapped address would not reach the file by DMA;
//! - `uring-dmabuf` (only when asked for): into the same GPU memory as `direct`, through the
//!   kernel's own dma-buf registered buffers where the kernel has them (`fgds::upstream`,
//!   Begunkov's series): the NVMe driver imports the dma-buf, `READ_FIXED`/`WRITE_FIXED` at
//!   offsets into it, no fgds.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fgds::{CpuMapping, Gpu};
use io_uring::squeue::Entry128;
use io_uring::{IoUring, opcode, types};

use crate::Source;
use crate::drive;

/// [`crate::cp::parse_size`] for a `usize` option.
fn size_usize(text: &str) -> Result<usize, String> {
    let n = crate::cp::parse_size(text)?;
    usize::try_from(n).map_err(|_| format!("{text:?} is too large"))
}

#[derive(clap::Args)]
pub struct Options {
    /// The file or block device to read or write (O_DIRECT); defaults to $FGDS_NVME.
    #[arg(long)]
    file: Option<PathBuf>,
    #[command(flatten)]
    source: Source,
    /// Modes to run, in order (repeatable): ram, direct, bounce, p2pmem, or all (those four);
    /// also bounce-serial, ram-again, ram-split, uring-dmabuf and direct-mapped, only when
    /// named.
    #[arg(long = "mode", default_values_t = ["all".to_owned()])]
    modes: Vec<String>,
    /// read (file to memory) or write (memory to file).
    #[arg(long, default_value = "read")]
    op: String,
    /// Bytes per request (`4K`, `1M`, ...).
    #[arg(long, default_value = "1M", value_parser = size_usize)]
    block_size: usize,
    /// Requests in flight per thread.
    #[arg(long, default_value_t = 8)]
    queue_depth: usize,
    /// Threads, each with its own io_uring and its own part of the buffer.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Bytes to move per mode and repetition (`256M`, ...).
    #[arg(long, default_value = "256M", value_parser = crate::cp::parse_size)]
    total: u64,
    /// Run each repetition for this many seconds instead of moving --total bytes.
    #[arg(long)]
    seconds: Option<f64>,
    /// Split each timed repetition into this many turns per mode, the modes taking turns, so
    /// that a burst of load on the host falls on every mode alike. Default: one turn per 0.1 s
    /// where a turn's requests in flight are at most 512 MiB (which a drive at 8 GiB/s
    /// completes in about 60 ms: beyond, a turn would be a single batch of requests), one per
    /// 0.02 s where they are at most 64 KiB (a hundred requests or more, and bursts of the
    /// host's load shorter than 0.1 s then fall on both of a pair), else one.
    #[arg(long)]
    turns: Option<usize>,
    /// Where in the file the I/O starts.
    #[arg(long, default_value = "0", value_parser = crate::cp::parse_size)]
    file_offset: u64,
    /// Bytes of the file the I/O cycles through, from --file-offset.
    #[arg(long, default_value = "64M", value_parser = crate::cp::parse_size)]
    span: u64,
    /// Repetitions of each mode; the median is reported with the spread.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Unrecorded repetitions before them, so that first-touch costs (page faults in the guest
    /// and, under emulation, in the host behind the GPU's memory) are not measured.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Register each thread's memory with its io_uring as a fixed buffer (pinned once, not per
    /// request; `direct`'s registration is put into the ring by fgds instead, unpinned, where
    /// the kernel can revoke it): `auto` where the kernel accepts the memory (and says so where
    /// it does not), `on` (fail where it does not), or `off`.
    #[arg(long, default_value = "auto")]
    fixed_buffers: FixedBuffers,
    /// Print JSON (an array, one object per mode).
    #[arg(long)]
    json: bool,
    /// Under emulation: a port (the rig's control channel, a virtio-serial device) that tells
    /// the emulator's CPU time, asked before and after each turn, so that the JSON has the
    /// host's CPU per GiB of each turn too (`turn_host_cpu_s_per_gib`, `turn_host_io_s_per_gib`).
    #[arg(long)]
    host_cpu_port: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum FixedBuffers {
    Auto,
    On,
    Off,
}

const MODES: &[&str] = &["ram", "direct", "bounce", "p2pmem"];
/// Modes run only when named: variants of a baseline, for experiments and controls.
/// `ram-again` is `ram` a second time, in its own memory: its ratio to `ram` is what the rig's
/// noise alone makes of two identical modes at that point. `ram-split` is `ram` with the drive's
/// requests capped at [`SPLIT_KB`] (`max_sectors_kb`; QEMU's NVMe with its default `mdts` 7
/// takes no more), so that an I/O larger than that is split into several requests, and a
/// `REQ_NOWAIT` one handed from io_uring to an io-wq worker first (the rig's old baseline).
const EXTRA_MODES: &[&str] = &[
    "bounce-serial",
    "ram-again",
    "ram-split",
    "uring-dmabuf",
    "direct-mapped",
];

/// The request size `ram-split` caps the drive at, in KiB.
const SPLIT_KB: u64 = 512;

/// One repetition's figures, summed over its turns.
#[derive(Default)]
struct Sample {
    secs: f64,
    cpu_secs: f64,
    latencies: Vec<Duration>,
    /// MiB/s of each turn.
    turn_mib_s: Vec<f64>,
    /// The median request's latency in each turn, in microseconds: a stall of the host slows
    /// a few requests of a turn, which moves its MiB/s but not this.
    turn_p50_us: Vec<f64>,
    /// The machine's CPU seconds per GiB moved in each turn.
    turn_cpu_s_per_gib: Vec<f64>,
    /// With --host-cpu-port: the emulator's CPU seconds per GiB in each turn, all its threads
    /// and those that are not vCPUs (device emulation, the drive's I/O, DMA).
    turn_host_cpu_s_per_gib: Vec<f64>,
    turn_host_io_s_per_gib: Vec<f64>,
    /// Requests the drive completed in the mode's turns (the block device's `stat`).
    requests: u64,
}

impl Sample {
    fn bytes(&self, opts: &Options) -> u64 {
        self.latencies.len() as u64 * opts.block_size as u64
    }

    /// Mean latency in microseconds.
    fn mean_us(&self) -> f64 {
        let total = self
            .latencies
            .iter()
            .map(Duration::as_secs_f64)
            .sum::<f64>();
        total * 1e6 / self.latencies.len().max(1) as f64
    }

    /// Latency percentile `p` (0 to 1) in microseconds; the latencies must be sorted.
    fn percentile_us(&self, p: f64) -> f64 {
        let lat = &self.latencies;
        lat.get(((lat.len() as f64 - 1.0) * p) as usize)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6)
    }
}

pub fn run(opts: &Options) -> anyhow::Result<()> {
    let file_path = match &opts.file {
        Some(path) => path.clone(),
        None => {
            PathBuf::from(std::env::var_os("FGDS_NVME").context("give --file (or set FGDS_NVME)")?)
        }
    };
    let write = match opts.op.as_str() {
        "read" => false,
        "write" => true,
        other => bail!("--op {other}: use read or write"),
    };
    // `all`: every mode this machine offers. `p2pmem` is offered only where the GPU's driver
    // published P2PDMA memory; where it did not, the JSON says why in a row of its own
    // (`not_offered`), which is not a result. A mode asked for that cannot be set up fails
    // the run.
    let mut not_offered = Vec::new();
    let modes = if opts.modes.iter().any(|m| m == "all") {
        let mut modes = vec!["ram".to_owned(), "direct".to_owned(), "bounce".to_owned()];
        match p2pmem_offered(opts) {
            Ok(_) => modes.push("p2pmem".to_owned()),
            Err(reason) => not_offered.push(("p2pmem", format!("{reason:#}"))),
        }
        modes
    } else {
        opts.modes.clone()
    };
    if let Some(bad) = modes
        .iter()
        .find(|m| !MODES.contains(&m.as_str()) && !EXTRA_MODES.contains(&m.as_str()))
    {
        bail!(
            "unknown mode {bad}: use {}, or all",
            [MODES, EXTRA_MODES].concat().join(", ")
        );
    }
    if opts.block_size == 0 || opts.queue_depth == 0 || opts.threads == 0 || opts.repeat == 0 {
        bail!("block size, queue depth, threads and repeat must be non-zero");
    }
    let file = fgds::open_direct(&file_path, write)?;
    let drive = drive::Drive::of(&file_path)?;
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();

    // Every mode is set up first, then the repetitions take turns (ram, direct, bounce, ram,
    // ...), so that a burst of load on the host hits every mode alike instead of whichever
    // mode happened to run then: the ratios to ram are what the bench is for.
    let mut rows = not_offered
        .into_iter()
        .map(|(mode, reason)| {
            eprintln!("bench: {mode}: not offered here: {reason}");
            serde_json::json!({"kernel": kernel, "mode": mode, "op": opts.op, "not_offered": reason})
        })
        .collect::<Vec<_>>();
    let mut runs = Vec::new();
    for mode in &modes {
        let region = region_len(opts, slot_count(opts, mode == "bounce"));
        let target = make_target(mode, opts, region * opts.threads, write)
            .with_context(|| format!("mode {mode} cannot be set up, so it cannot be measured"))?;
        if let Target::Direct {
            buffer,
            mapped: true,
            ..
        } = &target
        {
            let why = mapping_reaches(buffer, &file, write).with_context(|| {
                format!(
                    "mode {mode} cannot be measured on {}: its mapped address does not reach \
                     the file by DMA",
                    file_path.display()
                )
            })?;
            eprintln!("bench: {mode}: {why}");
        }
        let (rings, fixed) = match make_rings(&target, opts, region, &file) {
            Ok(made) => made,
            Err(err) => bail!("{mode}: {err:#}"),
        };
        match &fixed {
            Err(reason) => eprintln!(
                "bench: {mode}: no fixed buffers ({reason}); requests pin their pages one by one"
            ),
            Ok(Fixed::Command) => eprintln!(
                "bench: {mode}: fgds moves the data itself, through FGDS_URING_CMD_READ/WRITE"
            ),
            Ok(Fixed::Dmabuf) => eprintln!(
                "bench: {mode}: the NVMe driver imports the dma-buf (the kernel's dma-buf buffers)"
            ),
            Ok(Fixed::Pinned) => {}
        }
        runs.push(ModeRun {
            max_sectors_kb: (mode == "ram-split").then_some(SPLIT_KB),
            mode: mode.clone(),
            target,
            region,
            rings,
            fixed,
            ready: vec![None; opts.threads],
            samples: Vec::new(),
        });
    }
    let clock = CpuSource::detect();
    // A clock that cannot be read fails the run here, before any I/O.
    cpu_clock(clock)?;
    let turns = turns(opts);
    // The modes compared with each other (the first two, and `ram-again` where it follows
    // them) rotate through the first places round by round, so that each follows the last mode
    // (bounce, whose turn leaves the next one cheaper and slower) as often as the others do;
    // turns are compared over as many rounds as they rotate through (`paired_ratio`).
    let rotation = rotation(&modes).min(runs.len()).max(1);
    let mut round = 0usize;
    for (what, count) in [("warm-up", opts.warmup), ("repetition", opts.repeat)] {
        for rep in 0..count {
            let mut samples = runs.iter().map(|_| Sample::default()).collect::<Vec<_>>();
            for _ in 0..turns {
                let mut order = (0..runs.len()).collect::<Vec<_>>();
                if order.len() > rotation {
                    order[..rotation].rotate_left(round % rotation);
                }
                round += 1;
                for i in order {
                    let (run, sample) = (&mut runs[i], &mut samples[i]);
                    eprint!(
                        "\rbench: {} {} {} KiB qd {} x{}: {what} {}/{count}   ",
                        run.mode,
                        opts.op,
                        opts.block_size >> 10,
                        opts.queue_depth,
                        opts.threads,
                        rep + 1,
                    );
                    run_turn(run, turns, &file, &drive, opts, write, clock, sample)?;
                }
            }
            if what == "repetition" {
                for (run, mut sample) in runs.iter_mut().zip(samples) {
                    sample.latencies.sort();
                    run.samples.push(sample);
                }
            }
        }
    }
    eprintln!();
    // How the host backs the GPU's memory and the guest's RAM, once the turns have touched them.
    let host_backing = opts
        .host_cpu_port
        .as_deref()
        .map(host_backing)
        .transpose()?;
    let limits = drive.limits();
    let mut ram_turns = None;
    for run in runs {
        release_rings(&run.rings);
        let details = run.target.details();
        let ModeRun {
            mode,
            samples,
            fixed,
            max_sectors_kb: run_max_sectors_kb,
            ..
        } = run;
        // The repetition of median throughput gives the rate and the latencies; CPU per GiB
        // is the median of its own, so that one repetition that caught a burst on the host
        // moves neither.
        let rate = |s: &Sample| s.bytes(opts) as f64 / (1 << 20) as f64 / s.secs;
        let cpu_per_gib =
            |s: &Sample| s.cpu_secs / (s.bytes(opts).max(1) as f64 / (1u64 << 30) as f64);
        let mut order = (0..samples.len()).collect::<Vec<_>>();
        order.sort_by(|&a, &b| rate(&samples[a]).total_cmp(&rate(&samples[b])));
        let mid = &samples[order[order.len() / 2]];
        let median = rate(mid);
        let rates = order.iter().map(|&i| rate(&samples[i])).collect::<Vec<_>>();
        let turn_mib_s = samples
            .iter()
            .flat_map(|s| s.turn_mib_s.iter().copied())
            .collect::<Vec<_>>();
        let turn_p50_us = samples
            .iter()
            .flat_map(|s| s.turn_p50_us.iter().copied())
            .collect::<Vec<_>>();
        // CPU time per turn, to pair as throughput is (with /proc/stat's 10 ms steps only the
        // repetitions' sums mean much).
        let turn_cpu_s_per_gib = samples
            .iter()
            .flat_map(|s| s.turn_cpu_s_per_gib.iter().copied())
            .collect::<Vec<_>>();
        let turn_host = |f: fn(&Sample) -> &Vec<f64>| {
            samples
                .iter()
                .flat_map(|s| f(s).iter().copied())
                .collect::<Vec<_>>()
        };
        let rep_cpu_s_per_gib = samples.iter().map(cpu_per_gib).collect::<Vec<_>>();
        let ios = samples
            .iter()
            .map(|s| s.latencies.len() as u64)
            .sum::<u64>();
        let requests = samples.iter().map(|s| s.requests).sum::<u64>();
        let mut cpus = rep_cpu_s_per_gib.clone();
        cpus.sort_by(f64::total_cmp);
        if mode == "ram" {
            ram_turns = Some(turn_mib_s.clone());
        }
        let mut row = serde_json::json!({
            "kernel": kernel,
            "mode": mode,
            "op": opts.op,
            "block_size": opts.block_size,
            "queue_depth": opts.queue_depth,
            "threads": opts.threads,
            "total_bytes": mid.bytes(opts),
            "repetitions": opts.repeat,
            "turns": turns,
            "warmup": opts.warmup,
            "mib_s": median,
            "mib_s_min": rates[0],
            "mib_s_max": rates[rates.len() - 1],
            "cpu_s_per_gib": cpus[cpus.len() / 2],
            "cpu_s_per_gib_min": cpus[0],
            "cpu_s_per_gib_max": cpus[cpus.len() - 1],
            "p50_us": mid.percentile_us(0.5),
            "p99_us": mid.percentile_us(0.99),
            "mean_us": mid.mean_us(),
            "secs": mid.secs,
            "turn_mib_s": turn_mib_s,
            "turn_p50_us": turn_p50_us,
            "rep_cpu_s_per_gib": rep_cpu_s_per_gib,
            "turn_cpu_s_per_gib": turn_cpu_s_per_gib,
            "cpu_clock": clock.name(),
            "turn_host_cpu_s_per_gib": turn_host(|s| &s.turn_host_cpu_s_per_gib),
            "turn_host_io_s_per_gib": turn_host(|s| &s.turn_host_io_s_per_gib),
            "ratio_to_ram": ram_turns.as_deref().and_then(|r| paired_ratio(&turn_mib_s, r, rotation)),
            "rotation": rotation,
            "requests_per_io": requests as f64 / ios.max(1) as f64,
            "drive": limits,
            "drive_max_sectors_kb_in_turns": run_max_sectors_kb,
            "host_backing": host_backing,
            "fixed_buffers": fixed.is_ok(),
            "fixed_buffer_kind": fixed.as_ref().ok().map(|kind| match kind {
                Fixed::Pinned => "pinned",
                Fixed::Dmabuf => "kernel-dmabuf",
                Fixed::Command => "fgds-io-commands",
            }),
            "fixed_buffers_refused": fixed.err(),
        });
        if let (Some(row), serde_json::Value::Object(details)) = (row.as_object_mut(), details) {
            row.extend(details);
        }
        rows.push(row);
    }
    if opts.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    for row in rows.iter().filter(|r| r["not_offered"].is_null()) {
        println!("{}", gdsio_line(row));
    }
    println!(
        "{:<8} {:>10} {:>17} {:>10} {:>9} {:>9} {:>8}",
        "mode", "MiB/s", "spread", "CPU s/GiB", "p50 us", "p99 us", "x ram"
    );
    for row in &rows {
        if let Some(reason) = row["not_offered"].as_str() {
            println!(
                "{:<8} not offered here: {reason}",
                row["mode"].as_str().unwrap_or("")
            );
            continue;
        }
        let ratio = row["ratio_to_ram"]
            .as_f64()
            .map_or("-".to_owned(), |r| format!("{r:.2}"));
        println!(
            "{:<8} {:>10.1} {:>8.1}-{:<8.1} {:>10.3} {:>9.0} {:>9.0} {:>8}",
            row["mode"].as_str().unwrap_or(""),
            row["mib_s"].as_f64().unwrap_or(0.0),
            row["mib_s_min"].as_f64().unwrap_or(0.0),
            row["mib_s_max"].as_f64().unwrap_or(0.0),
            row["cpu_s_per_gib"].as_f64().unwrap_or(0.0),
            row["p50_us"].as_f64().unwrap_or(0.0),
            row["p99_us"].as_f64().unwrap_or(0.0),
            ratio
        );
    }
    Ok(())
}

/// A row as gdsio prints a result, for comparison with GDS's own tool: I/O type, transfer type
/// (`GPUD` for fgds's direct path and the kernel's P2PDMA or dma-buf paths, `CPUONLY` for RAM,
/// `CPU_GPU` for a copy through RAM), threads, data set, I/O size, GiB/s, mean latency.
fn gdsio_line(row: &serde_json::Value) -> String {
    let mode = row["mode"].as_str().unwrap_or_default();
    let xfer = match mode {
        "direct" | "direct-mapped" | "p2pmem" | "uring-dmabuf" => "GPUD",
        "ram" | "ram-again" | "ram-split" => "CPUONLY",
        "bounce" | "bounce-serial" => "CPU_GPU",
        other => other,
    };
    let kib = |key: &str| row[key].as_u64().unwrap_or_default() / 1024;
    let bytes = row["total_bytes"].as_u64().unwrap_or_default();
    let secs = row["secs"].as_f64().unwrap_or_default();
    let io_size = row["block_size"].as_u64().unwrap_or(1).max(1);
    format!(
        "IoType: {} XferType: {xfer} ({mode}) Threads: {} DataSetSize: {}/{}(KiB) IOSize: {}(KiB) \
         Throughput: {:.6} GiB/sec, Avg_Latency: {:.6} usecs ops: {} total_time {secs:.6} secs",
        row["op"].as_str().unwrap_or_default().to_uppercase(),
        row["threads"].as_u64().unwrap_or(1),
        bytes / 1024,
        bytes / 1024,
        kib("block_size"),
        row["mib_s"].as_f64().unwrap_or_default() / 1024.0,
        row["mean_us"].as_f64().unwrap_or_default(),
        bytes / io_size,
    )
}

/// Memory a mode moves data into or out of; kept alive for the mode's repetitions.
/// One mode of a run: its memory, its rings and the repetitions measured so far.
struct ModeRun {
    mode: String,
    /// The drive's `max_sectors_kb` for this mode's turns (`ram-split`), restored after each.
    max_sectors_kb: Option<u64>,
    target: Target,
    /// Bytes of the target each thread's requests cycle through.
    region: usize,
    rings: Vec<Ring>,
    fixed: Result<Fixed, String>,
    /// `bounce` writes: per thread, the staging slot already holding the next request's data.
    ready: Vec<Option<usize>>,
    samples: Vec<Sample>,
}

enum Target {
    Ram(Anon),
    /// The registration is dropped before the memory it covers (fields drop in order).
    /// `mapped`: requests name the registration's mapped address (`direct-mapped`), not its
    /// token.
    Direct {
        buffer: fgds::Buffer,
        _dmabuf: crate::Dmabuf,
        mapped: bool,
    },
    /// The GPU side is dropped before the RAM it may have pinned. `spare`: a slot more than
    /// the queue depth (`bounce`), or none (`bounce-serial`).
    Bounce {
        gpu: BounceCopy,
        ram: Anon,
        spare: bool,
    },
    P2pmem(Anon),
    /// GPU memory the NVMe driver imports (the kernel's dma-buf registered buffers).
    UringDmabuf {
        dmabuf: crate::Dmabuf,
    },
}

/// How `bounce` copies between RAM and the GPU: through the exporter's CPU mapping of the
/// dma-buf with the faster of two CPU copies, or with CUDA's copies from RAM it pinned (as a
/// CUDA program's loader would; a CUDA dma-buf has no CPU mapping, and this needs no fgds).
enum BounceCopy {
    Mapping {
        map: CpuMapping,
        copy: CpuCopy,
        _dmabuf: crate::Dmabuf,
    },
    Cuda {
        _pinned: fgds::cuda::HostRegistration,
        memory: fgds::cuda::DeviceMemory,
    },
}

impl Target {
    /// Where the I/O goes.
    fn io_ptr(&self) -> *mut u8 {
        match self {
            Target::Ram(a) | Target::P2pmem(a) | Target::Bounce { ram: a, .. } => a.ptr,
            Target::Direct { buffer, .. } => buffer.as_ptr(),
            // Requests name offsets into the dma-buf, from 0.
            Target::UringDmabuf { .. } => std::ptr::null_mut(),
        }
    }

    /// What the JSON row says of the mode's memory: how much of the RAM is in huge pages, and
    /// which copy `bounce` makes.
    fn details(&self) -> serde_json::Value {
        match self {
            Target::Ram(ram) => serde_json::json!({"huge_page_fraction": ram.huge_page_fraction()}),
            Target::Bounce { gpu, ram, spare } => serde_json::json!({
                "huge_page_fraction": ram.huge_page_fraction(),
                "bounce_spare_slot": spare,
                "bounce_copy": match gpu {
                    BounceCopy::Mapping { copy, .. } => copy.name(),
                    BounceCopy::Cuda { .. } => "cuda",
                },
            }),
            Target::Direct { .. } | Target::P2pmem(_) | Target::UringDmabuf { .. } => {
                serde_json::json!({})
            }
        }
    }
}

/// An mmap'd region (anonymous RAM, or the p2pmem allocator's).
struct Anon {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain address range; threads use disjoint parts of it.
unsafe impl Sync for Anon {}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping this value was made from.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

impl Anon {
    /// The share of the mapping the kernel backs with transparent huge pages
    /// (`AnonHugePages` of its entry in /proc/self/smaps), or None where that cannot be read.
    fn huge_page_fraction(&self) -> Option<f64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let start = format!("{:x}-", self.ptr as usize);
        let entry = smaps
            .split_inclusive('\n')
            .skip_while(|l| !l.starts_with(&start));
        let kib = entry
            .skip(1)
            .take_while(|l| {
                l.split_whitespace()
                    .next()
                    .is_some_and(|k| k.ends_with(':'))
            })
            .find_map(|l| l.strip_prefix("AnonHugePages:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?;
        Some((kib << 10) as f64 / self.len as f64)
    }
}

/// Transparent huge pages are 2 MiB on x86-64 and on arm64 with 4 KiB pages.
const HUGE_PAGE: usize = 2 << 20;

/// RAM as a reader who wants the drive's best has it: a private anonymous mapping of `len`
/// bytes rounded up to 2 MiB, at a 2 MiB aligned address, with transparent huge pages asked
/// for and every page touched, so that neither page faults nor 4 KiB pages are measured.
fn ram(len: usize) -> anyhow::Result<Anon> {
    let len = len.next_multiple_of(HUGE_PAGE);
    let reserve = len + HUGE_PAGE;
    // SAFETY: a new private anonymous mapping aliases nothing.
    let base = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            reserve,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }? as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    // SAFETY: the head and tail cut off lie inside the mapping just made, which nothing uses.
    unsafe {
        if start > base {
            rustix::mm::munmap(base as *mut _, start - base)?;
        }
        if base + reserve > start + len {
            rustix::mm::munmap((start + len) as *mut _, base + reserve - start - len)?;
        }
    }
    let ram = Anon {
        ptr: start as *mut u8,
        len,
    };
    // Without THP support the advice fails, and the row's `huge_page_fraction` says so.
    // SAFETY: advice on this value's own mapping, which nothing else uses.
    let advised =
        unsafe { rustix::mm::madvise(ram.ptr.cast(), len, rustix::mm::Advice::LinuxHugepage) };
    if let Err(err) = advised {
        eprintln!("bench: MADV_HUGEPAGE refused ({err}): RAM in 4 KiB pages");
    }
    // SAFETY: the mapping is `len` bytes and writable.
    unsafe { std::ptr::write_bytes(ram.ptr, 0, len) };
    Ok(ram)
}

fn make_target(mode: &str, opts: &Options, len: usize, write: bool) -> anyhow::Result<Target> {
    match mode {
        "ram" | "ram-again" | "ram-split" => Ok(Target::Ram(ram(len)?)),
        "direct" | "direct-mapped" => {
            // Whole 2 MiB, as `ram` gets: GPU memory comes in large allocations, and fgds maps
            // a buffer's aligned 2 MiB with PMDs, a smaller one 4 KiB at a time.
            let len = len.next_multiple_of(HUGE_PAGE);
            let (gpu, dmabuf) = crate::resolve(&opts.source, len as u64)?;
            Ok(Target::Direct {
                buffer: gpu.register(dmabuf.fd(), 0, len as u64)?,
                _dmabuf: dmabuf,
                mapped: mode == "direct-mapped",
            })
        }
        "bounce" | "bounce-serial" => {
            let ram = ram(len)?;
            let gpu = match opts.source.cuda {
                Some(ordinal) => {
                    let device = fgds::cuda::Cuda::load()?.device(ordinal)?;
                    BounceCopy::Cuda {
                        // SAFETY: `ram` is a live mapping of `len` bytes, and the
                        // registration is dropped before it (field order of `Target::Bounce`).
                        _pinned: unsafe { device.register_host(ram.ptr, ram.len) }?,
                        memory: device.alloc(len as u64)?,
                    }
                }
                None => {
                    let (_, dmabuf) = crate::resolve(&opts.source, len as u64)?;
                    let map = CpuMapping::new(dmabuf.fd(), len)
                        .context("the exporter's CPU mapping of the dma-buf")?;
                    BounceCopy::Mapping {
                        copy: fastest_copy(&map, &ram, !write),
                        map,
                        _dmabuf: dmabuf,
                    }
                }
            };
            Ok(Target::Bounce {
                gpu,
                ram,
                spare: mode == "bounce",
            })
        }
        "p2pmem" => p2pmem(opts, len.next_multiple_of(HUGE_PAGE)).map(Target::P2pmem),
        "uring-dmabuf" => {
            fgds::upstream::supported().map_err(|not| anyhow::format_err!("{}", not.reason))?;
            // The same GPU memory as `direct`'s: whole 2 MiB.
            let (_, dmabuf) = crate::resolve(&opts.source, len.next_multiple_of(HUGE_PAGE) as u64)?;
            Ok(Target::UringDmabuf { dmabuf })
        }
        _ => unreachable!("modes are checked in run"),
    }
}

/// The GPU's `p2pmem/allocate`, where its driver published P2PDMA memory, else why not.
fn p2pmem_offered(opts: &Options) -> anyhow::Result<PathBuf> {
    let bdf = match &opts.source.gpu {
        Some(bdf) => bdf.clone(),
        None => Gpu::list()?
            .first()
            .map(|g| g.bdf.clone())
            .context("no GPU to take p2pmem from")?,
    };
    let dir = PathBuf::from(format!("/sys/bus/pci/devices/{bdf}/p2pmem"));
    if !dir.join("allocate").exists() {
        bail!(
            "{} does not exist: this kernel has no userspace p2pmem (it needs CONFIG_PCI_P2PDMA and Linux 6.2+) or the GPU's driver registered no P2PDMA memory",
            dir.join("allocate").display()
        );
    }
    let published = std::fs::read_to_string(dir.join("published")).unwrap_or_default();
    if published.trim() != "1" {
        bail!("{bdf}'s P2PDMA memory is not published, so p2pmem/allocate cannot hand it out");
    }
    Ok(dir.join("allocate"))
}

fn p2pmem(opts: &Options, len: usize) -> anyhow::Result<Anon> {
    let allocate = p2pmem_offered(opts)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&allocate)
        .with_context(|| format!("cannot open {}", allocate.display()))?;
    // SAFETY: a new shared mapping at a kernel-chosen address aliases nothing; it is only used
    // as an I/O address.
    let ptr = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            f.as_fd(),
            0,
        )
    }
    .context("mmap of p2pmem/allocate")?;
    Ok(Anon {
        ptr: ptr.cast(),
        len,
    })
}

/// Most memory a thread's requests cycle through: deep queues of large blocks share slots (a
/// benchmark does not care what the data is), so that they fit a GPU's BAR.
const MAX_REGION: usize = 128 << 20;

/// Slots of a thread's region: one per request in flight, and with a `spare` (`bounce`) one
/// more, which a read goes into while a completed slot is copied (or, writing, which is filled
/// for the next request while the others are in flight).
fn slot_count(opts: &Options, spare: bool) -> usize {
    opts.queue_depth + usize::from(spare)
}

/// Bytes of target memory per thread: one block per slot, up to [`MAX_REGION`].
fn region_len(opts: &Options, slots: usize) -> usize {
    let bs = opts.block_size;
    (bs * slots).min(MAX_REGION.max(bs)) / bs * bs
}

/// Where slot `slot` lies in a thread's region.
fn slot_offset(slot: usize, bs: usize, region: usize) -> usize {
    (slot * bs) % region
}

/// Turns per repetition (`--turns`, or the default it describes).
fn turns(opts: &Options) -> usize {
    const SHORT_TURNS_IN_FLIGHT: usize = 64 << 10;
    const MAX_IN_FLIGHT: usize = 512 << 20;
    if let Some(turns) = opts.turns {
        return turns.max(1);
    }
    let Some(secs) = opts.seconds else {
        return 1;
    };
    let turn_secs = match opts.block_size * opts.queue_depth * opts.threads {
        n if n <= SHORT_TURNS_IN_FLIGHT => 0.02,
        n if n <= MAX_IN_FLIGHT => 0.1,
        _ => return 1,
    };
    ((secs / turn_secs) as usize).max(1)
}

/// Where the machine's CPU time comes from.
///
/// The scheduler's run time of every task on every CPU (/proc/schedstat's `rq_cpu_time`,
/// counted in nanoseconds at each context switch) is the default. It leaves out interrupts
/// taken while a CPU idles, and counts a task's stint on a CPU when the stint ends, so a
/// stint in progress at a reading falls after it (the reader's own: a turn's bookkeeping,
/// microseconds). The alternative, wall time less idle time as /proc/stat prints it, is kept
/// where there is no /proc/schedstat: its 10 ms units cannot measure a turn of 0.1 s that keeps
/// the machine busy for a few ms, and from 7.x on the kernel counts idle time partly by the
/// 4 ms tick, which over-counts it for a process that sleeps thousands of times a second
/// (docs/performance.md).
#[derive(Clone, Copy, PartialEq, Eq)]
enum CpuSource {
    Schedstat,
    ProcStat,
}

impl CpuSource {
    /// /proc/schedstat where its CPU lines are known to hold `rq_cpu_time` in column 7
    /// (versions 15 to 17, kernels 4.x to 7.x), else /proc/stat, saying so.
    fn detect() -> CpuSource {
        let text = std::fs::read_to_string("/proc/schedstat").unwrap_or_default();
        let version = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("version "))
            .and_then(|v| v.trim().parse::<u32>().ok());
        match version {
            Some(15..=17) => CpuSource::Schedstat,
            _ => {
                eprintln!(
                    "bench: no /proc/schedstat of a known version ({version:?}; the kernel needs \
                     CONFIG_SCHEDSTATS): CPU time from /proc/stat, in 10 ms steps"
                );
                CpuSource::ProcStat
            }
        }
    }

    /// As the JSON's `cpu_clock` names it.
    fn name(self) -> &'static str {
        match self {
            CpuSource::Schedstat => "schedstat-ns",
            CpuSource::ProcStat => "proc-stat-10ms",
        }
    }
}

/// The machine's CPU clocks at one moment: the monotonic clock, and the CPUs' summed run time
/// (schedstat) or idle time (/proc/stat) in seconds, with how many CPUs there are.
struct CpuClock {
    at: Instant,
    cpus: u32,
    secs: f64,
}

/// Reads the CPU clocks.
fn cpu_clock(source: CpuSource) -> anyhow::Result<CpuClock> {
    // Which line holds the figure and in which columns (counting the name as 0): each CPU's
    // line "cpuN ..." in /proc/schedstat; in /proc/stat the first line, "cpu ...", whose idle
    // and iowait sum the CPUs' before they are printed in 10 ms units (a sum of the per-CPU
    // lines would add a unit of error per CPU).
    let (path, per_cpu_figures, columns, unit_secs) = match source {
        CpuSource::Schedstat => ("/proc/schedstat", true, 7..8, 1e-9),
        // SAFETY: sysconf has no preconditions.
        CpuSource::ProcStat => (
            "/proc/stat",
            false,
            4..6,
            1.0 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64,
        ),
    };
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    let at = Instant::now();
    let mut cpus = 0;
    let mut total = 0u64;
    for line in text.lines() {
        let fields = line.split_whitespace().collect::<Vec<_>>();
        let per_cpu = match fields.first() {
            Some(&"cpu") => false,
            Some(name) if name.starts_with("cpu") => true,
            _ => continue,
        };
        cpus += u32::from(per_cpu);
        if per_cpu != per_cpu_figures {
            continue;
        }
        for c in columns.clone() {
            total += fields
                .get(c)
                .and_then(|v| v.parse::<u64>().ok())
                .with_context(|| format!("{path}: no figure in column {c} of {line:?}"))?;
        }
    }
    if cpus == 0 {
        bail!("{path}: no per-CPU lines");
    }
    Ok(CpuClock {
        at,
        cpus,
        secs: total as f64 * unit_secs,
    })
}

/// CPU seconds the whole machine was busy between two readings. Under /proc/stat that is
/// `cpus * wall - idle`, which the tick's sampling can make come out below zero.
fn busy_secs(source: CpuSource, from: &CpuClock, to: &CpuClock) -> f64 {
    let grew = to.secs - from.secs;
    match source {
        CpuSource::Schedstat => grew,
        CpuSource::ProcStat => {
            f64::from(to.cpus) * to.at.duration_since(from.at).as_secs_f64() - grew
        }
    }
}

/// One request line on the port of --host-cpu-port (the rig's control channel,
/// qemu/src/control.rs; opened per request, as the rig's other clients do): the reply's text
/// after `ok `, or why there is none.
fn host_request(port: &Path, request: &str, want: &str) -> anyhow::Result<String> {
    use std::io::{BufRead, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(port)
        .with_context(|| format!("cannot open --host-cpu-port {}", port.display()))?;
    file.write_all(format!("{request}\n").as_bytes())?;
    let mut reply = String::new();
    std::io::BufReader::new(file).read_line(&mut reply)?;
    reply
        .trim()
        .strip_prefix("ok ")
        .map(str::to_owned)
        .with_context(|| {
            format!(
                "--host-cpu-port {}: `{request}` got {:?}, want `ok {want}`",
                port.display(),
                reply.trim()
            )
        })
}

/// The emulator's CPU time so far, in nanoseconds, all its threads and its vCPU threads
/// (`qemu_cpu`: `ok <all> <vcpus>`).
fn host_cpu(port: &Path) -> anyhow::Result<(u64, u64)> {
    let reply = host_request(port, "qemu_cpu", "<ns> <ns>")?;
    reply
        .split_once(' ')
        .and_then(|(a, v)| Some((a.parse::<u64>().ok()?, v.parse::<u64>().ok()?)))
        .with_context(|| format!("`qemu_cpu` got {reply:?}, want two numbers of nanoseconds"))
}

/// How the host backs the GPU's memory and the guest's RAM (`qemu_backing`: `ok <json>`).
fn host_backing(port: &Path) -> anyhow::Result<serde_json::Value> {
    let json = host_request(port, "qemu_backing", "<json>")?;
    serde_json::from_str(&json).context("the reply to `qemu_backing` is not JSON")
}

/// A thread's io_uring: 128-byte entries for every mode (see [`make_rings`]).
type Ring = IoUring<Entry128>;

/// How a mode's rings hold its memory as their fixed buffer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Fixed {
    /// `IORING_REGISTER_BUFFERS`: pinned once; requests name it by address.
    Pinned,
    /// `direct`: no fixed buffer; fgds moves the data itself (`FGDS_URING_CMD_READ`/`WRITE`),
    /// requests naming the registration's token and an offset into it.
    Command,
    /// `uring-dmabuf`: the dma-buf registered as the kernel's dma-buf buffer 0; requests name
    /// byte offsets into it.
    Dmabuf,
}

/// One io_uring per thread, each with its part of the target registered as its fixed buffer
/// where `--fixed-buffers` asks for it; the second value says how they are, or why not. Every
/// mode's rings have 128-byte entries, which `direct`'s commands need, so that the modes differ
/// in their memory only.
fn make_rings(
    target: &Target,
    opts: &Options,
    region: usize,
    file: &File,
) -> anyhow::Result<(Vec<Ring>, Result<Fixed, String>)> {
    let mut rings = (0..opts.threads)
        .map(|_| IoUring::<Entry128>::builder().build(opts.queue_depth.next_power_of_two() as u32))
        .collect::<std::io::Result<Vec<_>>>()
        .context("io_uring_setup")?;
    if let Target::UringDmabuf { dmabuf } = target {
        // The mode is the registration: no `--fixed-buffers off` for it.
        for ring in &rings {
            ring.submitter()
                .register_buffers_sparse(1)
                .context("a sparse io_uring buffer table")?;
            fgds::upstream::register_in(ring, 0, dmabuf.fd(), file.as_fd()).map_err(|err| {
                anyhow::format_err!(
                    "the kernel did not register the dma-buf for the file: {}",
                    fgds::upstream::refusal(&err).reason
                )
            })?;
        }
        return Ok((rings, Ok(Fixed::Dmabuf)));
    }
    if opts.fixed_buffers == FixedBuffers::Off {
        return Ok((rings, Err("--fixed-buffers off".to_owned())));
    }
    if let Target::Direct { mapped: true, .. } = target {
        return Ok((
            rings,
            Err("the mapped address: GPU memory is never pinned long-term".to_owned()),
        ));
    }
    if let Target::Direct { buffer, .. } = target {
        return match fgds_commands(&mut rings[0], buffer) {
            Ok(()) => Ok((rings, Ok(Fixed::Command))),
            Err(why) if opts.fixed_buffers == FixedBuffers::On => {
                bail!("{why} (--fixed-buffers on)")
            }
            Err(why) => Ok((rings, Err(why))),
        };
    }
    for (t, ring) in rings.iter().enumerate() {
        let iov = libc::iovec {
            // SAFETY: thread `t`'s region lies inside the target's memory.
            iov_base: unsafe { target.io_ptr().add(t * region) }.cast(),
            iov_len: region,
        };
        // SAFETY: the memory stays mapped until the rings are dropped, which `run` does before
        // the target (and `release_rings` unregisters it first).
        if let Err(err) = unsafe { ring.submitter().register_buffers(&[iov]) } {
            let reason = format!("io_uring refused the memory as a fixed buffer: {err}");
            if opts.fixed_buffers == FixedBuffers::On {
                bail!("{reason} (--fixed-buffers on)");
            }
            release_rings(&rings[..t]);
            return Ok((rings, Err(reason)));
        }
    }
    Ok((rings, Ok(Fixed::Pinned)))
}

/// Whether the registration's mapped address reaches `file` by DMA, as the crate decides
/// before it reads through it: fgds's gate takes the file, or refuses it only because its queue
/// may merge (user pages never merge), or it is on a disk without a PCI device (md) whose every
/// member the gate takes. Says which, or fails with the gate's reason.
fn mapping_reaches(buffer: &fgds::Buffer, file: &File, write: bool) -> anyhow::Result<String> {
    use fgds::gate::{Gate, Verdict, describe_members};
    let verdict = buffer
        .check_file(file, write)
        .context("FGDS_IOCTL_CHECK_FILE")?;
    match verdict.gate {
        Gate::Direct | Gate::Merges => Ok(format!(
            "fgds's gate takes the file ({}): requests name the mapped address",
            verdict.gate.name()
        )),
        Gate::NoPci => {
            let members = buffer.check_members(file, write);
            let all = !members.is_empty()
                && members
                    .iter()
                    .all(|(_, v)| v.as_ref().is_ok_and(Verdict::mapping_reaches));
            if all {
                Ok(format!(
                    "every member reaches the GPU ({}): requests name the mapped address",
                    describe_members(&members)
                ))
            } else if members.is_empty() {
                bail!("{}, and it has no members to check", verdict.explain())
            } else {
                bail!("{}", describe_members(&members))
            }
        }
        _ => bail!("{}", verdict.explain()),
    }
}

/// Whether fgds takes `FGDS_URING_CMD_READ`/`WRITE`: a command of no length is refused with
/// EINVAL where it does (ENOTTY or EOPNOTSUPP where not).
fn fgds_commands(ring: &mut Ring, buffer: &fgds::Buffer) -> Result<(), String> {
    let arg = fgds::uapi::Io {
        idx: buffer.idx(),
        ..Default::default()
    };
    let sqe = opcode::UringCmd80::new(types::Fd(buffer.node_fd()), fgds::uapi::URING_CMD_READ)
        .cmd(arg.to_cmd())
        .build();
    // SAFETY: the command carries its argument inline; it refers to no memory of ours.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| "submission queue full".to_owned())?;
    ring.submit_and_wait(1)
        .map_err(|err| format!("io_uring_enter: {err}"))?;
    match ring.completion().next().map(|c| c.result()) {
        Some(res) if res == -libc::EINVAL => Ok(()),
        Some(res) => Err(format!(
            "fgds has no FGDS_URING_CMD_READ: {}",
            std::io::Error::from_raw_os_error(-res)
        )),
        None => Err("no completion for FGDS_URING_CMD_READ".to_owned()),
    }
}

/// Unregisters the rings' fixed buffers, so that their pages are unpinned now rather than when
/// the kernel gets round to freeing the rings.
fn release_rings(rings: &[Ring]) {
    for ring in rings {
        let _ = ring.submitter().unregister_buffers();
    }
}

/// One turn of a mode: its share of a repetition's time (or bytes), added to `sample`.
#[allow(clippy::too_many_arguments)]
fn run_turn(
    run: &mut ModeRun,
    turns: usize,
    file: &File,
    drive: &drive::Drive,
    opts: &Options,
    write: bool,
    clock: CpuSource,
    sample: &mut Sample,
) -> anyhow::Result<()> {
    let restore = match run.max_sectors_kb {
        Some(kib) => {
            let was = drive.limit("max_sectors_kb")?;
            drive.set_max_sectors_kb(kib)?;
            Some(was)
        }
        None => None,
    };
    let res = run_turn_io(run, turns, file, drive, opts, write, clock, sample);
    if let Some(was) = restore {
        drive.set_max_sectors_kb(was)?;
    }
    res
}

#[allow(clippy::too_many_arguments)]
fn run_turn_io(
    run: &mut ModeRun,
    turns: usize,
    file: &File,
    drive: &drive::Drive,
    opts: &Options,
    write: bool,
    clock: CpuSource,
    sample: &mut Sample,
) -> anyhow::Result<()> {
    let region = run.region;
    let per_thread = opts.total / (opts.threads * turns) as u64;
    let fixed = run.fixed.as_ref().ok().copied();
    let target = &run.target;
    let host_from = opts.host_cpu_port.as_deref().map(host_cpu).transpose()?;
    let requests_from = drive.completed()?;
    let from = cpu_clock(clock)?;
    let started = Instant::now();
    let deadline = opts
        .seconds
        .map(|s| started + Duration::from_secs_f64(s.max(0.0) / turns as f64));
    let mut latencies = std::thread::scope(|scope| {
        let handles = run
            .rings
            .iter_mut()
            .zip(run.ready.iter_mut())
            .enumerate()
            .map(|(t, (ring, ready))| {
                let thread = ThreadIo {
                    target,
                    fixed,
                    region,
                    region_offset: t * region,
                    file,
                    opts,
                    write,
                    bytes: per_thread,
                    deadline,
                    thread: t as u64,
                };
                scope.spawn(move || thread_io(&thread, ring, ready))
            })
            .collect::<Vec<_>>();
        let mut all = Vec::new();
        for h in handles {
            all.extend(h.join().expect("bench thread panicked")?);
        }
        anyhow::Ok(all)
    })?;
    let secs = started.elapsed().as_secs_f64();
    sample.secs += secs;
    let busy = busy_secs(clock, &from, &cpu_clock(clock)?);
    sample.cpu_secs += busy;
    let requests_to = drive.completed()?;
    sample.requests += if write {
        requests_to.writes - requests_from.writes
    } else {
        requests_to.reads - requests_from.reads
    };
    let mib = (latencies.len() * opts.block_size) as f64 / (1 << 20) as f64;
    sample.turn_mib_s.push(mib / secs);
    let gib = (latencies.len() * opts.block_size).max(1) as f64 / (1u64 << 30) as f64;
    sample.turn_cpu_s_per_gib.push(busy / gib);
    if let (Some(port), Some((all, vcpus))) = (opts.host_cpu_port.as_deref(), host_from) {
        let (all_to, vcpus_to) = host_cpu(port)?;
        let all = all_to.saturating_sub(all) as f64 * 1e-9;
        let io = all - vcpus_to.saturating_sub(vcpus) as f64 * 1e-9;
        sample.turn_host_cpu_s_per_gib.push(all / gib);
        sample.turn_host_io_s_per_gib.push(io / gib);
    }
    latencies.sort();
    sample.turn_p50_us.push(
        latencies
            .get(latencies.len() / 2)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6),
    );
    sample.latencies.extend(latencies);
    Ok(())
}

/// How many of the first modes rotate through the first places (at least two: the first two
/// trade places every other round; three where `ram-again` is third).
fn rotation(modes: &[String]) -> usize {
    if modes.get(2).is_some_and(|m| m == "ram-again") {
        3
    } else {
        2
    }
}

/// How fast mode `a` ran against mode `b`: the median, over groups of `rounds` consecutive
/// turns, of the ratio of their mean rates in those turns (each mode's turns ran back to back
/// with the other's, so a burst of load on the host slows both; over `rounds` rounds each
/// rotating mode has followed the last mode once); `a` and `b` list the MiB/s of the same turns.
fn paired_ratio(a: &[f64], b: &[f64], rounds: usize) -> Option<f64> {
    let mut ratios = a
        .chunks(rounds)
        .zip(b.chunks(rounds))
        .map(|(a, b)| (a.iter().sum::<f64>(), b.iter().sum::<f64>()))
        .filter(|&(_, b)| b > 0.0)
        .map(|(a, b)| a / b)
        .collect::<Vec<_>>();
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(ratios[n / 2]),
        _ => Some((ratios[n / 2 - 1] + ratios[n / 2]) / 2.0),
    }
}

/// What one thread of a turn works on.
struct ThreadIo<'a> {
    target: &'a Target,
    fixed: Option<Fixed>,
    /// Bytes of the target the thread's requests cycle through, from `region_offset`.
    region: usize,
    region_offset: usize,
    file: &'a File,
    opts: &'a Options,
    write: bool,
    /// Bytes to move, where there is no `deadline`.
    bytes: u64,
    deadline: Option<Instant>,
    thread: u64,
}

/// One thread's share: `bytes` (or until `deadline`) in requests of `block_size`, `queue_depth`
/// at a time. Returns each request's latency. `ready` carries a `bounce` write's staging slot
/// already filled for the next request from one turn to the next.
fn thread_io(
    io: &ThreadIo<'_>,
    ring: &mut Ring,
    ready: &mut Option<usize>,
) -> anyhow::Result<Vec<Duration>> {
    let opts = io.opts;
    let bs = opts.block_size;
    let (bounce, spare) = match io.target {
        Target::Bounce { ram, gpu, spare } => (Some((ram, gpu)), *spare),
        _ => (None, false),
    };
    let n_requests = match io.deadline {
        Some(_) => u64::MAX,
        None => io.bytes.div_ceil(bs as u64),
    };
    let more = |next: u64| next < n_requests && io.deadline.is_none_or(|d| Instant::now() < d);
    let slots = slot_count(opts, spare);
    let at = |slot: usize| io.region_offset + slot_offset(slot, bs, io.region);
    // The copy between a slot's staging RAM and the same offset of the GPU's memory.
    let copy = |slot: usize| -> anyhow::Result<()> {
        let Some((ram, gpu)) = bounce else {
            return Ok(());
        };
        // SAFETY: the slot lies inside both mappings (the same length), and no request into it
        // is in flight.
        let ram = unsafe { std::slice::from_raw_parts_mut(ram.ptr.add(at(slot)), bs) };
        bounce_copy(
            gpu,
            at(slot),
            if io.write {
                BounceDir::FromGpu(ram)
            } else {
                BounceDir::ToGpu(ram)
            },
        )
    };
    let mut issued_at = vec![Instant::now(); slots];
    let mut free = (0..slots)
        .rev()
        .filter(|&s| Some(s) != *ready)
        .collect::<Vec<_>>();
    let mut latencies = Vec::new();
    let mut next = 0u64;
    let mut in_flight = 0;
    let fd = types::Fd(io.file.as_raw_fd());
    let span_blocks = (opts.span / bs as u64).max(1);
    // Queues request `next` into a free slot (a `bounce` write's into the slot filled for it,
    // or one filled now); `bounce` hands it to the kernel at once, so that it is in flight
    // while the thread copies.
    let submit = |ring: &mut Ring,
                  issued_at: &mut [Instant],
                  free: &mut Vec<usize>,
                  ready: &mut Option<usize>,
                  next: u64|
     -> anyhow::Result<()> {
        let slot = match ready.take() {
            Some(slot) => slot,
            None => {
                let slot = free.pop().context("no free slot")?;
                if io.write {
                    copy(slot)?;
                }
                slot
            }
        };
        // fgds's commands address the registration from 0, its start.
        let base = match io.fixed {
            Some(Fixed::Command | Fixed::Dmabuf) => 0,
            _ => io.target.io_ptr() as usize,
        };
        let ptr = (base + at(slot)) as *mut u8;
        let block = (next * opts.threads as u64 + io.thread) % span_blocks;
        let off = opts.file_offset + block * bs as u64;
        let len = bs as u32;
        let sqe: Entry128 = match (io.write, io.fixed) {
            (write, Some(Fixed::Command)) => {
                let Target::Direct { buffer, .. } = io.target else {
                    bail!("fgds's commands for a target that is not fgds's");
                };
                let arg = fgds::uapi::Io {
                    idx: buffer.idx(),
                    offset: at(slot) as u64,
                    len: u64::from(len),
                    file_offset: off,
                    fd: io.file.as_raw_fd(),
                    flags: 0,
                };
                let op = match write {
                    true => fgds::uapi::URING_CMD_WRITE,
                    false => fgds::uapi::URING_CMD_READ,
                };
                opcode::UringCmd80::new(types::Fd(buffer.node_fd()), op)
                    .cmd(arg.to_cmd())
                    .build()
            }
            (true, Some(_)) => opcode::WriteFixed::new(fd, ptr, len, 0)
                .offset(off)
                .build()
                .into(),
            (true, None) => opcode::Write::new(fd, ptr, len).offset(off).build().into(),
            (false, Some(_)) => opcode::ReadFixed::new(fd, ptr, len, 0)
                .offset(off)
                .build()
                .into(),
            (false, None) => opcode::Read::new(fd, ptr, len).offset(off).build().into(),
        };
        issued_at[slot] = Instant::now();
        // SAFETY: the slot's memory lives until the run ends, and the run waits for every
        // request before returning.
        unsafe { ring.submission().push(&sqe.user_data(slot as u64)) }
            .map_err(|_| anyhow::format_err!("submission queue full"))?;
        if bounce.is_some() {
            ring.submit()?;
        }
        Ok(())
    };
    // A `bounce` write fills the spare slot for the next request while the others are in
    // flight, as a loader copies the next block while the drive writes the last.
    let prepare = |free: &mut Vec<usize>, ready: &mut Option<usize>, next: u64| {
        if spare && io.write && ready.is_none() && more(next) {
            let slot = free.pop().context("no free slot")?;
            copy(slot)?;
            *ready = Some(slot);
        }
        anyhow::Ok(())
    };
    while more(next) && in_flight < opts.queue_depth {
        submit(ring, &mut issued_at, &mut free, ready, next)?;
        next += 1;
        in_flight += 1;
    }
    prepare(&mut free, ready, next)?;
    while in_flight > 0 {
        ring.submit_and_wait(1)?;
        let done = ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect::<Vec<_>>();
        let reaped = done.len();
        for (i, (slot, res)) in done.into_iter().enumerate() {
            in_flight -= 1;
            if res != bs as i32 {
                // Drain what is in flight, so no request outlives its memory: the completions
                // reaped with this one are no longer in flight (counting them hung the bench
                // when a refused file failed every request of a deep queue at once).
                in_flight -= reaped - i - 1;
                while in_flight > 0 {
                    ring.submit_and_wait(1)?;
                    in_flight -= ring.completion().count();
                }
                let what = if res < 0 {
                    std::io::Error::from_raw_os_error(-res).to_string()
                } else {
                    format!("{res} of {bs} bytes")
                };
                bail!("request failed: {what}");
            }
            latencies.push(issued_at[slot].elapsed());
            // A read is copied out of its slot after the next request went into the spare
            // slot; without one, before its own slot takes the next request.
            let copy_after = spare && !io.write;
            if bounce.is_some() && !spare && !io.write {
                copy(slot)?;
            }
            if !copy_after {
                free.push(slot);
            }
            if more(next) {
                submit(ring, &mut issued_at, &mut free, ready, next)?;
                next += 1;
                in_flight += 1;
            }
            if copy_after {
                copy(slot)?;
                free.push(slot);
            }
            prepare(&mut free, ready, next)?;
        }
    }
    Ok(latencies)
}

/// A bounce copy's direction, with the RAM side.
enum BounceDir<'a> {
    ToGpu(&'a [u8]),
    FromGpu(&'a mut [u8]),
}

/// Copies between RAM and the GPU's memory at offset `at` of the bounce target.
fn bounce_copy(gpu: &BounceCopy, at: usize, dir: BounceDir<'_>) -> anyhow::Result<()> {
    match (gpu, dir) {
        (BounceCopy::Mapping { map, copy, .. }, BounceDir::ToGpu(src)) => {
            assert!(at + src.len() <= map.len(), "bounce copy out of bounds");
            // SAFETY: in bounds of the mapping (checked above), which no Rust reference covers.
            unsafe { copy.run(map.as_ptr().add(at), src.as_ptr(), src.len(), true) }
        }
        (BounceCopy::Mapping { map, copy, .. }, BounceDir::FromGpu(dst)) => {
            assert!(at + dst.len() <= map.len(), "bounce copy out of bounds");
            // SAFETY: as above.
            unsafe { copy.run(dst.as_mut_ptr(), map.as_ptr().add(at), dst.len(), false) }
        }
        (BounceCopy::Cuda { memory, .. }, BounceDir::ToGpu(src)) => {
            memory.copy_from_host(at as u64, src)?
        }
        (BounceCopy::Cuda { memory, .. }, BounceDir::FromGpu(dst)) => {
            memory.copy_to_host(at as u64, dst)?
        }
    }
    Ok(())
}

/// A CPU copy between RAM and the exporter's mapping of the GPU's memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum CpuCopy {
    /// `memcpy`.
    Memcpy,
    /// 16-byte non-temporal stores into the GPU's memory (`movntdq`), or non-temporal loads
    /// out of it (`movntdqa`, SSE4.1): what a copy to or from write-combined memory uses.
    Streaming,
}

impl CpuCopy {
    fn name(self) -> &'static str {
        match self {
            CpuCopy::Memcpy => "memcpy",
            CpuCopy::Streaming => "streaming",
        }
    }

    /// The copies this CPU can make in that direction.
    fn available(to_gpu: bool) -> Vec<CpuCopy> {
        let mut copies = vec![CpuCopy::Memcpy];
        #[cfg(target_arch = "x86_64")]
        if to_gpu || std::arch::is_x86_feature_detected!("sse4.1") {
            copies.push(CpuCopy::Streaming);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = to_gpu;
        copies
    }

    /// Copies `len` bytes from `src` to `dst`; `to_gpu` says that `dst` is the GPU's memory
    /// (else `src` is). A streaming copy of a length or an address not a multiple of 64 is a
    /// `memcpy`.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `len` bytes and do not overlap.
    unsafe fn run(self, dst: *mut u8, src: *const u8, len: usize, to_gpu: bool) {
        #[cfg(target_arch = "x86_64")]
        if self == CpuCopy::Streaming
            && len.is_multiple_of(64)
            && (dst as usize).is_multiple_of(64)
            && (src as usize).is_multiple_of(64)
        {
            if to_gpu {
                // SAFETY: the caller's promise; the alignment is checked above.
                unsafe { stream_to(dst, src, len) };
            } else {
                // SAFETY: as above; `Streaming` from the GPU is only offered with SSE4.1
                // (`available`).
                unsafe { stream_from(dst, src, len) };
            }
            return;
        }
        let _ = to_gpu;
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    }
}

/// Non-temporal stores of `len` bytes (a multiple of 64) to 64-byte aligned `dst`.
///
/// # Safety
/// As [`CpuCopy::run`], with `dst` and `src` 16-byte aligned.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_to(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_load_si128, _mm_sfence, _mm_stream_si128};
    for i in (0..len).step_by(64) {
        // SAFETY: `i + 64 <= len`, both pointers valid and 16-byte aligned (the caller's).
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_load_si128(s),
                _mm_load_si128(s.add(1)),
                _mm_load_si128(s.add(2)),
                _mm_load_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
    }
    // Non-temporal stores are weakly ordered: fence them before the copy counts as done.
    // SAFETY: SSE is part of x86-64.
    unsafe { _mm_sfence() };
}

/// Non-temporal loads of `len` bytes (a multiple of 64) from 64-byte aligned `src`.
///
/// # Safety
/// As [`stream_to`], and the CPU has SSE4.1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.1")]
unsafe fn stream_from(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_store_si128, _mm_stream_load_si128};
    for i in (0..len).step_by(64) {
        // SAFETY: as in `stream_to`.
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_stream_load_si128(s),
                _mm_stream_load_si128(s.add(1)),
                _mm_stream_load_si128(s.add(2)),
                _mm_stream_load_si128(s.add(3)),
            );
            _mm_store_si128(d, a);
            _mm_store_si128(d.add(1), b);
            _mm_store_si128(d.add(2), c);
            _mm_store_si128(d.add(3), e);
        }
    }
}

/// The faster of the CPU's copies between `ram` and `map` in the bench's direction, timed on up
/// to 8 MiB, three times each.
fn fastest_copy(map: &CpuMapping, ram: &Anon, to_gpu: bool) -> CpuCopy {
    let len = map.len().min(ram.len).min(8 << 20) / 64 * 64;
    let (dst, src) = if to_gpu {
        (map.as_ptr(), ram.ptr.cast_const())
    } else {
        (ram.ptr, map.as_ptr().cast_const())
    };
    let time = |copy: CpuCopy| {
        (0..3)
            .map(|_| {
                let started = Instant::now();
                // SAFETY: `len` lies inside both mappings, which are distinct.
                unsafe { copy.run(dst, src, len, to_gpu) };
                started.elapsed()
            })
            .min()
            .unwrap_or_default()
    };
    CpuCopy::available(to_gpu)
        .into_iter()
        .min_by_key(|&copy| time(copy))
        .unwrap_or(CpuCopy::Memcpy)
}
