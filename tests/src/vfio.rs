//! vfio-pci from a test: the GPU's IOMMU group in a type1 container, its device, and BAR2
//! ranges exported as dma-bufs (`VFIO_DEVICE_FEATURE_DMA_BUF`), for the programs that run with
//! `--iommu --exporter vfio` (`fgds_vfio`, `uring_dmabuf`).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use anyhow::{Context, bail, ensure};
use rustix::io::Errno;

/// vfio's UAPI (include/uapi/linux/vfio.h): `_IO(';', 100 + n)`.
pub mod uapi {
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
    pub const DEVICE_RESET: libc::c_ulong = io(11);

    pub const API_VERSION: i32 = 0;
    pub const TYPE1V2_IOMMU: libc::c_ulong = 3;
    pub const GROUP_FLAGS_VIABLE: u32 = 1;
    pub const DEVICE_FLAGS_RESET: u32 = 1;
    pub const DEVICE_FLAGS_PCI: u32 = 2;
    pub const PCI_BAR2_REGION_INDEX: u32 = 2;
    pub const REGION_INFO_FLAG_MMAP: u32 = 4;
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
pub fn ioctl(fd: RawFd, req: libc::c_ulong, arg: usize) -> Result<i32, Errno> {
    // SAFETY: every caller passes a request of vfio's UAPI with the argument it documents (an
    // integer, or a pointer to a live struct of the size the kernel reads from argsz).
    let r = unsafe { libc::ioctl(fd, req as _, arg) };
    if r < 0 { Err(last_errno()) } else { Ok(r) }
}

fn last_errno() -> Errno {
    Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// The GPU: the ivshmem device's PCI address.
pub fn gpu_bdf() -> anyhow::Result<String> {
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
pub fn driver_of(bdf: &str) -> Option<String> {
    std::fs::read_link(format!("/sys/bus/pci/devices/{bdf}/driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
}

/// The GPU's IOMMU group, opened into a type1 container (both stay open while this lives).
pub struct Group {
    pub bdf: String,
    _container: File,
    group: File,
}

impl Group {
    pub fn open() -> anyhow::Result<Group> {
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
    pub fn device(&self) -> anyhow::Result<Device> {
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
pub struct Device {
    pub file: Arc<File>,
    pub flags: u32,
    pub bar2: uapi::RegionInfo,
}

impl Device {
    /// `VFIO_DEVICE_FEATURE_DMA_BUF` of BAR2 `ranges` (offset, length), read-write or
    /// read-only: the dma-buf, or the errno.
    pub fn export(&self, ranges: &[(u64, u64)], rdonly: bool) -> Result<OwnedFd, Errno> {
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

    pub fn export_rw(&self, ranges: &[(u64, u64)]) -> anyhow::Result<OwnedFd> {
        self.export(ranges, false)
            .map_err(|e| anyhow::anyhow!("VFIO_DEVICE_FEATURE_DMA_BUF of BAR2 {ranges:#x?}: {e}"))
    }

    /// Writes `seed`'s pattern into BAR2 `[off, off + len)` through vfio's own mmap of the BAR,
    /// as the GPU's user does when the memory goes to its next use.
    pub fn fill(&self, off: u64, len: u64, seed: u64) -> anyhow::Result<()> {
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
                    .write_volatile(crate::pattern::word(seed, 8 * i as u64))
            };
        }
        // SAFETY: exactly the mapping made above.
        unsafe { libc::munmap(p, len as usize) };
        Ok(())
    }

    /// `VFIO_DEVICE_RESET`: vfio revokes every dma-buf of the device first, and waits for
    /// their importers' fences.
    pub fn reset(&self) -> anyhow::Result<()> {
        ioctl(self.file.as_raw_fd(), uapi::DEVICE_RESET, 0).context("VFIO_DEVICE_RESET")?;
        Ok(())
    }
}
