//! `cargo xtask ci`: everything CI checks, in one command, ending with one summary line.

use std::path::Path;
use std::process::{Command, ExitCode};

use fgds_vm_images::kernel;

use crate::report::{self, Outcome, Verdict};
use crate::{driver, host, package, selftest, vm};

/// The runs CI makes, kernel and fgds's `pages=`: the LTS users run (GENERIC pages, its kernel
/// having no CONFIG_PCI_P2PDMA), the newest with the default (P2PDMA pages) and with GENERIC
/// pages insisted on (2 MiB mappings; both with DMABUF_DEBUG on), and the LTS built with KASAN,
/// lockdep, kmemleak and fault injection (P2PDMA pages; built once from linux-source, about 12
/// minutes on 2 cores, then cached).
/// The last run has vfio-pci export the GPU's memory (under the rig's translating vIOMMU,
/// which vfio needs): an exporter nobody here wrote.
pub const CI_RUNS: [(&str, &str, &str); 5] = [
    ("debian:6.12", "auto", "vgpu"),
    ("debian:7.3", "auto", "vgpu"),
    ("debian:7.3", "generic", "vgpu"),
    ("build:6.12+debug", "auto", "vgpu"),
    ("debian:7.3", "auto", "vfio"),
];

#[derive(clap::Args)]
pub struct Options {
    /// Kernels to run the suite on (repeatable, with fgds's default `pages=auto`); default: the
    /// runs of `CI_RUNS`.
    #[arg(long = "kernel")]
    pub kernels: Vec<String>,
}

/// `cargo xtask check-driver`: checkpatch and sparse.
#[derive(clap::Args)]
pub struct DriverOptions {
    /// The kernel to run sparse against.
    #[arg(long, default_value = "debian:6.12")]
    pub kernel: String,
}

pub fn ci(opts: &Options) -> anyhow::Result<ExitCode> {
    let root = crate::project_root();
    let mut outcomes = Vec::new();
    let steps: &[(&str, &[&str])] = &[
        ("ci::cargo-fmt", &["fmt", "--all", "--check"]),
        (
            "ci::cargo-clippy",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--quiet",
                "--",
                "-D",
                "warnings",
            ],
        ),
        ("ci::cargo-test", &["test", "--workspace", "--quiet"]),
        (
            "ci::cargo-doc",
            &["doc", "--workspace", "--no-deps", "--quiet"],
        ),
    ];
    for (name, args) in steps {
        eprintln!("ci: cargo {}", args.join(" "));
        outcomes.push(cargo_step(&root, name, args)?);
    }
    eprintln!("ci: the Python package's wheel, mypy --strict and stubtest");
    outcomes.push(
        match crate::python::build_wheel().and_then(|wheel| crate::python::check(&wheel)) {
            Ok(()) => Outcome {
                name: "ci::python-check".to_owned(),
                verdict: Verdict::Pass,
            },
            Err(err) => Outcome {
                name: "ci::python-check".to_owned(),
                verdict: Verdict::Fail(format!("{err:#}")),
            },
        },
    );
    eprintln!("ci: checkpatch and sparse on driver/");
    outcomes.extend(check_driver_outcomes(&DriverOptions {
        kernel: "debian:6.12".to_owned(),
    }));
    eprintln!("ci: packages (lintian) and dkms build against every rig kernel");
    outcomes.extend(or_failure("package::build", package_outcomes()));
    let runs: Vec<(&str, &str, &str)> = if opts.kernels.is_empty() {
        CI_RUNS.to_vec()
    } else {
        opts.kernels
            .iter()
            .map(|k| (k.as_str(), "auto", "vgpu"))
            .collect()
    };
    let mut skips = Vec::new();
    for (kernel, pages, exporter) in runs {
        let vm_opts = vm::Options {
            fgds_pages: pages.to_owned(),
            iommu: exporter == "vfio",
            exporter: exporter.to_owned(),
            ..vm::Options::for_kernel(kernel)
        };
        outcomes.extend(or_failure(
            &format!("{kernel}::run"),
            vm::run_kernel(&vm_opts).map(|run| {
                skips.push((run.config, run.expected_skips));
                run.outcomes
            }),
        ));
    }
    let fuzz = crate::fuzz::Options::ci();
    eprintln!(
        "ci: the fuzzer, {} min on {} (seed {})",
        fuzz.minutes,
        fuzz.kernel,
        fuzz.seed.as_deref().unwrap_or("-")
    );
    outcomes.extend(or_failure("fuzz::run", crate::fuzz::run(&fuzz)));
    eprintln!("ci: rig self-test");
    outcomes.extend(or_failure(
        "rig-selftest::run",
        selftest::run("debian:6.12"),
    ));
    let passed = report::print(outcomes);
    report::print_skips(&skips);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The packages' lintian verdicts and `<kernel>::dkms-build` for every kernel of
/// [`package::DKMS_KERNELS`].
fn package_outcomes() -> anyhow::Result<Vec<Outcome>> {
    let packages = package::build(true)?;
    let mut outcomes = package::lintian(&packages)?;
    for spec in package::DKMS_KERNELS {
        outcomes.push(package::dkms_outcome(&packages, spec));
    }
    Ok(outcomes)
}

pub fn check_driver(opts: &DriverOptions) -> anyhow::Result<ExitCode> {
    let passed = report::print(check_driver_outcomes(opts));
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn check_driver_outcomes(opts: &DriverOptions) -> Vec<Outcome> {
    let res = (|| {
        let cache = host::cache_dir()?;
        let mut outcomes = driver::checkpatch(&cache)?;
        host::ensure_packages(host::VM_PACKAGES)?;
        let spec: kernel::KernelSpec = opts.kernel.parse()?;
        let kernel = kernel::prepare(&spec, &cache)?;
        let out_dir = crate::project_root()
            .join("target/driver-checks")
            .join(spec.slug());
        std::fs::create_dir_all(&out_dir)?;
        outcomes.push(driver::sparse(&kernel, &out_dir)?);
        Ok(outcomes)
    })();
    or_failure("driver::checks", res)
}

fn cargo_step(root: &Path, name: &str, args: &[&str]) -> anyhow::Result<Outcome> {
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .current_dir(root)
        // Rustdoc warnings (broken links, ...) fail the doc step.
        .env("RUSTDOCFLAGS", "-D warnings")
        .args(args)
        .status()?;
    let verdict = if status.success() {
        Verdict::Pass
    } else {
        Verdict::Fail(format!("cargo {} failed (output above)", args.join(" ")))
    };
    Ok(Outcome {
        name: name.to_owned(),
        verdict,
    })
}

/// The outcomes of a step, or one failed outcome named `name` if the step could not run.
fn or_failure(name: &str, res: anyhow::Result<Vec<Outcome>>) -> Vec<Outcome> {
    match res {
        Ok(outcomes) => outcomes,
        Err(err) => vec![Outcome {
            name: name.to_owned(),
            verdict: Verdict::Fail(format!("{err:#}")),
        }],
    }
}
