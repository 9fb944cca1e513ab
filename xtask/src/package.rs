//! `cargo xtask package`: the Debian packages `fgds-dkms` (the module's source with
//! driver/dkms.conf, a udev rule, a modprobe.d file) and `fgds` (the CLI and the UAPI header),
//! staged from packaging/ and built with `dpkg-deb`, checked with `lintian`; and `dkms build` of
//! the packaged source against the rig's kernels, in a private DKMS tree.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use fgds_vm_images::kernel::{self, Kernel};

use crate::host;
use crate::report::{self, Outcome, Verdict};

/// The kernels whose headers CI builds the packaged source against with `dkms build`: every
/// Debian series the rig boots and the debug kernel built from linux-source.
pub const DKMS_KERNELS: [&str; 5] = [
    "debian:6.1",
    "debian:6.12",
    "debian:7.2",
    "debian:7.3",
    "build:6.12+debug",
];

/// The maintainer named in the packages, unless DEBFULLNAME and DEBEMAIL say otherwise.
const MAINTAINER: &str = "fgds developers <fgds-devel@lists.example.org>";

#[derive(clap::Args)]
pub struct Options {
    /// Also `dkms build` the packaged source against these kernels (repeatable; `all`: the
    /// rig's kernels, as CI does).
    #[arg(long = "dkms", value_name = "KERNEL")]
    pub dkms: Vec<String>,
}

/// Built packages.
pub struct Packages {
    pub version: String,
    pub dkms: PathBuf,
    pub cli: Option<PathBuf>,
}

pub fn package(opts: &Options) -> anyhow::Result<ExitCode> {
    let packages = build(true)?;
    let mut outcomes = lintian(&packages)?;
    let kernels: Vec<String> = if opts.dkms.iter().any(|k| k == "all") {
        DKMS_KERNELS.iter().map(|k| (*k).to_owned()).collect()
    } else {
        opts.dkms.clone()
    };
    for spec in &kernels {
        outcomes.push(dkms_outcome(&packages, spec));
    }
    eprintln!("packages:");
    eprintln!("  {}", packages.dkms.display());
    if let Some(cli) = &packages.cli {
        eprintln!("  {}", cli.display());
    }
    Ok(if report::print(outcomes) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Where packages and their staging trees go.
fn out_dir() -> PathBuf {
    crate::project_root().join("target/package")
}

/// Builds `fgds-dkms` (and `fgds`, with `cli`) into target/package/.
pub fn build(cli: bool) -> anyhow::Result<Packages> {
    host::ensure_packages_without_recommends(&["dpkg-dev", "lintian", "dkms", "binutils", "gzip"])?;
    let root = crate::project_root();
    let version = crate_version(&root)?;
    let conf = std::fs::read_to_string(root.join("driver/dkms.conf"))?;
    let conf_version = conf
        .lines()
        .find_map(|l| l.strip_prefix("PACKAGE_VERSION="))
        .map(|v| v.trim_matches('"'));
    if conf_version != Some(version.as_str()) {
        bail!(
            "driver/dkms.conf has PACKAGE_VERSION {conf_version:?} but fgds/Cargo.toml has version {version}: make them equal"
        );
    }
    let out = out_dir();
    std::fs::create_dir_all(&out)?;
    let dkms = build_dkms(&root, &out, &version)?;
    let cli = if cli {
        Some(build_cli(&root, &out, &version)?)
    } else {
        None
    };
    Ok(Packages { version, dkms, cli })
}

fn crate_version(root: &Path) -> anyhow::Result<String> {
    let manifest = std::fs::read_to_string(root.join("fgds/Cargo.toml"))?;
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = "))
        .map(|v| v.trim_matches('"').to_owned())
        .context("fgds/Cargo.toml has no version line")
}

fn maintainer() -> String {
    match (std::env::var("DEBFULLNAME"), std::env::var("DEBEMAIL")) {
        (Ok(name), Ok(email)) if !name.is_empty() && !email.is_empty() => {
            format!("{name} <{email}>")
        }
        _ => MAINTAINER.to_owned(),
    }
}

/// A fresh staging tree `out/<name>/`.
fn stage_dir(out: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let dir = out.join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("cannot clean {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir.join("DEBIAN"))?;
    Ok(dir)
}

/// Copies `src` to `stage/rel` with `mode`.
fn install(src: &Path, stage: &Path, rel: &str, mode: u32) -> anyhow::Result<()> {
    let dst = stage.join(rel);
    std::fs::create_dir_all(dst.parent().expect("a file has a parent"))?;
    std::fs::copy(src, &dst).with_context(|| format!("cannot copy {}", src.display()))?;
    set_mode(&dst, mode)
}

fn write(stage: &Path, rel: &str, text: &str, mode: u32) -> anyhow::Result<()> {
    let dst = stage.join(rel);
    std::fs::create_dir_all(dst.parent().expect("a file has a parent"))?;
    std::fs::write(&dst, text).with_context(|| format!("cannot write {}", dst.display()))?;
    set_mode(&dst, mode)
}

fn set_mode(path: &Path, mode: u32) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot chmod {}", path.display()))
}

/// `packaging/<rel>` with `@NAME@` placeholders replaced.
fn template(root: &Path, rel: &str, vars: &[(&str, &str)]) -> anyhow::Result<String> {
    let path = root.join("packaging").join(rel);
    let mut text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    for (name, value) in vars {
        text = text.replace(&format!("@{name}@"), value);
    }
    if let Some(name) = text
        .split('@')
        .skip(1)
        .step_by(2)
        .find(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_uppercase()))
    {
        bail!(
            "{} has a placeholder @{name}@ that nothing fills",
            path.display()
        );
    }
    Ok(text)
}

/// `/usr/share/doc/<package>/`: copyright and the compressed changelog (native package).
fn docs(root: &Path, stage: &Path, package: &str, vars: &[(&str, &str)]) -> anyhow::Result<()> {
    let doc = format!("usr/share/doc/{package}");
    write(
        stage,
        &format!("{doc}/copyright"),
        &template(root, "copyright", vars)?,
        0o644,
    )?;
    let changelog = stage.join(&doc).join("changelog");
    std::fs::write(&changelog, template(root, "changelog", vars)?)?;
    // -n: no name or time stamp in the archive, so the package is reproducible.
    run(Command::new("gzip").args(["-9nf"]).arg(&changelog))?;
    set_mode(&stage.join(&doc).join("changelog.gz"), 0o644)
}

/// DEBIAN/md5sums over every file outside DEBIAN/, and the installed size in KiB.
fn md5sums(stage: &Path) -> anyhow::Result<u64> {
    let mut files = Vec::new();
    collect_files(stage, stage, &mut files)?;
    files.sort();
    let mut out = Command::new("md5sum");
    out.current_dir(stage).args(&files);
    let sums = run(&mut out)?;
    write(stage, "DEBIAN/md5sums", &sums, 0o644)?;
    let mut size = 0;
    for f in &files {
        size += std::fs::metadata(stage.join(f))?.len().div_ceil(1024);
    }
    Ok(size)
}

fn collect_files(base: &Path, dir: &Path, out: &mut Vec<String>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            if path != base.join("DEBIAN") {
                collect_files(base, &path, out)?;
            }
        } else {
            out.push(
                path.strip_prefix(base)
                    .expect("under base")
                    .display()
                    .to_string(),
            );
        }
    }
    Ok(())
}

/// `dpkg-deb --build` of `stage` into `out/<name>_<version>_<arch>.deb`.
fn dpkg_deb(
    stage: &Path,
    out: &Path,
    name: &str,
    version: &str,
    arch: &str,
) -> anyhow::Result<PathBuf> {
    let deb = out.join(format!("{name}_{version}_{arch}.deb"));
    run(Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zxz", "--build"])
        .arg(stage)
        .arg(&deb))?;
    Ok(deb)
}

fn build_dkms(root: &Path, out: &Path, version: &str) -> anyhow::Result<PathBuf> {
    let stage = stage_dir(out, "fgds-dkms")?;
    let src = format!("usr/src/fgds-{version}");
    let driver = root.join("driver");
    install(
        &driver.join("dkms.conf"),
        &stage,
        &format!("{src}/dkms.conf"),
        0o644,
    )?;
    // The module's own sources and headers; not vgpu (the rig's exporter) nor the top-level
    // Kbuild that builds it: dkms.conf builds driver/fgds/ as the external module.
    let mut sources = Vec::new();
    for dir in ["fgds", "include", "configure"] {
        collect_files(&driver, &driver.join(dir), &mut sources)?;
    }
    // The rig's exporter's header (include/uapi/linux/vgpu.h) stays out too.
    sources.retain(|f| {
        (f.ends_with(".c") && !f.ends_with(".mod.c")
            || f.ends_with(".h")
            || f.ends_with("Kbuild")
            || f.ends_with("conftest.sh")
            || f.ends_with("conftest.mk"))
            && !f.ends_with("vgpu.h")
            && !f.ends_with("fgds_config.h")
    });
    sources.sort();
    for rel in &sources {
        install(&driver.join(rel), &stage, &format!("{src}/{rel}"), 0o644)?;
    }
    let pkg = root.join("packaging/fgds-dkms");
    install(
        &pkg.join("60-fgds.rules"),
        &stage,
        "usr/lib/udev/rules.d/60-fgds.rules",
        0o644,
    )?;
    install(
        &pkg.join("fgds.conf"),
        &stage,
        "etc/modprobe.d/fgds.conf",
        0o644,
    )?;
    install(
        &pkg.join("fgds-limits.conf"),
        &stage,
        "etc/security/limits.d/fgds.conf",
        0o644,
    )?;
    let maintainer = maintainer();
    let vars = [("VERSION", version), ("MAINTAINER", maintainer.as_str())];
    docs(root, &stage, "fgds-dkms", &vars)?;
    for script in ["postinst", "prerm"] {
        write(
            &stage,
            &format!("DEBIAN/{script}"),
            &template(root, &format!("fgds-dkms/{script}"), &vars)?,
            0o755,
        )?;
    }
    write(
        &stage,
        "DEBIAN/conffiles",
        "/etc/modprobe.d/fgds.conf\n/etc/security/limits.d/fgds.conf\n",
        0o644,
    )?;
    let size = md5sums(&stage)?.to_string();
    let control = template(
        root,
        "fgds-dkms/control",
        &[
            ("VERSION", version),
            ("MAINTAINER", &maintainer),
            ("SIZE", &size),
        ],
    )?;
    write(&stage, "DEBIAN/control", &control, 0o644)?;
    dpkg_deb(&stage, out, "fgds-dkms", version, "all")
}

fn build_cli(root: &Path, out: &Path, version: &str) -> anyhow::Result<PathBuf> {
    // Dynamically linked: `fgds --cuda` loads libcuda, which a static glibc program cannot.
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .current_dir(root)
        .args([
            "build",
            "--quiet",
            "--release",
            "-p",
            "fgds",
            "--bin",
            "fgds",
        ])
        .status()
        .context("cannot run cargo")?;
    if !status.success() {
        bail!("building the fgds CLI failed (see cargo's output above)");
    }
    let stage = stage_dir(out, "fgds")?;
    install(
        &root.join("target/release/fgds"),
        &stage,
        "usr/bin/fgds",
        0o755,
    )?;
    run(Command::new("strip")
        .args([
            "--strip-unneeded",
            "--remove-section=.comment",
            "--remove-section=.note",
        ])
        .arg(stage.join("usr/bin/fgds")))?;
    install(
        &root.join("driver/include/uapi/linux/fgds.h"),
        &stage,
        "usr/include/linux/fgds.h",
        0o644,
    )?;
    let maintainer = maintainer();
    docs(
        root,
        &stage,
        "fgds",
        &[("VERSION", version), ("MAINTAINER", maintainer.as_str())],
    )?;
    let arch = run(Command::new("dpkg").arg("--print-architecture"))?
        .trim()
        .to_owned();
    let depends = shlib_depends(&stage, "usr/bin/fgds")?;
    let size = md5sums(&stage)?.to_string();
    let control = template(
        root,
        "fgds/control",
        &[
            ("VERSION", version),
            ("MAINTAINER", &maintainer),
            ("SIZE", &size),
            ("ARCH", &arch),
            ("DEPENDS", &depends),
        ],
    )?;
    write(&stage, "DEBIAN/control", &control, 0o644)?;
    dpkg_deb(&stage, out, "fgds", version, &arch)
}

/// The shared-library dependencies of `binary` as `dpkg-shlibdeps` computes them.
fn shlib_depends(stage: &Path, binary: &str) -> anyhow::Result<String> {
    // dpkg-shlibdeps wants a source package around the binary: a minimal debian/control.
    let work = stage.with_file_name("shlibdeps");
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    std::fs::create_dir_all(work.join("debian"))?;
    std::fs::write(
        work.join("debian/control"),
        "Source: fgds\n\nPackage: fgds\nArchitecture: any\n",
    )?;
    let text = run(Command::new("dpkg-shlibdeps")
        .current_dir(&work)
        .args(["-O", "-e"])
        .arg(stage.join(binary)))?;
    std::fs::remove_dir_all(&work)?;
    text.lines()
        .find_map(|l| l.strip_prefix("shlibs:Depends="))
        .map(str::to_owned)
        .context("dpkg-shlibdeps printed no shlibs:Depends")
}

/// `lintian` on each package: one outcome each, failing on any error tag (warnings shown).
pub fn lintian(packages: &Packages) -> anyhow::Result<Vec<Outcome>> {
    let mut outcomes = Vec::new();
    for deb in std::iter::once(&packages.dkms).chain(packages.cli.as_ref()) {
        let out = Command::new("lintian")
            .args(["--fail-on", "error"])
            .arg(deb)
            .output()
            .context("cannot run lintian")?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let name = deb
            .file_name()
            .map(|n| {
                n.to_string_lossy()
                    .split('_')
                    .next()
                    .unwrap_or_default()
                    .to_owned()
            })
            .unwrap_or_default();
        if !text.is_empty() {
            eprintln!("lintian {name}:\n{text}");
        }
        let verdict = if out.status.success() {
            Verdict::Pass
        } else {
            Verdict::Fail(format!(
                "lintian reports errors:\n{text}\n{}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        };
        outcomes.push(Outcome {
            name: format!("package::lintian::{name}"),
            verdict,
        });
    }
    Ok(outcomes)
}

/// `<kernel>::dkms-build`: `dkms build` of the packaged source against `spec`'s headers.
pub fn dkms_outcome(packages: &Packages, spec: &str) -> Outcome {
    let verdict = match dkms_build(packages, spec) {
        Ok(ko) => {
            eprintln!("dkms: {spec}: {}", ko.display());
            Verdict::Pass
        }
        Err(err) => Verdict::Fail(format!("{err:#}")),
    };
    Outcome {
        name: format!("{spec}::dkms-build"),
        verdict,
    }
}

/// Unpacks fgds-dkms and runs `dkms add` and `dkms build` against `spec`'s kernel build tree
/// (`--kernelsourcedir`), in a private DKMS tree under `target/dkms/<kernel>/` (the system's
/// /var/lib/dkms and /usr/src are never touched). Returns the built fgds.ko.
pub fn dkms_build(packages: &Packages, spec: &str) -> anyhow::Result<PathBuf> {
    let parsed: kernel::KernelSpec = spec.parse()?;
    let cache = host::cache_dir()?;
    host::ensure_packages(host::VM_PACKAGES)?;
    let kernel = kernel::prepare(&parsed, &cache)?;
    let work = crate::project_root()
        .join("target/dkms")
        .join(parsed.slug());
    if work.exists() {
        std::fs::remove_dir_all(&work)
            .with_context(|| format!("cannot clean {}", work.display()))?;
    }
    for dir in ["tree", "installed"] {
        std::fs::create_dir_all(work.join(dir))?;
    }
    let unpacked = work.join("root");
    run(Command::new("dpkg-deb")
        .arg("-x")
        .arg(&packages.dkms)
        .arg(&unpacked))?;
    let log = work.join("dkms.log");
    dkms(&kernel, &work, &["add"], &packages.version, &log)?;
    dkms(&kernel, &work, &["build"], &packages.version, &log)?;
    let ko = work
        .join("tree/fgds")
        .join(&packages.version)
        .join(&kernel.release)
        .join(std::env::consts::ARCH)
        .join("module/fgds.ko");
    if !ko.exists() {
        bail!(
            "dkms build made no {} (log: {})",
            ko.display(),
            log.display()
        );
    }
    Ok(ko)
}

/// One `dkms` command on the private tree, appending its output to `log`.
fn dkms(
    kernel: &Kernel,
    work: &Path,
    verb: &[&str],
    version: &str,
    log: &Path,
) -> anyhow::Result<()> {
    let mut cmd = Command::new("dkms");
    cmd.args(verb)
        .args(["-m", "fgds", "-v", version, "-k", &kernel.release])
        .arg(format!(
            "--sourcetree={}",
            work.join("root/usr/src").display()
        ))
        .arg(format!("--dkmstree={}", work.join("tree").display()))
        .arg(format!(
            "--installtree={}",
            work.join("installed").display()
        ))
        .arg(format!("--kernelsourcedir={}", kernel.kdir.display()))
        // What building against this tree needs on this host (the 7.x headers' compiler...).
        .env("FGDS_KBUILD_ARGS", kernel.make_vars.join(" "))
        // Where a signing key would go, should the host have the kernel's sign-file: never
        // /var/lib/dkms.
        .env("mok_signing_key", work.join("mok.key"))
        .env("mok_certificate", work.join("mok.der"));
    let out = cmd.output().context("cannot run dkms")?;
    let text = format!(
        "$ dkms {} ({})\n{}{}",
        verb.join(" "),
        kernel.release,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut previous = std::fs::read_to_string(log).unwrap_or_default();
    previous.push_str(&text);
    std::fs::write(log, &previous)?;
    if !out.status.success() {
        let make_log = work.join("tree/fgds").join(version).join("build/make.log");
        let make = std::fs::read_to_string(&make_log).unwrap_or_default();
        let tail = make.lines().rev().take(25).collect::<Vec<_>>();
        bail!(
            "dkms {} -k {} failed ({}):\n{}\n{}",
            verb.join(" "),
            kernel.release,
            log.display(),
            text.trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    Ok(())
}

/// Runs `cmd`, returning its stdout; an error with its stderr if it fails.
fn run(cmd: &mut Command) -> anyhow::Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed: {}",
            cmd,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
