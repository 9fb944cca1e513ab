//! `cargo xtask matrix`: the suite on a list of kernels and exporters, then one table row per
//! run.

use std::process::ExitCode;

use crate::report::{self, Outcome, Verdict};
use crate::vm;

/// One run of a matrix: a kernel, and who exports the GPU's memory.
#[derive(Clone)]
struct MatrixRun {
    kernel: String,
    /// A translating vIOMMU (`--iommu`).
    iommu: bool,
    /// `vgpu` or `vfio` (`--exporter`).
    exporter: String,
}

/// The runs of a full matrix: every supported kernel with vgpu, and vfio-pci as the exporter
/// on the kernels that have its BAR dma-bufs (with the vIOMMU it needs).
const DEFAULT_RUNS: &[(&str, bool, &str)] = &[
    ("debian:6.1", false, "vgpu"),
    ("debian:6.12", false, "vgpu"),
    ("debian:7.2", false, "vgpu"),
    ("debian:7.3", false, "vgpu"),
    ("build:6.12+debug", false, "vgpu"),
    ("build:7.2+debug", false, "vgpu"),
    ("build:7.2+io-uring-dmabuf", false, "vgpu"),
    ("debian:7.2", true, "vfio"),
    ("debian:7.3", true, "vfio"),
];

#[derive(clap::Args)]
pub struct Options {
    /// Kernels to run (repeatable); default: all supported ones, and the vfio-pci runs.
    #[arg(long = "kernel")]
    pub kernels: Vec<String>,
    /// The vgpu exporter's mode (runs with vgpu only).
    #[arg(long, default_value = "plain")]
    pub vgpu_mode: String,
    /// fgds's `pages=` parameter (as for test-vm).
    #[arg(long, default_value = "auto", value_parser = vm::FGDS_PAGES)]
    pub fgds_pages: String,
    /// With --kernel: a translating vIOMMU in every run (as for test-vm).
    #[arg(long)]
    pub iommu: bool,
    /// With --kernel: who exports the GPU's memory in every run (as for test-vm).
    #[arg(long, default_value = "vgpu", value_parser = crate::expected::EXPORTERS)]
    pub exporter: String,
}

/// One row of the table.
struct Row {
    kernel: String,
    config: String,
    version: String,
    passed: usize,
    failed: usize,
    skipped: usize,
    mode: String,
    secs: f64,
}

pub fn matrix(opts: &Options) -> anyhow::Result<ExitCode> {
    let runs = if opts.kernels.is_empty() {
        DEFAULT_RUNS
            .iter()
            .map(|(kernel, iommu, exporter)| MatrixRun {
                kernel: (*kernel).to_owned(),
                iommu: *iommu,
                exporter: (*exporter).to_owned(),
            })
            .collect::<Vec<_>>()
    } else {
        opts.kernels
            .iter()
            .map(|kernel| MatrixRun {
                kernel: kernel.clone(),
                iommu: opts.iommu,
                exporter: opts.exporter.clone(),
            })
            .collect()
    };
    let mut rows = Vec::new();
    let mut all = Vec::new();
    for run in &runs {
        let config = describe(run);
        let vm_opts = vm::Options {
            // vgpu is not loaded where vfio-pci exports: its mode means nothing there.
            vgpu_mode: if run.exporter == "vgpu" {
                opts.vgpu_mode.clone()
            } else {
                "plain".to_owned()
            },
            fgds_pages: opts.fgds_pages.clone(),
            iommu: run.iommu,
            exporter: run.exporter.clone(),
            ..vm::Options::for_kernel(&run.kernel)
        };
        match vm::run_kernel(&vm_opts) {
            Ok(kernel_run) => {
                rows.push(row(&kernel_run, config));
                all.extend(kernel_run.outcomes);
            }
            Err(err) => {
                eprintln!("matrix: {} {config}: {err:#}", run.kernel);
                rows.push(Row {
                    kernel: run.kernel.clone(),
                    config: config.clone(),
                    version: "-".to_owned(),
                    passed: 0,
                    failed: 1,
                    skipped: 0,
                    mode: "-".to_owned(),
                    secs: 0.0,
                });
                all.push(Outcome {
                    name: format!("{} {config}::run", run.kernel),
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

/// The run's exporter and vIOMMU, for the table: `vgpu`, `vfio, iommu`.
fn describe(run: &MatrixRun) -> String {
    if run.iommu {
        format!("{}, iommu", run.exporter)
    } else {
        run.exporter.clone()
    }
}

fn row(run: &vm::KernelRun, config: String) -> Row {
    let count = |f: fn(&Verdict) -> bool| run.outcomes.iter().filter(|o| f(&o.verdict)).count();
    let mode = run
        .reports
        .iter()
        .find_map(|r| r.strip_prefix("fgds mode=")?.split_whitespace().next())
        .unwrap_or("unreported")
        .to_owned();
    Row {
        kernel: run.spec.clone(),
        config,
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
        "| {:<18} | {:<12} | {:<22} | {:>6} | {:>6} | {:>7} | {:<16} | {:>7} |\n|{}|{}|{}|{}|{}|{}|{}|{}|\n",
        "kernel",
        "exporter",
        "version",
        "passed",
        "failed",
        "skipped",
        "driver mode",
        "time",
        "-".repeat(20),
        "-".repeat(14),
        "-".repeat(24),
        "-".repeat(8),
        "-".repeat(8),
        "-".repeat(9),
        "-".repeat(18),
        "-".repeat(9)
    );
    for r in rows {
        out.push_str(&format!(
            "| {:<18} | {:<12} | {:<22} | {:>6} | {:>6} | {:>7} | {:<16} | {:>6.0}s |\n",
            r.kernel, r.config, r.version, r.passed, r.failed, r.skipped, r.mode, r.secs
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_runs_include_vfio_on_the_kernels_that_have_it() {
        let vfio = DEFAULT_RUNS
            .iter()
            .filter(|(_, iommu, exporter)| *exporter == "vfio" && *iommu)
            .map(|(kernel, _, _)| *kernel)
            .collect::<Vec<_>>();
        assert_eq!(vfio, ["debian:7.2", "debian:7.3"]);
        let table = render(&[Row {
            kernel: "debian:7.2".into(),
            config: "vfio, iommu".into(),
            version: "7.2.13".into(),
            passed: 14,
            failed: 0,
            skipped: 19,
            mode: "p2pdma".into(),
            secs: 300.0,
        }]);
        assert!(
            table.contains("| debian:7.2         | vfio, iommu  |"),
            "{table}"
        );
    }
}
