//! Issue 16: revocation that holds. Once the exporter takes its memory back (or the GPU's
//! driver unbinds), nothing fgds handed out reaches that memory again, the exporter's
//! invalidation returns without waiting for I/O, its fence signals only once the I/O is done,
//! and no timer gives the memory back early. Also the review's other defects: PMDs in
//! VM_MIXEDMAP mappings, read-only dma-bufs, BAR geometry, teardown past its deadline, and
//! global locks held across the wait.
//!
//! Reads are held in flight with a QEMU blkdebug breakpoint on the raw drive (the first read
//! to reach the drive waits until the case resumes it).

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map, PAGE};
use fault::{Child, SharedCounter};
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;
use rustix::io::Errno;

/// NVMe scratch area of this program: the data the held reads carry.
const SCRATCH: u64 = 208 * MIB;
/// What GPU memory holds before and after (the sentinel), and what the held read carries.
const SEED_SENTINEL: u64 = 0x5345_4e54;
const SEED_READ: u64 = 0x5245_4144;
/// How long a case keeps a read held before it resumes it.
const HOLD: Duration = Duration::from_secs(2);

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "held_read_never_lands_after_revocation",
            run: held_read_never_lands_after_revocation,
        },
        Case {
            name: "vmsplice_holds_revocation_until_drained",
            run: vmsplice_holds_revocation_until_drained,
        },
        Case {
            name: "readonly_dmabuf_gives_readonly_mapping",
            run: readonly_dmabuf_gives_readonly_mapping,
        },
        Case {
            name: "no_pmd_in_a_mixedmap_mapping_of_two_extents",
            run: no_pmd_with_two_extents,
        },
        Case {
            name: "no_pmd_after_mremap_to_an_aligned_address",
            run: no_pmd_after_mremap,
        },
        Case {
            name: "teardown_past_its_deadline_keeps_waiting",
            run: teardown_past_its_deadline_keeps_waiting,
        },
        Case {
            name: "unbind_with_revocation_pending_blocks_no_one_else",
            run: unbind_blocks_no_one_else,
        },
        Case {
            name: "bar_resized_at_probe_is_read_again",
            run: bar_resized_at_probe_is_read_again,
        },
        Case {
            name: "pages_follow_registrations",
            run: pages_follow_registrations,
        },
        Case {
            name: "unreg_racing_an_invalidation_with_pages_shared",
            run: unreg_racing_an_invalidation_with_pages_shared,
        },
        Case {
            name: "unreg_of_a_used_registration_racing_an_invalidation",
            run: unreg_of_a_used_registration_racing_an_invalidation,
        },
    ])
}

/// The blkdebug breakpoint tag.
const TAG: &str = "fgds_revoke";

/// A pread(2) from the raw drive into `map`, in a thread: returns bytes read or the errno.
fn read_in_thread(map: &Map, len: usize, nvme_off: u64) -> JoinHandle<Result<usize, Errno>> {
    let ptr = map.ptr as usize;
    std::thread::spawn(move || {
        let nvme = common::nvme(false).map_err(|_| Errno::IO)?;
        common::pread_raw(&nvme, ptr as *mut u8, len, nvme_off)
    })
}

/// Starts a read into `map` and checks that QEMU holds it.
fn held_read(
    map: &Map,
    len: usize,
    nvme_off: u64,
) -> anyhow::Result<(common::Breakpoint, JoinHandle<Result<usize, Errno>>)> {
    let bp = common::Breakpoint::arm(TAG)?;
    let reader = read_in_thread(map, len, nvme_off);
    std::thread::sleep(Duration::from_millis(500));
    ensure!(
        !reader.is_finished(),
        "the read was not held by the breakpoint: {:?}",
        reader.join()
    );
    Ok((bp, reader))
}

/// Revokes the vgpu buffer at `bar_off` in a thread (the write returns once fences signalled).
fn revoke_in_thread(bar_off: u64) -> JoinHandle<anyhow::Result<()>> {
    std::thread::spawn(move || common::revoke(bar_off))
}

/// Waits until a CPU load from `ptr` raises SIGBUS: the buffer's mappings are zapped. Only
/// loads: a store that came before the zap would change the memory under test.
fn wait_zapped(ptr: *mut u8) -> anyhow::Result<()> {
    fault::wait_until(
        "the mapping to be zapped (SIGBUS on access)",
        Duration::from_secs(10),
        || Ok(common::load_in_child(ptr)? == 128 + libc::SIGBUS),
    )
    .map(drop)
}

/// Reads `len` bytes of BAR2 at `bar_off` through a fresh vgpu buffer of the same range:
/// vgpu hands ranges out first fit, so once the old buffer is gone, allocating it again gives
/// the same range (checked).
fn read_range_again(bar_off: u64, len: u64) -> anyhow::Result<Vec<u8>> {
    let vgpu = common::vgpu()?;
    let (dmabuf, off) = common::alloc(&vgpu, len)?;
    ensure!(
        off == bar_off,
        "vgpu gave BAR2 {off:#x}, not the revoked buffer's {bar_off:#x}: cannot read it back"
    );
    common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)
}

/// (a) A read held in flight into a buffer whose exporter revokes it: the exporter's
/// invalidation returns while the read is still held, its wait for fences ends only after the
/// read ended, new I/O and CPU access fail at once, and once the exporter reuses the memory
/// (vgpu writes the sentinel again) nothing of the read lands there.
fn held_read_never_lands_after_revocation() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    // A deadline shorter than the hold: no timer may give the memory back.
    let _timeout = fault::RevokeTimeout::set(500)?;
    fault::write_nvme_pattern(SEED_READ, LEN as usize, SCRATCH)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = Map::shared(&node, idx, LEN as usize)?;
    let nvme = common::nvme(false)?;

    let (bp, reader) = held_read(&map, LEN as usize, SCRATCH)?;
    fault::host_log("fgds_revoke: vgpu revokes a buffer with a read held in flight into it")?;
    let started = Instant::now();
    let revoker = revoke_in_thread(bar_off);
    wait_zapped(map.ptr)?;
    let late = common::pread_raw(&nvme, map.ptr, PAGE as usize, SCRATCH);
    ensure!(
        late == Err(Errno::FAULT),
        "a read into the revoked buffer gave {late:?}, want EFAULT"
    );
    std::thread::sleep(HOLD.saturating_sub(started.elapsed()));
    ensure!(
        !revoker.is_finished(),
        "the exporter's revocation returned while a read into the buffer was in flight: it got \
         the memory back early ({:?})",
        fault::join(revoker, "revoked")?
    );
    let resumed = started.elapsed();
    bp.resume()?;
    let read = fault::join(reader, "read")?;
    fault::join(revoker, "revoked")?.context("revoke")?;
    fault::check_held_revocation(bar_off, resumed, read)?;
    ensure!(
        read == Ok(LEN as usize),
        "the held read ended with {read:?}, want {LEN} bytes (it pinned its pages before the \
         revocation)"
    );

    // The exporter reuses the memory: anything of the read landing from now on would show.
    fault::reuse_and_check(bar_off, LEN, SEED_SENTINEL)?;
    drop(map);
    drop(node);
    drop(dmabuf);
    fault::wait_counters_zero("after the case")?;
    let got = read_range_again(bar_off, LEN)?;
    if let Some(at) = pattern::first_mismatch(SEED_SENTINEL, 0, &got) {
        let read_landed = pattern::first_mismatch(SEED_READ, at as u64, &got[at..at + 8]);
        bail!(
            "GPU memory at byte {at:#x} of the revoked buffer is not the sentinel the exporter \
             wrote after the revocation{}",
            if read_landed.is_none() {
                ": it is the held read's data"
            } else {
                ""
            }
        );
    }
    ktap::pass()
}

/// (c) Pages spliced into a pipe are references like I/O: with P2PDMA pages vmsplice() is
/// refused (GUP hands them to no one but the block layer); with GENERIC pages a revocation's
/// fence waits until the pipe is drained.
fn vmsplice_holds_revocation_until_drained() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 2 * MIB;
    let _timeout = fault::RevokeTimeout::set(500)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = Map::shared(&node, idx, LEN as usize)?;
    let (rx, tx) = pipe()?;
    let iov = libc::iovec {
        iov_base: map.ptr.cast(),
        iov_len: PAGE as usize,
    };
    // SAFETY: one page of our live mapping; vmsplice only reads the iovec.
    let n = unsafe { libc::vmsplice(tx.as_raw_fd(), &iov, 1, 0) };
    let err = std::io::Error::last_os_error();
    let mode = fgds_tests::guest::expected_mode()?;
    if mode != "generic" {
        ensure!(
            n < 0 && err.raw_os_error() == Some(libc::EREMOTEIO),
            "vmsplice of {mode} pages gave {n} ({err}), want EREMOTEIO"
        );
        return ktap::pass();
    }
    ensure!(
        n == PAGE as isize,
        "vmsplice of GENERIC pages gave {n} ({err})"
    );
    drop(tx);
    let started = Instant::now();
    let revoker = revoke_in_thread(bar_off);
    wait_zapped(map.ptr)?;
    std::thread::sleep(Duration::from_secs(1));
    ensure!(
        !revoker.is_finished(),
        "the revocation returned while a pipe still held a page of the buffer"
    );
    let drained_at = started.elapsed();
    let mut page = vec![0u8; PAGE as usize];
    let got = rustix::io::read(&rx, &mut page)?;
    ensure!(got == page.len(), "read {got} bytes from the pipe");
    if let Some(at) = pattern::first_mismatch(SEED_SENTINEL, 0, &page) {
        let word = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
        bail!(
            "the pipe did not carry the buffer's data: byte {at:#x}, word {:#018x}, want {:#018x}",
            word(&page, at & !7),
            pattern::word(SEED_SENTINEL, (at & !7) as u64)
        );
    }
    fault::wait_until(
        "the revocation to return once the pipe is drained",
        Duration::from_secs(10),
        || Ok(revoker.is_finished()),
    )?;
    fault::join(revoker, "revoked")?.context("revoke")?;
    let (_, invalidate, fences) = fault::last_revoke()?;
    ktap::diag(format_args!(
        "pipe drained {drained_at:?} into the revocation; invalidation {invalidate:?}, fences \
         {fences:?}"
    ));
    ensure!(
        invalidate + fences + Duration::from_millis(50) >= drained_at,
        "the fence signalled before the pipe was drained"
    );
    drop(map);
    drop(node);
    drop(dmabuf);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// (d) A dma-buf the exporter handed out read-only gives a mapping that is and stays read-only,
/// so NVMe reads into it fail; writes from it to the drive work.
fn readonly_dmabuf_gives_readonly_mapping() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = fgds::vgpu::alloc_with(&vgpu, LEN, fgds::vgpu::ALLOC_RDONLY)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = common::map_readonly_checked(&node, idx, LEN as usize)?;
    let nvme = common::nvme(true)?;
    let into = common::pread_raw(&nvme, map.ptr, LEN as usize, SCRATCH);
    ensure!(
        into == Err(Errno::FAULT),
        "an NVMe read into the read-only mapping gave {into:?}, want EFAULT"
    );
    let n = common::pwrite_raw(&nvme, map.ptr, LEN as usize, SCRATCH)
        .context("an NVMe write from the read-only mapping")?;
    ensure!(n == LEN as usize, "short write {n}");
    let mut back = AlignedBuf::new(LEN as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), SCRATCH)?;
    ensure!(
        pattern::first_mismatch(SEED_SENTINEL, 0, back.as_slice()).is_none(),
        "the drive did not get the GPU memory's data"
    );
    ktap::pass()
}

/// Why PMD mappings cannot occur here, if they cannot: only 2 MiB folios on 7.x kernels are
/// mapped with PMDs: GENERIC pages, and P2PDMA pages on a kernel with the p2pdma-folios change.
fn no_pmds_here() -> anyhow::Result<Option<String>> {
    let mode = fgds_tests::guest::expected_mode()?;
    let release = common::kernel_release()?;
    let folios = mode == "generic" || (mode == "p2pdma" && fgds_tests::guest::has_p2pdma_folios()?);
    Ok(if !folios {
        Some(format!(
            "no PMD mappings with {mode} pages (order-0 folios)"
        ))
    } else if !release.starts_with('7') {
        Some(format!(
            "no PMD mappings on {release}: fgds maps 2 MiB folios with PTEs before 7.x"
        ))
    } else {
        None
    })
}

/// Makes the kernel try huge faults in every VMA while it lives (THP "always").
struct ThpAlways(String);

impl ThpAlways {
    const PATH: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

    fn set() -> anyhow::Result<ThpAlways> {
        let text = std::fs::read_to_string(Self::PATH).context("read THP setting")?;
        let old = text
            .split_whitespace()
            .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
            .context("no current THP setting")?
            .to_owned();
        std::fs::write(Self::PATH, "always").context("set THP always")?;
        Ok(ThpAlways(old))
    }
}

impl Drop for ThpAlways {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.0);
    }
}

/// A reserved, inaccessible range of address space, 2 MiB aligned, to map into with MAP_FIXED.
struct Reserve {
    base: *mut u8,
    len: usize,
}

impl Reserve {
    fn new(len: usize) -> anyhow::Result<Reserve> {
        let total = len + 2 * MIB as usize;
        // SAFETY: a new inaccessible anonymous mapping aliases nothing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        ensure!(p != libc::MAP_FAILED, "reserve address space");
        Ok(Reserve {
            base: p.cast(),
            len: total,
        })
    }

    /// The first 2 MiB boundary in the reserve, plus `plus` bytes.
    fn aligned(&self, plus: usize) -> *mut u8 {
        let a = (self.base as usize).next_multiple_of(2 * MIB as usize);
        (a + plus) as *mut u8
    }
}

impl Drop for Reserve {
    fn drop(&mut self) {
        // SAFETY: the reserve and whatever was mapped into it with MAP_FIXED.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// Maps token `idx` of `node` at `addr` exactly.
fn map_fixed(node: &File, idx: u64, len: usize, addr: *mut u8) -> anyhow::Result<Map> {
    // SAFETY: `addr` lies in a reserve of ours, which MAP_FIXED replaces.
    let p = unsafe {
        libc::mmap(
            addr.cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            node.as_raw_fd(),
            idx as libc::off_t,
        )
    };
    ensure!(
        p == addr.cast(),
        "mmap at {addr:?}: {}",
        std::io::Error::last_os_error()
    );
    Ok(Map { ptr: p.cast(), len })
}

/// `struct pm_scan_arg` of `PAGEMAP_SCAN` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_HUGE: u64 = 1 << 6;
const PAGEMAP_SCAN: rustix::ioctl::Opcode =
    rustix::ioctl::opcode::read_write::<PmScanArg>(b'f', 16);

/// Bytes of `[addr, addr + len)` mapped with huge PMDs, as `PAGEMAP_SCAN` on
/// /proc/self/pagemap reports them (smaps' `FilePmdMapped` leaves device pages out).
fn pmd_mapped_bytes(addr: *mut u8, len: usize) -> anyhow::Result<u64> {
    let pagemap = File::open("/proc/self/pagemap").context("open /proc/self/pagemap")?;
    let mut regions = [PageRegion::default(); 64];
    let mut arg = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        start: addr as u64,
        end: addr as u64 + len as u64,
        vec: regions.as_mut_ptr() as u64,
        vec_len: regions.len() as u64,
        category_mask: PAGE_IS_PRESENT | PAGE_IS_HUGE,
        return_mask: PAGE_IS_HUGE,
        ..PmScanArg::default()
    };
    // SAFETY: `arg` is struct pm_scan_arg, its `vec` points at `regions`, which outlives the
    // call and has `vec_len` entries; the request number encodes the argument's size.
    let n = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
    ensure!(n >= 0, "PAGEMAP_SCAN: {}", std::io::Error::last_os_error());
    Ok(regions[..n as usize].iter().map(|r| r.end - r.start).sum())
}

/// Reads the NVMe pattern into the mapping and checks it through vgpu's CPU mapping.
fn data_through(map: &Map, dmabuf: &OwnedFd, len: u64) -> anyhow::Result<()> {
    let nvme = common::nvme(false)?;
    let n = common::pread_raw(&nvme, map.ptr, len as usize, 0).context("pread")?;
    ensure!(n == len as usize, "short read {n}");
    common::check_nvme_pattern(
        0,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )
}

/// (d) A buffer of two BAR runs at different 2 MiB phases, mapped where the second run's
/// folios fall on 2 MiB boundaries but the first run's do not: the VMA is VM_MIXEDMAP (no PMDs
/// as a whole), and a fault in the second run must not map a PMD there (the kernel would zap
/// it as a special PMD and keep the folio's reference for ever).
fn no_pmd_with_two_extents() -> CaseResult {
    if let Some(why) = no_pmds_here()? {
        return ktap::skip(why);
    }
    fault::require_idle()?;
    const LEN: u64 = 8 * MIB;
    let _thp = ThpAlways::set()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = fgds::vgpu::alloc_with(&vgpu, LEN, fgds::vgpu::ALLOC_SKEW)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let reserve = Reserve::new(LEN as usize)?;
    let map = map_fixed(&node, idx, LEN as usize, reserve.aligned(0))?;
    // The buffer's second run starts 2 MiB in, at a folio boundary of the BAR.
    // SAFETY: a byte of our live mapping.
    let _ = unsafe { map.at(2 * MIB as usize).read_volatile() };
    let pmd = pmd_mapped_bytes(map.ptr, LEN as usize)?;
    ensure!(pmd == 0, "a VM_MIXEDMAP mapping got {pmd} bytes of PMDs");
    data_through(&map, &dmabuf, LEN)?;
    drop(map);
    drop(reserve);
    common::unreg(&node, idx)?;
    drop(dmabuf);
    fault::wait_counters_zero("after the case")?;
    fault::wait_vgpu_buffers_gone("after the case: fgds let the buffer go")?;
    ktap::pass()
}

/// (d) A mapping made where the buffer's folios are not 2 MiB aligned (VM_MIXEDMAP), then moved
/// by mremap() to where they are: still no PMD.
fn no_pmd_after_mremap() -> CaseResult {
    if let Some(why) = no_pmds_here()? {
        return ktap::skip(why);
    }
    fault::require_idle()?;
    const LEN: u64 = 8 * MIB;
    let _thp = ThpAlways::set()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    // Where the buffer's first page would sit on a folio boundary, and one page off that.
    let phase = (bar_off % (2 * MIB)) as usize;
    let reserve = Reserve::new(2 * LEN as usize + 4 * MIB as usize)?;
    let aligned = reserve.aligned(phase);
    let off = reserve.aligned(phase + LEN as usize + 2 * MIB as usize + PAGE as usize);
    let mut map = map_fixed(&node, idx, LEN as usize, off)?;
    // SAFETY: moves our own mapping onto another part of our reserve.
    let moved = unsafe {
        libc::mremap(
            map.ptr.cast(),
            LEN as usize,
            LEN as usize,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            aligned.cast::<libc::c_void>(),
        )
    };
    ensure!(
        moved == aligned.cast(),
        "mremap: {}",
        std::io::Error::last_os_error()
    );
    map.ptr = moved.cast();
    // The first whole folio of the buffer.
    let head = (2 * MIB as usize - phase) % (2 * MIB as usize);
    // SAFETY: a byte of our live mapping.
    let _ = unsafe { map.at(head).read_volatile() };
    let pmd = pmd_mapped_bytes(map.ptr, LEN as usize)?;
    ensure!(
        pmd == 0,
        "a VM_MIXEDMAP mapping moved by mremap got {pmd} bytes of PMDs"
    );
    // Control: where fgds places the mapping itself, the same folio is mapped with a PMD.
    let pmds = Map::shared(&node, idx, LEN as usize)?;
    // SAFETY: a byte of our live mapping.
    let _ = unsafe { pmds.at(head).read_volatile() };
    let control = pmd_mapped_bytes(pmds.ptr, LEN as usize)?;
    ensure!(
        control >= 2 * MIB,
        "the control mapping got {control} bytes of PMDs: PAGEMAP_SCAN does not see them"
    );
    drop(pmds);
    data_through(&map, &dmabuf, LEN)?;
    drop(map);
    drop(reserve);
    common::unreg(&node, idx)?;
    drop(dmabuf);
    fault::wait_counters_zero("after the case")?;
    fault::wait_vgpu_buffers_gone("after the case: fgds let the buffer go")?;
    ktap::pass()
}

/// The rig GPU's PCI address and its driver's sysfs directory.
fn vgpu_driver() -> anyhow::Result<(String, std::path::PathBuf)> {
    let bdf = common::vgpu_bdf()?;
    let drv = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bdf}/driver"))
        .context("vgpu driver link")?;
    Ok((bdf, drv))
}

/// Binds vgpu to the GPU again and waits for its node and fgds's.
fn rebind_vgpu(bdf: &str, drv: &std::path::Path) -> anyhow::Result<()> {
    std::fs::write(drv.join("bind"), bdf).context("bind vgpu")?;
    fault::wait_until(
        "vgpu and the fgds node after the rebind",
        Duration::from_secs(20),
        || Ok(common::node_path().is_ok() && common::vgpu_name().is_ok()),
    )
    .map(drop)
}

/// (d) The GPU's driver unbinds while a read is held in flight into its memory, past fgds's
/// `revoke_timeout_ms`: fgds logs who holds the pages and keeps waiting (the unbind does not
/// return, the provider stays), and once the read ends everything is released and works
/// after a rebind.
fn teardown_past_its_deadline_keeps_waiting() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    let (bdf, drv) = vgpu_driver()?;
    let mode = fgds_tests::guest::expected_mode()?;
    let _timeout = fault::RevokeTimeout::set(500)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    drop((vgpu, dmabuf));
    let map = Map::shared(&node, idx, LEN as usize)?;
    let (bp, reader) = held_read(&map, LEN as usize, 0)?;
    let mark = fgds_tests::guest::kernel_log_mark()?;
    fault::host_log("fgds_revoke: unbind vgpu with a read held in flight, past revoke_timeout_ms")?;
    let unbinder = {
        let (bdf, drv) = (bdf.clone(), drv.clone());
        std::thread::spawn(move || std::fs::write(drv.join("unbind"), bdf))
    };
    std::thread::sleep(HOLD);
    let waiting = !unbinder.is_finished();
    let mode_meanwhile = common::sysfs("mode")?;
    let log = fgds_tests::guest::kernel_log_since(mark)?;
    bp.resume()?;
    let read = fault::join(reader, "read")?;
    let unbound = fault::join(unbinder, "unbound");
    drop(map);
    drop(node);
    rebind_vgpu(&bdf, &drv)?;
    unbound?.context("unbind vgpu")?;
    ensure!(
        waiting,
        "the GPU's unbind returned while a read into its memory was in flight"
    );
    ensure!(
        mode_meanwhile == mode,
        "while the teardown waited, sysfs mode read {mode_meanwhile:?}, not {mode:?}"
    );
    fault::expect_logged(&log, "still referenced after")?;
    ensure!(
        read == Ok(LEN as usize),
        "the held read ended with {read:?}"
    );
    fault::wait_counters_zero("after the rebind")?;
    ensure!(
        common::sysfs_u64("held")? == 0,
        "fgds still holds pages after the teardown"
    );
    fault::data_check(4 * MIB, 36 * MIB).context("after the rebind")?;
    ensure!(
        common::sysfs("mode")? == mode,
        "after the rebind fgds set up {} pages, not {mode}",
        common::sysfs("mode")?
    );
    ktap::pass()
}

/// The PCI address of the second NVMe controller (the drive at `FGDS_NVME2`).
fn nvme2_bdf() -> anyhow::Result<String> {
    let dev = std::env::var("FGDS_NVME2").context("FGDS_NVME2 is not set")?;
    let name = std::path::Path::new(&dev)
        .file_name()
        .context("FGDS_NVME2")?
        .to_string_lossy()
        .into_owned();
    let ctrl = std::fs::canonicalize(format!("/sys/block/{name}/device/device"))
        .with_context(|| format!("the PCI device of {name}"))?;
    Ok(ctrl
        .file_name()
        .context("PCI device")?
        .to_string_lossy()
        .into_owned())
}

/// Shared counter slot: how long the other process's munmap took, in µs (+1, so 0 is unset).
const MUNMAP_US: usize = 0;

/// (e) The GPU's driver unbinds while a read is held in flight into its memory: meanwhile an
/// unrelated PCI device (the second NVMe controller) unbinds and binds again, and another
/// process's last munmap of a buffer of the same GPU returns, without waiting for the read.
fn unbind_blocks_no_one_else() -> CaseResult {
    fault::require_idle()?;
    const LEN: u64 = 4 * MIB;
    let (bdf, drv) = vgpu_driver()?;
    let nvme2 = nvme2_bdf()?;
    let nvme_drv = std::path::Path::new("/sys/bus/pci/drivers/nvme");
    let counts = SharedCounter::new()?;
    let mut other = Child::spawn(|parent| {
        let node = common::open_node()?;
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, MIB)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, MIB)?;
        let map = Map::shared(&node, idx, MIB as usize)?;
        // The mapping is all that keeps the registration: its munmap releases it.
        common::unreg(&node, idx)?;
        drop((node, vgpu, dmabuf));
        parent.ready("mapped");
        parent.wait_released();
        let started = Instant::now();
        drop(map);
        counts
            .get(MUNMAP_US)
            .store(started.elapsed().as_micros() as u64 + 1, Ordering::SeqCst);
        Ok(())
    })?;
    let ready = other.wait_ready(Duration::from_secs(30))?;
    ensure!(ready == "mapped", "the other process said {ready:?}");

    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    drop((vgpu, dmabuf));
    let map = Map::shared(&node, idx, LEN as usize)?;
    let (bp, reader) = held_read(&map, LEN as usize, 0)?;
    fault::host_log("fgds_revoke: unbind vgpu with a read held; others go on meanwhile")?;
    let unbinder = {
        let (bdf, drv) = (bdf.clone(), drv.clone());
        std::thread::spawn(move || std::fs::write(drv.join("unbind"), bdf))
    };
    std::thread::sleep(Duration::from_secs(1));
    let result = (|| -> anyhow::Result<()> {
        ensure!(
            !unbinder.is_finished(),
            "the GPU's unbind returned while a read into its memory was in flight"
        );
        let started = Instant::now();
        std::fs::write(nvme_drv.join("unbind"), &nvme2).context("unbind the second NVMe")?;
        let unbind2 = started.elapsed();
        std::fs::write(nvme_drv.join("bind"), &nvme2).context("bind the second NVMe")?;
        let both = started.elapsed();
        other.release();
        fault::wait_until(
            "the other process's munmap",
            Duration::from_secs(10),
            || Ok(counts.get(MUNMAP_US).load(Ordering::SeqCst) != 0),
        )?;
        let munmap = Duration::from_micros(counts.get(MUNMAP_US).load(Ordering::SeqCst) - 1);
        ktap::diag(format_args!(
            "while the GPU's unbind waited: the second NVMe unbound in {unbind2:?} and bound in \
             {:?}; the other process's munmap took {munmap:?}",
            both - unbind2
        ));
        ensure!(
            both < Duration::from_secs(5),
            "the second NVMe's unbind and bind took {both:?}"
        );
        ensure!(
            munmap < Duration::from_secs(1),
            "the other process's munmap took {munmap:?}"
        );
        ensure!(
            !unbinder.is_finished(),
            "the GPU's unbind returned before the held read ended"
        );
        Ok(())
    })();
    bp.resume()?;
    let read = fault::join(reader, "read")?;
    let unbound = fault::join(unbinder, "unbound");
    let status = other.wait();
    drop(map);
    drop(node);
    rebind_vgpu(&bdf, &drv)?;
    unbound?.context("unbind vgpu")?;
    result?;
    ensure!(status? == 0, "the other process failed");
    ensure!(
        read == Ok(LEN as usize),
        "the held read ended with {read:?}"
    );
    fault::wait_counters_zero("after the rebind")?;
    fault::data_check(4 * MIB, 40 * MIB).context("after the rebind")?;
    ktap::pass()
}

/// vgpu's `bar_bytes`, set for as long as this lives (0: as assigned).
struct BarBytes;

impl BarBytes {
    const PATH: &str = "/sys/module/vgpu/parameters/bar_bytes";

    fn set(bytes: u64) -> anyhow::Result<BarBytes> {
        std::fs::write(Self::PATH, bytes.to_string()).context("set vgpu bar_bytes")?;
        Ok(BarBytes)
    }
}

impl Drop for BarBytes {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, "0");
    }
}

/// (d) The GPU's driver resizes its BAR when it binds, as GPU drivers do at probe: fgds reads
/// the BAR again when it sets the provider up, and registrations up to the new end work.
fn bar_resized_at_probe_is_read_again() -> CaseResult {
    fault::require_idle()?;
    let (bdf, drv) = vgpu_driver()?;
    let full = common::sysfs_u64("bar_size")?;
    let half = full / 2;
    let resize = |bytes: u64| -> anyhow::Result<()> {
        let _bar = BarBytes::set(bytes)?;
        std::fs::write(drv.join("unbind"), &bdf).context("unbind vgpu")?;
        rebind_vgpu(&bdf, &drv)
    };
    resize(half)?;
    let result = (|| -> anyhow::Result<()> {
        let node = common::open_node()?;
        let seen = common::sysfs_u64("bar_size")?;
        ensure!(
            seen == half,
            "vgpu resized the BAR to {half} bytes, fgds sees {seen}"
        );
        // The whole new BAR, read into at its end.
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, half)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, half)?;
        let map = Map::shared(&node, idx, half as usize)?;
        let tail = half as usize - MIB as usize;
        let nvme = common::nvme(false)?;
        let n = common::pread_raw(&nvme, map.at(tail), MIB as usize, 0).context("pread")?;
        ensure!(n == MIB as usize, "short read {n}");
        common::check_nvme_pattern(
            0,
            &common::gpu_read(dmabuf.as_fd(), half as usize, tail, MIB as usize)?,
        )?;
        Ok(())
    })();
    // Back to the BAR the rig gave the GPU, whatever happened.
    let restored = resize(full);
    result?;
    restored?;
    fault::wait_counters_zero("after the case")?;
    let _node = common::open_node()?;
    ensure!(
        common::sysfs_u64("bar_size")? == full,
        "the BAR is not back to {full} bytes"
    );
    fault::data_check(4 * MIB, 44 * MIB).context("after the BAR was restored")?;
    ktap::pass()
}

/// fgds's own pages over the BAR (P2PDMA and GENERIC modes) are made 64 MiB at a time under
/// registrations, not over the whole BAR at the first open (issue 37, point 5): after a
/// rebind, an open makes none (sysfs `pages_made`, and for P2PDMA pages the kernel's own
/// `p2pmem/size`); a registration makes the chunks it covers and no other; a registration
/// across a chunk boundary reads the drive through the mapping and through fgds's command,
/// bytes checked; the unbind releases them all. The exporter's pages: none made, ever.
fn pages_follow_registrations() -> CaseResult {
    const CHUNK: u64 = 64 * MIB;
    fault::require_idle()?;
    let (bdf, drv) = vgpu_driver()?;
    std::fs::write(drv.join("unbind"), &bdf).context("unbind vgpu")?;
    rebind_vgpu(&bdf, &drv)?;
    let p2pmem = std::path::PathBuf::from(format!("/sys/bus/pci/devices/{bdf}/p2pmem/size"));
    let kernel_p2pmem = || -> anyhow::Result<Option<u64>> {
        match std::fs::read_to_string(&p2pmem) {
            Ok(s) => Ok(Some(s.trim().parse().context("p2pmem/size")?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).context("p2pmem/size"),
        }
    };
    let node = common::open_node()?;
    let mode = common::sysfs("mode")?;
    // Found before the unbind, which takes vgpu's node away but not fgds's.
    let made_path = common::sysfs_dir()?.join("pages_made");
    let made = || -> anyhow::Result<u64> {
        let s = std::fs::read_to_string(&made_path).context("pages_made")?;
        s.trim().parse().context("pages_made: not a number")
    };
    ensure!(made()? == 0, "the open made {} bytes of pages", made()?);
    if mode == "p2pdma" {
        let kernel = kernel_p2pmem()?;
        ensure!(
            kernel.is_none_or(|n| n == 0),
            "the open made P2PDMA memory: p2pmem/size {kernel:?}"
        );
    }
    let owned = mode == "p2pdma" || mode == "generic";
    let vgpu = common::vgpu()?;
    let mut want = std::collections::BTreeSet::new();
    let mut cover = |off: u64, len: u64| {
        if owned {
            want.extend(off / CHUNK..(off + len - 1) / CHUNK + 1);
        }
        want.len() as u64 * CHUNK
    };
    let (small, small_off) = common::alloc(&vgpu, 2 * MIB)?;
    let small_idx = common::reg(&node, small.as_fd(), 0, 2 * MIB)?;
    let expect = cover(small_off, 2 * MIB);
    ensure!(
        made()? == expect,
        "{mode}: a 2 MiB registration at BAR offset {small_off:#x} made {} bytes of pages, want {expect}",
        made()?
    );
    // 68 MiB cannot lie inside one 64 MiB chunk.
    let len = CHUNK + 4 * MIB;
    let (big, big_off) = common::alloc(&vgpu, len)?;
    let big_idx = common::reg(&node, big.as_fd(), 0, len)?;
    let expect = cover(big_off, len);
    ensure!(
        made()? == expect,
        "{mode}: after a {len}-byte registration at {big_off:#x}, {} bytes of pages, want {expect}",
        made()?
    );
    if mode == "p2pdma" {
        let kernel = kernel_p2pmem()?;
        ensure!(
            kernel == Some(expect),
            "p2pmem/size {kernel:?}, want {expect}: the kernel's pool does not match fgds's count"
        );
    }
    // 2 MiB each side of the first chunk boundary inside the buffer, through the mapping and
    // through fgds's command; the bytes checked in the GPU's memory.
    let boundary = (big_off / CHUNK + 1) * CHUNK - big_off;
    let at = boundary - 2 * MIB;
    let nvme = common::nvme(false)?;
    let map = Map::shared(&node, big_idx, len as usize)?;
    let n = common::pread_raw(&nvme, map.at(at as usize), 4 * MIB as usize, 0)
        .context("pread into the mapping across a chunk boundary")?;
    ensure!(n == 4 * MIB as usize, "short read {n}");
    common::check_nvme_pattern(
        0,
        &common::gpu_read(big.as_fd(), len as usize, at as usize, 4 * MIB as usize)?,
    )
    .context("through the mapping")?;
    let arg = fgds::uapi::Io {
        idx: big_idx,
        offset: at,
        len: 4 * MIB,
        file_offset: 8 * MIB,
        fd: nvme.as_raw_fd(),
        flags: 0,
    };
    let n = common::ioctl_io(&node, false, &arg)
        .map_err(|e| anyhow::anyhow!("FGDS_IOCTL_READ across a chunk boundary: errno {e}"))?;
    ensure!(n == 4 * MIB as usize, "short FGDS_IOCTL_READ {n}");
    common::check_nvme_pattern(
        8 * MIB,
        &common::gpu_read(big.as_fd(), len as usize, at as usize, 4 * MIB as usize)?,
    )
    .context("through FGDS_IOCTL_READ")?;
    drop(map);
    common::unreg(&node, big_idx).context("unreg")?;
    common::unreg(&node, small_idx).context("unreg")?;
    ensure!(
        made()? == expect,
        "pages went with a registration ({} bytes left, {expect} made): they stay until unbind",
        made()?
    );
    drop((node, small, big));
    fault::wait_counters_zero("after the registrations")?;
    std::fs::write(drv.join("unbind"), &bdf).context("unbind vgpu")?;
    let after = made();
    let kernel = kernel_p2pmem()?;
    rebind_vgpu(&bdf, &drv)?;
    ensure!(after? == 0, "the unbind left pages made");
    ensure!(
        kernel.is_none_or(|n| n == 0),
        "the unbind left P2PDMA memory: p2pmem/size {kernel:?}"
    );
    ktap::pass()
}

/// Found by the fuzzer (docs/fuzzing.md): two registrations of the same memory, reads running
/// through one, the other's UNREG racing the exporter's invalidation. The released
/// registration found its pages quiet and gave up the reservation lock before it gave back its
/// page references; an invalidation in that window saw the pages busy (the other
/// registration's reads), put the registration on the pending list, and its cleanup ran after
/// the free (KASAN: slab-use-after-free in fgds_fence_retire_locked). Rounds, the UNREG a
/// little later against the revocation each round, until both orders happened (the UNREG done
/// before the revocation began, and begun after it ended) and some rounds overlapped, within a
/// bound; the verdict is the kernel's (a splat fails the program) and the counters at the end.
fn unreg_racing_an_invalidation_with_pages_shared() -> CaseResult {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    const LEN: u64 = 256 * 1024;
    const MIN_ROUNDS: u32 = 120;
    const ROUNDS: u32 = 600;
    const BUDGET: Duration = Duration::from_secs(40);
    fault::require_idle()?;
    // On kernels with fault injection, fgds widens the window the bug needed (between the
    // UNREG's unlock and the free) to 2 ms, so that a revocation sweeping across it lands
    // there in many rounds, not by chance.
    let window = fault::Window::set("race_window_us", 2000)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let started = Instant::now();
    let mut rounds = 0;
    let mut reads = 0;
    // Rounds where the UNREG ended before the revocation began, began after it ended, or
    // neither (the two overlapped: the window the bug needed).
    let (mut before, mut after, mut overlapped) = (0u32, 0u32, 0u32);
    // Rounds where the revocation began while the UNREG ran: with the race window, inside it.
    let mut during = 0u32;
    let mut longest_revocation = Duration::ZERO;
    let windowed = window.is_some();
    let seen_both =
        |b: u32, a: u32, o: u32, d: u32| b > 0 && a > 0 && o > 0 && (!windowed || d > 0);
    while rounds < ROUNDS
        && started.elapsed() < BUDGET
        && (rounds < MIN_ROUNDS || !seen_both(before, after, overlapped, during))
    {
        rounds += 1;
        let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
        let busy = common::reg(&node, dmabuf.as_fd(), 0, LEN).context("REG of the busy one")?;
        let map = Map::shared(&node, busy, LEN as usize)?;
        let other = common::reg(&node, dmabuf.as_fd(), 0, LEN).context("REG of the other")?;
        let stop = Arc::new(AtomicBool::new(false));
        // One reader: its pages are busy most of the time, quiet between reads.
        let readers: Vec<_> = (0..1)
            .map(|i| {
                let (ptr, stop) = (map.ptr as usize, stop.clone());
                std::thread::spawn(move || -> anyhow::Result<u32> {
                    let nvme = common::nvme(false)?;
                    let mut n = 0;
                    let half = LEN as usize / 2;
                    while !stop.load(Ordering::Relaxed) {
                        let at = (ptr + i * half) as *mut u8;
                        match common::pread_raw(&nvme, at, half, 0) {
                            Ok(_) => n += 1,
                            Err(Errno::FAULT) => break,
                            Err(e) => bail!("a read through the busy registration: {e}"),
                        }
                    }
                    Ok(n)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(5));
        // Every other round the UNREG starts first and the revocation follows it; the second
        // starts a little later each time: 80 steps up to the longest revocation seen so far
        // and half again (at least 4 ms), past a revocation that waits for a read in flight
        // (tens of ms under KASAN on a busy host).
        let unreg_first = rounds % 2 == 1;
        let span = (longest_revocation * 3 / 2)
            .clamp(Duration::from_millis(4), Duration::from_millis(200));
        let delay = span * ((rounds / 2) % 80) / 80;
        let spin = |d: Duration| {
            let from = Instant::now();
            while from.elapsed() < d {
                std::hint::spin_loop();
            }
        };
        let timed_unreg = || {
            let began = Instant::now();
            (common::unreg(&node, other), began, Instant::now())
        };
        let timed_revoke = || {
            let began = Instant::now();
            common::revoke(bar_off).map(|()| (began, Instant::now()))
        };
        let ((unreg, unreg_began, unreg_ended), revoked) = std::thread::scope(|scope| {
            if unreg_first {
                let unreg = scope.spawn(timed_unreg);
                spin(delay);
                let revoked = timed_revoke();
                (unreg.join().expect("UNREG thread"), revoked)
            } else {
                let revoke = scope.spawn(timed_revoke);
                spin(delay);
                let unreg = timed_unreg();
                (unreg, revoke.join().expect("revoke thread"))
            }
        });
        let (revoke_began, revoke_ended) = revoked.context("revoke")?;
        longest_revocation = longest_revocation.max(revoke_ended - revoke_began);
        if revoke_began > unreg_began && revoke_began < unreg_ended {
            during += 1;
        }
        if unreg_ended < revoke_began {
            before += 1;
        } else if unreg_began > revoke_ended {
            after += 1;
        } else {
            overlapped += 1;
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            reads += fault::join(r, "read")??;
        }
        ensure!(unreg.is_ok(), "UNREG of the other registration: {unreg:?}");
        common::unreg(&node, busy).context("UNREG of the busy one")?;
        drop(map);
    }
    ktap::diag(format_args!(
        "{rounds} rounds, {reads} reads through the busy registration; the UNREG ended before \
         the revocation began in {before}, began after it ended in {after}, overlapped it in \
         {overlapped}; the revocation began while the UNREG ran in {during}; the longest \
         revocation took {longest_revocation:?}"
    ));
    // A race proves something only if it went both ways, and through the window between.
    ensure!(
        seen_both(before, after, overlapped, during),
        "in {rounds} rounds the UNREG never came on both sides of the revocation and across it \
         ({before} before, {after} after, {overlapped} overlapping, {during} with the \
         revocation beginning during the UNREG{})",
        if windowed {
            ", which the race window needs"
        } else {
            ""
        }
    );
    drop(node);
    fault::wait_counters_zero("after the races")?;
    fault::wait_vgpu_buffers_gone("after the races: fgds let every buffer go")?;
    ktap::pass()
}

/// UNREG of a registration that fgds's own reads used (its `users` switched on), racing a
/// vgpu revocation: swept across the revocation's start, so that the invalidation often waits
/// for the reservation lock UNREG holds and runs the moment UNREG lets it go, before the
/// registration is freed. An invalidation of a released registration must not kill its
/// `users`: the kill's RCU callback would run after the free (the fuzzer found it:
/// `percpu_ref_exit()` warning of a switch in progress, then KASAN's use-after-free in
/// `rcu_cblist_dequeue()`).
fn unreg_of_a_used_registration_racing_an_invalidation() -> CaseResult {
    const LEN: u64 = 64 * 1024;
    const ROUNDS: u32 = 400;
    const BUDGET: Duration = Duration::from_secs(20);
    fault::require_idle()?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    let started = Instant::now();
    let (mut rounds, mut revoked_first) = (0, 0);
    while rounds < ROUNDS && started.elapsed() < BUDGET {
        rounds += 1;
        let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN).context("REG")?;
        let arg = fgds::uapi::Io {
            idx,
            offset: 0,
            len: PAGE,
            file_offset: 0,
            fd: nvme.as_raw_fd(),
            flags: 0,
        };
        let n = common::ioctl_io(&node, false, &arg)
            .map_err(|e| anyhow::format_err!("FGDS_IOCTL_READ: errno {e}"))?;
        ensure!(
            n as u64 == PAGE,
            "FGDS_IOCTL_READ moved {n} of {PAGE} bytes"
        );
        let revoker = revoke_in_thread(bar_off);
        let spin = Instant::now();
        while spin.elapsed() < Duration::from_micros(u64::from(rounds % 40) * 25) {
            std::hint::spin_loop();
        }
        // A call after the revocation gets ENODEV: which came first.
        if common::ioctl_io(&node, false, &arg) == Err(libc::ENODEV) {
            revoked_first += 1;
        }
        let unreg = common::unreg(&node, idx);
        fault::join(revoker, "revoked")?.context("revoke")?;
        ensure!(unreg.is_ok(), "UNREG of a live token: {unreg:?}");
    }
    ktap::diag(format_args!(
        "{rounds} rounds, the revocation first in {revoked_first}"
    ));
    // A race proves something only if it went both ways.
    ensure!(
        revoked_first > 0 && revoked_first < rounds,
        "in {rounds} rounds the revocation came first {revoked_first} times: the sweep never \
         put the UNREG on both sides of it"
    );
    drop(node);
    fault::wait_counters_zero("after the races")?;
    fault::wait_vgpu_buffers_gone("after the races: fgds let every buffer go")?;
    ktap::pass()
}

/// A pipe: (read end, write end).
fn pipe() -> anyhow::Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two new descriptors into the array.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors are new and owned by nothing else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}
