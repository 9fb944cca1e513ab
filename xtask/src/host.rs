//! The host: packages the rig needs, the cache directory, timing of phases.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// Host packages every VM run needs (Debian names).
pub const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "make",
    "gcc",
    "kmod",
    "xz-utils",
    "zstd",
    "e2fsprogs",
    "xfsprogs",
    "btrfs-progs",
];

/// Installs whichever of `packages` are missing, with apt-get (as root).
pub fn ensure_packages(packages: &[&str]) -> anyhow::Result<()> {
    install_missing(packages, false)
}

/// As [`ensure_packages`], without the packages' recommendations (dkms recommends the host
/// kernel's headers, which the rig never builds against).
pub fn ensure_packages_without_recommends(packages: &[&str]) -> anyhow::Result<()> {
    install_missing(packages, true)
}

/// Held while apt-get runs: threads that fetch side by side (`test-vm`'s kernel, fio's
/// source, the wheel's tools) may each find packages missing, and dpkg takes one at a time.
static APT: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn install_missing(packages: &[&str], no_recommends: bool) -> anyhow::Result<()> {
    let _apt = APT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let missing = packages
        .iter()
        .copied()
        .filter(|p| !is_installed(p))
        .collect::<Vec<_>>();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("installing host packages: {}", missing.join(" "));
    let apt = |args: &[&str]| -> anyhow::Result<bool> {
        let status = Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(std::process::Stdio::null())
            .status()
            .context("cannot run apt-get: the rig needs a Debian host")?;
        Ok(status.success())
    };
    let mut install = vec!["install", "-y", "-q"];
    if no_recommends {
        install.push("--no-install-recommends");
    }
    install.extend(&missing);
    if apt(&install)? {
        return Ok(());
    }
    if !apt(&["update", "-q"])? || !apt(&install)? {
        bail!(
            "apt-get install {} failed: run it as root and look at its output",
            missing.join(" ")
        );
    }
    Ok(())
}

fn is_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("install ok installed"))
}

/// The rig's cache: `$XDG_CACHE_HOME/fgds`, else `~/.cache/fgds`.
pub fn cache_dir() -> anyhow::Result<PathBuf> {
    let base = match (std::env::var_os("XDG_CACHE_HOME"), std::env::var_os("HOME")) {
        (Some(xdg), _) if !xdg.is_empty() => PathBuf::from(xdg),
        (_, Some(home)) => PathBuf::from(home).join(".cache"),
        _ => bail!("neither XDG_CACHE_HOME nor HOME is set: cannot place the rig's cache"),
    };
    let dir = base.join("fgds");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

/// Durations of a run's phases, printed in one line at the end.
#[derive(Default, Clone)]
pub struct Phases {
    done: Vec<(&'static str, Duration)>,
}

impl Phases {
    /// Runs `f` as phase `name`.
    pub fn run<T>(
        &mut self,
        name: &'static str,
        f: impl FnOnce() -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let started = Instant::now();
        let res = f();
        self.done.push((name, started.elapsed()));
        res
    }

    pub fn record(&mut self, name: &'static str, took: Duration) {
        self.done.push((name, took));
    }

    pub fn summary(&self) -> String {
        let parts = self
            .done
            .iter()
            .map(|(name, d)| format!("{name} {:.1}s", d.as_secs_f64()))
            .collect::<Vec<_>>();
        parts.join(", ")
    }
}
