//! `cargo xtask rig-selftest`: proves the rig's verdicts with programs whose ending is known
//! (tests/src/bin/rig_selftest.rs): a pass with a KTAP subtest, an exit 1, an exit 4 (skip),
//! and a kernel panic, which must fail the run within a minute with the panic lines shown.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::report::{self, Outcome, Verdict};
use crate::{guest, vm};

/// How long a panicking guest may take to be reported.
const PANIC_LIMIT: Duration = Duration::from_secs(60);

#[derive(clap::Args)]
pub struct Options {
    /// The kernel to boot.
    #[arg(long, default_value = "debian:6.12")]
    pub kernel: String,
}

pub fn rig_selftest(opts: &Options) -> anyhow::Result<ExitCode> {
    let outcomes = run(&opts.kernel)?;
    Ok(if report::print(outcomes) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Runs the two self-test boots on `kernel` and returns one verdict per expectation.
pub fn run(kernel: &str) -> anyhow::Result<Vec<Outcome>> {
    let dir = crate::project_root().join("target/rig-selftest");
    guest::build_binaries(guest::Build::Tests, &["rig_selftest"])?;
    let bin = guest::bin_dir(guest::Build::Tests).join("rig_selftest");
    let programs = ["pass", "fail", "skip", "panic"]
        .iter()
        .map(|mode| copy_as(&bin, &dir, mode))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let base = vm::Options {
        no_suite: true,
        ..vm::Options::for_kernel(kernel)
    };
    let endings = vm::run_kernel(&vm::Options {
        exec: programs[..3].to_vec(),
        ..base.clone()
    })?
    .outcomes;
    let started = Instant::now();
    let crash = vm::run_kernel(&vm::Options {
        exec: programs[3..].to_vec(),
        ..base
    })?
    .outcomes;
    let crash_took = started.elapsed();

    let find = |set: &[Outcome], suffix: &str| {
        set.iter()
            .find(|o| o.name.ends_with(suffix))
            .map(|o| o.verdict.clone())
    };
    let expect = |name: &str, ok: bool, why: String| Outcome {
        name: format!("rig-selftest::{name}"),
        verdict: if ok {
            Verdict::Pass
        } else {
            Verdict::Fail(why)
        },
    };
    let pass = find(&endings, "::exec:rig_selftest_pass");
    let sub = find(&endings, "::exec:rig_selftest_pass::selftest_case");
    let fail = find(&endings, "::exec:rig_selftest_fail");
    let skip = find(&endings, "::exec:rig_selftest_skip");
    let panic = find(&crash, "::exec:rig_selftest_panic");
    let panic_shown = matches!(&panic, Some(Verdict::Fail(msg)) if msg.contains("Kernel panic") || msg.contains("sysrq"));
    Ok(vec![
        expect(
            "exit_0_passes",
            matches!(pass, Some(Verdict::Pass)),
            format!("got {pass:?}"),
        ),
        expect(
            "ktap_subtests_reported",
            matches!(sub, Some(Verdict::Pass)),
            format!("got {sub:?}"),
        ),
        expect(
            "exit_1_fails",
            matches!(fail, Some(Verdict::Fail(_))),
            format!("got {fail:?}"),
        ),
        expect(
            "exit_4_skips",
            matches!(skip, Some(Verdict::Skip(_))),
            format!("got {skip:?}"),
        ),
        expect(
            "panic_fails_with_console",
            panic_shown,
            format!("got {panic:?}"),
        ),
        expect(
            "panic_reported_within_a_minute",
            crash_took < PANIC_LIMIT + Duration::from_secs(30)
                && crash_vm_time(&crash) < PANIC_LIMIT,
            format!("the panicking run took {:.0} s", crash_took.as_secs_f64()),
        ),
    ])
}

/// The machine time of a run is not in its outcomes; a run that hit its limit says so in `vm`.
fn crash_vm_time(outcomes: &[Outcome]) -> Duration {
    let timed_out = outcomes.iter().any(|o| {
        o.name.ends_with("::vm")
            && matches!(&o.verdict, Verdict::Fail(m) if m.contains("ran past its limit"))
    });
    if timed_out {
        Duration::MAX
    } else {
        Duration::ZERO
    }
}

fn copy_as(bin: &Path, dir: &Path, mode: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let dst = dir.join(format!("rig_selftest_{mode}"));
    std::fs::copy(bin, &dst)
        .with_context(|| format!("cannot copy {} to {}", bin.display(), dst.display()))?;
    Ok(dst)
}
