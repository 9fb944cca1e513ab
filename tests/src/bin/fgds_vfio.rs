//! Issue 18: fgds imports the BAR dma-bufs of vfio-pci, an exporter nobody here wrote
//! (`VFIO_DEVICE_FEATURE_DMA_BUF`, drivers/vfio/pci/vfio_pci_dmabuf.c), and survives the
//! revocations vfio really performs.
//!
//! The rig binds the ivshmem "GPU" to vfio-pci instead of vgpu (`cargo xtask test-vm --iommu
//! --exporter vfio`); this program opens its IOMMU group through a type1 container, exports BAR2
//! ranges as dma-bufs, registers them with fgds and moves data NVMe -> GPU -> NVMe with O_DIRECT
//! pread/pwrite and io_uring, the host checking the bytes in the GPU's backing file. Then vfio
//! revokes, while a registration is mapped and while a read is held in flight (a QEMU blkdebug
//! breakpoint), by `VFIO_DEVICE_RESET`, by clearing `PCI_COMMAND_MEMORY` through the config
//! region, and by closing the device: fgds's mapping gives SIGBUS, new I/O into it EFAULT,
//! vfio's wait for fences ends only after the held read ended, nothing of the read lands after
//! the revocation returned, and the next export and registration work.
//!
//! In runs whose GPU is vgpu's the program skips as a whole (xtask/src/expected.rs says where).

#[path = "../fgds_common.rs"]
mod common;

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map, PAGE};
use fgds_tests::guest::{self, AlignedBuf};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};
use rustix::io::Errno;

/// NVMe scratch area of this program (clear of the fault areas at 240 MiB and of the
/// pattern's first 64 MiB).
const SCRATCH: u64 = 160 * MIB;
/// What GPU memory holds before a revocation and after the exporter reused it (the sentinel),
/// and what the held read carries.
const SEED_SENTINEL: u64 = 0x7666_696f_5345_4e54;
const SEED_READ: u64 = 0x7666_696f_5245_4144;
/// How long a case keeps a read held before it resumes it.
const HOLD: Duration = Duration::from_secs(2);
/// The blkdebug breakpoint tag.
const TAG: &str = "fgds_vfio";
/// The PCI command register's offset in config space, and its memory decode bit
/// (include/uapi/linux/pci_regs.h).
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 0x2;

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
            name: "one_range_pread_pwrite",
            run: one_range_pread_pwrite,
        },
        Case {
            name: "several_ranges_io_uring",
            run: several_ranges_io_uring,
        },
        Case {
            name: "readonly_export_gives_readonly_mapping",
            run: readonly_export_gives_readonly_mapping,
        },
        Case {
            name: "reset_revokes_a_mapped_registration",
            run: || revocation(How::Reset, false),
        },
        Case {
            name: "reset_waits_for_a_held_read",
            run: || revocation(How::Reset, true),
        },
        Case {
            name: "memory_off_revokes_a_mapped_registration",
            run: || revocation(How::MemoryOff, false),
        },
        Case {
            name: "memory_off_waits_for_a_held_read",
            run: || revocation(How::MemoryOff, true),
        },
        Case {
            name: "close_revokes_a_mapped_registration",
            run: || revocation(How::Close, false),
        },
        Case {
            name: "close_waits_for_a_held_read",
            run: || revocation(How::Close, true),
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
    pub const DEVICE_RESET: libc::c_ulong = io(11);
    pub const DEVICE_FEATURE: libc::c_ulong = io(17);

    pub const API_VERSION: i32 = 0;
    pub const TYPE1V2_IOMMU: libc::c_ulong = 3;
    pub const GROUP_FLAGS_VIABLE: u32 = 1;
    pub const DEVICE_FLAGS_RESET: u32 = 1;
    pub const DEVICE_FLAGS_PCI: u32 = 2;
    pub const REGION_INFO_FLAG_MMAP: u32 = 4;
    pub const PCI_BAR2_REGION_INDEX: u32 = 2;
    pub const PCI_CONFIG_REGION_INDEX: u32 = 7;
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

/// Waits (up to 20 s) until fgds counts no registration of the GPU: (buffers, bytes) zero.
fn wait_fgds_idle(bdf: &str, when: &str) -> anyhow::Result<()> {
    let start = Instant::now();
    loop {
        let counts = (fgds_sysfs(bdf, "buffers")?, fgds_sysfs(bdf, "bytes")?);
        if counts.0 == "0" && counts.1 == "0" {
            return Ok(());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(20),
            "{when}: fgds still counts {} buffers of {} bytes",
            counts.0,
            counts.1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
        let config = region_info(&file, uapi::PCI_CONFIG_REGION_INDEX)?;
        Ok(Device {
            file: Arc::new(file),
            flags: info.flags,
            bar2,
            config,
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
    config: uapi::RegionInfo,
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

    /// Writes `seed`'s pattern into BAR2 `[off, off + len)` through vfio's own mmap of the BAR,
    /// as the GPU's user does when the memory goes to its next use.
    fn fill(&self, off: u64, len: u64, seed: u64) -> anyhow::Result<()> {
        ensure!(
            self.bar2.flags & uapi::REGION_INFO_FLAG_MMAP != 0,
            "vfio does not offer an mmap of BAR2"
        );
        // SAFETY: a new shared mapping of the device's BAR2 window at an address the kernel
        // picks aliases no Rust object; it is unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                (self.bar2.offset + off) as libc::off_t,
            )
        };
        ensure!(
            p != libc::MAP_FAILED,
            "mmap of BAR2 through vfio: {}",
            std::io::Error::last_os_error()
        );
        let words = p.cast::<u64>();
        for i in 0..(len / 8) as usize {
            // SAFETY: inside the mapping just made; device memory, hence volatile.
            unsafe {
                words
                    .add(i)
                    .write_volatile(pattern::word(seed, 8 * i as u64))
            };
        }
        // SAFETY: exactly the mapping made above.
        unsafe { libc::munmap(p, len as usize) };
        Ok(())
    }

    /// The command register, as vfio shows it.
    fn command(&self) -> anyhow::Result<u16> {
        let mut b = [0u8; 2];
        self.file
            .read_exact_at(&mut b, self.config.offset + PCI_COMMAND)
            .context("read PCI_COMMAND through vfio's config region")?;
        Ok(u16::from_le_bytes(b))
    }

    fn set_command(&self, value: u16) -> anyhow::Result<()> {
        self.file
            .write_all_at(&value.to_le_bytes(), self.config.offset + PCI_COMMAND)
            .context("write PCI_COMMAND through vfio's config region")
    }
}

/// Where a pattern stream stands for BAR2 range checks: each (BAR offset, length) of a buffer
/// holds the pattern of `seed` from `stream + offset in the buffer`.
fn host_check(ranges: &[(u64, u64)], seed: u64, stream: u64) -> anyhow::Result<()> {
    let mut at = stream;
    for (off, len) in ranges {
        ctl::gpu_check_at(*off, *len, seed, at)
            .with_context(|| format!("the host's look at BAR2 {off:#x}+{len:#x}"))?;
        at += len;
    }
    Ok(())
}

/// Puts `seed`'s pattern on the drive at `off`.
fn write_drive(seed: u64, off: u64, len: usize) -> anyhow::Result<()> {
    let nvme = common::nvme(true)?;
    let mut ram = AlignedBuf::new(len)?;
    pattern::fill(seed, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), off)?;
    Ok(())
}

/// Fails unless the drive holds `seed`'s pattern from `stream` at `off`.
fn check_drive(off: u64, len: usize, seed: u64, stream: u64) -> anyhow::Result<()> {
    let nvme = common::nvme(false)?;
    let mut ram = AlignedBuf::new(len)?;
    nvme.read_exact_at(ram.as_mut_slice(), off)?;
    if let Some(at) = pattern::first_mismatch(seed, stream, ram.as_slice()) {
        bail!("the drive at {off:#x} differs from the GPU memory's data at byte {at:#x}");
    }
    Ok(())
}

/// Whether the page at `ptr` is mapped (present in this process's page tables): read from
/// /proc/self/pagemap, so that asking faults nothing in.
fn page_present(ptr: *const u8) -> anyhow::Result<bool> {
    let pagemap = File::open("/proc/self/pagemap").context("open /proc/self/pagemap")?;
    let mut entry = [0u8; 8];
    pagemap.read_exact_at(&mut entry, (ptr as u64 / PAGE) * 8)?;
    Ok(u64::from_le_bytes(entry) & (1 << 63) != 0)
}

/// The GPU is vfio-pci's, vgpu is absent, vfio offers reset and an mmap-able BAR2, its DMA is
/// translated, the dma-buf is vfio's (fdinfo `exp_name`), and a registration of one page of it
/// works (and reports fgds's mode).
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
    let node = open_node(bdf)?;
    let dmabuf = dev.export_rw(&[(0, PAGE)])?;
    // The dma-buf is vfio's own (its exporter's name in fdinfo), not one of vgpu's.
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
    let reg = common::reg(&node, dmabuf.as_fd(), 0, PAGE);
    let mode = fgds_sysfs(bdf, "mode")?;
    ktap::diag(format_args!("fgds-report: fgds mode={mode}"));
    let idx = reg.map_err(|e| anyhow::anyhow!("REG_BUFFER of a vfio-pci dma-buf: {e}"))?;
    let want = guest::expected_mode()?;
    ensure!(
        mode == want,
        "fgds set up {mode} pages, the configuration implies {want}"
    );
    common::unreg(&node, idx)?;
    ktap::pass()
}

/// One BAR2 range: pread from the drive into the whole registration and into a part of it
/// (dmabuf_offset), io_uring reads into the whole one, the host checks GPU memory each time,
/// then pwrite back to the drive.
fn one_range_pread_pwrite() -> CaseResult {
    const BAR: u64 = 16 * MIB;
    const LEN: u64 = 8 * MIB;
    let group = Group::open()?;
    let dev = group.device()?;
    let node = open_node(&group.bdf)?;
    dev.fill(BAR, LEN, SEED_SENTINEL)?;
    let dmabuf = dev.export_rw(&[(BAR, LEN)])?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = Map::shared(&node, idx, LEN as usize)?;
    let nvme = common::nvme(true)?;
    let n = common::pread_raw(&nvme, map.ptr, LEN as usize, 0).context("pread NVMe -> GPU")?;
    ensure!(n == LEN as usize, "short pread {n}");
    host_check(&[(BAR, LEN)], pattern::NVME_SEED, 0).context("after pread")?;

    // A part of the dma-buf, from 2 MiB in: lands 2 MiB into the range.
    let part = common::reg(&node, dmabuf.as_fd(), 2 * MIB, 2 * MIB)?;
    let part_map = Map::shared(&node, part, 2 * MIB as usize)?;
    let n = common::pread_raw(&nvme, part_map.ptr, 2 * MIB as usize, 32 * MIB)
        .context("pread into a registration at dmabuf_offset 2 MiB")?;
    ensure!(n == 2 * MIB as usize, "short pread {n}");
    host_check(&[(BAR + 2 * MIB, 2 * MIB)], pattern::NVME_SEED, 32 * MIB)
        .context("after pread into the part")?;
    host_check(&[(BAR, 2 * MIB)], pattern::NVME_SEED, 0).context("the range before the part")?;

    // io_uring, into the whole registration's last 4 MiB.
    let mut ring = io_uring::IoUring::new(4)?;
    for i in 0..4u64 {
        let sqe = io_uring::opcode::Read::new(
            io_uring::types::Fd(nvme.as_raw_fd()),
            map.at((4 * MIB + i * MIB) as usize),
            MIB as u32,
        )
        .offset(36 * MIB + i * MIB)
        .build()
        .user_data(i);
        // SAFETY: the mapping outlives the requests: every completion is waited for below.
        unsafe { ring.submission().push(&sqe) }.context("submission queue full")?;
    }
    ring.submit_and_wait(4).context("io_uring_enter")?;
    let results = ring
        .completion()
        .map(|cqe| (cqe.user_data(), cqe.result()))
        .collect::<Vec<_>>();
    ensure!(
        results.len() == 4,
        "{} of 4 io_uring completions",
        results.len()
    );
    for (i, res) in results {
        ensure!(res == MIB as i32, "io_uring read {i} gave {res}");
    }
    host_check(&[(BAR + 4 * MIB, 4 * MIB)], pattern::NVME_SEED, 36 * MIB)
        .context("after the io_uring reads")?;

    let n =
        common::pwrite_raw(&nvme, map.ptr, LEN as usize, SCRATCH).context("pwrite GPU -> NVMe")?;
    ensure!(n == LEN as usize, "short pwrite {n}");
    let mut want = vec![0u8; LEN as usize];
    pattern::fill(pattern::NVME_SEED, 0, &mut want);
    pattern::fill(
        pattern::NVME_SEED,
        32 * MIB,
        &mut want[2 * MIB as usize..4 * MIB as usize],
    );
    pattern::fill(pattern::NVME_SEED, 36 * MIB, &mut want[4 * MIB as usize..]);
    check_drive_holds(SCRATCH, &want)?;
    drop((map, part_map));
    common::unreg(&node, idx)?;
    common::unreg(&node, part)?;
    wait_fgds_idle(&group.bdf, "after the case")?;
    ktap::pass()
}

/// Fails unless the drive holds `want` at `off`.
fn check_drive_holds(off: u64, want: &[u8]) -> anyhow::Result<()> {
    let nvme = common::nvme(false)?;
    let mut back = AlignedBuf::new(want.len())?;
    nvme.read_exact_at(back.as_mut_slice(), off)?;
    if let Some(at) = back.as_slice().iter().zip(want).position(|(a, b)| a != b) {
        bail!("the drive did not get the GPU memory's data: byte {at:#x} differs");
    }
    Ok(())
}

/// Three BAR2 ranges out of BAR order in one dma-buf: io_uring reads into the whole
/// registration (the host checks each range where it lies in the BAR) and into a registration
/// across all three, pread and pwrite through the whole one, then io_uring writes back to the
/// drive.
fn several_ranges_io_uring() -> CaseResult {
    let ranges = [(40 * MIB, 2 * MIB), (24 * MIB, MIB), (33 * MIB, 3 * MIB)];
    let len: u64 = ranges.iter().map(|r| r.1).sum();
    let group = Group::open()?;
    let dev = group.device()?;
    for (off, l) in ranges {
        dev.fill(off, l, SEED_SENTINEL)?;
    }
    let dmabuf = dev.export_rw(&ranges)?;
    let gpu = fgds::Gpu::open(&group.bdf)?;
    let buffer = gpu.register(dmabuf.as_fd(), 0, len)?;
    let nvme = common::nvme(true)?;
    let mut transfer = fgds::Transfer::new(fgds::TransferConfig::DEFAULT)?;
    let mut read = |buffer: &fgds::Buffer, from: u64| -> anyhow::Result<()> {
        let n = transfer
            .run(fgds::Direction::Read, buffer, 0..buffer.len(), &nvme, from)
            .context("io_uring NVMe -> GPU")?;
        ensure!(
            n == buffer.len(),
            "io_uring read {n} of {} bytes",
            buffer.len()
        );
        Ok(())
    };
    const FROM: u64 = 8 * MIB;
    read(&buffer, FROM)?;
    host_check(&ranges, pattern::NVME_SEED, FROM).context("after the io_uring read")?;

    // 1 MiB before the end of the first range to 1 MiB into the third: across all three.
    let straddle = gpu.register(dmabuf.as_fd(), MIB, 3 * MIB)?;
    const FROM2: u64 = 48 * MIB;
    read(&straddle, FROM2).context("into a registration across the ranges")?;
    host_check(
        &[(41 * MIB, MIB), (24 * MIB, MIB), (33 * MIB, MIB)],
        pattern::NVME_SEED,
        FROM2,
    )
    .context("after the read across the ranges")?;
    host_check(&[(34 * MIB, 2 * MIB)], pattern::NVME_SEED, FROM + 4 * MIB)
        .context("the rest of the third range")?;

    // pread and pwrite through the whole registration, from another place of the drive.
    const FROM3: u64 = 52 * MIB;
    let n = buffer
        .read_at(&nvme, FROM3, 0..len as usize)
        .context("pread NVMe -> GPU across the ranges")?;
    ensure!(n == len as usize, "pread {n} of {len} bytes");
    host_check(&ranges, pattern::NVME_SEED, FROM3).context("after the pread")?;
    let n = buffer
        .write_at(&nvme, SCRATCH + 8 * MIB, 0..len as usize)
        .context("pwrite GPU -> NVMe across the ranges")?;
    ensure!(n == len as usize, "pwrite {n}");
    check_drive(SCRATCH + 8 * MIB, len as usize, pattern::NVME_SEED, FROM3)?;

    // io_uring both ways: the whole, then the straddling part over it, back to the drive.
    read(&buffer, FROM)?;
    read(&straddle, FROM2)?;
    drop(straddle);
    let n = transfer
        .run(
            fgds::Direction::Write,
            &buffer,
            0..len as usize,
            &nvme,
            SCRATCH,
        )
        .context("io_uring GPU -> NVMe")?;
    ensure!(n == len as usize, "io_uring write {n}");
    let mut want = vec![0u8; len as usize];
    pattern::fill(pattern::NVME_SEED, FROM, &mut want);
    pattern::fill(
        pattern::NVME_SEED,
        FROM2,
        &mut want[MIB as usize..4 * MIB as usize],
    );
    check_drive_holds(SCRATCH, &want)?;
    drop(buffer);
    wait_fgds_idle(&group.bdf, "after the case")?;
    ktap::pass()
}

/// vfio hands the dma-buf out read-only (`open_flags` O_RDONLY): fgds registers it, refuses a
/// writable mapping (EACCES) and mprotect to writable, NVMe reads into it fail (EFAULT), and
/// writes from it to the drive carry the GPU memory's data.
fn readonly_export_gives_readonly_mapping() -> CaseResult {
    const BAR: u64 = 48 * MIB;
    const LEN: u64 = 2 * MIB;
    let group = Group::open()?;
    let dev = group.device()?;
    let node = open_node(&group.bdf)?;
    dev.fill(BAR, LEN, SEED_SENTINEL)?;
    let dmabuf = dev
        .export(&[(BAR, LEN)], true)
        .map_err(|e| anyhow::anyhow!("read-only VFIO_DEVICE_FEATURE_DMA_BUF: {e}"))?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = common::map_readonly_checked(&node, idx, LEN as usize)?;
    let nvme = common::nvme(true)?;
    let into = common::pread_raw(&nvme, map.ptr, LEN as usize, 0);
    ensure!(
        into == Err(Errno::FAULT),
        "an NVMe read into the read-only mapping gave {into:?}, want EFAULT"
    );
    ctl::gpu_check(BAR, LEN, SEED_SENTINEL).context("GPU memory after the refused read")?;
    let n = common::pwrite_raw(&nvme, map.ptr, LEN as usize, SCRATCH)
        .context("an NVMe write from the read-only mapping")?;
    ensure!(n == LEN as usize, "short write {n}");
    check_drive(SCRATCH, LEN as usize, SEED_SENTINEL, 0)?;
    drop(map);
    common::unreg(&node, idx)?;
    wait_fgds_idle(&group.bdf, "after the case")?;
    ktap::pass()
}

/// How vfio revokes its dma-bufs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum How {
    /// `VFIO_DEVICE_RESET`.
    Reset,
    /// Clearing `PCI_COMMAND_MEMORY` through vfio's config region.
    MemoryOff,
    /// Closing the device's file descriptor (its last reference).
    Close,
}

impl How {
    fn what(self) -> &'static str {
        match self {
            How::Reset => "VFIO_DEVICE_RESET",
            How::MemoryOff => "clearing PCI_COMMAND_MEMORY",
            How::Close => "closing the device fd",
        }
    }
}

/// What a thread's read gave, and when it ended.
type Ended<T> = (T, Instant);

/// A pread(2) from the drive into `map`, in a thread.
fn read_in_thread(map: &Map, len: usize, nvme_off: u64) -> JoinHandle<Ended<Result<usize, Errno>>> {
    let ptr = map.ptr as usize;
    std::thread::spawn(move || {
        let res = common::nvme(false)
            .map_err(|_| Errno::IO)
            .and_then(|nvme| common::pread_raw(&nvme, ptr as *mut u8, len, nvme_off));
        (res, Instant::now())
    })
}

fn join<T>(handle: JoinHandle<T>, what: &str) -> anyhow::Result<T> {
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("the thread that {what} panicked"))
}

/// Starts the revocation in a thread; the thread returns when the ioctl, write or close did.
fn revoke_in_thread(how: How, dev: Device) -> JoinHandle<Ended<anyhow::Result<Option<Device>>>> {
    std::thread::spawn(move || {
        let res = (|| -> anyhow::Result<Option<Device>> {
            match how {
                How::Reset => {
                    ioctl(dev.file.as_raw_fd(), uapi::DEVICE_RESET, 0)
                        .map_err(|e| anyhow::anyhow!("VFIO_DEVICE_RESET: {e}"))?;
                    Ok(Some(dev))
                }
                How::MemoryOff => {
                    let cmd = dev.command()?;
                    ensure!(
                        cmd & PCI_COMMAND_MEMORY != 0,
                        "memory decode is already off ({cmd:#x})"
                    );
                    dev.set_command(cmd & !(PCI_COMMAND_MEMORY))?;
                    Ok(Some(dev))
                }
                How::Close => {
                    let file = Arc::into_inner(dev.file)
                        .context("another reference to the device fd is alive")?;
                    // close(2) runs vfio's release before it returns (task work), and only
                    // the last reference releases: this is it.
                    drop(file);
                    Ok(None)
                }
            }
        })();
        (res, Instant::now())
    })
}

/// Waits until the page at `ptr` is no longer mapped: fgds zapped the mapping.
fn wait_zapped(ptr: *const u8) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while page_present(ptr)? {
        ensure!(
            start.elapsed() < Duration::from_secs(10),
            "the mapping was not zapped within 10 s of the revocation"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(start.elapsed())
}

/// vfio revokes its dma-buf of BAR2 `[BAR, BAR + LEN)` while fgds has it registered and
/// mapped, and (`held`) while a read into it is held in flight: see the program's
/// documentation for what must hold.
fn revocation(how: How, held: bool) -> CaseResult {
    const LEN: u64 = 4 * MIB;
    let bar: u64 = 64 * MIB
        + LEN
            * match how {
                How::Reset => 0,
                How::MemoryOff => 2,
                How::Close => 4,
            }
        + if held { LEN } else { 0 };
    let group = Group::open()?;
    let bdf = group.bdf.clone();
    wait_fgds_idle(&bdf, "before the case (another case left registrations?)")?;
    let dev = group.device()?;
    if how == How::Reset {
        ensure!(
            dev.flags & uapi::DEVICE_FLAGS_RESET != 0,
            "vfio-pci cannot reset the GPU"
        );
    }
    write_drive(SEED_READ, SCRATCH, LEN as usize)?;
    dev.fill(bar, LEN, SEED_SENTINEL)?;
    ctl::gpu_check(bar, LEN, SEED_SENTINEL).context("the sentinel before the case")?;
    let node = open_node(&bdf)?;
    let dmabuf = dev.export_rw(&[(bar, LEN)])?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    // Without a read held, the program lets go of the dma-buf, as users do once registered:
    // vfio reaches it through fgds's own reference alone.
    let dmabuf = held.then_some(dmabuf);
    let map = Map::shared(&node, idx, LEN as usize)?;
    // Fault the mapping in, without changing the memory.
    // SAFETY: a byte of our live mapping.
    let _ = unsafe { map.ptr.read_volatile() };
    ensure!(page_present(map.ptr)?, "the mapping is not faulted in");

    let held_read = if held {
        let bp = common::Breakpoint::arm(TAG)?;
        let reader = read_in_thread(&map, LEN as usize, SCRATCH);
        std::thread::sleep(Duration::from_millis(500));
        ensure!(
            !reader.is_finished(),
            "the read was not held by the breakpoint: {:?}",
            join(reader, "read")?.0
        );
        Some((bp, reader))
    } else {
        None
    };
    ctl::request(&format!(
        "log fgds_vfio: {} with {}",
        how.what(),
        if held {
            "a read held in flight"
        } else {
            "a mapped registration"
        }
    ))?;
    let started = Instant::now();
    let revoker = revoke_in_thread(how, dev);
    let zapped = wait_zapped(map.ptr)?;
    let late = common::pread_raw(&common::nvme(false)?, map.ptr, PAGE as usize, SCRATCH);
    ensure!(
        late == Err(Errno::FAULT),
        "a read into the revoked mapping gave {late:?}, want EFAULT"
    );

    let (dev, summary) = match held_read {
        Some((bp, reader)) => {
            std::thread::sleep(HOLD.saturating_sub(started.elapsed()));
            if revoker.is_finished() {
                let (res, _) = join(revoker, "revoked")?;
                bail!(
                    "{} returned while a read into the dma-buf was in flight: vfio got the \
                     memory back early ({:?})",
                    how.what(),
                    res.map(drop)
                );
            }
            let resumed = started.elapsed();
            bp.resume()?;
            let (read, read_end) = join(reader, "read")?;
            let (res, returned) = join(revoker, "revoked")?;
            let dev = res.with_context(|| how.what())?;
            let read_end = read_end.duration_since(started);
            let returned = returned.duration_since(started);
            ensure!(
                read == Ok(LEN as usize),
                "the held read ended with {read:?}, want {LEN} bytes (it pinned its pages \
                 before the revocation)"
            );
            ensure!(
                returned >= resumed,
                "{} returned {returned:?} into the revocation, before the read was resumed at \
                 {resumed:?}",
                how.what()
            );
            ensure!(
                returned + Duration::from_millis(50) >= read_end,
                "{} returned {returned:?} into the revocation, before the held read ended at \
                 {read_end:?}",
                how.what()
            );
            // Everything the read carried landed before the revocation returned.
            ctl::gpu_check(bar, LEN, SEED_READ)
                .context("the held read's data, once the revocation returned")?;
            (
                dev,
                format!(
                    "{} with a read held: mapping zapped after {zapped:?}; read resumed at \
                     {resumed:?}, ended at {read_end:?}; vfio's wait for fences returned at \
                     {returned:?}",
                    how.what()
                ),
            )
        }
        None => {
            let (res, returned) = join(revoker, "revoked")?;
            let dev = res.with_context(|| how.what())?;
            let took = returned.duration_since(started);
            ensure!(
                took < Duration::from_secs(5),
                "{} of a mapped registration without I/O took {took:?}",
                how.what()
            );
            (
                dev,
                format!(
                    "{} of a mapped registration: mapping zapped after {zapped:?}, returned \
                     after {took:?}",
                    how.what()
                ),
            )
        }
    };
    ktap::diag(&summary);

    // The revoked mapping: SIGBUS on access, EFAULT for I/O, and no new mapping of the token.
    let status = common::load_in_child(map.ptr)?;
    ensure!(
        status == 128 + libc::SIGBUS,
        "a load from the revoked mapping ended with status {status}, want SIGBUS"
    );
    let late = common::pread_raw(&common::nvme(false)?, map.ptr, LEN as usize, SCRATCH);
    ensure!(
        late == Err(Errno::FAULT),
        "a read into the revoked mapping after the revocation gave {late:?}, want EFAULT"
    );
    match Map::new(&node, idx, LEN as usize, libc::MAP_SHARED) {
        Err(Errno::NODEV) => {}
        other => bail!(
            "mmap of the revoked token gave {:?}, want ENODEV",
            other.map(drop)
        ),
    }

    // vfio takes the memory back in use.
    let dev = match (how, dev) {
        (How::Reset, Some(dev)) => dev,
        (How::MemoryOff, Some(dev)) => {
            // A dma-buf exported while memory decode is off is revoked from the start.
            let off = dev.export_rw(&[(bar, LEN)])?;
            match common::reg(&node, off.as_fd(), 0, LEN) {
                Err(Errno::NODEV) => {}
                other => bail!(
                    "registering a dma-buf exported while memory decode was off gave {other:?}, \
                     want ENODEV"
                ),
            }
            let cmd = dev.command()?;
            dev.set_command(cmd | PCI_COMMAND_MEMORY)?;
            dev
        }
        (How::Close, None) => {
            // The old dma-buf stays revoked for good: vfio refuses new attachments.
            if let Some(old) = &dmabuf {
                match common::reg(&node, old.as_fd(), 0, LEN) {
                    Err(Errno::NODEV) => {}
                    other => bail!(
                        "registering the dma-buf of a closed device gave {other:?}, want ENODEV"
                    ),
                }
            }
            group.device().context("open the device again")?
        }
        (how, dev) => bail!(
            "{how:?} left the device {}",
            if dev.is_some() { "open" } else { "closed" }
        ),
    };
    dev.fill(bar, LEN, SEED_SENTINEL)?;
    std::thread::sleep(Duration::from_millis(500));
    ctl::gpu_check(bar, LEN, SEED_SENTINEL)
        .context("GPU memory after vfio's user reused it: a byte of the read landed late")?;

    // The system stays usable: a new export, registration and read work.
    let fresh = dev.export_rw(&[(bar, LEN)])?;
    let idx2 = common::reg(&node, fresh.as_fd(), 0, LEN)
        .map_err(|e| anyhow::anyhow!("REG_BUFFER of a new export after the revocation: {e}"))?;
    let map2 = Map::shared(&node, idx2, LEN as usize)?;
    let n = common::pread_raw(&common::nvme(false)?, map2.ptr, LEN as usize, 0)
        .context("pread into the new registration")?;
    ensure!(n == LEN as usize, "short pread {n}");
    ctl::gpu_check_at(bar, LEN, pattern::NVME_SEED, 0)
        .context("after the new registration's read")?;
    drop(map2);
    common::unreg(&node, idx2)?;
    drop(map);
    common::unreg(&node, idx)?;
    drop((node, dmabuf, fresh, dev));
    wait_fgds_idle(&bdf, "after the case")?;
    ktap::pass()
}
