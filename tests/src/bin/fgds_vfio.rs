//! fgds and the BAR dma-bufs of vfio-pci, an exporter nobody here wrote
//! (`VFIO_DEVICE_FEATURE_DMA_BUF`, drivers/vfio/pci/vfio_pci_dmabuf.c).
//!
//! vfio-pci keeps P2PDMA state of its own for the BARs it exports (`pcim_p2pdma_init()`, a
//! provider and no pages), and fgds adds no pages to another driver's P2PDMA state (issue 36;
//! docs/driver.md, Page providers): beside it fgds could only make GENERIC pages, which it
//! refuses under the IOMMU that vfio needs. So a registration of a vfio-pci dma-buf is refused
//! with EOPNOTSUPP, the kernel log says why, and the GPU's P2PDMA state stays as vfio left it
//! (no P2PDMA pool appears). The direct path for vfio-pci's dma-bufs is the kernel's own dma-buf
//! I/O (docs/upstream.md).
//!
//! The rig binds the ivshmem "GPU" to vfio-pci instead of vgpu (`cargo xtask test-vm --iommu
//! --exporter vfio`); in runs whose GPU is vgpu's the program skips as a whole
//! (xtask/src/expected.rs says where).

#[path = "../fgds_common.rs"]
mod common;

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use common::{MIB, PAGE};
use fgds_tests::guest;
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

fn main() {
    if guest::exporter() != "vfio" {
        println!(
            "KTAP version 1\n1..0 # SKIP the GPU is not bound to vfio-pci (exporter {}): run \
             with --iommu --exporter vfio",
            guest::exporter()
        );
        std::process::exit(4);
    }
    ktap::run(&[
        Case {
            name: "gpu_is_bound_to_vfio_pci",
            run: gpu_is_bound_to_vfio_pci,
        },
        Case {
            name: "registration_refused_vfio_state_untouched",
            run: registration_refused_vfio_state_untouched,
        },
    ])
}

/// vfio's UAPI (include/uapi/linux/vfio.h): `_IO(';', 100 + n)`.
mod uapi {
    const fn io(nr: u32) -> libc::c_ulong {
        ((b';' as u32) << 8 | (100 + nr)) as libc::c_ulong
    }
    pub const GET_API_VERSION: libc::c_ulong = io(0);
    pub const CHECK_EXTENSION: libc::c_ulong = io(1);
    pub const SET_IOMMU: libc::c_ulong = io(2);
    pub const GROUP_GET_STATUS: libc::c_ulong = io(3);
    pub const GROUP_SET_CONTAINER: libc::c_ulong = io(4);
    pub const GROUP_GET_DEVICE_FD: libc::c_ulong = io(6);
    pub const DEVICE_GET_INFO: libc::c_ulong = io(7);
    pub const DEVICE_GET_REGION_INFO: libc::c_ulong = io(8);
    pub const DEVICE_FEATURE: libc::c_ulong = io(17);

    pub const API_VERSION: i32 = 0;
    pub const TYPE1V2_IOMMU: libc::c_ulong = 3;
    pub const GROUP_FLAGS_VIABLE: u32 = 1;
    pub const DEVICE_FLAGS_RESET: u32 = 1;
    pub const DEVICE_FLAGS_PCI: u32 = 2;
    pub const PCI_BAR2_REGION_INDEX: u32 = 2;
    pub const DEVICE_FEATURE_GET: u32 = 1 << 16;
    pub const DEVICE_FEATURE_DMA_BUF: u32 = 11;

    /// struct vfio_group_status.
    #[repr(C)]
    pub struct GroupStatus {
        pub argsz: u32,
        pub flags: u32,
    }

    /// struct vfio_device_info (without the capability chain).
    #[repr(C)]
    pub struct DeviceInfo {
        pub argsz: u32,
        pub flags: u32,
        pub num_regions: u32,
        pub num_irqs: u32,
        pub cap_offset: u32,
        pub pad: u32,
    }

    /// struct vfio_region_info.
    #[repr(C)]
    #[derive(Clone, Copy, Debug)]
    pub struct RegionInfo {
        pub argsz: u32,
        pub flags: u32,
        pub index: u32,
        pub cap_offset: u32,
        pub size: u64,
        pub offset: u64,
    }
}

/// `ioctl(fd, req, arg)`: the return value, or the errno.
fn ioctl(fd: RawFd, req: libc::c_ulong, arg: usize) -> Result<i32, Errno> {
    // SAFETY: every caller passes a request of vfio's UAPI with the argument it documents (an
    // integer, or a pointer to a live struct of the size the kernel reads from argsz).
    let r = unsafe { libc::ioctl(fd, req as _, arg) };
    if r < 0 { Err(last_errno()) } else { Ok(r) }
}

fn last_errno() -> Errno {
    Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// The GPU: the ivshmem device's PCI address.
fn gpu_bdf() -> anyhow::Result<String> {
    for entry in std::fs::read_dir("/sys/bus/pci/devices")?.flatten() {
        let read =
            |attr: &str| std::fs::read_to_string(entry.path().join(attr)).unwrap_or_default();
        if read("vendor").trim() == "0x1af4" && read("device").trim() == "0x1110" {
            return Ok(entry.file_name().to_string_lossy().into_owned());
        }
    }
    bail!("no ivshmem device (1af4:1110): the rig's GPU is missing")
}

/// The driver bound to PCI device `bdf`, if any.
fn driver_of(bdf: &str) -> Option<String> {
    std::fs::read_link(format!("/sys/bus/pci/devices/{bdf}/driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
}

/// fgds's node of the GPU.
fn node_path(bdf: &str) -> PathBuf {
    PathBuf::from(format!("/dev/fgds_{}", bdf.replace([':', '.'], "_")))
}

fn open_node(bdf: &str) -> anyhow::Result<File> {
    let path = node_path(bdf);
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| {
            format!(
                "cannot open {}: is fgds loaded with devices={bdf}?",
                path.display()
            )
        })
}

/// An fgds sysfs attribute of the GPU.
fn fgds_sysfs(bdf: &str, attr: &str) -> anyhow::Result<String> {
    let name = node_path(bdf);
    let path = Path::new("/sys/class/fgds")
        .join(name.file_name().context("node name")?)
        .join(attr);
    Ok(std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .trim()
        .to_owned())
}

/// The GPU's IOMMU group, opened into a type1 container (both stay open while this lives).
struct Group {
    bdf: String,
    _container: File,
    group: File,
}

impl Group {
    fn open() -> anyhow::Result<Group> {
        let bdf = gpu_bdf()?;
        let driver = driver_of(&bdf);
        ensure!(
            driver.as_deref() == Some("vfio-pci"),
            "the GPU {bdf} is bound to {driver:?}, not to vfio-pci: the rig did not bind it \
             (--exporter vfio)"
        );
        let group_link = std::fs::read_link(format!("/sys/bus/pci/devices/{bdf}/iommu_group"))
            .with_context(|| format!("{bdf} is in no IOMMU group: is the vIOMMU on (--iommu)?"))?;
        let number = group_link
            .file_name()
            .context("IOMMU group link")?
            .to_string_lossy()
            .into_owned();
        let rw = |path: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .with_context(|| format!("cannot open {path}"))
        };
        let container = rw("/dev/vfio/vfio")?;
        let version = ioctl(container.as_raw_fd(), uapi::GET_API_VERSION, 0)?;
        ensure!(version == uapi::API_VERSION, "vfio API version {version}");
        let type1 = ioctl(
            container.as_raw_fd(),
            uapi::CHECK_EXTENSION,
            uapi::TYPE1V2_IOMMU as usize,
        )?;
        ensure!(type1 == 1, "the vfio container offers no type1v2 IOMMU");
        let group = rw(&format!("/dev/vfio/{number}"))?;
        let mut status = uapi::GroupStatus {
            argsz: std::mem::size_of::<uapi::GroupStatus>() as u32,
            flags: 0,
        };
        ioctl(
            group.as_raw_fd(),
            uapi::GROUP_GET_STATUS,
            &raw mut status as usize,
        )
        .context("VFIO_GROUP_GET_STATUS")?;
        ensure!(
            status.flags & uapi::GROUP_FLAGS_VIABLE != 0,
            "IOMMU group {number} is not viable: another device of it is bound to a host driver"
        );
        let fd = container.as_raw_fd();
        ioctl(
            group.as_raw_fd(),
            uapi::GROUP_SET_CONTAINER,
            &raw const fd as usize,
        )
        .context("VFIO_GROUP_SET_CONTAINER")?;
        ioctl(
            container.as_raw_fd(),
            uapi::SET_IOMMU,
            uapi::TYPE1V2_IOMMU as usize,
        )
        .context("VFIO_SET_IOMMU(type1v2)")?;
        Ok(Group {
            bdf,
            _container: container,
            group,
        })
    }

    /// Opens the device (vfio-pci enables it, and resets it if it can).
    fn device(&self) -> anyhow::Result<Device> {
        let name = CString::new(self.bdf.clone())?;
        let fd = ioctl(
            self.group.as_raw_fd(),
            uapi::GROUP_GET_DEVICE_FD,
            name.as_ptr() as usize,
        )
        .context("VFIO_GROUP_GET_DEVICE_FD")?;
        // SAFETY: the ioctl returned a new descriptor that nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut info = uapi::DeviceInfo {
            argsz: std::mem::size_of::<uapi::DeviceInfo>() as u32,
            flags: 0,
            num_regions: 0,
            num_irqs: 0,
            cap_offset: 0,
            pad: 0,
        };
        ioctl(
            file.as_raw_fd(),
            uapi::DEVICE_GET_INFO,
            &raw mut info as usize,
        )
        .context("VFIO_DEVICE_GET_INFO")?;
        ensure!(
            info.flags & uapi::DEVICE_FLAGS_PCI != 0,
            "not a vfio-pci device"
        );
        let bar2 = region_info(&file, uapi::PCI_BAR2_REGION_INDEX)?;
        Ok(Device {
            file: Arc::new(file),
            flags: info.flags,
            bar2,
        })
    }
}

fn region_info(dev: &File, index: u32) -> anyhow::Result<uapi::RegionInfo> {
    let mut info = uapi::RegionInfo {
        argsz: std::mem::size_of::<uapi::RegionInfo>() as u32,
        flags: 0,
        index,
        cap_offset: 0,
        size: 0,
        offset: 0,
    };
    ioctl(
        dev.as_raw_fd(),
        uapi::DEVICE_GET_REGION_INFO,
        &raw mut info as usize,
    )
    .with_context(|| format!("VFIO_DEVICE_GET_REGION_INFO {index}"))?;
    Ok(info)
}

/// An open vfio-pci device.
struct Device {
    file: Arc<File>,
    flags: u32,
    bar2: uapi::RegionInfo,
}

impl Device {
    /// `VFIO_DEVICE_FEATURE_DMA_BUF` of BAR2 `ranges` (offset, length), read-write or
    /// read-only: the dma-buf, or the errno.
    fn export(&self, ranges: &[(u64, u64)], rdonly: bool) -> Result<OwnedFd, Errno> {
        // struct vfio_device_feature { argsz, flags, data[] } with data struct
        // vfio_device_feature_dma_buf { region_index, open_flags, flags, nr_ranges,
        // dma_ranges[] { offset, length } }, in u64 words to keep the ranges aligned.
        let mut words = vec![0u64; 3 + 2 * ranges.len()];
        let argsz = (words.len() * 8) as u32;
        let open_flags = if rdonly { libc::O_RDONLY } else { libc::O_RDWR } | libc::O_CLOEXEC;
        let lo_hi = |lo: u32, hi: u32| lo as u64 | (hi as u64) << 32;
        words[0] = lo_hi(
            argsz,
            uapi::DEVICE_FEATURE_GET | uapi::DEVICE_FEATURE_DMA_BUF,
        );
        words[1] = lo_hi(uapi::PCI_BAR2_REGION_INDEX, open_flags as u32);
        words[2] = lo_hi(0, ranges.len() as u32);
        for (i, (offset, length)) in ranges.iter().enumerate() {
            words[3 + 2 * i] = *offset;
            words[4 + 2 * i] = *length;
        }
        let fd = ioctl(
            self.file.as_raw_fd(),
            uapi::DEVICE_FEATURE,
            words.as_ptr() as usize,
        )?;
        // SAFETY: the ioctl returned a new dma-buf descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn export_rw(&self, ranges: &[(u64, u64)]) -> anyhow::Result<OwnedFd> {
        self.export(ranges, false)
            .map_err(|e| anyhow::anyhow!("VFIO_DEVICE_FEATURE_DMA_BUF of BAR2 {ranges:#x?}: {e}"))
    }
}

/// The GPU is vfio-pci's, vgpu is absent, vfio offers reset and an mmap-able BAR2, its DMA is
/// translated, and the dma-buf is vfio's (fdinfo `exp_name`).
fn gpu_is_bound_to_vfio_pci() -> CaseResult {
    let group = Group::open()?;
    let bdf = &group.bdf;
    ensure!(
        !Path::new("/sys/module/vgpu").exists(),
        "vgpu is loaded in a vfio run: the rig fell back to it"
    );
    let domain = std::fs::read_to_string(format!("/sys/bus/pci/devices/{bdf}/iommu_group/type"))
        .unwrap_or_default();
    ensure!(
        domain.trim().starts_with("DMA"),
        "the GPU's IOMMU domain is {:?}, not a translating one",
        domain.trim()
    );
    let dev = group.device()?;
    ensure!(
        dev.flags & uapi::DEVICE_FLAGS_RESET != 0,
        "vfio-pci cannot reset the GPU (no VFIO_DEVICE_FLAGS_RESET)"
    );
    ensure!(
        dev.bar2.size >= 64 * MIB,
        "BAR2 is {:#x} bytes",
        dev.bar2.size
    );
    let dmabuf = dev.export_rw(&[(0, PAGE)])?;
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", dmabuf.as_raw_fd()))?;
    let exporter = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("exp_name:"))
        .map(str::trim)
        .unwrap_or_default();
    ensure!(
        exporter.starts_with("vfio"),
        "the dma-buf's exporter is {exporter:?}, not vfio-pci"
    );
    ktap::pass()
}

/// A registration of a vfio-pci dma-buf is refused with EOPNOTSUPP and one log line that names
/// vfio's own P2PDMA state; the GPU gets no P2PDMA pool, before or after, and sysfs `mode`
/// reads `refused`, as the configuration implies.
fn registration_refused_vfio_state_untouched() -> CaseResult {
    let group = Group::open()?;
    let bdf = &group.bdf;
    let dev = group.device()?;
    let pool = Path::new("/sys/bus/pci/devices").join(bdf).join("p2pmem");
    ensure!(
        !pool.exists(),
        "{} exists before fgds registered anything: who made a P2PDMA pool on vfio's GPU?",
        pool.display()
    );
    let node = open_node(bdf)?;
    let dmabuf = dev.export_rw(&[(0, 2 * MIB)])?;
    let mark = guest::kernel_log_mark()?;
    let reg = common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB);
    let mode = fgds_sysfs(bdf, "mode")?;
    ktap::diag(format_args!("fgds-report: fgds mode={mode}"));
    ensure!(
        reg == Err(Errno::OPNOTSUPP),
        "REG_BUFFER of a vfio-pci dma-buf: {reg:?}, want EOPNOTSUPP"
    );
    let log = guest::kernel_log_since(mark)?;
    ensure!(
        log.iter()
            .any(|l| l.contains("keeps P2PDMA state of its own")),
        "the kernel log does not say why fgds refused vfio-pci's BAR:\n{}",
        log.join("\n")
    );
    let want = guest::expected_mode()?;
    ensure!(
        mode == want,
        "fgds's mode is {mode}, the configuration implies {want}"
    );
    ensure!(
        !pool.exists(),
        "{} appeared: fgds added P2PDMA pages to vfio-pci's P2PDMA state",
        pool.display()
    );
    ktap::pass()
}
