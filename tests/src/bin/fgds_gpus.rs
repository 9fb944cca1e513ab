//! Two GPUs, each behind a PCIe switch of its own with a drive of its own (`cargo xtask test-vm
//! --gpus 2`: the rig's drive fgds0 beside the first GPU, fgds3 beside the second; with
//! `--iommu` every device on a root port of its own). Each GPU reads its own drive directly;
//! a read across the switches takes the path the kernel's P2P distance check allows: through
//! the host bridge where it lets P2P through (the vIOMMU machine's CPU model is an AMD Zen,
//! which Linux allows), else refused with `FGDS_PATH_NO_P2P` and the controller named. Where
//! fgds would need GENERIC pages (no `CONFIG_PCI_P2PDMA`), neither GPU gets them: a drive that
//! cannot reach a GPU could DMA to its pages through the mapping, where fgds checks nothing, so
//! fgds refuses the GPU with one log line naming that drive. On a machine with one GPU every
//! case skips, saying so.

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use common::MIB;
use fgds::uapi;
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;

const PATH_DIRECT: u32 = 0;
const PATH_NO_P2P: u32 = 7;
/// What the second GPU's drive holds at its start (written through RAM by the cases).
const SEED_FGDS3: u64 = 0x6670_7573_3300;
const SENTINEL: u8 = 0x5a;
const LEN: u64 = MIB;

fn main() {
    fgds_tests::guest::skip_unless_vgpu();
    // The first GPU's mode, for the host's check; a refusal is these cases' to judge.
    if let Err(err) = fgds_tests::guest::fgds_refusal() {
        ktap::diag(format_args!("probing fgds's mode: {err:#}"));
    }
    ktap::run(&[
        Case {
            name: "each_gpu_reads_its_own_drive_directly",
            run: each_gpu_reads_its_own_drive,
        },
        Case {
            name: "reads_across_switches_take_the_topology_path",
            run: reads_across_switches,
        },
    ])
}

/// One GPU: its PCI address, its vgpu instance and its fgds node.
struct Gpu {
    bdf: String,
    vgpu: File,
    node: File,
}

/// One drive: its block device, the PCI address of its controller, and what its first bytes
/// hold (the pattern seed and its offset in the pattern's stream).
struct Drive {
    path: PathBuf,
    controller: String,
    seed: u64,
}

/// The machine's GPUs in address order (the rig's first), or None with fewer than two.
fn gpus() -> anyhow::Result<Option<Vec<Gpu>>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/sys/class/vgpu").context("no /sys/class/vgpu")? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let n: u32 = name
            .trim_start_matches("vgpu")
            .parse()
            .with_context(|| format!("vgpu instance {name}"))?;
        let dev = std::fs::canonicalize(format!("/sys/class/vgpu/{name}/device"))?;
        let bdf = dev
            .file_name()
            .context("vgpu's device link")?
            .to_string_lossy()
            .into_owned();
        found.push((bdf, n));
    }
    if found.len() < 2 {
        return Ok(None);
    }
    found.sort();
    let mut gpus = Vec::new();
    for (bdf, n) in found {
        let node_path = format!("/dev/fgds_{}", bdf.replace([':', '.'], "_"));
        let node = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&node_path)
            .with_context(|| format!("open {node_path}"))?;
        gpus.push(Gpu {
            vgpu: fgds::vgpu::open(n)?,
            node,
            bdf,
        });
    }
    Ok(Some(gpus))
}

/// The PCI path of a device from the host bridge down: its root port is the first element.
fn pci_path(sysfs: &Path) -> anyhow::Result<Vec<String>> {
    let real = std::fs::canonicalize(sysfs).with_context(|| format!("{}", sysfs.display()))?;
    Ok(real
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .skip_while(|c| !c.starts_with("pci"))
        .skip(1)
        .take_while(|c| c.contains(':'))
        .collect())
}

/// The first drive beside each GPU: fgds0 (the rig's raw namespace, which holds the NVMe
/// pattern) and fgds3 (written with its own pattern here, through RAM).
fn drives() -> anyhow::Result<[Drive; 2]> {
    let first = fgds_tests::guest::nvme_path()?;
    let second = fault::drive_by_serial("fgds3").context("no drive with serial fgds3")?;
    // As the rig's init does for its drives at boot (fgds refuses a queue that may merge).
    fgds_tests::guest::no_merges(&second)?;
    let mut data = AlignedBuf::new(LEN as usize)?;
    pattern::fill(SEED_FGDS3, 0, data.as_mut_slice());
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&second)
        .with_context(|| format!("open {}", second.display()))?;
    let n = common::pwrite_raw(&file, data.as_slice().as_ptr(), LEN as usize, 0)
        .map_err(|e| anyhow::anyhow!("writing fgds3's pattern: {e}"))?;
    ensure!(n == LEN as usize, "short write {n} to fgds3");
    let controller = |path: &Path| -> anyhow::Result<String> {
        let name = path.file_name().context("a drive without a name")?;
        let dev = PathBuf::from("/sys/block").join(name).join("device/device");
        pci_path(&dev)?
            .pop()
            .context("the drive's controller is not a PCI device")
    };
    Ok([
        Drive {
            controller: controller(&first)?,
            path: first,
            seed: pattern::NVME_SEED,
        },
        Drive {
            controller: controller(&second)?,
            path: second,
            seed: SEED_FGDS3,
        },
    ])
}

/// Whether the kernel lets P2P between `gpu` and the controller `drive` through: the same
/// switch, or the host bridge where Linux allows it (the rig's vIOMMU machine runs an AMD Zen
/// CPU model, `qemu/src/machine.rs` cpu_model; the plain machine's CPU is not on the list).
fn p2p_allowed(gpu: &Gpu, drive: &Drive) -> anyhow::Result<bool> {
    let dev = |bdf: &str| pci_path(&PathBuf::from("/sys/bus/pci/devices").join(bdf));
    let (g, d) = (dev(&gpu.bdf)?, dev(&drive.controller)?);
    if g.first() == d.first() {
        return Ok(true);
    }
    Ok(std::fs::read_to_string("/proc/cmdline")?.contains("intel_iommu=on"))
}

/// Registers `LEN` bytes of `gpu`'s memory holding `SENTINEL`; None where fgds refused the
/// GPU (EOPNOTSUPP: GENERIC pages where a drive cannot reach it), with the mode it shows.
fn register(gpu: &Gpu) -> anyhow::Result<Result<(OwnedFd, u64), String>> {
    let (dmabuf, _) = common::alloc(&gpu.vgpu, LEN)?;
    fgds::CpuMapping::new(dmabuf.as_fd(), LEN as usize)?.write(0, &vec![SENTINEL; LEN as usize]);
    match common::reg(&gpu.node, dmabuf.as_fd(), 0, LEN) {
        Ok(idx) => Ok(Ok((dmabuf, idx))),
        Err(e) if e == rustix::io::Errno::OPNOTSUPP => {
            let mode = std::fs::read_to_string(format!(
                "/sys/class/fgds/fgds_{}/mode",
                gpu.bdf.replace([':', '.'], "_")
            ))?;
            Ok(Err(mode.trim().to_owned()))
        }
        Err(e) => bail!("REG_BUFFER on the GPU at {}: {e}", gpu.bdf),
    }
}

/// Whether fgds refuses `gpu`: the mode it then shows, or None (the probe's registration gone).
fn refusal(gpu: &Gpu) -> anyhow::Result<Option<String>> {
    match register(gpu)? {
        Ok((_dmabuf, idx)) => {
            common::unreg(&gpu.node, idx).context("unreg")?;
            Ok(None)
        }
        Err(mode) => Ok(Some(mode)),
    }
}

/// Reads `drive` into `gpu` and checks what the kernel said and what arrived: direct with the
/// drive's controller as the DMA device and the drive's bytes in the GPU's memory where
/// `allowed`, else `FGDS_PATH_NO_P2P` naming the controller, EREMOTEIO, the memory untouched.
fn read_into(gpu: &Gpu, drive: &Drive, allowed: bool) -> anyhow::Result<()> {
    let what = format!("{} into the GPU at {}", drive.path.display(), gpu.bdf);
    let (dmabuf, idx) = match register(gpu)? {
        Ok(reg) => reg,
        Err(mode) => bail!("fgds refused the GPU at {} (mode {mode})", gpu.bdf),
    };
    let file = fgds_tests::guest::open_direct(&drive.path, false)?;
    let check = common::check_file_raw(&gpu.node, idx, file.as_raw_fd(), 0)
        .map_err(|e| anyhow::anyhow!("FGDS_IOCTL_CHECK_FILE for {what}: errno {e}"))?;
    let (want, verdict) = if allowed {
        (PATH_DIRECT, "direct")
    } else {
        (PATH_NO_P2P, "no P2P path")
    };
    ensure!(
        check.path == want && check.dma_dev().as_deref() == Some(drive.controller.as_str()),
        "FGDS_IOCTL_CHECK_FILE says path {} via {:?} for {what}, want {want} ({verdict}) via {}",
        check.path,
        check.dma_dev(),
        drive.controller
    );
    let arg = uapi::Io {
        idx,
        offset: 0,
        len: LEN,
        file_offset: 0,
        fd: file.as_raw_fd(),
        flags: 0,
    };
    let got = common::ioctl_io(&gpu.node, false, &arg);
    let bytes = common::gpu_read(dmabuf.as_fd(), LEN as usize, 0, LEN as usize)?;
    if allowed {
        let n = got.map_err(|e| anyhow::anyhow!("FGDS_IOCTL_READ of {what}: errno {e}"))?;
        ensure!(n == LEN as usize, "short read {n} of {what}");
        if let Some(at) = pattern::first_mismatch(drive.seed, 0, &bytes) {
            bail!("{what}: byte {at} differs from the drive's");
        }
    } else {
        ensure!(
            got == Err(libc::EREMOTEIO),
            "FGDS_IOCTL_READ of {what} gave {got:?}, want EREMOTEIO"
        );
        ensure!(
            bytes.iter().all(|&b| b == SENTINEL),
            "the refused read of {what} changed the GPU's memory"
        );
    }
    common::unreg(&gpu.node, idx).context("unreg")?;
    ktap::diag(format_args!(
        "{what}: {verdict} (DMA by {})",
        drive.controller
    ));
    Ok(())
}

/// Where fgds gets no pages it may vouch for (GENERIC pages, and a drive that cannot reach
/// the GPU), both GPUs are refused, each with the log line naming the drive (logged once, at
/// the first open since the GPU's driver bound: the whole kernel log is searched).
fn refused_both(gpus: &[Gpu], drives: &[Drive; 2]) -> anyhow::Result<()> {
    let log = fgds_tests::guest::kernel_log_since(0)?.join("\n");
    for (i, gpu) in gpus.iter().enumerate() {
        let other = &drives[1 - i];
        ensure!(
            refusal(gpu)?.is_some(),
            "the GPU at {} was accepted, the other was refused",
            gpu.bdf
        );
        ensure!(
            log.lines().any(|l| l.contains(&gpu.bdf)
                && l.contains("GENERIC pages refused")
                && l.contains(&other.controller)),
            "no log line refusing GENERIC pages of the GPU at {} naming the drive {} out of \
             its reach; the log:\n{log}",
            gpu.bdf,
            other.controller
        );
    }
    ktap::diag(format_args!(
        "GENERIC pages: both GPUs refused, each naming the drive beyond its switch"
    ));
    Ok(())
}

/// Each GPU reads its own drive, the one behind its switch, directly, the bytes checked.
fn each_gpu_reads_its_own_drive() -> CaseResult {
    let Some(gpus) = gpus()? else {
        return ktap::skip(ONE_GPU);
    };
    fault::require_idle()?;
    let drives = drives()?;
    if let Some(mode) = refusal(&gpus[0])? {
        ensure!(mode == "refused", "REG_BUFFER refused, sysfs mode {mode:?}");
        refused_both(&gpus, &drives)?;
        return ktap::pass();
    }
    for gpu in &gpus {
        let mode = std::fs::read_to_string(format!(
            "/sys/class/fgds/fgds_{}/mode",
            gpu.bdf.replace([':', '.'], "_")
        ))?;
        for drive in &drives {
            // GENERIC pages look like RAM to every DMA, the mapping's included, where fgds
            // checks nothing: they are only safe where every drive reaches the GPU.
            ensure!(
                mode.trim() != "generic" || p2p_allowed(gpu, drive)?,
                "fgds made GENERIC pages for the GPU at {} although the drive {} cannot reach \
                 it",
                gpu.bdf,
                drive.controller
            );
        }
    }
    for (gpu, drive) in gpus.iter().zip(&drives) {
        ensure!(
            p2p_allowed(gpu, drive)?,
            "the rig put {} and {} apart",
            gpu.bdf,
            drive.controller
        );
        read_into(gpu, drive, true)?;
    }
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// Each GPU reads the other's drive: through the host bridge where the kernel allows it, else
/// refused, as `FGDS_IOCTL_CHECK_FILE` says beforehand.
fn reads_across_switches() -> CaseResult {
    let Some(gpus) = gpus()? else {
        return ktap::skip(ONE_GPU);
    };
    fault::require_idle()?;
    let drives = drives()?;
    if refusal(&gpus[0])?.is_some() {
        refused_both(&gpus, &drives)?;
        return ktap::pass();
    }
    for (gpu, drive) in gpus.iter().zip(drives.iter().rev()) {
        read_into(gpu, drive, p2p_allowed(gpu, drive)?)?;
    }
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

const ONE_GPU: &str = "one GPU in this machine (`cargo xtask test-vm --gpus 2` has two)";
