//! `fgds doctor`: which path a read into GPU memory would take on this machine, and why not
//! the direct one.
//!
//! Everything is read from files under a root directory (`/` on the machine; a fixture tree
//! in the tests): sysfs for the module, its nodes, the GPUs, the NVMe controllers and the IOMMU
//! groups; `/proc` for the kernel, its command line and this process's capabilities; the
//! kernel's config from `/boot/config-<release>` or `/proc/config.gz`; `/etc/group` for the
//! `fgds` group. The GPU runtime (CUDA) is asked separately ([`cuda_devices`]) and handed in.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

/// `CAP_SYS_MODULE`, the capability `init_module(2)` needs.
const CAP_SYS_MODULE: u32 = 16;
/// `IORESOURCE_MEM` and `IORESOURCE_PREFETCH` in a sysfs `resource` line's flags.
const IORESOURCE_MEM: u64 = 0x200;
const IORESOURCE_PREFETCH: u64 = 0x2000;
/// The smallest BAR fgds serves.
const MIN_BAR: u64 = 64 << 20;

/// Who asks: decides whether the `fgds` group and the nodes' modes let them in.
#[derive(Debug, Clone)]
pub struct Identity {
    pub uid: u32,
    /// Effective and supplementary groups.
    pub gids: Vec<u32>,
}

impl Identity {
    /// This process's.
    pub fn current() -> Identity {
        let mut gids = rustix::process::getgroups().unwrap_or_default();
        gids.push(rustix::process::getegid());
        Identity {
            uid: rustix::process::geteuid().as_raw(),
            gids: gids.into_iter().map(|g| g.as_raw()).collect(),
        }
    }
}

/// A CUDA device as the runtime reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: i32,
    pub name: String,
    /// `DDDD:BB:DD.F`, as sysfs spells it.
    pub bdf: String,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: bool,
}

/// The CUDA devices, or why CUDA cannot be asked (no libcuda, a driver that does not start).
pub fn cuda_devices() -> Result<Vec<CudaDevice>, String> {
    let run = || -> crate::Result<Vec<CudaDevice>> {
        let cuda = crate::cuda::Cuda::load()?;
        let mut devices = Vec::new();
        for ordinal in 0..cuda.device_count()? {
            let device = cuda.device(ordinal)?;
            devices.push(CudaDevice {
                ordinal,
                name: device.name()?,
                bdf: device.pci_bus_id()?,
                dma_buf: device.dma_buf_supported()?,
            });
        }
        Ok(devices)
    };
    run().map_err(|err| err.to_string())
}

/// What the doctor found.
#[derive(Debug, Clone)]
pub struct Report {
    /// `uname -r`.
    pub kernel: String,
    pub module: Module,
    pub config: KernelConfig,
    /// Kernel parameters that decide DMA mapping (`iommu=`, `intel_iommu=`, `swiotlb=`, ...).
    pub cmdline: Vec<String>,
    pub gpus: Vec<GpuReport>,
    pub drives: Vec<Drive>,
    pub group: Group,
    /// The CUDA devices, or why there are none.
    pub cuda: Result<Vec<CudaDevice>, String>,
    /// Whether this kernel has its own dma-buf registered buffers for io_uring (the NVMe
    /// driver as the importer, no fgds: `crate::upstream`), or why not; asked of the running
    /// kernel only when examining `/`.
    pub uring_dmabuf: Result<(), String>,
    /// The path a read would take, and what stands in the direct path's way.
    pub verdict: Verdict,
}

/// The fgds module.
#[derive(Debug, Clone, Default)]
pub struct Module {
    pub loaded: bool,
    /// Its parameters when loaded (`pages`, `devices`, ...).
    pub params: BTreeMap<String, String>,
    /// Where modules.dep (or the DKMS tree) has it for this kernel.
    pub installed: Option<String>,
    /// Why this process could not load it, if it cannot.
    pub cannot_load: Option<String>,
}

/// The kernel options fgds depends on; `None` where the config could not be read.
#[derive(Debug, Clone, Default)]
pub struct KernelConfig {
    /// Where the config was read from.
    pub source: Option<String>,
    pub pci_p2pdma: Option<bool>,
    pub zone_device: Option<bool>,
}

/// A GPU: a PCI device of display class, or one fgds serves.
#[derive(Debug, Clone)]
pub struct GpuReport {
    pub bdf: String,
    /// `vendor:device`, hex.
    pub id: String,
    pub driver: Option<String>,
    /// The largest prefetchable memory BAR: index and size.
    pub bar: Option<(usize, u64)>,
    pub iommu: Iommu,
    /// The exporter registered P2PDMA memory on it (`p2pmem/` exists).
    pub p2pmem: bool,
    /// The fgds node, where there is one.
    pub node: Option<Node>,
    /// The CUDA device on it.
    pub cuda: Option<CudaDevice>,
    /// Per NVMe controller: where their paths meet (for the P2P distance).
    pub paths: Vec<(String, String)>,
}

/// A device's IOMMU: its group and the group's domain type (`identity`, `DMA`, `DMA-FQ`,
/// `blocked`, `unmanaged`); no group means no IOMMU for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Iommu {
    pub group: Option<String>,
    pub domain: Option<String>,
}

impl Iommu {
    /// Whether the IOMMU translates the device's DMA (anything but no IOMMU and identity).
    pub fn translates(&self) -> bool {
        self.group.is_some() && self.domain.as_deref().is_none_or(|d| d != "identity")
    }

    fn describe(&self) -> String {
        match (&self.group, &self.domain) {
            (None, _) => "none".to_owned(),
            (Some(g), Some(d)) => format!("group {g}, domain {d}"),
            (Some(g), None) => format!("group {g}, domain unknown"),
        }
    }
}

/// An fgds node in sysfs and `/dev`.
#[derive(Debug, Clone)]
pub struct Node {
    pub path: String,
    /// sysfs `mode`: `none`, `exporter-p2pdma`, `p2pdma`, `generic`, `refused`.
    pub mode: String,
    /// The `/dev` node's permission bits and group id, if it exists.
    pub dev: Option<(u32, u32)>,
    /// Whether the asker may open it read-write.
    pub accessible: bool,
}

/// An NVMe controller.
#[derive(Debug, Clone)]
pub struct Drive {
    /// `nvme0`.
    pub name: String,
    /// `pcie`, `tcp`, `rdma`, `fc`, `loop`.
    pub transport: String,
    pub bdf: Option<String>,
    pub iommu: Iommu,
    /// Its namespaces' block devices.
    pub namespaces: Vec<String>,
    /// Whether its queues accept P2PDMA pages: `Some` where the kernel shows it (debugfs
    /// `state` up to 6.10), else what the transport implies.
    pub p2p: P2pSupport,
    /// Its namespaces whose queues may merge requests (`queue/nomerges` not 2): fgds's own
    /// reads and writes of P2PDMA pages refuse them (docs/driver.md, The gate).
    pub merging: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum P2pSupport {
    /// The queue's state lists `PCI_P2PDMA`.
    Shown,
    /// The queue's state is readable and does not list it.
    NotShown,
    /// Not visible; a PCIe controller's queues take P2PDMA pages where the kernel has
    /// `CONFIG_PCI_P2PDMA`.
    PciePresumed,
    /// Not a PCIe controller: its queues never take P2PDMA pages.
    No,
}

/// The `fgds` group, and the limit registrations count against.
#[derive(Debug, Clone, Default)]
pub struct Group {
    pub gid: Option<u32>,
    pub member: bool,
    pub root: bool,
    /// This process's RLIMIT_MEMLOCK (soft) in bytes, `Some(None)` for unlimited, from
    /// `/proc/self/limits`; `None` where it cannot be read.
    pub memlock: Option<Option<u64>>,
}

/// Which path a read into GPU memory would take.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// `direct (fgds, <mode> pages)`, or `bounce`.
    pub path: String,
    pub direct: bool,
    /// The GPU it speaks of.
    pub gpu: Option<String>,
    /// Why not direct (empty when direct).
    pub blockers: Vec<String>,
    /// Worth knowing, not in the way.
    pub notes: Vec<String>,
}

/// Looks at the machine under `root` (`/`), as `who`, with `cuda` from [`cuda_devices`].
pub fn examine(root: &Path, who: &Identity, cuda: Result<Vec<CudaDevice>, String>) -> Report {
    let kernel = read(root, "proc/sys/kernel/osrelease").unwrap_or_default();
    let module = module(root, &kernel);
    let config = kernel_config(root, &kernel);
    let cmdline = read(root, "proc/cmdline")
        .unwrap_or_default()
        .split_whitespace()
        .filter(|w| {
            [
                "iommu",
                "intel_iommu",
                "amd_iommu",
                "swiotlb",
                "mem_encrypt",
            ]
            .iter()
            .any(|k| w.split('=').next() == Some(k))
        })
        .map(str::to_owned)
        .collect();
    let group = group(root, who);
    let drives = drives(root);
    let gpus = gpus(root, who, &drives, cuda.as_deref().unwrap_or_default());
    let uring_dmabuf = if root == Path::new("/") {
        crate::upstream::supported().map_err(|not| not.reason)
    } else {
        Err(format!(
            "not asked: {} is not the running system",
            root.display()
        ))
    };
    let mut report = Report {
        kernel,
        module,
        config,
        cmdline,
        gpus,
        drives,
        group,
        cuda,
        uring_dmabuf,
        verdict: Verdict {
            path: String::new(),
            direct: false,
            gpu: None,
            blockers: Vec::new(),
            notes: Vec::new(),
        },
    };
    report.verdict = verdict(&report);
    report
}

fn read(root: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(root.join(rel))
        .ok()
        .map(|s| s.trim().to_owned())
}

fn module(root: &Path, kernel: &str) -> Module {
    let sys = root.join("sys/module/fgds");
    let loaded = sys.is_dir();
    let mut params = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(sys.join("parameters")) {
        for entry in entries.flatten() {
            let value = std::fs::read_to_string(entry.path()).unwrap_or_default();
            params.insert(
                entry.file_name().to_string_lossy().into_owned(),
                value.trim().to_owned(),
            );
        }
    }
    let modules = root.join("lib/modules").join(kernel);
    let installed = std::fs::read_to_string(modules.join("modules.dep"))
        .ok()
        .and_then(|dep| {
            dep.lines()
                .filter_map(|l| l.split(':').next())
                .find(|p| is_fgds_ko(p))
                .map(|p| modules.join(p).display().to_string())
        })
        .or_else(|| {
            let dkms = modules.join("updates/dkms");
            std::fs::read_dir(&dkms).ok()?.flatten().find_map(|e| {
                is_fgds_ko(&e.file_name().to_string_lossy()).then(|| e.path().display().to_string())
            })
        });
    let cannot_load = if read(root, "proc/sys/kernel/modules_disabled").as_deref() == Some("1") {
        Some("module loading is disabled (kernel.modules_disabled = 1)".to_owned())
    } else {
        let caps = read(root, "proc/self/status").and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        });
        match caps {
            Some(caps) if caps & (1 << CAP_SYS_MODULE) == 0 => Some(
                "this process lacks CAP_SYS_MODULE (not root, or a container): the module must be loaded on the host".to_owned(),
            ),
            _ => None,
        }
    };
    Module {
        loaded,
        params,
        installed,
        cannot_load,
    }
}

fn is_fgds_ko(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    ["fgds.ko", "fgds.ko.xz", "fgds.ko.zst", "fgds.ko.gz"].contains(&name)
}

fn kernel_config(root: &Path, kernel: &str) -> KernelConfig {
    let boot = root.join("boot").join(format!("config-{kernel}"));
    let (source, text) = match std::fs::read_to_string(&boot) {
        Ok(text) => (boot, text),
        Err(_) => {
            let gz = root.join("proc/config.gz");
            let mut text = String::new();
            let unpacked = std::fs::File::open(&gz)
                .ok()
                .map(|f| flate2::read::GzDecoder::new(f).read_to_string(&mut text));
            match unpacked {
                Some(Ok(_)) => (gz, text),
                _ => return KernelConfig::default(),
            }
        }
    };
    let option = |name: &str| {
        let set = text
            .lines()
            .any(|l| l == format!("{name}=y") || l == format!("{name}=m"));
        Some(set)
    };
    KernelConfig {
        source: Some(source.display().to_string()),
        pci_p2pdma: option("CONFIG_PCI_P2PDMA"),
        zone_device: option("CONFIG_ZONE_DEVICE"),
    }
}

fn group(root: &Path, who: &Identity) -> Group {
    let gid = read(root, "etc/group").and_then(|text| {
        text.lines().find_map(|l| {
            let mut fields = l.split(':');
            (fields.next() == Some("fgds"))
                .then(|| fields.nth(1).and_then(|g| g.parse().ok()))
                .flatten()
        })
    });
    Group {
        gid,
        member: gid.is_some_and(|g| who.gids.contains(&g)),
        root: who.uid == 0,
        memlock: memlock(root),
    }
}

/// The soft `Max locked memory` of `proc/self/limits`: bytes, or `Some(None)` for unlimited.
fn memlock(root: &Path) -> Option<Option<u64>> {
    let text = read(root, "proc/self/limits")?;
    let line = text.lines().find(|l| l.starts_with("Max locked memory"))?;
    let soft = line["Max locked memory".len()..]
        .split_whitespace()
        .next()?;
    match soft {
        "unlimited" => Some(None),
        n => n.parse().ok().map(Some),
    }
}

/// The PCI devices directory's entries, each with its canonical path (for topology).
fn pci_devices(root: &Path) -> Vec<(String, PathBuf)> {
    let dir = root.join("sys/bus/pci/devices");
    let mut devices = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| {
                    let path = e.path();
                    let canonical = std::fs::canonicalize(&path).unwrap_or(path);
                    (e.file_name().to_string_lossy().into_owned(), canonical)
                })
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    devices.sort();
    devices
}

fn iommu(root: &Path, device: &Path) -> Iommu {
    let group = std::fs::read_link(device.join("iommu_group"))
        .ok()
        .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()));
    let domain = group.as_ref().and_then(|g| {
        std::fs::read_to_string(root.join("sys/kernel/iommu_groups").join(g).join("type"))
            .ok()
            .map(|s| s.trim().to_owned())
    });
    Iommu { group, domain }
}

/// The largest prefetchable memory BAR (of the six) in a sysfs `resource` file.
fn largest_prefetchable_bar(resource: &str) -> Option<(usize, u64)> {
    resource
        .lines()
        .take(6)
        .enumerate()
        .filter_map(|(i, line)| {
            let mut fields = line
                .split_whitespace()
                .map(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok());
            let (start, end, flags) = (fields.next()??, fields.next()??, fields.next()??);
            let prefetchable = flags & IORESOURCE_MEM != 0 && flags & IORESOURCE_PREFETCH != 0;
            (prefetchable && end > start).then(|| (i, end - start + 1))
        })
        .max_by_key(|&(_, size)| size)
}

/// The PCI addresses on a device's canonical sysfs path, from the root port down to it.
fn pci_chain(path: &Path) -> Vec<String> {
    path.components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .filter(|c| is_bdf(c))
        .collect()
}

fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// Where the paths of two devices meet: the last bridge they share, or the host bridge.
fn meeting_point(a: &Path, b: &Path) -> String {
    let (a, b) = (pci_chain(a), pci_chain(b));
    let shared = a
        .iter()
        .zip(&b)
        .take_while(|(x, y)| x == y)
        .map(|(x, _)| x.clone())
        .last();
    match shared {
        Some(bridge) if a.len() > 2 && b.len() > 2 && a[..2] == b[..2] => {
            format!("the PCIe switch at {bridge}")
        }
        Some(bridge) => format!("the bridge {bridge}"),
        None => "the host bridge".to_owned(),
    }
}

fn gpus(root: &Path, who: &Identity, drives: &[Drive], cuda: &[CudaDevice]) -> Vec<GpuReport> {
    let devices = pci_devices(root);
    let class_dir = root.join("sys/class/fgds");
    let mut nodes = BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(&class_dir) {
        for entry in entries.flatten() {
            let dir = entry.path();
            let Some(bdf) = std::fs::canonicalize(dir.join("device"))
                .ok()
                .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
            else {
                continue;
            };
            let name = entry.file_name().to_string_lossy().into_owned();
            let dev = root.join("dev").join(&name);
            let meta = std::fs::metadata(&dev).ok().map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.mode() & 0o7777, m.gid())
            });
            let accessible = match meta {
                None => false,
                Some(_) if who.uid == 0 => true,
                Some((mode, gid)) => {
                    (mode & 0o006 == 0o006) || (mode & 0o060 == 0o060 && who.gids.contains(&gid))
                }
            };
            nodes.insert(
                bdf,
                Node {
                    path: format!("/dev/{name}"),
                    mode: std::fs::read_to_string(dir.join("mode"))
                        .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned()),
                    dev: meta,
                    accessible,
                },
            );
        }
    }
    let mut gpus = Vec::new();
    for (bdf, path) in &devices {
        let class = std::fs::read_to_string(path.join("class")).unwrap_or_default();
        let display = class.trim().starts_with("0x0300") || class.trim().starts_with("0x0302");
        if !display && !nodes.contains_key(bdf) {
            continue;
        }
        let hex = |f: &str| {
            std::fs::read_to_string(path.join(f))
                .map(|s| s.trim().trim_start_matches("0x").to_owned())
                .unwrap_or_default()
        };
        let paths = drives
            .iter()
            .filter_map(|d| {
                let (_, drive_path) = devices.iter().find(|(b, _)| Some(b) == d.bdf.as_ref())?;
                Some((d.name.clone(), meeting_point(path, drive_path)))
            })
            .collect();
        gpus.push(GpuReport {
            bdf: bdf.clone(),
            id: format!("{}:{}", hex("vendor"), hex("device")),
            driver: std::fs::read_link(path.join("driver"))
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned())),
            bar: std::fs::read_to_string(path.join("resource"))
                .ok()
                .and_then(|r| largest_prefetchable_bar(&r)),
            iommu: iommu(root, path),
            p2pmem: path.join("p2pmem").is_dir(),
            node: nodes.remove(bdf),
            cuda: cuda.iter().find(|c| &c.bdf == bdf).cloned(),
            paths,
        });
    }
    gpus
}

fn drives(root: &Path) -> Vec<Drive> {
    let class = root.join("sys/class/nvme");
    let mut drives = Vec::new();
    let Ok(entries) = std::fs::read_dir(&class) else {
        return drives;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let dir = entry.path();
        let transport = std::fs::read_to_string(dir.join("transport"))
            .map_or_else(|_| "unknown".to_owned(), |s| s.trim().to_owned());
        let device = std::fs::canonicalize(dir.join("device")).ok();
        let bdf = device
            .as_ref()
            .and_then(|d| d.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .filter(|b| transport == "pcie" && is_bdf(b));
        let iommu = match (&bdf, &device) {
            (Some(_), Some(d)) => iommu(root, d),
            _ => Iommu::default(),
        };
        let mut namespaces = std::fs::read_dir(&dir)
            .map(|e| {
                e.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| {
                        n.strip_prefix(&name)
                            .is_some_and(|rest| rest.starts_with('n') || rest.starts_with('c'))
                    })
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        namespaces.sort();
        let p2p = if transport != "pcie" {
            P2pSupport::No
        } else {
            let states = namespaces
                .iter()
                .filter_map(|ns| {
                    std::fs::read_to_string(
                        root.join("sys/kernel/debug/block").join(ns).join("state"),
                    )
                    .ok()
                })
                .collect::<Vec<_>>();
            match states.first() {
                Some(state) if state.split('|').any(|f| f.trim() == "PCI_P2PDMA") => {
                    P2pSupport::Shown
                }
                Some(_) => P2pSupport::NotShown,
                None => P2pSupport::PciePresumed,
            }
        };
        let merging = namespaces
            .iter()
            .filter(|ns| {
                read(root, &format!("sys/block/{ns}/queue/nomerges"))
                    .is_some_and(|v| v.trim() != "2")
            })
            .cloned()
            .collect();
        drives.push(Drive {
            name,
            transport,
            bdf,
            iommu,
            namespaces,
            p2p,
            merging,
        });
    }
    drives.sort_by(|a, b| a.name.cmp(&b.name));
    drives
}

/// The page mode fgds would choose for `gpu` (its `pages=` rule: P2PDMA pages where the
/// kernel has `CONFIG_PCI_P2PDMA` or `pages=p2pdma`, else GENERIC pages where DMA reaches them
/// as it would P2PDMA pages; docs/driver.md, Page providers), or why it would refuse.
/// Not seen from userspace: memory encryption, and whether a host bridge routes P2P.
fn predicted_mode(report: &Report, gpu: &GpuReport) -> Result<String, String> {
    if let Some(node) = &gpu.node
        && node.mode != "none"
    {
        return match node.mode.as_str() {
            "refused" => Err(
                "fgds refused this GPU's setup: the kernel log (dmesg | grep fgds) says why"
                    .to_owned(),
            ),
            mode => Ok(mode.to_owned()),
        };
    }
    if gpu.p2pmem {
        return Ok("exporter-p2pdma".to_owned());
    }
    let p2pdma = report.config.pci_p2pdma;
    let pages = report
        .module
        .params
        .get("pages")
        .map_or("auto", String::as_str);
    match (pages, p2pdma) {
        ("p2pdma", Some(true)) | ("auto", Some(true)) => return Ok("p2pdma".to_owned()),
        ("p2pdma", _) => {
            return Err(
                "fgds is loaded with pages=p2pdma but the kernel has no CONFIG_PCI_P2PDMA: load it with pages=auto"
                    .to_owned(),
            );
        }
        ("auto", None) => {
            return Err(format!(
                "whether the kernel has CONFIG_PCI_P2PDMA is unknown (no /boot/config-{} or /proc/config.gz), and with it the page mode",
                report.kernel
            ));
        }
        _ => {}
    }
    // GENERIC pages: only where DMA reaches them as it would reach P2PDMA pages.
    let why = if gpu.iommu.translates() {
        Some(format!("an IOMMU translates the DMA of GPU {}", gpu.bdf))
    } else if let Some(d) = report.drives.iter().find(|d| d.iommu.translates()) {
        Some(format!("an IOMMU translates the DMA of {}", d.name))
    } else if report.cmdline.iter().any(|w| w == "swiotlb=force") {
        Some("swiotlb=force bounces the drives' DMA".to_owned())
    } else {
        None
    };
    match why {
        None => Ok("generic".to_owned()),
        Some(why) => Err(format!(
            "{why}, so GENERIC pages are not safe, and {}: fgds would refuse (set the IOMMU to passthrough, iommu=pt, or use a kernel with CONFIG_PCI_P2PDMA)",
            if pages == "generic" {
                "fgds is loaded with pages=generic"
            } else {
                "the kernel has no CONFIG_PCI_P2PDMA for P2PDMA pages"
            }
        )),
    }
}

fn verdict(report: &Report) -> Verdict {
    let mut blockers = Vec::new();
    let mut notes = Vec::new();
    let module = &report.module;
    if !module.loaded {
        let mut why = "the fgds module is not loaded".to_owned();
        match &module.installed {
            Some(path) => why.push_str(&format!(" (installed: {path}; modprobe fgds)")),
            None => why.push_str(&format!(
                " and not installed for {} (install the fgds-dkms package)",
                report.kernel
            )),
        }
        if let Some(cannot) = &module.cannot_load {
            why.push_str(&format!("; {cannot}"));
        }
        blockers.push(why);
    }
    if report.config.zone_device == Some(false) {
        blockers.push(
            "the kernel has no CONFIG_ZONE_DEVICE: fgds cannot create pages over GPU memory"
                .to_owned(),
        );
    }
    // The GPU the verdict speaks of: the first with a CUDA device able to export, else the
    // first with an fgds node, else the first.
    let gpu = report
        .gpus
        .iter()
        .find(|g| g.cuda.as_ref().is_some_and(|c| c.dma_buf))
        .or_else(|| report.gpus.iter().find(|g| g.node.is_some()))
        .or_else(|| report.gpus.first());
    match gpu {
        None => blockers.push("no GPU: no PCI device of display class".to_owned()),
        Some(gpu) => {
            match gpu.bar {
                Some((_, size)) if size >= MIN_BAR => {}
                _ => blockers.push(format!(
                    "GPU {} has no prefetchable BAR of 64 MiB or more for fgds to serve",
                    gpu.bdf
                )),
            }
            match &gpu.node {
                None if module.loaded => blockers.push(format!(
                    "fgds has no node for GPU {}: it serves display-class GPUs and those named in devices=",
                    gpu.bdf
                )),
                None => {}
                Some(node) if !node.accessible => blockers.push(format!(
                    "{} cannot be opened read-write by this user: join the fgds group (usermod -aG fgds $USER, then log in again)",
                    node.path
                )),
                Some(_) => {}
            }
            if let Err(why) = predicted_mode(report, gpu) {
                blockers.push(why);
            }
            match (&gpu.cuda, &report.cuda) {
                (Some(c), _) if !c.dma_buf => blockers.push(format!(
                    "CUDA device {} cannot export its memory as a dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0): it needs NVIDIA's open kernel module",
                    c.ordinal
                )),
                (Some(_), _) => {}
                (None, Err(why)) => notes.push(format!("no CUDA: {why}")),
                (None, Ok(_)) => notes.push(format!(
                    "no CUDA device on {}: its memory must come as a dma-buf from its own runtime",
                    gpu.bdf
                )),
            }
        }
    }
    let pcie = report
        .drives
        .iter()
        .filter(|d| d.transport == "pcie")
        .collect::<Vec<_>>();
    if pcie.is_empty() {
        blockers.push(if report.drives.is_empty() {
            "no NVMe drive".to_owned()
        } else {
            "no PCIe NVMe drive (fabrics drives cannot take P2P DMA)".to_owned()
        });
    }
    let mode = gpu.and_then(|g| predicted_mode(report, g).ok());
    if (mode.as_deref() == Some("p2pdma") || mode.as_deref() == Some("exporter-p2pdma"))
        && !pcie.is_empty()
        && pcie.iter().all(|d| d.p2p == P2pSupport::NotShown)
    {
        blockers
            .push("no NVMe queue accepts P2PDMA pages (debugfs state lacks PCI_P2PDMA)".to_owned());
    }
    let p2pdma = mode.as_deref() == Some("p2pdma") || mode.as_deref() == Some("exporter-p2pdma");
    for d in pcie.iter().filter(|d| p2pdma && !d.merging.is_empty()) {
        notes.push(format!(
            "{} may merge requests ({}): fgds's own reads and writes of P2PDMA pages refuse it, and reads go through the mapping instead; for fgds's commands: echo 2 > /sys/block/{}/queue/nomerges",
            d.name,
            d.merging.join(" "),
            d.merging[0]
        ));
    }
    if let Some(gpu) = gpu {
        for (drive, meet) in &gpu.paths {
            if meet == "the host bridge" {
                notes.push(format!(
                    "{} and {drive} meet at the host bridge, which routes P2P only on an AMD Zen CPU or a root complex on the kernel's list: where it does not, fgds refuses (and P2PDMA I/O fails)",
                    gpu.bdf
                ));
            }
        }
    }
    if report.group.gid.is_none() {
        notes.push(
            "no fgds group: the fgds-dkms package creates it and gives it the nodes".to_owned(),
        );
    }
    let direct = blockers.is_empty();
    let mut path = match (direct, &mode) {
        (true, Some(mode)) => format!("direct (fgds, {mode} pages)"),
        _ => {
            "bounce: into RAM, then a copy to the GPU (the direct path is not available)".to_owned()
        }
    };
    // The kernel's own path comes first where it exists, for what it takes.
    if report.uring_dmabuf.is_ok() && !pcie.is_empty() {
        path = format!(
            "uring-dmabuf for raw NVMe namespaces opened O_DIRECT (the kernel's dma-buf \
             registered buffers: the NVMe driver imports the GPU's dma-buf, no fgds); files on \
             a file system: {path}"
        );
    }
    Verdict {
        path,
        direct,
        gpu: gpu.map(|g| g.bdf.clone()),
        blockers,
        notes,
    }
}

/// The page mode of `gpu`: what sysfs says, or what fgds would choose, or why it would refuse.
fn pages(report: &Report, gpu: &GpuReport) -> String {
    let shown = gpu.node.as_ref().is_some_and(|n| n.mode != "none");
    match predicted_mode(report, gpu) {
        Ok(mode) if shown => mode,
        Ok(mode) => format!("{mode} (what fgds would choose here)"),
        Err(why) => format!("refused: {why}"),
    }
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b => format!("{} MiB", b >> 20),
    }
}

impl Report {
    /// The short human form.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let mut line = |label: &str, text: String| {
            out.push_str(&format!("{label:<9} {text}\n"));
        };
        line("kernel", self.kernel.clone());
        let m = &self.module;
        line(
            "module",
            match (m.loaded, &m.installed) {
                (true, _) => {
                    let params = m
                        .params
                        .iter()
                        .filter(|(k, _)| ["pages", "devices"].contains(&k.as_str()))
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect::<Vec<_>>();
                    format!("loaded ({})", params.join(" "))
                }
                (false, Some(path)) => format!("not loaded; installed at {path}"),
                (false, None) => format!("not loaded; not installed for {}", self.kernel),
            } + &m
                .cannot_load
                .as_ref()
                .map(|c| format!("; {c}"))
                .unwrap_or_default(),
        );
        let opt = |v: Option<bool>| match v {
            Some(true) => "y",
            Some(false) => "n",
            None => "unknown",
        };
        line(
            "config",
            format!(
                "CONFIG_PCI_P2PDMA={} CONFIG_ZONE_DEVICE={} ({})",
                opt(self.config.pci_p2pdma),
                opt(self.config.zone_device),
                self.config.source.as_deref().unwrap_or("no config found")
            ),
        );
        if !self.cmdline.is_empty() {
            line("cmdline", self.cmdline.join(" "));
        }
        line(
            "io_uring",
            match &self.uring_dmabuf {
                Ok(()) => "dma-buf registered buffers: yes (the kernel's own path, taken first)"
                    .to_owned(),
                Err(why) => format!("dma-buf registered buffers: no ({why})"),
            },
        );
        if self.gpus.is_empty() {
            line("gpu", "none".to_owned());
        }
        for g in &self.gpus {
            let bar = g.bar.map_or("no prefetchable BAR".to_owned(), |(i, s)| {
                format!("BAR{i} {}", size(s))
            });
            line(
                "gpu",
                format!(
                    "{} [{}] driver {}, {bar}, IOMMU {}{}",
                    g.bdf,
                    g.id,
                    g.driver.as_deref().unwrap_or("none"),
                    g.iommu.describe(),
                    if g.p2pmem {
                        ", exporter P2PDMA memory"
                    } else {
                        ""
                    }
                ),
            );
            line(
                "  node",
                match &g.node {
                    Some(n) => format!(
                        "{} mode {}{}",
                        n.path,
                        n.mode,
                        match n.dev {
                            Some((mode, gid)) => format!(" ({mode:o}, gid {gid})"),
                            None => ", no /dev node".to_owned(),
                        }
                    ),
                    None => "none".to_owned(),
                },
            );
            line("  pages", pages(self, g));
            if let Some(c) = &g.cuda {
                line(
                    "  cuda",
                    format!(
                        "device {} ({}), dma-buf export {}",
                        c.ordinal,
                        c.name,
                        if c.dma_buf {
                            "supported"
                        } else {
                            "NOT supported"
                        }
                    ),
                );
            }
            for (drive, meet) in &g.paths {
                line("  path", format!("to {drive} through {meet}"));
            }
        }
        if let Err(why) = &self.cuda {
            line("cuda", why.clone());
        }
        if self.drives.is_empty() {
            line("nvme", "none".to_owned());
        }
        for d in &self.drives {
            line(
                "nvme",
                format!(
                    "{} {} {} IOMMU {}, P2PDMA queues: {} ({})",
                    d.name,
                    d.transport,
                    d.bdf.as_deref().unwrap_or("-"),
                    d.iommu.describe(),
                    match d.p2p {
                        P2pSupport::Shown => "yes",
                        P2pSupport::NotShown => "no",
                        P2pSupport::PciePresumed => "yes where CONFIG_PCI_P2PDMA (not shown)",
                        P2pSupport::No => "no",
                    },
                    d.namespaces.join(" ")
                ),
            );
        }
        line(
            "group",
            match (self.group.gid, self.group.member, self.group.root) {
                (None, _, _) => "fgds: none".to_owned(),
                (Some(gid), member, root) => format!(
                    "fgds ({gid}): {}",
                    if root {
                        "you are root"
                    } else if member {
                        "you are a member"
                    } else {
                        "you are not a member"
                    }
                ),
            },
        );
        line(
            "memlock",
            match self.group.memlock {
                None => "unknown (no /proc/self/limits)".to_owned(),
                Some(None) => "unlimited for this process".to_owned(),
                Some(Some(bytes)) => format!(
                    "{} KiB for this process: registrations of GPU memory count against \
                     RLIMIT_MEMLOCK unless you have CAP_IPC_LOCK (raise it with ulimit -l or \
                     limits.conf; the fgds package sets 1 TiB for the fgds group)",
                    bytes >> 10
                ),
            },
        );
        let v = &self.verdict;
        line("path", v.path.clone());
        for b in &v.blockers {
            line("  because", b.clone());
        }
        for n in &v.notes {
            line("  note", n.clone());
        }
        out
    }

    /// The report as JSON.
    pub fn json(&self) -> Value {
        let iommu =
            |i: &Iommu| json!({"group": i.group, "domain": i.domain, "translates": i.translates()});
        let cuda = |c: &CudaDevice| json!({"ordinal": c.ordinal, "name": c.name, "bdf": c.bdf, "dma_buf": c.dma_buf});
        json!({
            "kernel": self.kernel,
            "module": {
                "loaded": self.module.loaded,
                "params": self.module.params,
                "installed": self.module.installed,
                "cannot_load": self.module.cannot_load,
            },
            "config": {
                "source": self.config.source,
                "pci_p2pdma": self.config.pci_p2pdma,
                "zone_device": self.config.zone_device,
            },
            "cmdline": self.cmdline,
            "gpus": self.gpus.iter().map(|g| json!({
                "bdf": g.bdf,
                "id": g.id,
                "driver": g.driver,
                "bar": g.bar.map(|(i, s)| json!({"index": i, "size": s})),
                "iommu": iommu(&g.iommu),
                "p2pmem": g.p2pmem,
                "node": g.node.as_ref().map(|n| json!({
                    "path": n.path, "mode": n.mode,
                    "dev_mode": n.dev.map(|(m, _)| format!("{m:o}")),
                    "dev_gid": n.dev.map(|(_, g)| g),
                    "accessible": n.accessible,
                })),
                "pages": pages(self, g),
                "cuda": g.cuda.as_ref().map(cuda),
                "paths": g.paths.iter().map(|(d, m)| json!({"drive": d, "meet": m})).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
            "cuda": match &self.cuda {
                Ok(devices) => json!({"devices": devices.iter().map(cuda).collect::<Vec<_>>()}),
                Err(why) => json!({"error": why}),
            },
            "drives": self.drives.iter().map(|d| json!({
                "name": d.name,
                "transport": d.transport,
                "bdf": d.bdf,
                "iommu": iommu(&d.iommu),
                "namespaces": d.namespaces,
                "p2p": format!("{:?}", d.p2p),
                "merging": d.merging,
            })).collect::<Vec<_>>(),
            "group": {"gid": self.group.gid, "member": self.group.member, "root": self.group.root,
                      "memlock_bytes": self.group.memlock.map(|m| m.map_or(json!("unlimited"), |b| json!(b)))},
            "uring_dmabuf": match &self.uring_dmabuf {
                Ok(()) => json!({"available": true}),
                Err(why) => json!({"available": false, "why": why}),
            },
            "verdict": {
                "path": self.verdict.path,
                "direct": self.verdict.direct,
                "gpu": self.verdict.gpu,
                "blockers": self.verdict.blockers,
                "notes": self.verdict.notes,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limit registrations count against, read from /proc/self/limits.
    #[test]
    fn memlock_is_read_from_proc() {
        let fx = Fixture::new("memlock");
        fx.write(
            "proc/self/limits",
            "Limit                     Soft Limit           Hard Limit           Units\n\
             Max locked memory         8388608              8388608              bytes\n",
        );
        assert_eq!(memlock(&fx.root), Some(Some(8 << 20)));
        fx.write(
            "proc/self/limits",
            "Max locked memory         unlimited            unlimited            bytes\n",
        );
        assert_eq!(memlock(&fx.root), Some(None));
        let empty = Fixture::new("memlock-none");
        assert_eq!(memlock(&empty.root), None);
    }

    /// A fake root directory, removed when dropped.
    struct Fixture {
        root: PathBuf,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let root =
                std::env::temp_dir().join(format!("fgds-doctor-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            Fixture { root }
        }

        fn write(&self, rel: &str, text: &str) {
            let path = self.root.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }

        fn link(&self, rel: &str, target: &Path) {
            let path = self.root.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, path).unwrap();
        }

        /// A PCI device below `chain` (bridges from the root port down), listed in
        /// /sys/bus/pci/devices; returns its directory.
        fn pci(&self, chain: &[&str], class: &str, resource: &str) -> PathBuf {
            let rel = format!("sys/devices/pci0000:00/{}", chain.join("/"));
            let dir = self.root.join(&rel);
            std::fs::create_dir_all(&dir).unwrap();
            for (file, text) in [
                ("class", class),
                ("vendor", "0x10de"),
                ("device", "0x2335"),
                ("resource", resource),
            ] {
                self.write(&format!("{rel}/{file}"), text);
            }
            self.link(
                &format!("sys/bus/pci/devices/{}", chain.last().unwrap()),
                &dir,
            );
            dir
        }

        fn iommu_group(&self, device: &Path, group: &str, domain: &str) {
            let dir = self.root.join("sys/kernel/iommu_groups").join(group);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("type"), format!("{domain}\n")).unwrap();
            std::os::unix::fs::symlink(&dir, device.join("iommu_group")).unwrap();
        }

        fn nvme(&self, name: &str, device: &Path) {
            self.write(&format!("sys/class/nvme/{name}/transport"), "pcie\n");
            self.link(&format!("sys/class/nvme/{name}/device"), device);
            std::fs::create_dir_all(self.root.join(format!("sys/class/nvme/{name}/{name}n1")))
                .unwrap();
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    /// BAR0 16 MiB non-prefetchable, BAR1 256 GiB prefetchable 64-bit, BAR3 32 MiB
    /// prefetchable: an H200's layout.
    const GPU_RESOURCE: &str = "0x00000000f0000000 0x00000000f0ffffff 0x0000000000040200\n\
        0x0000220000000000 0x0000223fffffffff 0x000000000014220c\n\
        0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
        0x0000224000000000 0x0000224001ffffff 0x000000000014220c\n\
        0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
        0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
        0x0000000000000000 0x0000000000000000 0x0000000000000000\n";

    fn h200() -> CudaDevice {
        CudaDevice {
            ordinal: 0,
            name: "NVIDIA H200".to_owned(),
            bdf: "0000:18:00.0".to_owned(),
            dma_buf: true,
        }
    }

    fn user() -> Identity {
        Identity {
            uid: 1000,
            gids: vec![1000, 990],
        }
    }

    #[test]
    fn a_gpu_machine_without_the_module_reads_through_ram() {
        let f = Fixture::new("h200");
        f.write("proc/sys/kernel/osrelease", "6.18.0-test\n");
        f.write(
            "proc/self/status",
            "Name:\tfgds\nCapEff:\t000001fffffeffff\n",
        );
        f.write(
            "boot/config-6.18.0-test",
            "CONFIG_ZONE_DEVICE=y\nCONFIG_PCI_P2PDMA=y\n",
        );
        let gpu = f.pci(
            &["0000:00:01.0", "0000:18:00.0"],
            "0x030200\n",
            GPU_RESOURCE,
        );
        f.link("sys/bus/pci/drivers/nvidia", Path::new("/nonexistent"));
        f.link(
            "sys/devices/pci0000:00/0000:00:01.0/0000:18:00.0/driver",
            &f.root.join("sys/bus/pci/drivers/nvidia"),
        );
        f.iommu_group(&gpu, "12", "identity");
        f.write("etc/group", "root:x:0:\nvideo:x:44:\n");
        let report = examine(&f.root, &user(), Ok(vec![h200()]));

        assert!(!report.module.loaded);
        assert_eq!(report.module.installed, None);
        assert!(
            report
                .module
                .cannot_load
                .as_deref()
                .unwrap()
                .contains("CAP_SYS_MODULE")
        );
        assert_eq!(report.config.pci_p2pdma, Some(true));
        let g = &report.gpus[0];
        assert_eq!(g.bdf, "0000:18:00.0");
        assert_eq!(g.driver.as_deref(), Some("nvidia"));
        assert_eq!(g.bar, Some((1, 256 << 30)));
        assert_eq!(g.iommu.domain.as_deref(), Some("identity"));
        assert!(!g.iommu.translates());
        assert_eq!(g.cuda, Some(h200()));
        let v = &report.verdict;
        assert!(!v.direct);
        assert!(v.path.starts_with("bounce"), "{}", v.path);
        assert_eq!(v.gpu.as_deref(), Some("0000:18:00.0"));
        assert!(
            v.blockers[0]
                .starts_with("the fgds module is not loaded and not installed for 6.18.0-test"),
            "{:?}",
            v.blockers
        );
        assert!(
            v.blockers.iter().any(|b| b == "no NVMe drive"),
            "{:?}",
            v.blockers
        );
        assert!(v.notes.iter().any(|n| n.starts_with("no fgds group")));
        let text = report.text();
        assert!(text.contains("module    not loaded; not installed for 6.18.0-test; this process lacks CAP_SYS_MODULE"), "{text}");
        assert!(
            text.contains("device 0 (NVIDIA H200), dma-buf export supported"),
            "{text}"
        );
        assert_eq!(report.json()["verdict"]["direct"], false);
    }

    #[test]
    fn the_rig_reads_directly() {
        let f = Fixture::new("rig");
        f.write("proc/sys/kernel/osrelease", "6.12.0-test\n");
        let gz = {
            use std::io::Write;
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(b"CONFIG_ZONE_DEVICE=y\n# CONFIG_PCI_P2PDMA is not set\n")
                .unwrap();
            e.finish().unwrap()
        };
        std::fs::create_dir_all(f.root.join("proc")).unwrap();
        std::fs::write(f.root.join("proc/config.gz"), gz).unwrap();
        f.write("sys/module/fgds/parameters/pages", "auto\n");
        f.write("sys/module/fgds/parameters/devices", "@ivshmem@\n");
        // A switch: upstream port 01:00.0, downstream ports 02:00.0 and 02:01.0.
        let up = ["0000:00:02.0", "0000:01:00.0"];
        let gpu = f.pci(
            &[up[0], up[1], "0000:02:00.0", "0000:03:00.0"],
            "0x050000\n",
            GPU_RESOURCE,
        );
        let drive = f.pci(
            &[up[0], up[1], "0000:02:01.0", "0000:04:00.0"],
            "0x010802\n",
            "",
        );
        f.nvme("nvme0", &drive);
        f.write("sys/class/fgds/fgds_0000_03_00_0/mode", "generic\n");
        f.link("sys/class/fgds/fgds_0000_03_00_0/device", &gpu);
        f.write("dev/fgds_0000_03_00_0", "");
        let dev = f.root.join("dev/fgds_0000_03_00_0");
        std::fs::set_permissions(&dev, std::os::unix::fs::PermissionsExt::from_mode(0o660))
            .unwrap();
        let gid = {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&dev).unwrap().gid()
        };
        f.write("etc/group", &format!("fgds:x:{gid}:alice\n"));
        let who = Identity {
            uid: 1000,
            gids: vec![gid],
        };
        let report = examine(&f.root, &who, Err("cannot load the CUDA driver".to_owned()));

        assert!(report.module.loaded);
        assert_eq!(report.config.pci_p2pdma, Some(false));
        assert!(
            report
                .config
                .source
                .as_deref()
                .unwrap()
                .ends_with("proc/config.gz")
        );
        assert_eq!(report.drives.len(), 1);
        assert_eq!(report.drives[0].bdf.as_deref(), Some("0000:04:00.0"));
        assert_eq!(report.drives[0].namespaces, vec!["nvme0n1".to_owned()]);
        assert_eq!(report.drives[0].p2p, P2pSupport::PciePresumed);
        let g = &report.gpus[0];
        assert!(g.node.as_ref().unwrap().accessible);
        assert_eq!(
            g.paths,
            vec![(
                "nvme0".to_owned(),
                "the PCIe switch at 0000:01:00.0".to_owned()
            )]
        );
        assert!(report.group.member);
        let v = &report.verdict;
        assert!(v.direct, "{:?}", v.blockers);
        assert_eq!(v.path, "direct (fgds, generic pages)");

        // The same node without the group's bits: the user is told to join.
        std::fs::set_permissions(&dev, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let report = examine(&f.root, &who, Err(String::new()));
        assert!(!report.verdict.direct);
        assert!(
            report.verdict.blockers[0].contains("join the fgds group"),
            "{:?}",
            report.verdict.blockers
        );

        // A queue that may merge: nothing to say with GENERIC pages, which may merge with RAM;
        // with P2PDMA pages fgds's commands refuse it, and the note says how to allow them.
        f.write("sys/block/nvme0n1/queue/nomerges", "0\n");
        let merges = |r: &Report| r.verdict.notes.iter().any(|n| n.contains("nomerges"));
        let report = examine(&f.root, &who, Err(String::new()));
        assert_eq!(report.drives[0].merging, vec!["nvme0n1".to_owned()]);
        assert!(!merges(&report), "{:?}", report.verdict.notes);
        f.write("sys/class/fgds/fgds_0000_03_00_0/mode", "p2pdma\n");
        let report = examine(&f.root, &who, Err(String::new()));
        assert!(merges(&report), "{:?}", report.verdict.notes);
        f.write("sys/block/nvme0n1/queue/nomerges", "2\n");
        let report = examine(&f.root, &who, Err(String::new()));
        assert!(report.drives[0].merging.is_empty());
        assert!(!merges(&report), "{:?}", report.verdict.notes);
    }

    #[test]
    fn a_translating_iommu_without_p2pdma_is_refused() {
        let f = Fixture::new("iommu");
        f.write("proc/sys/kernel/osrelease", "6.12.0-test\n");
        f.write("boot/config-6.12.0-test", "CONFIG_ZONE_DEVICE=y\n");
        f.write("sys/module/fgds/parameters/pages", "auto\n");
        f.write(
            "lib/modules/6.12.0-test/modules.dep",
            "updates/dkms/fgds.ko.xz:\nkernel/x.ko:\n",
        );
        let gpu = f.pci(
            &["0000:00:01.0", "0000:05:00.0"],
            "0x030000\n",
            GPU_RESOURCE,
        );
        f.iommu_group(&gpu, "3", "DMA-FQ");
        let drive = f.pci(&["0000:00:03.0", "0000:06:00.0"], "0x010802\n", "");
        f.iommu_group(&drive, "4", "DMA-FQ");
        f.nvme("nvme0", &drive);
        f.write(
            "sys/kernel/debug/block/nvme0n1/state",
            "SAME_COMP|NONROT|IO_STAT|PCI_P2PDMA\n",
        );
        let report = examine(
            &f.root,
            &Identity {
                uid: 0,
                gids: vec![0],
            },
            Ok(Vec::new()),
        );
        assert_eq!(
            report.module.installed.as_deref(),
            Some(
                f.root
                    .join("lib/modules/6.12.0-test/updates/dkms/fgds.ko.xz")
                    .to_str()
                    .unwrap()
            )
        );
        assert_eq!(report.drives[0].p2p, P2pSupport::Shown);
        assert!(report.gpus[0].iommu.translates());
        assert_eq!(report.gpus[0].paths[0].1, "the host bridge");
        assert!(v_notes_mention_host_bridge(&report));
        let v = &report.verdict;
        assert!(!v.direct);
        assert!(
            v.blockers
                .iter()
                .any(|b| b.starts_with("an IOMMU translates the DMA of GPU 0000:05:00.0, so GENERIC pages are not safe, and the kernel has no CONFIG_PCI_P2PDMA")),
            "{:?}",
            v.blockers
        );
        // Without the module loaded nothing says fgds has no node for the GPU.
        assert!(
            v.blockers
                .iter()
                .any(|b| b.contains("fgds has no node for GPU 0000:05:00.0"))
        );
    }

    fn v_notes_mention_host_bridge(report: &Report) -> bool {
        report
            .verdict
            .notes
            .iter()
            .any(|n| n.contains("meet at the host bridge"))
    }

    #[test]
    fn bars_are_the_largest_prefetchable_memory_one() {
        assert_eq!(largest_prefetchable_bar(GPU_RESOURCE), Some((1, 256 << 30)));
        let io_only = "0x000000000000c000 0x000000000000c0ff 0x0000000000040101\n";
        assert_eq!(largest_prefetchable_bar(io_only), None);
        assert_eq!(largest_prefetchable_bar(""), None);
    }

    #[test]
    fn module_files_are_recognised() {
        assert!(is_fgds_ko("updates/dkms/fgds.ko.zst"));
        assert!(is_fgds_ko("extra/fgds.ko"));
        assert!(!is_fgds_ko("kernel/drivers/xfgds.ko"));
        assert!(!is_fgds_ko("updates/dkms/fgds.ko.sig"));
    }
}
