//! Turning what a run produced (KTAP, console, host checks) into one verdict per test, and
//! printing them cargo-test style through libtest-mimic.

use std::path::Path;

use fgds_qemu::console::{self, Splat};
use fgds_qemu::ktap::{self, Status, Test};
use fgds_tests::pattern;

/// The verdict on one test.
#[derive(Debug, Clone)]
pub enum Verdict {
    Pass,
    Fail(String),
    Skip(String),
}

/// One reported test.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub name: String,
    pub verdict: Verdict,
}

/// What the host knows about a finished run.
pub struct RunArtifacts<'a> {
    /// Prefix of every test name, e.g. `debian-6.12`.
    pub label: &'a str,
    /// Names of the top-level tests in plan order (`setup` first).
    pub planned: &'a [String],
    pub ktap: &'a str,
    pub console: &'a str,
    pub gpu_backing: &'a Path,
    /// Why the machine ended early, if it did (timeout, QEMU error).
    pub machine_problem: Option<String>,
}

/// The verdicts of a run.
pub fn outcomes(run: &RunArtifacts) -> Vec<Outcome> {
    let doc = ktap::parse(run.ktap);
    let started = run.ktap.lines().any(|l| l.starts_with("KTAP version"));
    let finished = run.ktap.lines().any(|l| l.contains("fgds-rig: done"));
    let splats = console::splats(run.console);
    let mut tests = ktap::complete(doc);
    for (i, name) in run.planned.iter().enumerate() {
        match tests.get_mut(i) {
            Some(test) if test.status == Status::Missing => test.name = name.clone(),
            Some(_) => {}
            None => tests.push(missing(i + 1, name)),
        }
    }
    let crash_context = || {
        let lines = match splats.last() {
            Some(splat) => splat.context.clone(),
            None => console::tail(run.console, 40),
        };
        format!("console:\n{}", lines.join("\n"))
    };

    let mut out = Vec::new();
    for test in &tests {
        let prefix = format!("{}::{}", run.label, test.name);
        for sub in &test.subtests {
            out.push(Outcome {
                name: format!("{prefix}::{}", sub.name),
                verdict: verdict(sub, &crash_context),
            });
        }
        let mut v = verdict(test, &crash_context);
        let charged = splats
            .iter()
            .filter(|s| s.test.as_deref() == Some(test.name.as_str()))
            .collect::<Vec<_>>();
        if !charged.is_empty() {
            v = Verdict::Fail(splat_report(&charged));
        }
        out.push(Outcome {
            name: prefix,
            verdict: v,
        });
    }

    let uncharged = splats
        .iter()
        .filter(|s| s.test.is_none())
        .collect::<Vec<_>>();
    out.push(Outcome {
        name: format!("{}::console", run.label),
        verdict: if uncharged.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail(splat_report(&uncharged))
        },
    });
    out.push(Outcome {
        name: format!("{}::vm", run.label),
        verdict: match (&run.machine_problem, started, finished) {
            (Some(problem), _, _) => Verdict::Fail(format!("{problem}\n{}", crash_context())),
            (None, false, _) => Verdict::Fail(format!(
                "the guest reported nothing (no KTAP)\n{}",
                crash_context()
            )),
            (None, true, false) => Verdict::Fail(format!(
                "the guest stopped before the end of the suite\n{}",
                crash_context()
            )),
            (None, true, true) => Verdict::Pass,
        },
    });
    out.extend(host_checks(run));
    out
}

fn missing(number: usize, name: &str) -> Test {
    Test {
        number,
        name: name.to_owned(),
        status: Status::Missing,
        directive: String::new(),
        diagnostics: Vec::new(),
        subtests: Vec::new(),
    }
}

fn verdict(test: &Test, crash_context: &dyn Fn() -> String) -> Verdict {
    let diags = test.diagnostics.join("\n");
    match &test.status {
        Status::Pass => Verdict::Pass,
        Status::Skip(reason) => Verdict::Skip(if reason.is_empty() {
            "no reason given".to_owned()
        } else {
            reason.clone()
        }),
        Status::Fail => Verdict::Fail(
            format!("{} {}\n{diags}", "failed", test.directive)
                .trim()
                .to_owned(),
        ),
        Status::Missing => Verdict::Fail(format!(
            "no result: the guest crashed or hung\n{diags}\n{}",
            crash_context()
        )),
    }
}

fn splat_report(splats: &[&Splat]) -> String {
    let mut text = String::new();
    for splat in splats {
        text.push_str(&format!(
            "kernel report: {}\n{}\n",
            splat.line,
            splat.context.join("\n")
        ));
    }
    text
}

/// The GPU-memory checks guest tests asked for (`# fgds-host-check: gpu-pattern offset=.. len=.. seed=..`).
fn host_checks(run: &RunArtifacts) -> Vec<Outcome> {
    let mut out = Vec::new();
    for line in run.ktap.lines() {
        let Some(rest) = line.split("fgds-host-check: gpu-pattern").nth(1) else {
            continue;
        };
        let field = |key: &str| -> Option<u64> {
            rest.split_whitespace()
                .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
        };
        let (Some(offset), Some(len), Some(seed)) = (field("offset"), field("len"), field("seed"))
        else {
            out.push(Outcome {
                name: format!("{}::host::malformed-check", run.label),
                verdict: Verdict::Fail(format!("cannot parse host check {line:?}")),
            });
            continue;
        };
        let name = format!("{}::host::gpu-pattern@{offset:#x}+{len:#x}", run.label);
        out.push(Outcome {
            name,
            verdict: check_gpu_pattern(run.gpu_backing, offset, len, seed),
        });
    }
    out
}

fn check_gpu_pattern(path: &Path, offset: u64, len: u64, seed: u64) -> Verdict {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; len as usize];
    let res = std::fs::File::open(path).and_then(|f| f.read_exact_at(&mut buf, offset));
    if let Err(err) = res {
        return Verdict::Fail(format!(
            "cannot read {} at {offset:#x}: {err}",
            path.display()
        ));
    }
    match pattern::first_mismatch(seed, 0, &buf) {
        None => Verdict::Pass,
        Some(at) => Verdict::Fail(format!(
            "the GPU backing file {} differs from the pattern at byte {:#x} (buffer offset {at:#x})",
            path.display(),
            offset + at as u64
        )),
    }
}

/// Prints the verdicts, one line each, then cargo test's summary line; returns whether all passed.
pub fn print(outcomes: Vec<Outcome>) -> bool {
    let args = libtest_mimic::Arguments {
        test_threads: Some(1),
        ..libtest_mimic::Arguments::default()
    };
    let trials = outcomes
        .into_iter()
        .map(|o| {
            libtest_mimic::Trial::ignorable_test(o.name, move || match o.verdict {
                Verdict::Pass => Ok(libtest_mimic::Completion::Completed),
                Verdict::Skip(reason) => Ok(libtest_mimic::Completion::ignored_with(reason)),
                Verdict::Fail(msg) => Err(msg.into()),
            })
        })
        .collect();
    !libtest_mimic::run(&args, trials).has_failed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_with(ktap: &str, console: &str) -> Vec<Outcome> {
        let planned = vec![
            "setup".to_owned(),
            "smoke".to_owned(),
            "rig_modules".to_owned(),
        ];
        outcomes(&RunArtifacts {
            label: "k",
            planned: &planned,
            ktap,
            console,
            gpu_backing: Path::new("/nonexistent"),
            machine_problem: None,
        })
    }

    fn verdict_of<'a>(out: &'a [Outcome], name: &str) -> &'a Verdict {
        &out.iter()
            .find(|o| o.name == name)
            .unwrap_or_else(|| panic!("no outcome {name}"))
            .verdict
    }

    #[test]
    fn a_crash_mid_suite_fails_the_running_and_the_missing_tests() {
        let ktap = "KTAP version 1\n1..3\nok 1 setup\n  KTAP version 1\n  1..2\n  ok 1 a\n";
        let console =
            "[1] fgds-rig: begin smoke\n[2] Kernel panic - not syncing: sysrq triggered crash\n";
        let out = run_with(ktap, console);
        assert!(matches!(verdict_of(&out, "k::setup"), Verdict::Pass));
        assert!(matches!(verdict_of(&out, "k::smoke::a"), Verdict::Pass));
        assert!(matches!(
            verdict_of(&out, "k::smoke::test 2"),
            Verdict::Fail(_)
        ));
        let Verdict::Fail(msg) = verdict_of(&out, "k::smoke") else {
            panic!("smoke must fail")
        };
        assert!(
            msg.contains("Kernel panic"),
            "the panic lines are shown: {msg}"
        );
        assert!(matches!(
            verdict_of(&out, "k::rig_modules"),
            Verdict::Fail(_)
        ));
        assert!(matches!(verdict_of(&out, "k::vm"), Verdict::Fail(_)));
    }

    #[test]
    fn a_clean_run_passes_and_skips_are_not_passes() {
        let ktap = "KTAP version 1\n1..3\nok 1 setup\nok 2 smoke # SKIP the program exited with 4\nok 3 rig_modules\n# fgds-rig: done\n";
        let out = run_with(ktap, "[0] boot\n");
        assert!(matches!(verdict_of(&out, "k::smoke"), Verdict::Skip(_)));
        assert!(matches!(verdict_of(&out, "k::vm"), Verdict::Pass));
        assert!(matches!(verdict_of(&out, "k::console"), Verdict::Pass));
    }

    #[test]
    fn a_warning_fails_its_test() {
        let ktap =
            "KTAP version 1\n1..3\nok 1 setup\nok 2 smoke\nok 3 rig_modules\n# fgds-rig: done\n";
        let console = "[1] fgds-rig: begin smoke\n[2] WARNING: CPU: 0 PID: 9 at x.c:1\n[3] fgds-rig: end smoke\n";
        let out = run_with(ktap, console);
        assert!(matches!(verdict_of(&out, "k::smoke"), Verdict::Fail(_)));
    }
}
