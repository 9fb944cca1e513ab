//! `cargo xtask boot-loop`: boots one kernel many times without the suite (the guest loads the
//! rig's modules, reports `setup` and `kmemleak`, powers off) and counts the clean boots, so a
//! boot flake's rate can be measured and measured again (docs/architecture.md, Boot flakes).
//!
//! The kernel, the driver and the initramfs are prepared once; each boot gets fresh drive
//! images and GPU memory. A boot that is not clean keeps its console, KTAP and QEMU logs in
//! `target/boot-loop/<kernel>-<threads>/boot-<n>/`; every boot is a line of
//! `target/boot-loop/<kernel>-<threads>.txt` (`-stress` added with `--text-poke-stress`).

use std::fmt::Write as _;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use fgds_qemu::console;

use crate::report::Verdict;
use crate::vm::{self, TcgThreadsArg};

#[derive(clap::Args)]
pub struct Options {
    /// The kernel, as for test-vm (debian:6.1, debian:6.12, debian:7.2, debian:7.3, ...).
    #[arg(long, default_value = "debian:6.12")]
    pub kernel: String,
    /// How many boots.
    #[arg(long, default_value_t = 50)]
    pub count: u32,
    /// TCG's host threads, as for test-vm.
    #[arg(long, value_enum, default_value_t = vm::DEFAULT_TCG_THREADS)]
    pub tcg_threads: TcgThreadsArg,
    /// Extra kernel parameters, as for test-vm.
    #[arg(long, default_value = "")]
    pub append: String,
    /// After setup, run tests/src/bin/text_poke_stress.rs: static keys flipped thousands of
    /// times while the other vCPU runs the code they patch (a minute a boot at most).
    #[arg(long)]
    pub text_poke_stress: bool,
}

/// The stress program and its timeout in seconds.
const STRESS: (&str, u64) = ("text_poke_stress", 120);

/// How one boot went.
struct Boot {
    /// None: clean; else what went wrong, in one line.
    failure: Option<String>,
    /// For a clean boot, what the stress program reported.
    note: Option<String>,
    /// Until the guest's first result (`setup`), if one came.
    booted_in: Option<Duration>,
    took: Duration,
}

pub fn boot_loop(opts: &Options) -> anyhow::Result<ExitCode> {
    let vm_opts = vm::Options {
        no_suite: true,
        tcg_threads: opts.tcg_threads,
        append: opts.append.clone(),
        programs: if opts.text_poke_stress {
            vec![(STRESS.0.to_owned(), STRESS.1)]
        } else {
            Vec::new()
        },
        ..vm::Options::for_kernel(&opts.kernel)
    };
    let prepared = vm::prepare(&vm_opts)?;
    let loop_dir = crate::project_root().join("target/boot-loop");
    let name = format!(
        "{}-{}{}",
        prepared.label(),
        threads_name(opts.tcg_threads),
        if opts.text_poke_stress { "-stress" } else { "" }
    );
    let out_dir = loop_dir.join(&name);
    // Failures of an earlier loop of this kernel would read as this one's.
    let _ = std::fs::remove_dir_all(&out_dir);
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    let summary_path = loop_dir.join(format!("{name}.txt"));
    let qemu = qemu_version();
    let mut summary = format!(
        "# cargo xtask boot-loop --kernel {} --count {} --tcg-threads {} --append {:?}{}\n\
         # {qemu}; started {}\n# boot  result  boot-s  total-s  failure (or what the stress program did)\n",
        opts.kernel,
        opts.count,
        threads_name(opts.tcg_threads),
        opts.append,
        if opts.text_poke_stress {
            " --text-poke-stress"
        } else {
            ""
        },
        now_utc(),
    );
    eprintln!(
        "boot-loop: {} boots of {} ({qemu}, TCG {}-threaded); details in {}",
        opts.count,
        opts.kernel,
        threads_name(opts.tcg_threads),
        summary_path.display()
    );

    let mut boots = Vec::new();
    for n in 1..=opts.count {
        let boot = boot_once(&prepared, &vm_opts, n, &out_dir)?;
        let _ = writeln!(
            summary,
            "{n:4}  {}  {:6}  {:7.1}  {}",
            if boot.failure.is_none() {
                "clean "
            } else {
                "FAILED"
            },
            boot.booted_in
                .map_or("-".to_owned(), |d| format!("{:.1}", d.as_secs_f64())),
            boot.took.as_secs_f64(),
            boot.failure
                .as_deref()
                .or(boot.note.as_deref())
                .unwrap_or("")
        );
        std::fs::write(&summary_path, &summary)
            .with_context(|| format!("cannot write {}", summary_path.display()))?;
        if let Some(failure) = &boot.failure {
            eprintln!(
                "  boot {n}: {failure} (kept in {})",
                out_dir.join(format!("boot-{n}")).display()
            );
        }
        boots.push(boot);
        if n % 10 == 0 || n == opts.count {
            eprintln!("  {}", tally(&boots, opts.count));
        }
    }
    let failed = boots.iter().filter(|b| b.failure.is_some()).count();
    let _ = writeln!(
        summary,
        "# {}; ended {}",
        tally(&boots, opts.count),
        now_utc()
    );
    std::fs::write(&summary_path, &summary)
        .with_context(|| format!("cannot write {}", summary_path.display()))?;
    eprintln!(
        "boot-loop: {}: {} clean, {failed} failed of {} boots",
        opts.kernel,
        boots.len() - failed,
        boots.len()
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// One boot, judged: clean when every verdict passes (a skip, as of kmemleak where the kernel
/// has none, is not a failure).
fn boot_once(
    prepared: &vm::Prepared,
    opts: &vm::Options,
    n: u32,
    out_dir: &Path,
) -> anyhow::Result<Boot> {
    let started = Instant::now();
    let run = vm::boot(prepared, opts, false)?;
    let took = started.elapsed();
    let failed = run
        .outcomes
        .iter()
        .filter_map(|o| match &o.verdict {
            Verdict::Fail(msg) => Some((o.name.as_str(), msg.as_str())),
            Verdict::Pass | Verdict::Skip(_) => None,
        })
        .collect::<Vec<_>>();
    if failed.is_empty() {
        // What the stress program says it did ("N flips of each of 2 keys in S s").
        let ktap = std::fs::read(run.run_dir.join("ktap.log"))
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        let note = ktap
            .lines()
            .find(|l| l.contains(" flips of each of "))
            .map(|l| l.trim().trim_start_matches('#').trim().to_owned());
        return Ok(Boot {
            failure: None,
            note,
            booted_in: run.booted_in,
            took,
        });
    }
    let keep = out_dir.join(format!("boot-{n}"));
    std::fs::create_dir_all(&keep).with_context(|| format!("cannot create {}", keep.display()))?;
    for name in ["console.log", "ktap.log", "qemu.log", "qemu.cmdline"] {
        let from = run.run_dir.join(name);
        if from.exists() {
            std::fs::copy(&from, keep.join(name))
                .with_context(|| format!("cannot keep {}", from.display()))?;
        }
    }
    let console_text = std::fs::read(run.run_dir.join("console.log"))
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    Ok(Boot {
        failure: Some(describe(&console_text, run.booted_in.is_some(), &failed)),
        note: None,
        booted_in: run.booted_in,
        took,
    })
}

/// A failed boot in one line: the first kernel report and where it hit, else how the machine
/// ended (the `vm` verdict), else the first failed verdict.
fn describe(console_text: &str, reported: bool, failed: &[(&str, &str)]) -> String {
    let when = if reported {
        "after the guest's first result"
    } else {
        "before the guest's first result"
    };
    if let Some(splat) = console::splats(console_text).first() {
        // The splat's context runs on past its RIP line.
        let rip = splat
            .context
            .iter()
            .skip_while(|l| l.trim() != splat.line)
            .find_map(|l| l.split("RIP: 0010:").nth(1))
            .map(|rip| format!(", RIP {}", rip.trim()))
            .unwrap_or_default();
        return format!("{when}: {}{rip}", splat.line);
    }
    // How the machine ended says more than the test it ended in.
    let (name, msg) = failed
        .iter()
        .find(|(name, _)| name.ends_with("::vm"))
        .unwrap_or(&failed[0]);
    format!(
        "{when}: {name}: {}",
        msg.lines().next().unwrap_or("").trim()
    )
}

fn tally(boots: &[Boot], count: u32) -> String {
    let failed = boots.iter().filter(|b| b.failure.is_some()).count();
    let times = boots
        .iter()
        .filter_map(|b| b.booted_in)
        .map(|d| d.as_secs_f64())
        .collect::<Vec<_>>();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let took = boots
        .iter()
        .map(|b| b.took.as_secs_f64())
        .collect::<Vec<_>>();
    format!(
        "{}/{count} boots: {} clean, {failed} failed; setup after {:.1} s, {:.1} s a boot on average",
        boots.len(),
        boots.len() - failed,
        mean(&times),
        mean(&took)
    )
}

fn threads_name(threads: TcgThreadsArg) -> &'static str {
    match threads {
        TcgThreadsArg::Single => "single",
        TcgThreadsArg::Multi => "multi",
    }
}

/// `QEMU emulator version ...`, first line of `qemu-system-x86_64 --version`.
fn qemu_version() -> String {
    std::process::Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "QEMU of unknown version".to_owned())
}

fn now_utc() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d %H:%M UTC"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OOPS: &str = "\
[    5.195731] fgds-rig: end setup
[    7.744609] Oops: int3: 0000 [#1] SMP NOPTI
[    7.745247] CPU: 1 UID: 0 PID: 117 Comm: text_poke_stres Tainted: G           OE       7.3-amd64 #1
[    7.745988] RIP: 0010:update_se+0x46/0x5f0
[    7.746343] Code: 74 47 4c 01 56 78 eb <0c> 4c 89 d0 48 83 c4 50 c3
[    7.752524] RIP: 0033:0x7f9ecc1dfd70
";

    #[test]
    fn describes_an_oops_with_its_rip() {
        let failed = [("k::vm", "the guest stopped before the end of the suite")];
        assert_eq!(
            describe(OOPS, true, &failed),
            "after the guest's first result: [    7.744609] Oops: int3: 0000 [#1] SMP NOPTI, \
             RIP update_se+0x46/0x5f0"
        );
    }

    #[test]
    fn describes_a_silent_death_by_how_the_machine_ended() {
        let failed = [
            ("k::stress::test 1", "no result: the guest crashed or hung"),
            (
                "k::vm",
                "QEMU died of signal 11 (its log: qemu.log)\nconsole:\n...",
            ),
        ];
        assert_eq!(
            describe("[    1.0] Linux version 7.3\n", true, &failed),
            "after the guest's first result: k::vm: QEMU died of signal 11 (its log: qemu.log)"
        );
    }

    #[test]
    fn describes_a_silent_death_by_its_first_failed_verdict() {
        let failed = [(
            "k::setup",
            "no result: the guest crashed or hung\nconsole:\n...",
        )];
        assert_eq!(
            describe("[    1.0] Linux version 7.3\n", false, &failed),
            "before the guest's first result: k::setup: no result: the guest crashed or hung"
        );
    }
}
