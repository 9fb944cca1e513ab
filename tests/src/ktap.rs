//! A KTAP v1 writer for in-guest test binaries.
//!
//! A test binary prints one KTAP document on stdout: the version line, the plan, then one
//! result line per case. The rig's init nests it under the binary's own result.

use std::fmt::Display;
use std::io::Write;

/// The outcome of one test case.
pub enum Outcome {
    Pass,
    Fail(String),
    Skip(String),
}

/// A case's body: `Ok(())` passes, `Err` fails with its message, [`skip`] skips.
pub type CaseResult = anyhow::Result<Outcome>;

/// Marks a case as skipped, with the reason printed in the KTAP directive.
pub fn skip(reason: impl Display) -> CaseResult {
    Ok(Outcome::Skip(reason.to_string()))
}

/// Marks a case as passed.
pub fn pass() -> CaseResult {
    Ok(Outcome::Pass)
}

/// One named case of a test binary.
pub struct Case {
    pub name: &'static str,
    pub run: fn() -> CaseResult,
}

/// Prints a KTAP diagnostic line (`# ...`) on stdout.
pub fn diag(msg: impl Display) {
    let mut out = std::io::stdout().lock();
    for line in msg.to_string().lines() {
        let _ = writeln!(out, "# {line}");
    }
    let _ = out.flush();
}

/// A case that takes this long gets a diagnostic line with its time.
const SLOW_CASE: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs every case in order, prints the KTAP document and exits: 0 if nothing failed, else 1.
///
/// A case that panics fails; the others still run. Cases named on the command line run alone.
pub fn run(cases: &[Case]) -> ! {
    let filter = std::env::args().skip(1).collect::<Vec<_>>();
    let selected = cases
        .iter()
        .filter(|case| filter.is_empty() || filter.iter().any(|f| case.name.contains(f.as_str())))
        .collect::<Vec<_>>();
    println!("KTAP version 1");
    println!("1..{}", selected.len());
    let mut failed = 0;
    for (i, case) in selected.iter().enumerate() {
        let n = i + 1;
        let started = std::time::Instant::now();
        let outcome = match std::panic::catch_unwind(case.run) {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(err)) => Outcome::Fail(format!("{err:#}")),
            Err(panic) => Outcome::Fail(panic_message(&panic)),
        };
        // Where a program's time goes, for the cases that take a while (a slow CI run says
        // which case it was).
        let took = started.elapsed();
        if took >= SLOW_CASE {
            diag(format_args!(
                "{} took {:.1} s",
                case.name,
                took.as_secs_f64()
            ));
        }
        match outcome {
            Outcome::Pass => println!("ok {n} {}", case.name),
            Outcome::Skip(reason) => println!("ok {n} {} # SKIP {}", case.name, one_line(&reason)),
            Outcome::Fail(msg) => {
                failed += 1;
                diag(format_args!("{}: {msg}", case.name));
                println!("not ok {n} {}", case.name);
            }
        }
        let _ = std::io::stdout().flush();
    }
    std::process::exit(if failed == 0 { 0 } else { 1 })
}

fn one_line(s: &str) -> String {
    s.lines().collect::<Vec<_>>().join("; ")
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => format!("panicked: {s}"),
        (_, Some(s)) => format!("panicked: {s}"),
        _ => "panicked".to_owned(),
    }
}
