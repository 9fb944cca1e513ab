//! Helpers for in-guest tests: the rig's environment, page-aligned RAM buffers, O_DIRECT files
//! and the test exporter `vgpu`.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::ptr::NonNull;

use anyhow::{Context, bail};

/// The raw NVMe namespace the rig attached (env `FGDS_NVME`).
pub fn nvme_path() -> anyhow::Result<PathBuf> {
    match std::env::var_os("FGDS_NVME") {
        Some(path) => Ok(PathBuf::from(path)),
        None => bail!("FGDS_NVME is not set: run this test inside the rig (cargo xtask test-vm)"),
    }
}

/// Opens `path` with `O_DIRECT`, for reading, or for reading and writing.
pub fn open_direct(path: &std::path::Path, write: bool) -> anyhow::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))
}

/// A page-aligned, zero-filled anonymous RAM buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl AlignedBuf {
    pub fn new(len: usize) -> anyhow::Result<AlignedBuf> {
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing aliases
        // no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .with_context(|| format!("cannot map a {len}-byte buffer"))?;
        Ok(AlignedBuf {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"),
            len,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `new`, and no borrow outlives self.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// The modules the rig loaded, in load order, as the init loaded them (`/run/fgds/modules`):
/// one `path params` line each.
pub fn rig_modules() -> anyhow::Result<Vec<(String, String)>> {
    let text =
        std::fs::read_to_string("/run/fgds/modules").context("cannot read /run/fgds/modules")?;
    Ok(text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split_once(' ') {
            Some((path, params)) => (path.to_owned(), params.to_owned()),
            None => (l.to_owned(), String::new()),
        })
        .collect())
}

/// Whether the running kernel has the symbol `name`, built in or in a loaded module (a line of
/// /proc/kallsyms).
pub fn kernel_has_symbol(name: &str) -> anyhow::Result<bool> {
    let symbols = std::fs::read("/proc/kallsyms").context("read /proc/kallsyms")?;
    // glibc's memmem over the whole text, not a walk over its lines: the rig's unoptimised
    // build splits 5 MB of lines in seconds under TCG, and searches them with `str::contains`
    // at 13 times memmem's cost.
    let found = |needle: String| {
        // SAFETY: both ranges are live slices of the lengths given; memmem only reads them.
        !unsafe {
            libc::memmem(
                symbols.as_ptr().cast(),
                symbols.len(),
                needle.as_ptr().cast(),
                needle.len(),
            )
        }
        .is_null()
    };
    Ok(found(format!(" {name}\n")) || found(format!(" {name}\t")))
}

/// Whether the kernel makes P2PDMA pages 2 MiB folios for fgds (`pci_p2pdma_add_resource_folios()`,
/// the rig's kernel change p2pdma-folios), from its symbols rather than from the driver.
pub fn has_p2pdma_folios() -> anyhow::Result<bool> {
    kernel_has_symbol("pci_p2pdma_add_resource_folios")
}

/// The fgds mode (sysfs `mode`: `generic`, `p2pdma`, `exporter-p2pdma` or `refused`) that the
/// run's configuration implies, from the host's expected-outcome table
/// (xtask/src/expected.rs), never from the driver itself: the init sets `FGDS_EXPECTED_MODE`
/// from the plan.
pub fn expected_mode() -> anyhow::Result<String> {
    std::env::var("FGDS_EXPECTED_MODE").context(
        "FGDS_EXPECTED_MODE is not set: run inside the rig (cargo xtask test-vm), which sets it \
         from the run's configuration",
    )
}

/// Who exports the GPU's memory in this run (`FGDS_EXPORTER`, set by the host from
/// `--exporter`): `vgpu` or `vfio`. Programs run by hand, outside the rig, get `vgpu`.
pub fn exporter() -> String {
    std::env::var("FGDS_EXPORTER").unwrap_or_else(|_| "vgpu".to_owned())
}

/// Why a program or case that needs vgpu cannot run here, if it cannot: the GPU is bound to
/// vfio-pci (`--exporter vfio`), and vgpu is not loaded. The host's expected-outcome table
/// (xtask/src/expected.rs) lets exactly the vgpu programs skip with this reason there.
pub fn vgpu_absence() -> Option<String> {
    let exporter = exporter();
    (exporter != "vgpu").then(|| {
        format!(
            "the GPU is bound to vfio-pci (--exporter {exporter}), not to vgpu, which is not \
             loaded: this needs vgpu (fgds_vfio and uring_dmabuf cover vfio-pci)"
        )
    })
}

/// Exits with the kselftest skip code, the reason on the plan line, when the run has no vgpu
/// ([`vgpu_absence`]).
pub fn skip_unless_vgpu() {
    if let Some(reason) = vgpu_absence() {
        println!("KTAP version 1\n1..0 # SKIP {reason}");
        std::process::exit(4);
    }
}

/// The rig's vgpu instance: `vgpuN` (normally vgpu0; a rebind can make it another number).
pub fn vgpu_name() -> anyhow::Result<String> {
    let mut names = std::fs::read_dir("/sys/class/vgpu")
        .context("no /sys/class/vgpu: is vgpu loaded?")?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Vec<_>>();
    names.sort();
    names.into_iter().next().context("no vgpu device bound")
}

/// Opens the rig's vgpu instance (`/dev/vgpuN` of [`vgpu_name`]).
pub fn vgpu_open() -> anyhow::Result<File> {
    let n = vgpu_name()?
        .trim_start_matches("vgpu")
        .parse()
        .context("vgpu number")?;
    Ok(fgds::vgpu::open(n)?)
}

/// Registers one page of vgpu memory with fgds to find out whether fgds refuses this setup,
/// and reports the mode it then shows (`# fgds-report: fgds mode=...`, which the host checks
/// against the configuration).
///
/// Ok(None): fgds registered it. Ok(Some(reason)): REG_BUFFER failed with EOPNOTSUPP and sysfs
/// `mode` reads `refused`, as designed for GENERIC pages under a translating IOMMU or P2PDMA
/// pages on a kernel without them; the reason starts with `EOPNOTSUPP:`. Any other failure is
/// an error: it is not a refusal, and a case must not skip on it.
pub fn fgds_refusal() -> anyhow::Result<Option<String>> {
    use std::os::fd::AsFd;
    let info = fgds::Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU: is fgds loaded with devices=<the GPU>?")?;
    let gpu = fgds::Gpu::open(&info.bdf)?;
    let (dmabuf, _) = fgds::vgpu::alloc(&vgpu_open()?, 4096)?;
    let res = gpu.register(dmabuf.as_fd(), 0, 4096).map(drop);
    let now = fgds::Gpu::list()?
        .into_iter()
        .find(|g| g.bdf == info.bdf)
        .with_context(|| format!("fgds no longer lists {}", info.bdf))?;
    crate::ktap::diag(format_args!("fgds-report: fgds mode={}", now.mode));
    match res {
        Ok(()) => Ok(None),
        Err(fgds::Error::Register {
            errno: rustix::io::Errno::OPNOTSUPP,
        }) if now.mode == "refused" => Ok(Some(format!(
            "EOPNOTSUPP: fgds refuses this setup as designed (sysfs mode refused{}; the kernel \
             log says why; fgds_badinput::unsafe_setup_refused checks the refusal)",
            if now.iommu.starts_with("DMA") {
                ": GENERIC pages under a translating IOMMU"
            } else {
                ""
            }
        ))),
        Err(err) => Err(anyhow::Error::new(err).context(format!(
            "the probe registration failed, and not as a refusal (sysfs mode {})",
            now.mode
        ))),
    }
}

/// Exits with the kselftest skip code, and the reason on the plan line, if the run has no vgpu
/// ([`skip_unless_vgpu`]) or fgds refuses the setup (see [`fgds_refusal`]). A probe that fails otherwise is printed, and the program's
/// cases run (and fail on their own).
pub fn skip_if_fgds_refuses() {
    skip_unless_vgpu();
    match fgds_refusal() {
        Ok(None) => {}
        Ok(Some(reason)) => {
            println!("KTAP version 1\n1..0 # SKIP {reason}");
            std::process::exit(4);
        }
        Err(err) => crate::ktap::diag(format_args!("{err:#}")),
    }
}

/// The kernel log's sequence number now: `kernel_log_since(mark)` returns the messages logged
/// after `mark = kernel_log_mark()`.
pub fn kernel_log_mark() -> anyhow::Result<u64> {
    Ok(kernel_log()?.last().map_or(0, |(seq, _)| *seq))
}

/// The kernel's messages logged after `mark` ([`kernel_log_mark`]), oldest first.
pub fn kernel_log_since(mark: u64) -> anyhow::Result<Vec<String>> {
    Ok(kernel_log()?
        .into_iter()
        .filter(|(seq, _)| *seq > mark)
        .map(|(_, message)| message)
        .collect())
}

/// Every message in the kernel's ring buffer (/dev/kmsg) with its sequence number, oldest
/// first.
fn kernel_log() -> anyhow::Result<Vec<(u64, String)>> {
    let kmsg = rustix::fs::open(
        "/dev/kmsg",
        rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::NONBLOCK,
        rustix::fs::Mode::empty(),
    )
    .context("cannot open /dev/kmsg")?;
    let mut messages = Vec::new();
    let mut record = vec![0u8; 8192];
    loop {
        match rustix::io::read(&kmsg, &mut record) {
            Ok(n) => {
                // "prio,seq,usecs,flags;message\n", then continuation lines.
                let text = String::from_utf8_lossy(&record[..n]);
                let Some((head, message)) = text.split_once(';') else {
                    continue;
                };
                let seq = head.split(',').nth(1).and_then(|s| s.parse().ok());
                let message = message.lines().next().unwrap_or("").to_owned();
                messages.push((seq.unwrap_or(0), message));
            }
            // A record was overwritten while reading; the next read goes on.
            Err(rustix::io::Errno::PIPE) => continue,
            Err(rustix::io::Errno::AGAIN) => break,
            Err(e) => bail!("reading /dev/kmsg: {e}"),
        }
    }
    Ok(messages)
}

/// Sets `/sys/block/NAME/queue/nomerges` of the disk at `dev` (`/dev/NAME`) to 2, as the rig's
/// init does at boot: fgds's own reads and writes of P2PDMA pages need it (driver/fgds/gate.c).
/// A drive plugged back in or rebound starts at 0 again.
pub fn no_merges(dev: &std::path::Path) -> anyhow::Result<()> {
    let name = dev
        .file_name()
        .with_context(|| format!("{} names no disk", dev.display()))?
        .to_string_lossy();
    let path = format!("/sys/block/{name}/queue/nomerges");
    std::fs::write(&path, "2").with_context(|| format!("cannot write 2 to {path}"))
}

/// Raises `/sys/block/NAME/queue/max_sectors_kb` of the disk at `dev` to `max_hw_sectors_kb`,
/// the driver's own limit (the block layer's default stops at 1280 KiB), and returns it: a
/// benchmark's requests up to that size then reach the drive whole.
pub fn max_sectors_to_hw(dev: &std::path::Path) -> anyhow::Result<u64> {
    let name = dev
        .file_name()
        .with_context(|| format!("{} names no disk", dev.display()))?
        .to_string_lossy();
    let queue = format!("/sys/block/{name}/queue");
    let hw = std::fs::read_to_string(format!("{queue}/max_hw_sectors_kb"))
        .with_context(|| format!("cannot read {queue}/max_hw_sectors_kb"))?;
    let hw = hw.trim();
    std::fs::write(format!("{queue}/max_sectors_kb"), hw)
        .with_context(|| format!("cannot write {hw} to {queue}/max_sectors_kb"))?;
    hw.parse()
        .with_context(|| format!("{queue}/max_hw_sectors_kb: {hw:?}"))
}

/// A tmpfs of the guest's own at `dir`, mounted unless it already is.
pub fn tmpfs(dir: &std::path::Path) -> anyhow::Result<()> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    if mounts.contains(&format!(" {} tmpfs ", dir.display())) {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    rustix::mount::mount(
        "tmpfs",
        dir,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        Some(c"size=64m"),
    )
    .with_context(|| format!("mount tmpfs on {}", dir.display()))
}

/// Opens a device node that devtmpfs may still be creating (bounded wait), for reading and
/// writing.
pub fn wait_for_node(path: &std::path::Path) -> anyhow::Result<File> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match OpenOptions::new().read(true).write(true).open(path) {
            Ok(file) => return Ok(file),
            Err(err) if std::time::Instant::now() > deadline => {
                return Err(err).with_context(|| format!("open {}", path.display()));
            }
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
        }
    }
}

/// A loop device over a file, detached when dropped.
pub struct LoopDevice {
    dev: File,
    /// `/dev/loopN`.
    pub path: PathBuf,
}

impl LoopDevice {
    /// Attaches `backing` to a free loop device.
    pub fn new(backing: &std::path::Path) -> anyhow::Result<LoopDevice> {
        use std::os::fd::AsRawFd;
        const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
        const LOOP_SET_FD: libc::c_ulong = 0x4C00;
        let ctl = File::open("/dev/loop-control").context("open /dev/loop-control")?;
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            bail!("LOOP_CTL_GET_FREE: {}", std::io::Error::last_os_error());
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = wait_for_node(&path)?;
        let file = OpenOptions::new().read(true).write(true).open(backing)?;
        // SAFETY: LOOP_SET_FD takes the backing file's descriptor, which outlives the call.
        if unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_SET_FD, file.as_raw_fd()) } != 0 {
            bail!("LOOP_SET_FD: {}", std::io::Error::last_os_error());
        }
        Ok(LoopDevice { dev, path })
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
        // SAFETY: LOOP_CLR_FD takes no argument.
        unsafe { libc::ioctl(self.dev.as_raw_fd(), LOOP_CLR_FD, 0) };
    }
}

/// An md RAID0 array without a superblock over a range of each member (md's sysfs, as
/// `mdadm --build` does it), stopped when dropped.
pub struct Md {
    name: String,
    /// `/dev/NAME`.
    pub path: PathBuf,
}

impl Md {
    /// `member_bytes` of each of `members` (a block device and the byte offset of the range),
    /// striped in chunks of `chunk` bytes.
    pub fn raid0(
        name: &str,
        members: &[(&std::path::Path, u64)],
        member_bytes: u64,
        chunk: u64,
    ) -> anyhow::Result<Md> {
        std::fs::write("/sys/module/md_mod/parameters/new_array", name)
            .with_context(|| format!("create md array {name}"))?;
        let md = Md {
            name: name.to_owned(),
            path: PathBuf::from(format!("/dev/{name}")),
        };
        let dir = PathBuf::from(format!("/sys/block/{name}/md"));
        let put = |path: PathBuf, value: String| {
            std::fs::write(&path, &value)
                .with_context(|| format!("write {value:?} to {}", path.display()))
        };
        put(dir.join("metadata_version"), "none".into())?;
        put(dir.join("level"), "raid0".into())?;
        put(dir.join("chunk_size"), chunk.to_string())?;
        put(dir.join("raid_disks"), members.len().to_string())?;
        for (slot, (dev, offset)) in members.iter().enumerate() {
            let st = rustix::fs::stat(*dev).with_context(|| format!("stat {}", dev.display()))?;
            let (major, minor) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
            put(dir.join("new_dev"), format!("{major}:{minor}"))?;
            let name = dev.file_name().context("a member without a name")?;
            let rdev = dir.join(format!("dev-{}", name.to_string_lossy()));
            put(rdev.join("offset"), (offset / 512).to_string())?;
            put(rdev.join("size"), (member_bytes / 1024).to_string())?;
            put(rdev.join("slot"), slot.to_string())?;
        }
        put(dir.join("array_state"), "active".into())?;
        wait_for_node(&md.path)?;
        Ok(md)
    }
}

impl Drop for Md {
    fn drop(&mut self) {
        let state = format!("/sys/block/{}/md/array_state", self.name);
        let _ = std::fs::write(&state, "inactive");
        let _ = std::fs::write(&state, "clear");
    }
}

/// The block device of namespace 1 of the NVMe controller with serial `serial`, if present.
pub fn drive_by_serial(serial: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir("/sys/block").ok()?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("nvme") || name.contains('c') || name.contains('p') {
            continue;
        }
        let read = |attr: &str| {
            std::fs::read_to_string(entry.path().join(attr))
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        if read("device/serial") == serial && read("nsid") == "1" {
            let dev = std::path::Path::new("/dev").join(&name);
            if dev.exists() {
                return Some(dev);
            }
        }
    }
    None
}

/// The machine's drives behind the GPU's switch, in order (`cargo xtask test-vm --drives N`,
/// `FGDS_DRIVES`, 2 where not given): the raw drive (`FGDS_NVME`), the second drive (serial
/// `fgds1`), then serials `fgds-drive3` and up.
pub fn drives() -> anyhow::Result<Vec<PathBuf>> {
    let count = match std::env::var("FGDS_DRIVES") {
        Ok(n) => n
            .parse::<usize>()
            .with_context(|| format!("FGDS_DRIVES={n}: want a number of drives"))?,
        Err(_) => 2,
    };
    let mut drives = vec![nvme_path()?];
    for n in 2..=count {
        let serial = match n {
            2 => "fgds1".to_owned(),
            n => format!("fgds-drive{n}"),
        };
        let dev = drive_by_serial(&serial).with_context(|| {
            format!("no drive {n} (NVMe serial {serial}) though the machine has {count}")
        })?;
        drives.push(dev);
    }
    Ok(drives)
}
