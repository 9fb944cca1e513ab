//! Making a kernel's kbuild tree usable on this host: which host tools do not run (Debian 7.x
//! ships them linked against a newer glibc) and their rebuild from the kernel source, the make
//! variables that gcc-12 and Debian 12's tools need, and a trial build of a module.

use std::{
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail, format_err};
use xshell::{Shell, cmd};

use super::{Kernel, config_value, host, remove_dir_all_if_exists, run_logged};

/// Variants of the multi-architecture host tools Debian ships (`modpost.real-lsb-64`,
/// `objtool.real-x86`) that serve x86-64 modules; the wrapper execs them.
const NATIVE_VARIANTS: &[&str] = &["lsb-64", "x86"];

/// The host tools every out-of-tree module build runs (objtool where CONFIG_OBJTOOL is set, as
/// in all Debian x86 kernels), relative to the kbuild root.
pub(super) const NEEDED_TOOLS: &[&str] = &[
    "scripts/basic/fixdep",
    "scripts/mod/modpost",
    "scripts/mod/modpost.real-lsb-64",
    "tools/objtool/objtool",
    "tools/objtool/objtool.real-x86",
];

/// ELF executables under `kbuild_root` that do not run on this host (a library or symbol
/// version is missing, as `ldd` tells), as paths relative to `kbuild_root`, sorted.
pub(super) fn broken_tools(kbuild_root: &Path) -> anyhow::Result<Vec<String>> {
    let mut elves = Vec::new();
    find_elf_executables(kbuild_root, &mut elves)?;
    let mut broken = Vec::new();
    for path in elves {
        if !runs_here(&path)? {
            let rel = path.strip_prefix(kbuild_root).unwrap_or(&path);
            broken.push(rel.display().to_string());
        }
    }
    broken.sort();
    Ok(broken)
}

/// Builds kbuild's host tools in the kernel source tree `src` (configured from `config`, built
/// in `build_dir`) and puts those in `broken` into `kbuild_root`. Returns the ones that are
/// still broken: tools a module build does not use (genksyms without MODVERSIONS,
/// resolve_btfids without module BTF, the other architectures' variants).
pub(super) fn rebuild_tools(
    src: &Path,
    config: &Path,
    build_dir: &Path,
    kbuild_root: &Path,
    broken: &[String],
    log: &Path,
) -> anyhow::Result<Vec<String>> {
    remove_dir_all_if_exists(build_dir)?;
    fs::create_dir_all(build_dir)
        .with_context(|| format!("cannot create {}", build_dir.display()))?;
    fs::copy(config, build_dir.join(".config"))
        .with_context(|| format!("cannot copy {}", config.display()))?;
    let sh = Shell::new()?;
    let jobs = format!(
        "-j{}",
        std::thread::available_parallelism().map_or(1, |it| it.get())
    );
    // The config is re-evaluated for this host's gcc; the host tools do not depend on what
    // changes (compiler capabilities, BTF).
    run_logged(cmd!(sh, "make -C {src} O={build_dir} olddefconfig"), log)?;
    let config_text = fs::read_to_string(build_dir.join(".config"))?;
    let mut targets = vec!["modules_prepare"];
    if config_value(&config_text, "GENKSYMS") == Some("y") {
        targets.push("scripts/genksyms/");
    }
    run_logged(
        cmd!(sh, "make -C {src} O={build_dir} {jobs} {targets...}"),
        log,
    )?;

    for rel in broken {
        let Some(built) = built_path(rel) else {
            continue;
        };
        let built = build_dir.join(built);
        if !built.exists() {
            continue;
        }
        let dest = kbuild_root.join(rel);
        let tmp = super::with_suffix(&dest, ".fgds-new");
        fs::copy(&built, &tmp).with_context(|| format!("cannot copy {}", built.display()))?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))?;
        fs::rename(&tmp, &dest).with_context(|| format!("cannot replace {}", dest.display()))?;
    }
    let mut still = Vec::new();
    for rel in broken {
        if !runs_here(&kbuild_root.join(rel))? {
            still.push(rel.clone());
        }
    }
    Ok(still)
}

/// The make variables building modules against `kdir` needs on this host.
pub(super) fn make_vars(kdir: &Path, config: &str) -> anyhow::Result<Vec<String>> {
    let mut vars = Vec::new();
    // Debian's headers name the compiler the kernel was built with (gcc-12 for 6.x on
    // bookworm, gcc-16 for 7.x); use the host's gcc when that one is not installed.
    let mut cc = "gcc".to_owned();
    let kernelvariables = fs::read_to_string(kdir.join(".kernelvariables")).unwrap_or_default();
    if let Some(kernel_cc) = kernelvariables_cc(&kernelvariables) {
        if host::find_program(&kernel_cc).is_some() {
            cc = kernel_cc;
        } else {
            vars.push("CC=gcc".to_owned());
        }
    }
    // gcc < 14 lacks -fmin-function-alignment; unset, kbuild falls back to -falign-functions.
    if config_value(config, "CC_HAS_MIN_FUNCTION_ALIGNMENT") == Some("y")
        && !cc_accepts(&cc, "-fmin-function-alignment=16")?
    {
        vars.push("CONFIG_CC_HAS_MIN_FUNCTION_ALIGNMENT=".to_owned());
    }
    // Module BTF needs a pahole at least as new as the kernel's and a working resolve_btfids;
    // without them the module is built without BTF, which loading does not need.
    if config_value(config, "DEBUG_INFO_BTF_MODULES") == Some("y")
        && !can_make_module_btf(kdir, config)?
    {
        vars.push("CONFIG_DEBUG_INFO_BTF_MODULES=".to_owned());
    }
    Ok(vars)
}

/// Builds a trivial module against `kernel` in `work_dir` and checks that its vermagic is the
/// kernel's (the release, and the whole string as a module of the kernel has it).
pub(super) fn check_build(kernel: &Kernel, work_dir: &Path, log: &Path) -> anyhow::Result<()> {
    remove_dir_all_if_exists(work_dir)?;
    fs::create_dir_all(work_dir)
        .with_context(|| format!("cannot create {}", work_dir.display()))?;
    fs::write(work_dir.join("fgds_check.c"), CHECK_MODULE)?;
    fs::write(work_dir.join("Kbuild"), "obj-m := fgds_check.o\n")?;
    let sh = Shell::new()?;
    let kdir = &kernel.kdir;
    let vars = &kernel.make_vars;
    run_logged(
        cmd!(sh, "make -C {kdir} M={work_dir} {vars...} modules"),
        log,
    )
    .context("building a trivial module against the kernel failed")?;
    let ko = work_dir.join("fgds_check.ko");
    let vermagic = modinfo_vermagic(&ko)?;
    if vermagic.split_whitespace().next() != Some(kernel.release.as_str()) {
        bail!(
            "a module built against {} has vermagic {vermagic:?}, not release {}",
            kdir.display(),
            kernel.release
        );
    }
    if let Some(shipped) = some_module(&kernel.modules_dir)? {
        let shipped_vermagic = modinfo_vermagic(&shipped)?;
        if shipped_vermagic != vermagic {
            bail!(
                "a module built against {} has vermagic {vermagic:?}, but the kernel's own {} has {shipped_vermagic:?}",
                kdir.display(),
                shipped.display()
            );
        }
    }
    super::append_log(log, &format!("trial module vermagic: {vermagic}\n"))?;
    remove_dir_all_if_exists(work_dir)
}

const CHECK_MODULE: &str = r#"// A trivial module: checks that modules build against this kernel tree.
#include <linux/init.h>
#include <linux/module.h>

static int __init fgds_check_init(void)
{
	return 0;
}

static void __exit fgds_check_exit(void)
{
}

module_init(fgds_check_init);
module_exit(fgds_check_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("fgds kernel tree check");
"#;

fn find_elf_executables(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let entry = entry?;
        let file_type = entry.file_type()?;
        let path = entry.path();
        if file_type.is_dir() {
            find_elf_executables(&path, out)?;
        } else if file_type.is_file()
            && entry.metadata()?.permissions().mode() & 0o111 != 0
            && is_elf(&path)
        {
            out.push(path);
        }
    }
    Ok(())
}

fn is_elf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    fs::File::open(path)
        .and_then(|mut it| it.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

/// Whether the dynamic loader finds every library and symbol version `path` needs (static
/// executables run anyway).
fn runs_here(path: &Path) -> anyhow::Result<bool> {
    let sh = Shell::new()?;
    let output = cmd!(sh, "ldd {path}")
        .quiet()
        .ignore_status()
        .output()
        .context("cannot run ldd")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(!text.contains("not found"))
}

/// Where the build of the kernel source puts the tool that replaces `rel`; `None` for the
/// variants of other architectures.
fn built_path(rel: &str) -> Option<String> {
    let (dir, file) = match rel.rsplit_once('/') {
        Some((dir, file)) => (format!("{dir}/"), file),
        None => (String::new(), rel),
    };
    match file.split_once(".real-") {
        Some((base, variant)) => NATIVE_VARIANTS
            .contains(&variant)
            .then(|| format!("{dir}{base}")),
        None => Some(rel.to_owned()),
    }
}

/// The compiler `.kernelvariables` sets `CC` to, with `$(CROSS_COMPILE)` expanded, e.g.
/// "x86_64-linux-gnu-gcc-16".
fn kernelvariables_cc(text: &str) -> Option<String> {
    let assignment = |line: &str, name: &str| -> Option<String> {
        let line = line.trim().strip_prefix("override ").unwrap_or(line.trim());
        let rest = line.strip_prefix(name)?.trim_start();
        let value = rest.strip_prefix(":=").or_else(|| rest.strip_prefix('='))?;
        Some(value.trim().to_owned())
    };
    let cross = text
        .lines()
        .find_map(|it| assignment(it, "CROSS_COMPILE"))
        .unwrap_or_default();
    let cc = text.lines().find_map(|it| assignment(it, "CC"))?;
    // "$(if $(DEBIAN_KERNEL_USE_CCACHE),$(CCACHE)) $(CROSS_COMPILE)gcc-16": the compiler is the
    // last word.
    let word = cc
        .split_whitespace()
        .last()?
        .replace("$(CROSS_COMPILE)", &cross);
    (!word.contains('$')).then_some(word)
}

fn cc_accepts(cc: &str, flag: &str) -> anyhow::Result<bool> {
    let sh = Shell::new()?;
    let output = cmd!(sh, "{cc} -Werror {flag} -x c -c -o /dev/null /dev/null")
        .quiet()
        .ignore_status()
        .output()
        .with_context(|| format!("cannot run {cc}"))?;
    Ok(output.status.success())
}

fn can_make_module_btf(kdir: &Path, config: &str) -> anyhow::Result<bool> {
    let Some(pahole) = host::find_program("pahole") else {
        return Ok(false);
    };
    let sh = Shell::new()?;
    let version = cmd!(sh, "{pahole} --version")
        .quiet()
        .ignore_status()
        .read()
        .unwrap_or_default();
    let have = pahole_version(&version);
    let need = config_value(config, "PAHOLE_VERSION").and_then(|it| it.parse::<u32>().ok());
    if !matches!((have, need), (Some(have), Some(need)) if have >= need) {
        return Ok(false);
    }
    let resolve_btfids = kdir.join("tools/bpf/resolve_btfids/resolve_btfids");
    Ok(!resolve_btfids.exists() || runs_here(&resolve_btfids)?)
}

/// "v1.24" -> 124, the form of CONFIG_PAHOLE_VERSION.
fn pahole_version(text: &str) -> Option<u32> {
    let text = text.trim().trim_start_matches('v');
    let (major, minor) = text.split_once('.')?;
    Some(major.parse::<u32>().ok()? * 100 + minor.parse::<u32>().ok()?)
}

fn modinfo_vermagic(ko: &Path) -> anyhow::Result<String> {
    let modinfo = host::find_program("modinfo")
        .ok_or_else(|| format_err!("modinfo not found; install kmod"))?;
    let sh = Shell::new()?;
    let vermagic = cmd!(sh, "{modinfo} -F vermagic {ko}")
        .quiet()
        .read()
        .with_context(|| format!("cannot read the vermagic of {}", ko.display()))?;
    Ok(vermagic.trim().to_owned())
}

/// Some module the kernel ships: the first entry of modules.dep.
fn some_module(modules_dir: &Path) -> anyhow::Result<Option<PathBuf>> {
    let text = fs::read_to_string(modules_dir.join("modules.dep")).unwrap_or_default();
    let first = text
        .lines()
        .find_map(|line| line.split_once(':').map(|(path, _)| path.trim()));
    Ok(first
        .map(|it| modules_dir.join(it))
        .filter(|it| it.exists()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_compiler_of_kernelvariables() {
        let text = "\
override ARCH = x86
override KERNELRELEASE = 7.3-amd64
CCACHE = ccache
CC = $(if $(DEBIAN_KERNEL_USE_CCACHE),$(CCACHE)) $(CROSS_COMPILE)gcc-16
DEB_BUILD_ARCH ?= $(shell dpkg --print-architecture)
override CROSS_COMPILE = x86_64-linux-gnu-
DEBIAN_KERNEL_NO_CC_VERSION_CHECK = y
";
        assert_eq!(
            kernelvariables_cc(text).as_deref(),
            Some("x86_64-linux-gnu-gcc-16")
        );
        assert_eq!(
            kernelvariables_cc("CC := gcc-12\n").as_deref(),
            Some("gcc-12")
        );
        assert_eq!(kernelvariables_cc("CCACHE = ccache\n"), None);
        assert_eq!(kernelvariables_cc("CC = $(MYCC)\n"), None);
    }

    #[test]
    fn maps_tools_to_their_build() {
        assert_eq!(
            built_path("scripts/basic/fixdep").as_deref(),
            Some("scripts/basic/fixdep")
        );
        assert_eq!(
            built_path("scripts/mod/modpost.real-lsb-64").as_deref(),
            Some("scripts/mod/modpost")
        );
        assert_eq!(
            built_path("tools/objtool/objtool.real-x86").as_deref(),
            Some("tools/objtool/objtool")
        );
        assert_eq!(built_path("scripts/mod/modpost.real-msb-32"), None);
        assert_eq!(built_path("tools/objtool/objtool.real-powerpc"), None);
    }

    #[test]
    fn parses_pahole_versions() {
        assert_eq!(pahole_version("v1.24\n"), Some(124));
        assert_eq!(pahole_version("v1.30"), Some(130));
        assert_eq!(pahole_version("garbage"), None);
    }
}
