//! Host programs the kernel preparation runs (depmod, xz, make, ...), installed with the
//! system's apt when missing.

use std::{
    env,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use xshell::{Shell, cmd};

use super::run_logged;

/// What shows that a host package is installed.
#[derive(Clone, Copy)]
pub(super) enum Probe {
    /// A program in `PATH` (or in /usr/sbin, /sbin).
    Program(&'static str),
    /// A file, e.g. a header of a -dev package.
    File(&'static str),
}

/// Host packages needed to unpack Debian kernel packages and run depmod.
pub(super) const UNPACK: &[(Probe, &str)] = &[
    (Probe::Program("dpkg"), "dpkg"),
    (Probe::Program("depmod"), "kmod"),
    (Probe::Program("modinfo"), "kmod"),
    (Probe::Program("xz"), "xz-utils"),
];

/// Host packages needed to build out-of-tree modules and kbuild's host tools.
pub(super) const BUILD: &[(Probe, &str)] = &[
    (Probe::Program("make"), "make"),
    (Probe::Program("gcc"), "gcc"),
    (Probe::Program("ld"), "binutils"),
    (Probe::Program("flex"), "flex"),
    (Probe::Program("bison"), "bison"),
    (Probe::Program("bc"), "bc"),
    (Probe::Program("perl"), "perl"),
    (Probe::File("/usr/include/gelf.h"), "libelf-dev"),
    (Probe::File("/usr/include/openssl/opensslv.h"), "libssl-dev"),
    (Probe::File("/usr/include/zlib.h"), "zlib1g-dev"),
];

/// Installs the packages of `needs` whose probe fails, with `apt-get install -y` (logged to
/// `log`). Fails, naming them, if that is impossible (not root).
pub(super) fn ensure(needs: &[(Probe, &str)], log: &Path) -> anyhow::Result<()> {
    let mut missing: Vec<&str> = Vec::new();
    for &(probe, package) in needs {
        let present = match probe {
            Probe::Program(name) => find_program(name).is_some(),
            Probe::File(path) => Path::new(path).exists(),
        };
        if !present && !missing.contains(&package) {
            missing.push(package);
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let list = missing.join(" ");
    if !rustix::process::geteuid().is_root() {
        bail!("missing host packages: {list}; install them with `sudo apt-get install {list}`");
    }
    eprintln!("installing host packages: {list} ...");
    let sh = Shell::new()?;
    sh.set_var("DEBIAN_FRONTEND", "noninteractive");
    let packages = &missing;
    let install = || {
        run_logged(
            cmd!(
                sh,
                "apt-get install -y --no-install-recommends {packages...}"
            ),
            log,
        )
    };
    if install().is_err() {
        // The system's package lists may be stale or missing (as in fresh containers).
        run_logged(cmd!(sh, "apt-get update"), log).context("cannot update package lists")?;
        install().with_context(|| format!("cannot install host packages: {list}"))?;
    }
    Ok(())
}

/// The path of program `name`, looked up in `PATH` and then in the sbin directories (depmod is
/// in /usr/sbin, which a user's `PATH` may lack).
pub(super) fn find_program(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH").unwrap_or_default();
    env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|it| is_executable(it))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|it| it.is_file() && it.permissions().mode() & 0o111 != 0)
}
