//! vgpu, the rig's test exporter (driver/vgpu): its ioctl, its dma-buf fd, sysfs and revocation.

use std::fs::{self, File};
use std::os::fd::{AsFd, OwnedFd};

use anyhow::{Context, bail, ensure};
use fgds::vgpu;
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

const SYSFS: &str = "/sys/class/vgpu/vgpu0";

fn main() {
    fgds_tests::guest::skip_unless_vgpu();
    ktap::run(&[
        Case {
            name: "mode",
            run: mode,
        },
        Case {
            name: "alloc_rejects_bad_input",
            run: alloc_rejects_bad_input,
        },
        Case {
            name: "alloc_fd_flags",
            run: alloc_fd_flags,
        },
        Case {
            name: "buffers_listing",
            run: buffers_listing,
        },
        Case {
            name: "bar_full_then_reusable",
            run: bar_full_then_reusable,
        },
        Case {
            name: "mmap_rules",
            run: mmap_rules,
        },
        Case {
            name: "revoke",
            run: revoke,
        },
        Case {
            name: "unbind_with_live_buffer",
            run: unbind_with_live_buffer,
        },
    ])
}

fn alloc_raw(dev: &File, size: u64, flags: u32) -> Result<(OwnedFd, u64), Errno> {
    let mut arg = vgpu::Alloc {
        size,
        flags,
        ..vgpu::Alloc::default()
    };
    // SAFETY: `Alloc` is `struct vgpu_alloc`; the kernel writes only within it.
    unsafe {
        rustix::ioctl::ioctl(
            dev.as_fd(),
            rustix::ioctl::Updater::<{ vgpu::IOCTL_ALLOC }, vgpu::Alloc>::new(&mut arg),
        )
    }?;
    // SAFETY: a fresh fd installed by the kernel.
    Ok((
        unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(arg.fd) },
        arg.bar_offset,
    ))
}

fn bar_size() -> anyhow::Result<u64> {
    let res = fs::read_to_string(format!("{SYSFS}/device/resource"))?;
    let line = res.lines().nth(2).context("no BAR2 line")?;
    let f = line
        .split_whitespace()
        .map(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(f[1] - f[0] + 1)
}

fn buffers() -> anyhow::Result<Vec<[u64; 4]>> {
    let text = fs::read_to_string(format!("{SYSFS}/buffers"))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let f = line
            .split(' ')
            .map(str::parse)
            .collect::<Result<Vec<u64>, _>>()?;
        ensure!(f.len() == 4, "bad buffers line {line:?}");
        out.push([f[0], f[1], f[2], f[3]]);
    }
    Ok(out)
}

fn revoke_offset(off: u64) -> std::io::Result<()> {
    fs::write(format!("{SYSFS}/revoke"), format!("{off}\n"))
}

fn mode() -> CaseResult {
    let mode = fs::read_to_string(format!("{SYSFS}/mode"))?;
    ensure!(mode == "plain\n" || mode == "p2pdma\n", "mode {mode:?}");
    ktap::diag(format!("fgds-report: vgpu mode={}", mode.trim()));
    ensure!(
        fs::canonicalize(format!("{SYSFS}/device"))?
            .to_string_lossy()
            .contains("pci")
    );
    ktap::pass()
}

fn alloc_rejects_bad_input() -> CaseResult {
    let dev = vgpu::open(0)?;
    let bar = bar_size()?;
    for (size, flags, what) in [
        (4096, 1 << 2, "an unknown flag"),
        (4096, vgpu::ALLOC_SKEW, "a skewed buffer under 4 MiB"),
        (
            (4 << 20) + 4096,
            vgpu::ALLOC_SKEW,
            "a skewed buffer not a multiple of 2 MiB",
        ),
        (0, 0, "size 0"),
        (4097, 0, "unaligned size"),
        (bar + 4096, 0, "larger than the BAR"),
        (!4095, 0, "huge"),
    ] {
        match alloc_raw(&dev, size, flags) {
            Err(Errno::INVAL) => {}
            other => bail!("{what}: {:?}", other.map(|(_, o)| o)),
        }
    }
    ktap::pass()
}

fn alloc_fd_flags() -> CaseResult {
    let dev = vgpu::open(0)?;
    let (fd, off) = alloc_raw(&dev, 1 << 20, 0)?;
    ensure!(off % 4096 == 0);
    let fdflags = rustix::io::fcntl_getfd(&fd)?;
    ensure!(
        fdflags.contains(rustix::io::FdFlags::CLOEXEC),
        "no O_CLOEXEC"
    );
    let fl = rustix::fs::fcntl_getfl(&fd)?;
    ensure!(
        fl & rustix::fs::OFlags::RWMODE == rustix::fs::OFlags::RDWR,
        "not O_RDWR: {fl:?}"
    );
    let (ro, _) = alloc_raw(&dev, 1 << 20, vgpu::ALLOC_RDONLY)?;
    let fl = rustix::fs::fcntl_getfl(&ro)?;
    ensure!(
        fl & rustix::fs::OFlags::RWMODE == rustix::fs::OFlags::RDONLY,
        "VGPU_ALLOC_RDONLY: not O_RDONLY: {fl:?}"
    );
    ktap::pass()
}

fn buffers_listing() -> CaseResult {
    let dev = vgpu::open(0)?;
    let (fd, off) = alloc_raw(&dev, 3 << 20, 0)?;
    ensure!(
        buffers()?.contains(&[off, 3 << 20, 0, 0]),
        "{:?}",
        buffers()?
    );
    drop(fd);
    ensure!(!buffers()?.iter().any(|b| b[0] == off), "{:?}", buffers()?);
    ktap::pass()
}

fn bar_full_then_reusable() -> CaseResult {
    let dev = vgpu::open(0)?;
    let bar = bar_size()?;
    ensure!(buffers()?.is_empty(), "buffers left over: {:?}", buffers()?);
    let (whole, off) = alloc_raw(&dev, bar, 0)?;
    ensure!(off == 0);
    match alloc_raw(&dev, 4096, 0) {
        Err(Errno::NOMEM) => {}
        other => bail!("second alloc on a full BAR: {:?}", other.map(|(_, o)| o)),
    }
    drop(whole);
    let (_again, off) = alloc_raw(&dev, bar, 0).context("the BAR did not come back")?;
    ensure!(off == 0);
    ktap::pass()
}

fn mmap_raw(
    fd: &OwnedFd,
    len: usize,
    flags: rustix::mm::MapFlags,
    pgoff: u64,
) -> Result<*mut u8, Errno> {
    // SAFETY: a new mapping at a kernel-chosen address.
    unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            flags,
            fd,
            pgoff * 4096,
        )
    }
    .map(|p| p.cast())
}

fn mmap_rules() -> CaseResult {
    let dev = vgpu::open(0)?;
    let (fd, _) = alloc_raw(&dev, 1 << 20, 0)?;
    match mmap_raw(&fd, 4096, rustix::mm::MapFlags::PRIVATE, 0) {
        Err(Errno::INVAL) => {}
        other => bail!("MAP_PRIVATE: {other:?}"),
    }
    match mmap_raw(&fd, 8192, rustix::mm::MapFlags::SHARED, 255) {
        Err(Errno::INVAL) => {}
        other => bail!("past the end: {other:?}"),
    }
    // An offset mapping sees the same memory as the whole one.
    let whole = mmap_raw(&fd, 1 << 20, rustix::mm::MapFlags::SHARED, 0)?;
    let tail = mmap_raw(&fd, 4096, rustix::mm::MapFlags::SHARED, 255)?;
    // SAFETY: both mappings are live and in bounds.
    unsafe {
        whole
            .add(255 * 4096 + 8)
            .cast::<u64>()
            .write_volatile(0x1122_3344_5566_7788);
        ensure!(tail.add(8).cast::<u64>().read_volatile() == 0x1122_3344_5566_7788);
    }
    ktap::pass()
}

/// Forks a child that reads `ptr`; returns the signal that killed it, if any.
fn child_reads(ptr: *mut u8) -> anyhow::Result<Option<i32>> {
    // SAFETY: the child only reads memory and exits.
    let pid = unsafe { libc::fork() };
    ensure!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: a live mapping, possibly revoked.
        let _ = unsafe { ptr.cast::<u64>().read_volatile() };
        // SAFETY: exit without running the parent's atexit handlers.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    ensure!(unsafe { libc::waitpid(pid, &mut status, 0) } == pid);
    Ok(libc::WIFSIGNALED(status).then(|| libc::WTERMSIG(status)))
}

fn revoke() -> CaseResult {
    let dev = vgpu::open(0)?;
    let (fd, off) = alloc_raw(&dev, 2 << 20, 0)?;
    let map = mmap_raw(&fd, 2 << 20, rustix::mm::MapFlags::SHARED, 0)?;
    // SAFETY: live mapping.
    unsafe { map.cast::<u64>().write_volatile(42) };
    ensure!(child_reads(map)?.is_none(), "child died before revocation");

    revoke_offset(off).context("revoke")?;
    ensure!(
        buffers()?.contains(&[off, 2 << 20, 0, 1]),
        "{:?}",
        buffers()?
    );
    ensure!(
        child_reads(map)? == Some(libc::SIGBUS),
        "no SIGBUS after revocation"
    );
    match mmap_raw(&fd, 4096, rustix::mm::MapFlags::SHARED, 0) {
        Err(Errno::NODEV) => {}
        other => bail!("mmap after revocation: {other:?}"),
    }
    revoke_offset(off).context("second revoke")?;
    match revoke_offset(off + 4096) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
        other => bail!("revoke of no buffer: {other:?}"),
    }
    match fs::write(format!("{SYSFS}/revoke"), "garbage") {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        other => bail!("revoke of garbage: {other:?}"),
    }
    // SAFETY: unmapping our own mapping.
    unsafe { rustix::mm::munmap(map.cast(), 2 << 20)? };
    drop(fd);
    ensure!(!buffers()?.iter().any(|b| b[0] == off));
    ktap::pass()
}

fn unbind_with_live_buffer() -> CaseResult {
    let bdf = fs::canonicalize(format!("{SYSFS}/device"))?
        .file_name()
        .context("bdf")?
        .to_string_lossy()
        .into_owned();
    let dev = vgpu::open(0)?;
    let (fd, _) = alloc_raw(&dev, 2 << 20, 0)?;
    let map = mmap_raw(&fd, 2 << 20, rustix::mm::MapFlags::SHARED, 0)?;
    // SAFETY: live mapping.
    unsafe { map.cast::<u64>().write_volatile(7) };
    let t = std::time::Instant::now();
    fs::write("/sys/bus/pci/drivers/vgpu/unbind", &bdf).context("unbind")?;
    ktap::diag(format!("unbind with a live buffer took {:?}", t.elapsed()));
    ensure!(
        fs::metadata(SYSFS).is_err(),
        "vgpu0 still there after unbind"
    );
    ensure!(
        child_reads(map)? == Some(libc::SIGBUS),
        "no SIGBUS after unbind"
    );
    match alloc_raw(&dev, 4096, 0) {
        Err(Errno::NODEV) => {}
        other => bail!("alloc on an unbound device: {:?}", other.map(|(_, o)| o)),
    }
    fs::write("/sys/bus/pci/drivers/vgpu/bind", &bdf).context("rebind")?;
    ensure!(fs::metadata(SYSFS).is_ok(), "rebound device is not vgpu0");
    match mmap_raw(&fd, 4096, rustix::mm::MapFlags::SHARED, 0) {
        Err(Errno::NODEV) => {}
        other => bail!("mmap of an old buffer after rebind: {other:?}"),
    }
    let dev2 = vgpu::open(0)?;
    let (fd2, _) = alloc_raw(&dev2, 2 << 20, 0)?;
    let map2 = mmap_raw(&fd2, 2 << 20, rustix::mm::MapFlags::SHARED, 0)?;
    ensure!(child_reads(map2)?.is_none(), "new buffer not readable");
    // SAFETY: unmapping our own mappings.
    unsafe {
        rustix::mm::munmap(map.cast(), 2 << 20)?;
        rustix::mm::munmap(map2.cast(), 2 << 20)?;
    }
    ktap::pass()
}
