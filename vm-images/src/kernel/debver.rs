//! Debian package version comparison, as dpkg does it (`[epoch:]upstream[-revision]`, with `~`
//! sorting before everything, even the end of the string).

use std::cmp::Ordering;

pub(super) fn compare(a: &str, b: &str) -> Ordering {
    let (epoch_a, upstream_a, revision_a) = split(a);
    let (epoch_b, upstream_b, revision_b) = split(b);
    epoch_a
        .cmp(&epoch_b)
        .then_with(|| compare_part(upstream_a, upstream_b))
        .then_with(|| compare_part(revision_a, revision_b))
}

/// Whether `version` satisfies the dependency relation `op` (`=`, `>=`, `<=`, `>>`, `<<`) on
/// `other`. Unknown operators are treated as not satisfied.
pub(super) fn satisfies(version: &str, op: &str, other: &str) -> bool {
    let ord = compare(version, other);
    match op {
        "=" => ord == Ordering::Equal,
        ">=" => ord != Ordering::Less,
        "<=" => ord != Ordering::Greater,
        ">>" | ">" => ord == Ordering::Greater,
        "<<" | "<" => ord == Ordering::Less,
        _ => false,
    }
}

fn split(version: &str) -> (u64, &str, &str) {
    let (epoch, rest) = match version.split_once(':') {
        Some((epoch, rest)) => (epoch.parse().unwrap_or(0), rest),
        None => (0, version),
    };
    match rest.rsplit_once('-') {
        Some((upstream, revision)) => (epoch, upstream, revision),
        None => (epoch, rest, ""),
    }
}

/// dpkg's `verrevcmp`: alternating non-digit runs (compared by `order`) and digit runs
/// (compared numerically).
fn compare_part(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    while !a.is_empty() || !b.is_empty() {
        while a.first().is_some_and(|c| !c.is_ascii_digit())
            || b.first().is_some_and(|c| !c.is_ascii_digit())
        {
            let ord = order(a.first().copied()).cmp(&order(b.first().copied()));
            if ord != Ordering::Equal {
                return ord;
            }
            a = &a[usize::from(!a.is_empty())..];
            b = &b[usize::from(!b.is_empty())..];
        }
        let digits_a = a.iter().take_while(|c| c.is_ascii_digit()).count();
        let digits_b = b.iter().take_while(|c| c.is_ascii_digit()).count();
        let ord = compare_digits(&a[..digits_a], &b[..digits_b]);
        if ord != Ordering::Equal {
            return ord;
        }
        a = &a[digits_a..];
        b = &b[digits_b..];
    }
    Ordering::Equal
}

/// The sort weight of a character in a non-digit run; `None` is the end of the string (or the
/// start of a digit run), which sorts after `~` and before everything else.
fn order(c: Option<u8>) -> i32 {
    match c {
        None => 0,
        Some(c) if c.is_ascii_digit() => 0,
        Some(c) if c.is_ascii_alphabetic() => i32::from(c),
        Some(b'~') => -1,
        Some(c) => i32::from(c) + 256,
    }
}

fn compare_digits(a: &[u8], b: &[u8]) -> Ordering {
    let trim = |it: &[u8]| -> usize { it.iter().take_while(|&&c| c == b'0').count() };
    let (a, b) = (&a[trim(a)..], &b[trim(b)..]);
    a.len().cmp(&b.len()).then_with(|| a.cmp(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_less(a: &str, b: &str) {
        assert_eq!(compare(a, b), Ordering::Less, "{a} < {b}");
        assert_eq!(compare(b, a), Ordering::Greater, "{b} > {a}");
    }

    #[test]
    fn compares_like_dpkg() {
        check_less("6.1.192-2", "6.1.192-3");
        check_less("6.1.176-1", "6.1.192-3");
        check_less("6.12.9-1", "6.12.117-1");
        check_less("6.12.115-2~deb12u1", "6.12.117-1~deb12u1");
        check_less("6.12.117-1~deb12u1", "6.12.117-1");
        check_less("6.12.95-1~bpo12+1", "6.12.95-1");
        check_less("7.3~rc7-1~exp1", "7.3-1");
        check_less("7.3~rc7-1~exp1", "7.3~rc8-1~exp1");
        check_less("7.2.13-1", "7.3~rc7-1~exp1");
        check_less("1.0", "1.0a");
        check_less("1.0~", "1.0");
        check_less("1.0a", "1.0+");
        check_less("9:1.0", "10:0.1");
        check_less("2.0", "1:0.1");
        assert_eq!(compare("1.001", "1.1"), Ordering::Equal);
        assert_eq!(compare("0:6.1.192-3", "6.1.192-3"), Ordering::Equal);
    }

    #[test]
    fn checks_relations() {
        assert!(satisfies("6.1.192-3", ">=", "6.1.192-3"));
        assert!(satisfies("6.1.192-3", "=", "6.1.192-3"));
        assert!(!satisfies("6.1.192-2", ">=", "6.1.192-3"));
        assert!(satisfies("6.1.192-2", "<<", "6.1.192-3"));
        assert!(!satisfies("6.1.192-3", ">>", "6.1.192-3"));
    }
}
