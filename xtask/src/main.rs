//! `cargo xtask`: the one entry point for building, booting and testing fgds.
//!
//! - `cargo xtask test-vm [--kernel SPEC] [--exec PATH]...`: build the driver and the guest,
//!   boot a kernel in QEMU, run the suite, report one line per test.
//! - `cargo xtask ci`: what CI runs (formatting, clippy, host tests, driver checks, test-vm).
//! - `cargo xtask fuzz [--kernel SPEC] [--minutes N] [--seed S]`: the concurrency fuzzer under
//!   a debug kernel's sanitizers.

mod bench;
mod boot_loop;
mod ci;
mod driver;
mod expected;
mod fio;
mod fuzz;
mod guest;
mod host;
mod matrix;
mod package;
mod python;
mod report;
mod run_memory;
mod selftest;
mod vm;

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, boot and test fgds",
    arg_required_else_help = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a kernel in QEMU with an NVMe drive and an ivshmem GPU, run the suite, report.
    TestVm(vm::Options),
    /// What CI runs: fmt, clippy, host tests, driver checks, then test-vm on the CI kernels.
    Ci(ci::Options),
    /// Benchmark ram, direct, bounce and p2pmem I/O in the guest: JSON, a ratio table, plots.
    Bench(bench::Options),
    /// The suite on several kernels, then a table: passed, failed, skipped, driver mode, time.
    Matrix(matrix::Options),
    /// Boot a kernel many times without the suite; count the clean boots, keep the others' consoles.
    BootLoop(boot_loop::Options),
    /// Run the concurrency fuzzer on a debug kernel (KASAN, lockdep, kmemleak) for some minutes:
    /// its checks, the kernel's splats and leaks, operations per second and per outcome.
    Fuzz(fuzz::Options),
    /// fio in the guest: the `fgds` ioengine (fio/fgds.c) into GPU memory against fio's own
    /// `io_uring` into RAM, reads and writes, 4 KiB to 4 MiB, depth 1 and 32; the table goes to
    /// docs/performance.md.
    Fio(fio::Options),
    /// Run checkpatch.pl --strict and sparse over driver/.
    CheckDriver(ci::DriverOptions),
    /// Check the rig's own verdicts: programs that pass, fail, skip and panic the kernel.
    RigSelftest(selftest::Options),
    /// Build the Debian packages fgds-dkms and fgds (target/package/), check them with lintian,
    /// and with --dkms KERNEL build the packaged source with dkms against a kernel.
    Package(package::Options),
    /// Build the Python package's abi3 wheel (target/wheels/) with maturin, installed into a
    /// venv of the cache when missing; --check also runs mypy --strict and stubtest.
    Wheel(python::Options),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Before any thread starts: see run_memory.
    run_memory::enter_private_namespace();
    let res = match cli.command {
        Command::TestVm(opts) => vm::test_vm(&opts),
        Command::Ci(opts) => ci::ci(&opts),
        Command::RigSelftest(opts) => selftest::rig_selftest(&opts),
        Command::CheckDriver(opts) => ci::check_driver(&opts),
        Command::Matrix(opts) => matrix::matrix(&opts),
        Command::Bench(opts) => bench::bench(&opts),
        Command::Package(opts) => package::package(&opts),
        Command::Wheel(opts) => python::wheel(&opts),
        Command::BootLoop(opts) => boot_loop::boot_loop(&opts),
        Command::Fuzz(opts) => fuzz::fuzz(&opts),
        Command::Fio(opts) => fio::fio(&opts),
    };
    match res {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The workspace root (the parent of xtask/).
fn project_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}
