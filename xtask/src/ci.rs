//! `cargo xtask ci`: everything CI checks, in one command.

use std::process::{Command, ExitCode};

use crate::report::{self, Outcome, Verdict};
use crate::vm;

#[derive(clap::Args)]
pub struct Options {
    /// Kernels to boot (repeatable).
    #[arg(long = "kernel", default_values_t = ["debian:6.12".to_owned()])]
    pub kernels: Vec<String>,
}

pub fn ci(opts: &Options) -> anyhow::Result<ExitCode> {
    let root = crate::project_root();
    let mut outcomes = Vec::new();
    let steps: &[(&str, &[&str])] = &[
        ("ci::cargo-fmt", &["fmt", "--all", "--check"]),
        (
            "ci::cargo-clippy",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--quiet",
                "--",
                "-D",
                "warnings",
            ],
        ),
        ("ci::cargo-test", &["test", "--workspace", "--quiet"]),
    ];
    for (name, args) in steps {
        eprintln!("ci: cargo {}", args.join(" "));
        let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
            .current_dir(&root)
            .args(*args)
            .status()?;
        let verdict = if status.success() {
            Verdict::Pass
        } else {
            Verdict::Fail(format!("cargo {} failed", args.join(" ")))
        };
        outcomes.push(Outcome {
            name: (*name).to_owned(),
            verdict,
        });
    }
    for kernel in &opts.kernels {
        let vm_opts = vm::Options {
            kernel: kernel.clone(),
            accel: vm::AccelArg::Tcg,
            exec: Vec::new(),
            vgpu_mode: "plain".to_owned(),
            only: Vec::new(),
        };
        match vm::run_kernel(&vm_opts) {
            Ok(mut o) => outcomes.append(&mut o),
            Err(err) => outcomes.push(Outcome {
                name: format!("{kernel}::run"),
                verdict: Verdict::Fail(format!("{err:#}")),
            }),
        }
    }
    let passed = report::print(outcomes);
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
