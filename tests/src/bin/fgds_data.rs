//! fgds data path: NVMe to GPU and GPU to NVMe through a registered, mapped vgpu buffer, with
//! pread/pwrite, preadv/pwritev and io_uring, checked in the guest through vgpu's own CPU
//! mapping of the dma-buf.

use fgds_tests::common;

use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;

use anyhow::{Context, bail, ensure};
use common::{MIB, Map, PAGE};
use fgds_tests::guest::AlignedBuf;
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;

/// Where on the NVMe image tests write (beyond the 64 MiB pattern, inside the 256 MiB image).
const SCRATCH: u64 = 128 * MIB;

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "mode_reported",
            run: mode_reported,
        },
        Case {
            name: "nvme_to_gpu_pread_4k_to_64m",
            run: nvme_to_gpu_pread_sizes,
        },
        Case {
            name: "gpu_to_nvme_pwrite",
            run: gpu_to_nvme_pwrite,
        },
        Case {
            name: "preadv_pwritev_two_buffers",
            run: preadv_pwritev,
        },
        Case {
            name: "io_uring_read_write",
            run: io_uring_read_write,
        },
        Case {
            name: "io_uring_registered_buffers_refused",
            run: io_uring_registered_buffers_refused,
        },
        Case {
            name: "nonzero_dmabuf_offset",
            run: nonzero_dmabuf_offset,
        },
        Case {
            name: "several_buffers_per_fd",
            run: several_buffers_per_fd,
        },
        Case {
            name: "two_processes_at_once",
            run: two_processes,
        },
        Case {
            name: "ext4_file_both_directions",
            run: ext4_file,
        },
        Case {
            name: "xfs_file_both_directions",
            run: xfs_file,
        },
        Case {
            name: "btrfs_file_both_directions",
            run: btrfs_file,
        },
    ])
}

fn mode_reported() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, MIB)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, MIB).context("REG_BUFFER")?;
    let mode = common::sysfs("mode")?;
    ktap::diag(format_args!("fgds-report: fgds mode={mode}"));
    let expected = fgds_tests::guest::expected_mode()?;
    ensure!(
        mode == expected,
        "fgds shows mode {mode:?} with a buffer registered; the run's configuration implies \
         {expected:?} (xtask/src/expected.rs)"
    );
    ensure!(
        common::sysfs_u64("buffers")? >= 1,
        "sysfs buffers not counting"
    );
    ensure!(
        common::sysfs_u64("bytes")? >= MIB,
        "sysfs bytes not counting"
    );
    common::unreg(&node, idx)?;
    ktap::pass()
}

/// Reads `len` bytes of the NVMe pattern at `nvme_off` into a fresh GPU buffer through fgds and
/// checks the GPU memory, through vgpu's CPU mapping and as the host sees it.
fn read_into_gpu(len: u64, nvme_off: u64) -> anyhow::Result<()> {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    common::gpu_fill(dmabuf.as_fd(), len as usize, 0xaa)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len).context("REG_BUFFER")?;
    let map = Map::shared(&node, idx, len as usize)?;
    let n = common::pread_raw(&nvme, map.ptr, len as usize, nvme_off)
        .with_context(|| format!("pread of {len} bytes into GPU memory"))?;
    ensure!(n == len as usize, "short pread: {n} of {len}");
    let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    common::check_nvme_pattern(nvme_off, &got).with_context(|| format!("{len} bytes"))?;
    fgds_tests::ctl::gpu_check_at(bar_off, len, pattern::NVME_SEED, nvme_off)
        .with_context(|| format!("{len} bytes in the GPU's backing file"))?;
    Ok(())
}

fn nvme_to_gpu_pread_sizes() -> CaseResult {
    for len in [PAGE, 64 << 10, MIB, 4 * MIB, 16 * MIB, 64 * MIB] {
        let off = if len == 64 * MIB { 0 } else { 3 * MIB };
        read_into_gpu(len, off)?;
    }
    ktap::pass()
}

/// Fills a GPU buffer with the pattern of `seed` (as if at offset `at`), writes it to the NVMe
/// at `nvme_off` through fgds, reads it back into RAM and checks it.
fn gpu_to_nvme_pwrite() -> CaseResult {
    let len = 4 * MIB;
    let seed = 0x5752_4954;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(true)?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let mut data = vec![0u8; len as usize];
    pattern::fill(seed, SCRATCH, &mut data);
    common::gpu_write(dmabuf.as_fd(), len as usize, 0, &data)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let n = common::pwrite_raw(&nvme, map.ptr, len as usize, SCRATCH)
        .context("pwrite from GPU memory")?;
    ensure!(n == len as usize, "short pwrite: {n}");
    let mut ram = AlignedBuf::new(len as usize)?;
    nvme.read_exact_at(ram.as_mut_slice(), SCRATCH)?;
    if let Some(at) = pattern::first_mismatch(seed, SCRATCH, ram.as_slice()) {
        bail!("NVMe data differs from what the GPU held at byte {at}");
    }
    ktap::pass()
}

fn preadv_pwritev() -> CaseResult {
    let len = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(true)?;
    let (a, _) = common::alloc(&vgpu, len)?;
    let (b, _) = common::alloc(&vgpu, len)?;
    let ia = common::reg(&node, a.as_fd(), 0, len)?;
    let ib = common::reg(&node, b.as_fd(), 0, len)?;
    let ma = Map::shared(&node, ia, len as usize)?;
    let mb = Map::shared(&node, ib, len as usize)?;
    let iov = [
        libc::iovec {
            iov_base: ma.ptr.cast(),
            iov_len: len as usize,
        },
        libc::iovec {
            iov_base: mb.ptr.cast(),
            iov_len: len as usize,
        },
    ];
    let off = 5 * MIB;
    // SAFETY: both iovecs are live mappings of len bytes.
    let n = unsafe { libc::preadv(nvme.as_raw_fd(), iov.as_ptr(), 2, off as libc::off_t) };
    ensure!(
        n == 2 * len as isize,
        "preadv returned {n}: {}",
        std::io::Error::last_os_error()
    );
    common::check_nvme_pattern(
        off,
        &common::gpu_read(a.as_fd(), len as usize, 0, len as usize)?,
    )?;
    common::check_nvme_pattern(
        off + len,
        &common::gpu_read(b.as_fd(), len as usize, 0, len as usize)?,
    )?;
    let dst = SCRATCH + 8 * MIB;
    // SAFETY: as above.
    let n = unsafe { libc::pwritev(nvme.as_raw_fd(), iov.as_ptr(), 2, dst as libc::off_t) };
    ensure!(
        n == 2 * len as isize,
        "pwritev returned {n}: {}",
        std::io::Error::last_os_error()
    );
    let mut ram = AlignedBuf::new(2 * len as usize)?;
    nvme.read_exact_at(ram.as_mut_slice(), dst)?;
    common::check_nvme_pattern(off, ram.as_slice()).context("after pwritev")?;
    ktap::pass()
}

fn uring_rw(
    ring: &mut io_uring::IoUring,
    write: bool,
    fd: i32,
    ptr: *mut u8,
    chunk: usize,
    n: usize,
    off: u64,
) -> anyhow::Result<()> {
    for i in 0..n {
        // SAFETY: the chunk lies in a mapping the caller keeps alive until completion.
        let p = unsafe { ptr.add(i * chunk) };
        let sqe = if write {
            io_uring::opcode::Write::new(io_uring::types::Fd(fd), p, chunk as u32)
                .offset(off + (i * chunk) as u64)
                .build()
        } else {
            io_uring::opcode::Read::new(io_uring::types::Fd(fd), p, chunk as u32)
                .offset(off + (i * chunk) as u64)
                .build()
        };
        // SAFETY: buffers outlive the requests: we wait for all completions below.
        unsafe { ring.submission().push(&sqe.user_data(i as u64)) }
            .map_err(|_| anyhow::anyhow!("submission queue full"))?;
    }
    ring.submit_and_wait(n)?;
    for cqe in ring.completion().take(n) {
        ensure!(
            cqe.result() == chunk as i32,
            "request {} returned {}",
            cqe.user_data(),
            cqe.result()
        );
    }
    Ok(())
}

fn io_uring_read_write() -> CaseResult {
    const CHUNK: usize = 1 << 20;
    const N: usize = 8;
    let len = (CHUNK * N) as u64;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(true)?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let mut ring = io_uring::IoUring::new(N as u32)?;
    let off = 9 * MIB;
    uring_rw(&mut ring, false, nvme.as_raw_fd(), map.ptr, CHUNK, N, off)?;
    common::check_nvme_pattern(
        off,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    let dst = SCRATCH + 16 * MIB;
    uring_rw(&mut ring, true, nvme.as_raw_fd(), map.ptr, CHUNK, N, dst)?;
    let mut ram = AlignedBuf::new(len as usize)?;
    nvme.read_exact_at(ram.as_mut_slice(), dst)?;
    common::check_nvme_pattern(off, ram.as_slice()).context("after io_uring write")?;
    ktap::pass()
}

/// No long-term pin of fgds memory: io_uring's `IORING_REGISTER_BUFFERS` (a writable
/// `FOLL_LONGTERM` pin) is refused in every mode, because such a pin would outlive a revocation.
/// GENERIC mappings have a `page_mkwrite` handler, so GUP refuses long-term writable pins of
/// them (`EFAULT`); GUP never pins P2PDMA pages long-term (`EREMOTEIO`); Linux 6.1's io_uring
/// takes no file-backed memory (`EOPNOTSUPP`). The mapping stays usable for ordinary requests.
fn io_uring_registered_buffers_refused() -> CaseResult {
    let len = 2 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    // Touch a page for writing first, so that a writable PTE exists (GUP-fast's path).
    // SAFETY: the first byte of our live, writable mapping.
    unsafe { map.ptr.write_volatile(0) };
    let mut ring = io_uring::IoUring::new(4)?;
    let iov = [libc::iovec {
        iov_base: map.ptr.cast(),
        iov_len: len as usize,
    }];
    let mode = fgds_tests::guest::expected_mode()?;
    let release = common::kernel_release()?;
    let want = match mode.as_str() {
        _ if release.starts_with("6.1.") => libc::EOPNOTSUPP,
        "generic" => libc::EFAULT,
        "p2pdma" | "exporter-p2pdma" => libc::EREMOTEIO,
        other => bail!("unexpected fgds mode {other:?}"),
    };
    // SAFETY: the mapping outlives the ring; a registration that should not have worked is
    // undone below before the mapping goes.
    match unsafe { ring.submitter().register_buffers(&iov) } {
        Ok(()) => {
            ring.submitter().unregister_buffers()?;
            bail!("io_uring pinned fgds memory ({mode} pages) long-term as a fixed buffer");
        }
        Err(err) => ensure!(
            err.raw_os_error() == Some(want),
            "IORING_REGISTER_BUFFERS on {mode} pages failed with {err}, want errno {want}"
        ),
    }
    let off = 21 * MIB;
    let sqe =
        io_uring::opcode::Read::new(io_uring::types::Fd(nvme.as_raw_fd()), map.ptr, len as u32)
            .offset(off)
            .build();
    // SAFETY: the mapping stays until completion, waited for here.
    unsafe { ring.submission().push(&sqe) }.map_err(|_| anyhow::anyhow!("queue full"))?;
    ring.submit_and_wait(1)?;
    let res = ring.completion().next().map(|c| c.result()).unwrap_or(-1);
    ensure!(res == len as i32, "READ after the refusal returned {res}");
    common::check_nvme_pattern(
        off,
        &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
    )?;
    ktap::pass()
}

fn nonzero_dmabuf_offset() -> CaseResult {
    let size = 8 * MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    let (dmabuf, _) = common::alloc(&vgpu, size)?;
    common::gpu_fill(dmabuf.as_fd(), size as usize, 0xaa)?;
    let (off, len) = (3 * MIB + PAGE, 2 * MIB);
    let idx = common::reg(&node, dmabuf.as_fd(), off, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let nvme_off = 7 * MIB;
    common::pread_raw(&nvme, map.ptr, len as usize, nvme_off).context("pread")?;
    let all = common::gpu_read(dmabuf.as_fd(), size as usize, 0, size as usize)?;
    common::check_nvme_pattern(nvme_off, &all[off as usize..(off + len) as usize])?;
    ensure!(
        all[..off as usize].iter().all(|&b| b == 0xaa)
            && all[(off + len) as usize..].iter().all(|&b| b == 0xaa),
        "bytes outside the registered range changed"
    );
    ktap::pass()
}

fn several_buffers_per_fd() -> CaseResult {
    let len = MIB;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let nvme = common::nvme(false)?;
    let mut bufs = Vec::new();
    for i in 0..4u64 {
        let (dmabuf, _) = common::alloc(&vgpu, len)?;
        let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
        let map = Map::shared(&node, idx, len as usize)?;
        bufs.push((dmabuf, idx, map, 11 * MIB + i * 3 * MIB));
    }
    let idxs = bufs.iter().map(|b| b.1).collect::<Vec<_>>();
    let mut sorted = idxs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    ensure!(sorted.len() == idxs.len(), "tokens not unique: {idxs:?}");
    for (_, _, map, nvme_off) in &bufs {
        common::pread_raw(&nvme, map.ptr, len as usize, *nvme_off)?;
    }
    for (dmabuf, _, _, nvme_off) in &bufs {
        common::check_nvme_pattern(
            *nvme_off,
            &common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?,
        )?;
    }
    ktap::pass()
}

fn two_processes() -> CaseResult {
    // SAFETY: single-threaded test process.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        bail!("fork: {}", std::io::Error::last_os_error());
    }
    let mine = (0..4)
        .try_for_each(|i| read_into_gpu(4 * MIB, if pid == 0 { 20 } else { 30 } * MIB + i * MIB));
    if pid == 0 {
        // SAFETY: leave the child directly.
        unsafe { libc::_exit(i32::from(mine.is_err())) };
    }
    let child = common::wait(pid)?;
    mine.context("parent")?;
    ensure!(child == 0, "child failed (status {child})");
    ktap::pass()
}

/// O_DIRECT on a file in an ext4 filesystem (iomap direct I/O), both directions, through the
/// mapping and through fgds's commands. The rig mounts one and names its mount point in
/// FGDS_EXT4.
fn ext4_file() -> CaseResult {
    file_on("FGDS_EXT4", "ext4", 0x4558_5434, true)
}

/// The same on xfs, the other file system fgds's commands take.
fn xfs_file() -> CaseResult {
    file_on("FGDS_XFS", "xfs", 0x5846_5321, true)
}

/// The same on btrfs through the mapping (btrfs checksums data with the CPU, so the kernel
/// reads the GPU's pages itself); fgds's commands refuse btrfs (EREMOTEIO) and move nothing.
fn btrfs_file() -> CaseResult {
    file_on("FGDS_BTRFS", "btrfs", 0x4254_5246, false)
}

/// A file system's case: the rig mounts it and names its mount point in `var` where the
/// kernel has it.
fn file_on(var: &str, fs: &str, seed: u64, commands: bool) -> CaseResult {
    let Some(dir) = std::env::var_os(var) else {
        return ktap::skip(format_args!(
            "the kernel has no {fs} ({var} unset: the rig mounts it where /proc/filesystems \
             lists it)"
        ));
    };
    file_in(std::path::Path::new(&dir), seed)?;
    commands_on(std::path::Path::new(&dir), fs, seed, commands)
}

/// fgds's own reads and writes (FGDS_IOCTL_READ/WRITE) of a file in `dir`: the file's bytes
/// into GPU memory and back to another part of the file where `allowed`, else EREMOTEIO with
/// nothing moved.
fn commands_on(dir: &std::path::Path, fs: &str, seed: u64, allowed: bool) -> CaseResult {
    let len = 4 * MIB;
    let path = dir.join("fgds-commands.bin");
    let mut ram = AlignedBuf::new(len as usize)?;
    pattern::fill(seed ^ 1, 0, ram.as_mut_slice());
    std::fs::write(&path, ram.as_slice())?;
    let file = fgds_tests::guest::open_direct(&path, true)?;
    let node = common::open_node()?;
    let (dmabuf, _) = common::alloc(&common::vgpu()?, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let io = |file_offset| fgds::uapi::Io {
        idx,
        offset: 0,
        len,
        file_offset,
        fd: file.as_raw_fd(),
        flags: 0,
    };
    let read = common::ioctl_io(&node, false, &io(0));
    if !allowed {
        ensure!(
            read == Err(libc::EREMOTEIO),
            "FGDS_IOCTL_READ of a file on {fs}: {read:?}, not EREMOTEIO"
        );
        let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
        ensure!(
            pattern::first_mismatch(seed ^ 1, 0, &got).is_some(),
            "the refused read of {fs} moved the file's bytes into GPU memory"
        );
        let _ = std::fs::remove_file(&path);
        return ktap::pass();
    }
    ensure!(
        read == Ok(len as usize),
        "FGDS_IOCTL_READ of a file on {fs}: {read:?}"
    );
    let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    ensure!(
        pattern::first_mismatch(seed ^ 1, 0, &got).is_none(),
        "GPU memory differs from the {fs} file after FGDS_IOCTL_READ"
    );
    let wrote = common::ioctl_io(&node, true, &io(len));
    ensure!(
        wrote == Ok(len as usize),
        "FGDS_IOCTL_WRITE to a file on {fs}: {wrote:?}"
    );
    file.read_exact_at(ram.as_mut_slice(), len)?;
    ensure!(
        pattern::first_mismatch(seed ^ 1, 0, ram.as_slice()).is_none(),
        "the {fs} file differs where FGDS_IOCTL_WRITE put the GPU's bytes"
    );
    let _ = std::fs::remove_file(&path);
    ktap::pass()
}

fn file_in(dir: &std::path::Path, seed: u64) -> CaseResult {
    let len = 8 * MIB;
    let path = dir.join("fgds-data.bin");
    let mut ram = AlignedBuf::new(len as usize)?;
    pattern::fill(seed, 0, ram.as_mut_slice());
    std::fs::write(&path, ram.as_slice())?;
    let file = fgds_tests::guest::open_direct(&path, true)?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, len)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    let map = Map::shared(&node, idx, len as usize)?;
    let n = common::pread_raw(&file, map.ptr, len as usize, 0).context("pread file -> GPU")?;
    ensure!(n == len as usize, "short pread {n}");
    let got = common::gpu_read(dmabuf.as_fd(), len as usize, 0, len as usize)?;
    ensure!(
        pattern::first_mismatch(seed, 0, &got).is_none(),
        "GPU memory differs from the file"
    );
    let n = common::pwrite_raw(&file, map.ptr, len as usize, len).context("pwrite GPU -> file")?;
    ensure!(n == len as usize, "short pwrite {n}");
    file.read_exact_at(ram.as_mut_slice(), len)?;
    ensure!(
        pattern::first_mismatch(seed, 0, ram.as_slice()).is_none(),
        "file data written from the GPU differs"
    );
    ktap::pass()
}
