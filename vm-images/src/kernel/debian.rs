//! `debian:X.Y`: Debian's prebuilt `-amd64` kernel of a series, fetched by package name,
//! unpacked into `<cache>/kernels/<release>` and made ready for out-of-tree module builds.
//!
//! Which build: for a series the host's release (bookworm) has, its newest build there
//! (bookworm, -updates, -security, -backports), whose kbuild tools run on this host's glibc and
//! whose headers expect this host's gcc-12; otherwise the newest build the archive offers (7.2
//! from sid, 7.3 from experimental until it reaches sid).
//!
//! The packages: `linux-headers-<abi>-amd64` (its `-common` and `linux-kbuild-*` come through its
//! dependencies) and `linux-image-<abi>-amd64` (7.x splits it into `linux-binary-*`,
//! `linux-modules-*` and `linux-base-*`, again through dependencies).

use std::{
    fs,
    os::unix::fs as unix_fs,
    path::{Component, Path, PathBuf},
};

use anyhow::{Context, bail, format_err};
use xshell::{Shell, cmd};

use super::{
    Kernel, append_log, apt, debver, host, kbuild, lock_file, remove_dir_all_if_exists, run_logged,
    sanitize, source, with_suffix,
};

const FLAVOUR: &str = "amd64";

/// Marks a completely prepared kernel dir; holds what `load_prepared` needs.
const MARKER: &str = ".fgds-prepared";

/// Package name prefixes of the packages a kernel consists of. `linux-base` itself (Debian's
/// kernel maintainer scripts) and compilers are not part of it.
const KERNEL_PACKAGE_PREFIXES: &[&str] = &[
    "linux-image-",
    "linux-binary-",
    "linux-modules-",
    "linux-base-",
    "linux-headers-",
    "linux-kbuild-",
];

pub(super) fn prepare(series: &str, cache_dir: &Path) -> anyhow::Result<Kernel> {
    let apt = apt::open(cache_dir)?;
    let pick = resolve(&apt, series)?;
    let kernels = cache_dir.join("kernels");
    fs::create_dir_all(&kernels).with_context(|| format!("cannot create {}", kernels.display()))?;
    let root = kernels.join(&pick.release);
    let _lock = lock_file(&with_suffix(&root, ".lock"))?;
    if let Some(kernel) = load_prepared(&root, series, &pick)? {
        return Ok(kernel);
    }
    let log = with_suffix(&root, ".log");
    fs::write(
        &log,
        format!(
            "preparing debian:{series}: {} {}\n",
            pick.release, pick.version
        ),
    )
    .with_context(|| format!("cannot write {}", log.display()))?;
    let res = prepare_fresh(&apt, cache_dir, series, &pick, &root, &log);
    res.with_context(|| {
        format!(
            "cannot prepare {} {} (log: {})",
            pick.release,
            pick.version,
            log.display()
        )
    })
}

/// The build chosen for a series.
#[derive(Debug)]
struct Pick {
    /// `uname -r`, e.g. "6.1.0-57-amd64".
    release: String,
    /// The version of the kernel's packages, e.g. "6.1.192-3".
    version: String,
    /// The headers package, whose dependencies lead to the others.
    headers: apt::Candidate,
    /// The ABI name, e.g. "6.12.117+deb12".
    abi: String,
}

fn resolve(apt: &apt::Apt, series: &str) -> anyhow::Result<Pick> {
    let mut found = find_headers(apt, series)?;
    if found.is_none() && apt.refresh_after_miss()? {
        found = find_headers(apt, series)?;
    }
    let Some((headers, abi)) = found else {
        let names = apt.package_names("linux-headers-")?;
        let mut series_offered: Vec<String> = names
            .iter()
            .filter_map(|it| {
                it.strip_prefix("linux-headers-")?
                    .strip_suffix(&format!("-{FLAVOUR}"))
            })
            .filter_map(|abi| {
                let mut parts = abi.split(['.', '-', '+', '~']);
                Some(format!("{}.{}", parts.next()?, parts.next()?))
            })
            .filter(|it| super::is_series(it))
            .collect();
        series_offered.sort_by(|a, b| debver::compare(a, b));
        series_offered.dedup();
        bail!(
            "the archive has no -{FLAVOUR} kernel of series {series} (no linux-headers-{series}*-{FLAVOUR}); \
             series it offers: {}",
            series_offered.join(", ")
        );
    };
    Ok(Pick {
        release: format!("{abi}-{FLAVOUR}"),
        version: headers.version.clone(),
        headers,
        abi,
    })
}

/// The newest real (not meta) headers package of the series, preferring the host's suites;
/// with its ABI name (e.g. "6.12.117+deb12").
fn find_headers(apt: &apt::Apt, series: &str) -> anyhow::Result<Option<(apt::Candidate, String)>> {
    let names: Vec<String> = apt
        .package_names("linux-headers-")?
        .into_iter()
        .filter(|it| headers_abi(it, series).is_some())
        .collect();
    let mut candidates = apt.versions(&names)?;
    while let Some(best) = pick_newest(&candidates, apt.codename()).cloned() {
        let fields = apt.show(&best.package, &best.version)?.unwrap_or_default();
        if is_real_headers(&fields) {
            let abi = headers_abi(&best.package, series)
                .unwrap_or_default()
                .to_owned();
            return Ok(Some((best, abi)));
        }
        // A meta package such as linux-headers-6.12-amd64: look further.
        candidates.retain(|it| *it != best);
    }
    Ok(None)
}

/// The ABI part of a plain-flavour headers package of `series`: "6.1.0-57" for
/// "linux-headers-6.1.0-57-amd64", "7.3" for "linux-headers-7.3-amd64". `None` for other
/// series ("6.12" is not "6.1"), flavours (cloud, rt) and the -common packages.
fn headers_abi<'a>(package: &'a str, series: &str) -> Option<&'a str> {
    let abi = package
        .strip_prefix("linux-headers-")?
        .strip_suffix(&format!("-{FLAVOUR}"))?;
    let rest = abi.strip_prefix(series)?;
    if !(rest.is_empty() || rest.starts_with(['.', '+', '-', '~'])) {
        return None;
    }
    // "6.1.0-57", "6.12.117+deb12": after the version, only numbers or rcN; never a flavour.
    let plain = abi.split('-').skip(1).all(|part| {
        let part = part.strip_prefix("rc").unwrap_or(part);
        !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit())
    });
    plain.then_some(abi)
}

/// The newest candidate, among those of the host's suites (`codename`, `codename-*`) if there
/// are any.
pub(super) fn pick_newest<'a>(
    candidates: &'a [apt::Candidate],
    codename: &str,
) -> Option<&'a apt::Candidate> {
    let is_host_suite =
        |it: &apt::Candidate| it.suite == codename || it.suite.starts_with(&format!("{codename}-"));
    let host_only = candidates.iter().any(is_host_suite);
    candidates
        .iter()
        .filter(|it| !host_only || is_host_suite(it))
        .max_by(|a, b| {
            debver::compare(&a.version, &b.version).then_with(|| b.package.cmp(&a.package))
        })
}

fn is_real_headers(fields: &apt::Fields) -> bool {
    dependency_groups(fields)
        .iter()
        .flatten()
        .any(|dep| dep.name.starts_with("linux-headers-") && dep.name.ends_with("-common"))
}

/// One alternative of a dependency: `name (op version)`.
#[derive(Debug, PartialEq, Eq)]
struct Dependency {
    name: String,
    relation: Option<(String, String)>,
}

/// The `Depends` of a package record, as groups of alternatives.
fn dependency_groups(fields: &apt::Fields) -> Vec<Vec<Dependency>> {
    let Some((_, depends)) = fields.iter().find(|(key, _)| key == "Depends") else {
        return Vec::new();
    };
    depends
        .split(',')
        .map(|group| {
            group
                .split('|')
                .filter_map(|alt| {
                    let alt = alt.trim();
                    let (name, relation) = match alt.split_once('(') {
                        Some((name, rel)) => {
                            let rel = rel.trim_end_matches(')').trim();
                            let (op, version) = rel.split_once(' ')?;
                            (
                                name.trim(),
                                Some((op.trim().to_owned(), version.trim().to_owned())),
                            )
                        }
                        None => (alt, None),
                    };
                    let name = name.split(':').next().unwrap_or(name);
                    (!name.is_empty()).then(|| Dependency {
                        name: name.to_owned(),
                        relation,
                    })
                })
                .collect()
        })
        .collect()
}

fn is_kernel_package(name: &str) -> bool {
    KERNEL_PACKAGE_PREFIXES
        .iter()
        .any(|it| name.starts_with(it))
}

/// The headers, the image, and what they depend on among the kernel's packages.
fn package_set(
    apt: &apt::Apt,
    headers: &apt::Candidate,
    abi: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let version = &headers.version;
    let mut set = vec![(headers.package.clone(), version.clone())];
    let image = format!("linux-image-{abi}-{FLAVOUR}");
    let unsigned = format!("{image}-unsigned");
    let Some(image) = [image, unsigned]
        .into_iter()
        .find(|it| apt.show(it, version).ok().flatten().is_some())
    else {
        bail!(
            "the archive has {} {version} but no linux-image-{abi}-{FLAVOUR}[-unsigned] of that version",
            headers.package
        );
    };
    set.push((image, version.clone()));
    let mut idx = 0;
    while idx < set.len() {
        let (package, package_version) = set[idx].clone();
        idx += 1;
        let fields = apt
            .show(&package, &package_version)?
            .ok_or_else(|| format_err!("the package lists lost {package} {package_version}"))?;
        for group in dependency_groups(&fields) {
            if !group.first().is_some_and(|it| is_kernel_package(&it.name)) {
                continue;
            }
            if group
                .iter()
                .any(|dep| set.iter().any(|(name, _)| *name == dep.name))
            {
                continue;
            }
            let mut chosen = None;
            for dep in &group {
                if let Some(dep_version) = choose_version(apt, dep, version)? {
                    chosen = Some((dep.name.clone(), dep_version));
                    break;
                }
            }
            let Some(chosen) = chosen else {
                bail!(
                    "no version of {:?} (needed by {package} {package_version}) is in the archive",
                    group
                );
            };
            set.push(chosen);
        }
    }
    Ok(set)
}

/// The version of `dep` to fetch: the one its relation pins, else the kernel's own version,
/// else the newest that satisfies the relation.
fn choose_version(
    apt: &apt::Apt,
    dep: &Dependency,
    kernel_version: &str,
) -> anyhow::Result<Option<String>> {
    let available = apt.versions(std::slice::from_ref(&dep.name))?;
    let ok = |version: &str| match &dep.relation {
        Some((op, other)) => debver::satisfies(version, op, other),
        None => true,
    };
    if available.iter().any(|it| it.version == kernel_version) && ok(kernel_version) {
        return Ok(Some(kernel_version.to_owned()));
    }
    Ok(available
        .iter()
        .filter(|it| ok(&it.version))
        .max_by(|a, b| debver::compare(&a.version, &b.version))
        .map(|it| it.version.clone()))
}

/// Where things are in an unpacked kernel (6.x: `/boot` and `/lib/modules`; 7.x: all under
/// `/usr/lib/modules/<release>`).
struct Layout {
    vmlinuz: PathBuf,
    modules_dir: PathBuf,
    kdir: PathBuf,
    config: PathBuf,
}

fn locate(root: &Path, release: &str) -> anyhow::Result<Layout> {
    let first = |what: &str, paths: &[PathBuf]| -> anyhow::Result<PathBuf> {
        paths.iter().find(|it| it.exists()).cloned().ok_or_else(|| {
            let list: Vec<String> = paths.iter().map(|it| it.display().to_string()).collect();
            format_err!(
                "the unpacked kernel has no {what} (looked for {})",
                list.join(", ")
            )
        })
    };
    let modules_dir = first(
        "modules dir",
        &[
            root.join("usr/lib/modules").join(release),
            root.join("lib/modules").join(release),
        ],
    )?;
    let kdir = first(
        "headers",
        &[root
            .join("usr/src")
            .join(format!("linux-headers-{release}"))],
    )?;
    let vmlinuz = first(
        "vmlinuz",
        &[
            root.join(format!("boot/vmlinuz-{release}")),
            modules_dir.join("vmlinuz"),
        ],
    )?;
    let config = first(
        "config",
        &[
            root.join(format!("boot/config-{release}")),
            modules_dir.join("config"),
            kdir.join(".config"),
        ],
    )?;
    Ok(Layout {
        vmlinuz,
        modules_dir,
        kdir,
        config,
    })
}

/// The kernel prepared earlier in `root`, if it is complete and of the picked version.
fn load_prepared(root: &Path, series: &str, pick: &Pick) -> anyhow::Result<Option<Kernel>> {
    let Ok(marker) = fs::read_to_string(root.join(MARKER)) else {
        return Ok(None);
    };
    let field = |key: &str| {
        marker
            .lines()
            .find_map(|it| it.strip_prefix(key)?.strip_prefix('='))
    };
    if field("package_version") != Some(pick.version.as_str()) {
        return Ok(None);
    }
    let make_vars = marker
        .lines()
        .filter_map(|it| it.strip_prefix("make_var="))
        .map(str::to_owned)
        .collect();
    let layout = locate(root, &pick.release)?;
    Ok(Some(kernel(series, pick, layout, make_vars)))
}

fn kernel(series: &str, pick: &Pick, layout: Layout, make_vars: Vec<String>) -> Kernel {
    Kernel {
        spec: format!("debian:{series}"),
        release: pick.release.clone(),
        package_version: pick.version.clone(),
        vmlinuz: layout.vmlinuz,
        modules_dir: layout.modules_dir,
        kdir: layout.kdir,
        make_vars,
        config: layout.config,
    }
}

fn prepare_fresh(
    apt: &apt::Apt,
    cache_dir: &Path,
    series: &str,
    pick: &Pick,
    root: &Path,
    log: &Path,
) -> anyhow::Result<Kernel> {
    let release = &pick.release;
    remove_dir_all_if_exists(root)?;
    fs::create_dir_all(root).with_context(|| format!("cannot create {}", root.display()))?;
    host::ensure(host::UNPACK, log)?;
    let packages = package_set(apt, &pick.headers, &pick.abi)?;
    let mut debs = Vec::new();
    for (package, version) in &packages {
        debs.push(apt.download(package, version)?);
    }
    eprintln!("unpacking {release} into {} ...", root.display());
    // The packages side by side: the image's modules take most of the time.
    std::thread::scope(|scope| {
        let unpacks = debs
            .iter()
            .map(|deb| {
                scope.spawn(move || {
                    let sh = Shell::new()?;
                    run_logged(cmd!(sh, "dpkg -x {deb} {root}"), log).map(drop)
                })
            })
            .collect::<Vec<_>>();
        unpacks.into_iter().try_for_each(|unpack| {
            unpack
                .join()
                .unwrap_or_else(|_| Err(format_err!("an unpacking thread panicked")))
        })
    })?;
    let layout = locate(root, release)?;
    fix_tree(root, &layout.kdir, log)?;
    // depmod (10 s on two cores) beside the checks of the build tools and of a module build.
    std::thread::scope(|scope| {
        let modules_dir = layout.modules_dir.clone();
        let depmod = scope.spawn(move || {
            if modules_dir.join("modules.dep").exists() {
                return Ok(());
            }
            depmod(&modules_dir, release, log)
        });
        let checked = check_tools_and_build(apt, cache_dir, series, pick, root, layout, log);
        let depmod = depmod
            .join()
            .unwrap_or_else(|_| Err(format_err!("the depmod thread panicked")));
        checked.and_then(|kernel| depmod.map(|()| kernel))
    })
    .and_then(|kernel| keep(root, kernel, &packages, debs))
}

/// Rebuilds the kbuild host tools of the unpacked headers that do not run here, then checks
/// that a module builds against them.
fn check_tools_and_build(
    apt: &apt::Apt,
    cache_dir: &Path,
    series: &str,
    pick: &Pick,
    root: &Path,
    layout: Layout,
    log: &Path,
) -> anyhow::Result<Kernel> {
    let release = &pick.release;
    host::ensure(host::BUILD, log)?;
    let kbuild_root = fs::canonicalize(layout.kdir.join("scripts"))
        .ok()
        .and_then(|it| it.parent().map(Path::to_path_buf))
        .ok_or_else(|| format_err!("{}/scripts does not resolve", layout.kdir.display()))?;
    let broken = kbuild::broken_tools(&kbuild_root)?;
    append_log(
        log,
        &format!("kbuild host tools that do not run here: {broken:?}\n"),
    )?;
    if !broken.is_empty() {
        rebuild_host_tools(
            apt,
            cache_dir,
            series,
            pick,
            &layout.kdir,
            &kbuild_root,
            &broken,
            log,
        )?;
    }

    let config_text = fs::read_to_string(&layout.config)
        .with_context(|| format!("cannot read {}", layout.config.display()))?;
    let make_vars = kbuild::make_vars(&layout.kdir, &config_text)?;
    let kernel = kernel(series, pick, layout, make_vars);
    eprintln!("checking a module build against {release} ...");
    kbuild::check_build(&kernel, &root.join(".fgds-check"), log)?;
    Ok(kernel)
}

/// Marks the unpacked, checked tree at `root` as the cache of `kernel` (from `packages`), and
/// removes the downloaded `debs`.
fn keep(
    root: &Path,
    kernel: Kernel,
    packages: &[(String, String)],
    debs: Vec<PathBuf>,
) -> anyhow::Result<Kernel> {
    let release = &kernel.release;
    let mut marker = format!(
        "spec={}\nrelease={release}\npackage_version={}\n",
        kernel.spec, kernel.package_version
    );
    for (package, version) in packages {
        marker.push_str(&format!("package={package}={version}\n"));
    }
    for var in &kernel.make_vars {
        marker.push_str(&format!("make_var={var}\n"));
    }
    let tmp = root.join(format!("{MARKER}.tmp"));
    fs::write(&tmp, marker).with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, root.join(MARKER))?;
    for deb in debs {
        // The unpacked tree is the cache; the packages can be fetched again.
        let _ = fs::remove_file(deb);
    }
    Ok(kernel)
}

/// Makes the unpacked tree work where it is: absolute symlinks (`lib/modules/<r>/build`) point
/// into it, and the headers' Makefile includes the -common Makefile from it, not from
/// /usr/src.
fn fix_tree(root: &Path, kdir: &Path, log: &Path) -> anyhow::Result<()> {
    let mut links = Vec::new();
    find_absolute_symlinks(root, &mut links)?;
    for (link, target) in links {
        let inside = root.join(target.strip_prefix("/").unwrap_or(&target));
        let parent = link.parent().unwrap_or(root);
        let relative = relative_path(parent, &inside);
        fs::remove_file(&link).with_context(|| format!("cannot replace {}", link.display()))?;
        unix_fs::symlink(&relative, &link)
            .with_context(|| format!("cannot create symlink {}", link.display()))?;
        append_log(
            log,
            &format!("symlink {} -> {}\n", link.display(), relative.display()),
        )?;
    }

    let src_dir = root.join("usr/src");
    for entry in
        fs::read_dir(&src_dir).with_context(|| format!("cannot read {}", src_dir.display()))?
    {
        let makefile = entry?.path().join("Makefile");
        let Ok(text) = fs::read_to_string(&makefile) else {
            continue;
        };
        let fixed = rebase_usr_src(&text, root);
        if fixed != text {
            fs::write(&makefile, &fixed)
                .with_context(|| format!("cannot write {}", makefile.display()))?;
            append_log(log, &format!("{}:\n{fixed}\n", makefile.display()))?;
        }
    }
    for sub in [
        "scripts",
        "tools",
        "Makefile",
        ".config",
        "include/config/kernel.release",
    ] {
        if !kdir.join(sub).exists() {
            bail!(
                "{}/{sub} is missing or a dangling symlink in the unpacked headers",
                kdir.display()
            );
        }
    }
    Ok(())
}

fn find_absolute_symlinks(dir: &Path, out: &mut Vec<(PathBuf, PathBuf)>) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("cannot read {}", dir.display()))? {
        let entry = entry?;
        let file_type = entry.file_type()?;
        if file_type.is_dir() {
            find_absolute_symlinks(&entry.path(), out)?;
        } else if file_type.is_symlink() {
            let target = fs::read_link(entry.path())?;
            if target.is_absolute() {
                out.push((entry.path(), target));
            }
        }
    }
    Ok(())
}

/// `text` (a Makefile) with absolute `/usr/src/...` paths that start a word (`include
/// /usr/src/...`, `KBUILD_OUTPUT=/usr/src/...`) moved under `root`.
fn rebase_usr_src(text: &str, root: &Path) -> String {
    let root = root.display().to_string();
    let mut res = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(idx) = rest.find("/usr/src/") {
        let starts_word = idx == 0 || rest[..idx].ends_with([' ', '\t', '=', '\n', '"', '\'']);
        res.push_str(&rest[..idx]);
        if starts_word {
            res.push_str(&root);
        }
        res.push_str("/usr/src/");
        rest = &rest[idx + "/usr/src/".len()..];
    }
    res.push_str(rest);
    res
}

/// The relative path from directory `from` to `to`; both absolute and without `..`.
fn relative_path(from: &Path, to: &Path) -> PathBuf {
    let from: Vec<Component<'_>> = from.components().collect();
    let to: Vec<Component<'_>> = to.components().collect();
    let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
    let mut res = PathBuf::new();
    for _ in common..from.len() {
        res.push("..");
    }
    for part in &to[common..] {
        res.push(part);
    }
    res
}

/// Runs depmod for a modules dir `<base>/lib/modules/<release>`; Debian's packages ship no
/// modules.dep (the postinst makes it).
fn depmod(modules_dir: &Path, release: &str, log: &Path) -> anyhow::Result<()> {
    let base = modules_dir
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .ok_or_else(|| {
            format_err!(
                "{} is not a <base>/lib/modules/<release> dir",
                modules_dir.display()
            )
        })?;
    let depmod = host::find_program("depmod")
        .ok_or_else(|| format_err!("depmod not found; install kmod"))?;
    eprintln!("running depmod for {release} ...");
    let sh = Shell::new()?;
    run_logged(cmd!(sh, "{depmod} -b {base} {release}"), log)?;
    if !modules_dir.join("modules.dep").exists() {
        bail!(
            "depmod -b {} {release} made no modules.dep in {}",
            base.display(),
            modules_dir.display()
        );
    }
    Ok(())
}

/// Rebuilds the kbuild host tools that do not run here from the kernel's `linux-source-X.Y`.
#[allow(clippy::too_many_arguments)]
fn rebuild_host_tools(
    apt: &apt::Apt,
    cache_dir: &Path,
    series: &str,
    pick: &Pick,
    kdir: &Path,
    kbuild_root: &Path,
    broken: &[String],
    log: &Path,
) -> anyhow::Result<()> {
    let package = format!("linux-source-{series}");
    let version = &pick.version;
    if apt.show(&package, version)?.is_none() {
        bail!(
            "kbuild host tools of {} do not run on this host ({}), and {package} {version}, to \
             rebuild them from, is not in the archive",
            pick.release,
            broken.join(", ")
        );
    }
    let src = source::unpack(apt, cache_dir, &package, version)?;
    eprintln!(
        "rebuilding kbuild host tools of {} from {package} ...",
        pick.release
    );
    let build_dir = src.with_file_name(format!("tools-{}", sanitize(&pick.release)));
    let still = kbuild::rebuild_tools(
        &src,
        &kdir.join(".config"),
        &build_dir,
        kbuild_root,
        broken,
        log,
    )?;
    append_log(
        log,
        &format!("kbuild host tools not rebuilt (module builds do not use them): {still:?}\n"),
    )?;
    if let Some(needed) = still
        .iter()
        .find(|it| kbuild::NEEDED_TOOLS.contains(&it.as_str()))
    {
        bail!("rebuilt kbuild host tools from {package}, but {needed} still does not run here");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(package: &str, version: &str, suite: &str) -> apt::Candidate {
        apt::Candidate {
            package: package.to_owned(),
            version: version.to_owned(),
            suite: suite.to_owned(),
        }
    }

    #[test]
    fn recognizes_headers_of_a_series() {
        assert_eq!(
            headers_abi("linux-headers-6.1.0-57-amd64", "6.1"),
            Some("6.1.0-57")
        );
        assert_eq!(
            headers_abi("linux-headers-6.12.117+deb12-amd64", "6.12"),
            Some("6.12.117+deb12")
        );
        assert_eq!(
            headers_abi("linux-headers-6.12.90+deb12.1-amd64", "6.12"),
            Some("6.12.90+deb12.1")
        );
        assert_eq!(headers_abi("linux-headers-7.3-amd64", "7.3"), Some("7.3"));
        assert_eq!(
            headers_abi("linux-headers-7.2.13+deb14-amd64", "7.2"),
            Some("7.2.13+deb14")
        );
        assert_eq!(
            headers_abi("linux-headers-6.12-amd64", "6.12"),
            Some("6.12")
        );
        assert_eq!(
            headers_abi("linux-headers-6.12.117+deb12-amd64", "6.1"),
            None
        );
        assert_eq!(
            headers_abi("linux-headers-6.12.117+deb12-cloud-amd64", "6.12"),
            None
        );
        assert_eq!(headers_abi("linux-headers-7.3-rt-amd64", "7.3"), None);
        assert_eq!(headers_abi("linux-headers-7.3-common", "7.3"), None);
        assert_eq!(headers_abi("linux-headers-amd64", "7.3"), None);
    }

    #[test]
    fn picks_the_newest_build_preferring_the_host_suites() {
        let candidates = [
            candidate("linux-headers-6.12.117+deb13-amd64", "6.12.117-1", "trixie"),
            candidate(
                "linux-headers-6.12.115+deb12-amd64",
                "6.12.115-2~deb12u1",
                "bookworm-security",
            ),
            candidate(
                "linux-headers-6.12.117+deb12-amd64",
                "6.12.117-1~deb12u1",
                "bookworm-security",
            ),
            candidate(
                "linux-headers-6.12.95+deb12-amd64",
                "6.12.95-1~bpo12+1",
                "bookworm-backports",
            ),
        ];
        let best = pick_newest(&candidates, "bookworm").unwrap();
        assert_eq!(best.package, "linux-headers-6.12.117+deb12-amd64");
        let best = pick_newest(&candidates, "trixie").unwrap();
        assert_eq!(best.version, "6.12.117-1");

        let candidates = [
            candidate(
                "linux-headers-6.1.0-56-amd64",
                "6.1.192-2",
                "bookworm-security",
            ),
            candidate(
                "linux-headers-6.1.0-57-amd64",
                "6.1.192-3",
                "bookworm-security",
            ),
            candidate("linux-headers-6.1.0-47-amd64", "6.1.176-1", "bookworm"),
        ];
        assert_eq!(
            pick_newest(&candidates, "bookworm").unwrap().version,
            "6.1.192-3"
        );

        // No build for the host: the newest anywhere, an -rc in experimental included.
        let candidates = [
            candidate("linux-headers-7.3-amd64", "7.3~rc7-1~exp1", "experimental"),
            candidate("linux-headers-7.3-amd64", "7.3~rc6-1~exp1", "experimental"),
        ];
        assert_eq!(
            pick_newest(&candidates, "bookworm").unwrap().version,
            "7.3~rc7-1~exp1"
        );
        assert_eq!(pick_newest(&[], "bookworm"), None);
    }

    #[test]
    fn parses_dependencies() {
        let fields = vec![(
            "Depends".to_owned(),
            "linux-base (>= 4.12~), linux-headers-6.12.117+deb12-common (= 6.12.117-1~deb12u1), \
             linux-image-6.12.117+deb12-amd64 (= 6.12.117-1~deb12u1) | linux-image-6.12.117+deb12-amd64-unsigned (= 6.12.117-1~deb12u1), \
             linux-kbuild-6.12.117+deb12, gcc-12:amd64"
                .to_owned(),
        )];
        let groups = dependency_groups(&fields);
        assert_eq!(groups.len(), 5);
        assert_eq!(
            groups[1],
            [Dependency {
                name: "linux-headers-6.12.117+deb12-common".to_owned(),
                relation: Some(("=".to_owned(), "6.12.117-1~deb12u1".to_owned())),
            }]
        );
        assert_eq!(groups[2].len(), 2);
        assert_eq!(
            groups[2][1].name,
            "linux-image-6.12.117+deb12-amd64-unsigned"
        );
        assert_eq!(
            groups[3],
            [Dependency {
                name: "linux-kbuild-6.12.117+deb12".to_owned(),
                relation: None
            }]
        );
        assert_eq!(groups[4][0].name, "gcc-12");
        assert!(is_real_headers(&fields));
        assert!(!is_kernel_package("linux-base"));
        assert!(is_kernel_package("linux-base-7.3-amd64"));
        let meta = vec![(
            "Depends".to_owned(),
            "linux-headers-6.12.117+deb12-amd64 (= 6.12.117-1~deb12u1)".to_owned(),
        )];
        assert!(!is_real_headers(&meta));
    }

    #[test]
    fn rebases_usr_src_paths() {
        let root = Path::new("/c/kernels/7.3-amd64");
        let makefile = "KBUILD_OUTPUT=/usr/src/linux-headers-7.3-amd64\ninclude /usr/src/linux-headers-7.3-common/Makefile\n";
        assert_eq!(
            rebase_usr_src(makefile, root),
            "KBUILD_OUTPUT=/c/kernels/7.3-amd64/usr/src/linux-headers-7.3-amd64\n\
             include /c/kernels/7.3-amd64/usr/src/linux-headers-7.3-common/Makefile\n"
        );
        let fixed = rebase_usr_src(makefile, root);
        assert_eq!(rebase_usr_src(&fixed, root), fixed);
    }

    #[test]
    fn computes_relative_paths() {
        assert_eq!(
            relative_path(
                Path::new("/r/lib/modules/6.1.0-57-amd64"),
                Path::new("/r/usr/src/linux-headers-6.1.0-57-amd64")
            ),
            Path::new("../../../usr/src/linux-headers-6.1.0-57-amd64")
        );
        assert_eq!(
            relative_path(Path::new("/r/a"), Path::new("/r/a/b")),
            Path::new("b")
        );
    }
}
