//! The guest's kernel console: splats (panic, oops, BUG, WARNING, KASAN, lockdep, kmemleak)
//! and which test they happened in.
//!
//! The init writes `fgds-rig: begin <test>` and `fgds-rig: end <test>` into the kernel log around
//! each test, as blktests does, so a splat is charged to the test that was running.

/// A kernel report found in the console log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Splat {
    /// The test running when it was printed, if any.
    pub test: Option<String>,
    /// The matching line.
    pub line: String,
    /// The console lines around it, for the report.
    pub context: Vec<String>,
}

/// How a kernel report's first line starts (after the `[time]` prefix); any of these fails
/// the run. `WARNING:` is matched only at the start: boot messages such as "Speculative Return
/// Stack Overflow: WARNING: ..." are advice, not splats.
pub const SPLAT_STARTS: &[&str] = &[
    "Kernel panic",
    "BUG:",
    "WARNING:",
    "Oops:",
    "Oops ",
    "general protection fault",
    "UBSAN:",
    "kernel BUG at",
    "Call Trace:",
];

/// Text that marks a kernel report wherever it stands in a line (driver-prefixed reports,
/// lockdep's headings, kmemleak's objects as the init echoes them).
pub const SPLAT_ANYWHERE: &[&str] = &[
    "KASAN:",
    "possible circular locking dependency",
    "possible recursive locking",
    "inconsistent lock state",
    "suspicious RCU usage",
    "unreferenced object",
    "DMA-API:",
];

/// Whether a console line starts a kernel report.
pub fn is_splat(line: &str) -> bool {
    let message = match line.trim_start().strip_prefix('[') {
        Some(rest) => rest
            .split_once(']')
            .map_or(rest, |(_, msg)| msg)
            .trim_start(),
        None => line.trim_start(),
    };
    SPLAT_STARTS.iter().any(|m| message.starts_with(m))
        || SPLAT_ANYWHERE.iter().any(|m| message.contains(m))
}

const CONTEXT_BEFORE: usize = 5;
const CONTEXT_AFTER: usize = 30;

/// Finds the splats in `log`; several matching lines of one report count once.
pub fn splats(log: &str) -> Vec<Splat> {
    let lines = log.lines().collect::<Vec<_>>();
    let mut found = Vec::new();
    let mut current_test: Option<String> = None;
    let mut skip_until = 0;
    for (i, line) in lines.iter().enumerate() {
        if let Some(rest) = marker(line, "fgds-rig: begin ") {
            current_test = Some(rest.to_owned());
            skip_until = 0;
            continue;
        }
        if marker(line, "fgds-rig: end ").is_some() {
            current_test = None;
            skip_until = 0;
            continue;
        }
        if i < skip_until || !is_splat(line) {
            continue;
        }
        let from = i.saturating_sub(CONTEXT_BEFORE);
        let to = (i + CONTEXT_AFTER).min(lines.len());
        skip_until = to;
        found.push(Splat {
            test: current_test.clone(),
            line: line.trim().to_owned(),
            context: lines[from..to].iter().map(|l| (*l).to_owned()).collect(),
        });
    }
    found
}

fn marker<'a>(line: &'a str, prefix: &str) -> Option<&'a str> {
    line.find(prefix).map(|at| line[at + prefix.len()..].trim())
}

/// The last `n` lines of `log`, for a report when the guest died without a splat.
pub fn tail(log: &str, n: usize) -> Vec<String> {
    let lines = log.lines().collect::<Vec<_>>();
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| (*l).to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_splats_to_the_running_test() {
        let log = "\
[ 1.0] boot
[ 2.0] fgds-rig: begin smoke
[ 2.1] WARNING: CPU: 0 PID: 1 at drivers/x.c:1 f+0x1/0x2
[ 2.2] Call Trace:
[ 2.3] fgds-rig: end smoke
[ 3.0] BUG: KASAN: use-after-free in g
";
        let found = splats(log);
        assert_eq!(
            found.len(),
            2,
            "the Call Trace belongs to the WARNING; the BUG is a report of its own"
        );
        assert_eq!(found[0].test.as_deref(), Some("smoke"));
        assert!(found[0].line.contains("WARNING:"));
        assert_eq!(found[1].test, None);
    }

    #[test]
    fn advice_that_says_warning_is_not_a_splat() {
        assert!(!is_splat(
            "[    0.1] Speculative Return Stack Overflow: WARNING: See https://kernel.org/doc/html/latest/admin-guide/hw-vuln/srso.html for mitigation options."
        ));
        assert!(is_splat(
            "[    2.0] WARNING: CPU: 1 PID: 7 at mm/gup.c:10 f+0x1/0x2"
        ));
        assert!(is_splat(
            "[    2.0] WARNING: possible circular locking dependency detected"
        ));
        assert!(is_splat(
            "[    2.0] BUG: KASAN: slab-use-after-free in fgds_release+0x10/0x20"
        ));
        assert!(is_splat(
            "[    2.0] nvme 0000:01:00.0: DMA-API: device driver frees DMA memory with wrong function"
        ));
        assert!(is_splat(
            "[    2.0] fgds-rig: kmemleak: unreferenced object 0xffff8880 (size 64):"
        ));
    }

    #[test]
    fn clean_log_has_no_splats() {
        assert!(
            splats("[ 0.1] Linux version 6.12\n[ 0.2] fgds-rig: begin a\n[ 0.3] fgds-rig: end a\n")
                .is_empty()
        );
    }
}
