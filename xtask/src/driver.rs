//! driver/ (fgds and the rig's vgpu): building it against a kernel with Kbuild (always with
//! `W=1`), sparse, and checkpatch.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use fgds_vm_images::kernel::{Kernel, KernelSpec};

use crate::report::{Outcome, Verdict};

/// The rig's modules in load order: the exporter first, then the driver that imports from it.
pub const RIG_MODULES: &[&str] = &["vgpu", "fgds"];

/// The kernel source package checkpatch.pl comes from.
const CHECKPATCH_SOURCE: &str = "linux-source-6.12";

/// A finished build.
pub struct Build {
    /// The `.ko` files in [`RIG_MODULES`] order.
    pub kos: Vec<PathBuf>,
    /// fgds's generated fgds_config.h (the compile probes' results).
    pub config: PathBuf,
    /// Compiler diagnostics (warnings), one line each; none means a clean build.
    pub diagnostics: Vec<String>,
}

/// Builds the modules of driver/ for `kernel` with `W=1`, in a copy under `out_dir` (Kbuild
/// writes next to the sources; a copy per kernel keeps kernels apart). Diagnostics are printed
/// and returned; the whole log is `out_dir/build.log`.
pub fn build(kernel: &Kernel, out_dir: &Path) -> anyhow::Result<Build> {
    // A build of the same sources against the same kernel is the same build: CI boots
    // debian:7.3 in four configurations.
    let cache = build_cache(kernel)?;
    if let Some(build) = reuse(&cache)? {
        std::fs::write(
            out_dir.join("build.log"),
            format!(
                "the same sources were built against this kernel: {}\n",
                cache.display()
            ),
        )?;
        return Ok(build);
    }
    let build = build_fresh(kernel, out_dir)?;
    store(&build, &cache)?;
    Ok(build)
}

/// Where a build of the driver's current sources against `kernel` is kept:
/// `target/driver-builds/<release>-<fingerprint>`.
fn build_cache(kernel: &Kernel) -> anyhow::Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    kernel.release.hash(&mut hasher);
    kernel.kdir.hash(&mut hasher);
    kernel.make_vars.hash(&mut hasher);
    hash_sources(&crate::project_root().join("driver"), &mut hasher)?;
    Ok(crate::project_root()
        .join("target/driver-builds")
        .join(format!("{}-{:016x}", kernel.release, hasher.finish())))
}

/// Feeds the names and contents of the files [`copy_sources`] copies to `hasher`, in order.
fn hash_sources(dir: &Path, hasher: &mut impl std::hash::Hasher) -> anyhow::Result<()> {
    use std::hash::Hash;
    let mut entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .collect::<Result<Vec<_>, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            hash_sources(&path, hasher)?;
        } else if is_source(&entry.file_name().to_string_lossy()) {
            path.hash(hasher);
            std::fs::read(&path)?.hash(hasher);
        }
    }
    Ok(())
}

/// The kept build at `cache`, where there is one.
fn reuse(cache: &Path) -> anyhow::Result<Option<Build>> {
    if !cache.join("done").exists() {
        return Ok(None);
    }
    let diagnostics = std::fs::read_to_string(cache.join("diagnostics.txt"))?;
    Ok(Some(Build {
        kos: RIG_MODULES
            .iter()
            .map(|name| cache.join(format!("{name}.ko")))
            .collect(),
        config: cache.join("fgds_config.h"),
        diagnostics: diagnostics.lines().map(str::to_owned).collect(),
    }))
}

/// Keeps `build` at `cache` (written under a temporary name, then renamed: a concurrent run
/// of the same kernel sees all of it or nothing).
fn store(build: &Build, cache: &Path) -> anyhow::Result<()> {
    // One name per process and thread: runs of `cargo xtask ci` prepare in threads.
    let tmp = cache.with_extension(format!(
        "tmp{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&tmp)?;
    for (name, ko) in RIG_MODULES.iter().zip(&build.kos) {
        std::fs::copy(ko, tmp.join(format!("{name}.ko")))?;
    }
    std::fs::copy(&build.config, tmp.join("fgds_config.h"))?;
    std::fs::write(tmp.join("diagnostics.txt"), build.diagnostics.join("\n"))?;
    std::fs::write(tmp.join("done"), "")?;
    if std::fs::rename(&tmp, cache).is_err() {
        // Another run kept the same build first.
        std::fs::remove_dir_all(&tmp)?;
    }
    Ok(())
}

fn build_fresh(kernel: &Kernel, out_dir: &Path) -> anyhow::Result<Build> {
    let copy = fresh_copy(out_dir)?;
    let log_path = out_dir.join("build.log");
    let (ok, lines) = make(kernel, &copy, &["W=1"], &log_path)?;
    let (diagnostics, foreign) = split_diagnostics(&lines, &copy);
    for line in &diagnostics {
        eprintln!("  {line}");
    }
    if !foreign.is_empty() {
        eprintln!(
            "  the kernel's own headers or tools warn with this compiler (not the driver; see {}):",
            log_path.display()
        );
        for line in &foreign {
            eprintln!("    {line}");
        }
    }
    if !ok {
        bail!(
            "the driver does not build against {} (full log: {})",
            kernel.release,
            log_path.display()
        );
    }
    let kos = RIG_MODULES
        .iter()
        .map(|name| {
            let ko = copy.join(name).join(format!("{name}.ko"));
            if ko.exists() {
                Ok(ko)
            } else {
                bail!(
                    "the driver build made no {name}.ko (log: {})",
                    log_path.display()
                )
            }
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Build {
        kos,
        config: copy.join("fgds/fgds_config.h"),
        diagnostics,
    })
}

/// What each compile probe of driver/configure/probes/ must find, as `FGDS_HAVE_<NAME>` and
/// when the kernel has it, for the kernels the rig supports: a probe that fails there for a
/// reason of its own (a header it forgot) would silently pick the old API.
const PROBES: &[(&str, Has)] = &[
    ("VM_FLAGS_SET", Has::Since(6, 3)),
    ("CLASS_CREATE_NAME", Has::Since(6, 4)),
    ("GET_FILE_ACTIVE", Has::Since(6, 7)),
    ("IO_URING_CMD_H", Has::Since(6, 7)),
    ("FOLIO_ADD_FILE_RMAP_PTES", Has::Since(6, 9)),
    ("FOLIO_LARGE_MAPCOUNT", Has::Since(6, 9)),
    ("PCIM_REQUEST_REGION", Has::Since(6, 12)),
    ("MODULE_IMPORT_NS_STRING", Has::Since(6, 13)),
    ("VMF_INSERT_FOLIO_PMD", Has::Since(6, 15)),
    ("P2PDMA_PROVIDER_API", Has::Since(6, 19)),
    ("DMA_BUF_INVALIDATE_MAPPINGS", Has::Since(7, 0)),
    ("IO_URING_CMD_FROM_TW", Has::Since(7, 0)),
    ("IO_URING_CMD_DONE32", Has::Since(7, 0)),
    ("ATTACH_OPS_INVALIDATE_MAPPINGS", Has::Since(7, 0)),
    ("GET_DEV_PAGEMAP_PFN", Has::Since(7, 0)),
    ("P2PDMA_ADD_RESOURCE_FOLIOS", Has::Patch("p2pdma-folios")),
];

/// Which kernels have what a probe looks for.
#[derive(Clone, Copy)]
enum Has {
    /// Every kernel from this series on.
    Since(u32, u32),
    /// Only `build:` kernels with this change of kernel-patches/ applied.
    Patch(&'static str),
}

impl Has {
    fn holds(self, series: (u32, u32), patches: &[String]) -> bool {
        match self {
            Has::Since(major, minor) => series >= (major, minor),
            Has::Patch(name) => patches.iter().any(|p| p == name),
        }
    }

    fn describe(self) -> String {
        match self {
            Has::Since(major, minor) => format!("since {major}.{minor}"),
            Has::Patch(name) => format!("with the kernel change {name} only"),
        }
    }
}

/// The kernel series the rig supports, whose probe results [`PROBES`] knows.
const SUPPORTED_SERIES: &[(u32, u32)] = &[(6, 1), (6, 12), (7, 2), (7, 3)];

/// The verdict on the compile probes of a build, named `<label>::driver-probes`: every
/// `FGDS_HAVE_*` of fgds_config.h as [`PROBES`] expects for the kernel's series (skipped on a
/// series the rig does not support).
pub fn probes_outcome(label: &str, kernel: &Kernel, build: &Build) -> Outcome {
    let name = format!("{label}::driver-probes");
    let series = release_series(&kernel.release);
    let Some(series) = series.filter(|s| SUPPORTED_SERIES.contains(s)) else {
        return Outcome {
            name,
            verdict: Verdict::Skip(format!(
                "{}: not a series whose probe results are known",
                kernel.release
            )),
        };
    };
    let verdict = match std::fs::read_to_string(&build.config) {
        Err(err) => Verdict::Fail(format!("cannot read {}: {err}", build.config.display())),
        Ok(config) => {
            let patches = match kernel.spec.parse::<KernelSpec>() {
                Ok(KernelSpec::Build { patches, .. }) => patches,
                _ => Vec::new(),
            };
            let wrong = probe_mismatches(&config, series, &patches);
            if wrong.is_empty() {
                Verdict::Pass
            } else {
                Verdict::Fail(format!(
                    "{} on {}: {}",
                    build.config.display(),
                    kernel.release,
                    wrong.join("; ")
                ))
            }
        }
    };
    Outcome { name, verdict }
}

/// `(major, minor)` at the start of a release string such as "6.12.118+deb12-amd64".
fn release_series(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

/// The probes whose result in `config` (a generated fgds_config.h) is not what [`PROBES`]
/// says for `series` with the kernel change `patch`.
fn probe_mismatches(config: &str, series: (u32, u32), patches: &[String]) -> Vec<String> {
    PROBES
        .iter()
        .filter_map(|(name, has)| {
            let macro_name = format!("FGDS_HAVE_{name}");
            let found = config
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["#define", &macro_name, "1"]);
            let expected = has.holds(series, patches);
            (found != expected).then(|| {
                format!(
                    "{macro_name} is {}, expected {} ({})",
                    if found { "set" } else { "unset" },
                    if expected { "set" } else { "unset" },
                    has.describe()
                )
            })
        })
        .collect()
}

/// The verdict on a build's cleanliness, named `<label>::driver-build`.
pub fn build_outcome(label: &str, build: &Build) -> Outcome {
    let verdict = if build.diagnostics.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(format!(
            "the driver builds with diagnostics (W=1):\n{}",
            build.diagnostics.join("\n")
        ))
    };
    Outcome {
        name: format!("{label}::driver-build"),
        verdict,
    }
}

/// Runs sparse over the driver (`C=2`), against `kernel`; the verdict fails on any sparse
/// report about the driver's own files.
pub fn sparse(kernel: &Kernel, out_dir: &Path) -> anyhow::Result<Outcome> {
    crate::host::ensure_packages(&["sparse"])?;
    let copy = fresh_copy(out_dir)?;
    let log_path = out_dir.join("sparse.log");
    let (ok, diagnostics) = make(kernel, &copy, &["C=2", "CHECK=sparse"], &log_path)?;
    let ours = diagnostics
        .into_iter()
        .filter(|l| l.contains(&*copy.to_string_lossy()))
        .collect::<Vec<_>>();
    let verdict = match (ok, ours.is_empty()) {
        (true, true) => Verdict::Pass,
        (false, _) => Verdict::Fail(format!(
            "the sparse build failed (log: {})",
            log_path.display()
        )),
        (true, false) => Verdict::Fail(ours.join("\n")),
    };
    Ok(Outcome {
        name: "driver::sparse".to_owned(),
        verdict,
    })
}

/// Runs `checkpatch.pl --strict` (from Debian's linux-source package) on every C file and
/// header of driver/; one verdict per file.
pub fn checkpatch(cache: &Path) -> anyhow::Result<Vec<Outcome>> {
    let script = checkpatch_script(cache)?;
    let root = crate::project_root();
    let mut files = Vec::new();
    collect_sources(&root.join("driver"), &mut files)?;
    files.sort();
    let mut outcomes = Vec::new();
    for file in files {
        // The compat header exists to compare kernel versions (`LINUX_VERSION_CODE >= KERNEL_VERSION(..)`,
        // which checkpatch also takes for a constant on the left): those two checks are off there.
        let ignore = if file.ends_with("fgds_compat.h") {
            "LINUX_VERSION_CODE,CONSTANT_COMPARISON"
        } else {
            ""
        };
        let out = Command::new("perl")
            .arg(&script)
            .args([
                "--strict",
                "--no-tree",
                "--no-summary",
                "--terse",
                "--show-types",
            ])
            .args(["--ignore", ignore, "-f"])
            .arg(&file)
            .output()
            .context("cannot run perl for checkpatch.pl")?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .display()
            .to_string();
        let verdict = if out.status.success() && text.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail(text)
        };
        outcomes.push(Outcome {
            name: format!("driver::checkpatch::{rel}"),
            verdict,
        });
    }
    Ok(outcomes)
}

/// checkpatch.pl with its data files, extracted once from the linux-source package.
fn checkpatch_script(cache: &Path) -> anyhow::Result<PathBuf> {
    let dir = cache.join("checkpatch");
    let script = dir.join("checkpatch.pl");
    if script.exists() {
        return Ok(script);
    }
    crate::host::ensure_packages(&[CHECKPATCH_SOURCE, "perl"])?;
    let tarball = std::fs::read_dir("/usr/src")?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                n.to_string_lossy().starts_with(CHECKPATCH_SOURCE)
                    && n.to_string_lossy().contains(".tar")
            })
        })
        .with_context(|| format!("no {CHECKPATCH_SOURCE} tarball in /usr/src"))?;
    std::fs::create_dir_all(&dir)?;
    let prefix = tarball
        .file_name()
        .unwrap()
        .to_string_lossy()
        .split(".tar")
        .next()
        .unwrap_or_default()
        .to_owned();
    let members = ["checkpatch.pl", "spelling.txt", "const_structs.checkpatch"]
        .map(|f| format!("{prefix}/scripts/{f}"));
    let status = Command::new("tar")
        .arg("-xf")
        .arg(&tarball)
        .arg("-C")
        .arg(&dir)
        .arg("--strip-components=2")
        .args(&members)
        .status()?;
    if !status.success() || !script.exists() {
        bail!("cannot extract checkpatch.pl from {}", tarball.display());
    }
    Ok(script)
}

fn collect_sources(dir: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.is_dir() {
            collect_sources(&path, out)?;
        } else if (name.ends_with(".c") && !name.ends_with(".mod.c")) || name.ends_with(".h") {
            out.push(path);
        }
    }
    Ok(())
}

fn fresh_copy(out_dir: &Path) -> anyhow::Result<PathBuf> {
    let src = crate::project_root().join("driver");
    let copy = out_dir.join("driver");
    if copy.exists() {
        std::fs::remove_dir_all(&copy)
            .with_context(|| format!("cannot clean {}", copy.display()))?;
    }
    copy_sources(&src, &copy)?;
    Ok(copy)
}

/// Runs `make modules` in `copy` against `kernel` with `extra` variables; writes the whole
/// output to `log` and returns success and the diagnostic lines.
fn make(
    kernel: &Kernel,
    copy: &Path,
    extra: &[&str],
    log: &Path,
) -> anyhow::Result<(bool, Vec<String>)> {
    let output = Command::new("make")
        .arg("-C")
        .arg(&kernel.kdir)
        .arg(format!("M={}", copy.display()))
        .args(&kernel.make_vars)
        .args(extra)
        .arg(format!(
            "-j{}",
            std::thread::available_parallelism().map_or(2, |n| n.get())
        ))
        .arg("modules")
        .output()
        .context("cannot run make: is the make package installed?")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::write(log, &text)?;
    let diagnostics = text
        .lines()
        .filter(|l| is_diagnostic(l))
        .map(str::to_owned)
        .collect();
    Ok((output.status.success(), diagnostics))
}

/// Splits Kbuild's diagnostic lines into the driver's own (whole compiler messages whose
/// location is under `copy`) and the distinct first lines of everyone else's (the kernel's
/// headers warning under an older compiler, kbuild tools).
fn split_diagnostics(lines: &[String], copy: &Path) -> (Vec<String>, Vec<String>) {
    let copy = copy.to_string_lossy();
    let is_located = |l: &str| {
        [": warning:", ": error:", ": note:"]
            .iter()
            .any(|k| l.contains(k))
    };
    // Blocks: optional "In file included from" lines, a located line, then its excerpt.
    let mut blocks: Vec<Vec<&str>> = Vec::new();
    let mut open_include = false;
    for line in lines {
        let starts_include = line.starts_with("In file included from");
        let continues_include = line.trim_start().starts_with("from ");
        let new_block = ((starts_include || is_located(line)) && !open_include)
            || blocks.is_empty()
            || (!starts_include
                && !continues_include
                && !is_located(line)
                && !line.starts_with(' '));
        if new_block {
            blocks.push(Vec::new());
        }
        open_include = starts_include || (open_include && continues_include);
        blocks.last_mut().expect("a block was pushed").push(line);
    }
    let mut ours = Vec::new();
    let mut foreign = Vec::new();
    for block in blocks {
        match block.iter().find(|l| is_located(l)) {
            Some(located) if located.starts_with(&*copy) => {
                ours.extend(block.iter().map(|l| (*l).to_owned()))
            }
            Some(located) => foreign.push((*located).to_owned()),
            None => foreign.extend(block.iter().map(|l| (*l).to_owned())),
        }
    }
    foreign.sort();
    foreign.dedup();
    (ours, foreign)
}

/// Whether a line of Kbuild output is worth showing: anything but make's and Kbuild's own
/// progress lines (`make[1]: Entering ...`, `  CC [M]  ...`).
fn is_diagnostic(line: &str) -> bool {
    let quiet_step = line.starts_with("  ")
        && line.split_whitespace().next().is_some_and(|w| {
            w.chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
                && w.chars().any(|c| c.is_ascii_uppercase())
        });
    !(line.starts_with("make") || quiet_step || line.trim().is_empty())
}

/// Whether a file of driver/ is a source of the build (not one of its products).
fn is_source(name: &str) -> bool {
    name == "Kbuild"
        || name == "Makefile"
        || name == "conftest.sh"
        || name == "conftest.mk"
        || (name.ends_with(".c") && !name.ends_with(".mod.c"))
        || name.ends_with(".h")
}

fn copy_sources(src: &Path, dst: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src).with_context(|| format!("cannot read {}", src.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            copy_sources(&path, &dst.join(&name))?;
        } else if is_source(&name) {
            std::fs::copy(&path, dst.join(&name))
                .with_context(|| format!("cannot copy {}", path.display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_results_are_checked_against_the_series() {
        assert_eq!(release_series("6.12.118+deb12-amd64"), Some((6, 12)));
        assert_eq!(release_series("7.3-amd64"), Some((7, 3)));
        assert_eq!(release_series("6.1.0-57-amd64"), Some((6, 1)));
        let all = PROBES
            .iter()
            .map(|(n, _)| format!("#define FGDS_HAVE_{n} 1\n"))
            .collect::<String>();
        let folios = ["p2pdma-folios"].map(str::to_owned);
        assert!(probe_mismatches(&all, (7, 3), &folios).is_empty());
        let wrong = probe_mismatches(&all, (7, 3), &[]);
        assert_eq!(wrong.len(), 1, "{wrong:?}");
        assert!(wrong[0].contains("P2PDMA_ADD_RESOURCE_FOLIOS is set, expected unset (with the"));
        let wrong = probe_mismatches(&all, (6, 12), &[]);
        assert_eq!(wrong.len(), 9, "{wrong:?}");
        assert!(wrong[0].starts_with("FGDS_HAVE_MODULE_IMPORT_NS_STRING is set, expected unset"));
        let none = "/* FGDS_HAVE_VM_FLAGS_SET: no */\n";
        assert_eq!(probe_mismatches(none, (6, 1), &[]), Vec::<String>::new());
        assert_eq!(probe_mismatches(none, (7, 2), &[]).len(), PROBES.len() - 1);
    }

    #[test]
    fn shows_compiler_output_not_progress() {
        assert!(!is_diagnostic("make[1]: Entering directory '/x'"));
        assert!(!is_diagnostic("  CC [M]  /x/fgds/fgds.o"));
        assert!(!is_diagnostic("  MODPOST /x/Module.symvers"));
        assert!(!is_diagnostic("  CHECK   /x/fgds/gpu.c"));
        assert!(is_diagnostic(
            "/x/fgds/fgds.c:10:5: warning: unused variable 'x' [-Wunused-variable]"
        ));
        assert!(is_diagnostic("   10 |     int x;"));
    }

    #[test]
    fn header_warnings_are_not_the_drivers() {
        let lines = [
            "In file included from /k/include/linux/device.h:16,",
            "                 from /x/driver/fgds/gpu.c:3:",
            "/k/include/linux/fs.h:1302:9: warning: 'counted_by' attribute directive ignored [-Wattributes]",
            " 1302 |         unsigned char f_handle[] __counted_by(handle_bytes);",
            "/x/driver/fgds/gpu.c:10:5: warning: unused variable 'x' [-Wunused-variable]",
            "   10 |     int x;",
            "warning: pahole version differs from the one used to build the kernel",
        ]
        .map(str::to_owned);
        let (ours, foreign) = split_diagnostics(&lines, Path::new("/x/driver"));
        assert_eq!(ours, vec![lines[4].clone(), lines[5].clone()]);
        assert_eq!(foreign.len(), 2, "{foreign:?}");
    }
}
