//! Helpers for the fault-injection programs (`fgds_fault_*`, issue 7): waiting for the driver
//! to settle, its counters, unloading and loading fgds, children that hold resources, and the
//! host's fault log.

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use rustix::io::Errno;

use crate::{common, ctl, guest, ktap};

/// Polls `cond` every 20 ms until it holds; fails with `what` after `timeout`. Returns how long
/// it took.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    loop {
        if cond()? {
            return Ok(start.elapsed());
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// fgds's sysfs counters of the rig's GPU: (buffers, bytes).
pub fn counters() -> anyhow::Result<(u64, u64)> {
    Ok((common::sysfs_u64("buffers")?, common::sysfs_u64("bytes")?))
}

/// Waits (up to 20 s) until the GPU's counters read zero; fails with what they still read.
pub fn wait_counters_zero(after: &str) -> anyhow::Result<Duration> {
    let mut last = (0, 0);
    wait_until(
        &format!("fgds's buffers and bytes to return to 0 {after}"),
        Duration::from_secs(20),
        || {
            last = counters()?;
            Ok(last == (0, 0))
        },
    )
    .with_context(|| format!("buffers {} bytes {} still counted", last.0, last.1))
}

/// Fails unless nothing is registered on the GPU when a case starts.
pub fn require_idle() -> anyhow::Result<()> {
    wait_counters_zero("before the case (another program left registrations?)").map(drop)
}

/// vgpu's live buffers: (bar_offset, size, pins, revoked) per line of its sysfs `buffers`.
pub fn vgpu_buffers() -> anyhow::Result<Vec<(u64, u64, u32, bool)>> {
    let path = format!("/sys/class/vgpu/{}/buffers", common::vgpu_name()?);
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty() && *l != "...") {
        let f = line.split_whitespace().collect::<Vec<_>>();
        if f.len() != 4 {
            bail!("{path}: unexpected line {line:?}");
        }
        out.push((f[0].parse()?, f[1].parse()?, f[2].parse()?, f[3] != "0"));
    }
    Ok(out)
}

/// Waits (up to 20 s) until vgpu has no live buffer: every dma-buf fgds imported was released.
pub fn wait_vgpu_buffers_gone(after: &str) -> anyhow::Result<Duration> {
    let mut last = Vec::new();
    wait_until(
        &format!("vgpu's buffers to be released {after}"),
        Duration::from_secs(20),
        || {
            last = vgpu_buffers()?;
            Ok(last.is_empty())
        },
    )
    .with_context(|| format!("vgpu still has (bar_offset, size, pins, revoked) {last:?}"))
}

/// Records a line in the host's fault log (`faults.log`) with its time.
pub fn host_log(text: &str) -> anyhow::Result<()> {
    ctl::request(&format!("log {text}")).map(drop)
}

/// The fgds module as the init loaded it: (path, parameters).
pub fn fgds_module() -> anyhow::Result<(String, String)> {
    guest::rig_modules()?
        .into_iter()
        .find(|(path, _)| {
            Path::new(path)
                .file_stem()
                .is_some_and(|stem| stem == "fgds")
        })
        .context("the init did not load fgds (/run/fgds/modules)")
}

/// Asks the kernel to unload fgds without waiting (as `rmmod` does).
pub fn try_unload_fgds() -> Result<(), Errno> {
    rustix::system::delete_module(c"fgds", libc::O_NONBLOCK)
}

/// Fails unless unloading fgds is refused (the module is in use) and fgds stays loaded.
pub fn expect_unload_refused(while_what: &str) -> anyhow::Result<()> {
    match try_unload_fgds() {
        Err(Errno::AGAIN) | Err(Errno::BUSY) => {}
        Ok(()) => {
            // Put it back so the rest of the suite runs, then fail.
            let _ = load_fgds();
            bail!("fgds unloaded {while_what}");
        }
        Err(e) => bail!("unloading fgds {while_what}: {e}, want EAGAIN (in use)"),
    }
    if !Path::new("/sys/module/fgds").exists() {
        bail!("/sys/module/fgds vanished after a refused unload {while_what}");
    }
    Ok(())
}

/// Unloads fgds (retrying for up to 10 s while something still closes) and checks that it is
/// gone with every node and class directory.
pub fn unload_fgds() -> anyhow::Result<()> {
    let mut last = Ok(());
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        last = try_unload_fgds();
        if !matches!(last, Err(Errno::AGAIN) | Err(Errno::BUSY)) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    last.map_err(|e| anyhow::anyhow!("cannot unload fgds: {e}"))?;
    if Path::new("/sys/module/fgds").exists() {
        bail!("/sys/module/fgds still exists after unloading fgds");
    }
    if Path::new("/sys/class/fgds").exists() {
        bail!("/sys/class/fgds still exists after unloading fgds");
    }
    let nodes = std::fs::read_dir("/dev")?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("fgds_"))
        .count();
    if nodes != 0 {
        bail!("{nodes} /dev/fgds_* nodes left after unloading fgds");
    }
    Ok(())
}

/// Loads fgds again with the init's parameters.
pub fn load_fgds() -> anyhow::Result<()> {
    let (path, params) = fgds_module()?;
    load_fgds_with(&params)?.with_context(|| format!("cannot load {path} {params}"))
}

/// Loads the init's fgds module with `params` instead of the init's; the outer error is a
/// failure to try, the inner one the kernel's answer.
pub fn load_fgds_with(params: &str) -> anyhow::Result<Result<(), Errno>> {
    let (path, _) = fgds_module()?;
    let file = File::open(&path).with_context(|| format!("cannot open {path}"))?;
    Ok(rustix::system::finit_module(
        &file,
        &CString::new(params)?,
        0,
    ))
}

/// Fails unless one of `messages` contains `text`.
pub fn expect_logged(messages: &[String], text: &str) -> anyhow::Result<()> {
    if messages.iter().any(|m| m.contains(text)) {
        return Ok(());
    }
    bail!(
        "the kernel log does not say {text:?}; it says:\n{}",
        messages.join("\n")
    )
}

/// Loads fgds and waits for the rig GPU's node.
pub fn load_fgds_and_wait_node() -> anyhow::Result<()> {
    load_fgds()?;
    wait_until(
        "the fgds node after loading fgds",
        Duration::from_secs(10),
        || Ok(common::node_path().is_ok()),
    )?;
    Ok(())
}

/// Registers `len` bytes of fresh vgpu memory, reads the NVMe pattern at `nvme_off` into it
/// through fgds and checks it through vgpu's CPU mapping: the node works.
pub fn data_check(len: u64, nvme_off: u64) -> anyhow::Result<()> {
    use std::os::fd::AsFd;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len).context("REG")?;
    let map = common::Map::shared(&node, idx, len as usize)?;
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0xa5)?;
    let nvme = common::nvme(false)?;
    let n = common::pread_raw(&nvme, map.ptr, len as usize, nvme_off).context("pread")?;
    if n != len as usize {
        bail!("short pread: {n} of {len}");
    }
    common::check_nvme_pattern(
        nvme_off,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )
}

/// Copies a live fgds mapping into RAM with volatile 8-byte loads (device memory is never a
/// Rust reference).
pub fn read_mapping(map: &common::Map) -> Vec<u8> {
    let mut out = vec![0u8; map.len / 8 * 8];
    let (from, to) = (map.ptr.cast::<u64>(), out.as_mut_ptr().cast::<u64>());
    // A plain loop over raw words: the rig's unoptimised build runs it at a sixth of the cost
    // of slice iterators.
    let (words, mut i) = (map.len / 8, 0);
    while i < words {
        // SAFETY: `i * 8 + 8 <= map.len`, inside the live mapping, which is page aligned, and
        // inside `out` (written unaligned).
        unsafe { to.add(i).write_unaligned(from.add(i).read_volatile()) };
        i += 1;
    }
    out
}

/// A forked child that runs `body` and reports to the parent over two pipes (the rig's
/// minimal kernels have no AF_UNIX): the body calls `Parent::ready` once it holds what the
/// test needs, then usually blocks in `Parent::wait_released` until the parent lets it go (or
/// kills it).
pub struct Child {
    pub pid: libc::pid_t,
    /// Reads the child's messages.
    from: File,
    /// Releases the child.
    to: File,
}

/// The child's ends of the pipes.
pub struct Parent {
    to: File,
    from: File,
}

impl Parent {
    /// Tells the parent the child is ready, with a short message.
    pub fn ready(&mut self, msg: &str) {
        let _ = self.to.write_all(format!("{msg}\n").as_bytes());
    }

    /// Blocks until the parent releases the child (or goes away).
    pub fn wait_released(&mut self) {
        let mut b = [0u8; 1];
        let _ = self.from.read(&mut b);
    }
}

/// A pipe: (read end, write end), close-on-exec.
fn pipe() -> anyhow::Result<(File, File)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("pipe2: {}", std::io::Error::last_os_error());
    }
    // SAFETY: both fds are new and owned by nothing else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((File::from(r), File::from(w)))
}

impl Child {
    /// Forks; the child runs `body` and exits with its result (0, or 1 after printing the error
    /// as a KTAP diagnostic). Call only while the process is single-threaded.
    pub fn spawn(body: impl FnOnce(&mut Parent) -> anyhow::Result<()>) -> anyhow::Result<Child> {
        let (from_child, to_parent) = pipe()?;
        let (from_parent, to_child) = pipe()?;
        // SAFETY: the test programs fork while single-threaded; the child only runs `body` and
        // leaves with _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            bail!("fork: {}", std::io::Error::last_os_error());
        }
        if pid == 0 {
            drop((from_child, to_child));
            let mut parent = Parent {
                to: to_parent,
                from: from_parent,
            };
            let code = match body(&mut parent) {
                Ok(()) => 0,
                Err(err) => {
                    ktap::diag(format_args!("child: {err:#}"));
                    parent.ready(&format!("error: {err:#}"));
                    1
                }
            };
            // SAFETY: leave the child without running the parent's exit handlers.
            unsafe { libc::_exit(code) };
        }
        drop((to_parent, from_parent));
        Ok(Child {
            pid,
            from: from_child,
            to: to_child,
        })
    }

    /// Waits (up to `timeout`) for the child's ready line; an error line fails.
    pub fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + timeout;
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: std::os::fd::AsRawFd::as_raw_fd(&self.from),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) };
            if n == 0 {
                bail!("no word from the child within {timeout:?}");
            }
            match self.from.read(&mut b) {
                Ok(0) => bail!("the child exited before it was ready"),
                Ok(_) if b[0] == b'\n' => break,
                Ok(_) => line.push(b[0]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => bail!("reading from the child: {e}"),
            }
        }
        let line = String::from_utf8_lossy(&line).into_owned();
        if let Some(err) = line.strip_prefix("error: ") {
            bail!("the child failed: {err}");
        }
        Ok(line)
    }

    /// Lets the child go on (it returns from `Parent::wait_released`).
    pub fn release(&mut self) {
        let _ = self.to.write_all(b"x");
    }

    /// Sends SIGKILL.
    pub fn kill(&self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.pid, libc::SIGKILL) };
    }

    /// Waits for the child; returns its exit code, or 128 + the signal that ended it.
    pub fn wait(self) -> anyhow::Result<i32> {
        common::wait(self.pid)
    }
}

/// Anonymous shared counters (512 of them) the parent and a forked child both see.
pub struct SharedCounter {
    ptr: *mut std::sync::atomic::AtomicU64,
}

impl SharedCounter {
    pub fn new() -> anyhow::Result<SharedCounter> {
        // SAFETY: a new anonymous shared mapping at an address the kernel picks aliases no Rust
        // object; it is page aligned, so an AtomicU64 at its start is aligned.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            bail!("mmap: {}", std::io::Error::last_os_error());
        }
        Ok(SharedCounter { ptr: p.cast() })
    }

    /// Counter `i` (< 512).
    pub fn get(&self, i: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(i < 512);
        // SAFETY: the mapping (4096 bytes, zero-filled) lives as long as self and holds 512
        // aligned AtomicU64; `i` is in bounds.
        unsafe { &*self.ptr.add(i) }
    }
}

impl Drop for SharedCounter {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in new().
        unsafe { libc::munmap(self.ptr.cast(), 4096) };
    }
}

/// The vgpu sysfs directory of the rig's GPU.
pub fn vgpu_sysfs(attr: &str) -> anyhow::Result<String> {
    Ok(format!("/sys/class/vgpu/{}/{attr}", common::vgpu_name()?))
}

/// vgpu fills BAR2 `[off, off + len)` with the rig's pattern of `seed`, as the GPU does when
/// memory goes to its next user.
pub fn vgpu_fill(off: u64, len: u64, seed: u64) -> anyhow::Result<()> {
    let path = vgpu_sysfs("fill")?;
    std::fs::write(&path, format!("{off} {len} {seed}")).with_context(|| format!("write {path}"))
}

/// The latest revocation vgpu made: (bar_offset, invalidation, wait for fences).
pub fn last_revoke() -> anyhow::Result<(u64, Duration, Duration)> {
    let path = vgpu_sysfs("last_revoke")?;
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {path}"))?;
    let f = text
        .split_whitespace()
        .map(str::parse::<u64>)
        .collect::<Result<Vec<_>, _>>()?;
    ensure!(f.len() == 3, "{path}: {text:?}");
    Ok((f[0], Duration::from_nanos(f[1]), Duration::from_nanos(f[2])))
}

/// fgds's `revoke_timeout_ms`, set for as long as this lives.
pub struct RevokeTimeout(String);

impl RevokeTimeout {
    const PATH: &str = "/sys/module/fgds/parameters/revoke_timeout_ms";

    pub fn set(ms: u64) -> anyhow::Result<RevokeTimeout> {
        let old = std::fs::read_to_string(Self::PATH)?.trim().to_owned();
        std::fs::write(Self::PATH, ms.to_string())?;
        Ok(RevokeTimeout(old))
    }
}

impl Drop for RevokeTimeout {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::PATH, &self.0);
    }
}

/// Joins a helper thread of a case; its panic is the case's failure.
pub fn join<T>(handle: std::thread::JoinHandle<T>, what: &str) -> anyhow::Result<T> {
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("the thread that {what} panicked"))
}

/// Puts `seed`'s pattern on `len` bytes of the drive at `nvme_off`.
pub fn write_nvme_pattern(seed: u64, len: usize, nvme_off: u64) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;

    let nvme = common::nvme(true)?;
    let mut ram = crate::guest::AlignedBuf::new(len)?;
    crate::pattern::fill(seed, 0, ram.as_mut_slice());
    nvme.write_all_at(ram.as_slice(), nvme_off)?;
    Ok(())
}

/// The verdict on vgpu's last revocation, of the buffer at `bar_off`, made while a read
/// (`read`, as it ended) was held in flight into it until `resumed` into the revocation: the
/// invalidation returned without waiting for it, and the wait for fences ended only after it.
pub fn check_held_revocation(
    bar_off: u64,
    resumed: Duration,
    read: impl std::fmt::Debug,
) -> anyhow::Result<()> {
    let (off, invalidate, fences) = last_revoke()?;
    ktap::diag(format_args!(
        "held read: {read:?}; invalidation took {invalidate:?}, the wait for fences {fences:?}; \
         the read was resumed {resumed:?} into the revocation"
    ));
    ensure!(off == bar_off, "vgpu's last revocation was of {off:#x}");
    ensure!(
        invalidate < resumed / 2,
        "the invalidation callback took {invalidate:?} while the read was held for {resumed:?}: \
         it waited for I/O"
    );
    // vgpu times its revocation from the moment it starts it; `resumed` counts from before the
    // revoking thread was spawned and its sysfs write reached vgpu, which under KASAN on a busy
    // host took up to 143 ms. A fence that signalled early would do so a hold (seconds)
    // early; the callers also check that the revocation had not returned when they resumed.
    ensure!(
        invalidate + fences + Duration::from_millis(500) >= resumed,
        "the fence signalled {:?} into the revocation, before the read was resumed at \
         {resumed:?}",
        invalidate + fences
    );
    Ok(())
}

/// The exporter reuses `[bar_off, bar_off + len)` (vgpu writes `seed`'s pattern there); half a
/// second later the host finds it unchanged: nothing of a revoked buffer's I/O landed.
pub fn reuse_and_check(bar_off: u64, len: u64, seed: u64) -> anyhow::Result<()> {
    vgpu_fill(bar_off, len, seed)?;
    std::thread::sleep(Duration::from_millis(500));
    ctl::gpu_check(bar_off, len, seed)
        .context("the host's look at GPU memory after the exporter reused it")
}

/// The block device of the drive with controller serial `serial`, namespace 1.
pub fn drive_by_serial(serial: &str) -> Option<std::path::PathBuf> {
    guest::drive_by_serial(serial)
}

/// Puts `seed`'s pattern at the start of the drive `path` (O_DIRECT).
pub fn write_nvme2_pattern(path: &std::path::Path, seed: u64, len: usize) -> anyhow::Result<()> {
    use std::os::unix::fs::FileExt;
    let file = crate::guest::open_direct(path, true)?;
    let mut ram = crate::guest::AlignedBuf::new(len)?;
    crate::pattern::fill(seed, 0, ram.as_mut_slice());
    file.write_all_at(ram.as_slice(), 0)?;
    Ok(())
}

/// One of fgds's fault-injection windows (`race_window_us`, `lookup_window_us`: kernels with
/// fault injection only), set for as long as it lives.
pub struct Window(std::path::PathBuf);

impl Window {
    /// Sets fgds's parameter `name` to `us`; `None` where the kernel has no such parameter.
    pub fn set(name: &str, us: u32) -> anyhow::Result<Option<Window>> {
        let param = Path::new("/sys/module/fgds/parameters").join(name);
        if !param.exists() {
            return Ok(None);
        }
        std::fs::write(&param, us.to_string())
            .with_context(|| format!("write {}", param.display()))?;
        ktap::diag(format_args!("{name}: {us} us"));
        Ok(Some(Window(param)))
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "0");
    }
}
