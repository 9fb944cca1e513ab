//! `cargo xtask fuzz`: boots a kernel (a `build:` debug kernel by default: KASAN, lockdep,
//! kmemleak, DMABUF_DEBUG) and runs the concurrency fuzzer (tests/src/bin/fgds_fuzz.rs) for a
//! fixed time, then the rig's verdicts (a splat or a leak fails the run) and a summary:
//! operations per second, and the count of every operation's outcomes (success, errno,
//! signal). The guest's summary is kept in `target/fuzz/<kernel>.json`.

use std::process::ExitCode;

use anyhow::Context;
use serde_json::Value;

use crate::report::{Outcome, Verdict};
use crate::vm;

const PROGRAM: &str = "fgds_fuzz";

#[derive(clap::Args, Clone)]
pub struct Options {
    /// The kernel (a `build:X.Y+debug` kernel has the sanitizers).
    #[arg(long, default_value = "build:6.12+debug")]
    pub kernel: String,
    /// How long the fuzzer runs, in minutes.
    #[arg(long, default_value_t = 5)]
    pub minutes: u64,
    /// How long the fuzzer runs, in seconds (instead of `--minutes`; at least 60 for its
    /// verdict on what ran too rarely).
    #[arg(long, conflicts_with = "minutes")]
    pub seconds: Option<u64>,
    /// The seed (decimal or 0x hex); default: the guest's clock. Printed at the start.
    #[arg(long)]
    pub seed: Option<String>,
    /// Stop after this many operations (before the time is up).
    #[arg(long)]
    pub ops: Option<u64>,
    /// Worker processes.
    #[arg(long, default_value_t = 2)]
    pub workers: u64,
    /// Threads per worker process.
    #[arg(long, default_value_t = 3)]
    pub threads: u64,
    /// Seconds between GPU unbinds or hot-unplugs, on average (0: none).
    #[arg(long, default_value_t = 20)]
    pub chaos: u64,
    /// fgds's `pages=` parameter (as for test-vm).
    #[arg(long, default_value = "auto", value_parser = vm::FGDS_PAGES)]
    pub fgds_pages: String,
    /// TCG's host threads (as for test-vm): multi runs the guest's two vCPUs at once, about
    /// twice the operations per second and truly parallel races, at the price of the rare
    /// early-boot oops of multi-threaded TCG (docs/architecture.md, Boot flakes).
    #[arg(long, value_enum, default_value_t = vm::DEFAULT_TCG_THREADS)]
    pub tcg_threads: vm::TcgThreadsArg,
}

impl Options {
    /// CI's short run: a minute on the debug LTS with a fixed seed, a chaos event every ~10 s.
    pub fn ci() -> Options {
        Options {
            kernel: "build:6.12+debug".to_owned(),
            minutes: 1,
            seconds: Some(60),
            seed: Some("0x22".to_owned()),
            ops: None,
            workers: 2,
            threads: 3,
            chaos: 10,
            fgds_pages: "auto".to_owned(),
            tcg_threads: vm::DEFAULT_TCG_THREADS,
        }
    }
}

impl Options {
    /// How long the fuzzer runs.
    pub fn seconds(&self) -> u64 {
        self.seconds.unwrap_or(self.minutes * 60)
    }
}

pub fn fuzz(opts: &Options) -> anyhow::Result<ExitCode> {
    let passed = crate::report::print(run(opts)?);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs the fuzzer, prints its summary; returns the run's verdicts (the fuzzer's, the
/// kernel's splats, kmemleak's), with a failure when the fuzzer printed no summary.
pub fn run(opts: &Options) -> anyhow::Result<Vec<Outcome>> {
    let mut append = format!(
        "fgds.fuzz_seconds={} fgds.fuzz_workers={} fgds.fuzz_threads={} fgds.fuzz_chaos={}",
        opts.seconds(),
        opts.workers,
        opts.threads,
        opts.chaos
    );
    if let Some(seed) = &opts.seed {
        append += &format!(" fgds.fuzz_seed={seed}");
    }
    if let Some(ops) = opts.ops {
        append += &format!(" fgds.fuzz_ops={ops}");
    }
    eprintln!(
        "fuzz: {} for {} s (the console and the guest's log: target/vm-runs/)",
        opts.kernel,
        opts.seconds()
    );
    let run = vm::run_kernel(&vm::Options {
        fgds_pages: opts.fgds_pages.clone(),
        append,
        // The fuzzer's own time, then its checks, unbinds and a hang's reports.
        programs: vec![(PROGRAM.to_owned(), opts.seconds() + 600)],
        tcg_threads: opts.tcg_threads,
        ..vm::Options::for_kernel(&opts.kernel)
    })?;
    let summary = guest_summary(&run.run_dir)?;
    let mut outcomes = run.outcomes;
    match &summary {
        Some(s) => {
            let out_dir = crate::project_root().join("target/fuzz");
            std::fs::create_dir_all(&out_dir)?;
            let path = out_dir.join(format!("{}.json", run.spec.replace(':', "-")));
            let mut s = s.clone();
            s["kernel"] = Value::from(run.spec.clone());
            s["release"] = Value::from(run.release.clone());
            std::fs::write(&path, serde_json::to_string_pretty(&s)?)?;
            print_summary(&s);
            println!("fuzz: summary in {}", path.display());
        }
        None => outcomes.push(Outcome {
            name: format!("{}::fuzz-summary", run.spec),
            verdict: Verdict::Fail(format!(
                "the fuzzer printed no summary (see {})",
                run.run_dir.display()
            )),
        }),
    }
    Ok(outcomes)
}

/// The guest's `fgds-fuzz: {json}` line.
fn guest_summary(run_dir: &std::path::Path) -> anyhow::Result<Option<Value>> {
    let ktap = std::fs::read(run_dir.join("ktap.log"))
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .context("the run left no KTAP log")?;
    ktap.lines()
        .filter_map(|l| l.split("fgds-fuzz: ").nth(1))
        .next_back()
        .map(|json| serde_json::from_str(json).with_context(|| format!("bad summary {json:?}")))
        .transpose()
}

/// Operations per second, then a line per operation: its outcomes and their counts.
fn print_summary(s: &Value) {
    println!(
        "fuzz: seed {}, {} operations in {:.0} s ({:.0}/s), {} workers x {} threads, {} failed checks",
        s["seed"].as_str().unwrap_or("?"),
        s["ops"],
        s["seconds"].as_f64().unwrap_or(0.0),
        s["ops_per_s"].as_f64().unwrap_or(0.0),
        s["workers"],
        s["threads"],
        s["failures"]
    );
    if let Some(counts) = s["counts"].as_object() {
        for (op, outcomes) in counts {
            let cells: Vec<String> = outcomes
                .as_object()
                .into_iter()
                .flatten()
                .map(|(o, n)| match n.as_f64() {
                    Some(s) if o == "busy_s" => format!("{o} {s:.0}"),
                    _ => format!("{o} {n}"),
                })
                .collect();
            println!("  {op:<20} {}", cells.join(", "));
        }
    }
}
