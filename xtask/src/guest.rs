//! The guest's side of a run: the static binaries (init and tests), the suite, the initramfs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use fgds_vm_images::initramfs::{self, Entry};
use fgds_vm_images::kernel::{self, Kernel};

/// The target the guest binaries are built for (static glibc: no musl target here), and
/// `cargo xtask` too (.cargo/config.toml), so that both share their libraries' builds.
pub const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";

/// Kernel modules the tests need, where the kernel has them as modules (built-ins are skipped).
const KERNEL_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_console",
    "nvme",
    "pvpanic_pci",
    "ext4",
];
/// Kernel modules loaded when the kernel was configured with them (`CONFIG_...` name first).
const OPTIONAL_KERNEL_MODULES: &[(&str, &str)] = &[
    ("CONFIG_UDMABUF", "udmabuf"),
    // Block devices fgds must refuse (tests fgds_gate).
    ("CONFIG_BLK_DEV_LOOP", "loop"),
    ("CONFIG_BLK_DEV_RAM", "brd"),
    ("CONFIG_ZRAM", "zram"),
    ("CONFIG_DM_CRYPT", "dm_crypt"),
    // md RAID0 over two drives (fgds_gate).
    ("CONFIG_MD_RAID0", "raid0"),
];

/// File systems besides ext4, loaded (where the kernel has them) only for runs with a program
/// that asks for them (`+fs` on its suite line): btrfs's modules alone cost a TCG boot about
/// three seconds (raid6_pq and xor time their algorithms). The init mounts those the kernel
/// has.
const FS_KERNEL_MODULES: &[(&str, &str)] =
    &[("CONFIG_XFS_FS", "xfs"), ("CONFIG_BTRFS_FS", "btrfs")];

/// NVMe over TCP, target and host, loaded (where the kernel has them as modules) only for runs
/// with a program that asks for them (`+field`): fgds_gate exports a namespace over the
/// loopback and connects to it.
const FABRICS_KERNEL_MODULES: &[(&str, &str)] = &[
    ("CONFIG_NVME_TARGET_TCP", "nvmet_tcp"),
    ("CONFIG_NVME_TCP", "nvme_tcp"),
];

/// One test program of a run, in the order it runs.
pub struct SuiteEntry {
    pub name: String,
    pub path: PathBuf,
    pub timeout_secs: u64,
    /// For a C program of tests/c/ (`NAME.c` in the suite list): its source, built static.
    pub c_source: Option<PathBuf>,
    /// A Python program of tests/python/ (`NAME.py` in the suite list), run by the guest's
    /// Python (xtask/src/python.rs) through its `#!` line.
    pub python: bool,
    /// The program runs fio (`+fio` on its suite line): the guest gets fio and the `fgds`
    /// engine (xtask/src/fio.rs).
    pub fio: bool,
    /// The program uses xfs and btrfs (`+fs`): the guest loads their modules.
    pub fs: bool,
    /// The program uses the field's storage (`+field`): the guest loads the kernel's NVMe
    /// target and host over TCP, and the machine has a third drive outside the GPU's switch.
    pub field: bool,
    /// About how long it runs on a stock kernel, in seconds (`~N` on its suite line; 0, under
    /// a second, where none is given): how `test-vm` shares the suite out between its machines.
    pub typical_secs: u64,
}

impl SuiteEntry {
    /// A Rust program of tests/ (built by [`build_binaries`]).
    pub fn is_rust(&self) -> bool {
        self.c_source.is_none() && !self.python
    }
}

/// How the guest's Rust programs are built.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Build {
    /// The `rig` profile (unoptimised but for the data pattern): the rig's test runs, quicker
    /// to build.
    #[default]
    Tests,
    /// `release`, as users get the CLI: for what measures (`cargo xtask bench`).
    Release,
}

impl Build {
    fn profile(self) -> &'static str {
        match self {
            Build::Tests => "rig",
            Build::Release => "release",
        }
    }
}

/// Builds the init, the `fgds` CLI and the named test programs of `tests/`, static, into
/// [`bin_dir`].
pub fn build_binaries(build: Build, test_bins: &[&str]) -> anyhow::Result<()> {
    let root = crate::project_root();
    let mut args = [
        "build",
        "--quiet",
        "--profile",
        build.profile(),
        "--target",
        GUEST_TARGET,
    ]
    .map(str::to_owned)
    .to_vec();
    // With --bin, cargo builds only the named binaries of the selected packages.
    let own = [
        "-p",
        "fgds-init",
        "-p",
        "fgds",
        "-p",
        "fgds-tests",
        "--bin",
        "fgds-init",
        "--bin",
        "fgds",
    ];
    args.extend(own.map(str::to_owned));
    for bin in test_bins {
        args.extend(["--bin".to_owned(), (*bin).to_owned()]);
    }
    // Static binaries, linked so by a wrapper of rustc and not by RUSTFLAGS: the libraries
    // are then the very ones `cargo xtask` (the alias builds it for GUEST_TARGET, `rig`) and
    // the wheel were built with, reused rather than built again (29 s of builds on two cores
    // from nothing, then 11).
    let mut cargo = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()));
    if let Some(outer) = std::env::var_os("RUSTC_WRAPPER").filter(|w| !w.is_empty()) {
        cargo.env("FGDS_RUSTC_WRAPPER", outer);
    }
    let out = cargo
        .current_dir(&root)
        .args(&args)
        .env("RUSTC_WRAPPER", root.join("xtask/rustc-static-bins"))
        .env_remove("RUSTFLAGS")
        .status()
        .context("cannot run cargo")?;
    if !out.success() {
        bail!("building the guest binaries failed (see cargo's output above)");
    }
    let dir = bin_dir(build);
    ["fgds-init", "fgds"]
        .iter()
        .chain(test_bins)
        .try_for_each(|bin| ensure_static(&dir.join(bin)))
}

/// Fails for an ELF program that asks for an interpreter (a dynamic loader): the guest has no
/// shared libraries, and the kernel's exec of such a program fails with nothing to say why.
fn ensure_static(path: &Path) -> anyhow::Result<()> {
    let elf = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    if names_interpreter(&elf).with_context(|| path.display().to_string())? {
        bail!(
            "{} is linked dynamically (it names a dynamic loader), and the guest has no shared \
             libraries: xtask/rustc-static-bins links the guest's programs static, and this one \
             was built without it (by hand, or rustc given other arguments than it looks for); \
             remove it and run again",
            path.display()
        );
    }
    Ok(())
}

/// Whether a 64-bit little-endian ELF program has a `PT_INTERP` program header.
fn names_interpreter(elf: &[u8]) -> anyhow::Result<bool> {
    const PT_INTERP: u32 = 3;
    let bytes = |at: u64, n: usize| {
        let at = usize::try_from(at).ok()?;
        elf.get(at..at.checked_add(n)?)
    };
    let u16_at = |at| bytes(at, 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |at| bytes(at, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |at| {
        bytes(at, 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    if !elf.starts_with(b"\x7fELF\x02\x01") {
        bail!("not a 64-bit little-endian ELF file");
    }
    // e_phoff (0x20): where the program headers start; e_phentsize (0x36): the size of each;
    // e_phnum (0x38): how many. Each one's type comes first.
    let (Some(phoff), Some(size), Some(count)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        bail!("the ELF header is cut short");
    };
    for i in 0..u64::from(count) {
        let kind = u32_at(phoff + i * u64::from(size))
            .with_context(|| format!("program header {i} lies past the file's end"))?;
        if kind == PT_INTERP {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Builds the suite's C programs (tests/c/), static, with every warning an error; they see
/// tests/c/ (the RFC's own header) and driver/include/uapi/ (the rig's vgpu header).
pub fn build_c_programs(suite: &[SuiteEntry]) -> anyhow::Result<()> {
    let root = crate::project_root();
    std::fs::create_dir_all(c_bin_dir())?;
    for entry in suite {
        let Some(source) = &entry.c_source else {
            continue;
        };
        let out = Command::new("gcc")
            .args(["-static", "-O2", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(root.join("tests/c"))
            .arg("-I")
            .arg(root.join("driver/include/uapi"))
            .arg(source)
            .arg("-o")
            .arg(&entry.path)
            .output()
            .context("cannot run gcc")?;
        if !out.status.success() {
            bail!(
                "{} does not build:\n{}",
                source.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(())
}

fn c_bin_dir() -> PathBuf {
    crate::project_root().join("target/guest-c")
}

/// Where [`build_binaries`] puts the guest binaries.
pub fn bin_dir(build: Build) -> PathBuf {
    crate::project_root()
        .join("target")
        .join(GUEST_TARGET)
        .join(build.profile())
}

/// The default suite, from tests/suite.txt (`name timeout-seconds [+fio] [+fs] [+field]` per
/// line, in run order).
pub fn default_suite(bin_dir: &Path) -> anyhow::Result<Vec<SuiteEntry>> {
    let path = crate::project_root().join("tests/suite.txt");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let mut suite = Vec::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or_default();
        let timeout_secs = words
            .next()
            .unwrap_or("120")
            .parse()
            .with_context(|| format!("bad timeout in {}: {line:?}", path.display()))?;
        let (mut fio, mut fs, mut field, mut typical_secs) = (false, false, false, 0);
        for word in words {
            match word {
                "+fio" => fio = true,
                "+fs" => fs = true,
                "+field" => field = true,
                _ if word.starts_with('~') => {
                    typical_secs = word[1..].parse().with_context(|| {
                        format!("{}: {line:?}: bad typical seconds {word:?}", path.display())
                    })?;
                }
                _ => bail!(
                    "{}: {line:?}: unknown {word:?} (+fio, +fs, +field and ~SECONDS are known)",
                    path.display()
                ),
            }
        }
        let entry = if let Some(stem) = name.strip_suffix(".c") {
            SuiteEntry {
                name: stem.to_owned(),
                path: c_bin_dir().join(stem),
                timeout_secs,
                c_source: Some(crate::project_root().join("tests/c").join(name)),
                python: false,
                fio,
                fs,
                field,
                typical_secs,
            }
        } else if let Some(stem) = name.strip_suffix(".py") {
            SuiteEntry {
                name: stem.to_owned(),
                path: crate::project_root().join("tests/python").join(name),
                timeout_secs,
                c_source: None,
                python: true,
                fio,
                fs,
                field,
                typical_secs,
            }
        } else {
            SuiteEntry {
                name: name.to_owned(),
                path: bin_dir.join(name),
                timeout_secs,
                c_source: None,
                python: false,
                fio,
                fs,
                field,
                typical_secs,
            }
        };
        suite.push(entry);
    }
    Ok(suite)
}

/// A program given with `--exec`: it runs after the suite.
pub fn exec_entry(path: &Path, timeout_secs: u64) -> anyhow::Result<SuiteEntry> {
    if !path.is_file() {
        bail!("--exec {}: no such file", path.display());
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Ok(SuiteEntry {
        c_source: None,
        python: false,
        fio: false,
        fs: false,
        field: false,
        typical_secs: 1,
        name: format!("exec:{name}"),
        path: path.to_path_buf(),
        timeout_secs,
    })
}

/// The rig's modules with their parameters.
pub struct RigModule {
    pub ko: PathBuf,
    pub params: String,
}

/// Kernel modules of vfio-pci's BAR dma-bufs with a type1 container (`--exporter vfio`), with
/// their parameters: vfio_iommu_type1 is no dependency of the others (vfio asks for it by
/// name), so it is named. The rig's vIOMMU has no interrupt remapping (`intremap=off`), so
/// type1 refuses every group (EPERM) unless told that unremapped interrupts are acceptable:
/// the GPU (ivshmem-plain) has no MSI, and no test gives vfio an interrupt.
pub const VFIO_MODULES: &[(&str, &str)] = &[
    ("vfio", ""),
    ("vfio_iommu_type1", "allow_unsafe_interrupts=1"),
    ("vfio_pci", ""),
];

/// [`VFIO_MODULES`]'s parameters for a kernel that has vfio built in, on its command line.
pub const VFIO_BUILTIN_PARAMS: &str = "vfio_iommu_type1.allow_unsafe_interrupts=1";

/// How the guest is set up before its tests run, besides the suite.
pub struct GuestSetup<'a> {
    /// The rig's own modules, loaded last.
    pub rig_modules: &'a [RigModule],
    /// Kernel modules beyond the rig's usual ones ([`KERNEL_MODULES`]), where the kernel has
    /// them as modules, with their parameters.
    pub kernel_modules: &'a [(&'a str, &'a str)],
    /// (device, driver): after the kernel modules and before the rig's, the init binds the PCI
    /// device (`@ivshmem@`: the GPU) to the driver with `driver_override`.
    pub binds: &'a [(&'a str, &'a str)],
    /// Set for every test program.
    pub env: &'a [(&'a str, &'a str)],
}

/// Writes the initramfs for a run to `out` and returns the plan it holds. `python` is the
/// guest's Python staged for the suite's Python programs ([`crate::python::stage_guest`]),
/// with their helper modules; `staged` are more staged trees (fio's, [`crate::fio`]).
#[allow(clippy::too_many_arguments)]
pub fn make_initramfs(
    kernel: &Kernel,
    cache_dir: &Path,
    bin_dir: &Path,
    setup: &GuestSetup,
    suite: &[SuiteEntry],
    python: Option<(&Path, &[PathBuf])>,
    staged: &[PathBuf],
    out: &Path,
) -> anyhow::Result<String> {
    let mut tree = initramfs::base_tree();
    for root in staged {
        crate::python::add_to_tree(root, &mut tree)?;
    }
    if let Some((root, modules)) = python {
        crate::python::add_to_tree(root, &mut tree)?;
        for module in modules {
            tree.insert(
                format!("tests/{}", file_name(module)),
                Entry::File {
                    source: module.clone(),
                    mode: 0o644,
                },
            );
        }
    }
    let mut plan = String::new();
    for (name, value) in setup.env {
        plan.push_str(&format!("env {name} {value}\n"));
    }
    tree.insert(
        "init".to_owned(),
        Entry::File {
            source: bin_dir.join("fgds-init"),
            mode: 0o755,
        },
    );
    tree.insert(
        "bin/fgds".to_owned(),
        Entry::File {
            source: bin_dir.join("fgds"),
            mode: 0o755,
        },
    );

    let mut names = KERNEL_MODULES.to_vec();
    names.extend(setup.kernel_modules.iter().map(|(name, _)| *name));
    let fs = if suite.iter().any(|e| e.fs) {
        FS_KERNEL_MODULES
    } else {
        &[]
    };
    let fabrics = if suite.iter().any(|e| e.field) {
        FABRICS_KERNEL_MODULES
    } else {
        &[]
    };
    for (config, name) in OPTIONAL_KERNEL_MODULES.iter().chain(fs).chain(fabrics) {
        if kernel::has_config(kernel, config)? {
            names.push(name);
        }
    }
    for ko in kernel::module_load_order(kernel, &names, cache_dir)? {
        let file = file_name(&ko);
        let guest = format!("modules/kernel/{file}");
        // modules.dep names files with `-` or `_` as the source had them; names may use either.
        let stem = file.split('.').next().unwrap_or_default().replace('-', "_");
        let params = setup
            .kernel_modules
            .iter()
            .find(|(name, _)| name.replace('-', "_") == stem)
            .map_or("", |(_, params)| *params);
        plan.push_str(format!("module kernel /{guest} {params}").trim_end());
        plan.push('\n');
        tree.insert(
            guest,
            Entry::File {
                source: ko,
                mode: 0o644,
            },
        );
    }
    for (device, driver) in setup.binds {
        plan.push_str(&format!("bind {device} {driver}\n"));
    }
    for module in setup.rig_modules {
        let guest = format!("modules/rig/{}", file_name(&module.ko));
        plan.push_str(format!("module rig /{guest} {}\n", module.params).trim_end());
        plan.push('\n');
        tree.insert(
            guest,
            Entry::File {
                source: module.ko.clone(),
                mode: 0o644,
            },
        );
    }
    for entry in suite {
        let dir = if entry.name.starts_with("exec:") {
            "exec"
        } else {
            "tests"
        };
        let guest = format!("{dir}/{}", file_name(&entry.path));
        plan.push_str(&format!(
            "test {} /{guest} {}\n",
            entry.name, entry.timeout_secs
        ));
        tree.insert(
            guest,
            Entry::File {
                source: entry.path.clone(),
                mode: 0o755,
            },
        );
    }
    tree.insert(
        "etc/fgds/plan".to_owned(),
        Entry::Data {
            bytes: plan.clone().into_bytes(),
            mode: 0o644,
        },
    );
    initramfs::write(&tree, out)?;
    Ok(plan)
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An ELF header with one program header of type `kind` after it.
    fn elf_with(kind: u32) -> Vec<u8> {
        let mut elf = vec![0u8; 64 + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        elf[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        elf[64..68].copy_from_slice(&kind.to_le_bytes());
        elf
    }

    #[test]
    fn names_interpreter_reads_the_program_headers() {
        assert!(names_interpreter(&elf_with(3)).unwrap());
        assert!(!names_interpreter(&elf_with(1)).unwrap());
        // This test program is linked against the host's shared glibc.
        let own = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(names_interpreter(&own).unwrap());
        assert!(names_interpreter(b"#!/bin/sh\n").is_err());
        assert!(names_interpreter(&elf_with(3)[..66]).is_err());
    }
}
