//! `cargo xtask bench`: boots the rig with a 1 GiB GPU, runs the benchmark grid in the guest
//! (tests/src/bin/bench_suite.rs over `fgds bench`), and writes what it measured:
//! `target/bench/<kernel>.json`, a table of each mode's throughput as a ratio of `ram`, and
//! throughput-against-block-size plots (PNG and SVG), one line per mode.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::{guest, host, vm};

/// The guest program, and how long it may run.
const PROGRAM: &str = "bench_suite";
const FULL_TIMEOUT_SECS: u64 = 3 * 3600;
const QUICK_TIMEOUT_SECS: u64 = 1800;
/// 1 GiB of GPU memory, for the registration-cost measurement.
const GPU_BYTES: u64 = 1 << 30;
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

#[derive(clap::Args)]
pub struct Options {
    /// The kernel to measure.
    #[arg(long, default_value = "debian:6.12")]
    pub kernel: String,
    /// A small grid (three block sizes, queue depths 1 and 32, two repetitions).
    #[arg(long)]
    pub quick: bool,
    /// Profile instead of measuring: sample the guest's CPU while `ram` and `direct` read 1 GiB
    /// (1 MiB qd 1, 4 MiB qd 1, 4 and 16 MiB qd 32, 64 KiB qd 32), then small blocks at depth 1
    /// (4 KiB reads, 64 KiB reads and writes, less data), and write where each spends it to
    /// `target/bench/profile-<kernel>.txt`.
    #[arg(long, conflicts_with = "quick")]
    pub profile: bool,
    /// The vgpu exporter's mode (as for test-vm), or `auto`: `plain` (fgds's own pages, as with
    /// a real GPU), then where the kernel has CONFIG_PCI_P2PDMA a second boot with `p2pdma`,
    /// running `ram`, `direct` and upstream's `p2pmem` on vgpu's own published P2PDMA pages.
    #[arg(long, default_value = "auto", value_parser = ["plain", "p2pdma", "auto"])]
    pub vgpu_mode: String,
    /// fgds's `pages=` parameter (as for test-vm).
    #[arg(long, default_value = "auto", value_parser = vm::FGDS_PAGES)]
    pub fgds_pages: String,
    /// A translating vIOMMU (intel-iommu, strict: every unmap flushed), as for test-vm; the
    /// results go to `target/bench/<kernel>+iommu.*`.
    #[arg(long)]
    pub iommu: bool,
    /// io_uring fixed buffers for every mode where the kernel takes them (auto), or for none
    /// (off: every request pins its pages, the crate's default path).
    #[arg(long, default_value = "auto", value_parser = ["auto", "off"])]
    pub fixed_buffers: String,
    /// Extra guest kernel parameters, for experiments on the guest itself (for example
    /// `idle=poll`); the results go beside the defaults', to `target/bench/<kernel>+ARGS.*`.
    #[arg(long, default_value = "")]
    pub append: String,
    /// Boot nothing: print again what the JSON of an earlier run says (table, targets, the
    /// explanation of each high ratio, the checks), failing as that run would now.
    #[arg(long, value_name = "JSON")]
    pub from_json: Option<std::path::PathBuf>,
    /// What the file system costs instead of the grid: `ram` and `direct` on a file of ext4,
    /// xfs and btrfs and on the raw namespace (`target/bench/<kernel>-files.md`).
    #[arg(long, conflicts_with_all = ["quick", "profile"])]
    pub files: bool,
    /// NVMe drives behind the GPU's switch (as for test-vm; each of the second's 128 MiB).
    #[arg(long, default_value_t = vm::DEFAULT_DRIVES, value_parser = clap::value_parser!(u8).range(1..=fgds_qemu::machine::MAX_DRIVES as i64))]
    pub drives: u8,
    /// Several drives instead of the grid: md RAID0 over the first 1, 2, 4 (and 8) of the
    /// `--drives`, `ram` against `direct-mapped` (the registration's mapped address: fgds's own
    /// commands refuse md) at 1 and 4 MiB, depth 32, aggregate and per drive
    /// (`target/bench/<kernel>-raid0.md`).
    /// With `--from-json`, the JSON is such a run's (`<kernel>-raid0.json`).
    #[arg(long, conflicts_with_all = ["quick", "profile", "files"])]
    pub raid0: bool,
}

pub fn bench(opts: &Options) -> anyhow::Result<ExitCode> {
    host::ensure_packages(&["fonts-dejavu-core"])?;
    if let Some(path) = &opts.from_json {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let all: Vec<Value> = serde_json::from_str(&text)?;
        if opts.raid0 {
            let first = all.first().context("the JSON has no rows")?;
            let text = |key: &str| first[key].as_str().unwrap_or("?").to_owned();
            println!(
                "{}",
                raid0_table(&all, &text("kernel"), &text("release"), opts.drives)
            );
            let refused = raid0_refusals(&all);
            for (reason, at) in &refused {
                eprintln!("bench: direct-mapped refused on {at}: {reason}");
            }
            return Ok(if refused.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
        let (registration, rows): (Vec<Value>, Vec<Value>) =
            all.into_iter().partition(|r| r["kind"] == "registration");
        let label = path
            .file_stem()
            .map_or("again".into(), |s| s.to_string_lossy().into_owned())
            + "-again";
        let out_dir = crate::project_root().join("target/bench");
        let failed = report(&rows, registration.first(), &out_dir, &label)?;
        return Ok(if failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        });
    }
    if opts.files {
        return files(opts);
    }
    if opts.raid0 {
        return raid0(opts);
    }
    // `auto`: the headline runs with vgpu's memory as plain VRAM (fgds's own pages, as with a
    // real GPU); upstream's p2pmem needs P2PDMA pages the exporter publishes, so it gets a
    // second boot where vgpu has them and fgds takes vgpu's pages: both on the same pages.
    let auto = opts.vgpu_mode == "auto";
    let run = boot(opts, if auto { "plain" } else { &opts.vgpu_mode }, "main")?;
    let (mut rows, registration, profiles) = collect(&run)?;
    let mut failed = run
        .outcomes
        .iter()
        .any(|o| matches!(o.verdict, crate::report::Verdict::Fail(_)));
    let mut outcomes = run.outcomes;
    let out_dir = crate::project_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let mut label = run.spec.replace(':', "-");
    if opts.iommu {
        label += "+iommu";
    }
    // An experiment's results go beside the defaults', not over them.
    if !opts.append.trim().is_empty() {
        label += &format!(
            "+{}",
            opts.append.split_whitespace().collect::<Vec<_>>().join("+")
        )
        .replace(['/', ':'], "_");
    }
    if opts.profile {
        if profiles.is_empty() {
            crate::report::print(outcomes);
            bail!("the guest profiled nothing (see {})", run.run_dir.display());
        }
        write_profiles(&profiles, &out_dir, &label)?;
        return Ok(exit_code(outcomes, failed));
    }
    if rows.is_empty() {
        crate::report::print(outcomes);
        bail!("the guest measured nothing (see {})", run.run_dir.display());
    }
    if auto && run.has_p2pdma {
        eprintln!(
            "bench: second boot: vgpu with P2PDMA pages of its own, published, so that upstream's \
             p2pmem runs beside fgds on the same pages"
        );
        let second = boot(opts, "p2pdma", P2PMEM_SET)?;
        failed |= second
            .outcomes
            .iter()
            .any(|o| matches!(o.verdict, crate::report::Verdict::Fail(_)));
        let (more, _, _) = collect(&second)?;
        if more.is_empty() {
            crate::report::print(second.outcomes);
            bail!(
                "the p2pmem boot measured nothing (see {})",
                second.run_dir.display()
            );
        }
        rows.extend(more.into_iter().map(|mut row| {
            row["set"] = Value::from(P2PMEM_SET);
            row
        }));
        outcomes.extend(second.outcomes);
    } else if auto {
        println!(
            "p2pmem: {} has no CONFIG_PCI_P2PDMA: not measured",
            run.spec
        );
    }
    let mut all = rows.clone();
    all.extend(registration.clone());
    std::fs::write(
        out_dir.join(format!("{label}.json")),
        serde_json::to_string_pretty(&all)?,
    )?;
    std::fs::write(
        out_dir.join(format!("{label}.md")),
        markdown(&rows, registration.as_ref()),
    )?;
    failed |= report(&rows, registration.as_ref(), &out_dir, &label)?;
    Ok(exit_code(outcomes, failed))
}

/// Prints what a run measured (its table, targets, the explanation of every high ratio, the
/// host's backing, the registration figures), writes the plots, and says whether a check
/// failed.
fn report(
    rows: &[Value],
    registration: Option<&Value>,
    out_dir: &Path,
    label: &str,
) -> anyhow::Result<bool> {
    let mut failed = false;
    let rows = rows.to_vec();
    print_table(&rows);
    print_fixed_buffers(&rows);
    print_baselines(&rows);
    print_targets(&rows);
    let (explained, unexplained) = explain_high_ratios(&rows);
    if !explained.is_empty() {
        println!("direct/ram above {HIGH_RATIO}, each with the measured row that explains it:");
        for line in &explained {
            println!("  {line}");
        }
    }
    if unexplained > 0 {
        eprintln!(
            "bench: {unexplained} direct/ram ratio(s) above {HIGH_RATIO} that no measured row \
             explains (neither ram split more nor ram against itself as far off): a faster direct needs a \
             reason; see target/bench/{label}.json"
        );
        failed = true;
    }
    // Every mode's I/O reached the drive: as many requests completed there as it made, or
    // more where they were split. A mode that reports bytes it never moved fails the bench.
    let unseen = rows
        .iter()
        .filter(|r| r["requests_per_io"].as_f64().is_some_and(|q| q < 0.99))
        .map(|r| {
            format!(
                "{} {} {} qd{}: {:.2} requests per I/O",
                r["mode"].as_str().unwrap_or("?"),
                r["op"].as_str().unwrap_or("?"),
                human(r["block_size"].as_u64().unwrap_or(0)),
                r["queue_depth"],
                r["requests_per_io"].as_f64().unwrap_or(0.0)
            )
        })
        .collect::<Vec<_>>();
    if !unseen.is_empty() {
        eprintln!(
            "bench: the drive completed fewer requests than these modes made, so their bytes \
             did not all move: {}",
            unseen.join("; ")
        );
        failed = true;
    }
    let backing = backing_problems(&rows);
    for problem in backing.iter().take(5) {
        eprintln!(
            "bench: host backing differs from docs/performance.md's configuration: {problem}"
        );
    }
    if !backing.is_empty() {
        eprintln!(
            "bench: {} row(s) ran on host pages other than the documented ones: their figures \
             cannot be compared with the published ones",
            backing.len()
        );
        failed = true;
    }
    if let Some(reg) = registration {
        println!("{}", registration_line(reg));
    }
    let plots = plot(&rows, out_dir, label)?;
    println!(
        "wrote {label}.json, {label}.md (the docs' table) and {plots} plots in {}",
        out_dir.display()
    );
    Ok(failed)
}

/// The name of the second boot's rows (`set` in the JSON): ram, direct and p2pmem with vgpu's
/// own P2PDMA pages.
const P2PMEM_SET: &str = "p2pmem";

/// One boot of the rig running the benchmark: `set` is `main` (the grid, the registration
/// cost or the profile) or [`P2PMEM_SET`].
fn boot(opts: &Options, vgpu_mode: &str, set: &str) -> anyhow::Result<vm::KernelRun> {
    let timeout = if opts.quick {
        QUICK_TIMEOUT_SECS
    } else {
        FULL_TIMEOUT_SECS
    };
    vm::run_kernel(&vm::Options {
        vgpu_mode: vgpu_mode.to_owned(),
        fgds_pages: opts.fgds_pages.clone(),
        append: format!(
            "fgds.bench={} fgds.bench_set={set} fgds.fixed_buffers={} {}",
            if opts.quick {
                "quick"
            } else if opts.profile {
                "profile"
            } else if opts.files {
                "files"
            } else if opts.raid0 {
                "raid0"
            } else {
                "full"
            },
            opts.fixed_buffers,
            opts.append
        ),
        gpu_bytes: GPU_BYTES,
        programs: vec![(PROGRAM.to_owned(), timeout)],
        // The figures need both vCPUs running at once, as on hardware (docs/performance.md
        // was measured so); the rare early-boot oops of multi-threaded TCG costs a rerun here,
        // not a verdict (docs/architecture.md, Boot flakes).
        tcg_threads: vm::TcgThreadsArg::Multi,
        // No limit from the emulated controller: the guest's driver then builds requests up
        // to its own limit (4-8 MiB), and the grid raises `max_sectors_kb` to it, so that no
        // mode's request of 4 MiB or less is split where another's is not (docs/performance.md).
        nvme_mdts: Some(0),
        iommu: opts.iommu,
        filesystems: opts.files,
        drives: opts.drives,
        build: guest::Build::Release,
        ..vm::Options::for_kernel(&opts.kernel)
    })
}

/// `cargo xtask bench --files`: one boot, the files set's rows, a table per operation.
fn files(opts: &Options) -> anyhow::Result<ExitCode> {
    let run = boot(opts, &opts.vgpu_mode.replace("auto", "plain"), "files")?;
    let (rows, _, _) = collect(&run)?;
    let passed = crate::report::print(run.outcomes.clone());
    if rows.is_empty() {
        bail!("the guest measured nothing (see {})", run.run_dir.display());
    }
    let mut table = format!(
        "`cargo xtask bench --files --kernel {}` (`{}`): a 32 MiB file of each file system (the raw \
         namespace beside them), `ram` and `direct` in the same turns, 3 repetitions.\n\n\
         | fs | point | ram MiB/s | direct MiB/s | direct/ram |\n|---|---|---:|---:|---:|\n",
        run.spec, run.release
    );
    let mut points: BTreeMap<(String, String, u64, u64), BTreeMap<String, &Value>> =
        BTreeMap::new();
    for row in &rows {
        let key = (
            row["fs"].as_str().unwrap_or_default().to_owned(),
            row["op"].as_str().unwrap_or_default().to_owned(),
            row["block_size"].as_u64().unwrap_or_default(),
            row["queue_depth"].as_u64().unwrap_or_default(),
        );
        let mode = row["mode"].as_str().unwrap_or_default().to_owned();
        points.entry(key).or_default().insert(mode, row);
    }
    for ((fs, op, bs, qd), modes) in &points {
        let rate = |m: &str| modes.get(m).and_then(|r| r["mib_s"].as_f64());
        let direct = match (modes.get("direct"), rate("direct")) {
            (_, Some(d)) => format!("{d:.0}"),
            (Some(r), None) => format!("refused: {}", r["refused"].as_str().unwrap_or("?")),
            _ => "-".to_owned(),
        };
        table.push_str(&format!(
            "| {fs} | {op} {} qd{qd} | {} | {direct} | {} |\n",
            human(*bs),
            rate("ram").map_or("-".to_owned(), |r| format!("{r:.0}")),
            fmt_ratio(modes.get("direct").and_then(|r| r["ratio_to_ram"].as_f64())),
        ));
    }
    println!("{table}");
    let out_dir = crate::project_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let label = run.spec.replace(':', "-");
    std::fs::write(out_dir.join(format!("{label}-files.md")), &table)?;
    std::fs::write(
        out_dir.join(format!("{label}-files.json")),
        serde_json::to_string_pretty(&rows)?,
    )?;
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `cargo xtask bench --drives N --raid0`: one boot, md RAID0 over 1, 2, 4 (and 8) drives,
/// `ram` against `direct-mapped`, a table (`target/bench/<kernel>-raid0.md` and `.json`). Fails
/// where `direct-mapped` was refused (the reason is printed), where a mode's requests did not
/// all reach the drives, or where the host's pages are not the documented ones.
fn raid0(opts: &Options) -> anyhow::Result<ExitCode> {
    let run = boot(opts, &opts.vgpu_mode.replace("auto", "plain"), "raid0")?;
    let (rows, _, _) = collect(&run)?;
    let mut passed = crate::report::print(run.outcomes.clone());
    if rows.is_empty() {
        bail!("the guest measured nothing (see {})", run.run_dir.display());
    }
    let table = raid0_table(&rows, &run.spec, &run.release, opts.drives);
    println!("{table}");
    for (reason, at) in raid0_refusals(&rows) {
        eprintln!("bench: direct-mapped refused on {at}: {reason}");
        passed = false;
    }
    let unseen = rows
        .iter()
        .filter(|r| r["requests_per_io"].as_f64().is_some_and(|q| q < 0.99))
        .count();
    if unseen > 0 {
        eprintln!(
            "bench: in {unseen} row(s) the drives completed fewer requests than the mode made, so \
             its bytes did not all move (target/bench/*-raid0.json, requests_per_io)"
        );
        passed = false;
    }
    let backing = backing_problems(&rows);
    for problem in backing.iter().take(5) {
        eprintln!(
            "bench: host backing differs from docs/performance.md's configuration: {problem}"
        );
    }
    passed &= backing.is_empty();
    let out_dir = crate::project_root().join("target/bench");
    std::fs::create_dir_all(&out_dir)?;
    let label = run.spec.replace(':', "-");
    std::fs::write(out_dir.join(format!("{label}-raid0.md")), &table)?;
    std::fs::write(
        out_dir.join(format!("{label}-raid0.json")),
        serde_json::to_string_pretty(&rows)?,
    )?;
    println!("wrote {label}-raid0.md and .json in {}", out_dir.display());
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The several-drives table: per array (the first drive's range alone, then md RAID0 over 1,
/// 2, 4 drives) and block size, `ram` and `direct-mapped` in MiB/s (aggregate, and per drive),
/// their ratio in the same turns, `ram-again`'s (the noise), the requests the drives completed
/// per I/O, the guest's CPU per GiB, and the ratio again where neither mode had a fixed buffer.
fn raid0_table(rows: &[Value], spec: &str, release: &str, drives: u8) -> String {
    type Point<'a> = BTreeMap<(String, String), &'a Value>;
    let mut points: BTreeMap<(bool, u64, u64), Point> = BTreeMap::new();
    for row in rows.iter().filter(|r| r["set"] == "raid0") {
        let key = (
            row["array"] != "raw",
            row["drives"].as_u64().unwrap_or_default(),
            row["block_size"].as_u64().unwrap_or_default(),
        );
        let mode = row["mode"].as_str().unwrap_or_default().to_owned();
        let fixed = row["fixed_buffers_asked"]
            .as_str()
            .unwrap_or("auto")
            .to_owned();
        points.entry(key).or_default().insert((mode, fixed), row);
    }
    let chunk = rows
        .iter()
        .find_map(|r| r["chunk"].as_u64())
        .map_or("?".to_owned(), human);
    let mut table = format!(
        "`cargo xtask bench --drives {drives} --raid0 --kernel {spec}` (`{release}`): md RAID0 \
         (no superblock, {chunk} chunks) over the same 64 MiB of each of the first drives, and \
         that range of the first drive alone (`raw`); reads at depth 32, 5 repetitions of 1 s, \
         the modes taking turns. `direct`: `direct-mapped`, io_uring `READ` into the \
         registration's mapped address (fgds's own commands refuse md), each request pinning \
         its pages; `ram`: `READ_FIXED` into huge pages. MiB/s; ratios paired by turns; \
         requests: what the drives completed per I/O; CPU: the guest's s per GiB; unfixed: \
         direct/ram where neither has a fixed buffer (both pin per request).\n\n\
         | array | drives | size | ram MiB/s | direct MiB/s | direct/ram | ram-again/ram | per drive: ram, direct | requests per I/O | CPU ram, direct | unfixed direct/ram |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for ((md, n, bs), modes) in &points {
        let get = |m: &str, fixed: &str| modes.get(&(m.to_owned(), fixed.to_owned())).copied();
        let rate = |m: &str| get(m, "auto").and_then(|r| r["mib_s"].as_f64());
        let ratio = |m: &str, fixed: &str| {
            fmt_ratio(get(m, fixed).and_then(|r| r["ratio_to_ram"].as_f64()))
        };
        let direct = match (get("direct-mapped", "auto"), rate("direct-mapped")) {
            (_, Some(d)) => format!("{d:.0}"),
            (Some(_), None) => "refused".to_owned(),
            _ => "-".to_owned(),
        };
        let per = |m: &str| rate(m).map_or("-".to_owned(), |r| format!("{:.0}", r / *n as f64));
        let num = |m: &str, key: &str, digits: usize| {
            get(m, "auto")
                .and_then(|r| r[key].as_f64())
                .map_or("-".to_owned(), |v| format!("{v:.digits$}"))
        };
        table.push_str(&format!(
            "| {} | {n} | {} | {} | {direct} | {} | {} | {}, {} | {}, {} | {}, {} | {} |\n",
            if *md { "md raid0" } else { "raw" },
            human(*bs),
            rate("ram").map_or("-".to_owned(), |r| format!("{r:.0}")),
            ratio("direct-mapped", "auto"),
            ratio("ram-again", "auto"),
            per("ram"),
            per("direct-mapped"),
            num("ram", "requests_per_io", 1),
            num("direct-mapped", "requests_per_io", 1),
            num("ram", "cpu_s_per_gib", 2),
            num("direct-mapped", "cpu_s_per_gib", 2),
            ratio("direct-mapped", "off"),
        ));
    }
    // fgds's own commands on the raw drive, where they ran: the same drive's direct path.
    for ((md, _, bs), modes) in &points {
        let key = ("direct".to_owned(), "auto".to_owned());
        if let (false, Some(r)) = (md, modes.get(&key)) {
            table.push_str(&format!(
                "\nraw {}: fgds's own commands (`direct`) {:.0} MiB/s, {} of ram.",
                human(*bs),
                r["mib_s"].as_f64().unwrap_or_default(),
                fmt_ratio(r["ratio_to_ram"].as_f64())
            ));
        }
    }
    for (reason, at) in raid0_refusals(rows) {
        table.push_str(&format!("\n`direct-mapped` refused on {at}: {reason}"));
    }
    table.push('\n');
    table
}

/// Each distinct reason `direct-mapped` was refused for (without the device's name), with
/// where: `md raid0 over 1, 2, 4 drive(s) at 1M, 4M`.
fn raid0_refusals(rows: &[Value]) -> Vec<(String, String)> {
    type Where = BTreeMap<String, (Vec<u64>, Vec<u64>)>;
    let mut reasons: BTreeMap<String, Where> = BTreeMap::new();
    for row in rows.iter().filter(|r| r["set"] == "raid0") {
        let Some(reason) = row["refused"].as_str() else {
            continue;
        };
        let reason = reason
            .split_once("by DMA: ")
            .map_or(reason, |(_, why)| why)
            .to_owned();
        let array = row["array"].as_str().unwrap_or("?").to_owned();
        let (drives, sizes) = reasons.entry(reason).or_default().entry(array).or_default();
        drives.push(row["drives"].as_u64().unwrap_or_default());
        sizes.push(row["block_size"].as_u64().unwrap_or_default());
    }
    reasons
        .into_iter()
        .map(|(reason, arrays)| {
            let at = arrays
                .into_iter()
                .map(|(array, (mut drives, mut sizes))| {
                    drives.sort();
                    drives.dedup();
                    sizes.sort();
                    sizes.dedup();
                    let list = |v: Vec<String>| v.join(", ");
                    format!(
                        "{array} over {} drive(s) at {}",
                        list(drives.iter().map(u64::to_string).collect()),
                        list(sizes.into_iter().map(human).collect())
                    )
                })
                .collect::<Vec<_>>();
            (reason, at.join("; "))
        })
        .collect()
}

/// A boot's `# fgds-bench:` rows: the grid's, the registration cost's and the profiles.
fn collect(run: &vm::KernelRun) -> anyhow::Result<(Vec<Value>, Option<Value>, Vec<Value>)> {
    let ktap = std::fs::read(run.run_dir.join("ktap.log"))
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .context("the run left no KTAP log")?;
    let mut rows = Vec::new();
    let mut registration = None;
    let mut profiles = Vec::new();
    for line in ktap.lines() {
        let Some(json) = line.split("fgds-bench: ").nth(1) else {
            continue;
        };
        let mut row: Value =
            serde_json::from_str(json).with_context(|| format!("bad bench line {json:?}"))?;
        row["kernel"] = Value::from(run.spec.clone());
        row["release"] = Value::from(run.release.clone());
        if row["kind"] == "registration" {
            registration = Some(row);
        } else if row["kind"] == "profile" {
            profiles.push(row);
        } else {
            rows.push(row);
        }
    }
    Ok((rows, registration, profiles))
}

/// Which modes read and wrote through io_uring fixed buffers (pinned once, or `direct`'s
/// registration put into the ring by fgds, not pinned), and why the others did not: a mode
/// without them pins its pages on every request.
fn print_fixed_buffers(rows: &[serde_json::Value]) {
    let mut modes: Vec<(String, Option<String>)> = Vec::new();
    for row in rows {
        let Some(mode) = row["mode"].as_str() else {
            continue;
        };
        if !row["mib_s"].is_number() || modes.iter().any(|(m, _)| m == mode) {
            continue;
        }
        let refused = row["fixed_buffers_refused"].as_str().map(str::to_owned);
        modes.push((mode.to_owned(), refused));
    }
    let kind = |mode: &str| {
        rows.iter()
            .find(|row| row["mode"] == mode)
            .and_then(|row| row["fixed_buffer_kind"].as_str())
            .filter(|kind| *kind != "pinned")
            .map_or(mode.to_owned(), |kind| format!("{mode} ({kind})"))
    };
    let with = modes
        .iter()
        .filter(|(_, r)| r.is_none())
        .map(|(m, _)| kind(m))
        .collect::<Vec<_>>();
    println!("io_uring fixed buffers: {}", with.join(", "));
    for (mode, why) in &modes {
        if let Some(why) = why {
            println!("  {mode}: none ({why})");
        }
    }
}

/// Success, or the run's verdicts printed and failure when a test failed.
fn exit_code(outcomes: Vec<crate::report::Outcome>, failed: bool) -> ExitCode {
    if !failed {
        return ExitCode::SUCCESS;
    }
    crate::report::print(outcomes);
    ExitCode::FAILURE
}

/// Writes the profiles as JSON and as a report (`profile-<label>.json`, `.txt`), and prints
/// per workload the CPU per GiB of each mode and the functions where `direct` spends more.
fn write_profiles(profiles: &[Value], out_dir: &Path, label: &str) -> anyhow::Result<()> {
    use std::fmt::Write as _;
    std::fs::write(
        out_dir.join(format!("profile-{label}.json")),
        serde_json::to_string_pretty(profiles)?,
    )?;
    let ms = |v: &Value| v.as_f64().unwrap_or(0.0);
    let table = |v: &Value| -> BTreeMap<String, f64> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| Some((e[0].as_str()?.to_owned(), ms(&e[1]))))
            .collect()
    };
    let mut report = String::new();
    let mut summary = String::new();
    let mut workloads = BTreeMap::<(String, u64, u64), BTreeMap<String, &Value>>::new();
    for p in profiles {
        let key = (
            p["op"].as_str().unwrap_or("read").to_owned(),
            p["block_size"].as_u64().unwrap_or(0),
            p["queue_depth"].as_u64().unwrap_or(0),
        );
        workloads
            .entry(key)
            .or_default()
            .insert(p["mode"].as_str().unwrap_or("").to_owned(), p);
    }
    for ((op, bs, qd), modes) in &workloads {
        let title = format!("{op} {} qd {}", human(*bs), qd);
        writeln!(report, "== {title}: guest CPU ms per GiB moved ==")?;
        for (mode, p) in modes {
            writeln!(
                report,
                "{mode:<7} {:8.1} MiB/s  busy {:8.1}  user {:7.1}  (lost samples {})",
                ms(&p["mib_s"]),
                ms(&p["busy_ms_per_gib"]),
                ms(&p["user_ms_per_gib"]),
                p["lost_samples"]
            )?;
        }
        let (Some(ram), Some(direct)) = (modes.get("ram"), modes.get("direct")) else {
            continue;
        };
        writeln!(
            summary,
            "{title}: CPU ms/GiB ram {:.0}, direct {:.0}",
            ms(&ram["busy_ms_per_gib"]),
            ms(&direct["busy_ms_per_gib"])
        )?;
        let (r, d) = (table(&ram["inclusive"]), table(&direct["inclusive"]));
        let mut diff = d
            .iter()
            .map(|(f, v)| (f.clone(), *v, r.get(f).copied().unwrap_or(0.0)))
            .collect::<Vec<_>>();
        diff.sort_by(|a, b| (b.1 - b.2).total_cmp(&(a.1 - a.2)));
        writeln!(
            report,
            "-- inclusive, largest excess of direct over ram (ms/GiB: direct, ram) --"
        )?;
        for (f, dv, rv) in diff.iter().take(30) {
            writeln!(report, "{:>9.1} {:>9.1}  {f}", dv, rv)?;
        }
        for (f, dv, rv) in diff.iter().take(5) {
            writeln!(summary, "  {f}: direct {dv:.0}, ram {rv:.0}")?;
        }
        for (mode, p) in modes {
            writeln!(report, "-- {mode}: self time (ms/GiB) --")?;
            let mut own = table(&p["self"]).into_iter().collect::<Vec<_>>();
            own.sort_by(|a, b| b.1.total_cmp(&a.1));
            for (f, v) in own.iter().take(20) {
                writeln!(report, "{v:>9.1}  {f}")?;
            }
            writeln!(report, "-- {mode}: hottest call chains (ms/GiB) --")?;
            for e in p["stacks"].as_array().into_iter().flatten().take(12) {
                writeln!(
                    report,
                    "{:>9.1}  {}",
                    ms(&e[1]),
                    e[0].as_str().unwrap_or("")
                )?;
            }
        }
        writeln!(report)?;
    }
    let path = out_dir.join(format!("profile-{label}.txt"));
    std::fs::write(&path, &report)?;
    print!("{summary}");
    println!("wrote {} (and .json)", path.display());
    Ok(())
}

/// Rows grouped by (op, queue depth, block size), mode -> row.
type Grid<'a> = BTreeMap<(String, u64, u64), BTreeMap<String, &'a Value>>;

/// The rows of one boot: `set` is `main` (rows without a `set`) or [`P2PMEM_SET`].
fn grid<'a>(rows: &'a [Value], set: &str) -> Grid<'a> {
    let mut grid = Grid::new();
    for row in rows
        .iter()
        .filter(|r| r["mib_s"].is_number() && r["set"].as_str().unwrap_or("main") == set)
    {
        let key = (
            row["op"].as_str().unwrap_or("").to_owned(),
            row["queue_depth"].as_u64().unwrap_or(0),
            row["block_size"].as_u64().unwrap_or(0),
        );
        grid.entry(key)
            .or_default()
            .insert(row["mode"].as_str().unwrap_or("").to_owned(), row);
    }
    grid
}

fn print_table(rows: &[Value]) {
    let same_pages = grid(rows, P2PMEM_SET);
    println!(
        "{:<5} {:>3} {:>5} | {:>8} {:>6} {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6} | {:>6} {:>6} | {:>5} {:>5} | {:>6} {:>8}",
        "op",
        "qd",
        "block",
        "ram MiB/s",
        "direct",
        "bounce",
        "ram2",
        "split",
        "kdmabuf",
        "CPU r",
        "CPU d",
        "QEMU r",
        "QEMU d",
        "req r",
        "req d",
        "p2pmem",
        "dir/p2pm"
    );
    for ((op, qd, bs), modes) in grid(rows, "main") {
        let ram = modes.get("ram").and_then(|r| r["mib_s"].as_f64());
        let ratio = |m: &str| fmt_ratio(paired(&modes, m, "ram"));
        let num = |m: &str, key: &str, digits: usize| {
            modes
                .get(m)
                .and_then(|r| r[key].as_f64())
                .map_or("-".to_owned(), |c| format!("{c:.digits$}"))
        };
        let qemu = |m: &str| {
            median(turn_values(&modes, m, "turn_host_cpu_s_per_gib"))
                .map_or("-".to_owned(), |c| format!("{c:.2}"))
        };
        let other = same_pages.get(&(op.clone(), qd, bs));
        let p2p = |a: &str, b: &str| fmt_ratio(other.and_then(|m| paired(m, a, b)));
        println!(
            "{:<5} {:>3} {:>5} | {:>8.0} {:>6} {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6} | {:>6} {:>6} | {:>5} {:>5} | {:>6} {:>8}",
            op,
            qd,
            human(bs),
            ram.unwrap_or(0.0),
            ratio("direct"),
            ratio("bounce"),
            ratio("ram-again"),
            ratio("ram-split"),
            ratio("uring-dmabuf"),
            num("ram", "cpu_s_per_gib", 2),
            num("direct", "cpu_s_per_gib", 2),
            qemu("ram"),
            qemu("direct"),
            num("ram", "requests_per_io", 1),
            num("direct", "requests_per_io", 1),
            p2p("p2pmem", "ram"),
            p2p("direct", "p2pmem"),
        );
    }
    println!(
        "(direct, bounce, ram2 (ram-again, ram against itself: the rig's noise at the point), split \
         (ram-split: ram in requests of at most 512 KiB), kdmabuf (uring-dmabuf: the kernel's own \
         dma-buf registered buffers, where the kernel has them): throughput as a ratio of ram's in the \
         same turns; CPU r, CPU d: the guest's CPU s per GiB, ram and direct; QEMU r, QEMU d: the \
         host's CPU s per GiB in QEMU, all its threads; req r, req d: requests the drive completed \
         per I/O; p2pmem, dir/p2pm: from the boot where vgpu's own P2PDMA pages back both direct \
         and p2pmem, p2pmem as a ratio of that boot's ram, direct as a ratio of p2pmem)"
    );
}

/// The median of some figures.
fn median(values: Option<Vec<f64>>) -> Option<f64> {
    let mut v = values?;
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(v[n / 2]),
        _ => Some((v[n / 2 - 1] + v[n / 2]) / 2.0),
    }
}

/// Threshold above which a `direct`/`ram` ratio needs a measured row that explains it.
const HIGH_RATIO: f64 = 1.05;

/// Each `direct`/`ram` ratio above [`HIGH_RATIO`] with the measured row that explains it:
/// `ram` split into more requests per I/O than `direct` (the drive's `stat`), or the ratio
/// inside the range `ram-again` against `ram` spans over the same groups of rounds (ram against
/// itself, as far off 1 either way): the rig's noise there. Returns the lines and how many
/// found no explanation.
fn explain_high_ratios(rows: &[Value]) -> (Vec<String>, usize) {
    let mut lines = Vec::new();
    let mut unexplained = 0;
    for ((op, qd, bs), modes) in grid(rows, "main") {
        let Some(r) = paired(&modes, "direct", "ram").filter(|&r| r > HIGH_RATIO) else {
            continue;
        };
        let at = format!(
            "{op} {} qd{qd}: direct/ram {}",
            human(bs),
            fmt_ratio(Some(r))
        );
        let requests = |m: &str| modes.get(m).and_then(|row| row["requests_per_io"].as_f64());
        let again = paired(&modes, "ram-again", "ram");
        // How far ram against itself strays from 1, either way, over the groups of rounds.
        let band = paired_groups(&modes, "turn_mib_s", "ram-again", "ram")
            .into_iter()
            .map(|a| a.max(1.0 / a))
            .reduce(f64::max);
        let why = match (requests("ram"), requests("direct"), again) {
            (Some(rr), Some(rd), _) if rd >= 0.99 && rr > rd * 1.05 => {
                format!("ram split: {rr:.1} requests per I/O, direct {rd:.1}")
            }
            (_, _, Some(a)) if band.is_some_and(|b| r <= b) => {
                format!(
                    "noise: ram-again/ram {} at the same point, from {} to {} over its groups \
                     of rounds",
                    fmt_ratio(Some(a)),
                    fmt_ratio(band.map(|b| 1.0 / b)),
                    fmt_ratio(band)
                )
            }
            (rr, rd, a) => {
                unexplained += 1;
                format!(
                    "UNEXPLAINED: requests per I/O ram {}, direct {}; ram-again/ram {}",
                    rr.map_or("-".to_owned(), |v| format!("{v:.1}")),
                    rd.map_or("-".to_owned(), |v| format!("{v:.1}")),
                    fmt_ratio(a)
                )
            }
        };
        lines.push(format!("{at}: {why}"));
    }
    (lines, unexplained)
}

/// The host's pages as docs/performance.md documents the rig's configuration: the GPU's
/// memory a file of a tmpfs mounted `huge=always`, mapped with PMDs; the guest's RAM anonymous
/// memory in transparent huge pages for the most part. Returns what differs, per row's
/// `host_backing` (`qemu_backing` of the control channel), or that it was not recorded.
fn backing_problems(rows: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    for row in rows.iter().filter(|r| r["mib_s"].is_number()) {
        let b = &row["host_backing"];
        let at = format!(
            "{} {} {} qd{}",
            row["mode"].as_str().unwrap_or("?"),
            row["op"].as_str().unwrap_or("?"),
            human(row["block_size"].as_u64().unwrap_or(0)),
            row["queue_depth"]
        );
        if !b.is_object() {
            problems.push(format!("{at}: the host's backing was not recorded"));
            continue;
        }
        let kib = |part: &str, key: &str| b[part][key].as_f64().unwrap_or(0.0);
        let bar_pmd = kib("bar", "pmd_mapped_kib") / kib("bar", "rss_kib").max(1.0);
        let ram_huge = kib("guest_ram", "anon_huge_kib") / kib("guest_ram", "rss_kib").max(1.0);
        let fs = b["bar"]["fs"].as_str().unwrap_or("");
        let options = b["bar"]["mount_options"].as_str().unwrap_or("");
        if fs != "tmpfs" || !options.split(',').any(|o| o == "huge=always") {
            problems.push(format!(
                "{at}: the GPU's memory is on {fs} ({options}), not a tmpfs with huge=always"
            ));
        }
        if bar_pmd < BAR_PMD_SHARE {
            problems.push(format!(
                "{at}: {:.0}% of the GPU's memory QEMU touched is mapped with PMDs, want {:.0}% or more",
                100.0 * bar_pmd,
                100.0 * BAR_PMD_SHARE
            ));
        }
        if ram_huge < RAM_HUGE_SHARE {
            problems.push(format!(
                "{at}: {:.0}% of the guest's RAM QEMU touched is in huge pages, want {:.0}% or more",
                100.0 * ram_huge,
                100.0 * RAM_HUGE_SHARE
            ));
        }
    }
    problems.dedup();
    problems
}

/// The documented share of the GPU's memory that QEMU maps with PMDs (2 MiB pages).
const BAR_PMD_SHARE: f64 = 0.9;
/// The documented share of the guest's RAM the host backs with transparent huge pages.
const RAM_HUGE_SHARE: f64 = 0.5;

/// The reads at queue depths 1 and 32 as the Markdown table of docs/performance.md's results,
/// with the registration figures under it: `target/bench/<kernel>.md`, so that the document
/// quotes the run rather than retypes it.
fn markdown(rows: &[Value], registration: Option<&Value>) -> String {
    use std::fmt::Write as _;
    let mut md = String::from(
        "| point | ram MiB/s | direct/ram | ram-again/ram | uring-dmabuf/ram | spread of direct (MiB/s) | bounce/ram | direct/bounce | CPU s/GiB ram | CPU s/GiB direct | CPU direct/ram | QEMU s/GiB ram | QEMU s/GiB direct | requests per I/O ram, direct |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut keys = grid(rows, "main")
        .into_iter()
        .filter(|((_, qd, _), _)| *qd == 1 || *qd == 32)
        .collect::<Vec<_>>();
    keys.sort_by_key(|((op, qd, bs), _)| (op.clone(), *qd, *bs));
    for ((op, qd, bs), modes) in keys {
        let get = |m: &str, k: &str| modes.get(m).and_then(|r| r[k].as_f64());
        let num =
            |v: Option<f64>, digits: usize| v.map_or("-".to_owned(), |v| format!("{v:.digits$}"));
        let _ = writeln!(
            md,
            "| {op} {} qd{qd} | {} | {} | {} | {} | {}-{} | {} | {} | {} | {} | {} | {} | {} | {}, {} |",
            human(bs),
            num(get("ram", "mib_s"), 0),
            fmt_ratio(paired(&modes, "direct", "ram")),
            fmt_ratio(paired(&modes, "ram-again", "ram")),
            fmt_ratio(paired(&modes, "uring-dmabuf", "ram")),
            num(get("direct", "mib_s_min"), 0),
            num(get("direct", "mib_s_max"), 0),
            fmt_ratio(paired(&modes, "bounce", "ram")),
            fmt_ratio(paired(&modes, "direct", "bounce")),
            num(get("ram", "cpu_s_per_gib"), 3),
            num(get("direct", "cpu_s_per_gib"), 3),
            fmt_ratio(paired_cpu(&modes, "direct", "ram")),
            num(
                median(turn_values(&modes, "ram", "turn_host_cpu_s_per_gib")),
                2
            ),
            num(
                median(turn_values(&modes, "direct", "turn_host_cpu_s_per_gib")),
                2
            ),
            num(get("ram", "requests_per_io"), 1),
            num(get("direct", "requests_per_io"), 1),
        );
    }
    let (explained, _) = explain_high_ratios(rows);
    if !explained.is_empty() {
        md.push('\n');
    }
    for line in explained {
        let _ = writeln!(md, "- {line}");
    }
    if let Some(reg) = registration {
        let _ = writeln!(md, "\n- {}", registration_line(reg));
    }
    md
}

/// The registration target's figure, counting what a program pays the first time: the GPU's
/// page provider (chosen by the first open of its node since its driver bound) and the first
/// registration after boot, with the later registrations' cost beside it.
fn registration_line(reg: &Value) -> String {
    let f = |k: &str| reg[k].as_f64().unwrap_or(0.0);
    let read = f("read_1gib_s").max(f64::MIN_POSITIVE);
    let pct = |s: f64| 100.0 * s / read;
    let provider = reg["provider_setup_s"].as_f64();
    let first = provider.unwrap_or(0.0) + f("cold_reg_map_s");
    format!(
        "registration [target < 1% of reading 1 GiB in {read:.2} s]: first use {:.1} ms ({:.2}%: \
         the page provider {} + the first REG + mmap of 1 GiB {:.1} ms); every later REG + mmap \
         {:.1} ms ({:.2}%)",
        1e3 * first,
        pct(first),
        provider.map_or(
            "not measured (set up before the bench)".to_owned(),
            |s| format!("{:.1} ms", 1e3 * s)
        ),
        1e3 * f("cold_reg_map_s"),
        1e3 * f("reg_map_s"),
        pct(f("reg_map_s")),
    )
}

/// The figures the targets speak of (issue 17's acceptance), reads and writes: direct against
/// ram at 1 and 4 MiB (queue depths 1 and 32), direct against bounce at every point, direct
/// against upstream's p2pmem wherever it ran, and CPU per GiB of direct against ram at 1 MiB and
/// above. Each line lists the worst case first.
fn print_targets(rows: &[Value]) {
    for wanted in ["read", "write"] {
        let mut speed = Vec::new();
        let mut over_bounce = Vec::new();
        let mut over_serial = Vec::new();
        let mut over_p2pmem = Vec::new();
        let mut cpu = Vec::new();
        for ((op, qd, bs), modes) in grid(rows, P2PMEM_SET) {
            if op != wanted {
                continue;
            }
            if let Some(r) = paired(&modes, "direct", "p2pmem") {
                let won = turns_where(&modes, "p2pmem", "turn_mib_s", |d, p| d >= p)
                    .map(|won| format!(", not slower in {won} turns"))
                    .unwrap_or_default();
                over_p2pmem.push((r, format!("{} qd{qd}{won}", human(bs))));
            }
        }
        for ((op, qd, bs), modes) in grid(rows, "main") {
            if op != wanted {
                continue;
            }
            let at = format!("{} qd{qd}", human(bs));
            if let Some(r) = paired(&modes, "direct", "ram")
                && (bs == 1 << 20 || bs == 4 << 20)
                && (qd == 1 || qd == 32)
            {
                speed.push((r, at.clone()));
            }
            if let Some(r) = paired(&modes, "direct", "bounce") {
                // How many turns direct won shows whether a margin near 1 is more than noise.
                let won = turns_where(&modes, "bounce", "turn_mib_s", |d, b| d > b)
                    .map(|won| format!(", won {won} turns"))
                    .unwrap_or_default();
                // Where the throughput's margin is within 1%, each turn's median request time
                // too, which a stall of the host (a few slow requests in a turn) barely moves.
                let p50 = |mode: &str| modes.get(mode).and_then(|m| m["p50_us"].as_f64());
                let shorter = turns_where(&modes, "bounce", "turn_p50_us", |d, b| d < b)
                    .map(|n| format!(" shorter in {n} turns;"))
                    .unwrap_or_default();
                let median = match (p50("direct"), p50("bounce")) {
                    (Some(d), Some(b)) if (r - 1.0).abs() < 0.01 => {
                        format!("; median request{shorter} {d:.1} us against {b:.1}")
                    }
                    _ => String::new(),
                };
                over_bounce.push((r, format!("{at}{won}{median}")));
            }
            if let Some(r) = paired(&modes, "direct", "bounce-serial") {
                let won = turns_where(&modes, "bounce-serial", "turn_mib_s", |d, b| d > b)
                    .map(|won| format!(", won {won} turns"))
                    .unwrap_or_default();
                over_serial.push((r, format!("{at}{won}")));
            }
            if let Some(r) = paired_cpu(&modes, "direct", "ram")
                && bs >= 1 << 20
            {
                cpu.push((r, at));
            }
        }
        let line = |what: &str, mut v: Vec<(f64, String)>, worst_is_low: bool, target: &str| {
            if v.is_empty() {
                println!("{wanted} {what} [{target}]: not measured");
                return;
            }
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            if !worst_is_low {
                v.reverse();
            }
            let shown = v
                .iter()
                .map(|(x, at)| format!("{} ({at})", fmt_ratio(Some(*x))))
                .collect::<Vec<_>>()
                .join(", ");
            println!("{wanted} {what} [{target}]: {shown}");
        };
        line("direct/ram", speed, true, "target >= 0.95");
        line("direct/bounce", over_bounce, true, "target > 1");
        // Only where an experiment asked for it (`--append fgds.bench_modes=...`).
        if !over_serial.is_empty() {
            line(
                "direct/bounce-serial",
                over_serial,
                true,
                "bounce without its spare slot; no target",
            );
        }
        line("direct/p2pmem", over_p2pmem, true, "target >= 1");
        let measured = rows.iter().filter(|r| r["mib_s"].is_number());
        let by = if measured.clone().all(|r| r["cpu_clock"] == "schedstat-ns") {
            "paired two rounds at a time, /proc/schedstat's clock"
        } else {
            "paired by repetitions, /proc/stat's 10 ms clock"
        };
        line(
            "CPU direct/ram",
            cpu,
            false,
            &format!("target <= 1.2; {by}"),
        );
    }
}

/// What the baselines were: how much of `ram`'s (and `bounce`'s staging) RAM the kernel backed
/// with huge pages, and which copy `bounce` made.
fn print_baselines(rows: &[Value]) {
    let measured = || rows.iter().filter(|r| r["mib_s"].is_number());
    for mode in ["ram", "bounce"] {
        let fractions = measured()
            .filter(|r| r["mode"] == mode)
            .filter_map(|r| r["huge_page_fraction"].as_f64())
            .collect::<Vec<_>>();
        if let (Some(lo), Some(hi)) = (
            fractions.iter().copied().reduce(f64::min),
            fractions.iter().copied().reduce(f64::max),
        ) {
            println!(
                "{mode}: RAM 2 MiB aligned with MADV_HUGEPAGE, {:.0}-{:.0}% in huge pages",
                100.0 * lo,
                100.0 * hi
            );
        }
    }
    let mut copies = measured()
        .filter_map(|r| {
            Some(format!(
                "{} {}",
                r["op"].as_str()?,
                r["bounce_copy"].as_str()?
            ))
        })
        .collect::<Vec<_>>();
    copies.sort();
    copies.dedup();
    if !copies.is_empty() {
        println!(
            "bounce: the faster CPU copy, with a read in flight while a slot is copied: {}",
            copies.join(", ")
        );
    }
}

/// Mode `a`'s throughput as a ratio of mode `b`'s: the median, over pairs of consecutive turns,
/// of the ratio of their MiB/s in those turns (`turn_mib_s`; `fgds bench` runs the modes' turns
/// back to back, so a burst of load on the host slows both).
fn paired(modes: &BTreeMap<String, &Value>, a: &str, b: &str) -> Option<f64> {
    paired_by(modes, "turn_mib_s", a, b)
}

/// The same for CPU per GiB: over the turns where the guest read its CPU time from
/// /proc/schedstat (nanoseconds), else over the repetitions (`rep_cpu_s_per_gib`: a turn of
/// 0.1 s is too short for /proc/stat's 10 ms steps).
fn paired_cpu(modes: &BTreeMap<String, &Value>, a: &str, b: &str) -> Option<f64> {
    let key = if fine_cpu_clock(modes, a) && fine_cpu_clock(modes, b) {
        "turn_cpu_s_per_gib"
    } else {
        "rep_cpu_s_per_gib"
    };
    paired_by(modes, key, a, b)
}

/// Whether mode `m`'s CPU time was read in nanoseconds (`fgds bench`'s `cpu_clock`).
fn fine_cpu_clock(modes: &BTreeMap<String, &Value>, m: &str) -> bool {
    modes
        .get(m)
        .is_some_and(|r| r["cpu_clock"].as_str() == Some("schedstat-ns"))
}

/// The ratios of `a`'s figures under `key` to `b`'s, one per group of as many rounds as the
/// compared modes rotate through (`rotation`, 2 or 3): `fgds bench` rotates ram, direct (and
/// ram-again) through the first places, so that over those rounds each has followed bounce once.
fn paired_groups(modes: &BTreeMap<String, &Value>, key: &str, a: &str, b: &str) -> Vec<f64> {
    let rounds = modes
        .get(a)
        .and_then(|r| r["rotation"].as_u64())
        .unwrap_or(2)
        .max(1) as usize;
    let (Some(a), Some(b)) = (turn_values(modes, a, key), turn_values(modes, b, key)) else {
        return Vec::new();
    };
    a.chunks(rounds)
        .zip(b.chunks(rounds))
        .map(|(a, b)| (a.iter().sum::<f64>(), b.iter().sum::<f64>()))
        .filter(|&(_, b)| b > 0.0)
        .map(|(a, b)| a / b)
        .collect()
}

/// The median of [`paired_groups`]; `None` where either mode has no such figures.
fn paired_by(modes: &BTreeMap<String, &Value>, key: &str, a: &str, b: &str) -> Option<f64> {
    median(Some(paired_groups(modes, key, a, b)))
}

/// In how many of their turns `direct`'s figure under `key` and `other`'s satisfy `holds`,
/// as "N of M".
fn turns_where(
    modes: &BTreeMap<String, &Value>,
    other: &str,
    key: &str,
    holds: fn(f64, f64) -> bool,
) -> Option<String> {
    let (d, b) = (
        turn_values(modes, "direct", key)?,
        turn_values(modes, other, key)?,
    );
    let n = d.iter().zip(&b).filter(|&(&d, &b)| holds(d, b)).count();
    Some(format!("{n} of {}", d.len().min(b.len())))
}

/// Mode `m`'s per-turn (or per-repetition) figures under `key`.
fn turn_values(modes: &BTreeMap<String, &Value>, m: &str, key: &str) -> Option<Vec<f64>> {
    modes
        .get(m)
        .and_then(|r| r[key].as_array())
        .map(|v| v.iter().filter_map(Value::as_f64).collect())
}

/// Two decimals, or three where that would read 1.00 and hide which side of 1 it is.
fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        None => "-".to_owned(),
        Some(r) if (r - 1.0).abs() < 0.005 && r != 1.0 => format!("{r:.3}"),
        Some(r) => format!("{r:.2}"),
    }
}

/// A block size as the tables print it: `4K`, `1M`.
pub fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{}M", bytes >> 20)
    } else {
        format!("{}K", bytes >> 10)
    }
}

/// A plot's lines: mode -> (block size, MiB/s) points.
type Lines = BTreeMap<String, Vec<(u64, f64)>>;

/// One plot per (op, queue depth): MiB/s against block size (log scale), a line per mode,
/// as PNG and SVG, drawn by `xtask-plot` (xtask/plot/). Returns how many files it wrote.
fn plot(rows: &[Value], out_dir: &Path, label: &str) -> anyhow::Result<usize> {
    let mut series: BTreeMap<(String, u64), Lines> = BTreeMap::new();
    for ((op, qd, bs), modes) in grid(rows, "main") {
        for (mode, row) in modes {
            let value = row["mib_s"].as_f64().unwrap_or(0.0);
            series
                .entry((op.clone(), qd))
                .or_default()
                .entry(mode)
                .or_default()
                .push((bs, value));
        }
    }
    let plots = series
        .iter()
        .map(|((op, qd), lines)| {
            // Not `with_extension` on a path: the label has a dot (debian-6.12).
            serde_json::json!({
                "stem": format!("{label}-{op}-qd{qd}"),
                "title": format!("{label}: {op}, queue depth {qd}"),
                "lines": lines,
            })
        })
        .collect::<Vec<_>>();
    let mut child = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .current_dir(crate::project_root())
        .args(["run", "--quiet", "-p", "xtask-plot", "--", FONT])
        .arg(out_dir)
        .stdin(Stdio::piped())
        .spawn()
        .context("cannot run cargo for xtask-plot")?;
    let written = child
        .stdin
        .take()
        .context("xtask-plot's stdin")?
        .write_all(serde_json::to_string(&plots)?.as_bytes());
    let status = child.wait().context("waiting for xtask-plot")?;
    written.context("cannot give xtask-plot its plots")?;
    if !status.success() {
        bail!("xtask-plot failed to draw the plots (see its message above)");
    }
    Ok(2 * plots.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(drives: u64, bs: u64, mode: &str, mib_s: f64, ratio: Option<f64>) -> Value {
        serde_json::json!({
            "set": "raid0", "array": "md raid0", "chunk": 512 << 10, "drives": drives,
            "block_size": bs, "mode": mode, "mib_s": mib_s, "ratio_to_ram": ratio,
            "requests_per_io": 2.0, "cpu_s_per_gib": if mode == "ram" { 0.5 } else { 0.6 },
        })
    }

    #[test]
    fn raid0_table_gives_aggregate_and_per_drive_and_refusals() {
        let mut unfixed = row(2, 1 << 20, "direct-mapped", 7000.0, Some(0.9));
        unfixed["fixed_buffers_asked"] = Value::from("off");
        let rows = vec![
            unfixed,
            row(2, 1 << 20, "ram", 8000.0, None),
            row(2, 1 << 20, "direct-mapped", 7600.0, Some(0.95)),
            row(2, 1 << 20, "ram-again", 8100.0, Some(1.01)),
            serde_json::json!({
                "set": "raid0", "array": "md raid0", "drives": 4, "block_size": 4 << 20,
                "mode": "direct-mapped", "refused": "mode direct-mapped cannot be measured on /dev/md4: its mapped address does not reach the file by DMA: its block device's queue takes no P2PDMA pages",
            }),
            row(4, 4 << 20, "ram", 9000.0, None),
        ];
        let table = raid0_table(&rows, "debian:7.3", "7.3-amd64", 4);
        assert!(
            table.contains("--drives 4 --raid0 --kernel debian:7.3"),
            "{table}"
        );
        assert!(table.contains("512K chunks"), "{table}");
        assert!(
            table.contains(
                "`direct-mapped` refused on md raid0 over 4 drive(s) at 4M: its block device's \
                 queue takes no P2PDMA pages"
            ),
            "{table}"
        );
        assert!(
            table.contains(
                "| md raid0 | 2 | 1M | 8000 | 7600 | 0.95 | 1.01 | 4000, 3800 | 2.0, 2.0 | 0.50, 0.60 | 0.90 |"
            ),
            "{table}"
        );
        assert!(
            table.contains("| md raid0 | 4 | 4M | 9000 | refused | - |"),
            "{table}"
        );
    }
}
