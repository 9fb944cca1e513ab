//! The rig's guest init (PID 1), a static binary at `/init` in the initramfs.
//!
//! It mounts the kernel filesystems, loads the modules the plan names (kernel modules first,
//! then the rig's own), runs the test binaries one by one with a timeout each, streams their
//! KTAP output nested under one KTAP document on the virtio-serial port `fgds.ktap`, and powers
//! the machine off. Failures are reported as results, never by stopping early: the host counts
//! a missing result as a crash.
//!
//! The plan, `/etc/fgds/plan`, is written by the host, one directive a line:
//! `module <kernel|rig> <path> [params]`, `bind <device> <driver>` (binds a PCI device to a
//! driver with `driver_override`, between module loads, in plan order), `test <name> <path>
//! <timeout-seconds>` and `env <NAME> <value>` (set for every test). In module params and bind
//! lines `@ivshmem@` stands for the fake GPUs' PCI addresses (comma-separated, in address order).
//!
//! Tests get the rig's drives in their environment: `FGDS_NVME` (the raw drive: the pattern,
//! then scratch), `FGDS_EXT4` (where an ext4 filesystem on a second namespace is mounted) and
//! `FGDS_NVME2` (a second drive, on its own hot-pluggable slot); the plan's `env` lines (the
//! host sets `FGDS_EXPECTED_MODE`, the fgds mode the run's configuration implies); a kernel
//! parameter `fgds.<name>=<value>` becomes `FGDS_<NAME>=<value>`.
//!
//! The last line on the KTAP port is exactly `# fgds-rig: done`: the host takes a run whose
//! output lacks that line as cut short.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

const KTAP_PORT_NAME: &str = "fgds.ktap";
const PLAN: &str = "/etc/fgds/plan";
const LOADED: &str = "/run/fgds/modules";

struct Module {
    path: String,
    params: String,
}

/// One step of the setup, in plan order.
enum Step {
    Module(Module),
    /// Bind the PCI device to the driver.
    Bind {
        device: String,
        driver: String,
    },
}

struct Test {
    name: String,
    path: String,
    timeout: Duration,
}

/// What the plan says.
struct Plan {
    setup: Vec<Step>,
    tests: Vec<Test>,
    /// Environment variables for every test.
    env: Vec<(String, String)>,
}

fn main() {
    if let Err(err) = run() {
        console(&format!("fgds-init: {err:#}"));
    }
    bounded_sync();
    power_off();
}

/// How long the power-off waits for `sync(2)`.
const SYNC_BOUND: Duration = Duration::from_secs(10);

/// Syncs the filesystems, waiting at most [`SYNC_BOUND`]: the verdicts are already on the
/// KTAP port, and a drive a test left wedged (a request that never completes) must not keep
/// the machine up until the host's limit stops it.
fn bounded_sync() {
    let (done, synced) = mpsc::channel();
    std::thread::spawn(move || {
        rustix::fs::sync();
        let _ = done.send(());
    });
    if synced.recv_timeout(SYNC_BOUND).is_err() {
        console(&format!(
            "fgds-init: sync did not finish in {SYNC_BOUND:?} (a wedged drive?): powering off"
        ));
    }
}

/// How long the power-off may take before the init restarts the machine at once.
const POWER_OFF_BOUND: Duration = Duration::from_secs(20);

/// What the init prints when the power-off is stuck; the host reports the run's machine as
/// failed when the console has it (xtask/src/vm.rs).
const POWER_OFF_STUCK: &str = "fgds-init: the power-off did not finish";

/// Powers the machine off. The kernel's power-off shuts every device down under its device
/// lock: a removal a test left stuck (a driver waiting for ever) would hold it up until the
/// host's limit. Past [`POWER_OFF_BOUND`] the init prints [`POWER_OFF_STUCK`] and the blocked
/// tasks (sysrq `w`), and restarts at once (sysrq `b`: no device shutdown), which QEMU's
/// `-no-reboot` turns into its exit.
fn power_off() -> ! {
    std::thread::spawn(|| {
        // SAFETY: `reboot(2)` with RB_POWER_OFF has no memory-safety preconditions.
        unsafe { libc::reboot(libc::RB_POWER_OFF) };
    });
    std::thread::sleep(POWER_OFF_BOUND);
    console(&format!(
        "{POWER_OFF_STUCK} in {POWER_OFF_BOUND:?} (a device's shutdown or removal is stuck): \
         the blocked tasks follow, then an immediate restart"
    ));
    for key in ["w", "b"] {
        if let Err(err) = fs::write("/proc/sysrq-trigger", key) {
            console(&format!("fgds-init: sysrq {key}: {err}"));
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

fn run() -> anyhow::Result<()> {
    mount_kernel_filesystems()?;
    let Plan {
        setup: steps,
        tests,
        env,
    } = read_plan()?;
    // Modules first: the KTAP port's driver (virtio_console) may be one of them.
    kmsg("begin setup");
    let mut setup = load_modules(&steps);
    let (drives, drive_errors) = prepare_drives();
    if !drive_errors.is_empty() {
        let previous = setup.err().map(|e| format!("{e:#}\n")).unwrap_or_default();
        setup = Err(anyhow::format_err!("{previous}{}", drive_errors.join("\n")));
    }
    kmsg("end setup");
    let mut ktap = open_ktap_port()?;
    writeln!(ktap, "KTAP version 1")?;
    writeln!(ktap, "# fgds-rig: kernel {}", kernel_release())?;
    writeln!(ktap, "1..{}", tests.len() + 2)?;
    match &setup {
        Ok(()) => writeln!(ktap, "ok 1 setup")?,
        Err(err) => {
            for line in format!("{err:#}").lines() {
                writeln!(ktap, "# setup: {line}")?;
            }
            writeln!(ktap, "not ok 1 setup")?;
        }
    }
    ktap.flush()?;

    for (i, test) in tests.iter().enumerate() {
        run_test(&mut ktap, i + 2, test, &drives, &env)?;
    }
    kmsg("begin kmemleak");
    let leaks = kmemleak_scan();
    kmsg("end kmemleak");
    let number = tests.len() + 2;
    match leaks {
        Err(reason) => writeln!(ktap, "ok {number} kmemleak # SKIP {reason}")?,
        Ok(report) if report.trim().is_empty() => writeln!(ktap, "ok {number} kmemleak")?,
        Ok(report) => {
            for line in report.lines() {
                writeln!(ktap, "# kmemleak: {line}")?;
            }
            writeln!(ktap, "not ok {number} kmemleak")?;
        }
    }
    writeln!(ktap, "# fgds-rig: done")?;
    ktap.flush()?;
    Ok(())
}

fn mount_kernel_filesystems() -> anyhow::Result<()> {
    use rustix::mount::{MountFlags, mount};
    let mounts = [
        ("proc", "/proc", "proc"),
        ("sysfs", "/sys", "sysfs"),
        ("devtmpfs", "/dev", "devtmpfs"),
        ("tmpfs", "/tmp", "tmpfs"),
        ("tmpfs", "/run", "tmpfs"),
        ("debugfs", "/sys/kernel/debug", "debugfs"),
    ];
    for (source, target, fstype) in mounts {
        fs::create_dir_all(target).with_context(|| format!("cannot create {target}"))?;
        match mount(source, target, fstype, MountFlags::empty(), None) {
            Ok(()) | Err(rustix::io::Errno::BUSY) => {}
            // Not every kernel has debugfs; tests that need it skip.
            Err(_) if fstype == "debugfs" => {}
            Err(err) => bail!("cannot mount {fstype} on {target}: {err}"),
        }
    }
    fs::create_dir_all("/run/fgds")?;
    Ok(())
}

fn read_plan() -> anyhow::Result<Plan> {
    let text = fs::read_to_string(PLAN).with_context(|| format!("cannot read {PLAN}"))?;
    let mut setup = Vec::new();
    let mut tests = Vec::new();
    let mut env = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some((name, value)) = line.strip_prefix("env ").and_then(|r| r.split_once(' ')) {
            env.push((name.to_owned(), value.to_owned()));
            continue;
        }
        let mut words = line.splitn(4, ' ');
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("module"), Some(_kind), Some(path), params) => setup.push(Step::Module(Module {
                path: path.to_owned(),
                params: params.unwrap_or("").to_owned(),
            })),
            (Some("bind"), Some(device), Some(driver), None) => setup.push(Step::Bind {
                device: device.to_owned(),
                driver: driver.to_owned(),
            }),
            (Some("test"), Some(name), Some(path), Some(timeout)) => tests.push(Test {
                name: name.to_owned(),
                path: path.to_owned(),
                timeout: Duration::from_secs(
                    timeout
                        .parse()
                        .with_context(|| format!("bad timeout in {line:?}"))?,
                ),
            }),
            _ => bail!("malformed plan line {line:?}"),
        }
    }
    Ok(Plan { setup, tests, env })
}

/// Finds the virtio-serial port named [`KTAP_PORT_NAME`] (there is no udev to make the
/// `/dev/virtio-ports/` link).
fn open_ktap_port() -> anyhow::Result<File> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(entries) = fs::read_dir("/sys/class/virtio-ports") {
            for entry in entries.flatten() {
                let name = fs::read_to_string(entry.path().join("name")).unwrap_or_default();
                if name.trim() == KTAP_PORT_NAME {
                    let dev = Path::new("/dev").join(entry.file_name());
                    return OpenOptions::new()
                        .write(true)
                        .open(&dev)
                        .with_context(|| format!("cannot open {}", dev.display()));
                }
            }
        }
        if Instant::now() > deadline {
            bail!("no virtio-serial port named {KTAP_PORT_NAME}: is virtio_console loaded?");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn load_modules(steps: &[Step]) -> anyhow::Result<()> {
    // Every fake GPU (`--gpus 2` gives two), in address order: the first is the rig's GPU.
    let ivshmem = Some(find_pci_devices("0x1af4", "0x1110").join(",")).filter(|s| !s.is_empty());
    let mut loaded = String::new();
    let mut errors = Vec::new();
    for step in steps {
        let module = match step {
            Step::Module(module) => module,
            Step::Bind { device, driver } => {
                let device = match (&ivshmem, device.as_str()) {
                    (Some(bdf), "@ivshmem@") => bdf.clone(),
                    (None, "@ivshmem@") => {
                        errors.push(format!(
                            "bind to {driver}: no ivshmem device (1af4:1110) found"
                        ));
                        continue;
                    }
                    (_, other) => other.to_owned(),
                };
                for device in device.split(',') {
                    if let Err(err) = bind(device, driver) {
                        errors.push(format!("{err:#}"));
                    }
                }
                continue;
            }
        };
        let params = match (&ivshmem, module.params.contains("@ivshmem@")) {
            (Some(bdf), true) => module.params.replace("@ivshmem@", bdf),
            (None, true) => {
                errors.push(format!(
                    "{}: no ivshmem device (1af4:1110) found for its params",
                    module.path
                ));
                continue;
            }
            (_, false) => module.params.clone(),
        };
        let res = File::open(&module.path)
            .map_err(anyhow::Error::from)
            .and_then(|file| {
                Ok(rustix::system::finit_module(
                    &file,
                    &CString::new(params.clone())?,
                    0,
                )?)
            });
        match res {
            Ok(()) => loaded.push_str(&format!("{} {}\n", module.path, params)),
            // Already there (EEXIST): loaded as a dependency or built in.
            Err(_) if is_loaded(&module.path) => {
                loaded.push_str(&format!("{} {}\n", module.path, params))
            }
            // A CPU-specific implementation (sha256-ssse3, ...) that this vCPU cannot run:
            // the generic one serves, and a module that truly needed it fails to load itself.
            Err(err)
                if module.path.starts_with("/modules/kernel/")
                    && err.downcast_ref::<rustix::io::Errno>()
                        == Some(&rustix::io::Errno::NODEV) =>
            {
                kmsg(&format!(
                    "{} refuses this vCPU (ENODEV): skipped",
                    module.path
                ));
            }
            Err(err) => errors.push(format!("cannot load {} {params}: {err:#}", module.path)),
        }
    }
    fs::write(LOADED, loaded).with_context(|| format!("cannot write {LOADED}"))?;
    if errors.is_empty() {
        Ok(())
    } else {
        bail!("{}", errors.join("\n"))
    }
}

/// Binds PCI device `bdf` to `driver` (loaded already): `driver_override`, away from the driver
/// it has if any, `drivers_probe`; fails unless the device then has that driver.
fn bind(bdf: &str, driver: &str) -> anyhow::Result<()> {
    let dev = Path::new("/sys/bus/pci/devices").join(bdf);
    fs::write(dev.join("driver_override"), driver)
        .with_context(|| format!("cannot set driver_override of {bdf} to {driver}"))?;
    if dev.join("driver").exists() {
        fs::write(dev.join("driver/unbind"), bdf)
            .with_context(|| format!("cannot unbind {bdf} from its driver"))?;
    }
    fs::write("/sys/bus/pci/drivers_probe", bdf)
        .with_context(|| format!("cannot bind {bdf} to {driver} (drivers_probe)"))?;
    let bound = fs::read_link(dev.join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    if bound.as_deref() != Some(driver) {
        bail!("{bdf} is bound to {bound:?} after drivers_probe, not to {driver}");
    }
    Ok(())
}

fn is_loaded(path: &str) -> bool {
    let name = Path::new(path)
        .file_stem()
        .map(|s| s.to_string_lossy().replace('-', "_"))
        .unwrap_or_default();
    Path::new("/sys/module").join(name).exists()
}

/// The rig's block devices, found by controller serial and namespace id (the kernel names
/// controllers in probe order, which is not fixed).
#[derive(Default)]
struct Drives {
    /// Serial `fgds0`, namespace 1: the raw drive with the pattern.
    nvme: Option<String>,
    /// Serial `fgds0`, namespace 2: an ext4 filesystem, mounted at [`EXT4_MOUNT`].
    ext4: Option<String>,
    /// Serial `fgds1`, namespace 1: a second drive, on its own hot-pluggable slot.
    nvme2: Option<String>,
    /// Serials `fgds-drive3` and up, namespace 1: the further drives of `--drives N`
    /// (kernel parameter `fgds.drives=N`), in order; a missing one is `None`.
    more: Vec<Option<String>>,
    /// Serial `fgds0`, namespaces 3 and 4: an xfs and a btrfs filesystem, mounted at
    /// `/mnt/xfs` and `/mnt/btrfs` where the kernel has them ([`OTHER_FS`]).
    xfs: Option<String>,
    btrfs: Option<String>,
    /// The other file systems mounted: (environment variable, mount point).
    mounted: Vec<(&'static str, &'static str)>,
}

const EXT4_MOUNT: &str = "/mnt/ext4";

/// The file systems besides ext4: type, namespace id, mount point, the variable that names it
/// to the tests. A kernel without one (no `/proc/filesystems` line) leaves its variable unset,
/// and the tests that need it skip saying so.
const OTHER_FS: &[(&str, &str, &str, &str)] = &[
    ("xfs", "3", "/mnt/xfs", "FGDS_XFS"),
    ("btrfs", "4", "/mnt/btrfs", "FGDS_BTRFS"),
];

/// Waits (bounded) for the rig's NVMe namespaces, which the driver probes asynchronously.
fn find_drives() -> Drives {
    let deadline = Instant::now() + Duration::from_secs(20);
    let count = drive_count();
    loop {
        let mut drives = Drives {
            more: vec![None; count.saturating_sub(2)],
            ..Drives::default()
        };
        for entry in fs::read_dir("/sys/block").into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("nvme") else {
                continue;
            };
            if rest.contains('c') || rest.contains('p') {
                continue; // A path of a multipath namespace, or a partition.
            }
            // The number after `n` in the name is an instance, not the namespace id: namespaces
            // are scanned in parallel, so read the id.
            let read = |attr: &str| {
                let text = fs::read_to_string(entry.path().join(attr)).unwrap_or_default();
                text.trim().to_owned()
            };
            let (serial, nsid) = (read("device/serial"), read("nsid"));
            let dev = format!("/dev/{name}");
            match (serial.as_str(), nsid.as_str()) {
                ("fgds0", "1") => drives.nvme = Some(dev),
                ("fgds0", "2") => drives.ext4 = Some(dev),
                ("fgds0", "3") => drives.xfs = Some(dev),
                ("fgds0", "4") => drives.btrfs = Some(dev),
                ("fgds1", "1") => drives.nvme2 = Some(dev),
                (serial, "1") => {
                    let n = serial
                        .strip_prefix("fgds-drive")
                        .and_then(|n| n.parse::<usize>().ok());
                    if let Some(slot) = n.and_then(|n| drives.more.get_mut(n.wrapping_sub(3))) {
                        *slot = Some(dev);
                    }
                }
                _ => {}
            }
        }
        let ready = |d: &Option<String>| d.as_deref().is_some_and(|p| Path::new(p).exists());
        let fs = wants_other_fs();
        let all = [&drives.nvme, &drives.ext4]
            .into_iter()
            .chain([&drives.nvme2].into_iter().filter(|_| count >= 2))
            .chain(drives.more.iter())
            .chain([&drives.xfs, &drives.btrfs].into_iter().filter(|_| fs))
            .all(ready);
        if all || Instant::now() > deadline {
            return drives;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Finds the drives and mounts the ext4 one; the errors name what is missing.
fn prepare_drives() -> (Drives, Vec<String>) {
    let mut drives = find_drives();
    let mut errors = Vec::new();
    if drives.nvme.is_none() {
        errors.push(
            "no NVMe namespace 1 of serial fgds0 (the raw drive): is the nvme driver loaded?"
                .to_owned(),
        );
    }
    if drives.nvme2.is_none() && drive_count() >= 2 {
        errors.push("no NVMe namespace of serial fgds1 (the second drive)".to_owned());
    }
    for (i, dev) in drives.more.iter().enumerate() {
        if dev.is_none() {
            errors.push(format!(
                "no NVMe namespace 1 of serial fgds-drive{} (drive {} of fgds.drives={})",
                i + 3,
                i + 3,
                drive_count()
            ));
        }
    }
    // fgds's own reads and writes of P2PDMA pages need queues that never merge
    // (driver/fgds/gate.c); the rig sets it on every kernel alike.
    for dev in [&drives.nvme, &drives.ext4, &drives.nvme2]
        .into_iter()
        .chain(drives.more.iter())
        .flatten()
    {
        if let Err(err) = set_nomerges(dev) {
            errors.push(err);
        }
    }
    match &drives.ext4 {
        None => errors.push("no NVMe namespace 2 of serial fgds0 (the ext4 drive)".to_owned()),
        Some(dev) => {
            let _ = fs::create_dir_all(EXT4_MOUNT);
            if let Err(err) = rustix::mount::mount(
                dev.as_str(),
                EXT4_MOUNT,
                "ext4",
                rustix::mount::MountFlags::empty(),
                None,
            ) {
                errors.push(format!("cannot mount {dev} (ext4) on {EXT4_MOUNT}: {err}"));
            }
        }
    }
    let known = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let other_fs = if wants_other_fs() { OTHER_FS } else { &[] };
    for (fs_type, nsid, mount, var) in other_fs {
        let dev = if *fs_type == "xfs" {
            &drives.xfs
        } else {
            &drives.btrfs
        };
        let Some(dev) = dev.clone() else {
            errors.push(format!(
                "no NVMe namespace {nsid} of serial fgds0 (the {fs_type} drive)"
            ));
            continue;
        };
        if !known
            .lines()
            .any(|l| l.split_whitespace().last() == Some(*fs_type))
        {
            kmsg(&format!("no {fs_type} in this kernel: {var} stays unset"));
            continue;
        }
        if let Err(err) = set_nomerges(&dev) {
            errors.push(err);
        }
        let _ = fs::create_dir_all(mount);
        match rustix::mount::mount(
            dev.as_str(),
            *mount,
            *fs_type,
            rustix::mount::MountFlags::empty(),
            None,
        ) {
            Ok(()) => drives.mounted.push((var, mount)),
            Err(err) => errors.push(format!("cannot mount {dev} ({fs_type}) on {mount}: {err}")),
        }
    }
    (drives, errors)
}

/// Whether the host attached the xfs and btrfs namespaces (`fgds.fs=1` on the command line:
/// a program of the run uses them).
/// How many drives the machine has (`fgds.drives=N`, `cargo xtask test-vm --drives N`): 2
/// where not given, the rig's machine of old.
fn drive_count() -> usize {
    fs::read_to_string("/proc/cmdline")
        .unwrap_or_default()
        .split_whitespace()
        .find_map(|w| w.strip_prefix("fgds.drives=")?.parse().ok())
        .unwrap_or(2)
}

fn wants_other_fs() -> bool {
    fs::read_to_string("/proc/cmdline")
        .is_ok_and(|c| c.split_whitespace().any(|w| w == "fgds.fs=1"))
}

/// Writes 2 to `/sys/block/NAME/queue/nomerges` of the disk `dev` (`/dev/NAME`).
fn set_nomerges(dev: &str) -> Result<(), String> {
    let name = dev.trim_start_matches("/dev/");
    let path = format!("/sys/block/{name}/queue/nomerges");
    fs::write(&path, "2").map_err(|err| format!("cannot write 2 to {path}: {err}"))
}

fn find_pci_devices(vendor: &str, device: &str) -> Vec<String> {
    let Ok(entries) = fs::read_dir("/sys/bus/pci/devices") else {
        return Vec::new();
    };
    let mut found = entries
        .flatten()
        .filter(|entry| {
            let read = |attr: &str| fs::read_to_string(entry.path().join(attr)).unwrap_or_default();
            read("vendor").trim() == vendor && read("device").trim() == device
        })
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    found.sort();
    found
}

fn run_test(
    ktap: &mut File,
    number: usize,
    test: &Test,
    drives: &Drives,
    env: &[(String, String)],
) -> anyhow::Result<()> {
    kmsg(&format!("begin {}", test.name));
    let started = Instant::now();
    let mut command = Command::new(&test.path);
    for (var, value) in [("FGDS_NVME", &drives.nvme), ("FGDS_NVME2", &drives.nvme2)] {
        if let Some(dev) = value {
            command.env(var, dev);
        }
    }
    if drives.ext4.is_some() {
        command.env("FGDS_EXT4", EXT4_MOUNT);
    }
    for (var, mount) in &drives.mounted {
        command.env(var, mount);
    }
    for (var, value) in env.iter().cloned().chain(cmdline_env()) {
        command.env(var, value);
    }
    let child = command
        .env("PATH", "/bin:/tests:/exec")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(err) => {
            writeln!(ktap, "# {}: cannot start {}: {err}", test.name, test.path)?;
            writeln!(ktap, "not ok {number} {}", test.name)?;
            kmsg(&format!("end {}", test.name));
            return Ok(());
        }
    };
    // Lines from stdout (KTAP, nested) and stderr (diagnostics) arrive through one channel so
    // the timeout below is exact.
    let (tx, rx) = mpsc::channel::<(bool, String)>();
    let out = child.stdout.take().expect("piped stdout");
    let err = child.stderr.take().expect("piped stderr");
    let tx2 = tx.clone();
    std::thread::spawn(move || forward_lines(out, true, tx));
    std::thread::spawn(move || forward_lines(err, false, tx2));

    let deadline = started + test.timeout;
    let mut child_failed = false;
    // A program that skips as a whole says why on its plan line: `1..0 # SKIP reason`.
    let mut skip_reason = None;
    let mut open_streams = 2;
    let mut timed_out = false;
    while open_streams > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((_, line)) if line == "\0eof" => open_streams -= 1,
            Ok((true, line)) => {
                child_failed |= line.trim_start().starts_with("not ok ");
                if let Some((_, reason)) = line
                    .trim_start()
                    .strip_prefix("1..")
                    .and_then(|p| p.split_once("# SKIP"))
                {
                    skip_reason = Some(reason.trim().to_owned());
                }
                writeln!(ktap, "  {line}")?;
                ktap.flush()?;
            }
            Ok((false, line)) => {
                writeln!(ktap, "  # {line}")?;
                ktap.flush()?;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                timed_out = true;
                let _ = child.kill();
                break;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait().context("waitpid")?;
    let secs = started.elapsed().as_secs_f64();
    writeln!(ktap, "# {}: {:.1} s", test.name, secs)?;
    let line = if timed_out {
        format!(
            "not ok {number} {} # TIMEOUT {} seconds",
            test.name,
            test.timeout.as_secs()
        )
    } else {
        match status.code() {
            Some(0) if !child_failed => format!("ok {number} {}", test.name),
            Some(4) => {
                let reason = skip_reason.unwrap_or_else(|| "the program exited with 4".to_owned());
                format!("ok {number} {} # SKIP {reason}", test.name)
            }
            Some(code) => format!("not ok {number} {} # exit={code}", test.name),
            None => format!(
                "not ok {number} {} # killed by a signal ({status})",
                test.name
            ),
        }
    };
    writeln!(ktap, "{line}")?;
    ktap.flush()?;
    kmsg(&format!("end {}", test.name));
    Ok(())
}

fn forward_lines(stream: impl std::io::Read, is_stdout: bool, tx: mpsc::Sender<(bool, String)>) {
    for line in BufReader::new(stream).lines() {
        match line {
            Ok(line) => {
                if tx.send((is_stdout, line)).is_err() {
                    return;
                }
            }
            Err(_) => break,
        }
    }
    let _ = tx.send((is_stdout, "\0eof".to_owned()));
}

/// Asks kmemleak for a scan after the tests and returns what it reports (empty: no leak).
/// Objects younger than kmemleak's minimum age (5 s) are not reported, hence the wait.
fn kmemleak_scan() -> Result<String, String> {
    let path = Path::new("/sys/kernel/debug/kmemleak");
    if !path.exists() {
        return Err("the kernel has no kmemleak (CONFIG_DEBUG_KMEMLEAK)".to_owned());
    }
    std::thread::sleep(Duration::from_secs(6));
    for _ in 0..2 {
        fs::write(path, "scan").map_err(|err| format!("cannot start a kmemleak scan: {err}"))?;
    }
    let report =
        fs::read_to_string(path).map_err(|err| format!("cannot read {}: {err}", path.display()))?;
    for line in report.lines() {
        kmsg(&format!("kmemleak: {line}"));
    }
    Ok(report)
}

/// Writes a marker into the kernel log, so the host can tell which test a splat belongs to.
fn kmsg(msg: &str) {
    // One write(2) is one kernel log record.
    if let Ok(mut kmsg) = OpenOptions::new().write(true).open("/dev/kmsg") {
        let _ = kmsg.write_all(format!("fgds-rig: {msg}\n").as_bytes());
    }
}

fn console(msg: &str) {
    if let Ok(mut console) = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open("/dev/console")
    {
        let _ = console.write_all(format!("{msg}\n").as_bytes());
    }
}

/// Kernel parameters `fgds.<name>=<value>`, as environment variables `FGDS_<NAME>` for tests.
fn cmdline_env() -> Vec<(String, String)> {
    let cmdline = fs::read_to_string("/proc/cmdline").unwrap_or_default();
    cmdline
        .split_whitespace()
        .filter_map(|word| word.strip_prefix("fgds.")?.split_once('='))
        .map(|(name, value)| (format!("FGDS_{}", name.to_uppercase()), value.to_owned()))
        .collect()
}

fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}
