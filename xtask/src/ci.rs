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
    /// About what its machine costs in seconds (a fresh clone's CI, `target/ci-costs.txt`),
    /// for the order CI starts machines in: dearest first.
    pub secs: u32,
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
        secs: 120,
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
        secs: 80,
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
        secs: 50,
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
        secs: 190,
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
        secs: 15,
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
        secs: 8,
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
        secs: 8,
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
        secs: 8,
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
        secs: 35,
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
        crate::python::build_wheel(crate::python::WheelProfile::Rig)
            .and_then(|wheel| crate::python::check(&wheel))
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
                secs: 150,
            })
            .collect();
        &given
    };
    let mut jobs = runs.iter().map(Job::Run).collect::<Vec<_>>();
    jobs.push(Job::Fuzz(crate::fuzz::Options::ci()));
    jobs.push(Job::SelfTest);
    let lanes = lanes();
    eprintln!(
        "ci: {} machines, {lanes} at a time (each TCG machine is one host thread)",
        jobs.len()
    );
    let lanes_started = std::time::Instant::now();
    let done = run_in_lanes(&jobs, lanes);
    let mut skips = Vec::new();
    for (job, done) in jobs.iter().zip(done) {
        stages.push((job.label(), done.secs));
        outcomes.extend(done.outcomes);
        skips.extend(done.skips);
        programs.extend(done.programs);
    }
    stages.push((
        format!("machines, {lanes} at a time (wall)"),
        lanes_started.elapsed().as_secs_f64(),
    ));
    print_costs(&stages, &programs, started.elapsed().as_secs_f64());
    let passed = report::print(outcomes);
    report::print_skips(&skips);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One machine CI boots: a configuration of [`CI_RUNS`], the fuzzer, or the rig's self-test.
enum Job<'a> {
    Run(&'a CiRun),
    Fuzz(crate::fuzz::Options),
    SelfTest,
}

/// What a job gave.
#[derive(Default)]
struct JobDone {
    secs: f64,
    outcomes: Vec<Outcome>,
    /// The run's configuration and the skips the expected-outcome table expects in it.
    skips: Vec<(String, usize)>,
    /// The configuration with its phases, and what each of its programs cost.
    programs: Vec<(String, Vec<(String, f64)>)>,
}

/// The fuzzer's machine: about its minutes plus the debug kernel's boot and checks.
const FUZZ_SECS: u32 = 100;
/// The self-test's two short boots.
const SELFTEST_SECS: u32 = 15;

impl Job<'_> {
    fn label(&self) -> String {
        match self {
            Job::Run(run) => format!(
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
            ),
            Job::Fuzz(_) => "fuzzer".to_owned(),
            Job::SelfTest => "rig self-test".to_owned(),
        }
    }

    /// About what the job costs, for the order the lanes take jobs in: dearest first.
    fn secs(&self) -> u32 {
        match self {
            Job::Run(run) => run.secs,
            Job::Fuzz(_) => FUZZ_SECS,
            Job::SelfTest => SELFTEST_SECS,
        }
    }

    fn run(&self) -> JobDone {
        let label = self.label();
        let started = std::time::Instant::now();
        let mut done = JobDone::default();
        match self {
            Job::Run(run) => {
                eprintln!("ci: {label}: {}", run.proves);
                if let Some(series) = run.comparator {
                    let dir = kernel::comparators_dir().join(series);
                    if !dir.is_dir() {
                        let why = format!(
                            "the comparator series {} is not on this machine (set \
                             FGDS_COMPARATORS to the folder that holds {series}/)",
                            dir.display()
                        );
                        eprintln!("ci: {label}: skipped: {why}");
                        done.outcomes.push(Outcome {
                            name: format!("{}::run", run.kernel),
                            verdict: Verdict::Skip(why),
                        });
                        return done;
                    }
                }
                let vm_opts = vm::Options {
                    fgds_pages: run.pages.to_owned(),
                    iommu: run.iommu,
                    gpus: run.gpus,
                    exporter: run.exporter.to_owned(),
                    only: run.only.iter().map(|p| (*p).to_owned()).collect(),
                    ..vm::Options::for_kernel(run.kernel)
                };
                let result = vm::run_kernel(&vm_opts);
                done.outcomes = or_failure(
                    &format!("{}::run", run.kernel),
                    result.map(|r| {
                        done.skips.push((r.config, r.expected_skips));
                        done.programs
                            .push((format!("{label} ({})", r.phases), r.program_secs));
                        r.outcomes
                    }),
                );
            }
            Job::Fuzz(fuzz) => {
                eprintln!(
                    "ci: the fuzzer, {} s on {} (seed {})",
                    fuzz.seconds(),
                    fuzz.kernel,
                    fuzz.seed.as_deref().unwrap_or("-")
                );
                done.outcomes = or_failure("fuzz::run", crate::fuzz::run(fuzz));
            }
            Job::SelfTest => {
                eprintln!("ci: rig self-test");
                done.outcomes = or_failure("rig-selftest::run", selftest::run("debian:6.12"));
            }
        }
        done.secs = started.elapsed().as_secs_f64();
        let failed = done
            .outcomes
            .iter()
            .filter(|o| matches!(o.verdict, Verdict::Fail(_)))
            .count();
        eprintln!(
            "ci: {label}: done in {:.0} s, {} results, {failed} failed",
            done.secs,
            done.outcomes.len()
        );
        done
    }
}

/// How many machines CI runs at once: one per host core (each TCG machine runs on one host
/// thread), at most four.
fn lanes() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().clamp(1, 4))
}

/// Runs `jobs` on `lanes` threads, each taking the dearest job left; returns what each gave, in
/// the order of `jobs`.
fn run_in_lanes(jobs: &[Job<'_>], lanes: usize) -> Vec<JobDone> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut order = (0..jobs.len()).collect::<Vec<_>>();
    order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].secs()));
    let next = AtomicUsize::new(0);
    let results = Mutex::new(
        (0..jobs.len())
            .map(|_| None)
            .collect::<Vec<Option<JobDone>>>(),
    );
    std::thread::scope(|scope| {
        for _ in 0..lanes {
            let (order, next, results) = (&order, &next, &results);
            scope.spawn(move || {
                while let Some(&i) = order.get(next.fetch_add(1, Ordering::SeqCst)) {
                    vm::set_log_prefix(&format!("[{}] ", jobs[i].label()));
                    let done = jobs[i].run();
                    results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(done);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect()
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
