//! `cargo xtask test-vm`: one kernel, one machine, the whole suite.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fgds_pattern as pattern;
use fgds_qemu::machine::{self, Accel, TcgThreads};
use fgds_vm_images::{disk, kernel};

use crate::expected::{self, RunConfig};
use crate::host::{self, Phases};
use crate::report::{self, Outcome};
use crate::{driver, fio, guest, package, python, run_memory};

/// Seconds the guest gets to boot and load modules, on top of the tests' own timeouts.
const BOOT_ALLOWANCE_SECS: u64 = 120;
/// Timeout of a program given with `--exec`.
const EXEC_TIMEOUT_SECS: u64 = 300;

#[derive(clap::Args, Clone)]
pub struct Options {
    /// The kernel: debian:6.1, debian:6.12, debian:7.2, debian:7.3, or path:DIR (a built tree).
    #[arg(long, default_value = "debian:6.12")]
    pub kernel: String,
    /// CPU accelerator. KVM is opt-in: these hosts' /dev/kvm cannot boot the guest kernels.
    #[arg(long, value_enum, default_value_t = AccelArg::Tcg)]
    pub accel: AccelArg,
    /// TCG's host threads: one for all vCPUs (single), or one per vCPU (multi: faster, but
    /// QEMU then may run stale code after the kernel patches its text; docs/architecture.md,
    /// Boot flakes).
    #[arg(long, value_enum, default_value_t = DEFAULT_TCG_THREADS)]
    pub tcg_threads: TcgThreadsArg,
    /// A static executable to run in the guest after the suite (repeatable). Exit 0 passes,
    /// 4 skips, anything else fails; KTAP lines it prints are reported as subtests.
    #[arg(long = "exec", value_name = "PATH")]
    pub exec: Vec<PathBuf>,
    /// The vgpu exporter's mode: plain (no struct pages, like VRAM), provider (plain with a
    /// P2PDMA provider of its own, as vfio-pci on 7.x) or p2pdma (P2PDMA pages of its own,
    /// published for upstream's p2pmem).
    #[arg(long, default_value = "plain", value_parser = ["plain", "provider", "p2pdma"])]
    pub vgpu_mode: String,
    /// fgds's `pages=` parameter: which pages it creates over the GPU's BAR (auto: P2PDMA
    /// wherever the kernel has CONFIG_PCI_P2PDMA, GENERIC only on kernels without it and only
    /// where fgds vouches for the topology).
    #[arg(long, default_value = "auto", value_parser = FGDS_PAGES)]
    pub fgds_pages: String,
    /// Run only the suite's programs whose names contain this (repeatable; --exec ones always run).
    #[arg(long = "only", value_name = "NAME")]
    pub only: Vec<String>,
    /// Extra kernel parameters (`fgds.<name>=<value>` reaches tests as `FGDS_<NAME>`).
    #[arg(long, default_value = "")]
    pub append: String,
    /// Bytes of GPU memory (the ivshmem BAR; a power of two).
    #[arg(long, default_value_t = pattern::GPU_MEMORY_BYTES)]
    pub gpu_bytes: u64,
    /// NVMe drives behind the GPU's switch (1 to 8): the raw drive, the second drive, then
    /// drives of the second's size (128 MiB, sparse), serials `fgds-drive3` and up. The
    /// default, 2, is the rig's machine as it always was; the suite's cases of the second
    /// drive need it.
    #[arg(long, default_value_t = DEFAULT_DRIVES, value_parser = clap::value_parser!(u8).range(1..=machine::MAX_DRIVES as i64))]
    pub drives: u8,
    /// Run these programs of tests/ (name and timeout) instead of the suite.
    #[arg(skip)]
    pub programs: Vec<(String, u64)>,
    /// The NVMe controller's `mdts` (largest transfer, as a power of two of 4 KiB; 0: no
    /// limit), where not QEMU's default (7: 512 KiB). `cargo xtask bench` lifts it, so that no
    /// request of its grid up to the guest driver's own limit is split.
    #[arg(skip)]
    pub nvme_mdts: Option<u8>,
    /// The guest loads xfs and btrfs for `programs` (as a suite line's `+fs` does).
    #[arg(skip)]
    pub filesystems: bool,
    /// A fio job file staged for the guest as `job.fio` (`cargo xtask fio --job`).
    #[arg(skip)]
    pub fio_job: Option<PathBuf>,
    /// A translating vIOMMU (intel-iommu); devices on separate root ports, P2P through the
    /// host bridge.
    #[arg(long)]
    pub iommu: bool,
    /// Who exports the GPU's memory: vgpu (the rig's exporter) or vfio (the GPU bound to
    /// vfio-pci, its BAR exported with VFIO_DEVICE_FEATURE_DMA_BUF; needs --iommu and a kernel
    /// with CONFIG_VFIO_PCI_DMABUF; vgpu is not loaded).
    #[arg(long, default_value = "vgpu", value_parser = expected::EXPORTERS)]
    pub exporter: String,
    /// GPUs in the machine: 1, or 2 (the second behind a switch of its own with a drive of its
    /// own, serial fgds3; fgds_gpus's machine).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub gpus: u8,
    /// Run no suite program, only the --exec ones.
    #[arg(long)]
    pub no_suite: bool,
    /// Machines the suite is shared out between, booted at once (each TCG machine runs on one
    /// host thread; each has its own console and verdicts, the second's named `<run>-m2`).
    /// 0: one per host core, at most two.
    #[arg(long, default_value_t = 0)]
    pub machines: usize,
    /// This run is part `.0` of the suite's split, with these programs (`--machines`).
    #[arg(skip)]
    pub part: Option<(usize, Vec<String>)>,
    /// Boot with the fgds.ko that `dkms build` makes from the fgds-dkms package (built as
    /// `cargo xtask package` does) instead of the rig's own build of driver/.
    #[arg(long)]
    pub dkms: bool,
    /// How the guest's Rust programs are built: for tests, or `release` for measurements.
    #[arg(skip)]
    pub build: guest::Build,
}

impl Options {
    /// Whether `--only` selects the suite's program `name` (any given part of its name).
    fn selects(&self, name: &str) -> bool {
        self.only.iter().any(|o| name.contains(o.as_str()))
    }

    /// The defaults of `cargo xtask test-vm --kernel <kernel>`: the whole suite, TCG, plain vgpu.
    pub fn for_kernel(kernel: &str) -> Options {
        Options {
            kernel: kernel.to_owned(),
            accel: AccelArg::Tcg,
            tcg_threads: DEFAULT_TCG_THREADS,
            exec: Vec::new(),
            vgpu_mode: "plain".to_owned(),
            fgds_pages: "auto".to_owned(),
            only: Vec::new(),
            no_suite: false,
            dkms: false,
            iommu: false,
            exporter: "vgpu".to_owned(),
            append: String::new(),
            gpu_bytes: pattern::GPU_MEMORY_BYTES,
            gpus: 1,
            drives: DEFAULT_DRIVES,
            programs: Vec::new(),
            nvme_mdts: None,
            filesystems: false,
            fio_job: None,
            machines: 1,
            part: None,
            build: guest::Build::Tests,
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy)]
pub enum AccelArg {
    Tcg,
    Kvm,
}

/// The machine's drives unless `--drives` says otherwise: the raw drive and the second one.
pub const DEFAULT_DRIVES: u8 = 2;

/// TCG's host threads unless `--tcg-threads` says otherwise: one. With a thread per vCPU,
/// QEMU (7.2 and 10.0 alike) can keep a translation of code that another vCPU is rewriting, so
/// the guest runs an INT3 the kernel already removed and oopses (docs/architecture.md, Boot
/// flakes).
pub const DEFAULT_TCG_THREADS: TcgThreadsArg = TcgThreadsArg::Single;

#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq)]
pub enum TcgThreadsArg {
    Single,
    Multi,
}

pub fn test_vm(opts: &Options) -> anyhow::Result<ExitCode> {
    let runs = run_split(opts)?;
    let config = runs[0].config.clone();
    let expected_skips = runs.iter().map(|r| r.expected_skips).sum();
    let passed = report::print(runs.into_iter().flat_map(|r| r.outcomes).collect());
    report::print_skips(&[(config, expected_skips)]);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// What one kernel's run gave.
pub struct KernelRun {
    /// The spec as given, e.g. `debian:6.12`.
    pub spec: String,
    pub release: String,
    pub package_version: String,
    /// The guest's `# fgds-report:` lines (the driver's mode, ...).
    pub reports: Vec<String>,
    /// The run's configuration, as `RunConfig::describe` says it.
    pub config: String,
    /// Skips the expected-outcome table expects (xtask/src/expected.rs) in this run.
    pub expected_skips: usize,
    /// Whether the kernel has CONFIG_PCI_P2PDMA (upstream's p2pmem can run on it).
    pub has_p2pdma: bool,
    /// From the start of the fetch to the verdicts.
    pub took: Duration,
    /// From QEMU's start to the guest's first result (`setup`); `None` if none came.
    pub booted_in: Option<Duration>,
    pub outcomes: Vec<Outcome>,
    /// Where the run's artifacts are.
    pub run_dir: PathBuf,
    /// What each top-level result cost: the time from the one before (or the machine's start)
    /// to it, and the host's phases before the machine (fetch, build, image, ...).
    pub program_secs: Vec<(String, f64)>,
    pub phases: String,
}

/// The values of fgds's `pages=` parameter.
pub const FGDS_PAGES: [&str; 3] = ["auto", "p2pdma", "generic"];

/// Runs the suite on one kernel and returns the verdicts. Errors are problems of the host (a
/// kernel that cannot be fetched, a driver that does not build, a configuration the rig cannot
/// run), not test failures.
pub fn run_kernel(opts: &Options) -> anyhow::Result<KernelRun> {
    let prepared = {
        let _held = PREPARING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        prepare(opts)?
    };
    boot(&prepared, opts, true)
}

/// Runs the suite as `--machines` says: on one machine, or shared out between machines booted
/// at once, each with the programs of its share in the suite's order and everything a run
/// checks of its own (console, kmemleak, the driver's mode). The guest programs are built
/// first, for all, while the kernel is fetched; the share with the Python programs is
/// prepared last, so that the wheel is built while the first machine runs.
pub fn run_split(opts: &Options) -> anyhow::Result<Vec<KernelRun>> {
    let machines = match opts.machines {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get().min(2)),
        n => n,
    };
    if machines < 2 || opts.no_suite || !opts.programs.is_empty() || !opts.exec.is_empty() {
        return Ok(vec![run_kernel(opts)?]);
    }
    let mut suite = guest::default_suite(&guest::bin_dir(opts.build))?;
    if !opts.only.is_empty() {
        suite.retain(|e| opts.selects(&e.name));
    }
    if suite.len() < 2 {
        return Ok(vec![run_kernel(opts)?]);
    }
    let mut parts = share_out(&suite, machines);
    // The share with the Python programs last: its wheel builds while the others run.
    parts.sort_by_key(|part| {
        part.iter()
            .any(|name| suite.iter().any(|e| e.name == *name && e.python))
    });
    let rust = suite
        .iter()
        .filter(|e| e.is_rust())
        .map(|e| e.name.as_str())
        .collect::<Vec<_>>();
    {
        let _held = PREPARING
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        build_while_fetching(opts, &suite, &rust)?;
    }
    let results = std::thread::scope(|scope| {
        // Each machine is prepared once the one before it was (or failed to be).
        let mut after: Option<std::sync::mpsc::Receiver<()>> = None;
        let handles = parts
            .into_iter()
            .enumerate()
            .map(|(i, names)| {
                let part_opts = Options {
                    part: Some((i + 1, names)),
                    ..opts.clone()
                };
                let (prepared_tx, prepared_rx) = std::sync::mpsc::channel::<()>();
                let wait = after.replace(prepared_rx);
                scope.spawn(move || {
                    set_log_prefix(&format!("[{}/{machines}] ", i + 1));
                    if let Some(wait) = wait {
                        let _ = wait.recv();
                    }
                    let prepared = {
                        let _held = PREPARING.lock().unwrap_or_else(|p| p.into_inner());
                        prepare(&part_opts)
                    };
                    drop(prepared_tx);
                    boot(&prepared?, &part_opts, true)
                })
            })
            .collect::<Vec<_>>();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::format_err!("a run's thread panicked")))
            })
            .collect::<Vec<_>>()
    });
    results.into_iter().collect()
}

/// Builds the guest's programs while the host's packages, the kernel and what fio's engine and
/// the wheel build from are fetched, and the driver is built against the kernel (the machines
/// then find them there): on a bare machine the downloads (20 s and more for a Debian kernel's
/// packages) no longer wait for the compiler, and the first machine no longer waits for the
/// driver's build after the programs' (10 s).
fn build_while_fetching(
    opts: &Options,
    suite: &[guest::SuiteEntry],
    rust: &[&str],
) -> anyhow::Result<()> {
    let spec: kernel::KernelSpec = opts.kernel.parse()?;
    std::thread::scope(|scope| {
        let fetch = scope.spawn(|| {
            host::ensure_packages(host::VM_PACKAGES)?;
            let kernel = kernel::prepare(&spec, &host::cache_dir()?)?;
            // Kept in the driver's build cache, where each machine's own build finds it; built
            // in a directory of this process's own (another run may build beside it), which
            // goes once the cache holds the build and stays, with its log, where it failed.
            let ahead = crate::project_root()
                .join("target/driver-builds")
                .join(format!("ahead-{}-{}", spec.slug(), std::process::id()));
            std::fs::create_dir_all(&ahead)?;
            driver::build(&kernel, &ahead)?;
            std::fs::remove_dir_all(&ahead)
                .with_context(|| format!("cannot remove {}", ahead.display()))
        });
        // fio's source and the wheel's tools beside the kernel (10 s from an empty cache).
        let tools = scope.spawn(|| {
            if suite.iter().any(|e| e.fio) {
                fio::fetch()?;
            }
            if suite.iter().any(|e| e.python) {
                python::fetch_tools()?;
            }
            anyhow::Ok(())
        });
        let programs = guest::build_binaries(opts.build, rust);
        let joined = |thread: std::thread::ScopedJoinHandle<'_, anyhow::Result<()>>| {
            thread
                .join()
                .unwrap_or_else(|_| Err(anyhow::format_err!("a fetching thread panicked")))
        };
        programs.and(joined(fetch)).and(joined(tools))
    })
}

/// About how much later the machine with the Python programs starts its programs than the
/// other, which boots while the wheel builds (`rig` profile, after the guest's programs, whose
/// libraries it shares: 13-18 s), its own boot then beside the other's programs: 9-20 s,
/// measured in five runs.
const WHEEL_SECS: u64 = 15;

/// The suite's programs shared out between `machines` by their typical seconds (the dearest
/// first, each to the least loaded machine; the Python programs on the last machine, with the
/// wheel's build counted against it), each share in the suite's order.
fn share_out(suite: &[guest::SuiteEntry], machines: usize) -> Vec<Vec<String>> {
    let mut load = vec![0u64; machines];
    let mut share = vec![0usize; suite.len()];
    // The Python programs on the last machine, which starts later by the wheel's build.
    let last = machines - 1;
    for (at, entry) in suite.iter().enumerate().filter(|(_, e)| e.python) {
        load[last] = load[last].max(WHEEL_SECS) + entry.typical_secs;
        share[at] = last;
    }
    let mut by_cost = suite.iter().filter(|e| !e.python).collect::<Vec<_>>();
    by_cost.sort_by_key(|e| std::cmp::Reverse(e.typical_secs));
    for entry in by_cost {
        let lightest = (0..machines).min_by_key(|&m| load[m]).unwrap_or(0);
        load[lightest] += entry.typical_secs;
        let at = suite.iter().position(|e| e.name == entry.name).unwrap_or(0);
        share[at] = lightest;
    }
    (0..machines)
        .map(|m| {
            suite
                .iter()
                .zip(&share)
                .filter(|(_, s)| **s == m)
                .map(|(e, _)| e.name.clone())
                .collect::<Vec<_>>()
        })
        .filter(|part| !part.is_empty())
        .collect()
}

/// Held while a run is prepared. Runs that boot side by side (`cargo xtask ci`) share what
/// preparing builds or installs in place: the guest programs, the driver's build cache, the
/// staged Python and fio, the host's packages. Their machines run at once; their preparations
/// one after the other.
static PREPARING: std::sync::Mutex<()> = std::sync::Mutex::new(());

thread_local! {
    /// What this thread's progress lines start with: the configuration's name while runs
    /// share the terminal (`cargo xtask ci`), else nothing.
    static LOG_PREFIX: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Starts every progress line this thread's runs print with `prefix`.
pub fn set_log_prefix(prefix: &str) {
    LOG_PREFIX.with(|p| *p.borrow_mut() = prefix.to_owned());
}

/// `eprintln!` with the thread's [`LOG_PREFIX`].
macro_rules! say {
    ($($arg:tt)*) => {
        LOG_PREFIX.with(|p| eprintln!("{}{}", p.borrow(), format_args!($($arg)*)))
    };
}

/// A run made ready to boot: the kernel fetched, the driver and the guest programs built, the
/// initramfs written. [`boot`] boots it (once, or again for `cargo xtask boot-loop`).
pub struct Prepared {
    started: Instant,
    label: String,
    pub run_dir: PathBuf,
    /// Held while the run directory is in use.
    _lock: File,
    kernel: kernel::Kernel,
    build: driver::Build,
    dkms_outcome: Option<Outcome>,
    run_config: RunConfig,
    /// The programs the expected-outcome table speaks for.
    covered: Vec<String>,
    suite: Vec<guest::SuiteEntry>,
    initrd: PathBuf,
    phases: Phases,
}

impl Prepared {
    /// The run's name, e.g. `debian-7.3`, `debian-6.12-iommu`.
    pub fn label(&self) -> &str {
        &self.label
    }
}

/// Fetches the kernel, builds the driver and the guest programs and writes the initramfs.
pub fn prepare(opts: &Options) -> anyhow::Result<Prepared> {
    let started = Instant::now();
    let spec: kernel::KernelSpec = opts.kernel.parse()?;
    let mut label = spec.slug();
    if opts.iommu {
        label.push_str("-iommu");
    }
    if opts.exporter != "vgpu" {
        label = format!("{label}-{}", opts.exporter);
    }
    if opts.fgds_pages != "auto" {
        label = format!("{label}-{}", opts.fgds_pages);
    }
    if opts.dkms {
        label.push_str("-dkms");
    }
    if opts.gpus > 1 {
        label = format!("{label}-gpus{}", opts.gpus);
    }
    if let Some((n, _)) = &opts.part
        && *n > 1
    {
        label = format!("{label}-m{n}");
    }
    let (run_dir, lock) = claim_run_dir(&crate::project_root().join("target/vm"), &label)?;
    say!(
        "test-vm: {} (artifacts in {})",
        opts.kernel,
        run_dir.display()
    );
    let mut phases = Phases::default();

    host::ensure_packages(host::VM_PACKAGES)?;
    let cache = host::cache_dir()?;
    let kernel = phases.run("fetch", || kernel::prepare(&spec, &cache))?;
    say!(
        "  kernel {} (package {})",
        kernel.release,
        display_version(&kernel.package_version)
    );

    let run_config = RunConfig {
        gpus: opts.gpus,
        ..RunConfig::new(
            &kernel,
            &opts.fgds_pages,
            &opts.vgpu_mode,
            opts.iommu,
            &opts.exporter,
        )?
    };
    let vfio = run_config.exporter == expected::Exporter::Vfio;
    let expected_mode = expected::mode(&run_config)?;

    let bin_dir = guest::bin_dir(opts.build);
    let mut suite = guest::default_suite(&bin_dir)?;
    // The programs the expected-outcome table speaks for.
    let covered = ["setup", "kmemleak", "vm"]
        .into_iter()
        .map(str::to_owned)
        .chain(suite.iter().map(|e| e.name.clone()))
        .collect::<Vec<_>>();
    if let Some(unknown) = opts
        .only
        .iter()
        .find(|o| !suite.iter().any(|e| e.name.contains(o.as_str())))
    {
        let names = suite.iter().map(|e| e.name.as_str()).collect::<Vec<_>>();
        bail!(
            "--only {unknown}: no program of tests/suite.txt matches; there are {}",
            names.join(", ")
        );
    }
    if !opts.only.is_empty() {
        suite.retain(|e| opts.selects(&e.name));
    }
    if let Some((_, names)) = &opts.part {
        suite.retain(|e| names.contains(&e.name));
    }
    if opts.no_suite {
        suite.clear();
    }
    if !opts.programs.is_empty() {
        suite = opts
            .programs
            .iter()
            .map(|(name, timeout_secs)| guest::SuiteEntry {
                name: name.clone(),
                path: bin_dir.join(name),
                timeout_secs: *timeout_secs,
                c_source: None,
                python: false,
                // A program of the suite keeps what its suite line asks for.
                fio: suite.iter().any(|e| e.name == *name && e.fio),
                fs: opts.filesystems || suite.iter().any(|e| e.name == *name && e.fs),
                field: suite.iter().any(|e| e.name == *name && e.field),
                typical_secs: 1,
            })
            .collect();
    }
    if !opts.gpu_bytes.is_power_of_two() {
        bail!("--gpu-bytes {}: QEMU needs a power of two", opts.gpu_bytes);
    }
    let build = phases.run("build", || {
        let build = driver::build(&kernel, &run_dir)?;
        let rust = suite
            .iter()
            .filter(|e| e.is_rust())
            .map(|e| e.name.as_str())
            .collect::<Vec<_>>();
        guest::build_binaries(opts.build, &rust)?;
        guest::build_c_programs(&suite)?;
        Ok(build)
    })?;
    let python = if suite.iter().any(|e| e.python) {
        Some(phases.run("python", || {
            let wheel = python::build_wheel(python::WheelProfile::Rig)?;
            let modules = python::test_modules()?;
            let root = python::stage_guest(&wheel, &modules)?;
            Ok((root, modules))
        })?)
    } else {
        None
    };
    let staged = if suite.iter().any(|e| e.fio) {
        vec![phases.run("fio", || fio::stage_guest(opts.fio_job.as_deref()))?]
    } else {
        Vec::new()
    };
    for exec in &opts.exec {
        suite.push(guest::exec_entry(exec, EXEC_TIMEOUT_SECS)?);
    }
    let mut kos = build.kos.clone();
    let mut dkms_outcome = None;
    if opts.dkms {
        let ko = phases.run("dkms", || {
            let packages = package::build(false)?;
            package::dkms_build(&packages, &opts.kernel)
        })?;
        say!("  fgds.ko from dkms: {}", ko.display());
        let at = driver::RIG_MODULES
            .iter()
            .position(|m| *m == "fgds")
            .expect("fgds is a rig module");
        kos[at] = ko;
        dkms_outcome = Some(Outcome {
            name: format!("{label}::dkms-build"),
            verdict: report::Verdict::Pass,
        });
    }

    let initrd = run_dir.join("initramfs.cpio");
    phases.run("initramfs", || {
        // With vfio-pci as the exporter vgpu is not loaded at all: nothing of it can stand in.
        let rig = kos
            .iter()
            .zip(driver::RIG_MODULES)
            .filter(|(_, name)| !(vfio && **name == "vgpu"))
            .map(|(ko, name)| guest::RigModule {
                ko: ko.clone(),
                params: module_params(name, opts, run_config.vgpu_mode),
            })
            .collect::<Vec<_>>();
        let env = [
            ("FGDS_EXPECTED_MODE", expected_mode.sysfs()),
            ("FGDS_EXPORTER", run_config.exporter.name()),
        ];
        let setup = guest::GuestSetup {
            rig_modules: &rig,
            kernel_modules: if vfio { guest::VFIO_MODULES } else { &[] },
            binds: if vfio {
                &[("@ivshmem@", "vfio-pci")]
            } else {
                &[]
            },
            env: &env,
        };
        let python = python
            .as_ref()
            .map(|(root, modules)| (root.as_path(), modules.as_slice()));
        let plan = guest::make_initramfs(
            &kernel, &cache, &bin_dir, &setup, &suite, python, &staged, &initrd,
        )?;
        std::fs::write(run_dir.join("plan.txt"), plan)?;
        Ok(())
    })?;
    Ok(Prepared {
        started,
        label,
        run_dir,
        _lock: lock,
        kernel,
        build,
        dkms_outcome,
        run_config,
        covered,
        suite,
        initrd,
        phases,
    })
}

/// Boots a prepared run and returns its verdicts; `echo` prints the results as they come and
/// the phases' times. Errors are problems of the host, not test failures.
pub fn boot(prepared: &Prepared, opts: &Options, echo: bool) -> anyhow::Result<KernelRun> {
    let mut phases = prepared.phases.clone();
    let Prepared {
        started,
        label,
        run_dir,
        kernel,
        build,
        dkms_outcome,
        run_config,
        covered,
        suite,
        initrd,
        ..
    } = prepared;
    // Drives three and up, each of the second's size.
    let more_drives = usize::from(opts.drives).saturating_sub(2);
    let memory = run_memory::create(
        run_dir,
        opts.gpu_bytes,
        pattern::NVME_IMAGE_BYTES
            + (4 + more_drives as u64) * disk::SMALL_DRIVE_BYTES
            + if opts.gpus > 1 { opts.gpu_bytes } else { 0 }
            + disk::XFS_DRIVE_BYTES
            + disk::BTRFS_DRIVE_BYTES,
    )?;
    let gpu_backing = memory.gpu.clone();
    let nvme_image = memory.drive("nvme.img")?;
    let ext4_image = memory.drive("ext4.img")?;
    // xfs and btrfs namespaces only for a run with a program that uses them (`+fs`): every
    // other run keeps the machine the comparator's unplug cases were measured on.
    let filesystems = suite.iter().any(|e| e.fs);
    let (xfs_image, btrfs_image) = if filesystems {
        (
            Some(memory.drive("xfs.img")?),
            Some(memory.drive("btrfs.img")?),
        )
    } else {
        (None, None)
    };
    let nvme2_image = if opts.drives >= 2 {
        Some(memory.drive("nvme2.img")?)
    } else {
        None
    };
    let extra_drives = (3..3 + more_drives)
        .map(|n| memory.drive(&format!("drive{n}.img")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // A drive outside the GPU's switch only for a run with a program that uses it (`+field`).
    let far_image = if suite.iter().any(|e| e.field) {
        Some(memory.drive("far.img")?)
    } else {
        None
    };
    let second_gpu = if opts.gpus > 1 {
        Some(machine::SecondGpu {
            backing: memory.drive("gpu1.mem")?,
            drive_image: memory.drive("nvme3.img")?,
        })
    } else {
        None
    };
    phases.run("image", || {
        disk::write_nvme_image(&nvme_image)?;
        disk::write_gpu_backing(&gpu_backing, opts.gpu_bytes)?;
        disk::write_ext4_image(&ext4_image, disk::SMALL_DRIVE_BYTES)?;
        if let (Some(xfs), Some(btrfs)) = (&xfs_image, &btrfs_image) {
            disk::write_fs_image(xfs, "xfs", disk::XFS_DRIVE_BYTES)?;
            disk::write_fs_image(btrfs, "btrfs", disk::BTRFS_DRIVE_BYTES)?;
        }
        for image in nvme2_image.iter().chain(&extra_drives) {
            disk::write_gpu_backing(image, disk::SMALL_DRIVE_BYTES)?;
        }
        if let Some(far) = &far_image {
            disk::write_gpu_backing(far, disk::SMALL_DRIVE_BYTES)?;
        }
        if let Some(second) = &second_gpu {
            disk::write_gpu_backing(&second.backing, opts.gpu_bytes)?;
            disk::write_gpu_backing(&second.drive_image, disk::SMALL_DRIVE_BYTES)?;
        }
        Ok(())
    })?;

    let config = machine::Config {
        kernel: kernel.vmlinuz.clone(),
        initrd: initrd.clone(),
        // Where vfio is built in (the comparator kernel), its type1 parameter comes from the
        // command line; where it is a module the init passes it at load (VFIO_MODULES).
        cmdline: format!(
            "{} {} {} {} {}",
            opts.append,
            if run_config.exporter == expected::Exporter::Vfio {
                guest::VFIO_BUILTIN_PARAMS
            } else {
                ""
            },
            // The init waits for and mounts the xfs and btrfs namespaces only then.
            if filesystems { "fgds.fs=1" } else { "" },
            // fgds_gate plugs the drive outside the switch in only then.
            if far_image.is_some() && !opts.iommu {
                "fgds.far=1"
            } else {
                ""
            },
            // The init waits for this many drives, and the tests find them (FGDS_DRIVES).
            if opts.drives == DEFAULT_DRIVES {
                String::new()
            } else {
                format!("fgds.drives={}", opts.drives)
            }
        )
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" "),
        accel: match (opts.accel, opts.tcg_threads) {
            (AccelArg::Tcg, TcgThreadsArg::Single) => Accel::Tcg(TcgThreads::Single),
            (AccelArg::Tcg, TcgThreadsArg::Multi) => Accel::Tcg(TcgThreads::Multi),
            (AccelArg::Kvm, _) => Accel::Kvm,
        },
        cpus: 2,
        memory_mib: 2048,
        nvme_image,
        gpu_backing: gpu_backing.clone(),
        gpu_bytes: opts.gpu_bytes,
        second_gpu,
        nvme_errors: nvme_errors(),
        nvme_mdts: opts.nvme_mdts,
        iommu: opts.iommu,
        ext4_image,
        xfs_image,
        btrfs_image,
        nvme2_image,
        extra_drives,
        far_image,
        run_dir: run_dir.clone(),
    };
    let limit = Duration::from_secs(
        BOOT_ALLOWANCE_SECS + suite.iter().map(|e| e.timeout_secs).sum::<u64>(),
    );
    let run = run_machine(&config, limit, echo)?;
    let boot = run.boot.unwrap_or(run.took);
    phases.record("boot", boot);
    phases.record("tests", run.took.saturating_sub(boot));

    let files = machine::run_files(run_dir);
    let ktap = machine::read_log(&files.ktap);
    let console = machine::read_log(&files.console);
    let machine_problem = match (&run.exit, machine::check_qemu_log(&files), run.panicked) {
        (machine::Exit::TimedOut, _, _) => Some(format!(
            "the machine ran past its limit of {} s and was stopped",
            limit.as_secs()
        )),
        (
            machine::Exit::Exited {
                signal: Some(signal),
                ..
            },
            _,
            _,
        ) => Some(format!(
            "QEMU died of signal {signal} (its log: {})",
            files.qemu_log.display()
        )),
        (_, Err(err), _) => Some(format!("{err:#}")),
        (_, Ok(()), true) => Some("QEMU reported a guest panic (pvpanic)".to_owned()),
        (machine::Exit::Exited { .. }, Ok(()), false) => console
            .lines()
            .find(|l| l.contains(POWER_OFF_STUCK))
            .map(|line| {
                format!(
                    "the guest's power-off was stuck, and the init restarted it: {} (the \
                     console shows the blocked tasks)",
                    line.trim()
                )
            }),
    };
    let planned = std::iter::once("setup".to_owned())
        .chain(suite.iter().map(|e| e.name.clone()))
        .chain(std::iter::once("kmemleak".to_owned()))
        .collect::<Vec<_>>();
    let mut reports = Vec::<String>::new();
    for line in ktap.lines().filter_map(|l| l.split("fgds-report: ").nth(1)) {
        if !reports.iter().any(|r| r == line.trim()) {
            if echo {
                say!("  {}", line.trim());
            }
            reports.push(line.trim().to_owned());
        }
    }
    if echo {
        say!("  phases: {}", phases.summary());
    }
    let mut outcomes = vec![
        driver::build_outcome(label, build),
        driver::probes_outcome(label, kernel, build),
    ];
    outcomes.extend(dkms_outcome.clone());
    outcomes.extend(report::outcomes(&report::RunArtifacts {
        label,
        planned: &planned,
        ktap: &ktap,
        console: &console,
        machine_problem,
    }));
    let fgds_planned = suite.iter().any(|e| e.name.starts_with("fgds_"));
    outcomes.extend(expected::mode_outcome(
        run_config,
        label,
        &ktap,
        fgds_planned,
    ));
    let expected_skips = expected::apply(run_config, label, covered, &mut outcomes);
    // The GPU's memory is RAM of the host: give it back once the verdicts are in.
    drop(memory);
    let program_secs = run
        .results
        .iter()
        .scan(Duration::ZERO, |last, (name, at)| {
            let took = at.saturating_sub(*last);
            *last = *at;
            Some((name.clone(), took.as_secs_f64()))
        })
        .collect::<Vec<_>>();
    let timings = program_secs
        .iter()
        .map(|(name, secs)| format!("{secs:6.1} {name}\n"))
        .collect::<String>();
    let timings_path = run_dir.join("programs.txt");
    std::fs::write(&timings_path, timings)
        .with_context(|| format!("cannot write {}", timings_path.display()))?;
    Ok(KernelRun {
        spec: opts.kernel.clone(),
        release: kernel.release.clone(),
        package_version: kernel.package_version.clone(),
        reports,
        config: run_config.describe(),
        expected_skips,
        has_p2pdma: run_config.configs.contains("CONFIG_PCI_P2PDMA"),
        took: started.elapsed(),
        booted_in: run.boot,
        outcomes,
        run_dir: run_dir.clone(),
        program_secs,
        phases: phases.summary(),
    })
}

/// Claims `vm/<label>` for this run, or `vm/<label>-2`, `-3`... while other runs of the same
/// kernel hold those (a lock file each, released when the returned file is dropped).
fn claim_run_dir(vm: &Path, label: &str) -> anyhow::Result<(PathBuf, File)> {
    std::fs::create_dir_all(vm).with_context(|| format!("cannot create {}", vm.display()))?;
    for n in 1..=16 {
        let name = if n == 1 {
            label.to_owned()
        } else {
            format!("{label}-{n}")
        };
        let lock = File::create(vm.join(format!("{name}.lock")))?;
        if rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_ok() {
            let dir = vm.join(name);
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            return Ok((dir, lock));
        }
    }
    bail!(
        "16 runs of {label} are under way in {}: wait for one to end",
        vm.display()
    )
}

/// The drive's fault areas (`fgds_pattern::fault`) as blkdebug rules, EIO each.
fn nvme_errors() -> Vec<machine::InjectError> {
    use pattern::fault;
    let sector = |byte: u64| byte / 512;
    [
        (false, fault::READ_ALWAYS, false),
        (false, fault::READ_ONCE, true),
        (true, fault::WRITE_ALWAYS, false),
        (true, fault::WRITE_ONCE, true),
    ]
    .into_iter()
    .map(|(write, byte, once)| machine::InjectError {
        write,
        sector: sector(byte),
        once,
        errno: 5,
    })
    .collect()
}

fn module_params(name: &str, opts: &Options, vgpu_mode: expected::VgpuMode) -> String {
    match name {
        // Published P2PDMA memory gives `fgds bench` its upstream `p2pmem` mode to compare.
        "vgpu" if vgpu_mode == expected::VgpuMode::P2pdma => "mode=p2pdma publish=1".to_owned(),
        "vgpu" if vgpu_mode == expected::VgpuMode::Provider => "mode=provider".to_owned(),
        "vgpu" => "mode=plain".to_owned(),
        "fgds" => format!("devices=@ivshmem@ pages={}", opts.fgds_pages),
        _ => String::new(),
    }
}

fn display_version(v: &str) -> &str {
    if v.is_empty() {
        "none: a local tree"
    } else {
        v
    }
}

/// Boots the machine and waits for it, echoing top-level results as they arrive. Returns how it
/// ended with its run time, and the boot time (until the setup result arrived).
/// How a machine's run went.
struct MachineRun {
    exit: machine::Exit,
    took: Duration,
    /// Until the first result (setup) arrived.
    boot: Option<Duration>,
    /// Each top-level result's name, and when it arrived.
    results: Vec<(String, Duration)>,
    panicked: bool,
}

/// What the guest's init prints when the machine's power-off is stuck (vm-images/init).
const POWER_OFF_STUCK: &str = "fgds-init: the power-off did not finish";

fn run_machine(
    config: &machine::Config,
    limit: Duration,
    echo: bool,
) -> anyhow::Result<MachineRun> {
    let mut vm = machine::start(config)?;
    let started = Instant::now();
    let files = machine::run_files(&config.run_dir);
    let mut shown = 0;
    let mut boot = None;
    let mut results = Vec::new();
    let mut show_new_results = || {
        let text = machine::read_log(&files.ktap);
        let lines = text
            .lines()
            .filter(|l| l.starts_with("ok ") || l.starts_with("not ok "))
            .collect::<Vec<_>>();
        for line in &lines[shown.min(lines.len())..] {
            if boot.is_none() {
                boot = Some(started.elapsed());
            }
            let name = line
                .trim_start_matches("not ")
                .split_whitespace()
                .nth(2)
                .unwrap_or("?")
                .to_owned();
            results.push((name, started.elapsed()));
            if echo {
                say!("  [{:6.1}s] {line}", started.elapsed().as_secs_f64());
            }
        }
        shown = lines.len();
    };
    let exit = vm.wait(limit, &mut show_new_results)?;
    show_new_results();
    Ok(MachineRun {
        exit,
        took: vm.elapsed(),
        boot,
        results,
        panicked: vm.guest_panicked(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, typical_secs: u64, python: bool) -> guest::SuiteEntry {
        guest::SuiteEntry {
            name: name.to_owned(),
            path: PathBuf::from(name),
            timeout_secs: 60,
            c_source: None,
            python,
            fio: false,
            fs: false,
            field: false,
            typical_secs,
        }
    }

    #[test]
    fn share_out_balances_and_keeps_the_suites_order() {
        let suite = [
            entry("a", 3, false),
            entry("revoke", 26, false),
            entry("io", 7, false),
            entry("py", 3, true),
            entry("fio", 9, false),
            entry("last", 1, false),
        ];
        let parts = share_out(&suite, 2);
        assert_eq!(parts.len(), 2);
        // Every program once, each share in the suite's order.
        let mut all = parts.concat();
        all.sort();
        assert_eq!(all, ["a", "fio", "io", "last", "py", "revoke"]);
        for part in &parts {
            let at = |n: &String| suite.iter().position(|e| e.name == *n);
            assert!(part.windows(2).all(|w| at(&w[0]) < at(&w[1])), "{part:?}");
        }
        // The Python program on the last machine, which carries the wheel's build (15 s): the
        // first takes the dearest program and more besides (without the wheel counted, it
        // would have `revoke` alone).
        assert_eq!(parts[0], ["revoke", "io"]);
        assert_eq!(parts[1], ["a", "py", "fio", "last"]);
    }
}
