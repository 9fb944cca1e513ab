//! fgds as a guest on devices it does not own (issue 36): the device that does the DMA of
//! fgds's own reads and writes is the dma-buf's importer, so the exporter judges its path (and
//! may refuse it); fgds adds nothing to P2PDMA state another driver set up, and an exporter that
//! keeps P2PDMA state or pages of its own goes on allocating and exporting while fgds is loaded,
//! serves registrations, is unloaded and loaded again, and while the GPU is unbound and bound
//! again. The host fails the run on any splat (KASAN and kmemleak on the debug kernels).

use fgds_tests::common;
use fgds_tests::fault;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, ensure};
use common::MIB;
use fgds::uapi;
use fgds_tests::guest;
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

const WAIT: Duration = Duration::from_secs(10);

fn main() {
    common::run_refusing(
        &[
            Case {
                name: "dma_device_is_the_importer",
                run: dma_device_is_the_importer,
            },
            Case {
                name: "exporter_refusing_the_dma_device_is_eremoteio",
                run: exporter_refusing_the_dma_device_is_eremoteio,
            },
            Case {
                name: "foreign_p2pdma_state_gets_no_pages",
                run: foreign_p2pdma_state_gets_no_pages,
            },
            Case {
                name: "exporter_p2pdma_pages_unchanged",
                run: exporter_p2pdma_pages_unchanged,
            },
        ],
        &[
            "foreign_p2pdma_state_gets_no_pages",
            "exporter_p2pdma_pages_unchanged",
        ],
    )
}

/// The PCI device under a block device: the one that does its DMA.
fn nvme_bdf() -> anyhow::Result<String> {
    let path = guest::nvme_path()?;
    let name = path.file_name().context("FGDS_NVME has no file name")?;
    let sys = std::fs::canonicalize(Path::new("/sys/class/block").join(name))?;
    sys.ancestors()
        .filter_map(|p| p.file_name()?.to_str())
        .find(|n| is_bdf(n))
        .map(str::to_owned)
        .with_context(|| format!("no PCI device above {}", sys.display()))
}

/// `0000:01:00.0`.
fn is_bdf(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && name
            .chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// vgpu's `importers`: (device, mappings it holds now).
fn importers() -> anyhow::Result<Vec<(String, u32)>> {
    let path = format!("/sys/class/vgpu/{}/importers", common::vgpu_name()?);
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    text.lines()
        .map(|l| {
            let (dev, n) = l
                .split_once(' ')
                .with_context(|| format!("{path}: bad line {l:?}"))?;
            Ok((dev.to_owned(), n.parse()?))
        })
        .collect()
}

fn maps_of(dev: &str) -> anyhow::Result<u32> {
    Ok(importers()?
        .into_iter()
        .find(|(d, _)| d == dev)
        .map_or(0, |(_, n)| n))
}

fn read_arg(idx: u64, len: u64, nvme: &File, file_offset: u64) -> uapi::Io {
    uapi::Io {
        idx,
        offset: 0,
        len,
        file_offset,
        fd: nvme.as_raw_fd(),
        flags: 0,
    }
}

/// Reads `len` bytes of the drive at `nvme_off` into a new registration of a new buffer with
/// fgds's own read and checks them through vgpu's CPU mapping.
fn read_through_fgds(node: &File, len: u64, nvme_off: u64) -> anyhow::Result<()> {
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(node, dmabuf.as_fd(), 0, len).context("REG_BUFFER")?;
    let nvme = common::nvme(false)?;
    let got = common::ioctl_io(node, false, &read_arg(idx, len, &nvme, nvme_off));
    ensure!(
        got == Ok(len as usize),
        "FGDS_IOCTL_READ of {len} bytes: {got:?}"
    );
    let data = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    common::check_nvme_pattern(nvme_off, &data)?;
    common::unreg(node, idx).context("UNREG_BUFFER")?;
    Ok(())
}

fn dma_device_is_the_importer() -> CaseResult {
    let bdf = nvme_bdf()?;
    let before = maps_of(&bdf)?;
    ensure!(
        before == 0,
        "{bdf} holds {before} mappings of vgpu buffers before this case"
    );
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len).context("REG_BUFFER")?;
    ensure!(
        maps_of(&bdf)? == 0,
        "a registration alone mapped the buffer for {bdf}, which did no I/O yet"
    );
    let nvme = common::nvme(false)?;
    let got = common::ioctl_io(&node, false, &read_arg(idx, len, &nvme, 3 * MIB));
    ensure!(got == Ok(len as usize), "FGDS_IOCTL_READ: {got:?}");
    let data = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    common::check_nvme_pattern(3 * MIB, &data)?;
    let during = importers()?;
    ensure!(
        maps_of(&bdf)? == 1,
        "after fgds read from the drive into the buffer, vgpu's importers are {during:?}: \
         the drive's controller {bdf} should hold one mapping (the DMA device is the importer)"
    );
    let again = common::ioctl_io(&node, false, &read_arg(idx, len, &nvme, 0));
    ensure!(
        again == Ok(len as usize),
        "second FGDS_IOCTL_READ: {again:?}"
    );
    ensure!(
        maps_of(&bdf)? == 1,
        "a second read mapped the buffer for {bdf} again: {:?}",
        importers()?
    );
    ktap::diag(format_args!("vgpu's importers during I/O: {during:?}"));
    common::unreg(&node, idx).context("UNREG_BUFFER")?;
    drop(dmabuf);
    fault::wait_until(
        "the drive's mapping to go with the registration",
        WAIT,
        || Ok(maps_of(&bdf)? == 0),
    )?;
    ktap::pass()
}

/// Sets vgpu's `refuse_importer` for its life, clears it on drop.
struct Refusing;

const REFUSE_PARAM: &str = "/sys/module/vgpu/parameters/refuse_importer";

impl Refusing {
    fn new(bdf: &str) -> anyhow::Result<Refusing> {
        std::fs::write(REFUSE_PARAM, bdf)
            .with_context(|| format!("cannot write {REFUSE_PARAM}"))?;
        Ok(Refusing)
    }
}

impl Drop for Refusing {
    fn drop(&mut self) {
        let _ = std::fs::write(REFUSE_PARAM, "\n");
    }
}

fn exporter_refusing_the_dma_device_is_eremoteio() -> CaseResult {
    let bdf = nvme_bdf()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0x5a)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len).context("REG_BUFFER")?;
    let nvme = common::nvme(false)?;
    let mark = guest::kernel_log_mark()?;
    {
        let _refusing = Refusing::new(&bdf)?;
        let got = common::ioctl_io(&node, false, &read_arg(idx, len, &nvme, 0));
        ensure!(
            got == Err(libc::EREMOTEIO),
            "FGDS_IOCTL_READ through {bdf}, which the exporter refuses: {got:?}, want EREMOTEIO"
        );
    }
    let log = guest::kernel_log_since(mark)?;
    fault::expect_logged(&log, &format!("refused an attachment as {bdf}"))?;
    let data = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    ensure!(
        data.iter().all(|&b| b == 0x5a),
        "the refused read changed the buffer"
    );
    // A refusal is the exporter's answer of the moment, not remembered.
    let got = common::ioctl_io(&node, false, &read_arg(idx, len, &nvme, 0));
    ensure!(
        got == Ok(len as usize),
        "FGDS_IOCTL_READ once the exporter takes {bdf} again: {got:?}"
    );
    let data = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    common::check_nvme_pattern(0, &data)?;
    common::unreg(&node, idx).context("UNREG_BUFFER")?;
    ktap::pass()
}

fn vgpu_module() -> anyhow::Result<(String, String)> {
    guest::rig_modules()?
        .into_iter()
        .find(|(path, _)| Path::new(path).file_stem().is_some_and(|s| s == "vgpu"))
        .context("the init did not load vgpu (/run/fgds/modules)")
}

fn unload_vgpu() -> anyhow::Result<()> {
    let mut last = Ok(());
    for _ in 0..200 {
        last = rustix::system::delete_module(c"vgpu", libc::O_NONBLOCK);
        if !matches!(last, Err(Errno::AGAIN) | Err(Errno::BUSY)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    last.context("cannot unload vgpu")
}

/// Loads vgpu with `params` and waits for its GPU and fgds's node of it.
fn load_vgpu(params: &str) -> anyhow::Result<()> {
    let (path, _) = vgpu_module()?;
    let file = File::open(&path).with_context(|| format!("cannot open {path}"))?;
    rustix::system::finit_module(&file, &CString::new(params)?, 0)
        .with_context(|| format!("cannot load {path} {params}"))?;
    wait_gpu()
}

fn wait_gpu() -> anyhow::Result<()> {
    fault::wait_until("vgpu's GPU and fgds's node", WAIT, || {
        Ok(common::vgpu_name().is_ok() && common::node_path().is_ok())
    })?;
    Ok(())
}

/// Puts vgpu (with the init's parameters) and fgds back as the init left them, on drop.
struct Restore {
    params: String,
}

impl Drop for Restore {
    fn drop(&mut self) {
        if !Path::new("/sys/module/fgds").exists() {
            let _ = fault::load_fgds();
        }
        let _ = unload_vgpu();
        if let Err(err) = load_vgpu(&self.params) {
            ktap::diag(format_args!("restoring vgpu: {err:#}"));
        }
    }
}

/// A thread that allocates, exports, writes and frees vgpu buffers until stopped (at the
/// latest when dropped); an error before `unbinding` is set fails it, one after it ends it.
/// Its CPU writes go through the buffer's mapping under `writing`, and none starts once
/// `unbinding` is set: a write under way when the unbind revoked the mapping would be a SIGBUS,
/// not an error (seen with the tests built unoptimised, where the write takes long enough).
struct Allocator {
    stop: Arc<AtomicBool>,
    unbinding: Arc<AtomicBool>,
    writing: Arc<Mutex<()>>,
    thread: Option<JoinHandle<anyhow::Result<u64>>>,
}

impl Allocator {
    fn start() -> Allocator {
        let stop = Arc::new(AtomicBool::new(false));
        let unbinding = Arc::new(AtomicBool::new(false));
        let writing = Arc::new(Mutex::new(()));
        let thread = Some(allocate(stop.clone(), unbinding.clone(), writing.clone()));
        Allocator {
            stop,
            unbinding,
            writing,
            thread,
        }
    }

    /// Runs `unbind` while the thread goes on allocating, with no write through a mapping
    /// under way and none to start after it.
    fn unbind_meanwhile(&self, unbind: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
        self.unbinding.store(true, Ordering::SeqCst);
        let _no_writes = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        unbind()
    }

    /// Stops it; how many buffers it allocated.
    fn finish(mut self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::SeqCst);
        let thread = self.thread.take().expect("joined once");
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("the allocating thread panicked"))?
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn allocate(
    stop: Arc<AtomicBool>,
    unbinding: Arc<AtomicBool>,
    writing: Arc<Mutex<()>>,
) -> JoinHandle<anyhow::Result<u64>> {
    std::thread::spawn(move || {
        let vgpu = common::vgpu()?;
        let mut done = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let step = || -> anyhow::Result<()> {
                let (dmabuf, _) = common::alloc(&vgpu, 2 * MIB)?;
                let _writing = writing.lock().unwrap_or_else(|p| p.into_inner());
                ensure!(
                    !unbinding.load(Ordering::SeqCst),
                    "the GPU is being unbound: no write through the mapping"
                );
                common::gpu_write(dmabuf.as_fd(), (2 * MIB) as usize, 0, &[done as u8; 4096])?;
                Ok(())
            };
            match step() {
                Ok(()) => done += 1,
                Err(_) if unbinding.load(Ordering::SeqCst) => break,
                Err(err) => return Err(err.context(format!("allocation {done}"))),
            }
        }
        Ok(done)
    })
}

fn p2pmem_dir() -> anyhow::Result<PathBuf> {
    Ok(Path::new("/sys/bus/pci/devices")
        .join(common::vgpu_bdf()?)
        .join("p2pmem"))
}

/// What the GPU's P2PDMA pool looks like: None without one, else its `size`.
fn p2pmem() -> anyhow::Result<Option<String>> {
    let dir = p2pmem_dir()?;
    if !dir.exists() {
        return Ok(None);
    }
    Ok(Some(
        std::fs::read_to_string(dir.join("size"))?.trim().to_owned(),
    ))
}

/// The scenario of the acceptance: vgpu loaded with `params` allocates and exports all along
/// while fgds serves registrations, is unloaded and loaded again, and the GPU is unbound and
/// bound again; fgds's mode is `mode` and the GPU's P2PDMA pool stays `pool` throughout.
fn owner_keeps_its_state(
    params: &str,
    mode: &str,
    pool: impl Fn() -> Option<String>,
) -> CaseResult {
    let (_, init_params) = vgpu_module()?;
    let _restore = Restore {
        params: init_params,
    };
    unload_vgpu()?;
    load_vgpu(params)?;
    let want = pool();
    let check_pool = |when: &str| -> anyhow::Result<()> {
        let got = p2pmem()?;
        ensure!(
            got == want,
            "{when}: the GPU's P2PDMA pool is {got:?} (p2pmem/size), want {want:?}: fgds changed \
             P2PDMA state that its driver set up"
        );
        Ok(())
    };
    check_pool("vgpu loaded")?;
    let alloc = Allocator::start();

    let node = common::open_node()?;
    read_through_fgds(&node, 4 * MIB, MIB)?;
    check_pool("fgds serving registrations")?;
    let got = common::sysfs("mode")?;
    ensure!(got == mode, "fgds's mode is {got}, want {mode}");
    drop(node);

    fault::unload_fgds()?;
    check_pool("fgds unloaded")?;
    fault::load_fgds_and_wait_node()?;
    let node = common::open_node()?;
    read_through_fgds(&node, 4 * MIB, 5 * MIB)?;
    check_pool("fgds loaded again")?;

    // A registration stays across the unbind: fgds lets go of it when the GPU's driver goes.
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, 2 * MIB)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB).context("REG_BUFFER")?;
    drop(vgpu);
    let bdf = common::vgpu_bdf()?;
    alloc.unbind_meanwhile(|| {
        std::fs::write("/sys/bus/pci/drivers/vgpu/unbind", &bdf).context("unbind the GPU")
    })?;
    let nvme = common::nvme(false)?;
    let got = common::ioctl_io(&node, false, &read_arg(idx, 2 * MIB, &nvme, 0));
    ensure!(
        got.is_err(),
        "FGDS_IOCTL_READ after the GPU was unbound: {got:?}"
    );
    let allocated = alloc.finish()?;
    ensure!(allocated > 0, "vgpu allocated nothing while fgds worked");
    drop(dmabuf);
    drop(node);
    std::fs::write("/sys/bus/pci/drivers/vgpu/bind", &bdf).context("bind the GPU again")?;
    wait_gpu()?;
    check_pool("the GPU bound again")?;
    let node = common::open_node()?;
    read_through_fgds(&node, 4 * MIB, 0)?;
    check_pool("fgds serving registrations after the rebind")?;
    ktap::diag(format_args!(
        "vgpu allocated {allocated} buffers meanwhile; pool {want:?} throughout"
    ));
    ktap::pass()
}

fn foreign_p2pdma_state_gets_no_pages() -> CaseResult {
    if !guest::kernel_has_symbol("pcim_p2pdma_provider")? {
        return ktap::skip("no P2PDMA providers in this kernel (Linux 6.19 and later)");
    }
    if common::gpu_dma_translated()? {
        return ktap::skip(
            "the GPU's DMA is translated by an IOMMU: fgds refuses GENERIC pages, its only \
             pages beside a provider",
        );
    }
    owner_keeps_its_state("mode=provider", "generic", || None)
}

fn exporter_p2pdma_pages_unchanged() -> CaseResult {
    if !guest::kernel_has_symbol("pci_p2pdma_add_resource")? {
        return ktap::skip("no CONFIG_PCI_P2PDMA in this kernel");
    }
    let bar = common::sysfs_u64("bar_size")?;
    owner_keeps_its_state("mode=p2pdma", "exporter-p2pdma", move || {
        Some(bar.to_string())
    })
}
