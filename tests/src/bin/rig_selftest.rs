//! A program for checking the rig itself with `--exec` (not part of the suite): its first
//! argument, or its file name after `rig_selftest_`, says how it ends.
//!
//! - `pass`: prints a KTAP document with one passing case and exits 0;
//! - `fail`: exits 1;
//! - `skip`: exits 4 (the kselftest skip code);
//! - `panic`: crashes the kernel through `/proc/sysrq-trigger`.

use std::io::Write;

fn main() {
    let how = std::env::args()
        .nth(1)
        .or_else(|| {
            let exe = std::env::args().next()?;
            let name = std::path::Path::new(&exe)
                .file_name()?
                .to_string_lossy()
                .into_owned();
            name.strip_prefix("rig_selftest_").map(str::to_owned)
        })
        .unwrap_or_default();
    match how.as_str() {
        "pass" => {
            println!("KTAP version 1\n1..1\nok 1 selftest_case");
            std::process::exit(0)
        }
        "fail" => std::process::exit(1),
        "skip" => std::process::exit(4),
        "panic" => {
            let mut trigger = std::fs::OpenOptions::new()
                .write(true)
                .open("/proc/sysrq-trigger")
                .expect("open sysrq-trigger");
            let _ = trigger.write_all(b"c");
            std::process::exit(2)
        }
        other => {
            eprintln!("rig_selftest: unknown mode {other:?}: use pass, fail, skip or panic");
            std::process::exit(2)
        }
    }
}
