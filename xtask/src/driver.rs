//! Building driver/ (fgds and the rig's vgpu) against a kernel with Kbuild.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use fgds_vm_images::kernel::Kernel;

/// The rig's modules in load order: the exporter first, then the driver that imports from it.
pub const RIG_MODULES: &[&str] = &["vgpu", "fgds"];

/// Builds the modules of driver/ for `kernel` in a copy under `out_dir` (Kbuild writes next to
/// the sources, and one copy per kernel keeps kernels apart). Compiler diagnostics are printed;
/// the whole log is in `out_dir/build.log`. Returns the `.ko` files in [`RIG_MODULES`] order.
pub fn build(kernel: &Kernel, out_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let src = crate::project_root().join("driver");
    let copy = out_dir.join("driver");
    if copy.exists() {
        std::fs::remove_dir_all(&copy)
            .with_context(|| format!("cannot clean {}", copy.display()))?;
    }
    copy_sources(&src, &copy)?;
    let log_path = out_dir.join("build.log");
    let output = Command::new("make")
        .arg("-C")
        .arg(&kernel.kdir)
        .arg(format!("M={}", copy.display()))
        .args(&kernel.make_vars)
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
    std::fs::write(&log_path, &text)?;
    for line in text.lines().filter(|l| is_diagnostic(l)) {
        eprintln!("  {line}");
    }
    if !output.status.success() {
        bail!(
            "the driver does not build against {} (full log: {})",
            kernel.release,
            log_path.display()
        );
    }
    RIG_MODULES
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
        .collect()
}

/// Whether a line of Kbuild output is worth showing: anything but make's and Kbuild's own
/// progress lines (`make[1]: Entering ...`, `  CC [M]  ...`).
fn is_diagnostic(line: &str) -> bool {
    let quiet_step = line.starts_with("  ")
        && line
            .split_whitespace()
            .next()
            .is_some_and(|w| w.chars().all(|c| c.is_ascii_uppercase()));
    !(line.starts_with("make") || quiet_step || line.trim().is_empty())
}

fn copy_sources(src: &Path, dst: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dst)?;
    for entry in std::fs::read_dir(src).with_context(|| format!("cannot read {}", src.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            copy_sources(&path, &dst.join(&name))?;
        } else if name == "Kbuild"
            || name == "Makefile"
            || name.ends_with(".c")
            || name.ends_with(".h")
        {
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
    fn shows_compiler_output_not_progress() {
        assert!(!is_diagnostic("make[1]: Entering directory '/x'"));
        assert!(!is_diagnostic("  CC [M]  /x/fgds/fgds.o"));
        assert!(!is_diagnostic("  MODPOST /x/Module.symvers"));
        assert!(is_diagnostic(
            "/x/fgds/fgds.c:10:5: warning: unused variable 'x' [-Wunused-variable]"
        ));
        assert!(is_diagnostic("   10 |     int x;"));
    }
}
