//! A private apt configuration under `<cache>/apt`, for looking up and downloading kernel
//! packages by name without touching the system's apt setup.
//!
//! ```text
//! apt/etc/sources.list     derived from the system's sources (see `private_sources`)
//! apt/state/               package lists; `state/status` is empty: nothing is "installed"
//! apt/cache/               apt's binary caches
//! apt/debs/                downloaded packages, removed once unpacked
//! apt/update-stamp         written after each `apt-get update`; holds the sources it used
//! apt/update.log, apt/download.log
//! ```
//!
//! The lists cover the host's suites first; the newer suites (about 20 MB more to fetch) are
//! added the first time a lookup finds nothing in the host's, as for a 7.x kernel on bookworm.
//! Lists of the last day that cover more than a run needs serve it as they are.

use std::{
    cell::Cell,
    fs,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use anyhow::{Context, format_err};
use xshell::{Shell, cmd};

use super::{FileLock, lock_file, run_logged};

/// How long package lists are used before `apt-get update` runs again.
const LISTS_MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);

/// Suites newer than the host's that carry the kernels the matrix wants (7.x in sid and
/// experimental; trixie for completeness).
const NEWER_SUITES: &[&str] = &["trixie", "sid", "experimental"];

/// Suite names (or their first word, as in "bookworm-updates") that mark an apt source as a
/// Debian archive; "rc-buggy" and the host's codename count too.
const DEBIAN_SUITES: &[&str] = &[
    "jessie",
    "stretch",
    "buster",
    "bullseye",
    "bookworm",
    "trixie",
    "forky",
    "duke",
    "sid",
    "experimental",
    "oldoldstable",
    "oldstable",
    "stable",
    "testing",
    "unstable",
];

pub(super) struct Apt {
    dir: PathBuf,
    /// The host's Debian codename, e.g. "bookworm".
    codename: String,
    options: Vec<String>,
    /// The sources with the newer suites too, for a lookup the host's suites cannot answer.
    newer_sources: String,
    /// Whether the lists in use cover the newer suites.
    newer: Cell<bool>,
    /// Whether `apt-get update` ran during this process, so a failed lookup does not refresh
    /// twice.
    updated: Cell<bool>,
}

/// Which suites a private sources.list names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Suites {
    /// The host's: `<codename>`, `-updates`, `-backports`, `-security`.
    Host,
    /// The host's and `NEWER_SUITES`.
    Newer,
}

/// One available version of a package, and the suite that offers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Candidate {
    pub(super) package: String,
    pub(super) version: String,
    pub(super) suite: String,
}

/// The fields of one package record (`apt-cache show`), in order.
pub(super) type Fields = Vec<(String, String)>;

/// Sets up the private apt configuration under `cache_dir/apt` and refreshes its package lists
/// if they are missing, older than a day, or were fetched for other sources.
pub(super) fn open(cache_dir: &Path) -> anyhow::Result<Apt> {
    let dir = cache_dir.join("apt");
    for sub in [
        "etc/sources.list.d",
        "etc/preferences.d",
        "state/lists/partial",
        "cache/archives/partial",
        "debs",
    ] {
        let path = dir.join(sub);
        fs::create_dir_all(&path).with_context(|| format!("cannot create {}", path.display()))?;
    }
    let status = dir.join("state/status");
    if !status.exists() {
        fs::write(&status, "").with_context(|| format!("cannot create {}", status.display()))?;
    }

    let codename = host_codename()?;
    let system = read_system_sources()?;
    let host_sources = private_sources(&system, &codename, Suites::Host)?;
    let apt = Apt {
        options: options(&dir)?,
        newer_sources: private_sources(&system, &codename, Suites::Newer)?,
        newer: Cell::new(false),
        dir,
        codename,
        updated: Cell::new(false),
    };
    if let Err(e) = apt.update(&host_sources, false) {
        // Offline: the lists of the last update serve, for the sources they were fetched for.
        let Ok(stamp) = fs::read_to_string(apt.dir.join("update-stamp")) else {
            return Err(e);
        };
        write_sources(&apt.dir, &stamp)?;
        apt.newer.set(covers(&stamp, &apt.newer_sources));
        eprintln!("warning: cannot refresh the package lists, using the old ones: {e:#}");
    }
    Ok(apt)
}

impl Apt {
    pub(super) fn codename(&self) -> &str {
        &self.codename
    }

    /// Points the private configuration at `sources` and runs `apt-get update`, unless
    /// `force` is off and lists of the last day cover them: those serve as they are, whatever
    /// more they cover, so that one run's lookups never lose the suites another run added.
    fn update(&self, sources: &str, force: bool) -> anyhow::Result<()> {
        // Held from the sources' write to the stamp's: no run sees lists the stamp does not name.
        let _lock = self.lock()?;
        let fresh = fresh_stamp(&self.dir).filter(|it| covers(it, sources));
        if let (Some(stamp), false) = (&fresh, force) {
            write_sources(&self.dir, stamp)?;
            self.newer.set(covers(stamp, &self.newer_sources));
            return Ok(());
        }
        let sources = fresh.as_deref().unwrap_or(sources);
        write_sources(&self.dir, sources)?;
        eprintln!(
            "updating package lists (private apt config in {}) ...",
            self.dir.display()
        );
        let sh = Shell::new()?;
        let options = &self.options;
        let log = self.dir.join("update.log");
        run_logged(cmd!(sh, "apt-get {options...} update"), &log)
            .context("cannot update the private package lists")?;
        self.updated.set(true);
        self.newer.set(covers(sources, &self.newer_sources));
        let stamp = self.dir.join("update-stamp");
        fs::write(&stamp, sources).with_context(|| format!("cannot write {}", stamp.display()))
    }

    /// After a lookup found nothing: adds the newer suites to the lists if they lack them,
    /// else refreshes the lists unless that already happened in this process. Returns whether
    /// it did either, i.e. whether retrying the lookup makes sense.
    pub(super) fn refresh_after_miss(&self) -> anyhow::Result<bool> {
        if !self.newer.get() {
            eprintln!(
                "not in {}'s suites: adding {} to the private package lists",
                self.codename,
                NEWER_SUITES.join(", ")
            );
            self.update(&self.newer_sources, false)?;
        } else if self.updated.get() {
            return Ok(false);
        } else {
            self.update(&self.newer_sources, true)?;
        }
        Ok(true)
    }

    /// Names of all packages the lists know that start with `prefix`.
    pub(super) fn package_names(&self, prefix: &str) -> anyhow::Result<Vec<String>> {
        let sh = Shell::new()?;
        let options = &self.options;
        let out = self.query(cmd!(sh, "apt-cache {options...} pkgnames {prefix}"))?;
        Ok(out.lines().map(str::to_owned).collect())
    }

    /// All versions of `packages`, with the suites that offer them.
    pub(super) fn versions(&self, packages: &[String]) -> anyhow::Result<Vec<Candidate>> {
        if packages.is_empty() {
            return Ok(Vec::new());
        }
        let sh = Shell::new()?;
        let options = &self.options;
        let out = self.query(cmd!(sh, "apt-cache {options...} madison {packages...}"))?;
        Ok(parse_madison(&out))
    }

    /// The record of `package` at `version`, or `None` if the lists have no such version.
    pub(super) fn show(&self, package: &str, version: &str) -> anyhow::Result<Option<Fields>> {
        let sh = Shell::new()?;
        let options = &self.options;
        let spec = format!("{package}={version}");
        let _lock = self.lock()?;
        let output = cmd!(sh, "apt-cache {options...} show {spec}")
            .quiet()
            .ignore_status()
            .output()
            .context("cannot run apt-cache")?;
        let out = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() || out.trim().is_empty() {
            return Ok(None);
        }
        Ok(parse_stanzas(&out).into_iter().next())
    }

    /// Downloads `package` at `version` into `<cache>/apt/debs` and returns the .deb's path.
    pub(super) fn download(&self, package: &str, version: &str) -> anyhow::Result<PathBuf> {
        let debs = self.dir.join("debs");
        // apt-get names the file <package>_<version with ':' escaped>_<arch>.deb.
        let prefix = format!("{package}_{}_", version.replace(':', "%3a"));
        let find = || -> anyhow::Result<Option<PathBuf>> {
            for entry in fs::read_dir(&debs)? {
                let name = entry?.file_name();
                let name = name.to_string_lossy();
                if name.starts_with(&prefix) && name.ends_with(".deb") {
                    return Ok(Some(debs.join(&*name)));
                }
            }
            Ok(None)
        };
        if let Some(path) = find()? {
            return Ok(path);
        }
        eprintln!("fetching {package} {version} ...");
        let sh = Shell::new()?;
        sh.change_dir(&debs);
        let options = &self.options;
        let spec = format!("{package}={version}");
        let log = self.dir.join("download.log");
        let res = {
            let _lock = self.lock()?;
            run_logged(cmd!(sh, "apt-get {options...} download {spec}"), &log)
        };
        if let Err(e) = res {
            // The archive may have dropped that version since the lists were fetched.
            if !self.refresh_after_miss()? {
                return Err(e).with_context(|| format!("cannot download {package} {version}"));
            }
            let _lock = self.lock()?;
            run_logged(cmd!(sh, "apt-get {options...} download {spec}"), &log)
                .with_context(|| format!("cannot download {package} {version}"))?;
        }
        find()?.ok_or_else(|| {
            format_err!(
                "apt-get download {spec} succeeded but left no {prefix}*.deb in {}",
                debs.display()
            )
        })
    }

    fn query(&self, cmd: xshell::Cmd<'_>) -> anyhow::Result<String> {
        let _lock = self.lock()?;
        let cmd = cmd.quiet().ignore_status();
        let cmd_line = cmd.to_string();
        let output = cmd
            .output()
            .with_context(|| format!("cannot run `{cmd_line}`"))?;
        if !output.status.success() {
            return Err(format_err!(
                "`{cmd_line}` failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    fn lock(&self) -> anyhow::Result<FileLock> {
        lock_file(&self.dir.join("lock"))
    }
}

/// The `-o` options that point apt at the private configuration under `dir`.
fn options(dir: &Path) -> anyhow::Result<Vec<String>> {
    let path = |sub: &str| dir.join(sub).display().to_string();
    let mut settings = vec![
        format!("Dir::Etc::SourceList={}", path("etc/sources.list")),
        format!("Dir::Etc::SourceParts={}", path("etc/sources.list.d")),
        format!("Dir::Etc::Preferences={}", path("etc/preferences")),
        format!("Dir::Etc::PreferencesParts={}", path("etc/preferences.d")),
        format!("Dir::State={}", path("state")),
        format!("Dir::State::status={}", path("state/status")),
        format!("Dir::Cache={}", path("cache")),
        // The system may disable the binary caches (Docker images do); they make lookups fast.
        "Dir::Cache::pkgcache=pkgcache.bin".to_owned(),
        "Dir::Cache::srcpkgcache=srcpkgcache.bin".to_owned(),
        "APT::Get::List-Cleanup=true".to_owned(),
        "Acquire::Languages=none".to_owned(),
    ];
    // Only the Packages indices are needed; skip AppStream metadata and the like that the
    // system's apt.conf.d may add.
    let sh = Shell::new()?;
    let dump = cmd!(sh, "apt-config dump")
        .quiet()
        .read()
        .context("cannot run apt-config")?;
    for target in extra_index_targets(&dump) {
        settings.push(format!(
            "Acquire::IndexTargets::deb::{target}::DefaultEnabled=false"
        ));
    }
    if rustix::process::geteuid().is_root() {
        // apt drops to the _apt user for downloads, which cannot enter a cache under /root;
        // say so up front rather than get a warning on every download.
        settings.push("APT::Sandbox::User=root".to_owned());
    }
    Ok(settings
        .into_iter()
        .flat_map(|it| ["-o".to_owned(), it])
        .collect())
}

/// The sources the last `apt-get update` used, if it ran less than `LISTS_MAX_AGE` ago.
fn fresh_stamp(dir: &Path) -> Option<String> {
    let stamp = dir.join("update-stamp");
    let age = fs::metadata(&stamp)
        .and_then(|it| it.modified())
        .map(|it| SystemTime::now().duration_since(it).unwrap_or_default());
    match age {
        Ok(age) if age < LISTS_MAX_AGE => fs::read_to_string(&stamp).ok(),
        _ => None,
    }
}

/// Whether the sources.list `have` names every source `want` does.
fn covers(have: &str, want: &str) -> bool {
    let lines = |text: &str| {
        text.lines()
            .map(str::trim)
            .filter(|it| it.starts_with("deb "))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let have = lines(have);
    lines(want).iter().all(|it| have.contains(it))
}

fn write_sources(dir: &Path, sources: &str) -> anyhow::Result<()> {
    let path = dir.join("etc/sources.list");
    if fs::read_to_string(&path).ok().as_deref() != Some(sources) {
        fs::write(&path, sources).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

/// An apt source of type `deb` that is enabled.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SourceEntry {
    uris: Vec<String>,
    suites: Vec<String>,
    /// A keyring path; `None` if unset or given inline.
    signed_by: Option<String>,
}

fn read_system_sources() -> anyhow::Result<Vec<SourceEntry>> {
    let mut entries = Vec::new();
    let list = Path::new("/etc/apt/sources.list");
    if let Ok(text) = fs::read_to_string(list) {
        entries.extend(parse_one_line(&text));
    }
    let parts = Path::new("/etc/apt/sources.list.d");
    let mut files: Vec<PathBuf> = match fs::read_dir(parts) {
        Ok(it) => it.filter_map(|it| Some(it.ok()?.path())).collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    for file in files {
        let is_list = file.extension().is_some_and(|it| it == "list");
        let is_sources = file.extension().is_some_and(|it| it == "sources");
        if !is_list && !is_sources {
            continue;
        }
        let text =
            fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?;
        if is_list {
            entries.extend(parse_one_line(&text));
        } else {
            entries.extend(parse_deb822(&text));
        }
    }
    Ok(entries)
}

fn host_codename() -> anyhow::Result<String> {
    let path = "/etc/os-release";
    let text = fs::read_to_string(path).with_context(|| format!("cannot read {path}"))?;
    text.lines()
        .find_map(|line| line.strip_prefix("VERSION_CODENAME="))
        .map(|it| it.trim_matches('"').to_owned())
        .filter(|it| !it.is_empty())
        .ok_or_else(|| {
            format_err!(
                "cannot tell this host's Debian release: {path} has no VERSION_CODENAME; \
                 the kernel fetcher needs a Debian host"
            )
        })
}

/// Parses deb822-style sources (`/etc/apt/sources.list.d/*.sources`).
fn parse_deb822(text: &str) -> Vec<SourceEntry> {
    let mut entries = Vec::new();
    for stanza in parse_stanzas(text) {
        let field = |name: &str| -> Option<&str> {
            stanza
                .iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.as_str())
        };
        let words = |name: &str| -> Vec<String> {
            field(name)
                .unwrap_or("")
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        };
        if !words("Types").iter().any(|it| it == "deb") {
            continue;
        }
        if field("Enabled").is_some_and(|it| it.trim().eq_ignore_ascii_case("no")) {
            continue;
        }
        // An inline key is a multi-line value; only a path (or paths) fits on one line.
        let signed_by = field("Signed-By")
            .map(str::trim)
            .filter(|it| !it.is_empty() && !it.contains('\n') && it.starts_with('/'))
            .map(str::to_owned);
        entries.push(SourceEntry {
            uris: words("URIs"),
            suites: words("Suites"),
            signed_by,
        });
    }
    entries
}

/// Parses one-line-style sources (`/etc/apt/sources.list`, `*.list`).
fn parse_one_line(text: &str) -> Vec<SourceEntry> {
    let mut entries = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line
            .strip_prefix("deb ")
            .or_else(|| line.strip_prefix("deb\t"))
        else {
            continue;
        };
        let rest = rest.trim_start();
        let (options, rest) = match rest.strip_prefix('[') {
            Some(it) => match it.split_once(']') {
                Some((options, rest)) => (options, rest),
                None => continue,
            },
            None => ("", rest),
        };
        let mut words = rest.split_whitespace();
        let (Some(uri), Some(suite)) = (words.next(), words.next()) else {
            continue;
        };
        let signed_by = options
            .split_whitespace()
            .find_map(|it| it.strip_prefix("signed-by="))
            .map(str::to_owned);
        entries.push(SourceEntry {
            uris: vec![uri.to_owned()],
            suites: vec![suite.to_owned()],
            signed_by,
        });
    }
    entries
}

/// The private sources.list: every Debian archive URI of the system's sources with the host's
/// suites (`<codename>`, `-updates`, `-backports`) and, for `Suites::Newer`, the newer ones,
/// and the security archive with `<codename>-security`. Component `main` only: that is where
/// the kernels are.
fn private_sources(
    entries: &[SourceEntry],
    codename: &str,
    which: Suites,
) -> anyhow::Result<String> {
    let is_debian_suite = |suite: &str| {
        let suite = suite.split('/').next().unwrap_or(suite);
        let first = suite.split('-').next().unwrap_or(suite);
        suite == "rc-buggy" || first == codename || DEBIAN_SUITES.contains(&first)
    };
    let is_security_suite =
        |suite: &str| suite.ends_with("-security") || suite.contains("/updates");

    // (uri, keyring) in the order the system lists them, without duplicates.
    let mut archives: Vec<(String, Option<String>)> = Vec::new();
    let mut security: Vec<(String, Option<String>)> = Vec::new();
    for entry in entries {
        if !entry.suites.iter().any(|it| is_debian_suite(it)) {
            continue;
        }
        let is_security = entry.suites.iter().any(|it| is_security_suite(it));
        let list = if is_security {
            &mut security
        } else {
            &mut archives
        };
        for uri in &entry.uris {
            let uri = uri.trim_end_matches('/').to_owned();
            if !list.iter().any(|(it, _)| *it == uri) {
                list.push((uri, entry.signed_by.clone()));
            }
        }
    }
    if archives.is_empty() {
        return Err(format_err!(
            "no Debian archive in the system's apt sources (/etc/apt/sources.list, \
             /etc/apt/sources.list.d/*.{{list,sources}}); add the Debian mirror for {codename} \
             there (the kernel fetcher only reads it)"
        ));
    }
    if security.is_empty() {
        // The security archive usually sits next to the main one: .../debian -> .../debian-security.
        security.extend(
            archives
                .iter()
                .filter(|(uri, _)| uri.ends_with("/debian"))
                .map(|(uri, key)| (format!("{uri}-security"), key.clone())),
        );
    }

    let mut suites: Vec<String> = ["", "-updates", "-backports"]
        .iter()
        .map(|it| format!("{codename}{it}"))
        .collect();
    for suite in NEWER_SUITES.iter().filter(|_| which == Suites::Newer) {
        if !suites.iter().any(|it| it == suite) {
            suites.push((*suite).to_owned());
        }
    }
    let line = |uri: &str, key: &Option<String>, suite: &str| match key {
        Some(key) => format!("deb [signed-by={key}] {uri} {suite} main\n"),
        None => format!("deb {uri} {suite} main\n"),
    };
    let mut text = String::from("# Written by fgds from the system's apt sources.\n");
    for (uri, key) in &archives {
        for suite in &suites {
            text.push_str(&line(uri, key, suite));
        }
    }
    for (uri, key) in &security {
        text.push_str(&line(uri, key, &format!("{codename}-security")));
    }
    Ok(text)
}

/// Index targets besides `Packages` in an `apt-config dump`, e.g. "DEP-11".
fn extra_index_targets(dump: &str) -> Vec<String> {
    let mut targets: Vec<String> = Vec::new();
    for line in dump.lines() {
        let Some(rest) = line.strip_prefix("Acquire::IndexTargets::deb::") else {
            continue;
        };
        let name = rest.split([':', ' ']).next().unwrap_or("");
        if !name.is_empty() && name != "Packages" && !targets.iter().any(|it| it == name) {
            targets.push(name.to_owned());
        }
    }
    targets
}

/// Parses `apt-cache madison` output: `package | version | uri suite/component arch Packages`.
fn parse_madison(text: &str) -> Vec<Candidate> {
    let mut res = Vec::new();
    for line in text.lines() {
        let mut fields = line.split('|').map(str::trim);
        let (Some(package), Some(version), Some(source)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if !source.ends_with("Packages") {
            continue;
        }
        let Some(dist) = source.split_whitespace().nth(1) else {
            continue;
        };
        let suite = dist.split('/').next().unwrap_or(dist);
        res.push(Candidate {
            package: package.to_owned(),
            version: version.to_owned(),
            suite: suite.to_owned(),
        });
    }
    res
}

/// Parses deb822 stanzas (`Key: value`, continuation lines start with a blank, `#` comments).
/// Continuation lines are joined to the value with '\n'.
fn parse_stanzas(text: &str) -> Vec<Fields> {
    let mut stanzas = Vec::new();
    let mut current: Fields = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !current.is_empty() {
                stanzas.push(std::mem::take(&mut current));
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        if line.starts_with([' ', '\t']) {
            if let Some((_, value)) = current.last_mut() {
                value.push('\n');
                value.push_str(line.trim());
            }
            continue;
        }
        if let Some((key, value)) = line.split_once(':') {
            current.push((key.trim().to_owned(), value.trim().to_owned()));
        }
    }
    if !current.is_empty() {
        stanzas.push(current);
    }
    stanzas
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEB822: &str = "\
Types: deb
# http://snapshot.example.org/archive/debian/20250520T000000Z
URIs: http://mirror.example.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb deb-src
URIs: http://mirror.example.org/debian-security/
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: https://vendor.example.com/node_20.x
Suites: nodistro
Components: main
Signed-By: /usr/share/keyrings/vendor.gpg

Types: deb
URIs: http://disabled.example.org/debian
Suites: sid
Components: main
Enabled: no

Types: deb
URIs: http://inline.example.org/debian
Suites: trixie
Components: main contrib
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 .
 mQINBF...
 -----END PGP PUBLIC KEY BLOCK-----
";

    #[test]
    fn parses_deb822_sources() {
        let entries = parse_deb822(DEB822);
        let keyring = Some("/usr/share/keyrings/debian-archive-keyring.gpg".to_owned());
        assert_eq!(entries.len(), 4, "{entries:#?}");
        assert_eq!(
            entries[0],
            SourceEntry {
                uris: vec!["http://mirror.example.org/debian".to_owned()],
                suites: vec!["bookworm".to_owned(), "bookworm-updates".to_owned()],
                signed_by: keyring.clone(),
            }
        );
        assert_eq!(entries[1].suites, ["bookworm-security"]);
        assert_eq!(entries[1].signed_by, keyring);
        assert_eq!(entries[2].suites, ["nodistro"]);
        // The disabled stanza is skipped; an inline key is not a keyring path.
        assert_eq!(entries[3].uris, ["http://inline.example.org/debian"]);
        assert_eq!(entries[3].signed_by, None);
    }

    #[test]
    fn parses_one_line_sources() {
        let text = "\
# deb http://commented.example.org/debian sid main
deb http://mirror.example.org/debian bookworm main contrib
deb-src http://mirror.example.org/debian bookworm main
deb [arch=amd64 signed-by=/etc/apt/keyrings/x.gpg] http://mirror.example.org/debian-security bookworm-security main # comment
deb https://packages.example.com/apt cloud-sdk-bookworm main
deb [broken http://nowhere.example.org/debian sid main
";
        let entries = parse_one_line(text);
        assert_eq!(entries.len(), 3, "{entries:#?}");
        assert_eq!(entries[0].uris, ["http://mirror.example.org/debian"]);
        assert_eq!(entries[0].suites, ["bookworm"]);
        assert_eq!(entries[0].signed_by, None);
        assert_eq!(
            entries[1].uris,
            ["http://mirror.example.org/debian-security"]
        );
        assert_eq!(entries[1].suites, ["bookworm-security"]);
        assert_eq!(
            entries[1].signed_by.as_deref(),
            Some("/etc/apt/keyrings/x.gpg")
        );
        assert_eq!(entries[2].suites, ["cloud-sdk-bookworm"]);
    }

    #[test]
    fn derives_private_sources() {
        let mut entries = parse_deb822(DEB822);
        entries.extend(parse_one_line(
            "deb https://packages.example.com/apt cloud-sdk-bookworm main",
        ));
        let text = private_sources(&entries, "bookworm", Suites::Newer).unwrap();
        let key = "[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]";
        let expected = format!(
            "\
# Written by fgds from the system's apt sources.
deb {key} http://mirror.example.org/debian bookworm main
deb {key} http://mirror.example.org/debian bookworm-updates main
deb {key} http://mirror.example.org/debian bookworm-backports main
deb {key} http://mirror.example.org/debian trixie main
deb {key} http://mirror.example.org/debian sid main
deb {key} http://mirror.example.org/debian experimental main
deb http://inline.example.org/debian bookworm main
deb http://inline.example.org/debian bookworm-updates main
deb http://inline.example.org/debian bookworm-backports main
deb http://inline.example.org/debian trixie main
deb http://inline.example.org/debian sid main
deb http://inline.example.org/debian experimental main
deb {key} http://mirror.example.org/debian-security bookworm-security main
"
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn derives_the_security_archive_when_the_system_has_none() {
        let entries = parse_one_line("deb http://mirror.example.org/debian/ bookworm main");
        let text = private_sources(&entries, "bookworm", Suites::Newer).unwrap();
        assert!(
            text.contains("deb http://mirror.example.org/debian sid main\n"),
            "{text}"
        );
        assert!(
            text.ends_with(
                "deb http://mirror.example.org/debian-security bookworm-security main\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn fails_without_a_debian_archive() {
        let entries =
            parse_one_line("deb https://packages.example.com/apt cloud-sdk-bookworm main");
        let err = private_sources(&entries, "bookworm", Suites::Host)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no Debian archive"), "{err}");
    }

    #[test]
    fn host_sources_name_only_the_hosts_suites() {
        let entries = parse_deb822(DEB822);
        let host = private_sources(&entries, "bookworm", Suites::Host).unwrap();
        let newer = private_sources(&entries, "bookworm", Suites::Newer).unwrap();
        for suite in NEWER_SUITES {
            assert!(!host.contains(&format!(" {suite} main")), "{host}");
        }
        assert!(host.contains(" bookworm-backports main\n"), "{host}");
        assert!(host.contains(" bookworm-security main\n"), "{host}");
        // Lists fetched for the newer suites serve a run that needs the host's alone, and not
        // the other way round.
        assert!(covers(&newer, &host));
        assert!(!covers(&host, &newer));
        assert!(covers(&host, &host));
        // Comments and order do not matter; a missing source does.
        let reordered: String = host.lines().rev().map(|it| format!("{it}\n")).collect();
        assert!(covers(&reordered, &host));
        let fewer = host.replace(
            "deb http://inline.example.org/debian bookworm-updates main\n",
            "",
        );
        assert!(!covers(&fewer, &host));
    }

    #[test]
    fn finds_extra_index_targets() {
        let dump = "\
Acquire::IndexTargets \"\";
Acquire::IndexTargets::deb \"\";
Acquire::IndexTargets::deb::Packages \"\";
Acquire::IndexTargets::deb::Packages::MetaKey \"$(COMPONENT)/binary-$(ARCHITECTURE)/Packages\";
Acquire::IndexTargets::deb::DEP-11 \"\";
Acquire::IndexTargets::deb::DEP-11::MetaKey \"$(COMPONENT)/dep11/Components.yml\";
Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled \"false\";
Acquire::IndexTargets::deb-src::Sources \"\";
";
        assert_eq!(extra_index_targets(dump), ["DEP-11", "DEP-11-icons-small"]);
    }

    #[test]
    fn parses_madison() {
        let text = "\
linux-image-amd64 | 7.3~rc7-1~exp1 | http://mirror.example.org/debian experimental/main amd64 Packages
linux-image-amd64 | 6.1.192-3 | http://mirror.example.org/debian-security bookworm-security/main amd64 Packages
    linux | 6.1.192-3 | http://mirror.example.org/debian bookworm/main Sources
";
        let candidates = parse_madison(text);
        assert_eq!(candidates.len(), 2);
        assert_eq!(
            candidates[1],
            Candidate {
                package: "linux-image-amd64".to_owned(),
                version: "6.1.192-3".to_owned(),
                suite: "bookworm-security".to_owned(),
            }
        );
        assert_eq!(candidates[0].suite, "experimental");
    }
}
