//! Issue 7 (e): the kernel's own failure injection (failslab, fail_page_alloc,
//! fail_make_request on the NVMe disk), scoped to the test's task with `fail-nth`, during
//! REG_BUFFER (with and without setting the page provider up), mmap and the page faults of a
//! mapping (CPU access, and GUP from a read), and direct I/O both ways.
//!
//! Each case walks the fault points of one operation: it makes the 1st, 2nd, ... fault point
//! the operation reaches fail (every allocation of the task and every bio of the NVMe disk
//! counts), until the operation runs without reaching the n-th one. After every injected
//! failure the operation returned a plain errno (or, for a CPU access, retried the fault) and
//! left nothing behind: fgds's counters and the exporter's pin count are as before, the same
//! operation without injection works and the data is right. No kernel splat (the rig checks
//! the console), and the rig's kmemleak scan after the suite finds no leak.
//!
//! Needs a kernel with fault-injection debugfs (`build:X.Y+debug`); elsewhere every case skips.

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fgds_tests::guest::{self, AlignedBuf};
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

const DEBUGFS: &str = "/sys/kernel/debug";
/// Fault points walked per case at most (a walk that gets there stops and says so).
const MAX_POINTS: u32 = 400;
const LEN: u64 = MIB;
/// NVMe scratch for the write case.
const SCRATCH: u64 = 160 * MIB;

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "reg_under_fault_injection",
            run: reg_case,
        },
        Case {
            name: "provider_setup_under_fault_injection",
            run: provider_case,
        },
        Case {
            name: "mmap_and_cpu_fault_under_fault_injection",
            run: mmap_fault_case,
        },
        Case {
            name: "gup_fault_and_read_under_fault_injection",
            run: gup_read_case,
        },
        Case {
            name: "write_under_fault_injection",
            run: write_case,
        },
        Case {
            name: "revocation_under_fault_injection",
            run: revocation_case,
        },
    ])
}

/// The fault-injection setup, undone on drop: failslab and fail_page_alloc count every
/// allocation (sleeping ones and order 0 included), fail_make_request every bio of the NVMe
/// disk; nothing fails by probability (task-filter on, no task has make-it-fail), only through
/// this thread's `fail-nth`.
struct Injection {
    saved: Vec<(PathBuf, String)>,
    nth: File,
}

impl Injection {
    /// Err, with the reason, where the kernel has no fault-injection debugfs. Without
    /// `page_alloc`, fail_page_alloc counts nothing (min-order above the largest order).
    fn new(page_alloc: bool) -> anyhow::Result<Result<Injection, String>> {
        let attrs = ["failslab", "fail_page_alloc", "fail_make_request"];
        let missing = attrs
            .iter()
            .filter(|a| !Path::new(DEBUGFS).join(a).is_dir())
            .collect::<Vec<_>>();
        if !missing.is_empty() {
            let missing = missing.iter().map(|a| a.to_string()).collect::<Vec<_>>();
            return Ok(Err(format!(
                "no fault-injection debugfs ({DEBUGFS}/{{{}}} missing: the kernel lacks \
                 CONFIG_FAULT_INJECTION_DEBUG_FS with FAILSLAB, FAIL_PAGE_ALLOC and \
                 FAIL_MAKE_REQUEST; the build:X.Y+debug kernels have them)",
                missing.join(",")
            )));
        }
        let disk = guest::nvme_path()?;
        let disk = disk.file_name().context("FGDS_NVME")?.to_owned();
        let mut settings: Vec<(PathBuf, &str)> = Vec::new();
        for a in attrs {
            let dir = Path::new(DEBUGFS).join(a);
            settings.push((dir.join("task-filter"), "Y"));
            settings.push((dir.join("probability"), "100"));
            settings.push((dir.join("verbose"), "0"));
        }
        for a in ["failslab", "fail_page_alloc"] {
            settings.push((Path::new(DEBUGFS).join(a).join("ignore-gfp-wait"), "N"));
        }
        let fpa = Path::new(DEBUGFS).join("fail_page_alloc");
        settings.push((fpa.join("ignore-gfp-highmem"), "N"));
        settings.push((fpa.join("min-order"), if page_alloc { "0" } else { "99" }));
        settings.push((
            Path::new("/sys/block").join(&disk).join("make-it-fail"),
            "1",
        ));
        let mut inj = Injection {
            saved: Vec::new(),
            nth: OpenOptions::new()
                .read(true)
                .write(true)
                .open("/proc/thread-self/fail-nth")
                .context("cannot open /proc/thread-self/fail-nth")?,
        };
        for (path, value) in settings {
            let old = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            std::fs::write(&path, value)
                .with_context(|| format!("cannot write {value} to {}", path.display()))?;
            inj.saved.push((path, old.trim().to_owned()));
        }
        Ok(Ok(inj))
    }

    /// Makes the n-th fault point this thread reaches fail.
    fn arm(&self, n: u32) -> anyhow::Result<()> {
        self.nth
            .write_at(n.to_string().as_bytes(), 0)
            .context("writing fail-nth")?;
        Ok(())
    }

    /// Stops injecting; returns whether the armed failure was injected.
    fn disarm(&self) -> anyhow::Result<bool> {
        let mut buf = [0u8; 16];
        let n = self.nth.read_at(&mut buf, 0).context("reading fail-nth")?;
        let left = std::str::from_utf8(&buf[..n])?.trim().parse::<u32>()?;
        self.nth.write_at(b"0", 0).context("clearing fail-nth")?;
        Ok(left == 0)
    }
}

impl Drop for Injection {
    fn drop(&mut self) {
        let _ = self.nth.write_at(b"0", 0);
        for (path, old) in self.saved.iter().rev() {
            let _ = std::fs::write(path, old);
        }
    }
}

/// Runs `op` with the n-th fault point of this thread armed; returns whether the failure was
/// injected and the errno `op` returned, if any.
fn armed(
    inj: &Injection,
    n: u32,
    op: impl FnOnce() -> anyhow::Result<Option<Errno>>,
) -> anyhow::Result<(bool, Option<Errno>)> {
    inj.arm(n)?;
    let res = op();
    let injected = inj.disarm()?;
    Ok((injected, res?))
}

/// Walks the fault points of an operation: `step(n)` runs it with the n-th point armed and
/// returns (injected, errno); `check` then runs without injection. Stops when a step ran
/// without reaching its n-th point. Returns the number of points walked.
fn walk(
    mut step: impl FnMut(u32) -> anyhow::Result<(bool, Option<Errno>)>,
    mut check: impl FnMut(u32, Option<Errno>) -> anyhow::Result<()>,
) -> anyhow::Result<u32> {
    let mut outcomes = std::collections::BTreeMap::<String, u32>::new();
    let start = Instant::now();
    for n in 1..=MAX_POINTS {
        let (injected, res) = step(n).with_context(|| format!("fault point {n}"))?;
        if !injected {
            ensure!(
                res.is_none(),
                "without an injected failure (all {} points passed) the operation failed: {res:?}",
                n - 1
            );
            ktap::diag(format_args!(
                "{} fault points in {:?}; outcomes {outcomes:?}",
                n - 1,
                start.elapsed()
            ));
            return Ok(n - 1);
        }
        *outcomes
            .entry(res.map_or("ok".to_owned(), |e| {
                std::io::Error::from_raw_os_error(e.raw_os_error()).to_string()
            }))
            .or_default() += 1;
        check(n, res).with_context(|| format!("after an injected failure at point {n}"))?;
    }
    ktap::diag(format_args!(
        "stopped after {MAX_POINTS} fault points ({:?}); outcomes {outcomes:?}",
        start.elapsed()
    ));
    Ok(MAX_POINTS)
}

fn setup_or_skip() -> anyhow::Result<Result<Injection, String>> {
    fault::require_idle()?;
    Injection::new(true)
}

/// vgpu's pin count of its buffer at `bar_off` (0 if it lists none there).
fn pins(bar_off: u64) -> anyhow::Result<u32> {
    Ok(fault::vgpu_buffers()?
        .into_iter()
        .find(|b| b.0 == bar_off)
        .map_or(0, |b| b.2))
}

/// After a REG that may have failed: nothing of it is left when it failed, and a REG without
/// injection works (a transient failure must not be remembered as a refusal).
fn check_reg_outcome(
    node: &File,
    dmabuf: BorrowedFd<'_>,
    bar_off: u64,
    res: Option<Errno>,
) -> anyhow::Result<()> {
    if let Some(e) = res {
        ensure!(
            !matches!(e, Errno::OPNOTSUPP | Errno::BUSY),
            "REG_BUFFER failed with {e:?}, a refusal, for an allocation failure (mode {})",
            common::sysfs("mode").unwrap_or_default()
        );
        ensure!(
            fault::counters()? == (0, 0),
            "a failed REG_BUFFER left counters {:?}",
            fault::counters()?
        );
        ensure!(
            pins(bar_off)? == 0,
            "a failed REG_BUFFER left the dma-buf pinned ({} pins)",
            pins(bar_off)?
        );
    }
    let idx = common::reg(node, dmabuf, 0, LEN).context("REG_BUFFER without injection")?;
    common::unreg(node, idx)?;
    fault::wait_counters_zero("after UNREG")?;
    Ok(())
}

/// REG_BUFFER, then UNREG_BUFFER (not injected) if it worked.
fn reg_once(node: &File, dmabuf: BorrowedFd<'_>) -> anyhow::Result<Option<Errno>> {
    match common::reg(node, dmabuf, 0, LEN) {
        Ok(idx) => {
            common::unreg(node, idx)?;
            Ok(None)
        }
        Err(e) => Ok(Some(e)),
    }
}

fn reg_case() -> CaseResult {
    let inj = match setup_or_skip()? {
        Ok(inj) => inj,
        Err(reason) => return ktap::skip(reason),
    };
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    // The provider is set up (by the open, else this registration) outside the injection.
    common::unreg(&node, common::reg(&node, dmabuf.as_fd(), 0, LEN)?)?;
    let points = walk(
        |n| armed(&inj, n, || reg_once(&node, dmabuf.as_fd())),
        |_, res| check_reg_outcome(&node, dmabuf.as_fd(), bar_off, res),
    )?;
    ensure!(points > 0, "REG_BUFFER reached no fault point");
    ktap::pass()
}

/// New kernel log lines, read from /dev/kmsg.
struct Kmsg(File);

impl Kmsg {
    /// Positioned at the end of the log.
    fn open() -> anyhow::Result<Kmsg> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open("/dev/kmsg")
            .context("cannot open /dev/kmsg")?;
        rustix::fs::seek(&f, rustix::fs::SeekFrom::End(0))?;
        Ok(Kmsg(f))
    }

    /// The messages logged since the last call.
    fn new_lines(&mut self) -> Vec<String> {
        use std::io::Read;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 8192];
        loop {
            match self.0.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    let rec = String::from_utf8_lossy(&buf[..n]);
                    let msg = rec.split_once(';').map_or(&*rec, |(_, m)| m);
                    out.push(msg.lines().next().unwrap_or("").to_owned());
                }
                // EPIPE: records were overwritten; go on with the next ones.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
                Err(_) => break,
            }
        }
        out
    }
}

/// The first open of the node after fgds is loaded sets the page provider up (GENERIC pages or
/// P2PDMA pages over the whole BAR), and a REG_BUFFER tries again where that failed: each step
/// loads fgds afresh (not injected), then opens the node and registers under the injection.
///
/// The walk covers fgds's own fault points of the setup (the import, the BAR's write-combine
/// reservation, the devres group) and stops at the first failure injected inside the kernel's
/// pci_p2pdma_add_resource() or memremap_pages() (fgds logs that they failed). Past that
/// point only the kernel's memory hotplug is exercised, and on 6.12 it does not survive
/// allocation failures: x86's init_memory_mapping() does not check alloc_low_page() for NULL
/// after boot (arch/x86/mm/init_64.c, phys_p4d/pud/pmd_init: an oops), add_pages()
/// WARNs when __add_pages() fails, and memremap_pages() does not remove the sections it added,
/// so the BAR's range answers EEXIST until reboot. Hence slab failures only here, and the stop.
fn provider_case() -> CaseResult {
    fault::require_idle()?;
    let inj = match Injection::new(false)? {
        Ok(inj) => inj,
        Err(reason) => return ktap::skip(reason),
    };
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    let node = std::cell::RefCell::new(None::<File>);
    let kmsg = std::cell::RefCell::new(Kmsg::open()?);
    let mut inside_kernel = None;
    let fresh = || -> anyhow::Result<()> {
        node.borrow_mut().take();
        fault::unload_fgds()?;
        fault::load_fgds_and_wait_node()?;
        ensure!(
            common::sysfs("mode")? == "none",
            "a fresh fgds has a provider"
        );
        Ok(())
    };
    // Opens the node and registers; an open that fails leaves no node, and the check opens one.
    let open_and_reg = |path: &Path| -> anyhow::Result<Option<Errno>> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => file,
            Err(e) => {
                let errno = Errno::from_io_error(&e);
                return Ok(Some(
                    errno.with_context(|| format!("opening {}: {e}", path.display()))?,
                ));
            }
        };
        let res = reg_once(&file, dmabuf.as_fd());
        *node.borrow_mut() = Some(file);
        res
    };
    let result = walk(
        |n| {
            fresh()?;
            kmsg.borrow_mut().new_lines();
            // Looked up before the injection: only the open and the registration run under it.
            let path = common::node_path()?;
            let (injected, res) = armed(&inj, n, || open_and_reg(&path))?;
            if node.borrow().is_none() {
                *node.borrow_mut() = Some(common::open_node()?);
            }
            let node = node.borrow();
            let node = node.as_ref().context("no node")?;
            let lines = kmsg.borrow_mut().new_lines();
            if let Some(line) = lines.iter().find(|l| {
                l.contains("cannot register P2PDMA pages") || l.contains("memremap_pages of BAR")
            }) {
                inside_kernel = Some((n, line.clone()));
                // End the walk here: report "not injected" after checking this step.
                check_reg_outcome(node, dmabuf.as_fd(), bar_off, res)?;
                return Ok((false, None));
            }
            Ok((injected, res))
        },
        |_, res| {
            let node = node.borrow();
            let node = node.as_ref().context("no node")?;
            check_reg_outcome(node, dmabuf.as_fd(), bar_off, res)?;
            ensure!(
                common::sysfs("mode")? != "none",
                "no provider after a successful registration"
            );
            Ok(())
        },
    );
    node.borrow_mut().take();
    if let Some((n, line)) = &inside_kernel {
        ktap::diag(format_args!(
            "stopped at point {n}, the first inside the kernel's P2PDMA/memremap_pages: {line}"
        ));
    }
    // fgds stays loaded whatever happened.
    if !Path::new("/sys/module/fgds").exists() {
        fault::load_fgds_and_wait_node()?;
    }
    ensure!(
        result? > 0,
        "setting the provider up reached no fault point"
    );
    ktap::pass()
}

/// Exit codes of the mmap child.
const CHILD_OK: i32 = 0;
const CHILD_INJECTED: i32 = 1;
const CHILD_MMAP_FAILED: i32 = 2;

/// In a child (fail-nth is per task): arms point n, maps the registration and touches a page
/// at its start and one in its middle, so the fault handler maps them.
fn mmap_child(node: &File, idx: u64, n: u32) -> i32 {
    let run = || -> anyhow::Result<i32> {
        let nth = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/thread-self/fail-nth")?;
        nth.write_at(n.to_string().as_bytes(), 0)?;
        let map = Map::new(node, idx, LEN as usize, libc::MAP_SHARED);
        if let Ok(map) = &map {
            for off in [0, LEN as usize / 2] {
                // SAFETY: a write inside our live mapping (this child's copy).
                unsafe { std::ptr::write_volatile(map.at(off), 0x5a) };
            }
        }
        let mut buf = [0u8; 16];
        let len = nth.read_at(&mut buf, 0)?;
        let left = std::str::from_utf8(&buf[..len])?.trim().parse::<u32>()?;
        nth.write_at(b"0", 0)?;
        let mapped = map.is_ok();
        drop(map);
        Ok(match (left == 0, mapped) {
            (false, true) => CHILD_OK,
            (true, true) => CHILD_INJECTED,
            (true, false) => CHILD_MMAP_FAILED,
            (false, false) => 3,
        })
    };
    run().unwrap_or(4)
}

fn mmap_fault_case() -> CaseResult {
    let _inj = match setup_or_skip()? {
        Ok(inj) => inj,
        Err(reason) => return ktap::skip(reason),
    };
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let nvme = common::nvme(false)?;
    let points = walk(
        |n| {
            let status = common::in_child(|| mmap_child(&node, idx, n))?;
            match status {
                CHILD_OK => Ok((false, None)),
                CHILD_INJECTED => Ok((true, None)),
                // mmap(2) failed: the child does not know the errno; ENOMEM is what it can be.
                CHILD_MMAP_FAILED => Ok((true, Some(Errno::NOMEM))),
                s if s == 128 + libc::SIGBUS => {
                    bail!("a CPU access got SIGBUS after an injected allocation failure")
                }
                s => bail!("the child ended with status {s}"),
            }
        },
        |_, _| {
            // The registration is intact: map it again, read into it, check.
            ensure!(
                fault::counters()? == (1, LEN),
                "counters {:?}",
                fault::counters()?
            );
            let map = Map::shared(&node, idx, LEN as usize)?;
            common::pread_raw(&nvme, map.ptr, LEN as usize, 2 * MIB)?;
            common::check_nvme_pattern(2 * MIB, &fault::read_mapping(&map))
        },
    )?;
    ensure!(points > 0, "mmap and its faults reached no fault point");
    common::unreg(&node, idx)?;
    ktap::pass()
}

/// One pread or pwrite system call between the drive and `ptr`: the errno, if it failed.
fn one_io(write: bool, file: &File, ptr: *mut u8, len: u64, off: u64) -> Option<Errno> {
    use std::os::fd::AsRawFd;
    // SAFETY: `ptr` is a live fgds mapping of at least `len` bytes; the kernel only DMAs.
    let n = unsafe {
        if write {
            libc::pwrite(file.as_raw_fd(), ptr.cast(), len as usize, off as i64)
        } else {
            libc::pread(file.as_raw_fd(), ptr.cast(), len as usize, off as i64)
        }
    };
    if n < 0 {
        Some(Errno::from_raw_os_error(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        ))
    } else if n as u64 != len {
        Some(Errno::RANGE) // a short transfer; never expected from a block device here
    } else {
        None
    }
}

/// A transient failure must never look like a revocation (EFAULT) or a short transfer.
fn io_errno_ok(e: Errno) -> bool {
    !matches!(e, Errno::FAULT | Errno::RANGE)
}

fn gup_read_case() -> CaseResult {
    let inj = match setup_or_skip()? {
        Ok(inj) => inj,
        Err(reason) => return ktap::skip(reason),
    };
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let nvme = common::nvme(false)?;
    let off = |n: u32| (u64::from(n) % 60) * MIB;
    let points = walk(
        |n| {
            // A fresh mapping each time: the read's GUP faults its pages in.
            let map = Map::shared(&node, idx, LEN as usize)?;
            let off = off(n);
            common::gpu_fill(dmabuf.as_fd(), LEN as usize, 0)?;
            armed(&inj, n, || Ok(one_io(false, &nvme, map.ptr, LEN, off)))
        },
        |n, res| {
            let off = off(n);
            if let Some(e) = res {
                ensure!(io_errno_ok(e), "pread failed with {e:?}");
            }
            let map = Map::shared(&node, idx, LEN as usize)?;
            if let Some(e) = one_io(false, &nvme, map.ptr, LEN, off) {
                bail!("pread without injection failed: {e:?}");
            }
            common::check_nvme_pattern(
                off,
                &common::gpu_read(dmabuf.as_fd(), LEN as usize, 0, LEN as usize)?,
            )
        },
    )?;
    ensure!(points > 0, "the read reached no fault point");
    common::unreg(&node, idx)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

fn write_case() -> CaseResult {
    let inj = match setup_or_skip()? {
        Ok(inj) => inj,
        Err(reason) => return ktap::skip(reason),
    };
    let seed = 0x494e_4a57;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let mut data = vec![0u8; LEN as usize];
    fgds_tests::pattern::fill(seed, 0, &mut data);
    common::gpu_write(dmabuf.as_fd(), LEN as usize, 0, &data)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
    let map = Map::shared(&node, idx, LEN as usize)?;
    let nvme = common::nvme(true)?;
    // Fault the mapping in first: this case is about the I/O.
    let _ = fault::read_mapping(&map);
    let zero = AlignedBuf::new(LEN as usize)?;
    let mut ram = AlignedBuf::new(LEN as usize)?;
    let points = walk(
        |n| {
            nvme.write_all_at(zero.as_slice(), SCRATCH)?;
            armed(&inj, n, || Ok(one_io(true, &nvme, map.ptr, LEN, SCRATCH)))
        },
        |_, res| {
            if let Some(e) = res {
                ensure!(io_errno_ok(e), "pwrite failed with {e:?}");
            }
            if let Some(e) = one_io(true, &nvme, map.ptr, LEN, SCRATCH) {
                bail!("pwrite without injection failed: {e:?}");
            }
            nvme.read_exact_at(ram.as_mut_slice(), SCRATCH)?;
            if let Some(at) = fgds_tests::pattern::first_mismatch(seed, 0, ram.as_slice()) {
                bail!("byte {at} written from GPU memory differs on the drive");
            }
            Ok(())
        },
    )?;
    ensure!(points > 0, "the write reached no fault point");
    let got = common::gpu_read(dmabuf.as_fd(), LEN as usize, 0, LEN as usize)?;
    ensure!(
        fgds_tests::pattern::first_mismatch(seed, 0, &got).is_none(),
        "GPU memory changed by writes from it"
    );
    drop(map);
    common::unreg(&node, idx)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// The blkdebug tag of the revocation case's held read.
const REVOKE_TAG: &str = "fgds_inject_revoke";
/// How long each step of the revocation case holds its read.
const REVOKE_HOLD: Duration = Duration::from_millis(400);

/// A vgpu revocation (the exporter's invalidation under its reservation lock, then its wait for
/// fences) of a buffer whose registration has an `FGDS_IOCTL_READ` held in flight, with the
/// n-th allocation of the revoking thread failed: a failure before the invalidation (the
/// sysfs write's buffer) fails the write and revokes nothing; one inside fgds's invalidation
/// (the reservation slot for its fence) is retried there, logged, and the revocation completes
/// as without it: the invalidation returns without waiting for the read, the fence signals
/// only after the read ended, and nothing of the read lands once vgpu reuses the memory. The
/// walk must reach fgds's reservation at least once.
fn revocation_case() -> CaseResult {
    // Slab failures only: page allocations (slab refills) would make the count of points
    // before fgds's reservation vary from one revocation to the next.
    fault::require_idle()?;
    let inj = match Injection::new(false)? {
        Ok(inj) => inj,
        Err(reason) => return ktap::skip(reason),
    };
    const LEN: u64 = MIB;
    let revoke_path = format!("/sys/class/vgpu/{}/revoke", common::vgpu_name()?);
    let mut kmsg = Kmsg::open()?;
    let mut reserved_retry = false;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    fault::write_nvme_pattern(0x5245_564b, LEN as usize, SCRATCH)?;
    let points = walk(
        |n| {
            let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
            fault::vgpu_fill(bar_off, LEN, 0x5345_4e54)?;
            let idx = common::reg(&node, dmabuf.as_fd(), 0, LEN)?;
            let bp = common::Breakpoint::arm(REVOKE_TAG)?;
            let reader = {
                let node = node.try_clone()?;
                let arg = fgds::uapi::Io {
                    idx,
                    offset: 0,
                    len: LEN,
                    file_offset: SCRATCH,
                    fd: std::os::fd::AsRawFd::as_raw_fd(&nvme),
                    flags: 0,
                };
                std::thread::spawn(move || common::ioctl_io(&node, false, &arg))
            };
            std::thread::sleep(Duration::from_millis(200));
            ensure!(
                !reader.is_finished(),
                "the read was not held by the breakpoint"
            );
            let started = Instant::now();
            let resumer = std::thread::spawn(move || {
                std::thread::sleep(REVOKE_HOLD);
                bp.resume()
            });
            // Opened first: only the write (the revocation itself) is injected.
            let mut attr = OpenOptions::new()
                .write(true)
                .open(&revoke_path)
                .with_context(|| format!("open {revoke_path}"))?;
            let (injected, res) = armed(&inj, n, || {
                use std::io::Write;
                Ok(attr
                    .write_all(bar_off.to_string().as_bytes())
                    .err()
                    .map(|e| Errno::from_raw_os_error(e.raw_os_error().unwrap_or(libc::EIO))))
            })?;
            drop(attr);
            let resumed = REVOKE_HOLD;
            fault::join(resumer, "resume")?.context("resume the held read")?;
            let read = fault::join(reader, "read")?;
            if res.is_none() {
                // Revoked: exactly as without injection.
                fault::check_held_revocation(bar_off, resumed, read)?;
                fault::reuse_and_check(bar_off, LEN, 0x5345_4e54)?;
            } else {
                // Nothing was revoked: the registration still works; revoke it for real.
                ensure!(read == Ok(LEN as usize), "the held read gave {read:?}");
                common::revoke(bar_off)?;
            }
            ktap::diag(format_args!(
                "point {n}: {res:?} after {:?}",
                started.elapsed()
            ));
            drop(dmabuf);
            common::unreg(&node, idx)?;
            if kmsg
                .new_lines()
                .iter()
                .any(|l| l.contains("no memory for the revocation fence"))
            {
                reserved_retry = true;
            }
            Ok((injected, res))
        },
        |_, res| {
            ensure!(
                res.is_none() || res == Some(Errno::NOMEM),
                "the revocation failed with {res:?}, want success or ENOMEM"
            );
            Ok(())
        },
    )?;
    ensure!(
        reserved_retry,
        "none of the {points} failed allocations reached fgds's reservation of a fence slot"
    );
    drop((node, vgpu, nvme));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}
