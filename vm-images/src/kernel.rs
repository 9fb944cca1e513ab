//! Kernels for the rig: Debian's prebuilt packages, fetched by package name into a private apt
//! cache, kernels built from Debian's `linux-source-X.Y` with the rig's config fragments
//! (`vm-images/configs/`), or a tree the user built; made ready to boot and to build out-of-tree
//! modules against.
//!
//! Layout under the cache dir (`$XDG_CACHE_HOME/fgds` or `~/.cache/fgds` for the rig):
//!
//! ```text
//! apt/                 private apt configuration, package lists and downloads (see `apt.rs`)
//! kernels/<release>/   an unpacked Debian kernel (image, modules, headers, kbuild), with the
//!                      marker file `.fgds-prepared` once it is complete
//! kernels/<release>.log
//! kernels/path-<name>-<hash>/   modules installed from a `path:` tree
//! kernels/build-<X.Y>[-debug]-<key>/   a `build:` kernel: build/ (the O= tree, kdir), modules/,
//!                      `.fgds-built` once complete (see `build.rs`); its log beside it
//! src/<linux-source-X.Y_version>/   unpacked `linux-source-X.Y`: the source of `build:`
//!                      kernels, and of kbuild host tools rebuilt for `debian:` ones
//! ko/<release>-<hash>/ decompressed `.ko` files handed out by [`module_load_order`]
//! ```
//!
//! **Architecture Invariant:** the system's apt configuration is only read, never changed; the
//! only system-wide action is `apt-get install` of missing host tools (kmod, libelf-dev, ...).

mod apt;
mod build;
mod debian;
mod debver;
mod host;
mod kbuild;
mod kconfig;
mod modules;
mod source;
mod tree;

use std::{
    fmt, fs,
    io::Write,
    path::{Path, PathBuf},
    str::FromStr,
};

use anyhow::{Context, bail, format_err};

/// Which kernel to run and build against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelSpec {
    /// Debian's prebuilt `-amd64` kernel of a series such as "6.1", "6.12", "7.2" or "7.3".
    Debian { series: String },
    /// Built from Debian's `linux-source-X.Y` with `vm-images/configs/base.config`, plus
    /// `debug.config` (KASAN, lockdep, kmemleak, DMABUF_DEBUG, fault injection) if `debug`,
    /// with the kernel changes `kernel-patches/<patch>/<series>.patch` that
    /// `patches` names applied in that order.
    Build {
        series: String,
        debug: bool,
        patches: Vec<String>,
    },
    /// A kernel tree the user configured and built (`make bzImage modules`).
    Path(PathBuf),
}

/// A kernel ready to boot, with what is needed to build out-of-tree modules against it.
#[derive(Debug, Clone)]
pub struct Kernel {
    /// The spec it was prepared from, e.g. "debian:6.12".
    pub spec: String,
    /// `uname -r` of the kernel, e.g. "6.12.117+deb12-amd64".
    pub release: String,
    /// The exact Debian package version, e.g. "6.12.117-1~deb12u1" (of `linux-source-X.Y` for
    /// `build:` kernels); empty for `path:` kernels.
    pub package_version: String,
    pub vmlinuz: PathBuf,
    /// `.../lib/modules/<release>`, with `modules.dep`.
    pub modules_dir: PathBuf,
    /// The tree to pass to `make -C kdir M=...` for out-of-tree modules.
    pub kdir: PathBuf,
    /// Extra make variables that building against `kdir` needs on this host, e.g.
    /// "CONFIG_DEBUG_INFO_BTF_MODULES=".
    pub make_vars: Vec<String>,
    /// The kernel's `.config`.
    pub config: PathBuf,
}

/// Fetches (or finds in the cache) and prepares the kernel `spec` names.
///
/// Long steps print one progress line each to stderr; their output goes to log files under
/// `cache_dir`. A second call with the same arguments is fast and offline, except that the
/// private package lists are refreshed once a day.
pub fn prepare(spec: &KernelSpec, cache_dir: &Path) -> anyhow::Result<Kernel> {
    fs::create_dir_all(cache_dir)
        .with_context(|| format!("cannot create the cache dir {}", cache_dir.display()))?;
    let res = match spec {
        KernelSpec::Debian { series } => debian::prepare(series, cache_dir),
        KernelSpec::Build {
            series,
            debug,
            patches,
        } => build::prepare(series, *debug, patches, cache_dir),
        KernelSpec::Path(dir) => tree::prepare(dir, cache_dir),
    };
    res.with_context(|| format!("cannot prepare kernel {spec}"))
}

/// The `.ko` files to load, in load order (dependencies first), for the named modules.
///
/// Modules built into the kernel (`modules.builtin`) are left out; names unknown to the kernel
/// are an error naming them. "pre:" soft dependencies (`modules.softdep`) are loaded before a
/// module and "post:" ones after it, as modprobe does. Compressed modules (`.ko.xz`, `.ko.zst`,
/// `.ko.gz`) are decompressed into the cache once, so the returned paths are plain `.ko` files.
pub fn module_load_order(
    kernel: &Kernel,
    names: &[&str],
    cache_dir: &Path,
) -> anyhow::Result<Vec<PathBuf>> {
    modules::load_order_files(kernel, names, cache_dir)
        .with_context(|| format!("cannot resolve modules for kernel {}", kernel.release))
}

/// Whether the kernel's config sets `option` (e.g. "CONFIG_PCI_P2PDMA") to y or m.
pub fn has_config(kernel: &Kernel, option: &str) -> anyhow::Result<bool> {
    let text = fs::read_to_string(&kernel.config)
        .with_context(|| format!("cannot read kernel config {}", kernel.config.display()))?;
    let value = config_value(&text, option);
    Ok(matches!(value, Some("y" | "m")))
}

/// Where the kernel changes live (the project's `kernel-patches/`): one directory per change,
/// holding for each series it applies to a patch (`<series>.patch`, `patch -p1` in the kernel
/// tree) or a list of patches in order (`<series>.series`, see `kernel::build`).
pub fn kernel_patches_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."))
        .join("kernel-patches")
}

/// Where third-party kernel series are read from (a `comparators:` line of a `.series` file):
/// `$FGDS_COMPARATORS`, else `../shared/comparators/` beside the project. The project never
/// copies them into its own tree.
pub fn comparators_dir() -> PathBuf {
    match std::env::var_os("FGDS_COMPARATORS") {
        Some(dir) => PathBuf::from(dir),
        None => kernel_patches_dir().join("../../shared/comparators"),
    }
}

/// The kernel changes a `build:` spec can name.
fn patch_names() -> Vec<String> {
    let mut names = fs::read_dir(kernel_patches_dir())
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let e = e.ok()?;
            e.file_type()
                .ok()?
                .is_dir()
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect::<Vec<_>>();
    names.sort();
    names
}

impl FromStr for KernelSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> anyhow::Result<KernelSpec> {
        const FORMS: &str = "accepted forms: `debian:X.Y` (Debian's prebuilt -amd64 kernel of \
                             series X.Y, e.g. debian:6.1, debian:6.12, debian:7.2, debian:7.3), \
                             `build:X.Y[+debug][+PATCH...]` (built from Debian's linux-source-X.Y \
                             with the rig's config, e.g. build:6.12, build:7.2+debug, and with \
                             kernel changes of kernel-patches/, e.g. \
                             build:7.2+p2pdma-folios+p2pdma-merge) or `path:DIR` (a kernel tree built with \
                             `make bzImage modules`)";
        if let Some(series) = s.strip_prefix("debian:") {
            if !is_series(series) {
                bail!("invalid kernel spec {s:?}: {series:?} is not a series like 6.12; {FORMS}");
            }
            return Ok(KernelSpec::Debian {
                series: series.to_owned(),
            });
        }
        if let Some(rest) = s.strip_prefix("build:") {
            let mut parts = rest.split('+');
            let series = parts.next().unwrap_or_default();
            let (mut debug, mut patches) = (false, Vec::<String>::new());
            for flavour in parts {
                match flavour {
                    "debug" if !debug && patches.is_empty() => debug = true,
                    name if !patches.iter().any(|p| p == name)
                        && patch_names().iter().any(|p| p == name) =>
                    {
                        patches.push(name.to_owned())
                    }
                    _ => bail!(
                        "invalid kernel spec {s:?}: unknown or repeated variant +{flavour} \
                         (+debug, then kernel changes of kernel-patches/, each once: \
                         {}); {FORMS}",
                        patch_names().join(", ")
                    ),
                }
            }
            if !is_series(series) {
                bail!("invalid kernel spec {s:?}: {series:?} is not a series like 6.12; {FORMS}");
            }
            return Ok(KernelSpec::Build {
                series: series.to_owned(),
                debug,
                patches,
            });
        }
        if let Some(dir) = s.strip_prefix("path:") {
            if dir.is_empty() {
                bail!("invalid kernel spec {s:?}: the directory is missing; {FORMS}");
            }
            return Ok(KernelSpec::Path(PathBuf::from(dir)));
        }
        Err(format_err!("invalid kernel spec {s:?}; {FORMS}"))
    }
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelSpec::Debian { series } => write!(f, "debian:{series}"),
            KernelSpec::Build {
                series,
                debug,
                patches,
            } => {
                write!(f, "build:{series}{}", if *debug { "+debug" } else { "" })?;
                patches.iter().try_for_each(|patch| write!(f, "+{patch}"))
            }
            KernelSpec::Path(dir) => write!(f, "path:{}", dir.display()),
        }
    }
}

impl KernelSpec {
    /// A filesystem-safe name for the spec, e.g. "debian-6.12", "build-6.12-debug" or
    /// "path-linux-0123456789abcdef".
    pub fn slug(&self) -> String {
        match self {
            KernelSpec::Debian { series } => format!("debian-{}", sanitize(series)),
            KernelSpec::Build {
                series,
                debug,
                patches,
            } => format!(
                "build-{}{}{}",
                sanitize(series),
                if *debug { "-debug" } else { "" },
                patches
                    .iter()
                    .map(|p| format!("-{}", sanitize(p)))
                    .collect::<String>()
            ),
            KernelSpec::Path(dir) => {
                let name = dir
                    .file_name()
                    .map(|it| it.to_string_lossy())
                    .unwrap_or_default();
                let hash = fnv1a(dir.as_os_str().as_encoded_bytes());
                if name.is_empty() {
                    format!("path-{hash:016x}")
                } else {
                    format!("path-{}-{hash:016x}", sanitize(&name))
                }
            }
        }
    }
}

fn is_series(s: &str) -> bool {
    let Some((major, minor)) = s.split_once('.') else {
        return false;
    };
    let is_num = |it: &str| !it.is_empty() && it.bytes().all(|b| b.is_ascii_digit());
    is_num(major) && is_num(minor)
}

/// The value of `option` in a kernel .config text: `Some("y")`, `Some("\"text\"")`, or `None`
/// when it is not set. `option` may be given with or without the `CONFIG_` prefix.
fn config_value<'a>(config: &'a str, option: &str) -> Option<&'a str> {
    let option = option.strip_prefix("CONFIG_").unwrap_or(option);
    config.lines().find_map(|line| {
        let (key, value) = line.split_once('=')?;
        (key.strip_prefix("CONFIG_")? == option).then_some(value)
    })
}

/// Replaces every byte that is not safe in a file name with '_'.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._+~-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// FNV-1a, 64 bits: a stable hash for cache keys (std's hasher may change between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Runs `cmd` quietly, appends the command line and its output to `log`, and fails with the
/// tail of the output if it exits unsuccessfully. Returns its stdout.
fn run_logged(cmd: xshell::Cmd<'_>, log: &Path) -> anyhow::Result<String> {
    let cmd = cmd.quiet().ignore_status();
    let cmd_line = cmd.to_string();
    let output = cmd
        .output()
        .with_context(|| format!("cannot run `{cmd_line}`"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    append_log(log, &format!("$ {cmd_line}\n{stdout}{stderr}"))?;
    if output.status.success() {
        return Ok(stdout);
    }
    let mut tail: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .rev()
        .take(15)
        .collect();
    tail.reverse();
    Err(format_err!(
        "`{cmd_line}` failed ({}); its last lines:\n{}\nthe full output is in {}",
        output.status,
        tail.join("\n"),
        log.display()
    ))
}

fn append_log(log: &Path, text: &str) -> anyhow::Result<()> {
    let mut file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open log file {}", log.display()))?;
    file.write_all(text.as_bytes())
        .with_context(|| format!("cannot write log file {}", log.display()))
}

/// An exclusive lock on a file, held until dropped; serializes concurrent preparations of the
/// same cache entry (e.g. test threads or two `cargo xtask` runs).
struct FileLock {
    file: fs::File,
}

impl FileLock {
    /// The locked file. A child process given a copy of it (as its stdin, say) keeps the lock
    /// held, with its own children, until they all exit: a build that outlives its parent is
    /// not raced by the next one.
    fn file(&self) -> &fs::File {
        &self.file
    }
}

fn lock_file(path: &Path) -> anyhow::Result<FileLock> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open lock file {}", path.display()))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(FileLock { file })
}

/// Like [`lock_file`], but says `waiting` on stderr first if another process holds the lock.
fn lock_file_announced(path: &Path, waiting: &str) -> anyhow::Result<FileLock> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let file = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open lock file {}", path.display()))?;
    use rustix::fs::{FlockOperation, flock};
    match flock(&file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => return Ok(FileLock { file }),
        Err(rustix::io::Errno::WOULDBLOCK) => eprintln!("{waiting} ..."),
        Err(e) => return Err(e).with_context(|| format!("cannot lock {}", path.display())),
    }
    flock(&file, FlockOperation::LockExclusive)
        .with_context(|| format!("cannot lock {}", path.display()))?;
    Ok(FileLock { file })
}

/// `path` with `suffix` appended to its last component ("6.1.0-57-amd64" + ".lock"), unlike
/// `Path::with_extension`, which would cut the name at its last dot.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut res = path.as_os_str().to_owned();
    res.push(suffix);
    PathBuf::from(res)
}

/// Removes `dir` and everything in it, if it exists.
fn remove_dir_all_if_exists(dir: &Path) -> anyhow::Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", dir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_debian_specs() {
        let spec: KernelSpec = "debian:6.12".parse().unwrap();
        assert_eq!(
            spec,
            KernelSpec::Debian {
                series: "6.12".to_owned()
            }
        );
        assert_eq!(spec.to_string(), "debian:6.12");
        assert_eq!(spec.slug(), "debian-6.12");
        let spec: KernelSpec = "debian:7.3".parse().unwrap();
        assert_eq!(spec.slug(), "debian-7.3");
    }

    #[test]
    fn parses_build_specs() {
        let spec: KernelSpec = "build:6.12".parse().unwrap();
        assert_eq!(
            spec,
            KernelSpec::Build {
                series: "6.12".to_owned(),
                debug: false,
                patches: Vec::new(),
            }
        );
        assert_eq!(spec.to_string(), "build:6.12");
        assert_eq!(spec.slug(), "build-6.12");
        let spec: KernelSpec = "build:7.2+debug".parse().unwrap();
        assert_eq!(
            spec,
            KernelSpec::Build {
                series: "7.2".to_owned(),
                debug: true,
                patches: Vec::new(),
            }
        );
        assert_eq!(spec.to_string(), "build:7.2+debug");
        assert_eq!(spec.slug(), "build-7.2-debug");
        let spec: KernelSpec = "build:7.2+debug+p2pdma-folios".parse().unwrap();
        assert_eq!(spec.to_string(), "build:7.2+debug+p2pdma-folios");
        assert_eq!(spec.slug(), "build-7.2-debug-p2pdma-folios");
        assert_eq!(
            "build:7.2+p2pdma-folios".parse::<KernelSpec>().unwrap(),
            KernelSpec::Build {
                series: "7.2".to_owned(),
                debug: false,
                patches: vec!["p2pdma-folios".to_owned()],
            }
        );
        let spec: KernelSpec = "build:7.2+p2pdma-folios+p2pdma-merge".parse().unwrap();
        assert_eq!(spec.to_string(), "build:7.2+p2pdma-folios+p2pdma-merge");
        assert_eq!(spec.slug(), "build-7.2-p2pdma-folios-p2pdma-merge");
        let err = "build:7.2+p2pdma-folios+p2pdma-folios"
            .parse::<KernelSpec>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("repeated"), "{err}");
        assert_eq!(
            "build:6.12+debug".parse::<KernelSpec>().unwrap().slug(),
            "build-6.12-debug"
        );
        let err = "build:6.12+kasan"
            .parse::<KernelSpec>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("+kasan") && err.contains("+debug"), "{err}");
    }

    #[test]
    fn parses_path_specs() {
        let spec: KernelSpec = "path:/src/linux".parse().unwrap();
        assert_eq!(spec, KernelSpec::Path(PathBuf::from("/src/linux")));
        assert_eq!(spec.to_string(), "path:/src/linux");
        let slug = spec.slug();
        assert!(slug.starts_with("path-linux-"), "{slug}");
        assert!(
            slug.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'),
            "{slug}"
        );
        let other: KernelSpec = "path:/other/linux".parse().unwrap();
        assert_ne!(other.slug(), slug);
    }

    #[test]
    fn rejects_bad_specs_naming_the_accepted_forms() {
        for bad in [
            "6.12",
            "debian:",
            "debian:6",
            "debian:6.x",
            "debian:bookworm",
            "build:",
            "build:6",
            "build:+debug",
            "build:6.12+",
            "build:6.12+debug+debug",
            "build:7.2+p2pdma-folios+debug",
            "build:7.2+p2pdma-folios+p2pdma-folios",
            "path:",
            "",
        ] {
            let err = bad.parse::<KernelSpec>().unwrap_err().to_string();
            assert!(
                err.contains("debian:X.Y")
                    && err.contains("build:X.Y[+debug][+PATCH...]")
                    && err.contains("path:DIR"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn reads_config_values() {
        let config =
            "CONFIG_A=y\n# CONFIG_B is not set\nCONFIG_C=m\nCONFIG_AB=y\nCONFIG_S=\"x=y\"\n";
        assert_eq!(config_value(config, "CONFIG_A"), Some("y"));
        assert_eq!(config_value(config, "A"), Some("y"));
        assert_eq!(config_value(config, "CONFIG_B"), None);
        assert_eq!(config_value(config, "CONFIG_C"), Some("m"));
        assert_eq!(config_value(config, "CONFIG_S"), Some("\"x=y\""));
        assert_eq!(config_value(config, "CONFIG_D"), None);
    }
}
