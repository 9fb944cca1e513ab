//! `cargo xtask ci`: everything CI checks, in one command, ending with one summary line.

use std::path::Path;
use std::process::{Command, ExitCode};

use fgds_vm_images::kernel;

use crate::report::{self, Outcome, Verdict};
use crate::{driver, host, package, selftest, vm};

/// One configuration CI boots, and the programs that only it proves something with.
pub struct CiRun {
    pub kernel: &'static str,
    /// fgds's `pages=`.
    pub pages: &'static str,
    pub exporter: &'static str,
    /// The rig's translating vIOMMU (vfio needs it).
    pub iommu: bool,
    /// GPUs in the machine (`--gpus`).
    pub gpus: u8,
    /// The suite's programs to run; empty: all of them.
    pub only: &'static [&'static str],
    /// A third-party series of `../shared/comparators/` the kernel is built with: where the
    /// machine has no copy, the run is reported skipped with that reason, never passed.
    pub comparator: Option<&'static str>,
    /// Why this configuration is in CI.
    pub proves: &'static str,
}

/// The runs CI makes. Each configuration runs what only it proves: the whole suite where the
/// code paths differ throughout (the LTS with GENERIC pages, the newest with P2PDMA pages, the
/// LTS under KASAN, lockdep and fault injection), the programs that touch the pages and the
/// data where only the page kind differs, and single programs where a configuration proves
/// one thing.
pub const CI_RUNS: [CiRun; 9] = [
    CiRun {
        kernel: "debian:6.12",
        pages: "auto",
        exporter: "vgpu",
        iommu: false,
        gpus: 1,
        only: &[],
        comparator: None,
        proves: "the LTS users run: GENERIC pages (no CONFIG_PCI_P2PDMA), everything",
    },
    CiRun {
        kernel: "debian:7.3",
        pages: "auto",
        exporter: "vgpu",
        iommu: false,
        gpus: 1,
        only: &[],
        comparator: None,
        proves: "the newest kernel: P2PDMA pages, DMABUF_DEBUG, everything",
    },
    CiRun {
        kernel: "debian:7.3",
        pages: "generic",
        exporter: "vgpu",
        iommu: false,
        gpus: 1,
        only: &[
            "fgds_data",
            "fgds_lifetime",
            "fgds_revoke",
            "fgds_io",
            "fgds_gate",
            "fgds_fault_gpu_unplug",
        ],
        comparator: None,
        proves: "GENERIC pages (2 MiB mappings) on the newest kernel's mm and block layer: the \
                 programs that map, move, revoke and unplug pages",
    },
    CiRun {
        kernel: "build:6.12+debug",
        pages: "auto",
        exporter: "vgpu",
        iommu: false,
        gpus: 1,
        only: &[],
        comparator: None,
        proves: "KASAN, lockdep, kmemleak and fault injection (built once from linux-source, \
                 about 12 minutes on 2 cores, then cached), everything",
    },
    CiRun {
        kernel: "debian:7.3",
        pages: "auto",
        exporter: "vfio",
        iommu: true,
        gpus: 1,
        only: &["fgds_vfio", "fgds_python"],
        comparator: None,
        proves: "vfio-pci as the exporter (an exporter nobody here wrote), under the vIOMMU: fgds \
                 refuses it and leaves its P2PDMA state alone",
    },
    CiRun {
        kernel: "debian:7.3",
        pages: "generic",
        exporter: "vgpu",
        iommu: true,
        gpus: 1,
        only: &["fgds_badinput"],
        comparator: None,
        proves: "GENERIC pages under a translating IOMMU are refused (unsafe_setup_refused)",
    },
    CiRun {
        kernel: "debian:6.12",
        pages: "auto",
        exporter: "vgpu",
        iommu: false,
        gpus: 2,
        only: &["fgds_gpus"],
        comparator: None,
        proves: "two GPUs behind switches of their own, each with its drive: GENERIC pages \
                 refused for both, naming the drive out of each one's reach",
    },
    CiRun {
        kernel: "debian:7.3",
        pages: "auto",
        exporter: "vgpu",
        iommu: false,
        gpus: 2,
        only: &["fgds_gpus"],
        comparator: None,
        proves: "two GPUs behind switches of their own, each with its drive: P2PDMA pages, each \
                 GPU reads its own drive directly, across the switches refused",
    },
    CiRun {
        kernel: "build:7.2+io-uring-dmabuf",
        pages: "auto",
        exporter: "vgpu",
        iommu: false,
        gpus: 1,
        only: &["uring_dmabuf", "fgds_crate"],
        comparator: Some("io-uring-dmabuf-v3"),
        proves: "the upstream design (Begunkov's io_uring dma-buf series, built from \
                 ../shared/comparators/, about 7 minutes once): the kernel's dma-buf buffers \
                 through the series and through the crate's path",
    },
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

/// A stage's name and what it cost, in seconds.
type Stages = Vec<(String, f64)>;

/// Runs `f` as stage `name`, adding its wall time to `stages`.
fn stage<T>(stages: &mut Stages, name: &str, f: impl FnOnce() -> T) -> T {
    let started = std::time::Instant::now();
    let out = f();
    stages.push((name.to_owned(), started.elapsed().as_secs_f64()));
    out
}

pub fn ci(opts: &Options) -> anyhow::Result<ExitCode> {
    let root = crate::project_root();
    let started = std::time::Instant::now();
    let mut stages = Stages::new();
    let mut programs: Vec<(String, Vec<(String, f64)>)> = Vec::new();
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
        let outcome = stage(&mut stages, &format!("cargo {}", args[0]), || {
            cargo_step(&root, name, args)
        })?;
        outcomes.push(outcome);
    }
    eprintln!("ci: the Python package's wheel, mypy --strict and stubtest");
    let python = stage(&mut stages, "python package", || {
        crate::python::build_wheel().and_then(|wheel| crate::python::check(&wheel))
    });
    outcomes.push(match python {
        Ok(()) => Outcome {
            name: "ci::python-check".to_owned(),
            verdict: Verdict::Pass,
        },
        Err(err) => Outcome {
            name: "ci::python-check".to_owned(),
            verdict: Verdict::Fail(format!("{err:#}")),
        },
    });
    eprintln!("ci: checkpatch and sparse on driver/");
    let checks = stage(&mut stages, "checkpatch, sparse", || {
        check_driver_outcomes(&DriverOptions {
            kernel: "debian:6.12".to_owned(),
        })
    });
    outcomes.extend(checks);
    eprintln!("ci: packages (lintian) and dkms build against every rig kernel");
    let packages = stage(&mut stages, "packages, dkms builds", package_outcomes);
    outcomes.extend(or_failure("package::build", packages));
    let given: Vec<CiRun>;
    let runs: &[CiRun] = if opts.kernels.is_empty() {
        &CI_RUNS
    } else {
        given = opts
            .kernels
            .iter()
            .map(|k| CiRun {
                kernel: Box::leak(k.clone().into_boxed_str()),
                pages: "auto",
                exporter: "vgpu",
                iommu: false,
                gpus: 1,
                only: &[],
                comparator: None,
                proves: "given on the command line",
            })
            .collect();
        &given
    };
    let mut skips = Vec::new();
    for run in runs {
        let vm_opts = vm::Options {
            fgds_pages: run.pages.to_owned(),
            iommu: run.iommu,
            gpus: run.gpus,
            exporter: run.exporter.to_owned(),
            only: run.only.iter().map(|p| (*p).to_owned()).collect(),
            ..vm::Options::for_kernel(run.kernel)
        };
        let label = format!(
            "{} pages={}{}{}{}",
            run.kernel,
            run.pages,
            if run.exporter == "vgpu" {
                String::new()
            } else {
                format!(" {}", run.exporter)
            },
            if run.iommu { " iommu" } else { "" },
            if run.gpus > 1 {
                format!(" gpus={}", run.gpus)
            } else {
                String::new()
            }
        );
        eprintln!("ci: {label}: {}", run.proves);
        if let Some(series) = run.comparator {
            let dir = kernel::comparators_dir().join(series);
            if !dir.is_dir() {
                let why = format!(
                    "the comparator series {} is not on this machine (set FGDS_COMPARATORS to \
                     the folder that holds {series}/)",
                    dir.display()
                );
                eprintln!("ci: {label}: skipped: {why}");
                outcomes.push(Outcome {
                    name: format!("{}::run", run.kernel),
                    verdict: Verdict::Skip(why),
                });
                continue;
            }
        }
        let result = stage(&mut stages, &label, || vm::run_kernel(&vm_opts));
        outcomes.extend(or_failure(
            &format!("{}::run", run.kernel),
            result.map(|r| {
                skips.push((r.config, r.expected_skips));
                programs.push((format!("{label} ({})", r.phases), r.program_secs));
                r.outcomes
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
    let fuzzed = stage(&mut stages, "fuzzer", || crate::fuzz::run(&fuzz));
    outcomes.extend(or_failure("fuzz::run", fuzzed));
    eprintln!("ci: rig self-test");
    let selftested = stage(&mut stages, "rig self-test", || {
        selftest::run("debian:6.12")
    });
    outcomes.extend(or_failure("rig-selftest::run", selftested));
    print_costs(&stages, &programs, started.elapsed().as_secs_f64());
    let passed = report::print(outcomes);
    report::print_skips(&skips);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What each stage cost, and per booted configuration its programs, dearest first; the whole
/// table also goes to `target/ci-costs.txt`.
fn print_costs(stages: &Stages, programs: &[(String, Vec<(String, f64)>)], total: f64) {
    use std::fmt::Write as _;
    let mut text = String::new();
    let _ = writeln!(text, "ci: {total:.0} s in all; per stage:");
    for (name, secs) in stages {
        let _ = writeln!(text, "  {secs:7.1} s  {name}");
    }
    for (config, progs) in programs {
        let mut progs = progs.clone();
        progs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let shown = progs
            .iter()
            .filter(|(_, s)| *s >= 1.0)
            .map(|(p, s)| format!("{p} {s:.0}"))
            .collect::<Vec<_>>();
        let _ = writeln!(text, "  {config}: {}", shown.join(", "));
    }
    print!("{text}");
    let path = crate::project_root().join("target/ci-costs.txt");
    if let Err(err) = std::fs::write(&path, &text) {
        eprintln!("ci: cannot write {}: {err}", path.display());
    }
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
