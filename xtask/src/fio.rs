//! fio in the rig: Debian's fio, the project's `fgds` ioengine (fio/fgds.c) built against the
//! headers of that same fio release, both staged for the guest, and `cargo xtask fio`, which
//! runs a grid of fio jobs in the guest (tests/src/bin/fgds_fio.rs), the `fgds` engine into
//! GPU memory against fio's own `io_uring` engine into RAM, and writes the table.
//!
//! An external engine sees fio's internal structures, and Debian ships no fio headers: the
//! engine is compiled against the upstream tarball of the release Debian's fio is built from
//! (fetched from Debian's archive, checked against the checksum Debian's signed `.dsc`
//! gives), and the host's fio must be that release.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::{host, vm};

/// The fio release of Debian 12 (bookworm), whose source the engine is built against.
const FIO_RELEASE: &str = "3.33";
const FIO_TARBALL: &str = "http://deb.debian.org/debian/pool/main/f/fio/fio_3.33.orig.tar.gz";
/// The tarball's SHA-256, as fio_3.33-3.dsc (signed by Debian) lists it.
const FIO_TARBALL_SHA256: &str = "d2410e13e0f379d061d077cc5ae325835bb7c6186aa7bafc1df954cbc9b014fc";
/// Where the engine is in the guest.
pub const GUEST_ENGINE: &str = "usr/lib/fgds/fio-fgds.so";
/// The guest program of the grid, and how long it may run.
const PROGRAM: &str = "fgds_fio";
const TIMEOUT_SECS: u64 = 1800;
/// docs/performance.md's fio section lies between these lines.
const DOC_BEGIN: &str = "<!-- cargo xtask fio: begin -->";
const DOC_END: &str = "<!-- cargo xtask fio: end -->";

#[derive(clap::Args)]
pub struct Options {
    /// The kernel to measure.
    #[arg(long, default_value = "debian:7.3")]
    pub kernel: String,
    /// Seconds each job runs.
    #[arg(long, default_value_t = 2)]
    pub runtime: u64,
    /// Leave docs/performance.md alone (the table is still printed and kept in target/fio/).
    #[arg(long)]
    pub no_doc: bool,
    /// Run this job file in the guest instead of the grid, with FGDS_ENGINE, FGDS_FILE (the
    /// raw namespace), FGDS_OFFSET (its scratch area) and FGDS_DMABUF (vgpu) set for `${...}`
    /// in it (fio/fgds-verify.fio is one); fio's output is printed.
    #[arg(long, value_name = "FILE")]
    pub job: Option<PathBuf>,
}

/// What building the engine needs on the host: fio, to match its structures, a compiler, and
/// curl for fio's source.
const HOST_PACKAGES: &[&str] = &["fio", "gcc", "curl"];

/// Builds the engine for the host's fio; returns the shared object.
pub fn build_engine() -> anyhow::Result<PathBuf> {
    host::ensure_packages(HOST_PACKAGES)?;
    let version = Command::new("fio")
        .arg("--version")
        .output()
        .context("cannot run fio")?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_owned();
    if version != format!("fio-{FIO_RELEASE}") {
        bail!(
            "the fgds engine is built against fio {FIO_RELEASE} (Debian 12's), and this host's \
             fio is {version:?}: an external engine must match its fio's structures; install \
             bookworm's fio or change FIO_RELEASE and its tarball in xtask/src/fio.rs"
        );
    }
    let src = fio_source()?;
    let root = crate::project_root();
    let out_dir = root.join("target/fio");
    std::fs::create_dir_all(&out_dir)?;
    let out = out_dir.join("fio-fgds.so");
    let source = root.join("fio/fgds.c");
    let fresh = |o: &Path| -> anyhow::Result<bool> {
        let built = std::fs::metadata(o)?.modified()?;
        Ok([&source, &root.join("driver/include/uapi/linux/fgds.h")]
            .iter()
            .all(|s| {
                std::fs::metadata(s)
                    .and_then(|m| m.modified())
                    .is_ok_and(|m| m <= built)
            }))
    };
    if fresh(&out).unwrap_or(false) {
        return Ok(out);
    }
    // fio's own headers are not -Wextra clean: they are system headers here.
    let res = Command::new("gcc")
        .args([
            "-O2",
            "-g",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-D_GNU_SOURCE",
            "-include",
        ])
        .arg(src.join("config-host.h"))
        .arg("-isystem")
        .arg(&src)
        .arg("-I")
        .arg(root.join("driver/include/uapi"))
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&source)
        .output()
        .context("cannot run gcc")?;
    if !res.status.success() {
        bail!(
            "fio/fgds.c does not build:\n{}",
            String::from_utf8_lossy(&res.stderr)
        );
    }
    Ok(out)
}

/// Fetches what the fgds engine's build needs (the host's fio, fio's source), ahead of it.
pub fn fetch() -> anyhow::Result<()> {
    host::ensure_packages(HOST_PACKAGES)?;
    fio_source().map(drop)
}

/// fio's source tree for [`FIO_RELEASE`], fetched, checked and configured once in the cache.
fn fio_source() -> anyhow::Result<PathBuf> {
    let dir = host::cache_dir()?.join(format!("fio-{FIO_RELEASE}"));
    let src = dir.join(format!("fio-{FIO_RELEASE}"));
    if dir.join("configured").exists() {
        return Ok(src);
    }
    std::fs::create_dir_all(&dir)?;
    let tarball = dir.join("fio.orig.tar.gz");
    eprintln!("  fetching fio {FIO_RELEASE}'s source (its headers, for the fgds engine)");
    let status = Command::new("curl")
        .args(["-fsSL", "--retry", "3", "-o"])
        .arg(&tarball)
        .arg(FIO_TARBALL)
        .status()
        .context("cannot run curl")?;
    if !status.success() {
        bail!("cannot fetch {FIO_TARBALL}: is Debian's archive reachable?");
    }
    let sum = Command::new("sha256sum").arg(&tarball).output()?;
    let sum = String::from_utf8_lossy(&sum.stdout);
    if sum.split_whitespace().next() != Some(FIO_TARBALL_SHA256) {
        bail!("{FIO_TARBALL}: SHA-256 {sum} is not the one Debian's fio_3.33-3.dsc lists");
    }
    if src.exists() {
        std::fs::remove_dir_all(&src)?;
    }
    let status = Command::new("tar")
        .arg("xzf")
        .arg(&tarball)
        .current_dir(&dir)
        .status()?;
    if !status.success() {
        bail!("cannot unpack {}", tarball.display());
    }
    // config-host.h only: the engine needs fio's configuration, not fio.
    let res = Command::new("./configure")
        .arg("--disable-native")
        .current_dir(&src)
        .output()
        .context("cannot run fio's configure")?;
    if !res.status.success() {
        bail!(
            "fio's configure failed:\n{}",
            String::from_utf8_lossy(&res.stdout)
        );
    }
    std::fs::write(dir.join("configured"), "")?;
    Ok(src)
}

/// Where the job files of fio/ are in the guest, and `cargo xtask fio --job`'s as `job.fio`.
pub const GUEST_JOBS: &str = "usr/share/fgds/fio";

/// Stages the guest's fio (the host's binary and the shared libraries it loads), the engine and
/// the job files of fio/ (and `job`, as `job.fio`); returns the staged root.
pub fn stage_guest(job: Option<&Path>) -> anyhow::Result<PathBuf> {
    let engine = build_engine()?;
    let root = crate::project_root().join("target/fio/guest");
    if root.exists() {
        std::fs::remove_dir_all(&root)?;
    }
    let fio = PathBuf::from("/usr/bin/fio");
    let mut files = vec![fio.clone()];
    for binary in [&fio, &engine] {
        let out = Command::new("ldd").arg(binary).output()?;
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let words = line.split_whitespace().collect::<Vec<_>>();
            let lib = match words.as_slice() {
                [_, "=>", path, ..] if path.starts_with('/') => path,
                [path, ..] if path.starts_with('/') => path,
                _ => continue,
            };
            files.push(PathBuf::from(lib));
        }
    }
    files.sort();
    files.dedup();
    for file in files {
        let dest = root.join(file.strip_prefix("/")?);
        std::fs::create_dir_all(dest.parent().expect("a staged file has a directory"))?;
        std::fs::copy(std::fs::canonicalize(&file)?, &dest)
            .with_context(|| format!("cannot stage {}", file.display()))?;
    }
    let dest = root.join(GUEST_ENGINE);
    std::fs::create_dir_all(dest.parent().expect("the engine's directory"))?;
    std::fs::copy(&engine, &dest)?;
    let jobs = root.join(GUEST_JOBS);
    std::fs::create_dir_all(&jobs)?;
    for entry in std::fs::read_dir(crate::project_root().join("fio"))?.flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "fio") {
            std::fs::copy(&path, jobs.join(entry.file_name()))?;
        }
    }
    if let Some(job) = job {
        std::fs::copy(job, jobs.join("job.fio"))
            .with_context(|| format!("cannot read the job file {}", job.display()))?;
    }
    Ok(root)
}

/// `cargo xtask fio`: the grid in the guest, its table printed, kept in `target/fio/` and
/// written into docs/performance.md.
pub fn fio(opts: &Options) -> anyhow::Result<ExitCode> {
    if let Some(job) = &opts.job {
        return run_job(opts, job);
    }
    let boot = || {
        vm::run_kernel(&vm::Options {
            append: format!("fgds.fio=bench fgds.fio_runtime={}", opts.runtime),
            programs: vec![(PROGRAM.to_owned(), TIMEOUT_SECS)],
            // Both vCPUs at once and no limit from the emulated controller, as for the bench
            // (xtask/src/bench.rs): no engine's requests are split where another's are not.
            tcg_threads: vm::TcgThreadsArg::Multi,
            nvme_mdts: Some(0),
            ..vm::Options::for_kernel(&opts.kernel)
        })
    };
    let mut run = boot()?;
    // Multi-threaded TCG's rare early-boot oops (docs/architecture.md, Boot flakes) costs one
    // more boot, not the measurement.
    let booted = |run: &vm::KernelRun| {
        run.outcomes.iter().any(|o| {
            o.name.ends_with("::setup") && matches!(o.verdict, crate::report::Verdict::Pass)
        })
    };
    if !booted(&run) {
        eprintln!(
            "fio: the guest did not come up (console: {}); booting once more",
            run.run_dir.join("console.log").display()
        );
        run = boot()?;
    }
    let ktap = std::fs::read(run.run_dir.join("ktap.log"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .context("the run left no KTAP log")?;
    let rows = ktap
        .lines()
        .filter_map(|l| l.split("fgds-fio: ").nth(1))
        .map(serde_json::from_str::<Value>)
        .collect::<Result<Vec<_>, _>>()
        .context("a bad fgds-fio line")?;
    let passed = crate::report::print(run.outcomes.clone());
    if rows.is_empty() {
        bail!(
            "the guest measured nothing (see {})",
            run.run_dir.join("console.log").display()
        );
    }
    let out_dir = crate::project_root().join("target/fio");
    std::fs::create_dir_all(&out_dir)?;
    let label = run.spec.replace([':', '+'], "-");
    std::fs::write(
        out_dir.join(format!("{label}.json")),
        serde_json::to_string_pretty(&rows)?,
    )?;
    let table = markdown(&rows, &run.spec, &run.release, opts.runtime);
    std::fs::write(out_dir.join(format!("{label}.md")), &table)?;
    println!("{table}");
    if !opts.no_doc && passed {
        write_doc(&table)?;
        println!("written to docs/performance.md (between {DOC_BEGIN:?} and {DOC_END:?})");
    }
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `cargo xtask fio --job FILE`: the job file in the guest (single-threaded TCG, the suite's
/// machine), fio's output printed, its exit status the verdict.
fn run_job(opts: &Options, job: &Path) -> anyhow::Result<ExitCode> {
    if !job.is_file() {
        bail!("--job {}: no such file", job.display());
    }
    let run = vm::run_kernel(&vm::Options {
        append: "fgds.fio=job".to_owned(),
        programs: vec![(PROGRAM.to_owned(), TIMEOUT_SECS)],
        fio_job: Some(job.to_path_buf()),
        ..vm::Options::for_kernel(&opts.kernel)
    })?;
    let ktap = std::fs::read(run.run_dir.join("ktap.log"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .context("the run left no KTAP log")?;
    for line in ktap.lines().filter_map(|l| l.split("fio| ").nth(1)) {
        println!("{line}");
    }
    Ok(if crate::report::print(run.outcomes) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The grid as a Markdown table: per workload, block size and depth, each engine's GiB/s and
/// mean latency, the drive's requests per I/O, and `fgds` as a ratio of each `io_uring` row.
fn markdown(rows: &[Value], spec: &str, release: &str, runtime: u64) -> String {
    let mut points: BTreeMap<(String, u64, u64), BTreeMap<String, &Value>> = BTreeMap::new();
    for row in rows {
        let key = (
            row["rw"].as_str().unwrap_or_default().to_owned(),
            row["bs"].as_u64().unwrap_or_default(),
            row["iodepth"].as_u64().unwrap_or_default(),
        );
        let engine = row["engine"].as_str().unwrap_or_default().to_owned();
        points.entry(key).or_default().insert(engine, row);
    }
    let mut out = format!(
        "fio 3.33 (Debian's), {spec} (`{release}`), {runtime} s per job. `fgds`: the fgds \
         engine into GPU memory (vgpu); `io_uring`: fio's own engine into RAM as fio allocates \
         it (4 KiB pages, pinned per request); `io_uring-huge`: the same into 2 MiB huge pages \
         (`iomem=shmhuge`) registered once (`fixedbufs=1`). GiB/s (mean latency in us, the \
         drive's requests per I/O).\n\n\
         | rw | bs | depth | fgds | io_uring | io_uring-huge | fgds / io_uring | fgds / io_uring-huge |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for ((rw, bs, depth), engines) in &points {
        let cell = |e: &str| {
            engines.get(e).map_or("-".to_owned(), |r| {
                format!(
                    "{:.3} ({:.0}, {:.1})",
                    r["gib_s"].as_f64().unwrap_or_default(),
                    r["lat_us"].as_f64().unwrap_or_default(),
                    r["requests_per_io"].as_f64().unwrap_or_default()
                )
            })
        };
        let ratio = |base: &str| {
            let rate = |e: &str| engines.get(e).and_then(|r| r["gib_s"].as_f64());
            match (rate("fgds"), rate(base)) {
                (Some(f), Some(b)) if b > 0.0 => format!("{:.2}", f / b),
                _ => "-".to_owned(),
            }
        };
        out.push_str(&format!(
            "| {rw} | {} | {depth} | {} | {} | {} | {} | {} |\n",
            crate::bench::human(*bs),
            cell("fgds"),
            cell("io_uring"),
            cell("io_uring-huge"),
            ratio("io_uring"),
            ratio("io_uring-huge")
        ));
    }
    out
}

/// Replaces docs/performance.md's fio section with `table`.
fn write_doc(table: &str) -> anyhow::Result<()> {
    let path = crate::project_root().join("docs/performance.md");
    let text = std::fs::read_to_string(&path)?;
    let (Some(begin), Some(end)) = (text.find(DOC_BEGIN), text.find(DOC_END)) else {
        bail!(
            "{} has no {DOC_BEGIN:?} ... {DOC_END:?} section",
            path.display()
        );
    };
    let new = format!("{}{DOC_BEGIN}\n{table}{}", &text[..begin], &text[end..]);
    std::fs::write(&path, new)?;
    Ok(())
}
