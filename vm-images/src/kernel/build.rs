//! `build:X.Y[+debug][+PATCH...]`: a guest kernel built from Debian's `linux-source-X.Y` with the
//! rig's config fragments (`vm-images/configs/`) and, for each `+PATCH` in order, the kernel change
//! `kernel-patches/PATCH/X.Y.patch` applied to a copy of the tree (hard links, so
//! the copy costs seconds), cached by version and a hash of everything that changes the result.
//!
//! ```text
//! kernels/build-<series>[-debug]-<key>/
//!     build/              the O= build tree: kdir for module builds, bzImage, .config
//!     modules/lib/modules/<release>/   `make modules_install` (modules.builtin, modules.dep)
//!                         (usr/lib/modules where kbuild installs there)
//!     .fgds-configured    the .config is merged and verified; a build may resume
//!     .fgds-built         written last: the kernel is complete
//! kernels/build-<series>[-debug]-<key>.log   every command and the full make output
//! kernels/build-<series>[-debug].cc-count    files the last complete build compiled
//! ```
//!
//! The config: `make tinyconfig`, the fragments merged over it (base.config, then debug.config
//! for `+debug`), `make olddefconfig`, then a check that every setting of the fragments holds.

use std::{
    fs,
    io::{Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use xshell::{Shell, cmd};

use super::{
    FileLock, Kernel, KernelSpec, append_log, apt, host, kbuild, kconfig, lock_file_announced,
    remove_dir_all_if_exists, run_logged, source, tree, with_suffix,
};

/// Written last into a complete build; holds what `load_built` needs.
const MARKER: &str = ".fgds-built";
/// Written once the .config is merged and verified; with it, an interrupted build resumes.
const CONFIGURED: &str = ".fgds-configured";
/// The config the fragments are merged over.
const BASE_TARGET: &str = "tinyconfig";
/// Changes whenever the steps below change what they produce; part of the cache key.
const RECIPE: &str = "fgds build recipe 1: tinyconfig, fragments, olddefconfig, bzImage modules";
/// How often a long build prints a progress line.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);
/// Variables of the caller's environment that would change what kbuild does.
const KBUILD_ENV: &[&str] = &[
    "ARCH",
    "CROSS_COMPILE",
    "KBUILD_OUTPUT",
    "KCONFIG_CONFIG",
    "LOCALVERSION",
    "CC",
    "LD",
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
    "KCFLAGS",
    "KCPPFLAGS",
];

pub(super) fn prepare(
    series: &str,
    debug: bool,
    patches: &[String],
    cache_dir: &Path,
) -> anyhow::Result<Kernel> {
    let spec = KernelSpec::Build {
        series: series.to_owned(),
        debug,
        patches: patches.to_vec(),
    };
    let patches = patches
        .iter()
        .map(|name| change_patches(name, series))
        .collect::<anyhow::Result<Vec<_>>>()?
        .into_iter()
        .flatten()
        .collect::<Vec<_>>();
    let host_log = cache_dir.join("host-packages.log");
    host::ensure(host::UNPACK, &host_log)?;
    host::ensure(host::BUILD, &host_log)?;
    let apt = apt::open(cache_dir)?;
    let (package, version) = source::pick(&apt, series)?;
    let mut fragments = fragments(debug);
    for name in spec_patches(&spec) {
        fragments.extend(change_fragment(name)?);
    }
    let settings = kconfig::settings(&fragments)?;
    let toolchain = toolchain()?;
    let mut parts = vec![RECIPE, &package, &version, &toolchain];
    for fragment in &fragments {
        parts.extend([fragment.name, fragment.text]);
    }
    for patch in &patches {
        parts.extend([patch.name.as_str(), patch.text.as_str()]);
    }
    let key = kconfig::cache_key(&parts);

    let kernels = cache_dir.join("kernels");
    fs::create_dir_all(&kernels).with_context(|| format!("cannot create {}", kernels.display()))?;
    let root = kernels.join(format!("{}-{key}", spec.slug()));
    let lock = lock_file_announced(
        &with_suffix(&root, ".lock"),
        &format!(
            "waiting for another process building {spec} in {}",
            root.display()
        ),
    )?;
    if let Some(kernel) = load_built(&root, &spec, &version)? {
        return Ok(kernel);
    }
    let job = Job {
        lock: &lock,
        spec: &spec,
        package: &package,
        version: &version,
        key: &key,
        settings: &settings,
        root: &root,
        log: with_suffix(&root, ".log"),
        count_file: kernels.join(format!("{}.cc-count", spec.slug())),
    };
    let mut src = source::unpack(&apt, cache_dir, &package, &version)?;
    if !patches.is_empty() {
        src = patched_tree(&src, &root, &patches, &job.log)?;
    }
    job.build(&src).with_context(|| {
        format!(
            "cannot build {spec} from {package} {version} (log: {})",
            job.log.display()
        )
    })
}

/// The series a kernel change has patches for, for error messages.
fn patched_series(name: &str) -> String {
    let mut series = fs::read_dir(super::kernel_patches_dir().join(name))
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_string_lossy().into_owned();
            let series = name
                .strip_suffix(".patch")
                .or_else(|| name.strip_suffix(".series"))?;
            // `7.2.patch`, `7.2.series`; not the files a series lists (`7.2-prep.patch`).
            series
                .chars()
                .all(|c| c.is_ascii_digit() || c == '.')
                .then(|| series.to_owned())
        })
        .collect::<Vec<_>>();
    series.sort();
    series.dedup();
    if series.is_empty() {
        "no series".to_owned()
    } else {
        series.join(", ")
    }
}

/// A patch to apply: the kernel change it belongs to, its file and its text.
struct Patch {
    name: String,
    path: PathBuf,
    text: String,
}

/// The patches of kernel change `name` for `series`, in order: its `<series>.patch`, or the
/// files its `<series>.series` lists, one per line (`#` comments and blank lines aside): a file
/// of the change's directory, or `comparators:<dir>/<file>`, a third-party series read from
/// [`super::comparators_dir`].
fn change_patches(name: &str, series: &str) -> anyhow::Result<Vec<Patch>> {
    let dir = super::kernel_patches_dir().join(name);
    let read = |path: PathBuf| -> anyhow::Result<Patch> {
        let text = fs::read_to_string(&path)
            .with_context(|| format!("cannot read {} (kernel change {name})", path.display()))?;
        Ok(Patch {
            name: name.to_owned(),
            path,
            text,
        })
    };
    let single = dir.join(format!("{series}.patch"));
    if single.exists() {
        return Ok(vec![read(single)?]);
    }
    let list = dir.join(format!("{series}.series"));
    let text = fs::read_to_string(&list).with_context(|| {
        format!(
            "the kernel change {name} has no patch for {series} ({} or {}); it exists for: {}",
            single.display(),
            list.display(),
            patched_series(name)
        )
    })?;
    let mut patches = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let path = match line.strip_prefix("comparators:") {
            Some(rel) => {
                let path = super::comparators_dir().join(rel);
                if !path.exists() {
                    bail!(
                        "{}: {} is not there: the third-party series are read from {} (set \
                         FGDS_COMPARATORS to the folder that holds them)",
                        list.display(),
                        path.display(),
                        super::comparators_dir().display()
                    );
                }
                path
            }
            None => dir.join(line),
        };
        patches.push(read(path)?);
    }
    Ok(patches)
}

/// A copy of `src` with the kernel changes `patches` applied in order: `<root>.src/linux`, hard
/// links to the unpacked tree (GNU patch replaces a file it changes, so the original stays as
/// it was), made again from scratch unless a marker says it is complete. Beside the build's
/// root, which a fresh configuration empties.
fn patched_tree(src: &Path, root: &Path, patches: &[Patch], log: &Path) -> anyhow::Result<PathBuf> {
    let dir = with_suffix(root, ".src");
    let (tree, marker) = (dir.join("linux"), dir.join(".fgds-patched"));
    if marker.exists() && tree.join("Makefile").exists() {
        return Ok(tree);
    }
    remove_dir_all_if_exists(&dir)?;
    fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let sh = Shell::new()?;
    run_logged(cmd!(sh, "cp -al {src} {tree}"), log)?;
    sh.change_dir(&tree);
    for Patch { name, path, .. } in patches {
        eprintln!("applying the kernel change {name} ({})", path.display());
        // Fuzz 2 (GNU patch's default, said here): a series posted against another base may
        // need it (kernel-patches/README.md names where).
        run_logged(
            cmd!(
                sh,
                "patch -p1 --forward --batch --fuzz=2 --no-backup-if-mismatch -i {path}"
            ),
            log,
        )
        .with_context(|| {
            format!(
                "{} does not apply to {} with the changes before it: see {}",
                path.display(),
                src.display(),
                log.display()
            )
        })?;
    }
    let names: Vec<_> = patches
        .iter()
        .map(|p| p.path.display().to_string())
        .collect();
    fs::write(&marker, names.join("+"))
        .with_context(|| format!("cannot write {}", marker.display()))?;
    Ok(tree)
}

fn spec_patches(spec: &KernelSpec) -> &[String] {
    match spec {
        KernelSpec::Build { patches, .. } => patches,
        _ => &[],
    }
}

/// A kernel change's own config fragment (`kernel-patches/<change>/kernel.config`: what its code
/// or its tests need beyond base.config), merged after the rig's, so that only the kernels
/// built with the change carry it (and only their cache keys change).
fn change_fragment(name: &str) -> anyhow::Result<Option<kconfig::Fragment>> {
    let path = super::kernel_patches_dir().join(name).join("kernel.config");
    if !path.exists() {
        return Ok(None);
    }
    let text =
        fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    // The build lives as long as the process: leaking two strings gives them 'static.
    Ok(Some(kconfig::Fragment {
        name: Box::leak(format!("kernel-patches/{name}/kernel.config").into_boxed_str()),
        text: Box::leak(text.into_boxed_str()),
    }))
}

fn fragments(debug: bool) -> Vec<kconfig::Fragment> {
    let mut res = vec![kconfig::BASE];
    if debug {
        res.push(kconfig::DEBUG);
    }
    res
}

/// The compiler's and linker's versions: a new toolchain means a new build.
fn toolchain() -> anyhow::Result<String> {
    let sh = Shell::new()?;
    let first_line = |program: &str| -> anyhow::Result<String> {
        let out = cmd!(sh, "{program} --version")
            .quiet()
            .read()
            .with_context(|| format!("cannot run `{program} --version`; is it installed?"))?;
        Ok(out.lines().next().unwrap_or_default().to_owned())
    };
    Ok(format!("{}\n{}", first_line("gcc")?, first_line("ld")?))
}

/// Where a built kernel's parts are under its cache dir.
struct Layout {
    build: PathBuf,
    modules: PathBuf,
}

impl Layout {
    fn of(root: &Path) -> Layout {
        Layout {
            build: root.join("build"),
            modules: root.join("modules"),
        }
    }

    fn vmlinuz(&self) -> PathBuf {
        self.build.join("arch/x86/boot/bzImage")
    }

    fn config(&self) -> PathBuf {
        self.build.join(".config")
    }
}

/// The kernel built earlier in `root`, if it is complete.
fn load_built(root: &Path, spec: &KernelSpec, version: &str) -> anyhow::Result<Option<Kernel>> {
    let Ok(marker) = fs::read_to_string(root.join(MARKER)) else {
        return Ok(None);
    };
    let field = |key: &str| {
        marker
            .lines()
            .find_map(|it| it.strip_prefix(key)?.strip_prefix('='))
    };
    let (Some(release), Some(version_built), Some(modules_dir)) = (
        field("release"),
        field("package_version"),
        field("modules_dir"),
    ) else {
        return Ok(None);
    };
    if version_built != version {
        return Ok(None);
    }
    let layout = Layout::of(root);
    let kernel = Kernel {
        spec: spec.to_string(),
        release: release.to_owned(),
        package_version: version.to_owned(),
        vmlinuz: layout.vmlinuz(),
        modules_dir: root.join(modules_dir),
        kdir: layout.build.clone(),
        make_vars: marker
            .lines()
            .filter_map(|it| it.strip_prefix("make_var="))
            .map(str::to_owned)
            .collect(),
        config: layout.config(),
    };
    let needed = [
        kernel.vmlinuz.clone(),
        kernel.config.clone(),
        kernel.modules_dir.join("modules.dep"),
        kernel.kdir.join("Module.symvers"),
        kernel.kdir.join("scripts/mod/modpost"),
    ];
    if let Some(missing) = needed.iter().find(|it| !it.exists()) {
        eprintln!(
            "{spec}: {} is missing from the cached build; building again",
            missing.display()
        );
        return Ok(None);
    }
    Ok(Some(kernel))
}

/// One build of a `build:` kernel into its cache dir.
struct Job<'a> {
    /// The lock on this build's cache dir.
    lock: &'a FileLock,
    spec: &'a KernelSpec,
    package: &'a str,
    version: &'a str,
    key: &'a str,
    settings: &'a [kconfig::Setting],
    root: &'a Path,
    log: PathBuf,
    count_file: PathBuf,
}

impl Job<'_> {
    fn build(&self, src: &Path) -> anyhow::Result<Kernel> {
        let layout = Layout::of(self.root);
        let started = Instant::now();
        let resumable = self.root.join(CONFIGURED).exists() && layout.config().exists();
        if resumable {
            append_log(
                &self.log,
                "\nresuming an interrupted build (.fgds-configured is there)\n",
            )?;
            eprintln!(
                "{}: resuming the interrupted build in {} ...",
                self.spec,
                self.root.display()
            );
            if let Err(err) = self.compile(src, &layout, false) {
                append_log(&self.log, &format!("the resumed build failed: {err:#}\n"))?;
                eprintln!(
                    "{}: the resumed build failed; starting over from a clean tree",
                    self.spec
                );
                self.configure(src, &layout)?;
                self.compile(src, &layout, true)?;
            }
        } else {
            self.configure(src, &layout)?;
            self.compile(src, &layout, true)?;
        }
        let kernel = self.finish(&layout)?;
        let took = started.elapsed();
        eprintln!(
            "{}: built {} in {}",
            self.spec,
            kernel.release,
            format_duration(took)
        );
        self.write_marker(&kernel, took)?;
        Ok(kernel)
    }

    /// A fresh build tree with the merged and verified .config.
    fn configure(&self, src: &Path, layout: &Layout) -> anyhow::Result<()> {
        remove_dir_all_if_exists(self.root)?;
        fs::create_dir_all(&layout.build)
            .with_context(|| format!("cannot create {}", layout.build.display()))?;
        fs::write(
            &self.log,
            format!(
                "building {} from {} {} (key {}) in {}\n",
                self.spec,
                self.package,
                self.version,
                self.key,
                self.root.display()
            ),
        )
        .with_context(|| format!("cannot write {}", self.log.display()))?;
        eprintln!("{}: configuring ({BASE_TARGET} + fragments) ...", self.spec);
        let sh = Shell::new()?;
        let build = &layout.build;
        let out = format!("O={}", build.display());
        run_logged(
            without_kbuild_env(cmd!(sh, "make -C {src} {out} {BASE_TARGET}")),
            &self.log,
        )?;
        let config_path = layout.config();
        let base = fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let merged = kconfig::merge(&base, self.settings);
        fs::write(&config_path, merged)
            .with_context(|| format!("cannot write {}", config_path.display()))?;
        run_logged(
            without_kbuild_env(cmd!(sh, "make -C {src} {out} olddefconfig")),
            &self.log,
        )?;
        let config = fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let unmet = kconfig::unmet(&config, self.settings);
        if !unmet.is_empty() {
            bail!(
                "{}",
                kconfig::unmet_message(
                    &unmet,
                    &config_path.display().to_string(),
                    &src.display().to_string()
                )
            );
        }
        append_log(
            &self.log,
            &format!(
                "all {} settings of the fragments hold in {}\n",
                self.settings.len(),
                config_path.display()
            ),
        )?;
        let marker = self.root.join(CONFIGURED);
        fs::write(&marker, format!("key={}\n", self.key))
            .with_context(|| format!("cannot write {}", marker.display()))
    }

    /// `make bzImage modules`, with a progress line every 30 s. A `fresh` build (not a resumed
    /// one) records how many files it compiled, for the next build's estimate.
    fn compile(&self, src: &Path, layout: &Layout, fresh: bool) -> anyhow::Result<()> {
        let jobs = std::thread::available_parallelism().map_or(1, |it| it.get());
        let expected = fs::read_to_string(&self.count_file)
            .ok()
            .and_then(|it| it.trim().parse::<usize>().ok());
        let args = [
            "-C".to_owned(),
            src.display().to_string(),
            format!("O={}", layout.build.display()),
            format!("-j{jobs}"),
            "bzImage".to_owned(),
            "modules".to_owned(),
        ];
        append_log(&self.log, &format!("$ make {}\n", args.join(" ")))?;
        eprintln!(
            "{}: compiling with {jobs} jobs (about 12 min on 2 cores for a debug kernel; \
             full output in {}) ...",
            self.spec,
            self.log.display()
        );
        let log_file = fs::OpenOptions::new()
            .append(true)
            .open(&self.log)
            .with_context(|| format!("cannot open {}", self.log.display()))?;
        let mut offset = log_file.metadata()?.len();
        let mut command = Command::new("make");
        command
            .args(&args)
            // The lock file (empty, read at EOF if ever) as stdin: make and every compiler it
            // starts hold the lock, so if this process dies (SIGKILL, or a SIGTERM that make
            // does not get), the next one waits for the orphaned build, then resumes it,
            // instead of running a second make in the same tree.
            .stdin(Stdio::from(self.lock.file().try_clone()?))
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        for var in KBUILD_ENV {
            command.env_remove(var);
        }
        let mut child = command.spawn().context("cannot run make")?;
        let started = Instant::now();
        let mut last_report = started;
        let mut progress = Progress::default();
        let status = loop {
            if let Some(status) = child.try_wait().context("cannot wait for make")? {
                break status;
            }
            std::thread::sleep(Duration::from_millis(500));
            if last_report.elapsed() >= PROGRESS_EVERY {
                last_report = Instant::now();
                offset = feed_from(&self.log, offset, &mut progress)?;
                eprintln!(
                    "{}: {}",
                    self.spec,
                    progress.line(started.elapsed(), expected)
                );
            }
        };
        feed_from(&self.log, offset, &mut progress)?;
        if !status.success() {
            // Lossily: a compiler's non-UTF-8 byte must not hide every error line.
            let text = fs::read(&self.log)
                .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
                .unwrap_or_default();
            bail!(
                "`make {}` failed ({status}) after {}; its errors:\n{}\nthe full output is in {}",
                args.join(" "),
                format_duration(started.elapsed()),
                error_lines(&text),
                self.log.display()
            );
        }
        if fresh && progress.compiled > 0 {
            let _ = fs::write(&self.count_file, format!("{}\n", progress.compiled));
        }
        Ok(())
    }

    /// Installs the modules and checks that an out-of-tree module builds against the tree.
    fn finish(&self, layout: &Layout) -> anyhow::Result<Kernel> {
        let release_file = layout.build.join("include/config/kernel.release");
        let release = fs::read_to_string(&release_file)
            .with_context(|| format!("cannot read {}", release_file.display()))?
            .trim()
            .to_owned();
        for path in [layout.vmlinuz(), layout.build.join("Module.symvers")] {
            if !path.exists() {
                bail!("the build succeeded but left no {}", path.display());
            }
        }
        let modules_dir =
            tree::install_modules(&layout.build, &release, &layout.modules, &self.log)?;
        let config_text = fs::read_to_string(layout.config())?;
        let make_vars = kbuild::make_vars(&layout.build, &config_text)?;
        let kernel = Kernel {
            spec: self.spec.to_string(),
            release,
            package_version: self.version.to_owned(),
            vmlinuz: layout.vmlinuz(),
            modules_dir,
            kdir: layout.build.clone(),
            make_vars,
            config: layout.config(),
        };
        eprintln!(
            "{}: checking a module build against {} ...",
            self.spec, kernel.release
        );
        kbuild::check_build(&kernel, &self.root.join(".fgds-check"), &self.log)?;
        Ok(kernel)
    }

    fn write_marker(&self, kernel: &Kernel, took: Duration) -> anyhow::Result<()> {
        let mut marker = format!(
            "spec={}\nrelease={}\npackage={}\npackage_version={}\nkey={}\nbuild_secs={}\n",
            self.spec,
            kernel.release,
            self.package,
            self.version,
            self.key,
            took.as_secs()
        );
        let modules_dir = kernel
            .modules_dir
            .strip_prefix(self.root)
            .unwrap_or(&kernel.modules_dir);
        marker.push_str(&format!("modules_dir={}\n", modules_dir.display()));
        for var in &kernel.make_vars {
            marker.push_str(&format!("make_var={var}\n"));
        }
        let tmp = self.root.join(format!("{MARKER}.tmp"));
        fs::write(&tmp, marker).with_context(|| format!("cannot write {}", tmp.display()))?;
        fs::rename(&tmp, self.root.join(MARKER))
            .with_context(|| format!("cannot rename {}", tmp.display()))
    }
}

/// `cmd` without the caller's kbuild variables.
fn without_kbuild_env(cmd: xshell::Cmd<'_>) -> xshell::Cmd<'_> {
    KBUILD_ENV.iter().fold(cmd, |cmd, var| cmd.env_remove(var))
}

/// Feeds what `log` got after `offset` to `progress`; returns the new offset.
fn feed_from(log: &Path, offset: u64, progress: &mut Progress) -> anyhow::Result<u64> {
    let mut file = fs::File::open(log).with_context(|| format!("cannot read {}", log.display()))?;
    file.seek(SeekFrom::Start(offset))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    progress.feed(&String::from_utf8_lossy(&bytes));
    Ok(offset + bytes.len() as u64)
}

/// What a kbuild log says about a build's progress.
#[derive(Debug, Default)]
struct Progress {
    /// Files compiled (`CC` and `AS` lines).
    compiled: usize,
    /// The last step, e.g. "CC mm/kasan/shadow.o".
    step: String,
    /// An unfinished last line.
    partial: String,
}

impl Progress {
    fn feed(&mut self, text: &str) {
        self.partial.push_str(text);
        let Some(end) = self.partial.rfind('\n') else {
            return;
        };
        let complete: String = self.partial.drain(..=end).collect();
        for line in complete.lines() {
            let Some((verb, target)) = kbuild_step(line) else {
                continue;
            };
            if verb == "CC" || verb == "AS" {
                self.compiled += 1;
            }
            self.step = format!("{verb} {target}");
        }
    }

    fn line(&self, elapsed: Duration, expected: Option<usize>) -> String {
        let estimate = match expected {
            Some(total) if total > 0 => {
                format!(" (~{}%)", (self.compiled * 100 / total).min(99))
            }
            _ => String::new(),
        };
        let step = if self.step.is_empty() {
            "starting".to_owned()
        } else {
            format!("at {}", self.step)
        };
        format!(
            "{} elapsed, {} files compiled{estimate}, {step}",
            format_duration(elapsed),
            self.compiled
        )
    }
}

/// A kbuild quiet-mode line, `  CC [M]  drivers/x.o`, as ("CC", "drivers/x.o").
fn kbuild_step(line: &str) -> Option<(&str, &str)> {
    let rest = line.strip_prefix("  ")?;
    let (verb, target) = rest.split_once(char::is_whitespace)?;
    if verb.is_empty()
        || !verb
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    {
        return None;
    }
    let target = target.trim_start();
    let target = target.strip_prefix("[M]").unwrap_or(target).trim();
    (!target.is_empty()).then_some((verb, target))
}

/// The lines of a failed build's log that say why: compiler and make errors (the last 25),
/// or the last 25 lines when there are none.
fn error_lines(log: &str) -> String {
    let errors: Vec<&str> = log
        .lines()
        .filter(|it| it.contains("error") || it.contains("Error ") || it.contains("*** "))
        .collect();
    let lines: Vec<&str> = if errors.is_empty() {
        log.lines().collect()
    } else {
        errors
    };
    lines[lines.len().saturating_sub(25)..].join("\n")
}

fn format_duration(duration: Duration) -> String {
    let secs = duration.as_secs();
    format!("{}m{:02}s", secs / 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_kbuild_progress() {
        let mut progress = Progress::default();
        progress.feed("make[1]: Entering directory '/b'\n  GEN     Makefile\n  CC      init/main.o\n  AS      arch/x86/entry/entry_64.o\n  CC [M]  drivers/x.o\n  LD ");
        assert_eq!(progress.compiled, 3);
        assert_eq!(progress.step, "CC drivers/x.o");
        // The rest of a line cut at the end of a read comes with the next one.
        progress.feed("     vmlinux.o\nIn file included from x.c:1:\n");
        assert_eq!(progress.compiled, 3);
        assert_eq!(progress.step, "LD vmlinux.o");
        assert_eq!(
            progress.line(Duration::from_secs(330), Some(6)),
            "5m30s elapsed, 3 files compiled (~50%), at LD vmlinux.o"
        );
        assert_eq!(
            Progress::default().line(Duration::from_secs(5), None),
            "0m05s elapsed, 0 files compiled, starting"
        );
    }

    #[test]
    fn recognizes_kbuild_steps() {
        assert_eq!(
            kbuild_step("  HOSTCC  scripts/basic/fixdep"),
            Some(("HOSTCC", "scripts/basic/fixdep"))
        );
        assert_eq!(kbuild_step("  CC [M]  a.o"), Some(("CC", "a.o")));
        assert_eq!(
            kbuild_step("  Kernel: arch/x86/boot/bzImage is ready"),
            None
        );
        assert_eq!(kbuild_step("gcc: error: x"), None);
        assert_eq!(kbuild_step("  "), None);
    }

    #[test]
    fn picks_error_lines() {
        let log = "  CC a.o\nx.c:1: error: bad\nmake[2]: *** [x.o] Error 1\n  CC b.o\n";
        assert_eq!(
            error_lines(log),
            "x.c:1: error: bad\nmake[2]: *** [x.o] Error 1"
        );
        assert_eq!(error_lines("one\ntwo\n"), "one\ntwo");
    }
}
