//! `path:DIR`: a kernel tree the user configured and built. Its modules are installed into
//! `<cache>/kernels/path-<name>-<hash>/`, again whenever the tree was rebuilt since.

use std::{
    fs,
    path::{Path, PathBuf},
    time::SystemTime,
};

use anyhow::{Context, bail, format_err};
use xshell::{Shell, cmd};

use super::{
    Kernel, KernelSpec, append_log, config_value, host, kbuild, lock_file,
    remove_dir_all_if_exists, run_logged, with_suffix,
};

pub(super) fn prepare(dir: &Path, cache_dir: &Path) -> anyhow::Result<Kernel> {
    let dir = fs::canonicalize(dir)
        .with_context(|| format!("kernel tree {} does not exist", dir.display()))?;
    let vmlinuz = dir.join("arch/x86/boot/bzImage");
    let config = dir.join(".config");
    let release_file = dir.join("include/config/kernel.release");
    for path in [&config, &release_file, &vmlinuz] {
        if !path.exists() {
            bail!(
                "{} is not a built kernel tree: {} is missing; build it with `make -C {} bzImage modules`",
                dir.display(),
                path.display(),
                dir.display()
            );
        }
    }
    let release = fs::read_to_string(&release_file)
        .with_context(|| format!("cannot read {}", release_file.display()))?
        .trim()
        .to_owned();
    let config_text =
        fs::read_to_string(&config).with_context(|| format!("cannot read {}", config.display()))?;
    let spec = KernelSpec::Path(dir.clone());
    let out = cache_dir.join("kernels").join(spec.slug());
    fs::create_dir_all(cache_dir.join("kernels"))?;
    let _lock = lock_file(&with_suffix(&out, ".lock"))?;
    let log = with_suffix(&out, ".log");

    let modules_dir = if config_value(&config_text, "MODULES") == Some("y") {
        install_modules(&dir, &release, &out, &log)?
    } else {
        no_modules(&dir, &release, &out)?
    };
    let make_vars = kbuild::make_vars(&dir, &config_text)?;
    Ok(Kernel {
        spec: spec.to_string(),
        release,
        package_version: String::new(),
        vmlinuz,
        modules_dir,
        kdir: dir,
        make_vars,
        config,
    })
}

/// `make modules_install` of the built tree `dir` into `out` (a directory of its own: it is
/// emptied first), unless the tree was not rebuilt since the last time.
pub(super) fn install_modules(
    dir: &Path,
    release: &str,
    out: &Path,
    log: &Path,
) -> anyhow::Result<PathBuf> {
    let candidates = [
        out.join("lib/modules").join(release),
        out.join("usr/lib/modules").join(release),
    ];
    let installed = candidates.iter().find(|it| it.join("modules.dep").exists());
    if let Some(modules_dir) = installed {
        let installed_at = mtime(&modules_dir.join("modules.dep"));
        let built_at = [
            "modules.order",
            "Module.symvers",
            ".config",
            "include/config/kernel.release",
        ]
        .iter()
        .filter_map(|it| mtime(&dir.join(it)))
        .max();
        if installed_at.is_some() && installed_at >= built_at {
            return Ok(modules_dir.clone());
        }
    }
    remove_dir_all_if_exists(out)?;
    fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    append_log(
        log,
        &format!("installing the modules of {}\n", dir.display()),
    )?;
    host::ensure(host::UNPACK, log)?;
    eprintln!(
        "installing the modules of {} into {} ...",
        dir.display(),
        out.display()
    );
    let sh = Shell::new()?;
    let install_path = format!("INSTALL_MOD_PATH={}", out.display());
    run_logged(
        cmd!(sh, "make -C {dir} {install_path} modules_install"),
        log,
    )
    .with_context(|| {
        format!(
            "cannot install the modules of {}; is it built?",
            dir.display()
        )
    })?;
    let modules_dir = candidates
        .iter()
        .find(|it| it.exists())
        .cloned()
        .ok_or_else(|| {
            format_err!(
                "make modules_install put no lib/modules/{release} into {}",
                out.display()
            )
        })?;
    if !modules_dir.join("modules.dep").exists() {
        let depmod = host::find_program("depmod")
            .ok_or_else(|| format_err!("depmod not found; install kmod"))?;
        let base = modules_dir
            .parent()
            .and_then(Path::parent)
            .and_then(Path::parent)
            .unwrap_or(out);
        run_logged(cmd!(sh, "{depmod} -b {base} {release}"), log)?;
    }
    Ok(modules_dir)
}

/// A kernel without module support: an empty modules dir whose modules.builtin{,.modinfo}
/// list what the tree built in.
fn no_modules(dir: &Path, release: &str, out: &Path) -> anyhow::Result<PathBuf> {
    let modules_dir = out.join("lib/modules").join(release);
    fs::create_dir_all(&modules_dir)
        .with_context(|| format!("cannot create {}", modules_dir.display()))?;
    let builtin = fs::read_to_string(dir.join("modules.builtin")).unwrap_or_default();
    fs::write(modules_dir.join("modules.builtin"), builtin)?;
    let modinfo = fs::read(dir.join("modules.builtin.modinfo")).unwrap_or_default();
    fs::write(modules_dir.join("modules.builtin.modinfo"), modinfo)?;
    fs::write(modules_dir.join("modules.dep"), "")?;
    Ok(modules_dir)
}

fn mtime(path: &Path) -> Option<SystemTime> {
    fs::metadata(path).and_then(|it| it.modified()).ok()
}
