//! `cargo xtask matrix`: the suite on a list of kernels, then one table row per kernel.

use std::process::ExitCode;

use crate::report::{self, Outcome, Verdict};
use crate::vm;

/// The kernels of a full matrix run.
pub const DEFAULT_KERNELS: &[&str] = &[
    "debian:6.1",
    "debian:6.12",
    "debian:7.2",
    "debian:7.3",
    "build:6.12+debug",
    "build:7.2+debug",
];

#[derive(clap::Args)]
pub struct Options {
    /// Kernels to run (repeatable); default: all supported ones.
    #[arg(long = "kernel")]
    pub kernels: Vec<String>,
    /// The vgpu exporter's mode.
    #[arg(long, default_value = "plain")]
    pub vgpu_mode: String,
    /// fgds's `pages=` parameter (as for test-vm).
    #[arg(long, default_value = "auto", value_parser = vm::FGDS_PAGES)]
    pub fgds_pages: String,
}

/// One row of the table.
struct Row {
    kernel: String,
    version: String,
    passed: usize,
    failed: usize,
    skipped: usize,
    mode: String,
    secs: f64,
}

pub fn matrix(opts: &Options) -> anyhow::Result<ExitCode> {
    let kernels = if opts.kernels.is_empty() {
        DEFAULT_KERNELS.iter().map(|k| (*k).to_owned()).collect()
    } else {
        opts.kernels.clone()
    };
    let mut rows = Vec::new();
    let mut all = Vec::new();
    for kernel in &kernels {
        let vm_opts = vm::Options {
            vgpu_mode: opts.vgpu_mode.clone(),
            fgds_pages: opts.fgds_pages.clone(),
            ..vm::Options::for_kernel(kernel)
        };
        match vm::run_kernel(&vm_opts) {
            Ok(run) => {
                rows.push(row(&run));
                all.extend(run.outcomes);
            }
            Err(err) => {
                eprintln!("matrix: {kernel}: {err:#}");
                rows.push(Row {
                    kernel: kernel.clone(),
                    version: "-".to_owned(),
                    passed: 0,
                    failed: 1,
                    skipped: 0,
                    mode: "-".to_owned(),
                    secs: 0.0,
                });
                all.push(Outcome {
                    name: format!("{kernel}::run"),
                    verdict: Verdict::Fail(format!("{err:#}")),
                });
            }
        }
    }
    let table = render(&rows);
    let out = crate::project_root().join("target/matrix.txt");
    let _ = std::fs::write(&out, &table);
    let passed = report::print(all);
    println!("\n{table}(also in {})", out.display());
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn row(run: &vm::KernelRun) -> Row {
    let count = |f: fn(&Verdict) -> bool| run.outcomes.iter().filter(|o| f(&o.verdict)).count();
    let mode = run
        .reports
        .iter()
        .find_map(|r| r.strip_prefix("fgds mode=")?.split_whitespace().next())
        .unwrap_or("unreported")
        .to_owned();
    Row {
        kernel: run.spec.clone(),
        version: if run.package_version.is_empty() {
            run.release.clone()
        } else {
            run.package_version.clone()
        },
        passed: count(|v| matches!(v, Verdict::Pass)),
        failed: count(|v| matches!(v, Verdict::Fail(_))),
        skipped: count(|v| matches!(v, Verdict::Skip(_))),
        mode,
        secs: run.took.as_secs_f64(),
    }
}

fn render(rows: &[Row]) -> String {
    let mut out = format!(
        "| {:<18} | {:<22} | {:>6} | {:>6} | {:>7} | {:<16} | {:>7} |\n|{}|{}|{}|{}|{}|{}|{}|\n",
        "kernel",
        "version",
        "passed",
        "failed",
        "skipped",
        "driver mode",
        "time",
        "-".repeat(20),
        "-".repeat(24),
        "-".repeat(8),
        "-".repeat(8),
        "-".repeat(9),
        "-".repeat(18),
        "-".repeat(9)
    );
    for r in rows {
        out.push_str(&format!(
            "| {:<18} | {:<22} | {:>6} | {:>6} | {:>7} | {:<16} | {:>6.0}s |\n",
            r.kernel, r.version, r.passed, r.failed, r.skipped, r.mode, r.secs
        ));
    }
    out
}
