//! Which `.ko` files to load, and in which order, from depmod's `modules.dep`.

use std::{
    collections::{HashMap, HashSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail, format_err};
use xshell::{Shell, cmd};

use super::{Kernel, fnv1a, host, lock_file, with_suffix};

pub(super) fn load_order_files(
    kernel: &Kernel,
    names: &[&str],
    cache_dir: &Path,
) -> anyhow::Result<Vec<PathBuf>> {
    let dir = &kernel.modules_dir;
    let dep_path = dir.join("modules.dep");
    let dep_text = fs::read_to_string(&dep_path).with_context(|| {
        format!(
            "cannot read {}; prepare the kernel again to run depmod",
            dep_path.display()
        )
    })?;
    let read_optional = |name: &str| fs::read_to_string(dir.join(name)).unwrap_or_default();
    let modules = Modules {
        dep: parse_modules_dep(&dep_text),
        builtin: parse_builtin(&read_optional("modules.builtin"))
            .into_iter()
            .chain(parse_builtin_modinfo(
                &fs::read(dir.join("modules.builtin.modinfo")).unwrap_or_default(),
            ))
            .collect(),
        softdeps: parse_softdeps(&read_optional("modules.softdep")),
        aliases: HashMap::new(),
    };
    // Soft dependencies may name an alias ("crypto-crc32c"), as modprobe allows.
    let wanted: HashSet<&String> = modules
        .softdeps
        .values()
        .flat_map(|(pre, post)| pre.iter().chain(post))
        .collect();
    let aliases = parse_aliases(&read_optional("modules.alias"), &wanted);
    let modules = Modules { aliases, ..modules };
    let order = load_order(&modules, names)?;

    // Decompressed copies go to a directory keyed by this modules.dep, so a re-prepared kernel
    // (new package version, new `make modules_install`) never gets stale copies.
    let stamp = fs::metadata(&dep_path)
        .and_then(|it| it.modified())
        .ok()
        .and_then(|it| it.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|it| it.as_nanos())
        .unwrap_or(0);
    let key = format!("{}\n{}\n{stamp}", dir.display(), kernel.package_version);
    let out_dir = cache_dir.join("ko").join(format!(
        "{}-{:016x}",
        super::sanitize(&kernel.release),
        fnv1a(key.as_bytes())
    ));
    let mut files = Vec::new();
    for rel in order {
        let src = dir.join(&rel);
        match Compression::of(&rel) {
            None => files.push(src),
            Some(compression) => {
                files.push(decompress(&src, &rel, compression, &out_dir, cache_dir)?)
            }
        }
    }
    Ok(files)
}

/// What depmod says about a kernel's modules.
struct Modules {
    /// Module name (with '_') to its path relative to the modules dir and its dependencies'
    /// names.
    dep: HashMap<String, (String, Vec<String>)>,
    /// Names of the modules built into the kernel (modules.builtin and
    /// modules.builtin.modinfo).
    builtin: HashSet<String>,
    /// Module name to its "pre:" and "post:" soft dependencies (module names or aliases).
    softdeps: HashMap<String, (Vec<String>, Vec<String>)>,
    /// Alias to the modules that have it; only the plain aliases soft dependencies name.
    aliases: HashMap<String, Vec<String>>,
}

/// The paths (relative to the modules dir) to load for `names`, dependencies first, each once.
fn load_order(modules: &Modules, names: &[&str]) -> anyhow::Result<Vec<String>> {
    let unknown: Vec<&str> = names
        .iter()
        .copied()
        .filter(|it| {
            let name = normalize(it);
            !modules.dep.contains_key(&name) && !modules.builtin.contains(&name)
        })
        .collect();
    if !unknown.is_empty() {
        bail!(
            "unknown modules: {} (neither in modules.dep nor built in; the kernel's config \
             probably lacks them)",
            unknown.join(", ")
        );
    }
    let mut order = Vec::new();
    let mut done = HashSet::new();
    for name in names {
        visit(
            modules,
            &normalize(name),
            &mut done,
            &mut Vec::new(),
            &mut order,
        )?;
    }
    Ok(order)
}

/// Depth-first: a module's pre-softdeps and dependencies, the module, then its post-softdeps.
fn visit(
    modules: &Modules,
    name: &str,
    done: &mut HashSet<String>,
    stack: &mut Vec<String>,
    order: &mut Vec<String>,
) -> anyhow::Result<()> {
    if done.contains(name) || stack.iter().any(|it| it == name) {
        return Ok(());
    }
    let Some((path, deps)) = modules.dep.get(name) else {
        // Built in (checked for the requested names), or an optional softdep that is absent.
        return Ok(());
    };
    stack.push(name.to_owned());
    let (pre, post) = match modules.softdeps.get(name) {
        Some((pre, post)) => (pre.as_slice(), post.as_slice()),
        None => (&[][..], &[][..]),
    };
    for dep in pre {
        for dep in resolve_softdep(modules, dep) {
            visit(modules, &dep, done, stack, order)?;
        }
    }
    for dep in deps {
        if !modules.dep.contains_key(dep) {
            return Err(format_err!(
                "modules.dep is inconsistent: {name} needs {dep}, which has no entry"
            ));
        }
        visit(modules, dep, done, stack, order)?;
    }
    stack.pop();
    done.insert(name.to_owned());
    order.push(path.clone());
    for dep in post {
        for dep in resolve_softdep(modules, dep) {
            visit(modules, &dep, done, stack, order)?;
        }
    }
    Ok(())
}

/// The modules a soft dependency names: the module of that name, else the modules with that
/// alias. Of several, only the `*_generic` ones if there are any: they always load, whereas the
/// CPU-specific ones (crc32c_intel) fail on CPUs without the feature, such as TCG's.
/// Soft dependencies that are built in or absent resolve to nothing: they are optional.
fn resolve_softdep(modules: &Modules, name: &str) -> Vec<String> {
    if modules.dep.contains_key(name) {
        return vec![name.to_owned()];
    }
    let Some(providers) = modules.aliases.get(name) else {
        return Vec::new();
    };
    if providers.iter().any(|it| modules.builtin.contains(it)) {
        return Vec::new();
    }
    let mut providers: Vec<String> = providers
        .iter()
        .filter(|it| modules.dep.contains_key(*it))
        .cloned()
        .collect();
    if providers.iter().any(|it| it.ends_with("_generic")) {
        providers.retain(|it| it.ends_with("_generic"));
    }
    providers.sort();
    providers
}

/// Parses `modules.alias` lines (`alias <pattern> <module>`), keeping the aliases in `wanted`.
fn parse_aliases(text: &str, wanted: &HashSet<&String>) -> HashMap<String, Vec<String>> {
    let mut res: HashMap<String, Vec<String>> = HashMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some("alias"), Some(alias), Some(module)) = (words.next(), words.next(), words.next())
        else {
            continue;
        };
        let alias = normalize(alias);
        if wanted.contains(&alias) {
            res.entry(alias).or_default().push(normalize(module));
        }
    }
    res
}

/// The module name of a path or name: the file name without `.ko[.xz|.zst|.gz]`, with '-'
/// replaced by '_' (the kernel treats both the same).
fn normalize(path_or_name: &str) -> String {
    let file = path_or_name.rsplit('/').next().unwrap_or(path_or_name);
    let stem = match file.find(".ko") {
        Some(idx) => &file[..idx],
        None => file,
    };
    stem.replace('-', "_")
}

fn parse_modules_dep(text: &str) -> HashMap<String, (String, Vec<String>)> {
    let mut res = HashMap::new();
    for line in text.lines() {
        let Some((path, deps)) = line.split_once(':') else {
            continue;
        };
        let deps = deps.split_whitespace().map(normalize).collect();
        res.insert(normalize(path), (path.trim().to_owned(), deps));
    }
    res
}

fn parse_builtin(text: &str) -> HashSet<String> {
    text.lines()
        .map(str::trim)
        .filter(|it| !it.is_empty())
        .map(normalize)
        .collect()
}

/// Names in `modules.builtin.modinfo` (NUL-separated `name.key=value` records). Unlike
/// modules.builtin, it also knows built-in drivers whose option is a bool (udmabuf in 6.x).
fn parse_builtin_modinfo(bytes: &[u8]) -> HashSet<String> {
    bytes
        .split(|&b| b == 0)
        .filter_map(|record| {
            let name = &record[..record.iter().position(|&b| b == b'.')?];
            Some(normalize(&String::from_utf8_lossy(name)))
        })
        .filter(|it| !it.is_empty())
        .collect()
}

/// Parses `modules.softdep` lines: `softdep <module> pre: <a> <b> post: <c>`.
fn parse_softdeps(text: &str) -> HashMap<String, (Vec<String>, Vec<String>)> {
    let mut res: HashMap<String, (Vec<String>, Vec<String>)> = HashMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("softdep") {
            continue;
        }
        let Some(module) = words.next() else { continue };
        let entry = res.entry(normalize(module)).or_default();
        let mut is_post = false;
        for word in words {
            match word {
                "pre:" => is_post = false,
                "post:" => is_post = true,
                _ if is_post => entry.1.push(normalize(word)),
                _ => entry.0.push(normalize(word)),
            }
        }
    }
    res
}

#[derive(Clone, Copy)]
enum Compression {
    Xz,
    Zstd,
    Gzip,
}

impl Compression {
    fn of(path: &str) -> Option<Compression> {
        if path.ends_with(".ko.xz") {
            Some(Compression::Xz)
        } else if path.ends_with(".ko.zst") {
            Some(Compression::Zstd)
        } else if path.ends_with(".ko.gz") {
            Some(Compression::Gzip)
        } else {
            None
        }
    }
}

/// Decompresses `src` (at `rel` in the modules dir) to `out_dir/rel` without the compression
/// suffix, unless that was done before.
fn decompress(
    src: &Path,
    rel: &str,
    compression: Compression,
    out_dir: &Path,
    cache_dir: &Path,
) -> anyhow::Result<PathBuf> {
    let rel_ko = &rel[..rel.rfind(".ko").map_or(rel.len(), |it| it + 3)];
    let dest = out_dir.join(rel_ko.trim_start_matches('/'));
    if dest.exists() {
        return Ok(dest);
    }
    let (program, package) = match compression {
        Compression::Xz => ("xz", "xz-utils"),
        Compression::Zstd => ("zstd", "zstd"),
        Compression::Gzip => ("gzip", "gzip"),
    };
    let log = cache_dir.join("host-packages.log");
    host::ensure(&[(host::Probe::Program(program), package)], &log)?;
    let parent = dest.parent().unwrap_or(out_dir);
    fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let _lock = lock_file(&with_suffix(out_dir, ".lock"))?;
    if dest.exists() {
        return Ok(dest);
    }
    let sh = Shell::new()?;
    let output = cmd!(sh, "{program} -dc {src}")
        .quiet()
        .ignore_status()
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    if !output.status.success() {
        bail!(
            "cannot decompress {}: {program} failed: {}",
            src.display(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let tmp = dest.with_extension("ko.tmp");
    fs::write(&tmp, &output.stdout).with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, &dest).with_context(|| format!("cannot rename {}", tmp.display()))?;
    Ok(dest)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Shaped like a Debian 7.x modules.dep (depmod lists dependencies deepest last).
    const MODULES_DEP: &str = "\
kernel/drivers/nvme/host/nvme.ko.xz: kernel/drivers/nvme/host/nvme-core.ko.xz kernel/drivers/nvme/common/nvme-keyring.ko.xz kernel/drivers/nvme/common/nvme-auth.ko.xz
kernel/drivers/nvme/host/nvme-core.ko.xz: kernel/drivers/nvme/common/nvme-keyring.ko.xz kernel/drivers/nvme/common/nvme-auth.ko.xz
kernel/drivers/nvme/common/nvme-auth.ko.xz: kernel/crypto/hkdf.ko.xz
kernel/drivers/nvme/common/nvme-keyring.ko.xz:
kernel/crypto/hkdf.ko.xz:
kernel/fs/ext4/ext4.ko.xz: kernel/fs/jbd2/jbd2.ko.xz kernel/fs/mbcache.ko.xz kernel/lib/crc16.ko.xz
kernel/fs/jbd2/jbd2.ko.xz:
kernel/fs/mbcache.ko.xz:
kernel/lib/crc16.ko.xz:
kernel/crypto/crc32c_generic.ko.xz:
kernel/arch/x86/crypto/crc32c-intel.ko.xz:
kernel/drivers/misc/pvpanic/pvpanic-pci.ko.xz: kernel/drivers/misc/pvpanic/pvpanic.ko.xz
kernel/drivers/misc/pvpanic/pvpanic.ko.xz:
";
    const BUILTIN: &str = "\
kernel/drivers/char/virtio_console.ko
kernel/drivers/dma-buf/udmabuf.ko
";
    const SOFTDEP: &str = "\
# Soft dependencies extracted from modules themselves.
softdep ext4 pre: crypto-crc32c
softdep nvme_core pre: crc32c_generic post: hkdf
softdep mbcache pre: nosuch
";
    const ALIAS: &str = "\
alias crypto-crc32c crc32c_intel
alias crypto-crc32c crc32c_generic
alias crc32c crc32c_generic
alias pci:v00001B36d00000011sv*sd*bc*sc*i* pvpanic_pci
";

    fn modules() -> Modules {
        Modules {
            dep: parse_modules_dep(MODULES_DEP),
            builtin: parse_builtin(BUILTIN),
            softdeps: parse_softdeps(SOFTDEP),
            aliases: parse_aliases(
                ALIAS,
                &["crypto_crc32c".to_owned(), "nosuch".to_owned()]
                    .iter()
                    .collect(),
            ),
        }
    }

    #[test]
    fn orders_dependencies_first() {
        let order = load_order(&modules(), &["nvme", "pvpanic_pci"]).unwrap();
        assert_eq!(
            order,
            [
                "kernel/crypto/crc32c_generic.ko.xz",
                "kernel/drivers/nvme/common/nvme-keyring.ko.xz",
                "kernel/crypto/hkdf.ko.xz",
                "kernel/drivers/nvme/common/nvme-auth.ko.xz",
                "kernel/drivers/nvme/host/nvme-core.ko.xz",
                "kernel/drivers/nvme/host/nvme.ko.xz",
                "kernel/drivers/misc/pvpanic/pvpanic.ko.xz",
                "kernel/drivers/misc/pvpanic/pvpanic-pci.ko.xz",
            ]
        );
    }

    #[test]
    fn leaves_out_builtins_and_absent_softdeps() {
        // mbcache's softdep "nosuch" is neither a module nor an alias: it is optional. ext4's
        // "crypto-crc32c" is an alias of two modules; the generic one is taken.
        let order = load_order(&modules(), &["virtio_console", "ext4", "udmabuf", "jbd2"]).unwrap();
        assert_eq!(
            order,
            [
                "kernel/crypto/crc32c_generic.ko.xz",
                "kernel/fs/jbd2/jbd2.ko.xz",
                "kernel/fs/mbcache.ko.xz",
                "kernel/lib/crc16.ko.xz",
                "kernel/fs/ext4/ext4.ko.xz",
            ]
        );
    }

    #[test]
    fn accepts_dashes_and_underscores() {
        let order = load_order(&modules(), &["nvme_keyring", "pvpanic-pci"]).unwrap();
        assert_eq!(order.len(), 3);
        assert_eq!(order[0], "kernel/drivers/nvme/common/nvme-keyring.ko.xz");
    }

    #[test]
    fn names_unknown_modules() {
        let err = load_order(&modules(), &["nvme", "nosuch", "fgds"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("nosuch, fgds"), "{err}");
    }

    #[test]
    fn reads_builtin_modinfo() {
        let modinfo =
            b"virtio_console.license=GPL\0virtio_console.file=drivers/char/virtio_console\0\
                        udmabuf.parm=list_limit:limit. Default is 1024.\0";
        let names = parse_builtin_modinfo(modinfo);
        let mut names: Vec<&str> = names.iter().map(String::as_str).collect();
        names.sort();
        assert_eq!(names, ["udmabuf", "virtio_console"]);
    }

    #[test]
    fn normalizes_names() {
        assert_eq!(
            normalize("kernel/drivers/misc/pvpanic/pvpanic-pci.ko.zst"),
            "pvpanic_pci"
        );
        assert_eq!(normalize("nvme-core.ko"), "nvme_core");
        assert_eq!(normalize("virtio_console"), "virtio_console");
    }
}
