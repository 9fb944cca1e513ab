//! GPUs that fgds serves, as its sysfs class shows them, and registration of their memory.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::uapi;

/// Where the driver's class lives in sysfs.
pub const SYSFS_CLASS: &str = "/sys/class/fgds";

/// A GPU fgds serves, as sysfs shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// PCI address, `DDDD:BB:DD.F`.
    pub bdf: String,
    /// The character device, `/dev/fgds_DDDD_BB_DD_F`.
    pub node: PathBuf,
    /// Size of the GPU memory BAR fgds uses, in bytes.
    pub bar_size: u64,
    /// How fgds provides pages for this GPU's memory (`exporter-p2pdma`, `p2pdma`, `generic`).
    pub mode: String,
    /// The IOMMU domain of the GPU's group (`identity`, `DMA`, `DMA-FQ`, ...), or `none`.
    pub iommu: String,
    /// Buffers registered now, over all open files.
    pub buffers: u64,
    /// Bytes registered now.
    pub bytes: u64,
}

/// An open fgds node: the handle to register a GPU's dma-bufs.
pub struct Gpu {
    node: Arc<File>,
    info: GpuInfo,
}

impl Gpu {
    /// Every GPU fgds serves, sorted by PCI address. An empty list if fgds is not loaded.
    ///
    /// ```no_run
    /// for gpu in fgds::Gpu::list()? {
    ///     println!("{} {} {} MiB, mode {}", gpu.bdf, gpu.node.display(), gpu.bar_size >> 20, gpu.mode);
    /// }
    /// # Ok::<(), fgds::Error>(())
    /// ```
    pub fn list() -> Result<Vec<GpuInfo>> {
        list_in(Path::new(SYSFS_CLASS), Path::new("/dev"))
    }

    /// Opens the node of the GPU at PCI address `bdf` (`0000:03:00.0`).
    ///
    /// The first open since the GPU's driver bound also sets fgds's page provider up for the
    /// GPU (struct pages over its whole BAR: the kernel's memory hotplug, tens of ms for 1 GiB
    /// under emulation), so that [`Gpu::register`] never pays for it; keep the `Gpu` open rather
    /// than opening it per transfer. If that setup is refused, `register` returns the reason.
    ///
    /// ```no_run
    /// let gpu = fgds::Gpu::open("0000:03:00.0")?;
    /// println!("BAR of {} MiB", gpu.info().bar_size >> 20);
    /// # Ok::<(), fgds::Error>(())
    /// ```
    pub fn open(bdf: &str) -> Result<Gpu> {
        let info = Gpu::list()?
            .into_iter()
            .find(|g| g.bdf == bdf)
            .ok_or_else(|| Error::NoSuchGpu {
                bdf: bdf.to_owned(),
            })?;
        let node = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&info.node)
            .map_err(|source| Error::Open {
                path: info.node.clone(),
                source,
            })?;
        Ok(Gpu {
            node: Arc::new(node),
            info,
        })
    }

    /// What sysfs said of this GPU when it was opened.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Registers `len` bytes at `offset` of the dma-buf `dmabuf` and maps them; the returned
    /// [`Buffer`] is the DMA target or source for direct I/O. The dma-buf fd may be closed
    /// afterwards. `offset` and `len` must be page aligned.
    ///
    /// ```no_run
    /// # fn dmabuf_from_gpu_runtime() -> std::os::fd::OwnedFd { unimplemented!() }
    /// use std::os::fd::AsFd;
    /// let gpu = fgds::Gpu::open("0000:03:00.0")?;
    /// let dmabuf = dmabuf_from_gpu_runtime();
    /// let buffer = gpu.register(dmabuf.as_fd(), 0, 64 << 20)?;
    /// let file = fgds::open_direct("/data/weights.bin".as_ref(), false)?;
    /// buffer.read_at(&file, 0, 0..64 << 20)?;
    /// # Ok::<(), fgds::Error>(())
    /// ```
    pub fn register(&self, dmabuf: BorrowedFd<'_>, offset: u64, len: u64) -> Result<Buffer> {
        let page = rustix::param::page_size() as u64;
        if len == 0 || !len.is_multiple_of(page) || !offset.is_multiple_of(page) {
            return Err(Error::Invalid(format!(
                "dma-buf offset {offset:#x} and length {len:#x} must be non-zero multiples of the page size ({page:#x})"
            )));
        }
        let mut arg = uapi::RegBuffer {
            dmabuf_fd: dmabuf.as_raw_fd(),
            flags: 0,
            dmabuf_offset: offset,
            size: len,
            idx: 0,
        };
        // SAFETY: `RegBuffer` is `struct fgds_ioctl_reg_buffer` (checked by tests/uapi_layout.rs)
        // and the opcode encodes its size; the kernel writes only within it.
        unsafe {
            rustix::ioctl::ioctl(
                self.node.as_fd(),
                rustix::ioctl::Updater::<{ uapi::REG_BUFFER }, uapi::RegBuffer>::new(&mut arg),
            )
        }
        .map_err(|errno| Error::Register { errno })?;
        Buffer::map(Arc::clone(&self.node), arg.idx, len)
    }
}

fn list_in(class: &Path, dev: &Path) -> Result<Vec<GpuInfo>> {
    let entries = match std::fs::read_dir(class) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(Error::Sysfs {
                path: class.to_path_buf(),
                source,
            });
        }
    };
    let mut gpus = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| Error::Sysfs {
            path: class.to_path_buf(),
            source,
        })?;
        let dir = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let device = std::fs::canonicalize(dir.join("device")).map_err(|source| Error::Sysfs {
            path: dir.join("device"),
            source,
        })?;
        let bdf = device
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let iommu = std::fs::read_to_string(device.join("iommu_group/type"))
            .map_or_else(|_| "none".to_owned(), |s| s.trim().to_owned());
        gpus.push(GpuInfo {
            node: dev.join(&name),
            bar_size: read_u64(&dir.join("bar_size"))?,
            mode: read_string(&dir.join("mode"))?,
            buffers: read_u64(&dir.join("buffers"))?,
            bytes: read_u64(&dir.join("bytes"))?,
            iommu,
            bdf,
        });
    }
    gpus.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    Ok(gpus)
}

fn read_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| Error::Sysfs {
            path: path.to_path_buf(),
            source,
        })
}

fn read_u64(path: &Path) -> Result<u64> {
    let text = read_string(path)?;
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|_| Error::Sysfs {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not a number: {text:?}"),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_gpus_from_a_sysfs_tree() {
        let root = std::env::temp_dir().join(format!("fgds-sysfs-test-{}", std::process::id()));
        let pci = root.join("devices/pci0000:00/0000:03:00.0");
        let class = root.join("class/fgds");
        let node = class.join("fgds_0000_03_00_0");
        std::fs::create_dir_all(&pci).unwrap();
        std::fs::create_dir_all(&node).unwrap();
        std::os::unix::fs::symlink(&pci, node.join("device")).unwrap();
        for (attr, value) in [
            ("bar_size", "268435456\n"),
            ("mode", "generic\n"),
            ("buffers", "2\n"),
            ("bytes", "0x200000\n"),
        ] {
            std::fs::write(node.join(attr), value).unwrap();
        }
        let gpus = list_in(&class, Path::new("/dev")).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(
            gpus,
            vec![GpuInfo {
                bdf: "0000:03:00.0".to_owned(),
                node: PathBuf::from("/dev/fgds_0000_03_00_0"),
                bar_size: 256 << 20,
                mode: "generic".to_owned(),
                iommu: "none".to_owned(),
                buffers: 2,
                bytes: 2 << 20,
            }]
        );
    }

    #[test]
    fn no_class_directory_means_no_gpus() {
        assert_eq!(
            list_in(Path::new("/nonexistent/fgds"), Path::new("/dev")).unwrap(),
            Vec::new()
        );
    }
}
