//! The rig's machine and the QEMU process that runs it.
//!
//! q35 with TCG by default; the NVMe drive and the ivshmem "GPU" sit behind one emulated PCIe
//! switch (x3130 upstream, two xio3130 downstream ports) under a root port, so the kernel's P2P
//! distance check sees a shared upstream bridge and allows P2P DMA between them
//! (research/kernel-mechanisms.md 1.4). The GPU's memory is a host file, so the host can check
//! after the run what the guest wrote into it.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The CPU accelerator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Tcg(TcgThreads),
    Kvm,
}

/// How many host threads TCG runs the vCPUs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcgThreads {
    /// One thread for all vCPUs, which take turns.
    Single,
    /// A thread per vCPU (MTTCG).
    Multi,
}

/// What the machine is made of. Every path is the host's.
pub struct Config {
    pub kernel: PathBuf,
    pub initrd: PathBuf,
    /// Extra kernel parameters, after the rig's own.
    pub cmdline: String,
    pub accel: Accel,
    pub cpus: u32,
    pub memory_mib: u32,
    pub nvme_image: PathBuf,
    /// An ext4 filesystem image: the raw drive's second namespace.
    pub ext4_image: PathBuf,
    /// An xfs and a btrfs filesystem image: its third and fourth namespaces, where given.
    pub xfs_image: Option<PathBuf>,
    pub btrfs_image: Option<PathBuf>,
    /// The second drive's image (behind the GPU's switch, in its own hot-pluggable slot); none
    /// for a machine of one drive (`--drives 1`).
    pub nvme2_image: Option<PathBuf>,
    /// The images of drives three and up (`--drives N`), each an NVMe controller of its own
    /// (serial [`extra_drive_serial`]) in a slot of its own behind the GPU's switch (with
    /// `iommu`, on a root port of its own, as every device is).
    pub extra_drives: Vec<PathBuf>,
    /// The image of a third drive, for a root port of its own outside the GPU's switch (no P2P
    /// path to the GPU: the host bridge is not one Linux lets P2P through without a vIOMMU's
    /// CPU model); only without `iommu`. The port is empty at boot: a test plugs the drive in.
    pub far_image: Option<PathBuf>,
    pub gpu_backing: PathBuf,
    pub gpu_bytes: u64,
    /// A second GPU behind a switch of its own, with a drive of its own beside it (`--gpus 2`);
    /// with `iommu`, each on a root port of its own.
    pub second_gpu: Option<SecondGpu>,
    /// I/O errors the drive returns at fixed sectors.
    pub nvme_errors: Vec<InjectError>,
    /// Every NVMe controller's `mdts`, where not QEMU's default (7: 512 KiB per command).
    pub nvme_mdts: Option<u8>,
    /// A translating vIOMMU (intel-iommu), with each device on its own root port.
    pub iommu: bool,
    /// Where the console log, the KTAP log, the QEMU log and the QMP socket go.
    pub run_dir: PathBuf,
}

/// The second GPU's memory (the same size as the first's) and its drive's image.
pub struct SecondGpu {
    pub backing: PathBuf,
    pub drive_image: PathBuf,
}

/// QEMU's ids of the second GPU and of the drive beside it (serial `fgds3`).
pub const GPU1_ID: &str = "gpu1";
pub const NVME3_ID: &str = "nvme3";

/// The files of one run, under [`Config::run_dir`].
pub struct RunFiles {
    pub console: PathBuf,
    pub ktap: PathBuf,
    pub qemu_log: PathBuf,
    pub qmp: PathBuf,
    /// The control channel's socket (guest requests, see [`crate::control`]).
    pub ctl: PathBuf,
    /// A second QMP monitor, for the control channel.
    pub ctl_qmp: PathBuf,
    /// What the control channel injected, when.
    pub faults: PathBuf,
}

/// An I/O error QEMU's blkdebug injects for the NVMe drive whenever a request touches `sector`
/// (512-byte units): on reads or on writes, once or every time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InjectError {
    pub write: bool,
    pub sector: u64,
    pub once: bool,
    pub errno: i32,
}

/// The QEMU device id of the GPU (for `device_del`).
pub const GPU_ID: &str = "gpu0";
/// The PCIe slot (downstream port) the GPU sits in.
pub const GPU_BUS: &str = "dn1";
/// The QEMU device id of the NVMe controller.
pub const NVME_ID: &str = "nvme0";
/// The QEMU device id of the second NVMe controller (its own slot, for hot-unplug tests).
pub const NVME2_ID: &str = "nvme1";
/// The most drives a machine has (`--drives`): the first two, and six more.
pub const MAX_DRIVES: usize = 8;

/// The controller serial of drive `n` (counted from 1) for drives three and up; the first two
/// are `fgds0` and `fgds1`, and `fgds2` is the drive outside the switch that fgds_gate plugs in.
pub fn extra_drive_serial(n: usize) -> String {
    format!("fgds-drive{n}")
}

/// The downstream ports (slots) of the GPU's switch, or root ports with `iommu`: the first
/// drive, the GPU, the second drive, then one per further drive.
fn ports(config: &Config) -> Vec<String> {
    ["dn0", GPU_BUS, "dn2"]
        .into_iter()
        .map(str::to_owned)
        .chain((3..3 + config.extra_drives.len()).map(|n| format!("dn{n}")))
        .collect()
}

/// The PCIe chassis number of port `i` of [`ports`]: 2, 3 and 4 for the first three (as
/// always), 11 and up for the further drives' (clear of the root ports' 1 and 9).
fn chassis(i: usize) -> usize {
    if i < 3 { i + 2 } else { i + 8 }
}

/// The kernel parameters the rig always passes: console on the first serial port, a panic or
/// oops ends the machine at once (`-no-reboot` turns the reboot into QEMU's exit).
pub const BASE_CMDLINE: &str = "console=ttyS0,115200 panic=-1 oops=panic nmi_watchdog=0 \
                                 rdinit=/init loglevel=6 printk.devkmsg=on";

pub fn run_files(run_dir: &Path) -> RunFiles {
    RunFiles {
        console: run_dir.join("console.log"),
        ktap: run_dir.join("ktap.log"),
        qemu_log: run_dir.join("qemu.log"),
        qmp: run_dir.join("qmp.sock"),
        ctl: run_dir.join("ctl.sock"),
        ctl_qmp: run_dir.join("qmp-ctl.sock"),
        faults: run_dir.join("faults.log"),
    }
}

/// The QEMU command line for `config`.
pub fn args(config: &Config) -> Vec<String> {
    let files = run_files(&config.run_dir);
    let accel = match config.accel {
        Accel::Tcg(TcgThreads::Single) => "tcg,thread=single",
        Accel::Tcg(TcgThreads::Multi) => "tcg,thread=multi",
        Accel::Kvm => "kvm",
    };
    let mut args = Vec::new();
    let mut push = |items: &[&str]| args.extend(items.iter().map(|s| (*s).to_owned()));
    push(&[
        "-machine",
        "q35",
        "-accel",
        accel,
        "-nodefaults",
        // Threads named by their role (`CPU 0/TCG`, `worker`, ...): without it every thread is
        // `qemu-system-x86`, and the bench cannot tell the vCPUs' time from the devices'.
        "-name",
        "fgds,debug-threads=on",
        "-no-reboot",
        // pvpanic reports a panic from a panic notifier, which runs before the kernel flushes
        // its console: QEMU's default action (shutdown) would end the machine with the oops
        // still in the guest's log buffer. The guest goes on, prints, and reboots instead,
        // which `-no-reboot` turns into QEMU's exit.
        "-action",
        "panic=none",
        "-display",
        "none",
    ]);
    push(&["-cpu", cpu_model(config)]);
    // A debugging aid: QEMU's own trace events (`qemu-system-x86_64 -trace help`), written
    // next to the run's other files.
    if let Some(pattern) = std::env::var_os("FGDS_QEMU_TRACE") {
        push(&[
            "-trace",
            &format!(
                "enable={},file={}",
                pattern.to_string_lossy(),
                path(&config.run_dir.join("qemu-trace.log"))
            ),
        ]);
    }
    push(&[
        "-smp",
        &config.cpus.to_string(),
        "-m",
        &format!("{}M", config.memory_mib),
    ]);
    push(&[
        "-kernel",
        &path(&config.kernel),
        "-initrd",
        &path(&config.initrd),
    ]);
    push(&[
        "-append",
        format!(
            "{BASE_CMDLINE} {} {}",
            device_cmdline(config),
            config.cmdline
        )
        .trim(),
    ]);
    push(&[
        "-chardev",
        &format!("file,id=console,path={}", path(&files.console)),
    ]);
    push(&["-serial", "chardev:console"]);
    push(&["-device", "virtio-serial-pci,id=vser"]);
    push(&[
        "-chardev",
        &format!("file,id=ktap,path={}", path(&files.ktap)),
    ]);
    push(&[
        "-device",
        "virtserialport,bus=vser.0,chardev=ktap,name=fgds.ktap",
    ]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", path(&files.qmp)),
    ]);
    push(&[
        "-chardev",
        &format!("socket,id=ctl,path={},server=on,wait=off", path(&files.ctl)),
    ]);
    push(&[
        "-device",
        "virtserialport,bus=vser.0,chardev=ctl,name=fgds.ctl",
    ]);
    push(&[
        "-qmp",
        &format!("unix:{},server=on,wait=off", path(&files.ctl_qmp)),
    ]);
    push(&["-device", "pvpanic-pci"]);
    if config.iommu {
        // A translating vIOMMU. QEMU sends every DMA through it, so switch-local P2P (bus
        // addresses) would break: each device gets its own root port instead, and P2P goes
        // through the host bridge, which Linux allows for an AMD Zen CPU (the CPU model's
        // family 23, see `cpu_model`). research/kernel-mechanisms.md 1.4 and 6.
        push(&["-device", "intel-iommu,intremap=off"]);
        for (i, port) in ports(config).iter().enumerate() {
            push(&[
                "-device",
                &format!(
                    "pcie-root-port,id={port},bus=pcie.0,chassis={},slot={}",
                    chassis(i),
                    i + 1
                ),
            ]);
        }
    } else {
        // The switch: root port -> upstream port -> three downstream ports (hot-pluggable
        // slots): the NVMe drive, the GPU, the second NVMe drive. A shared upstream bridge
        // makes the kernel's P2P distance check pass without a host bridge allowlist.
        push(&[
            "-device",
            "pcie-root-port,id=rp0,bus=pcie.0,chassis=1,slot=1",
        ]);
        push(&["-device", "x3130-upstream,id=up0,bus=rp0"]);
        for (i, port) in ports(config).iter().enumerate() {
            push(&[
                "-device",
                &format!(
                    "xio3130-downstream,id={port},bus=up0,chassis={},slot=0",
                    chassis(i)
                ),
            ]);
        }
    }
    // blkdebug sits under the raw node: the raw driver emits the read_aio/write_aio events on
    // its child (research/kernel-mechanisms.md 5.2).
    push(&["-blockdev", &nvme_blockdev(config)]);
    push(&["-blockdev", &raw_blockdev("nvme0-ext4", &config.ext4_image)]);
    let other_fs = [
        (3, "xfs", &config.xfs_image),
        (4, "btrfs", &config.btrfs_image),
    ];
    for (_, fs, image) in other_fs {
        if let Some(image) = image {
            push(&["-blockdev", &raw_blockdev(&format!("nvme0-{fs}"), image)]);
        }
    }
    if let Some(image) = &config.nvme2_image {
        push(&["-blockdev", &raw_blockdev("nvme1-disk", image)]);
    }
    for (i, image) in config.extra_drives.iter().enumerate() {
        push(&[
            "-blockdev",
            &raw_blockdev(&format!("drive{}-disk", i + 3), image),
        ]);
    }
    let mdts = config
        .nvme_mdts
        .map_or(String::new(), |m| format!(",mdts={m}"));
    // Namespace 1: the raw drive; 2, 3 and 4: ext4, xfs and btrfs.
    push(&[
        "-device",
        &format!("nvme,id={NVME_ID},serial=fgds0,bus=dn0{mdts}"),
    ]);
    push(&[
        "-device",
        &format!("nvme-ns,drive=nvme0-disk,nsid=1,bus={NVME_ID}"),
    ]);
    let namespaces = other_fs
        .iter()
        .filter(|(_, _, image)| image.is_some())
        .map(|(nsid, fs, _)| (*nsid, *fs));
    for (nsid, fs) in [(2, "ext4")].into_iter().chain(namespaces) {
        push(&[
            "-device",
            &format!("nvme-ns,drive=nvme0-{fs},nsid={nsid},bus={NVME_ID}"),
        ]);
    }
    if config.nvme2_image.is_some() {
        push(&[
            "-device",
            &format!("nvme,id={NVME2_ID},serial=fgds1,drive=nvme1-disk,bus=dn2{mdts}"),
        ]);
    }
    for n in 3..3 + config.extra_drives.len() {
        push(&[
            "-device",
            &format!(
                "nvme,id=drive{n},serial={},drive=drive{n}-disk,bus=dn{n}{mdts}",
                extra_drive_serial(n)
            ),
        ]);
    }
    if let (Some(image), false) = (&config.far_image, config.iommu) {
        push(&[
            "-device",
            "pcie-root-port,id=rpfar,bus=pcie.0,chassis=9,slot=9",
        ]);
        // Its controller is plugged in by the test (FAR_NVME_ADD): GENERIC pages are refused
        // on a machine where an NVMe controller cannot reach the GPU, so it must come after
        // their set-up, as a drive added later does.
        push(&["-blockdev", &raw_blockdev("nvme2-disk", image)]);
    }
    push(&[
        "-object",
        &gpu_memory_backend("vram0", config.gpu_bytes, &config.gpu_backing),
    ]);
    push(&[
        "-device",
        &format!("ivshmem-plain,id={GPU_ID},memdev=vram0,bus={GPU_BUS}"),
    ]);
    if let Some(second) = &config.second_gpu {
        second_gpu_args(config, second, &mut push);
    }
    args
}

/// The second GPU and its drive: behind a second switch (its own root port, upstream port
/// and two downstream ports), so that each GPU has a drive it reaches peer-to-peer and one it
/// reaches only through the host bridge; with a vIOMMU, on root ports of their own like every
/// other device. Enumerated after the first switch, so the first GPU keeps the lower address.
fn second_gpu_args(config: &Config, second: &SecondGpu, push: &mut impl FnMut(&[&str])) {
    // Chassis and slots 20 and up: clear of the first switch's and the further drives' ports.
    let (gpu_port, drive_port) = ("gpu1port", "nvme3port");
    if config.iommu {
        for (i, port) in [gpu_port, drive_port].iter().enumerate() {
            push(&[
                "-device",
                &format!(
                    "pcie-root-port,id={port},bus=pcie.0,chassis={},slot={}",
                    i + 23,
                    i + 23
                ),
            ]);
        }
    } else {
        push(&[
            "-device",
            "pcie-root-port,id=rp1,bus=pcie.0,chassis=20,slot=20",
        ]);
        push(&["-device", "x3130-upstream,id=up1,bus=rp1"]);
        for (i, port) in [gpu_port, drive_port].iter().enumerate() {
            push(&[
                "-device",
                &format!(
                    "xio3130-downstream,id={port},bus=up1,chassis={},slot=0",
                    i + 21
                ),
            ]);
        }
    }
    push(&[
        "-blockdev",
        &raw_blockdev("nvme3-disk", &second.drive_image),
    ]);
    push(&[
        "-device",
        &format!("nvme,id={NVME3_ID},serial=fgds3,drive=nvme3-disk,bus={drive_port}"),
    ]);
    push(&[
        "-object",
        &gpu_memory_backend("vram1", config.gpu_bytes, &second.backing),
    ]);
    push(&[
        "-device",
        &format!("ivshmem-plain,id={GPU1_ID},memdev=vram1,bus={gpu_port}"),
    ]);
}

/// The vCPU model: the host's under KVM; under TCG `qemu64` (AMD, family 15), or with a
/// vIOMMU the same with family 23 (Zen), for which Linux allows P2P through the host bridge.
fn cpu_model(config: &Config) -> &'static str {
    match (config.accel, config.iommu) {
        (Accel::Kvm, _) => "host",
        (Accel::Tcg(_), false) => "qemu64",
        (Accel::Tcg(_), true) => "qemu64,family=23",
    }
}

/// Kernel parameters for the machine's devices: with a vIOMMU, translate every DMA strictly.
pub fn device_cmdline(config: &Config) -> &'static str {
    if config.iommu {
        "intel_iommu=on iommu.passthrough=0 iommu.strict=1"
    } else {
        ""
    }
}

fn raw_blockdev(node: &str, image: &Path) -> String {
    format!(
        "driver=raw,node-name={node},file.driver=file,file.filename={},file.cache.direct=off",
        path(image)
    )
}

fn nvme_blockdev(config: &Config) -> String {
    let rules = config
        .nvme_errors
        .iter()
        .map(|r| {
            let event = if r.write { "write_aio" } else { "read_aio" };
            format!(
                r#"{{"event":"{event}","errno":{},"sector":{},"once":{}}}"#,
                r.errno, r.sector, r.once
            )
        })
        .collect::<Vec<_>>();
    format!(
        r#"{{"driver":"raw","node-name":"nvme0-disk","file":{{"driver":"blkdebug","node-name":"nvme0-blkdebug","image":{{"driver":"file","filename":{},"cache":{{"direct":false}}}},"inject-error":[{}]}}}}"#,
        json_string(&path(&config.nvme_image)),
        rules.join(",")
    )
}

fn json_string(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

/// A running machine.
pub struct Machine {
    child: Child,
    pub files: RunFiles,
    started: Instant,
    /// The QMP session, kept for the machine's life.
    qmp: Option<crate::qmp::Session>,
    /// Whether QEMU reported a guest panic (pvpanic).
    panicked: bool,
    /// The control channel's server, while the machine runs.
    control: Option<crate::control::Server>,
}

/// How the machine ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// QEMU exited by itself (the guest powered off, or rebooted after a panic), or was killed
    /// by `signal`.
    Exited {
        code: Option<i32>,
        signal: Option<i32>,
    },
    /// It ran past its time limit and was stopped.
    TimedOut,
}

/// The QEMU object that holds the GPU's memory: its backing file, mapped shared, at a 2 MiB
/// aligned address (QEMU aligns a tmpfs file to 4 KiB otherwise, where the host cannot give it
/// the huge pages xtask's `run_memory` asks for).
pub fn gpu_memory_backend(id: &str, bytes: u64, backing: &Path) -> String {
    format!(
        "memory-backend-file,id={id},size={bytes},mem-path={},share=on,align=2M",
        path(backing)
    )
}

/// Starts QEMU for `config` (`qemu-system-x86_64` from PATH).
pub fn start(config: &Config) -> anyhow::Result<Machine> {
    let files = run_files(&config.run_dir);
    for stale in [
        &files.console,
        &files.ktap,
        &files.qmp,
        &files.ctl,
        &files.ctl_qmp,
    ] {
        let _ = std::fs::remove_file(stale);
    }
    let log = File::create(&files.qemu_log)
        .with_context(|| format!("cannot create {}", files.qemu_log.display()))?;
    let args = args(config);
    std::fs::write(config.run_dir.join("qemu.cmdline"), shell_words(&args))?;
    let mut command = Command::new("qemu-system-x86_64");
    command
        .args(&args)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl(2),
    // which is async-signal-safe; it allocates nothing and takes no lock.
    unsafe {
        command.pre_exec(|| {
            // QEMU dies with the rig: a killed `cargo xtask` leaves no machine holding the images.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    };
    let child = command
        .spawn()
        .context("cannot start qemu-system-x86_64: is the qemu-system-x86 package installed?")?;
    let qmp = crate::qmp::connect(&files.qmp, Duration::from_secs(10)).ok();
    let gpu = crate::control::GpuSlot {
        id: GPU_ID.to_owned(),
        bus: GPU_BUS.to_owned(),
        backing: config.gpu_backing.clone(),
        bytes: config.gpu_bytes,
    };
    let control = Some(crate::control::serve(
        &files.ctl,
        &files.ctl_qmp,
        &files.faults,
        gpu,
    ));
    Ok(Machine {
        child,
        files,
        qmp,
        panicked: false,
        control,
        started: Instant::now(),
    })
}

fn shell_words(args: &[String]) -> String {
    let quoted = args
        .iter()
        .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
        .collect::<Vec<_>>();
    format!("qemu-system-x86_64 {}\n", quoted.join(" "))
}

impl Machine {
    /// Waits for QEMU to exit, at most `limit`; calls `on_tick` about every 200 ms so the caller
    /// can show progress. Past the limit the machine is stopped.
    pub fn wait(&mut self, limit: Duration, mut on_tick: impl FnMut()) -> anyhow::Result<Exit> {
        let mut last_poll = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().context("waitpid on QEMU")? {
                return Ok(Exit::Exited {
                    code: status.code(),
                    signal: std::os::unix::process::ExitStatusExt::signal(&status),
                });
            }
            if self.started.elapsed() > limit {
                self.stop();
                return Ok(Exit::TimedOut);
            }
            if last_poll.elapsed() > Duration::from_secs(1) {
                self.poll_status();
                last_poll = Instant::now();
            }
            on_tick();
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether QEMU reported a guest panic (pvpanic) while the machine ran.
    pub fn guest_panicked(&mut self) -> bool {
        self.poll_status();
        self.panicked
    }

    /// Asks QMP for the run state, which also collects events such as `GUEST_PANICKED`.
    fn poll_status(&mut self) {
        let Some(qmp) = self.qmp.as_mut() else { return };
        match qmp.status() {
            Ok(status) => self.panicked |= status.contains("panicked") || qmp.guest_panicked(),
            // QEMU is gone or exiting.
            Err(_) => self.qmp = None,
        }
    }

    /// Stops QEMU: an ACPI power-down first (a clean shutdown, if the guest still listens),
    /// then `quit`, then SIGKILL if it is still there a few seconds later.
    pub fn stop(&mut self) {
        if let Some(control) = self.control.take() {
            control.stop();
        }
        if let Some(qmp) = self.qmp.as_mut() {
            if qmp.powerdown().is_ok() {
                let deadline = Instant::now() + Duration::from_secs(5);
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = self.child.try_wait() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            let _ = qmp.quit();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// Fails unless QEMU's log is free of errors that mean the machine was not what we asked for.
/// What QEMU prints when the rig's own fault injection works: the drive's blkdebug errors
/// (see [`InjectError`]).
const EXPECTED_QEMU_MESSAGES: &[&str] = &["aio failed: Input/output error"];

pub fn check_qemu_log(files: &RunFiles) -> anyhow::Result<()> {
    let log = read_log(&files.qemu_log);
    let unexpected = |l: &&str| {
        l.contains("qemu-system-x86_64:") && !EXPECTED_QEMU_MESSAGES.iter().any(|m| l.contains(m))
    };
    if let Some(line) = log.lines().find(unexpected) {
        bail!(
            "QEMU reported: {line} (full log: {})",
            files.qemu_log.display()
        );
    }
    Ok(())
}

/// A log of the run (console, KTAP, QEMU's), read lossily: a byte that is not UTF-8 (a guest
/// that printed binary, a line cut in the middle of a character) becomes U+FFFD and the rest of
/// the log stays, so no check reads an emptied log. A log that is not there reads empty.
pub fn read_log(path: &Path) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(accel: Accel) -> Config {
        Config {
            kernel: "bzImage".into(),
            initrd: "initrd".into(),
            cmdline: String::new(),
            accel,
            cpus: 2,
            memory_mib: 2048,
            nvme_image: "nvme.img".into(),
            ext4_image: "ext4.img".into(),
            xfs_image: None,
            btrfs_image: None,
            nvme2_image: Some("nvme2.img".into()),
            extra_drives: Vec::new(),
            far_image: None,
            gpu_backing: "gpu".into(),
            gpu_bytes: 1 << 28,
            second_gpu: None,
            nvme_errors: Vec::new(),
            nvme_mdts: None,
            iommu: false,
            run_dir: "run".into(),
        }
    }

    fn accel_arg(accel: Accel) -> String {
        let args = args(&config(accel));
        let at = args.iter().position(|a| a == "-accel").expect("-accel");
        args[at + 1].clone()
    }

    #[test]
    fn tcg_threads_reach_the_command_line() {
        assert_eq!(
            accel_arg(Accel::Tcg(TcgThreads::Single)),
            "tcg,thread=single"
        );
        assert_eq!(accel_arg(Accel::Tcg(TcgThreads::Multi)), "tcg,thread=multi");
        assert_eq!(accel_arg(Accel::Kvm), "kvm");
    }

    #[test]
    fn a_log_with_bytes_that_are_not_utf8_is_read_whole() {
        let path = std::env::temp_dir().join(format!("fgds-log-{}", std::process::id()));
        let mut log = b"[ 1.0] boot\n[ 1.1] garbage \xff\xfe from a serial line\n".to_vec();
        log.extend_from_slice(b"[ 2.0] fgds-rig: begin smoke\n[ 2.1] BUG: KASAN: use-after-free\n");
        std::fs::write(&path, &log).expect("temp file");
        let text = super::read_log(&path);
        let _ = std::fs::remove_file(&path);
        assert!(text.contains("garbage \u{fffd}\u{fffd} from"), "{text}");
        let splats = crate::console::splats(&text);
        assert_eq!(splats.len(), 1, "the splat after the bad bytes is found");
        assert_eq!(splats[0].test.as_deref(), Some("smoke"));
        assert_eq!(super::read_log(&path), "", "a missing log reads empty");
    }

    /// Every port and device id, and every chassis, once: with eight drives and a second GPU,
    /// with and without the vIOMMU.
    #[test]
    fn ids_and_chassis_are_unique_with_every_option() {
        for iommu in [false, true] {
            let mut c = config(Accel::Tcg(TcgThreads::Single));
            c.iommu = iommu;
            c.extra_drives = (3..=8).map(|n| format!("d{n}.img").into()).collect();
            c.far_image = Some("far.img".into());
            c.second_gpu = Some(SecondGpu {
                backing: "gpu1".into(),
                drive_image: "nvme3.img".into(),
            });
            let args = args(&c);
            let devices = args
                .windows(2)
                .filter(|w| w[0] == "-device" || w[0] == "-object" || w[0] == "-blockdev")
                .map(|w| w[1].as_str())
                .collect::<Vec<_>>();
            for key in ["id=", "chassis=", "node-name="] {
                let mut values = devices
                    .iter()
                    .filter_map(|d| d.split(',').find_map(|p| p.strip_prefix(key)))
                    .collect::<Vec<_>>();
                let all = values.len();
                values.sort();
                values.dedup();
                assert_eq!(
                    values.len(),
                    all,
                    "iommu {iommu}: a {key} twice in {devices:?}"
                );
            }
        }
    }

    #[test]
    fn further_drives_sit_behind_the_gpus_switch() {
        let mut c = config(Accel::Tcg(TcgThreads::Single));
        let default = args(&c);
        assert!(
            !default.iter().any(|a| a.contains("dn3")),
            "two drives: no slot 3"
        );
        c.extra_drives = vec!["d3.img".into(), "d4.img".into()];
        c.nvme_mdts = Some(0);
        let args = args(&c);
        let devices = args
            .windows(2)
            .filter(|w| w[0] == "-device")
            .map(|w| w[1].as_str())
            .collect::<Vec<_>>();
        for n in 3..=4 {
            let port = format!("xio3130-downstream,id=dn{n},bus=up0,");
            assert!(devices.iter().any(|d| d.starts_with(&port)), "{devices:?}");
            let drive = format!(
                "nvme,id=drive{n},serial={},drive=drive{n}-disk,bus=dn{n},mdts=0",
                extra_drive_serial(n)
            );
            assert!(devices.contains(&drive.as_str()), "{devices:?}");
        }
        let nvme = devices.iter().filter(|d| d.starts_with("nvme,")).count();
        assert_eq!(nvme, 4, "{devices:?}");
        let mut chassis = devices
            .iter()
            .filter_map(|d| d.split("chassis=").nth(1))
            .map(|c| c.split(',').next().unwrap_or(c))
            .collect::<Vec<_>>();
        let all = chassis.len();
        chassis.sort();
        chassis.dedup();
        assert_eq!(chassis.len(), all, "every port has a chassis of its own");
    }
}
