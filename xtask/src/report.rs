//! Turning what a run produced (KTAP, console) into one verdict per test, and printing them
//! cargo-test style through libtest-mimic.

use fgds_qemu::console::{self, Splat};
use fgds_qemu::ktap::{self, Status, Test};

/// The init's last line on the KTAP port, exactly: a run without it was cut short.
pub const END_MARKER: &str = "# fgds-rig: done";

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
    /// Why the machine ended early, if it did (timeout, QEMU error).
    pub machine_problem: Option<String>,
}

/// The verdicts of a run.
pub fn outcomes(run: &RunArtifacts) -> Vec<Outcome> {
    let doc = ktap::parse(run.ktap);
    let started = run.ktap.lines().any(|l| l.starts_with("KTAP version"));
    let finished = run
        .ktap
        .lines()
        .any(|l| l.trim_end_matches('\r') == END_MARKER);
    let splats = console::splats(run.console);
    let (tests, unplanned) = match_plan(run.planned, ktap::complete(doc));
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
    for test in unplanned {
        out.push(Outcome {
            name: format!("{}::unplanned::{}", run.label, test.name),
            verdict: Verdict::Fail(format!(
                "a result (number {}) that the host's plan does not name: the guest ran \
                 something else than it was given",
                test.number
            )),
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
                "the guest stopped before the end of the suite (no line {END_MARKER:?})\n{}",
                crash_context()
            )),
            (None, true, true) => Verdict::Pass,
        },
    });
    out
}

/// Pairs the planned tests with the guest's results by name: each planned name takes the
/// first result line of that name; a planned test without one takes the block the guest died
/// in, if it bears the test's number (the init numbers tests in plan order), else it is
/// missing. Returns the tests in plan order, and the results that no planned name took.
fn match_plan(planned: &[String], results: Vec<Test>) -> (Vec<Test>, Vec<Test>) {
    let mut left = results.into_iter().map(Some).collect::<Vec<_>>();
    let mut take = |pred: &dyn Fn(&Test) -> bool| {
        left.iter_mut()
            .find(|t| t.as_ref().is_some_and(pred))
            .and_then(Option::take)
    };
    let mut tests = Vec::new();
    for (i, name) in planned.iter().enumerate() {
        let number = i + 1;
        let test = take(&|t: &Test| t.status != Status::Missing && t.name == *name)
            .or_else(|| {
                take(&|t: &Test| t.status == Status::Missing && t.number == number).map(|mut t| {
                    t.name = name.clone();
                    t
                })
            })
            .unwrap_or_else(|| missing(number, name));
        tests.push(test);
    }
    let unplanned = left.into_iter().flatten().collect();
    (tests, unplanned)
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

/// Prints, after the summary, how many skips the expected-outcome table expected in each run's
/// configuration (every other skip failed), one line per run.
pub fn print_skips(runs: &[(String, usize)]) {
    for (config, skips) in runs {
        println!("expected skips: {skips} in {config} (xtask/src/expected.rs)");
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

    #[test]
    fn results_are_matched_by_name_not_position() {
        // The guest ran rig_modules before smoke: each result keeps its own verdict.
        let ktap = "KTAP version 1\n1..3\nok 1 setup\nnot ok 2 rig_modules # exit=1\nok 3 smoke\n# fgds-rig: done\n";
        let out = run_with(ktap, "");
        assert!(matches!(verdict_of(&out, "k::smoke"), Verdict::Pass));
        assert!(matches!(
            verdict_of(&out, "k::rig_modules"),
            Verdict::Fail(_)
        ));
    }

    #[test]
    fn a_result_the_plan_does_not_name_fails_and_so_does_the_planned_test() {
        let ktap =
            "KTAP version 1\n1..3\nok 1 setup\nok 2 smoke\nok 3 rig_module\n# fgds-rig: done\n";
        let out = run_with(ktap, "");
        assert!(matches!(
            verdict_of(&out, "k::unplanned::rig_module"),
            Verdict::Fail(_)
        ));
        let Verdict::Fail(msg) = verdict_of(&out, "k::rig_modules") else {
            panic!("a planned test without a result must fail")
        };
        assert!(msg.contains("no result"), "{msg}");
    }

    #[test]
    fn the_end_marker_must_be_the_whole_line() {
        let results = "KTAP version 1\n1..3\nok 1 setup\nok 2 smoke\nok 3 rig_modules\n";
        for not_the_end in [
            "  # fgds-rig: done\n",
            "# fgds-rig: done, or not\n",
            "# smoke: fgds-rig: done\n",
        ] {
            let out = run_with(&format!("{results}{not_the_end}"), "");
            assert!(
                matches!(verdict_of(&out, "k::vm"), Verdict::Fail(_)),
                "{not_the_end:?} taken for the end"
            );
        }
        let out = run_with(&format!("{results}# fgds-rig: done\r\n"), "");
        assert!(matches!(verdict_of(&out, "k::vm"), Verdict::Pass));
    }
}
