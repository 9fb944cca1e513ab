//! Debian's `linux-source-X.Y` packages: which version a series means, and its tree unpacked
//! once into `<cache>/src/<package>_<version>/`.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail, format_err};
use xshell::{Shell, cmd};

use super::{apt, debian, lock_file, remove_dir_all_if_exists, run_logged, sanitize, with_suffix};

/// The `linux-source-<series>` package and version to build: the newest in the host's suites
/// (bookworm, -updates, -security, -backports) if they have one, else the newest anywhere
/// (7.2 from sid).
pub(super) fn pick(apt: &apt::Apt, series: &str) -> anyhow::Result<(String, String)> {
    let package = format!("linux-source-{series}");
    let mut candidates = apt.versions(std::slice::from_ref(&package))?;
    if candidates.is_empty() && apt.refresh_after_miss()? {
        candidates = apt.versions(std::slice::from_ref(&package))?;
    }
    let Some(best) = debian::pick_newest(&candidates, apt.codename()) else {
        bail!(
            "the archive has no {package} (the private package lists know no version of it); \
             check the series, e.g. build:6.12 or build:7.2"
        );
    };
    Ok((package, best.version.clone()))
}

/// Unpacks `package` (a linux-source-X.Y) once into `<cache>/src/<package>_<version>/` and
/// returns the kernel source tree in it.
pub(super) fn unpack(
    apt: &apt::Apt,
    cache_dir: &Path,
    package: &str,
    version: &str,
) -> anyhow::Result<PathBuf> {
    let dir = cache_dir
        .join("src")
        .join(format!("{package}_{}", sanitize(version)));
    fs::create_dir_all(dir.parent().unwrap_or(cache_dir))?;
    let _lock = lock_file(&with_suffix(&dir, ".lock"))?;
    let marker = dir.join(".fgds-unpacked");
    if let Ok(tree) = fs::read_to_string(&marker) {
        let tree = dir.join(tree.trim());
        if tree.join("Makefile").exists() {
            return Ok(tree);
        }
    }
    remove_dir_all_if_exists(&dir)?;
    let deb_root = dir.join("deb");
    fs::create_dir_all(&deb_root)
        .with_context(|| format!("cannot create {}", deb_root.display()))?;
    let log = dir.join("unpack.log");
    let deb = apt.download(package, version)?;
    eprintln!("unpacking {package} {version} into {} ...", dir.display());
    let sh = Shell::new()?;
    run_logged(cmd!(sh, "dpkg -x {deb} {deb_root}"), &log)?;
    let usr_src = deb_root.join("usr/src");
    let tarball = fs::read_dir(&usr_src)
        .with_context(|| format!("cannot read {}", usr_src.display()))?
        .filter_map(|it| Some(it.ok()?.path()))
        .find(|it| {
            it.file_name()
                .is_some_and(|name| name.to_string_lossy().contains(".tar"))
        })
        .ok_or_else(|| format_err!("{package} has no source tarball in /usr/src"))?;
    run_logged(cmd!(sh, "tar -xf {tarball} -C {dir}"), &log)?;
    remove_dir_all_if_exists(&deb_root)?;
    let _ = fs::remove_file(&deb);
    let tree = fs::read_dir(&dir)?
        .filter_map(|it| Some(it.ok()?.path()))
        .find(|it| it.join("Makefile").exists())
        .ok_or_else(|| format_err!("the tarball of {package} holds no kernel tree"))?;
    let name = tree
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    fs::write(&marker, name).with_context(|| format!("cannot write {}", marker.display()))?;
    Ok(tree)
}
