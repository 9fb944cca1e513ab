//! The Python package (python/): `cargo xtask wheel` builds its abi3 wheel with maturin, from a
//! venv of its own in the cache (maturin installed there from PyPI when missing); the guest's
//! Python for the suite's Python tests (tests/python/) is staged from the host's Debian
//! interpreter.
//!
//! The guest's Python: `/usr/bin/python3.11` of the host (Debian's, from the apt package
//! `python3.11`), the shared libraries it and its extension modules need (as `ldd` finds them),
//! the modules of its standard library that the tests and `fgds` import, compiled to sourceless
//! `.pyc` files, and the wheel's files in `/usr/lib/python3/dist-packages`, where Debian's
//! Python looks, as an installed wheel would be. Staged once per input (wheel, interpreter,
//! tests) under `target/guest-python/<key>/`.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, bail};
use fgds_vm_images::initramfs::{Entry, Tree};

use crate::host;

/// The maturin the wheel is built with (installed from PyPI into the cache's venv).
const MATURIN: &str = "maturin==1.16.0";
/// What `--check` type-checks with.
const MYPY: &str = "mypy==1.19.1";
/// The guest's interpreter: Debian 12's.
pub const GUEST_PYTHON: &str = "/usr/bin/python3.11";

#[derive(clap::Args)]
pub struct Options {
    /// Also type-check the package and the tests (mypy --strict) and check the native
    /// module's stub against the module (stubtest).
    #[arg(long)]
    pub check: bool,
}

/// The cargo profile a wheel is built with.
#[derive(Clone, Copy)]
pub enum WheelProfile {
    /// What users get (`cargo xtask wheel`).
    Release,
    /// The rig's runs and CI: unoptimised, built in half the time (Cargo.toml).
    Rig,
}

impl WheelProfile {
    fn name(self) -> &'static str {
        match self {
            WheelProfile::Release => "release",
            WheelProfile::Rig => "rig",
        }
    }
}

/// `cargo xtask wheel`.
pub fn wheel(opts: &Options) -> anyhow::Result<ExitCode> {
    let wheel = build_wheel(WheelProfile::Release)?;
    println!("{}", wheel.display());
    if opts.check {
        check(&wheel)?;
        eprintln!("wheel: mypy --strict and stubtest passed");
    }
    Ok(ExitCode::SUCCESS)
}

/// Fetches the tools the wheel's build needs (maturin, from PyPI), ahead of it.
pub fn fetch_tools() -> anyhow::Result<()> {
    tools_venv(&[MATURIN]).map(drop)
}

/// The venv of the build tools, with `packages` installed (from PyPI, once).
fn tools_venv(packages: &[&str]) -> anyhow::Result<PathBuf> {
    host::ensure_packages(&["python3", "python3-venv", "python3-pip"])?;
    let venv = host::cache_dir()?.join("python-tools");
    let python = venv.join("bin/python");
    if !python.exists() {
        run(Command::new("/usr/bin/python3")
            .args(["-m", "venv"])
            .arg(&venv))
        .context("creating the build tools' venv")?;
    }
    let marker = venv.join(format!("installed-{}", packages.join("+")));
    if !marker.exists() {
        eprintln!(
            "wheel: installing {} into {}",
            packages.join(" "),
            venv.display()
        );
        pip_install(&python, packages)
            .with_context(|| format!("pip install {} from PyPI", packages.join(" ")))?;
        std::fs::write(&marker, "")?;
    }
    Ok(venv)
}

/// `pip install --quiet ARGS` with the venv's `python`.
fn pip_install(python: &Path, args: &[&str]) -> anyhow::Result<()> {
    run(Command::new(python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(args))
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot run {:?}", cmd.get_program()))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// The wheels this process built, by profile: the sources do not change under a run, so one
/// build serves every machine of it (and a second caller waits for the first's build).
static BUILT: std::sync::Mutex<Vec<(&str, PathBuf)>> = std::sync::Mutex::new(Vec::new());

/// Builds the wheel with `profile` into `target/wheels/` (once per process) and returns its
/// path.
pub fn build_wheel(profile: WheelProfile) -> anyhow::Result<PathBuf> {
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, wheel)) = built
        .iter()
        .find(|(name, wheel)| *name == profile.name() && wheel.exists())
    {
        return Ok(wheel.clone());
    }
    let wheel = build_wheel_now(profile)?;
    built.retain(|(name, _)| *name != profile.name());
    built.push((profile.name(), wheel.clone()));
    Ok(wheel)
}

fn build_wheel_now(profile: WheelProfile) -> anyhow::Result<PathBuf> {
    let venv = tools_venv(&[MATURIN])?;
    let root = crate::project_root();
    let out = root.join("target/wheels");
    std::fs::create_dir_all(&out)?;
    for entry in std::fs::read_dir(&out)?.flatten() {
        if entry.file_name().to_string_lossy().starts_with("fgds-") {
            std::fs::remove_file(entry.path())?;
        }
    }
    run(Command::new(venv.join("bin/maturin"))
        .current_dir(&root)
        .args([
            "build",
            "--quiet",
            "--profile",
            profile.name(),
            "-m",
            "python/Cargo.toml",
            // For the guest's target, like the guest's programs: their libraries are shared.
            "--target",
            crate::guest::GUEST_TARGET,
            "--out",
        ])
        .arg(&out)
        // The guest binaries' static flags must not reach a shared object.
        .env_remove("RUSTFLAGS"))
    .context("maturin build (python/)")?;
    let wheels = std::fs::read_dir(&out)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect::<Vec<_>>();
    match wheels.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!("maturin left {} wheels in {}", other.len(), out.display()),
    }
}

/// mypy --strict over the package and the tests, and stubtest of the native module's stub.
pub fn check(wheel: &Path) -> anyhow::Result<()> {
    let venv = tools_venv(&[MATURIN, MYPY])?;
    let python = venv.join("bin/python");
    let wheel = wheel.to_string_lossy();
    pip_install(&python, &["--force-reinstall", "--no-deps", &wheel])?;
    let root = crate::project_root();
    let mypy = |dir: &str, args: &[&str]| {
        run(Command::new(&python)
            .current_dir(root.join(dir))
            .args(["-m", "mypy", "--strict", "--no-incremental"])
            .args(args))
        .with_context(|| format!("mypy --strict {} in {dir}", args.join(" ")))
    };
    mypy("tests/python", &["-p", "fgds"])?;
    mypy("tests/python", &["."])?;
    // PyTorch is not installed here: the example's uses of it are unchecked.
    mypy("python/examples", &["--ignore-missing-imports", "."])?;
    run(Command::new(&python).args(["-m", "mypy.stubtest", "fgds._fgds"]))
        .context("stubtest fgds._fgds")
}

/// The Python that stages the guest's tree: argv `wheel out tests...`. It unpacks the wheel,
/// has a child interpreter import what the tests import (their `__main__` blocks do not run),
/// and stages every module of the standard library the child loaded, compiled, with the
/// extension modules and the shared libraries they and the interpreter need.
const STAGE: &str = r#"
import os, py_compile, shutil, subprocess, sys, sysconfig, zipfile
wheel, out, tests = sys.argv[1], sys.argv[2], sys.argv[3:]
site = os.path.join(out, "usr/lib/python3/dist-packages")
with zipfile.ZipFile(wheel) as z:
    z.extractall(site)
# What the guest's interpreter loads: a child that starts as it does (no -S) and imports the
# tests' modules and what they import at run time only (the thread pool, error paths).
LIST = """
import importlib, sys
sys.path[:0] = [sys.argv[1]] + [path.rsplit("/", 1)[0] for path in sys.argv[2:]]
for name in ["fgds", "concurrent.futures.thread", "encodings.latin_1", "encodings.ascii"]:
    importlib.import_module(name)
for path in sys.argv[2:]:
    importlib.import_module(path.rsplit("/", 1)[1].rsplit(".", 1)[0])
for module in list(sys.modules.values()):
    print(getattr(module, "__file__", None) or "")
"""
files = subprocess.run([sys.executable, "-E", "-c", LIST, site] + [os.path.abspath(t) for t in tests],
                       stdout=subprocess.PIPE, text=True, check=True).stdout.split()
stdlib = sysconfig.get_paths()["stdlib"]
os.makedirs(os.path.join(out, stdlib.lstrip("/"), "lib-dynload"), exist_ok=True)
shared = [sys.executable]
for f in map(os.path.abspath, files):
    if f.startswith(site + "/") and f.endswith(".so"):
        shared.append(f)
    if not f.startswith(stdlib + "/"):
        continue
    dest = os.path.join(out, f.lstrip("/"))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if f.endswith(".py"):
        py_compile.compile(f, cfile=dest + "c", dfile=f, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    elif f.endswith(".so"):
        shutil.copyfile(f, dest)
        shared.append(f)
# os.pyc is also the landmark by which the interpreter finds its prefix.
assert os.path.exists(os.path.join(out, stdlib.lstrip("/"), "os.pyc")), "os.pyc not staged"
libs = set()
for f in shared:
    for line in subprocess.run(["ldd", f], capture_output=True, text=True, check=True).stdout.splitlines():
        words = line.split()
        if "=>" in words and len(words) > 2 and words[2].startswith("/"):
            libs.add(words[2])
        elif words and words[0].startswith("/"):
            libs.add(words[0])
for lib in sorted(libs) + [sys.executable]:
    dest = os.path.join(out, lib.lstrip("/"))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copyfile(os.path.realpath(lib), dest)
"#;

/// Stages the guest's Python with `wheel` and the tests of `tests` (tests/python/*.py), once
/// per input; returns the staged root.
pub fn stage_guest(wheel: &Path, tests: &[PathBuf]) -> anyhow::Result<PathBuf> {
    host::ensure_packages(&["python3.11"])?;
    let mut key = DefaultHasher::new();
    STAGE.hash(&mut key);
    std::fs::read(wheel)?.hash(&mut key);
    let interpreter = std::fs::metadata(GUEST_PYTHON)
        .with_context(|| format!("no {GUEST_PYTHON}: the guest's Python is Debian's python3.11"))?;
    (interpreter.len(), interpreter.modified()?).hash(&mut key);
    for test in tests {
        test.hash(&mut key);
        std::fs::read(test)?.hash(&mut key);
    }
    let dir = crate::project_root()
        .join("target/guest-python")
        .join(format!("{:016x}", key.finish()));
    let root = dir.join("root");
    if dir.join("staged").exists() {
        return Ok(root);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&root)?;
    run(Command::new(GUEST_PYTHON)
        .args(["-E", "-c", STAGE])
        .arg(wheel)
        .arg(&root)
        .args(tests))
    .context("staging the guest's Python")?;
    std::fs::write(dir.join("staged"), "")?;
    Ok(root)
}

/// Adds the staged tree under `root` to the initramfs `tree`; returns its bytes.
pub fn add_to_tree(root: &Path, tree: &mut Tree) -> anyhow::Result<u64> {
    let mut bytes = 0;
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let rel = dir.strip_prefix(root)?.to_string_lossy().into_owned();
        if !rel.is_empty() {
            tree.entry(rel).or_insert(Entry::Dir);
        }
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                dirs.push(path);
                continue;
            }
            let rel = path.strip_prefix(root)?.to_string_lossy().into_owned();
            let executable = rel.starts_with("usr/bin/") || rel.contains(".so");
            bytes += entry.metadata()?.len();
            tree.insert(
                rel,
                Entry::File {
                    source: path,
                    mode: if executable { 0o755 } else { 0o644 },
                },
            );
        }
    }
    Ok(bytes)
}

/// The Python test programs' helper modules (tests/python/*.py), all staged with each.
pub fn test_modules() -> anyhow::Result<Vec<PathBuf>> {
    let dir = crate::project_root().join("tests/python");
    let mut files = std::fs::read_dir(&dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect::<Vec<_>>();
    files.sort();
    Ok(files)
}
