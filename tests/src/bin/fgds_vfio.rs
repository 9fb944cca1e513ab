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

use fgds_tests::common;
use fgds_tests::vfio;

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
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

/// The GPU is vfio-pci's, vgpu is absent, vfio offers reset and an mmap-able BAR2, its DMA is
/// translated, and the dma-buf is vfio's (fdinfo `exp_name`).
fn gpu_is_bound_to_vfio_pci() -> CaseResult {
    let group = vfio::Group::open()?;
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
        dev.flags & vfio::uapi::DEVICE_FLAGS_RESET != 0,
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
    let group = vfio::Group::open()?;
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
    let reg = common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB);
    let mode = fgds_sysfs(bdf, "mode")?;
    ktap::diag(format_args!("fgds-report: fgds mode={mode}"));
    ensure!(
        reg == Err(Errno::OPNOTSUPP),
        "REG_BUFFER of a vfio-pci dma-buf: {reg:?}, want EOPNOTSUPP"
    );
    // Logged once, when fgds first set up (and refused) the GPU's pages: at the node's first
    // open, maybe by an earlier program.
    let log = guest::kernel_log_since(0)?;
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
