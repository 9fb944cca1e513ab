//! fgds lifetime: UNREG and close with a live mapping, fork, partial munmap, mremap, madvise,
//! 2 MiB mappings split by madvise, munmap and fork,
//! SIGKILL during I/O, revocation by the exporter (SIGBUS on access, EFAULT on I/O, ENODEV on
//! mmap), exporter unbind and rebind, module unload while in use.

use fgds_tests::common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map};
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

const SIGBUS_STATUS: i32 = 128 + libc::SIGBUS;

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "unreg_with_live_mapping",
            run: unreg_with_live_mapping,
        },
        Case {
            name: "close_with_live_mapping",
            run: close_with_live_mapping,
        },
        Case {
            name: "fork_then_io_in_child",
            run: fork_then_io_in_child,
        },
        Case {
            name: "partial_munmap",
            run: partial_munmap,
        },
        Case {
            name: "mremap_and_madvise",
            run: mremap_and_madvise,
        },
        Case {
            name: "pmd_mappings_split_and_let_go",
            run: pmd_mappings_split_and_let_go,
        },
        Case {
            name: "sigkill_during_large_read",
            run: sigkill_during_large_read,
        },
        Case {
            name: "revoke_after_io",
            run: revoke_after_io,
        },
        Case {
            name: "revoke_during_io",
            run: revoke_during_io,
        },
        Case {
            name: "exporter_unbind_and_rebind",
            run: exporter_unbind_and_rebind,
        },
        Case {
            name: "module_unload_refused_while_open",
            run: module_unload_refused,
        },
        Case {
            name: "munmap_then_sysfs_readdir_is_no_lock_cycle",
            run: munmap_then_sysfs_readdir,
        },
    ])
}

/// Found by the fuzzer (docs/fuzzing.md), a lockdep cycle on the debug kernels: the last
/// reference of a registration going in munmap() took `gpu->lock` under the mmap lock,
/// `gpu->lock` was held while the provider set up (creating the P2PDMA sysfs files: the kernfs
/// lock), and a readdir of sysfs takes the kernfs lock, then faults on the user's buffer (the
/// mmap lock, when contended). Each step here makes one edge (the provider's setup is this
/// program's after `exporter_unbind_and_rebind`); lockdep, where the kernel has it, reports the
/// cycle as a splat, which fails the program.
fn munmap_then_sysfs_readdir() -> CaseResult {
    // The first open since exporter_unbind_and_rebind bound vgpu again sets the provider up
    // (P2PDMA pages: fgds creates the GPU's P2PDMA state, its sysfs group with it).
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    common::unreg(&node, idx)?;
    // The mapping holds the last reference: munmap() releases the registration.
    drop(map);
    wait_buffers(0)?;
    // getdents64 of a sysfs directory whose first entries past "." and ".." (24 bytes each,
    // written before kernfs takes its lock) land on a page never touched: filldir faults with
    // the kernfs lock held. The fault takes the mmap lock with a trylock first (no lockdep
    // edge) and waits for it only when it is contended: a thread keeps it busy meanwhile.
    let dir = std::fs::File::open("/sys/class/fgds")?;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                drop(Map::anonymous(common::PAGE as usize));
            }
        })
    };
    let result = (|| -> anyhow::Result<()> {
        for _ in 0..300 {
            let two = Map::anonymous(2 * common::PAGE as usize)?;
            let first_page_end = two.at(common::PAGE as usize);
            // SAFETY: the last byte of the first page of our mapping: it is faulted in now.
            unsafe { first_page_end.sub(1).write_volatile(0) };
            // SAFETY: 48 bytes before the end of the first page, inside our mapping.
            let at = unsafe { first_page_end.sub(48) };
            rustix::fs::seek(&dir, rustix::fs::SeekFrom::Start(0))?;
            // SAFETY: the kernel writes at most PAGE + 48 bytes from `at`, the rest of our
            // mapping.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_getdents64,
                    std::os::fd::AsRawFd::as_raw_fd(&dir),
                    at,
                    common::PAGE as usize + 48,
                )
            };
            ensure!(
                n > 0,
                "getdents64 of /sys/class/fgds: {}",
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    })();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("the mmap thread panicked"))?;
    result?;
    ktap::pass()
}

/// Waits until sysfs `buffers` drops to `want` (releases may finish just after close).
fn wait_buffers(want: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = common::sysfs_u64("buffers")?;
        if n == want {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("sysfs buffers is {n}, want {want}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_check(map_ptr: *mut u8, len: u64, nvme_off: u64) -> anyhow::Result<()> {
    let nvme = common::nvme(false)?;
    let n = common::pread_raw(&nvme, map_ptr, len as usize, nvme_off).context("pread")?;
    ensure!(n == len as usize, "short pread {n}");
    Ok(())
}

fn unreg_with_live_mapping() -> CaseResult {
    let base = common::sysfs_u64("buffers")?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    common::unreg(&node, idx).context("UNREG")?;
    ensure!(
        common::sysfs_u64("buffers")? == base + 1,
        "the mapping did not keep the buffer"
    );
    read_check(map.ptr, len, 2 * MIB)?;
    common::check_nvme_pattern(
        2 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    drop(map);
    wait_buffers(base)?;
    ktap::pass()
}

fn close_with_live_mapping() -> CaseResult {
    let base = common::sysfs_u64("buffers")?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let map = {
        let node = common::open_node()?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
        Map::shared(&node, idx, len as usize)?
    };
    read_check(map.ptr, len, 4 * MIB)?;
    common::check_nvme_pattern(
        4 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    ensure!(
        common::sysfs_u64("buffers")? == base + 1,
        "buffer gone while mapped"
    );
    drop(map);
    wait_buffers(base)?;
    ktap::pass()
}

fn fork_then_io_in_child() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 4 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    // Fault the pages in before fork so the child gets PTE copies, not only the VMA.
    read_check(map.ptr, MIB, 0)?;
    let ptr = map.ptr as usize;
    let status = common::in_child(|| {
        let Ok(nvme) = common::nvme(false) else {
            return 2;
        };
        match common::pread_raw(&nvme, ptr as *mut u8, len as usize, 6 * MIB) {
            Ok(n) if n == len as usize => 0,
            _ => 1,
        }
    })?;
    ensure!(status == 0, "child I/O failed (status {status})");
    common::check_nvme_pattern(
        6 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    ktap::pass()
}

fn partial_munmap() -> CaseResult {
    let base = common::sysfs_u64("buffers")?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 4 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    common::unreg(&node, idx)?;
    let mut map = Map::shared(&node, idx, len as usize);
    ensure!(map.is_err(), "mmap of an unregistered token worked");
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    map = Map::shared(&node, idx, len as usize);
    let mut map = map?;
    // Unmap the second MiB: the VMA splits in two, each keeps the buffer.
    // SAFETY: a sub-range of our own mapping.
    let rc = unsafe { libc::munmap(map.at(MIB as usize).cast(), MIB as usize) };
    ensure!(rc == 0, "munmap");
    common::unreg(&node, idx)?;
    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, MIB as usize, 8 * MIB).context("I/O into the first part")?;
    common::pread_raw(&nvme, map.at(2 * MIB as usize), 2 * MIB as usize, 10 * MIB)
        .context("I/O into the last part")?;
    let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    common::check_nvme_pattern(8 * MIB, &got[..MIB as usize])?;
    common::check_nvme_pattern(10 * MIB, &got[2 * MIB as usize..])?;
    ensure!(
        common::sysfs_u64("buffers")? == base + 1,
        "buffer gone while partly mapped"
    );
    // SAFETY: the two remaining parts of our own mapping.
    unsafe {
        libc::munmap(map.ptr.cast(), MIB as usize);
        libc::munmap(map.at(2 * MIB as usize).cast(), 2 * MIB as usize);
    }
    map.len = 0;
    wait_buffers(base)?;
    ktap::pass()
}

fn mremap_and_madvise() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let mut map = Map::shared(&node, idx, len as usize)?;
    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 12 * MIB)?;
    // Growing is refused (VM_DONTEXPAND).
    // SAFETY: mremap of our own mapping; on failure nothing changes.
    let grown = unsafe { libc::mremap(map.ptr.cast(), len as usize, 2 * len as usize, 0) };
    ensure!(grown == libc::MAP_FAILED, "growing the mapping worked");
    // Moving works.
    // SAFETY: as above; MAYMOVE returns the new address and unmaps the old one.
    let moved = unsafe {
        libc::mremap(
            map.ptr.cast(),
            len as usize,
            len as usize,
            libc::MREMAP_MAYMOVE,
        )
    };
    ensure!(
        moved != libc::MAP_FAILED,
        "mremap move: {}",
        std::io::Error::last_os_error()
    );
    map.ptr = moved.cast();
    common::pread_raw(&nvme, map.ptr, len as usize, 14 * MIB).context("I/O after mremap")?;
    common::check_nvme_pattern(
        14 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    // MADV_DONTNEED zaps the PTEs; the pages fault back in.
    // SAFETY: advice on our own mapping.
    let rc = unsafe { libc::madvise(map.ptr.cast(), len as usize, libc::MADV_DONTNEED) };
    ensure!(rc == 0, "madvise");
    common::pread_raw(&nvme, map.ptr, len as usize, 16 * MIB).context("I/O after MADV_DONTNEED")?;
    common::check_nvme_pattern(
        16 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    ktap::pass()
}

/// Minor page faults of this thread so far.
fn minor_faults() -> anyhow::Result<i64> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes one rusage into the buffer we pass.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    ensure!(rc == 0, "getrusage: {}", std::io::Error::last_os_error());
    // SAFETY: initialised by the successful call above.
    Ok(unsafe { usage.assume_init() }.ru_minflt)
}

/// Whether fgds must map 2 MiB folios with PMDs here: on 7.x, GENERIC pages, and P2PDMA pages
/// where the kernel can make them 2 MiB folios (`pci_p2pdma_add_resource_folios()`, the rig's
/// kernel change p2pdma-folios) (docs/driver.md); the mode taken from the run's configuration
/// and the kernel's symbols, not from the driver.
fn maps_pmds() -> anyhow::Result<bool> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let major: u32 = release
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .context("kernel release")?;
    let mode = common::sysfs("mode")?;
    let expected = fgds_tests::guest::expected_mode()?;
    ensure!(
        mode == expected,
        "fgds shows mode {mode:?}; the run's configuration implies {expected:?}"
    );
    let folios =
        expected == "generic" || (expected == "p2pdma" && fgds_tests::guest::has_p2pdma_folios()?);
    Ok(major >= 7 && folios)
}

/// An 8 MiB buffer on 2 MiB BAR boundaries: where fgds maps PMDs, touching it from its last
/// page down faults once per 2 MiB (a PTE mapping would fault once per page, fault-around only
/// reaching forward). Then each PMD is split a different way (MADV_DONTNEED of one page, munmap
/// of one page, I/O from a forked child, which gets no copy of the PMDs), I/O goes into every
/// part, and once unmapped the buffer must let go: a reference lost or leaked by a split would
/// keep it pinned.
fn pmd_mappings_split_and_let_go() -> CaseResult {
    const PAGE: usize = 4096;
    const PMD: u64 = 2 * MIB;
    let base = common::sysfs_u64("buffers")?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 8 * MIB;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len + PMD)?;
    let skip = (PMD - bar_off % PMD) % PMD;
    let idx = common::reg(&node, dmabuf.as_fd(), skip, len)?;
    let mut map = Map::shared(&node, idx, len as usize)?;

    let before = minor_faults()?;
    for page in (0..len as usize / PAGE).rev() {
        // SAFETY: a write inside our live mapping.
        unsafe { std::ptr::write_volatile(map.at(page * PAGE), 0x5a) };
    }
    let faults = minor_faults()? - before;
    let pmds = maps_pmds()?;
    ktap::diag(format_args!(
        "touching 8 MiB from its end took {faults} faults (PMD mappings expected: {pmds})"
    ));
    ensure!(
        !pmds || faults <= 8,
        "{faults} faults for four 2 MiB folios: fgds did not map them with PMDs"
    );

    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 20 * MIB).context("I/O into all of it")?;
    common::check_nvme_pattern(
        20 * MIB,
        &common::gpu_read(
            dmabuf.as_fd(),
            (len + PMD) as usize,
            skip as usize,
            len as usize,
        )?,
    )?;
    // Split the first PMD (zap one page), the second (unmap one page: the VMA splits too).
    let at = |off: u64| map.at(off as usize);
    // SAFETY: advice on a page of our own mapping.
    let rc = unsafe { libc::madvise(at(MIB).cast(), PAGE, libc::MADV_DONTNEED) };
    ensure!(rc == 0, "madvise: {}", std::io::Error::last_os_error());
    // SAFETY: unmaps one page of our own mapping; nothing refers to it any more.
    let rc = unsafe { libc::munmap(at(3 * MIB).cast(), PAGE) };
    ensure!(rc == 0, "munmap: {}", std::io::Error::last_os_error());
    let (third, fourth) = (at(4 * MIB) as usize, at(6 * MIB) as usize);
    let status = common::in_child(|| {
        let Ok(nvme) = common::nvme(false) else {
            return 2;
        };
        match common::pread_raw(&nvme, third as *mut u8, 2 * MIB as usize, 30 * MIB) {
            Ok(n) if n == 2 * MIB as usize => 0,
            _ => 1,
        }
    })?;
    ensure!(status == 0, "child I/O failed (status {status})");
    for (off, len, nvme_off) in [
        (0, 2 * MIB, 40 * MIB),
        (2 * MIB, MIB, 42 * MIB),
        (3 * MIB + PAGE as u64, MIB - PAGE as u64, 43 * MIB),
    ] {
        common::pread_raw(&nvme, at(off), len as usize, nvme_off)
            .with_context(|| format!("I/O into the split part at {off:#x}"))?;
    }
    common::pread_raw(&nvme, fourth as *mut u8, 2 * MIB as usize, 50 * MIB)
        .context("I/O into the last PMD")?;
    let got = common::gpu_read(
        dmabuf.as_fd(),
        (len + PMD) as usize,
        skip as usize,
        len as usize,
    )?;
    let mib = MIB as usize;
    common::check_nvme_pattern(40 * MIB, &got[..2 * mib])?;
    common::check_nvme_pattern(42 * MIB, &got[2 * mib..3 * mib])?;
    common::check_nvme_pattern(43 * MIB, &got[3 * mib + PAGE..4 * mib])?;
    common::check_nvme_pattern(30 * MIB, &got[4 * mib..6 * mib])?;
    common::check_nvme_pattern(50 * MIB, &got[6 * mib..])?;

    common::unreg(&node, idx)?;
    // SAFETY: the two parts of our own mapping around the page unmapped above.
    unsafe {
        libc::munmap(map.ptr.cast(), 3 * mib);
        libc::munmap(map.at(3 * mib + PAGE).cast(), 5 * mib - PAGE);
    }
    map.len = 0;
    wait_buffers(base)?;
    ktap::pass()
}

fn sigkill_during_large_read() -> CaseResult {
    let base = common::sysfs_u64("buffers")?;
    // SAFETY: single-threaded test process.
    let pid = unsafe { libc::fork() };
    ensure!(pid >= 0, "fork");
    if pid == 0 {
        let run = || -> anyhow::Result<()> {
            let node = common::open_node()?;
            let vgpu = common::vgpu()?;
            let len = 64 * MIB;
            let (dmabuf, _) = common::alloc(&vgpu, len)?;
            let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
            let map = Map::shared(&node, idx, len as usize)?;
            let nvme = common::nvme(false)?;
            loop {
                common::pread_raw(&nvme, map.ptr, len as usize, 0)?;
            }
        };
        let _ = run();
        // SAFETY: leave the child.
        unsafe { libc::_exit(1) };
    }
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: killing our own child.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let status = common::wait(pid)?;
    ensure!(
        status == 128 + libc::SIGKILL,
        "child ended with status {status} before the kill"
    );
    wait_buffers(base)?;
    ktap::pass()
}

fn revoke_after_io() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 2 * MIB;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 0).context("I/O before revoke")?;
    common::revoke(bar_off)?;
    let status = common::touch_in_child(map.ptr)?;
    ensure!(
        status == SIGBUS_STATUS,
        "access after revoke: status {status}, want SIGBUS"
    );
    match common::pread_raw(&nvme, map.ptr, len as usize, 0) {
        Err(Errno::FAULT) => {}
        other => bail!("pread after revoke: {other:?}, want EFAULT"),
    }
    match Map::new(&node, idx, len as usize, libc::MAP_SHARED) {
        Err(Errno::NODEV) => {}
        Err(e) => bail!("mmap after revoke: {e}, want ENODEV"),
        Ok(_) => bail!("mmap after revoke worked"),
    }
    drop(map);
    common::unreg(&node, idx).context("UNREG of a revoked token")?;
    ktap::pass()
}

fn revoke_during_io() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let len = 16 * MIB;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let ptr = map.ptr as usize;
    let reader = std::thread::spawn(move || -> (u32, Option<Errno>) {
        let Ok(nvme) = common::nvme(false) else {
            return (0, None);
        };
        let mut ok = 0;
        loop {
            match common::pread_raw(&nvme, ptr as *mut u8, len as usize, 0) {
                Ok(_) => ok += 1,
                Err(e) => return (ok, Some(e)),
            }
            if ok > 10_000 {
                return (ok, None);
            }
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    common::revoke(bar_off).context("revoke during I/O")?;
    let (ok, err) = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    ktap::diag(format_args!(
        "{ok} reads completed before the revoke; then {err:?}"
    ));
    ensure!(
        err == Some(Errno::FAULT),
        "I/O after revoke ended with {err:?}, want EFAULT"
    );
    drop(map);
    common::unreg(&node, idx)?;
    ktap::pass()
}

fn vgpu_driver_path(bdf: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/sys/bus/pci/devices/{bdf}/driver"))
}

fn exporter_unbind_and_rebind() -> CaseResult {
    let bdf = common::vgpu_bdf()?;
    let drv = std::fs::canonicalize(vgpu_driver_path(&bdf)).context("vgpu driver link")?;
    let node = common::open_node()?;
    let len = 2 * MIB;
    let map = {
        let vgpu = common::vgpu()?;
        let (dmabuf, _) = common::alloc(&vgpu, len)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
        Map::shared(&node, idx, len as usize)?
    };
    let nvme = common::nvme(false)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 0)?;
    // vgpu's class device goes away with the unbind: find fgds's sysfs now.
    let sys = common::sysfs_dir()?;
    let read = |attr: &str| -> anyhow::Result<String> {
        Ok(std::fs::read_to_string(sys.join(attr))?.trim().to_owned())
    };
    std::fs::write(drv.join("unbind"), &bdf).context("unbind vgpu")?;
    let result = (|| -> anyhow::Result<()> {
        ensure!(
            read("mode")? == "none",
            "provider kept after the exporter unbound"
        );
        let status = common::touch_in_child(map.ptr)?;
        ensure!(
            status == SIGBUS_STATUS,
            "access after unbind: status {status}, want SIGBUS"
        );
        match common::pread_raw(&nvme, map.ptr, len as usize, 0) {
            Err(Errno::FAULT) => Ok(()),
            other => bail!("pread after unbind: {other:?}, want EFAULT"),
        }
    })();
    // Release everything that still holds the old vgpu instance before binding again.
    drop(map);
    drop(node);
    let deadline = Instant::now() + Duration::from_secs(5);
    while read("buffers")? != "0" && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = read("buffers")?;
    std::fs::write(drv.join("bind"), &bdf).context("rebind vgpu")?;
    result?;
    ensure!(left == "0", "{left} buffers left after close");
    // The next registration sets the provider up again.
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len).context("REG after rebind")?;
    let map = Map::shared(&node, idx, len as usize)?;
    common::pread_raw(&nvme, map.ptr, len as usize, 18 * MIB).context("I/O after rebind")?;
    common::check_nvme_pattern(
        18 * MIB,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    ktap::pass()
}

fn module_unload_refused() -> CaseResult {
    let node = common::open_node()?;
    match rustix::system::delete_module(c"fgds", libc::O_NONBLOCK) {
        Err(Errno::BUSY) | Err(Errno::AGAIN) => {}
        other => bail!("unloading fgds with an open node: {other:?}, want EBUSY"),
    }
    ensure!(
        std::path::Path::new("/sys/module/fgds").exists(),
        "fgds unloaded"
    );
    drop(node);
    ktap::pass()
}
