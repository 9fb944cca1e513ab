//! Raw access to the fgds driver for the driver's in-guest tests (`fgds_*` binaries): every
//! system call is made by hand so that each errno the UAPI documents can be checked.

use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;

use anyhow::{Context, bail};
use fgds::uapi;
use rustix::io::Errno;

pub const PAGE: u64 = 4096;
pub const MIB: u64 = 1 << 20;

/// The rig's vgpu instance: `vgpuN` (normally vgpu0; a rebind can make it another number).
pub fn vgpu_name() -> anyhow::Result<String> {
    crate::guest::vgpu_name()
}

/// The PCI address of the rig's GPU.
pub fn vgpu_bdf() -> anyhow::Result<String> {
    let dev = std::fs::canonicalize(format!("/sys/class/vgpu/{}/device", vgpu_name()?))
        .context("vgpu device link")?;
    Ok(dev
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default())
}

/// The fgds node of the rig's GPU.
pub fn node_path() -> anyhow::Result<PathBuf> {
    let bdf = vgpu_bdf()?;
    let name = format!("fgds_{}", bdf.replace([':', '.'], "_"));
    let path = PathBuf::from("/dev").join(&name);
    if !path.exists() {
        bail!(
            "{} missing: is fgds loaded with devices={bdf}?",
            path.display()
        );
    }
    Ok(path)
}

/// The node's sysfs directory.
pub fn sysfs_dir() -> anyhow::Result<PathBuf> {
    let node = node_path()?;
    Ok(PathBuf::from("/sys/class/fgds").join(node.file_name().expect("node name")))
}

pub fn sysfs(attr: &str) -> anyhow::Result<String> {
    let path = sysfs_dir()?.join(attr);
    Ok(std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read {}", path.display()))?
        .trim()
        .to_owned())
}

pub fn sysfs_u64(attr: &str) -> anyhow::Result<u64> {
    let s = sysfs(attr)?;
    s.parse()
        .with_context(|| format!("{attr}: not a number: {s:?}"))
}

pub fn open_node() -> anyhow::Result<File> {
    let path = node_path()?;
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))
}

pub fn vgpu() -> anyhow::Result<File> {
    crate::guest::vgpu_open()
}

/// A vgpu buffer: its dma-buf and its offset in BAR2.
pub fn alloc(vgpu: &File, size: u64) -> anyhow::Result<(OwnedFd, u64)> {
    Ok(fgds::vgpu::alloc(vgpu, size)?)
}

pub fn reg_raw(node: BorrowedFd<'_>, arg: &mut uapi::RegBuffer) -> Result<(), Errno> {
    // SAFETY: RegBuffer is struct fgds_ioctl_reg_buffer; the opcode encodes its size.
    unsafe {
        rustix::ioctl::ioctl(
            node,
            rustix::ioctl::Updater::<{ uapi::REG_BUFFER }, uapi::RegBuffer>::new(arg),
        )
    }
}

pub fn reg(node: &File, dmabuf: BorrowedFd<'_>, offset: u64, size: u64) -> Result<u64, Errno> {
    let mut arg = uapi::RegBuffer {
        dmabuf_fd: dmabuf.as_raw_fd(),
        flags: 0,
        dmabuf_offset: offset,
        size,
        idx: 0,
    };
    reg_raw(node.as_fd(), &mut arg)?;
    Ok(arg.idx)
}

pub fn unreg(node: &File, idx: u64) -> Result<(), Errno> {
    let arg = uapi::UnregBuffer { idx };
    // SAFETY: UnregBuffer is struct fgds_ioctl_unreg_buffer; the kernel only reads it.
    unsafe {
        rustix::ioctl::ioctl(
            node.as_fd(),
            rustix::ioctl::Setter::<{ uapi::UNREG_BUFFER }, _>::new(arg),
        )
    }
}

/// One `FGDS_IOCTL_READ` (`write` false) or `FGDS_IOCTL_WRITE`; the bytes moved or the errno.
pub fn ioctl_io(node: &File, write: bool, arg: &uapi::Io) -> Result<usize, i32> {
    let request = if write {
        uapi::IOCTL_WRITE
    } else {
        uapi::IOCTL_READ
    };
    // SAFETY: `Io` is `struct fgds_io`, which the kernel only reads.
    let res = unsafe { libc::ioctl(node.as_raw_fd(), request as _, arg) };
    match res {
        n if n >= 0 => Ok(n as usize),
        _ => Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)),
    }
}

/// The SQE of one `FGDS_URING_CMD_READ` (`write` false) or `WRITE` on `node`, for a ring of
/// 128-byte entries; the command carries `arg` inline.
pub fn io_cmd(node: &File, write: bool, arg: &uapi::Io) -> io_uring::squeue::Entry128 {
    let op = if write {
        uapi::URING_CMD_WRITE
    } else {
        uapi::URING_CMD_READ
    };
    io_uring::opcode::UringCmd80::new(io_uring::types::Fd(node.as_raw_fd()), op)
        .cmd(arg.to_cmd())
        .build()
}

/// A mapping made with raw mmap(2) flags; unmapped on drop (what is left of it).
pub struct Map {
    pub ptr: *mut u8,
    pub len: usize,
}

impl Map {
    pub fn new(node: &File, idx: u64, len: usize, flags: i32) -> Result<Map, Errno> {
        // SAFETY: a new mapping at an address the kernel picks aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                node.as_raw_fd(),
                idx as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Errno::from_raw_os_error(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            ));
        }
        Ok(Map { ptr: p.cast(), len })
    }

    /// A private anonymous mapping, never touched.
    pub fn anonymous(len: usize) -> anyhow::Result<Map> {
        // SAFETY: a new mapping at an address the kernel picks aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        anyhow::ensure!(
            p != libc::MAP_FAILED,
            "mmap: {}",
            std::io::Error::last_os_error()
        );
        Ok(Map { ptr: p.cast(), len })
    }

    pub fn shared(node: &File, idx: u64, len: usize) -> anyhow::Result<Map> {
        Map::new(node, idx, len, libc::MAP_SHARED).map_err(|e| anyhow::anyhow!("mmap: {e}"))
    }

    pub fn at(&self, off: usize) -> *mut u8 {
        assert!(off <= self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { self.ptr.add(off) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: exactly the range mapped in new() (a partial munmap shrinks len first).
            unsafe { libc::munmap(self.ptr.cast(), self.len) };
        }
    }
}

/// The NVMe namespace, O_DIRECT.
pub fn nvme(write: bool) -> anyhow::Result<File> {
    crate::guest::open_direct(&crate::guest::nvme_path()?, write)
}

/// pread(2) into a raw address until done or error; returns bytes done or the errno.
// Tests pass addresses here on purpose that may be unmapped, revoked or GPU memory: the
// kernel checks them (EFAULT) or a throwaway child takes the signal, so the raw pointer is
// the point, not a contract the caller must keep.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn pread_raw(file: &File, ptr: *mut u8, len: usize, off: u64) -> Result<usize, Errno> {
    raw_io(len, off, |done, at| {
        // SAFETY: the kernel checks the range and fails with EFAULT where it is not mapped.
        unsafe {
            libc::pread(
                file.as_raw_fd(),
                ptr.wrapping_add(done).cast(),
                len - done,
                at,
            )
        }
    })
}

/// pwrite(2) from a raw address until done or error; returns bytes done or the errno.
// As for pread_raw().
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn pwrite_raw(file: &File, ptr: *const u8, len: usize, off: u64) -> Result<usize, Errno> {
    raw_io(len, off, |done, at| {
        // SAFETY: the kernel checks the range and fails with EFAULT where it is not mapped.
        unsafe {
            libc::pwrite(
                file.as_raw_fd(),
                ptr.wrapping_add(done).cast(),
                len - done,
                at,
            )
        }
    })
}

/// Calls `call(done, file offset)` until `len` bytes are done, a call moves none, or one fails.
fn raw_io(
    len: usize,
    off: u64,
    mut call: impl FnMut(usize, libc::off_t) -> isize,
) -> Result<usize, Errno> {
    let mut done = 0;
    while done < len {
        let n = call(done, (off + done as u64) as libc::off_t);
        if n < 0 {
            return Err(Errno::from_raw_os_error(
                std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            ));
        }
        if n == 0 {
            break;
        }
        done += n as usize;
    }
    Ok(done)
}

/// Reads GPU memory through vgpu's own CPU mapping of the dma-buf.
pub fn gpu_read(
    dmabuf: BorrowedFd<'_>,
    size: usize,
    off: usize,
    len: usize,
) -> anyhow::Result<Vec<u8>> {
    let map = fgds::CpuMapping::new(dmabuf, size)?;
    let mut out = vec![0u8; len];
    map.read(off, &mut out);
    Ok(out)
}

/// Writes GPU memory through vgpu's own CPU mapping of the dma-buf.
pub fn gpu_write(
    dmabuf: BorrowedFd<'_>,
    size: usize,
    off: usize,
    data: &[u8],
) -> anyhow::Result<()> {
    let map = fgds::CpuMapping::new(dmabuf, size)?;
    map.write(off, data);
    Ok(())
}

pub fn gpu_fill(dmabuf: BorrowedFd<'_>, size: usize, byte: u8) -> anyhow::Result<()> {
    gpu_write(dmabuf, size, 0, &vec![byte; size])
}

/// Fails unless `buf` is the NVMe pattern at `nvme_off`.
pub fn check_nvme_pattern(nvme_off: u64, buf: &[u8]) -> anyhow::Result<()> {
    use crate::pattern;
    if let Some(at) = pattern::first_mismatch(pattern::NVME_SEED, nvme_off, buf) {
        bail!(
            "data differs from the NVMe pattern at byte {} of the buffer",
            at
        );
    }
    Ok(())
}

/// Revokes the vgpu buffer at `bar_offset` (as the GPU driver does on eviction).
pub fn revoke(bar_offset: u64) -> anyhow::Result<()> {
    let path = format!("/sys/class/vgpu/{}/revoke", vgpu_name()?);
    std::fs::write(&path, format!("{bar_offset}")).with_context(|| format!("cannot write {path}"))
}

/// Runs `f` in a forked child and returns its wait status (exit code, or 128 + signal).
pub fn in_child(f: impl FnOnce() -> i32) -> anyhow::Result<i32> {
    // SAFETY: the test binaries are single-threaded when they fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        bail!("fork: {}", std::io::Error::last_os_error());
    }
    if pid == 0 {
        let code = f();
        // SAFETY: leave the child without running the parent's atexit handlers.
        unsafe { libc::_exit(code) };
    }
    wait(pid)
}

pub fn wait(pid: libc::pid_t) -> anyhow::Result<i32> {
    let mut status = 0;
    // SAFETY: plain waitpid on our own child.
    if unsafe { libc::waitpid(pid, &mut status, 0) } != pid {
        bail!("waitpid: {}", std::io::Error::last_os_error());
    }
    Ok(if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    })
}

/// Reads one byte of a mapping in a child; returns its wait status (128 + SIGBUS on SIGBUS).
/// Unlike [`touch_in_child`], it changes nothing where the mapping still works.
// Tests pass addresses here on purpose that may be unmapped, revoked or GPU memory: the
// kernel checks them (EFAULT) or a throwaway child takes the signal, so the raw pointer is
// the point, not a contract the caller must keep.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn load_in_child(ptr: *const u8) -> anyhow::Result<i32> {
    in_child(|| {
        // SAFETY: a deliberate access to a possibly revoked mapping, in a throwaway child.
        let _ = unsafe { std::ptr::read_volatile(ptr) };
        0
    })
}

/// Touches one byte of a mapping in a child; returns its wait status (128 + SIGBUS on SIGBUS).
// Tests pass addresses here on purpose that may be unmapped, revoked or GPU memory: the
// kernel checks them (EFAULT) or a throwaway child takes the signal, so the raw pointer is
// the point, not a contract the caller must keep.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn touch_in_child(ptr: *mut u8) -> anyhow::Result<i32> {
    in_child(|| {
        // SAFETY: a deliberate access to a possibly revoked mapping, in a throwaway child.
        unsafe { std::ptr::write_volatile(ptr, 0x5a) };
        0
    })
}

/// Whether the GPU's DMA is translated by an IOMMU (its group's domain type is DMA or DMA-FQ).
pub fn gpu_dma_translated() -> anyhow::Result<bool> {
    let bdf = vgpu_bdf()?;
    let ty = std::fs::read_to_string(format!("/sys/bus/pci/devices/{bdf}/iommu_group/type"))
        .unwrap_or_default();
    Ok(ty.trim().starts_with("DMA"))
}

/// None if fgds accepts this setup, else why it refuses it (`EOPNOTSUPP: ...`), from one probe
/// registration (see [`crate::guest::fgds_refusal`]).
pub fn refusal() -> anyhow::Result<Option<String>> {
    crate::guest::fgds_refusal()
}

static REFUSAL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn skip_refused() -> crate::ktap::CaseResult {
    crate::ktap::skip(
        REFUSAL
            .get()
            .map_or("EOPNOTSUPP: fgds refuses this setup", String::as_str),
    )
}

/// Runs `cases`, or skips every one of them when fgds refuses this setup.
pub fn run_unless_refused(cases: &[crate::ktap::Case]) -> ! {
    run_refusing(cases, &[])
}

/// Runs `cases`; when fgds refuses this setup (REG_BUFFER fails with EOPNOTSUPP and sysfs
/// `mode` reads `refused`), those not named in `without_reg` (the cases that need no
/// successful registration) are skipped with a reason that starts with `EOPNOTSUPP:`. Whether
/// that skip is expected is the host's expected-outcome table's to say (xtask/src/expected.rs).
/// A probe that fails otherwise is printed and every case runs (and fails on its own).
pub fn run_refusing(cases: &[crate::ktap::Case], without_reg: &[&str]) -> ! {
    // Every program that comes here allocates from vgpu.
    crate::guest::skip_unless_vgpu();
    let refused = refusal().unwrap_or_else(|err| {
        crate::ktap::diag(format_args!("{err:#}"));
        None
    });
    if let Some(reason) = refused {
        let _ = REFUSAL.set(reason);
        let cases = cases
            .iter()
            .map(|c| crate::ktap::Case {
                name: c.name,
                run: if without_reg.contains(&c.name) {
                    c.run
                } else {
                    skip_refused
                },
            })
            .collect::<Vec<_>>();
        crate::ktap::run(&cases)
    }
    crate::ktap::run(cases)
}

/// The guest kernel's release (`uname -r`).
pub fn kernel_release() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .context("cannot read /proc/sys/kernel/osrelease")?
        .trim()
        .to_owned())
}

/// A qemu-io command on the raw drive's block node (blkdebug breakpoints), through the host.
pub fn qemu_io(cmd: &str) -> anyhow::Result<()> {
    let out = crate::ctl::request(&format!("hmp qemu-io nvme0-disk \"{cmd}\""))?;
    anyhow::ensure!(out.trim().is_empty(), "qemu-io {cmd:?}: {out}");
    Ok(())
}

/// A blkdebug breakpoint on the raw drive, named by a tag: QEMU suspends the first read that
/// reaches it until [`Breakpoint::resume`]. Dropping it removes and resumes it whatever
/// happened.
pub struct Breakpoint(&'static str);

impl Breakpoint {
    pub fn arm(tag: &'static str) -> anyhow::Result<Breakpoint> {
        qemu_io(&format!("break read_aio {tag}"))?;
        Ok(Breakpoint(tag))
    }

    pub fn resume(&self) -> anyhow::Result<()> {
        qemu_io(&format!("resume {}", self.0))
    }
}

impl Drop for Breakpoint {
    fn drop(&mut self) {
        let _ = qemu_io(&format!("remove_break {}", self.0));
        let _ = qemu_io(&format!("resume {}", self.0));
    }
}

/// Maps token `idx` of a registration of a read-only dma-buf and checks that it stays
/// read-only: `mmap` with `PROT_WRITE` fails with `EACCES`, a read-only `mmap` works, and
/// `mprotect` to writable fails with `EACCES`. Returns the read-only mapping.
pub fn map_readonly_checked(node: &File, idx: u64, len: usize) -> anyhow::Result<Map> {
    match Map::new(node, idx, len, libc::MAP_SHARED) {
        Err(Errno::ACCESS) => {}
        Err(e) => bail!("a writable mapping of a read-only dma-buf failed with {e}, want EACCES"),
        Ok(_) => bail!("a read-only dma-buf gave a writable mapping"),
    }
    // SAFETY: a new read-only mapping at an address the kernel picks.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            node.as_raw_fd(),
            idx as libc::off_t,
        )
    };
    anyhow::ensure!(
        ptr != libc::MAP_FAILED,
        "a read-only mapping failed: {}",
        std::io::Error::last_os_error()
    );
    let map = Map {
        ptr: ptr.cast(),
        len,
    };
    // SAFETY: changes the protection of our own mapping only.
    let r = unsafe { libc::mprotect(ptr, len, libc::PROT_READ | libc::PROT_WRITE) };
    anyhow::ensure!(
        r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EACCES),
        "mprotect(PROT_WRITE) of the read-only mapping gave {r}, want EACCES"
    );
    Ok(map)
}

/// `FGDS_IOCTL_CHECK_FILE` as given: the answer or the errno.
pub fn check_file_raw(node: &File, idx: u64, fd: i32, flags: u32) -> Result<uapi::CheckFile, i32> {
    let mut arg = uapi::CheckFile {
        idx,
        fd,
        flags,
        ..uapi::CheckFile::default()
    };
    // SAFETY: `CheckFile` is `struct fgds_check_file`, read and written in place.
    if unsafe {
        libc::ioctl(
            node.as_raw_fd(),
            uapi::IOCTL_CHECK_FILE as _,
            &mut arg as *mut uapi::CheckFile,
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    Ok(arg)
}
