//! A KTAP v1 parser in the manner of the kernel's `kunit_parser.py`: unknown lines are ignored,
//! subtests nest by two-space indentation, and a planned test without a result is a crash.

/// The status of one test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Pass,
    Fail,
    Skip(String),
    /// Planned, but no result line arrived (the guest crashed or hung).
    Missing,
}

/// One test and its subtests, with the diagnostic lines printed before its result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Test {
    pub number: usize,
    pub name: String,
    pub status: Status,
    /// The text after `#` on the result line, other than SKIP (e.g. `exit=1`, `TIMEOUT 60 seconds`).
    pub directive: String,
    pub diagnostics: Vec<String>,
    pub subtests: Vec<Test>,
}

/// A parsed KTAP document: its plan (if any) and its top-level tests, plus its own diagnostics.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Document {
    pub plan: Option<usize>,
    pub tests: Vec<Test>,
    pub diagnostics: Vec<String>,
}

/// Parses `text`; lines before the first version line are ignored.
pub fn parse(text: &str) -> Document {
    let lines = text
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .collect::<Vec<_>>();
    let start = lines
        .iter()
        .position(|l| is_version(l.trim_start()))
        .map_or(lines.len(), |i| i + 1);
    let indent = lines
        .get(start.wrapping_sub(1))
        .map_or(0, |l| l.len() - l.trim_start().len());
    let mut pos = start;
    parse_block(&lines, &mut pos, indent)
}

fn is_version(line: &str) -> bool {
    line.starts_with("KTAP version ") || line.starts_with("TAP version ")
}

/// Parses the block at `indent` starting at `pos` (just after its version line), up to the
/// first line indented less than `indent`.
fn parse_block(lines: &[&str], pos: &mut usize, indent: usize) -> Document {
    let mut doc = Document::default();
    let mut pending_diag = Vec::new();
    let mut pending_sub: Option<Document> = None;
    while *pos < lines.len() {
        let raw = lines[*pos];
        let this_indent = raw.len() - raw.trim_start().len();
        let line = raw.trim_start();
        if line.is_empty() {
            *pos += 1;
            continue;
        }
        if this_indent < indent {
            break;
        }
        if this_indent > indent {
            if is_version(line) {
                *pos += 1;
                pending_sub = Some(parse_block(lines, pos, this_indent));
                continue;
            }
            // Indented text that is not a subtest: a diagnostic of the coming result.
            pending_diag.push(line.trim_start_matches('#').trim().to_owned());
            *pos += 1;
            continue;
        }
        *pos += 1;
        if let Some(plan) = line.strip_prefix("1..") {
            doc.plan = plan.trim().parse().ok();
        } else if let Some(diag) = line.strip_prefix('#') {
            pending_diag.push(diag.trim().to_owned());
        } else if let Some(mut test) = parse_result(line) {
            test.diagnostics = std::mem::take(&mut pending_diag);
            if let Some(sub) = pending_sub.take() {
                test.subtests = complete(sub);
            }
            doc.tests.push(test);
        }
    }
    if let Some(sub) = pending_sub {
        // A subtest block whose parent never reported: the guest died inside it.
        let number = doc.tests.last().map_or(1, |t| t.number + 1);
        doc.tests.push(Test {
            number,
            name: format!("test {number}"),
            status: Status::Missing,
            directive: String::new(),
            diagnostics: std::mem::take(&mut pending_diag),
            subtests: complete(sub),
        });
    }
    doc.diagnostics.append(&mut pending_diag);
    doc
}

/// The subtests of a block, with planned-but-missing ones added as [`Status::Missing`].
pub fn complete(doc: Document) -> Vec<Test> {
    let mut tests = doc.tests;
    let plan = doc.plan.unwrap_or(0);
    let next = tests.iter().map(|t| t.number).max().unwrap_or(0);
    for number in next + 1..=plan {
        tests.push(Test {
            number,
            name: format!("test {number}"),
            status: Status::Missing,
            directive: String::new(),
            diagnostics: Vec::new(),
            subtests: Vec::new(),
        });
    }
    tests
}

fn parse_result(line: &str) -> Option<Test> {
    let (ok, rest) = if let Some(rest) = line.strip_prefix("ok ") {
        (true, rest)
    } else {
        (false, line.strip_prefix("not ok ")?)
    };
    let (number, rest) = rest.split_once(' ').unwrap_or((rest, ""));
    let number = number.parse().ok()?;
    let (name, directive) = match rest.split_once(" # ") {
        Some((name, directive)) => (name.trim(), directive.trim()),
        None => (rest.trim().trim_end_matches(" #"), ""),
    };
    let name = name.strip_prefix("- ").unwrap_or(name).to_owned();
    let upper = directive.to_ascii_uppercase();
    let status = if upper.starts_with("SKIP") {
        Status::Skip(directive[4..].trim().to_owned())
    } else if ok && !upper.starts_with("TIMEOUT") && !upper.starts_with("ERROR") {
        Status::Pass
    } else {
        Status::Fail
    };
    let directive = if matches!(status, Status::Skip(_)) {
        String::new()
    } else {
        directive.to_owned()
    };
    Some(Test {
        number,
        name,
        status,
        directive,
        diagnostics: Vec::new(),
        subtests: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const RUN: &str = "\
[    1.0] junk before
KTAP version 1
# fgds-rig: kernel 6.12
1..4
ok 1 setup
  KTAP version 1
  1..3
  ok 1 a
  # b: data differs
  not ok 2 b
  ok 3 c # SKIP no udmabuf
not ok 2 smoke # exit=1
  KTAP version 1
  1..2
  ok 1 first
ok 3 partial # TIMEOUT 5 seconds
";

    #[test]
    fn parses_nesting_skips_and_missing() {
        let doc = parse(RUN);
        assert_eq!(doc.plan, Some(4));
        let tests = complete(doc);
        assert_eq!(tests.len(), 4);
        assert_eq!(tests[0].status, Status::Pass);
        let smoke = &tests[1];
        assert_eq!(
            (smoke.name.as_str(), &smoke.status, smoke.directive.as_str()),
            ("smoke", &Status::Fail, "exit=1")
        );
        assert_eq!(smoke.subtests.len(), 3);
        assert_eq!(smoke.subtests[1].status, Status::Fail);
        assert_eq!(
            smoke.subtests[1].diagnostics,
            vec!["b: data differs".to_owned()]
        );
        assert_eq!(
            smoke.subtests[2].status,
            Status::Skip("no udmabuf".to_owned())
        );
        let partial = &tests[2];
        assert_eq!(
            partial.status,
            Status::Fail,
            "a TIMEOUT result fails even when `ok`"
        );
        assert_eq!(partial.subtests.len(), 2);
        assert_eq!(partial.subtests[1].status, Status::Missing);
        assert_eq!(tests[3].status, Status::Missing);
    }

    #[test]
    fn no_version_line_means_no_tests() {
        let doc = parse("Kernel panic - not syncing\n");
        assert!(doc.tests.is_empty());
        assert_eq!(doc.plan, None);
    }
}
