//! Where fgds's own reads and writes may go (driver/fgds/gate.c): files whose I/O completes
//! only when some process decides (a pipe, a socket), files whose data the CPU copies (tmpfs)
//! and block devices whose queues take no P2PDMA pages (loop, brd, zram, dm-crypt) are refused
//! with EREMOTEIO by both ioctls and both io_uring commands, before a page is handed out; a
//! revocation started while a write into a full pipe is attempted ends at once; with P2PDMA
//! pages, a queue that may merge is refused; and where fgds
//! goes, one ring's batch of adjacent reads and writes alternating RAM and GPU memory, from two
//! processes at once, puts every byte where it belongs.

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, ioctl_io};
use fgds::uapi;
use fgds_tests::guest::{AlignedBuf, LoopDevice, Md};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};
use io_uring::squeue::{Entry, Entry128};
use io_uring::{IoUring, opcode, types};

/// NVMe scratch area of this program.
const SCRATCH: u64 = 200 * MIB;
const SEED_GPU: u64 = 0x4741_5445;
const SEED_SENTINEL: u64 = 0x4741_5453;
/// Where this program mounts a tmpfs of its own.
const TMPFS: &str = "/mnt/fgds-gate";
/// The bound a refused call's revocation must meet: nothing was admitted, so nothing waits.
const REVOKE_BOUND: Duration = Duration::from_secs(5);

fn main() {
    common::run_unless_refused(&[
        Case {
            name: "pipe_and_socket_refused",
            run: pipe_and_socket_refused,
        },
        Case {
            name: "tmpfs_file_refused",
            run: tmpfs_file_refused,
        },
        Case {
            name: "loop_device_refused",
            run: loop_device_refused,
        },
        Case {
            name: "brd_refused",
            run: || ram_disk_refused("brd", "CONFIG_BLK_DEV_RAM", brd),
        },
        Case {
            name: "zram_refused",
            run: || ram_disk_refused("zram", "CONFIG_ZRAM", zram),
        },
        Case {
            name: "dm_crypt_refused",
            run: dm_crypt_refused,
        },
        Case {
            name: "dm_linear_refused",
            run: dm_linear_refused,
        },
        Case {
            name: "nvme_over_tcp_refused",
            run: nvme_over_tcp_refused,
        },
        Case {
            name: "md_raid0_over_two_drives",
            run: md_raid0_over_two_drives,
        },
        Case {
            name: "drive_outside_the_switch_refused",
            run: drive_outside_the_switch_refused,
        },
        Case {
            name: "check_file_names_the_path",
            run: check_file_names_the_path,
        },
        Case {
            name: "revocation_not_held_by_a_full_pipe",
            run: revocation_not_held_by_a_full_pipe,
        },
        Case {
            name: "merging_queue_refused_for_p2pdma_pages",
            run: merging_queue_refused,
        },
        Case {
            name: "ram_and_gpu_alternating_in_one_batch",
            run: ram_and_gpu_alternating_in_one_batch,
        },
    ])
}

/// One registration of `len` bytes of vgpu memory, filled with the sentinel.
struct Reg {
    node: File,
    _dmabuf: OwnedFd,
    idx: u64,
    bar_off: u64,
}

fn registration(len: u64) -> anyhow::Result<Reg> {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, len)?;
    fault::vgpu_fill(bar_off, len, SEED_SENTINEL)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, len)?;
    Ok(Reg {
        node,
        _dmabuf: dmabuf,
        idx,
        bar_off,
    })
}

fn io_arg(idx: u64, len: u64, fd: i32, file_offset: u64) -> uapi::Io {
    uapi::Io {
        idx,
        offset: 0,
        len,
        file_offset,
        fd,
        flags: 0,
    }
}

/// One `FGDS_URING_CMD_READ`/`WRITE` on a ring of its own: bytes moved or the errno; None where
/// this kernel's io_uring cannot carry fgds's commands (EOPNOTSUPP, Linux 6.1).
fn command_io(
    node: &File,
    write: bool,
    arg: &uapi::Io,
) -> anyhow::Result<Option<Result<usize, i32>>> {
    let mut ring = IoUring::<Entry128>::builder()
        .build(2)
        .context("io_uring_setup with 128-byte entries")?;
    let sqe = common::io_cmd(node, write, arg);
    // SAFETY: the command carries its argument inline; it refers to no memory.
    unsafe { ring.submission().push(&sqe) }.context("submission queue full")?;
    ring.submit_and_wait(1)?;
    match ring.completion().next().map(|c| c.result()) {
        Some(res) if res == -libc::EOPNOTSUPP => Ok(None),
        Some(res) if res >= 0 => Ok(Some(Ok(res as usize))),
        Some(res) => Ok(Some(Err(-res))),
        None => bail!("no completion for the command"),
    }
}

/// fgds's four ways (ioctl and command, read and write) with `fd` at `file_offset`: each must
/// fail with EREMOTEIO, `FGDS_IOCTL_CHECK_FILE` must give `want` (`enum fgds_path`) as the
/// reason, and GPU memory must still hold its sentinel. `what` names the file.
fn require_refused(reg: &Reg, fd: i32, what: &str, want: u32) -> anyhow::Result<()> {
    const LEN: u64 = 64 * 1024;
    let mark = fgds_tests::guest::kernel_log_mark()?;
    for write in [false, true] {
        let dir = if write { "WRITE" } else { "READ" };
        let (path, _) = check_file(reg, fd, write)?;
        ensure!(
            path == want,
            "FGDS_IOCTL_CHECK_FILE ({dir}) says {path} for {what}, want {want}"
        );
        let arg = io_arg(reg.idx, LEN, fd, 0);
        match ioctl_io(&reg.node, write, &arg) {
            Err(e) if e == libc::EREMOTEIO => {}
            Err(e) => bail!(
                "FGDS_IOCTL_{dir} with {what} failed with {}, want EREMOTEIO",
                std::io::Error::from_raw_os_error(e)
            ),
            Ok(n) => bail!("FGDS_IOCTL_{dir} with {what} was accepted ({n} bytes moved)"),
        }
        match command_io(&reg.node, write, &arg)? {
            None => ktap::diag(format_args!(
                "no io_uring commands on this kernel: {what} checked through the ioctls"
            )),
            Some(Err(e)) if e == libc::EREMOTEIO => {}
            Some(Err(e)) => bail!(
                "FGDS_URING_CMD_{dir} with {what} failed with {}, want EREMOTEIO",
                std::io::Error::from_raw_os_error(e)
            ),
            Some(Ok(n)) => bail!("FGDS_URING_CMD_{dir} with {what} was accepted ({n} bytes)"),
        }
    }
    // The driver's line (ratelimited, so only shown, never required).
    let fd_tag = format!("fd {fd}");
    if let Some(line) = fgds_tests::guest::kernel_log_since(mark)?
        .into_iter()
        .find(|l| l.contains(&fd_tag))
    {
        ktap::diag(format_args!("{what}: {line}"));
    }
    ctl::gpu_check(reg.bar_off, LEN, SEED_SENTINEL)
        .with_context(|| format!("GPU memory after the refused calls with {what}"))
}

/// `pipe2(O_DIRECT)` (packet mode) both ends, and both ends of a socket pair.
fn pipe_and_socket_refused() -> CaseResult {
    fault::require_idle()?;
    let reg = registration(MIB)?;
    let (r, w) = pipe(libc::O_DIRECT | libc::O_NONBLOCK)?;
    require_refused(
        &reg,
        r.as_raw_fd(),
        "the read end of an O_DIRECT pipe",
        PATH_FILE_TYPE,
    )?;
    require_refused(
        &reg,
        w.as_raw_fd(),
        "the write end of an O_DIRECT pipe",
        PATH_FILE_TYPE,
    )?;
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two descriptors into the array, which we then own.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, fds.as_mut_ptr()) } != 0 {
        let err = std::io::Error::last_os_error();
        // The build: kernels have no networking at all.
        ensure!(
            err.raw_os_error() == Some(libc::ENOSYS),
            "socketpair: {err}"
        );
        ktap::diag("no sockets on this kernel (no CONFIG_NET): the pipe stands for them");
    } else {
        // SAFETY: both are fresh descriptors of ours.
        let (a, _b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        require_refused(&reg, a.as_raw_fd(), "a Unix socket", PATH_FILE_TYPE)?;
    }
    drop(reg);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

fn pipe(flags: i32) -> anyhow::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array, which we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), flags) } != 0 {
        bail!("pipe2: {}", std::io::Error::last_os_error());
    }
    // SAFETY: both are fresh descriptors of ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A tmpfs of this program's own at [`TMPFS`].
fn tmpfs() -> anyhow::Result<&'static Path> {
    let dir = Path::new(TMPFS);
    fgds_tests::guest::tmpfs(dir)?;
    Ok(dir)
}

/// A file of `len` bytes on [`TMPFS`].
fn tmpfs_file(name: &str, len: u64) -> anyhow::Result<PathBuf> {
    let path = tmpfs()?.join(name);
    let file = File::create(&path)?;
    file.set_len(len)?;
    Ok(path)
}

/// Opens `path` for reading and writing with O_DIRECT, or without it where the file refuses
/// O_DIRECT (tmpfs before 6.6): either way fgds must refuse it, before the O_DIRECT check.
fn open_rw(path: &Path) -> anyhow::Result<File> {
    let direct = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    match direct {
        Ok(file) => Ok(file),
        Err(err) if err.raw_os_error() == Some(libc::EINVAL) => {
            ktap::diag(format_args!("{} takes no O_DIRECT here", path.display()));
            Ok(OpenOptions::new().read(true).write(true).open(path)?)
        }
        Err(err) => Err(err).with_context(|| format!("open {}", path.display())),
    }
}

fn tmpfs_file_refused() -> CaseResult {
    fault::require_idle()?;
    let path = tmpfs_file("tmpfs.bin", 4 * MIB)?;
    let file = open_rw(&path)?;
    let reg = registration(MIB)?;
    require_refused(&reg, file.as_raw_fd(), "a file on tmpfs", PATH_FS)?;
    drop((reg, file));
    std::fs::remove_file(path)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

fn loop_device_refused() -> CaseResult {
    fault::require_idle()?;
    let backing = tmpfs_file("loop.bin", 8 * MIB)?;
    let dev = LoopDevice::new(&backing)?;
    let file = open_rw(&dev.path)?;
    let reg = registration(MIB)?;
    require_refused(&reg, file.as_raw_fd(), "a loop device", PATH_QUEUE)?;
    drop((reg, file, dev));
    std::fs::remove_file(backing)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// Whether the guest kernel has what `option` builds: the rig loads the module where the
/// kernel has it as one, so its sysfs directory tells (`/sys/module/NAME`, or the device's).
fn kernel_has(option: &str) -> bool {
    let dir = match option {
        "CONFIG_BLK_DEV_RAM" => "/sys/block/ram0",
        "CONFIG_ZRAM" => "/sys/block/zram0",
        "CONFIG_DM_CRYPT" => "/sys/module/dm_crypt",
        _ => return false,
    };
    Path::new(dir).exists()
}

fn brd() -> anyhow::Result<PathBuf> {
    Ok(PathBuf::from("/dev/ram0"))
}

fn zram() -> anyhow::Result<PathBuf> {
    let size = Path::new("/sys/block/zram0/disksize");
    if std::fs::read_to_string(size)?.trim() == "0" {
        std::fs::write(size, "16M").context("write 16M to /sys/block/zram0/disksize")?;
    }
    Ok(PathBuf::from("/dev/zram0"))
}

fn ram_disk_refused(what: &str, option: &str, dev: fn() -> anyhow::Result<PathBuf>) -> CaseResult {
    if !kernel_has(option) {
        return ktap::skip(format!("the kernel has no {what} ({option})"));
    }
    fault::require_idle()?;
    let path = dev()?;
    let file = open_rw(&fgds_tests::guest::wait_for_node(&path).map(|_| path.clone())?)?;
    let reg = registration(MIB)?;
    require_refused(
        &reg,
        file.as_raw_fd(),
        &format!("{what} ({})", path.display()),
        PATH_QUEUE,
    )?;
    drop((reg, file));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// A device-mapper device made with the DM ioctls, removed when dropped.
struct Dm {
    name: String,
    path: PathBuf,
}

/// `struct dm_ioctl` (include/uapi/linux/dm-ioctl.h), 312 bytes, then what follows it.
const DM_HDR: usize = 312;

fn dm_ioctl(nr: u8, name: &str, flags: u32, payload: &[u8], targets: u32) -> anyhow::Result<u64> {
    let control = File::open("/dev/mapper/control").context("open /dev/mapper/control")?;
    let mut buf = vec![0u8; DM_HDR + payload.len() + 4096];
    let size = buf.len() as u32;
    buf[0..4].copy_from_slice(&4u32.to_ne_bytes());
    buf[12..16].copy_from_slice(&size.to_ne_bytes()); // data_size
    buf[16..20].copy_from_slice(&(DM_HDR as u32).to_ne_bytes()); // data_start
    buf[20..24].copy_from_slice(&targets.to_ne_bytes()); // target_count
    buf[28..32].copy_from_slice(&flags.to_ne_bytes());
    buf[48..48 + name.len()].copy_from_slice(name.as_bytes());
    buf[DM_HDR..DM_HDR + payload.len()].copy_from_slice(payload);
    // _IOWR(0xfd, nr, struct dm_ioctl)
    let req = (3u64 << 30) | ((DM_HDR as u64) << 16) | (0xfd << 8) | nr as u64;
    // SAFETY: the buffer is data_size bytes long, as the header says.
    if unsafe { libc::ioctl(control.as_raw_fd(), req as libc::c_ulong, buf.as_mut_ptr()) } != 0 {
        bail!(
            "DM ioctl {nr} for {name}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(u64::from_ne_bytes(buf[40..48].try_into()?))
}

impl Dm {
    /// A dm-crypt target over `backing` (sectors of 512 bytes), with a fixed test key.
    fn crypt(name: &str, backing: &Path, sectors: u64) -> anyhow::Result<Dm> {
        let params = format!(
            "aes-cbc-plain {} 0 {} 0",
            "00".repeat(32),
            backing.display()
        );
        Dm::create(name, "crypt", &params, sectors)
    }

    /// A dm-linear target (what LVM makes) over `sectors` of `backing` from sector `start`.
    fn linear(name: &str, backing: &Path, start: u64, sectors: u64) -> anyhow::Result<Dm> {
        Dm::create(
            name,
            "linear",
            &format!("{} {start}", backing.display()),
            sectors,
        )
    }

    /// One target of `kind` with `params`, `sectors` long, loaded and resumed.
    fn create(name: &str, kind: &str, params: &str, sectors: u64) -> anyhow::Result<Dm> {
        const DM_DEV_CREATE: u8 = 3;
        const DM_DEV_SUSPEND: u8 = 6;
        const DM_TABLE_LOAD: u8 = 9;
        dm_ioctl(DM_DEV_CREATE, name, 0, &[], 0)?;
        let mut dm = Dm {
            name: name.to_owned(),
            path: PathBuf::new(),
        };
        let params = format!("{params}\0");
        let mut spec = vec![0u8; 40];
        spec[8..16].copy_from_slice(&sectors.to_ne_bytes());
        let next = (40 + params.len()).next_multiple_of(8);
        spec[20..24].copy_from_slice(&(next as u32).to_ne_bytes());
        spec[24..24 + kind.len()].copy_from_slice(kind.as_bytes());
        spec.extend_from_slice(params.as_bytes());
        spec.resize(next, 0);
        dm_ioctl(DM_TABLE_LOAD, name, 0, &spec, 1)?;
        let dev = dm_ioctl(DM_DEV_SUSPEND, name, 0, &[], 0)?;
        // Linux's new_encode_dev(): minor's low byte, major, minor's high bits.
        let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
        dm.path = PathBuf::from(format!("/dev/dm-{minor}"));
        Ok(dm)
    }
}

impl Drop for Dm {
    fn drop(&mut self) {
        const DM_DEV_REMOVE: u8 = 4;
        let _ = dm_ioctl(DM_DEV_REMOVE, &self.name, 0, &[], 0);
    }
}

fn dm_crypt_refused() -> CaseResult {
    if !kernel_has("CONFIG_DM_CRYPT") {
        return ktap::skip("the kernel has no dm-crypt (CONFIG_DM_CRYPT)");
    }
    fault::require_idle()?;
    let backing = tmpfs_file("crypt.bin", 8 * MIB)?;
    let under = LoopDevice::new(&backing)?;
    let dm = Dm::crypt("fgds-gate-crypt", &under.path, 8 * MIB / 512)?;
    let file = open_rw(&fgds_tests::guest::wait_for_node(&dm.path).map(|_| dm.path.clone())?)?;
    let reg = registration(MIB)?;
    require_refused(&reg, file.as_raw_fd(), "a dm-crypt target", PATH_QUEUE)?;
    drop((reg, file));
    crate_bounces_saying_why(&dm.path, "dm-crypt", QUEUE_REASON)?;
    drop((dm, under));
    std::fs::remove_file(backing)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// How [`fgds::gate::Verdict::explain`] begins for `FGDS_PATH_QUEUE`.
const QUEUE_REASON: &str = "its block device's queue takes no P2PDMA pages";

/// dm-linear (what LVM makes) over the drive's scratch area: the kernel's dm takes no P2PDMA
/// pages, so fgds refuses it four ways with its verdict, and the crate reads it through RAM
/// saying why.
fn dm_linear_refused() -> CaseResult {
    if !Path::new("/dev/mapper/control").exists() {
        return ktap::skip("the kernel has no device mapper (CONFIG_BLK_DEV_DM)");
    }
    fault::require_idle()?;
    let nvme = fgds_tests::guest::nvme_path()?;
    let dm = Dm::linear("fgds-gate-linear", &nvme, SCRATCH / 512, 16 * MIB / 512)?;
    let file = open_rw(&fgds_tests::guest::wait_for_node(&dm.path).map(|_| dm.path.clone())?)?;
    let reg = registration(MIB)?;
    require_refused(&reg, file.as_raw_fd(), "a dm-linear target", PATH_QUEUE)?;
    drop((reg, file));
    crate_bounces_saying_why(&dm.path, "dm-linear", QUEUE_REASON)?;
    drop(dm);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// `FGDS_PATH_*` of the UAPI (`enum fgds_path`).
const PATH_DIRECT: u32 = 0;
const PATH_FILE_TYPE: u32 = 1;
const PATH_FS: u32 = 3;
const PATH_QUEUE: u32 = 5;
const PATH_NO_PCI: u32 = 6;
const PATH_NO_P2P: u32 = 7;
const PATH_MERGES: u32 = 8;
const PATH_NOT_O_DIRECT: u32 = 9;

/// `FGDS_IOCTL_CHECK_FILE` of `fd` for the registration: the path, and the device doing the
/// DMA (`DDDD:BB:DD.F`) where the driver found one.
fn check_file(reg: &Reg, fd: i32, write: bool) -> anyhow::Result<(u32, Option<String>)> {
    let flags = if write { uapi::CHECK_WRITE } else { 0 };
    let arg = common::check_file_raw(&reg.node, reg.idx, fd, flags).map_err(|e| {
        anyhow::anyhow!(
            "FGDS_IOCTL_CHECK_FILE: {}",
            std::io::Error::from_raw_os_error(e)
        )
    })?;
    Ok((arg.path, arg.dma_dev()))
}

/// The crate's [`fgds::GpuFile`] reads `path` (4 MiB of a pattern written through RAM first)
/// into vgpu memory, and the bytes arrive; how it went.
fn crate_read(path: &Path, what: &str) -> anyhow::Result<fgds::Completion> {
    const LEN: u64 = 4 * MIB;
    const SEED: u64 = 0x4741_5442;
    let mut data = AlignedBuf::new(LEN as usize)?;
    pattern::fill(SEED, 0, data.as_mut_slice());
    OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .and_then(|f| f.write_all_at(data.as_slice(), 0))
        .with_context(|| format!("writing the pattern to {} through RAM", path.display()))?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, LEN)?;
    fault::vgpu_fill(bar_off, LEN, SEED_SENTINEL)?;
    let registry = fgds::Registry::new();
    let mem = registry.dmabuf_memory(dmabuf.as_fd(), 0, LEN, None)?;
    let file = fgds::GpuFile::open(path, "r")?;
    let done = file.read(&mem, LEN, 0, 0, &fgds::Options::DEFAULT)?;
    ktap::diag(format_args!("the crate's read of {what}: {done:?}"));
    ctl::gpu_check(bar_off, LEN, SEED)
        .with_context(|| format!("GPU memory after reading {what}"))?;
    ensure!(
        done.bytes == LEN,
        "the crate's read of {what} moved {done:?}"
    );
    Ok(done)
}

/// [`crate_read`] of `path`: all of it through RAM, labelled bounce, with the driver's reason
/// (`why`, the start of [`fgds::gate::Verdict::explain`]).
fn crate_bounces_saying_why(path: &Path, what: &str, why: &str) -> anyhow::Result<()> {
    let done = crate_read(path, what)?;
    let reason = done.reason.clone().unwrap_or_default();
    ensure!(
        done.path == fgds::IoPath::Bounce && done.bounced == done.bytes && reason.contains(why),
        "the crate's read of {what} went {done:?}: want all of it through RAM, labelled bounce, \
         with the driver's reason ({why:?})"
    );
    Ok(())
}

/// md RAID0 over ranges of the two drives, both behind the GPU's switch. fgds's own I/O refuses
/// the array (its disk has no PCI device to check, or, where the kernel's md takes no P2PDMA
/// pages, its queue), saying which; where the kernel's md takes P2PDMA pages, the crate's read
/// goes direct through the mapped address (the kernel's P2PDMA checks judge each member) and
/// `fgds doctor` says so, member by member; elsewhere it goes through RAM with the reason.
fn md_raid0_over_two_drives() -> CaseResult {
    if !Path::new("/sys/module/raid0").exists() {
        return ktap::skip("the kernel has no md RAID0 as a module (CONFIG_MD_RAID0)");
    }
    fault::require_idle()?;
    let nvme = fgds_tests::guest::nvme_path()?;
    let nvme2 = fault::drive_by_serial("fgds1").context("no second drive (serial fgds1)")?;
    let md = Md::raid0(
        "md_fgds",
        &[(&nvme, SCRATCH), (&nvme2, 64 * MIB)],
        16 * MIB,
        128 * 1024,
    )?;
    let file = open_rw(&md.path)?;
    let reg = registration(MIB)?;
    let (path, _) = check_file(&reg, file.as_raw_fd(), false)?;
    ensure!(
        path == PATH_NO_PCI || path == PATH_QUEUE,
        "FGDS_IOCTL_CHECK_FILE says {path} for md RAID0, want {PATH_NO_PCI} or {PATH_QUEUE}"
    );
    require_refused(&reg, file.as_raw_fd(), "an md RAID0 array", path)?;
    drop((reg, file));
    if path == PATH_QUEUE {
        crate_bounces_saying_why(&md.path, "md RAID0", QUEUE_REASON)?;
    } else {
        let done = crate_read(&md.path, "md RAID0")?;
        ensure!(
            done.path == fgds::IoPath::Direct && done.bounced == 0,
            "the crate's read of md RAID0 went {done:?}, want direct (the mapped address)"
        );
        let said = doctor(&md.path)?;
        ktap::diag(format_args!("fgds doctor {}: {said}", md.path.display()));
        let members = said["members"].as_array().cloned().unwrap_or_default();
        ensure!(
            said["path"] == "direct"
                && members.len() == 2
                && members
                    .iter()
                    .all(|m| m["gate"] == "direct" || m["gate"] == "merges"),
            "fgds doctor says {said} for md RAID0 over two reachable drives"
        );
    }
    drop(md);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// QEMU's id of the drive outside the GPU's switch, how to plug it in (the rig's own arguments:
/// qemu/src/machine.rs, `far_image`), and its serial.
const FAR_ID: &str = "nvme2";
const FAR_ADD: &str = "nvme,id=nvme2,serial=fgds2,drive=nvme2-disk,bus=rpfar";
const FAR_SERIAL: &str = "fgds2";

/// The drive outside the GPU's switch, plugged in for a case and unplugged when dropped.
struct FarDrive {
    path: PathBuf,
}

impl FarDrive {
    /// None where the machine has no port for it (a run without `+field`, or with a vIOMMU).
    fn plug() -> anyhow::Result<Option<FarDrive>> {
        if !std::fs::read_to_string("/proc/cmdline")?.contains("fgds.far=1") {
            return Ok(None);
        }
        ctl::device_add(FAR_ADD).context("plugging in the drive outside the switch")?;
        let mut path = None;
        fault::wait_until(
            "the drive outside the switch",
            Duration::from_secs(30),
            || {
                path = fault::drive_by_serial(FAR_SERIAL);
                Ok(path.is_some())
            },
        )?;
        let Some(path) = path else { return Ok(None) };
        // The node comes before the disk is ready to open (ENXIO until then).
        fgds_tests::guest::wait_for_node(&path)?;
        Ok(Some(FarDrive { path }))
    }
}

impl Drop for FarDrive {
    fn drop(&mut self) {
        if let Err(err) = ctl::device_del(FAR_ID) {
            ktap::diag(format_args!(
                "unplugging the drive outside the switch: {err:#}"
            ));
        }
    }
}

/// A drive plugged in outside the GPU's switch, after fgds set up the GPU's pages (the host
/// bridge between them lets no P2P through): fgds refuses it four ways, naming the path
/// (`FGDS_PATH_NO_P2P`) and the controller; md RAID0 over it and a reachable drive is refused
/// too, and the crate's read of the array goes through RAM naming the member that stops it, as
/// `fgds doctor` does.
fn drive_outside_the_switch_refused() -> CaseResult {
    fault::require_idle()?;
    // The GPU's pages first, so that the drive comes after their set-up.
    let reg = registration(MIB)?;
    let Some(far) = FarDrive::plug()? else {
        return ktap::skip(
            "no port outside the GPU's switch in this machine (a run without +field, or with \
             --iommu, where every device has a root port of its own)",
        );
    };
    let file = open_rw(&far.path)?;
    let (path, dev) = check_file(&reg, file.as_raw_fd(), false)?;
    ensure!(
        path == PATH_NO_P2P && dev.is_some(),
        "FGDS_IOCTL_CHECK_FILE says {path} ({dev:?}) for a drive outside the switch, want \
         {PATH_NO_P2P} with its controller"
    );
    require_refused(
        &reg,
        file.as_raw_fd(),
        "a drive outside the switch",
        PATH_NO_P2P,
    )?;
    drop((reg, file));
    if Path::new("/sys/module/raid0").exists() {
        let nvme = fgds_tests::guest::nvme_path()?;
        let md = Md::raid0(
            "md_far",
            &[(&nvme, SCRATCH), (&far.path, 64 * MIB)],
            16 * MIB,
            128 * 1024,
        )?;
        let reg = registration(MIB)?;
        let (gate, _) = check_file(&reg, open_rw(&md.path)?.as_raw_fd(), false)?;
        drop(reg);
        if gate == PATH_QUEUE {
            // This kernel's md takes no P2PDMA pages: that is the reason, whatever the members.
            crate_bounces_saying_why(&md.path, "md RAID0", QUEUE_REASON)?;
            drop((md, far));
            fault::wait_counters_zero("after the case")?;
            return ktap::pass();
        }
        let far_name = far
            .path
            .file_name()
            .context("the drive's node has no name")?
            .to_string_lossy()
            .into_owned();
        let done = crate_read(&md.path, "md RAID0 with a member outside the switch")?;
        let reason = done.reason.clone().unwrap_or_default();
        ensure!(
            done.path == fgds::IoPath::Bounce
                && done.bounced == done.bytes
                && reason.contains(&format!("{far_name} not: the drive's controller")),
            "the crate's read of md RAID0 with {far_name} outside the switch went {done:?}: want \
             it through RAM, naming {far_name}"
        );
        let said = doctor(&md.path)?;
        ktap::diag(format_args!("fgds doctor {}: {said}", md.path.display()));
        ensure!(
            said["path"] == "bounce"
                && said["members"].as_array().is_some_and(|m| m
                    .iter()
                    .any(|m| m["name"] == far_name.as_str() && m["gate"] == "no-p2p-path")),
            "fgds doctor says {said} for md RAID0 with {far_name} outside the switch"
        );
        drop(md);
    } else {
        ktap::diag("no md RAID0 here: the drive alone was checked");
    }
    drop(far);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// `fgds doctor --json FILE` with the rig's vgpu memory.
fn doctor(file: &Path) -> anyhow::Result<serde_json::Value> {
    let vgpu = common::vgpu_name()?;
    let out = std::process::Command::new("/bin/fgds")
        .args([
            "doctor",
            "--json",
            "--vgpu",
            vgpu.trim_start_matches("vgpu"),
        ])
        .arg(file)
        .output()?;
    ensure!(
        out.status.success(),
        "fgds doctor {}: {}",
        file.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The NQN of the subsystem [`nvme_over_tcp_refused`] exports.
const TCP_NQN: &str = "nqn.2026-12.io.fgds:gate";
const NVMET: &str = "/sys/kernel/config/nvmet";

/// The kernel's NVMe target exporting a file over TCP on the loopback, and the kernel's NVMe
/// host connected to it; both undone when dropped.
struct NvmeTcp {
    /// The host's controller, `nvmeN`.
    controller: Option<String>,
    /// The namespace's block device.
    path: PathBuf,
}

impl NvmeTcp {
    fn new(backing: &Path) -> anyhow::Result<NvmeTcp> {
        loopback_up()?;
        let config = Path::new("/sys/kernel/config");
        if !config.join("nvmet").exists() {
            rustix::mount::mount(
                "configfs",
                config,
                "configfs",
                rustix::mount::MountFlags::empty(),
                None,
            )
            .context("mount configfs on /sys/kernel/config")?;
        }
        let mut tcp = NvmeTcp {
            controller: None,
            path: PathBuf::new(),
        };
        let subsys = Path::new(NVMET).join("subsystems").join(TCP_NQN);
        let ns = subsys.join("namespaces/1");
        let port = Path::new(NVMET).join("ports/1");
        let put = |path: PathBuf, value: &str| {
            std::fs::write(&path, value)
                .with_context(|| format!("write {value:?} to {}", path.display()))
        };
        std::fs::create_dir(&subsys).context("create the nvmet subsystem")?;
        put(subsys.join("attr_allow_any_host"), "1")?;
        std::fs::create_dir(&ns)?;
        put(ns.join("device_path"), &backing.to_string_lossy())?;
        put(ns.join("buffered_io"), "1")?;
        put(ns.join("enable"), "1")?;
        std::fs::create_dir(&port)?;
        put(port.join("addr_trtype"), "tcp")?;
        put(port.join("addr_adrfam"), "ipv4")?;
        put(port.join("addr_traddr"), "127.0.0.1")?;
        put(port.join("addr_trsvcid"), "4420")?;
        std::os::unix::fs::symlink(&subsys, port.join("subsystems").join(TCP_NQN))
            .context("link the subsystem to the port")?;
        let mut fabrics = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/nvme-fabrics")
            .context("open /dev/nvme-fabrics")?;
        fabrics
            .write_all(
                format!("transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn={TCP_NQN}").as_bytes(),
            )
            .context("connect to the target over TCP")?;
        let mut answer = String::new();
        std::io::Read::read_to_string(&mut fabrics, &mut answer)?;
        let instance = answer
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("instance="))
            .with_context(|| format!("/dev/nvme-fabrics answered {answer:?}"))?;
        tcp.controller = Some(format!("nvme{instance}"));
        let mut found = None;
        fault::wait_until("the namespace over TCP", Duration::from_secs(20), || {
            found = tcp_namespace()?;
            Ok(found.is_some())
        })?;
        tcp.path = found.context("the namespace over TCP")?;
        fgds_tests::guest::wait_for_node(&tcp.path)?;
        Ok(tcp)
    }
}

/// The block device of the namespace of [`TCP_NQN`], once there: a disk (not hidden) whose
/// device (the controller, or with native multipath the subsystem) has that NQN.
fn tcp_namespace() -> anyhow::Result<Option<PathBuf>> {
    for entry in std::fs::read_dir("/sys/block")? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        // A multipath head's paths (nvmeXcYnZ) are hidden disks without a node.
        let hidden = std::fs::read_to_string(format!("/sys/block/{name}/hidden"))
            .is_ok_and(|h| h.trim() == "1");
        if hidden {
            continue;
        }
        let nqn = std::fs::read_to_string(format!("/sys/block/{name}/device/subsysnqn"))
            .unwrap_or_default();
        if nqn.trim() == TCP_NQN {
            return Ok(Some(PathBuf::from(format!("/dev/{name}"))));
        }
    }
    Ok(None)
}

impl Drop for NvmeTcp {
    fn drop(&mut self) {
        if let Some(ctrl) = &self.controller {
            let _ = std::fs::write(format!("/sys/class/nvme/{ctrl}/delete_controller"), "1");
        }
        let subsys = Path::new(NVMET).join("subsystems").join(TCP_NQN);
        let port = Path::new(NVMET).join("ports/1");
        let _ = std::fs::remove_file(port.join("subsystems").join(TCP_NQN));
        let _ = std::fs::remove_dir(&port);
        let _ = std::fs::write(subsys.join("namespaces/1/enable"), "0");
        let _ = std::fs::remove_dir(subsys.join("namespaces/1"));
        let _ = std::fs::remove_dir(&subsys);
    }
}

/// Brings the loopback interface up (no init script does here).
fn loopback_up() -> anyhow::Result<()> {
    // SAFETY: a datagram socket of our own, closed below.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    ensure!(sock >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: `sock` is a fresh descriptor of ours.
    let sock = unsafe { OwnedFd::from_raw_fd(sock) };
    // SAFETY: an all-zero `ifreq` is valid; the name and flags are set below.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads the `ifreq` we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } != 0 {
        bail!("bring lo up: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// A namespace of the kernel's own NVMe target, over TCP on the loopback, through the
/// kernel's NVMe host: its queue takes no P2PDMA pages (the TCP transport copies with the CPU),
/// so fgds refuses it four ways with EREMOTEIO and says why; the crate reads it through RAM,
/// labelled so, with that reason; and `fgds doctor` names the bounce path.
fn nvme_over_tcp_refused() -> CaseResult {
    if !Path::new("/sys/module/nvmet_tcp").exists() || !Path::new("/sys/module/nvme_tcp").exists() {
        return ktap::skip(
            "the kernel has no NVMe over TCP as modules (CONFIG_NVME_TARGET_TCP, CONFIG_NVME_TCP)",
        );
    }
    fault::require_idle()?;
    let backing = tmpfs_file("tcp.bin", 16 * MIB)?;
    let tcp = NvmeTcp::new(&backing)?;
    ktap::diag(format_args!(
        "{} is the namespace over TCP ({})",
        tcp.path.display(),
        tcp.controller.as_deref().unwrap_or("?")
    ));
    let file = open_rw(&tcp.path)?;
    let reg = registration(MIB)?;
    let (path, _) = check_file(&reg, file.as_raw_fd(), false)?;
    // A multipath head stacks the path's limits (no P2PDMA pages), or, if it kept them, has no
    // PCI device: refused either way.
    ensure!(
        path == PATH_QUEUE || path == PATH_NO_PCI,
        "FGDS_IOCTL_CHECK_FILE says {path} for the namespace over TCP"
    );
    require_refused(&reg, file.as_raw_fd(), "a namespace over NVMe/TCP", path)?;
    drop((reg, file));
    let why = if path == PATH_QUEUE {
        QUEUE_REASON
    } else {
        "hangs from no PCI device"
    };
    crate_bounces_saying_why(&tcp.path, "a namespace over NVMe/TCP", why)?;
    drop(tcp);
    std::fs::remove_file(backing)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// The driver's gate on the files fgds takes: the raw namespace and a file on ext4 are direct,
/// with the drive's controller as the DMA device; the namespace open without O_DIRECT says so;
/// with P2PDMA pages, a queue that may merge says so; `fgds doctor FILE` prints the same; and
/// bad input and a revoked registration get their errnos.
fn check_file_names_the_path() -> CaseResult {
    fault::require_idle()?;
    let reg = registration(MIB)?;
    let nvme_path = fgds_tests::guest::nvme_path()?;
    let controller = std::fs::canonicalize(format!(
        "/sys/block/{}/device/device",
        nvme_path
            .file_name()
            .context("the drive's node has no name")?
            .to_string_lossy()
    ))?;
    let controller = controller
        .file_name()
        .context("the controller's sysfs path")?
        .to_string_lossy()
        .into_owned();
    let nvme = fgds::open_direct(&nvme_path, true)?;
    let ext4 = std::path::Path::new(
        &std::env::var_os("FGDS_EXT4").context("the rig provides no ext4 (FGDS_EXT4)")?,
    )
    .join("fgds_gate.bin");
    File::create(&ext4)?.set_len(MIB)?;
    let ext4_file = fgds::open_direct(&ext4, true)?;
    let ext4_controller = {
        let (_, dev) = check_file(&reg, ext4_file.as_raw_fd(), false)?;
        dev
    };
    for write in [false, true] {
        let got = check_file(&reg, nvme.as_raw_fd(), write)?;
        ensure!(
            got == (PATH_DIRECT, Some(controller.clone())),
            "the raw namespace ({}) gives {got:?}, want direct through {controller}",
            if write { "write" } else { "read" }
        );
        let got = check_file(&reg, ext4_file.as_raw_fd(), write)?;
        ensure!(
            got.0 == PATH_DIRECT && got.1.is_some(),
            "a file on ext4 gives {got:?}, want direct through the ext4 namespace's controller"
        );
    }
    let buffered = File::open(&nvme_path)?;
    let got = check_file(&reg, buffered.as_raw_fd(), false)?;
    ensure!(
        got.0 == PATH_NOT_O_DIRECT,
        "the namespace without O_DIRECT gives {got:?}, want {PATH_NOT_O_DIRECT} (not O_DIRECT)"
    );
    if fgds_tests::guest::expected_mode()? != "generic" {
        let nomerges = nomerges_path()?;
        let before = std::fs::read_to_string(&nomerges)?;
        std::fs::write(&nomerges, "0")?;
        let got = check_file(&reg, nvme.as_raw_fd(), false);
        std::fs::write(&nomerges, before.trim())?;
        ensure!(
            got?.0 == PATH_MERGES,
            "a merging queue with P2PDMA pages is not reported as such"
        );
    }
    // The CLI prints the driver's answer.
    let said = doctor(&nvme_path)?;
    ktap::diag(format_args!("fgds doctor {}: {said}", nvme_path.display()));
    ensure!(
        said["path"] == "direct" && said["dma_device"] == controller.as_str(),
        "fgds doctor says {said} for the raw namespace"
    );
    let said = doctor(&ext4)?;
    ensure!(
        said["path"] == "direct" && said["dma_device"] == ext4_controller.as_deref().unwrap_or(""),
        "fgds doctor says {said} for a file on ext4"
    );
    let backing = tmpfs_file("doctor.bin", 8 * MIB)?;
    let dev = LoopDevice::new(&backing)?;
    let said = doctor(&dev.path)?;
    ktap::diag(format_args!("fgds doctor {}: {said}", dev.path.display()));
    ensure!(
        said["path"] == "bounce" && said["gate"] == "queue",
        "fgds doctor says {said} for a loop device"
    );
    // Bad input, each with its errno; then a revoked registration.
    let fd = nvme.as_raw_fd();
    for (what, idx, fd, flags, want) in [
        ("unknown flags", reg.idx, fd, 0x2, libc::EINVAL),
        ("a token not page-aligned", reg.idx + 1, fd, 0, libc::EINVAL),
        ("no such token", reg.idx + (1 << 30), fd, 0, libc::ENOENT),
        ("no such file", reg.idx, -1, 0, libc::EBADF),
    ] {
        let got = common::check_file_raw(&reg.node, idx, fd, flags).err();
        ensure!(
            got == Some(want),
            "FGDS_IOCTL_CHECK_FILE with {what}: errno {got:?}, want {want}"
        );
    }
    common::revoke(reg.bar_off)?;
    let got = common::check_file_raw(&reg.node, reg.idx, fd, 0).err();
    ensure!(
        got == Some(libc::ENODEV),
        "FGDS_IOCTL_CHECK_FILE of a revoked registration: errno {got:?}, want ENODEV"
    );
    drop((reg, nvme, ext4_file, buffered, dev));
    std::fs::remove_file(&ext4)?;
    std::fs::remove_file(backing)?;
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// The reviewer's reproduction: fill an O_DIRECT pipe that nobody reads, ask fgds to write a
/// registration into it from another thread, then revoke the buffer. fgds must refuse the
/// write, and the revocation must end within [`REVOKE_BOUND`]; a driver that took the write
/// would hold the revocation until the pipe is drained (the case drains it after the bound).
fn revocation_not_held_by_a_full_pipe() -> CaseResult {
    fault::require_idle()?;
    let reg = registration(2 * MIB)?;
    let (idx, bar_off) = (reg.idx, reg.bar_off);
    let (r, w) = pipe(libc::O_DIRECT)?;
    // Fill the pipe: non-blocking for the fill only.
    // SAFETY: fcntl on our own descriptor.
    unsafe {
        libc::fcntl(
            w.as_raw_fd(),
            libc::F_SETFL,
            libc::O_NONBLOCK | libc::O_DIRECT,
        )
    };
    let mut w_file = File::from(w);
    let chunk = [0u8; 4096];
    let mut filled = 0;
    while w_file.write(&chunk).is_ok() {
        filled += 1;
    }
    // SAFETY: as above; blocking again, so that an admitted write would wait.
    unsafe { libc::fcntl(w_file.as_raw_fd(), libc::F_SETFL, libc::O_DIRECT) };
    ktap::diag(format_args!("the pipe holds {filled} packets of 4 KiB"));
    let node2 = reg.node.try_clone()?;
    let wfd = w_file.as_raw_fd();
    let writer = std::thread::spawn(move || ioctl_io(&node2, true, &io_arg(idx, 4096, wfd, 0)));
    std::thread::sleep(Duration::from_millis(200));
    let start = Instant::now();
    let revoker = std::thread::spawn(move || common::revoke(bar_off));
    while !revoker.is_finished() && start.elapsed() < REVOKE_BOUND {
        std::thread::sleep(Duration::from_millis(10));
    }
    let took = start.elapsed();
    let held = !revoker.is_finished();
    // Unblock whatever is still waiting before judging.
    let mut r_file = File::from(r);
    let mut sink = vec![0u8; 4096];
    while !writer.is_finished() || !revoker.is_finished() {
        // SAFETY: fcntl on our own descriptor.
        unsafe { libc::fcntl(r_file.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
        let _ = std::io::Read::read(&mut r_file, &mut sink);
        std::thread::sleep(Duration::from_millis(5));
    }
    let written = writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer panicked"))?;
    revoker
        .join()
        .map_err(|_| anyhow::anyhow!("revoker panicked"))?
        .context("the revocation")?;
    ensure!(
        !held,
        "the revocation was still waiting after {took:?}, held up by fgds's write into a full pipe \
         (it ended when the pipe was drained; the write gave {written:?})"
    );
    ensure!(
        written == Err(libc::EREMOTEIO),
        "FGDS_IOCTL_WRITE into a full O_DIRECT pipe gave {written:?}, want Err(EREMOTEIO)"
    );
    ktap::diag(format_args!("the revocation took {took:?}"));
    drop((reg, w_file));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// The raw drive's `/sys/block/NAME/queue/nomerges`.
fn nomerges_path() -> anyhow::Result<PathBuf> {
    let dev = fgds_tests::guest::nvme_path()?;
    let name = dev
        .file_name()
        .context("the raw drive's path has no name")?
        .to_string_lossy()
        .into_owned();
    Ok(PathBuf::from(format!("/sys/block/{name}/queue/nomerges")))
}

/// With the raw drive's queue allowed to merge (nomerges 0), fgds refuses its reads and writes
/// of P2PDMA pages, which must never share a request with RAM (GENERIC pages are RAM to the DMA
/// layer, so they go); the crate's `Transfer` then takes the mapped address.
fn merging_queue_refused() -> CaseResult {
    fault::require_idle()?;
    let nomerges = nomerges_path()?;
    let before = std::fs::read_to_string(&nomerges)?;
    let reg = registration(MIB)?;
    let nvme = common::nvme(true)?;
    fault::write_nvme_pattern(SEED_GPU, MIB as usize, SCRATCH)?;
    std::fs::write(&nomerges, "0")?;
    let got = ioctl_io(
        &reg.node,
        false,
        &io_arg(reg.idx, 64 * 1024, nvme.as_raw_fd(), SCRATCH),
    );
    let crate_read = crate_read_while_merging(&nvme);
    std::fs::write(&nomerges, before.trim())?;
    let (path, bar_off) = crate_read?;
    ktap::diag(format_args!("the crate's Transfer took {path:?}"));
    ctl::gpu_check(bar_off, MIB, SEED_GPU).context("GPU memory after the crate's read")?;
    let p2pdma_pages = fgds_tests::guest::expected_mode()? != "generic";
    let refuse = p2pdma_pages;
    match (refuse, got) {
        (true, Err(e)) if e == libc::EREMOTEIO => {}
        (false, Ok(n)) if n == 64 * 1024 => {}
        (true, got) => bail!(
            "a read from a queue that may merge gave {got:?}, want EREMOTEIO: the pages are P2PDMA"
        ),
        (false, got) => bail!("a read from a queue that may merge gave {got:?}, want 65536 bytes"),
    }
    // Refused commands: the crate's Transfer takes the mapped address, whose user pages the
    // kernel keeps out of merges itself (REQ_NOMERGE); else the commands (none on 6.1).
    let want = if refuse || command_io(&reg.node, false, &uapi::Io::default())?.is_none() {
        fgds::TransferPath::Mapped
    } else {
        fgds::TransferPath::Command
    };
    ensure!(
        path == Some(want),
        "the crate's Transfer went {path:?}, want {want:?}"
    );
    drop((reg, nvme));
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// 1 MiB of the raw drive into a new registration through the crate's `Transfer`: the path it
/// took and where the buffer lies in BAR2.
fn crate_read_while_merging(nvme: &File) -> anyhow::Result<(Option<fgds::TransferPath>, u64)> {
    let gpu = fgds::Gpu::open(&common::vgpu_bdf()?)?;
    let vgpu = common::vgpu()?;
    let (dmabuf, bar_off) = common::alloc(&vgpu, MIB)?;
    let buffer = gpu.register(dmabuf.as_fd(), 0, MIB)?;
    let mut transfer = fgds::Transfer::new(fgds::TransferConfig {
        chunk_size: 256 * 1024,
        queue_depth: 4,
    })?;
    let n = transfer.run(
        fgds::Direction::Read,
        &buffer,
        0..MIB as usize,
        nvme,
        SCRATCH,
    )?;
    ensure!(n == MIB as usize, "the crate's read moved {n} bytes");
    Ok((transfer.last_run_path(), bar_off))
}

/// Adjacent 64 KiB ranges of the raw drive, even ones read into GPU memory by fgds's command,
/// odd ones into RAM by io_uring's read, all in one submission; then the same ranges written
/// back elsewhere from both. Two processes do it at once, each on its own area. The host checks
/// GPU memory, the program checks RAM and the drive; the block layer's merge tracepoints are
/// counted and reported.
fn ram_and_gpu_alternating_in_one_batch() -> CaseResult {
    fault::require_idle()?;
    if !std::fs::read_to_string("/proc/filesystems")?.contains("\ttracefs") {
        return ktap::skip(
            "the kernel has no tracefs (CONFIG_TRACING), where the case counts the block \
             layer's merges",
        );
    }
    let reg = registration(4 * MIB)?;
    if command_io(&reg.node, false, &uapi::Io::default())?.is_none() {
        drop(reg);
        return ktap::skip(
            "EOPNOTSUPP: this kernel's io_uring loses the byte count of a driver's command \
             (Linux 6.1): fgds offers only the ioctls",
        );
    }
    const PIECE: u64 = 64 * 1024;
    const PIECES: u64 = 32;
    for area in 0..2 {
        fault::write_nvme_pattern(SEED_GPU + area, (PIECE * PIECES) as usize, area_at(area))?;
    }
    let (result, trace) = fgds_tests::profile::trace(
        &[
            "block/block_bio_backmerge",
            "block/block_bio_frontmerge",
            "block/block_rq_merge",
        ],
        || {
            let child = common::in_child(|| match alternate(&reg, 1, PIECE, PIECES) {
                Ok(()) => 0,
                Err(err) => {
                    ktap::diag(format_args!("the second process: {err:#}"));
                    1
                }
            });
            let mine = alternate(&reg, 0, PIECE, PIECES);
            Ok((child?, mine))
        },
    )?;
    let (child, mine) = result;
    mine?;
    ensure!(child == 0, "the second process failed (status {child})");
    let merges = trace.lines().filter(|l| l.contains("merge")).count();
    ktap::diag(format_args!(
        "{merges} block-layer merges during the batches (the queue's nomerges is {})",
        std::fs::read_to_string(nomerges_path()?)?.trim()
    ));
    for area in 0..2 {
        for i in (0..PIECES).step_by(2) {
            let at = area * 2 * MIB + i / 2 * PIECE;
            ctl::gpu_check_at(reg.bar_off + at, PIECE, SEED_GPU + area, i * PIECE)
                .with_context(|| format!("process {area}: GPU memory of piece {i}"))?;
        }
    }
    drop(reg);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}

/// Where process `area`'s drive area starts (reads); its writes go 16 MiB further.
fn area_at(area: u64) -> u64 {
    SCRATCH + area * 4 * MIB
}

/// Process `area` of [`ram_and_gpu_alternating_in_one_batch`]: GPU pieces land in its 2 MiB
/// half of the registration, one after another; RAM pieces in a buffer of its own.
fn alternate(reg: &Reg, area: u64, piece: u64, pieces: u64) -> anyhow::Result<()> {
    let nvme = common::nvme(true)?;
    let mut ram = AlignedBuf::new((piece * pieces / 2) as usize)?;
    let mut ring = IoUring::<Entry128>::builder()
        .build(64)
        .context("io_uring_setup with 128-byte entries")?;
    let gpu_at = |i: u64| area * 2 * MIB + i / 2 * piece;
    let ram_ptr =
        |ram: &mut AlignedBuf, i: u64| ram.as_mut_slice()[(i / 2 * piece) as usize..].as_mut_ptr();
    for write in [false, true] {
        let drive = area_at(area) + if write { 16 * MIB } else { 0 };
        for i in 0..pieces {
            let off = drive + i * piece;
            let sqe: Entry128 = if i % 2 == 0 {
                let mut arg = io_arg(reg.idx, piece, nvme.as_raw_fd(), off);
                arg.offset = gpu_at(i);
                common::io_cmd(&reg.node, write, &arg)
            } else {
                let ptr = ram_ptr(&mut ram, i);
                let e: Entry = if write {
                    opcode::Write::new(types::Fd(nvme.as_raw_fd()), ptr, piece as u32)
                        .offset(off)
                        .build()
                } else {
                    opcode::Read::new(types::Fd(nvme.as_raw_fd()), ptr, piece as u32)
                        .offset(off)
                        .build()
                };
                e.into()
            };
            // SAFETY: the RAM buffer outlives the batch (we wait for every completion below);
            // fgds's commands carry their argument inline.
            unsafe { ring.submission().push(&sqe.user_data(i)) }.context("queue full")?;
        }
        ring.submit_and_wait(pieces as usize)?;
        let mut seen = 0;
        while seen < pieces {
            ring.submit_and_wait(1)?;
            for cqe in ring.completion() {
                seen += 1;
                ensure!(
                    cqe.result() == piece as i32,
                    "{} of piece {} gave {}",
                    if write { "write" } else { "read" },
                    cqe.user_data(),
                    cqe.result()
                );
            }
        }
        if !write {
            for i in (1..pieces).step_by(2) {
                let start = (i / 2 * piece) as usize;
                let got = &ram.as_slice()[start..start + piece as usize];
                if let Some(at) = pattern::first_mismatch(SEED_GPU + area, i * piece, got) {
                    bail!("RAM piece {i}: byte {at:#x} is not the drive's");
                }
            }
        }
    }
    let mut back = AlignedBuf::new((piece * pieces) as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), area_at(area) + 16 * MIB)?;
    if let Some(at) = pattern::first_mismatch(SEED_GPU + area, 0, back.as_slice()) {
        bail!("the written area's byte {at:#x} is not what was read (GPU and RAM pieces alike)");
    }
    Ok(())
}
