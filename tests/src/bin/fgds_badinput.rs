//! fgds bad input: every invalid REG_BUFFER, UNREG_BUFFER and mmap argument gets the errno the
//! UAPI header documents; dma-bufs that are not GPU memory are refused.

use fgds_tests::common;
use fgds_tests::fault;

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use anyhow::{Context, bail, ensure};
use common::{MIB, Map, PAGE};
use fgds::uapi;
use fgds_tests::ktap::{self, Case, CaseResult};
use rustix::io::Errno;

fn main() {
    common::run_refusing(
        &[
            Case {
                name: "reg_bad_arguments",
                run: reg_bad_arguments,
            },
            Case {
                name: "reg_closed_fd_ebadf",
                run: reg_closed_fd,
            },
            Case {
                name: "reg_not_a_dmabuf_einval",
                run: reg_not_a_dmabuf,
            },
            Case {
                name: "reg_udmabuf_einval",
                run: reg_udmabuf,
            },
            Case {
                name: "unreg_bad_arguments",
                run: unreg_bad_arguments,
            },
            Case {
                name: "mmap_bad_arguments",
                run: mmap_bad_arguments,
            },
            Case {
                name: "unknown_ioctl_enotty",
                run: unknown_ioctl,
            },
            Case {
                name: "limit_buffers_per_file_emfile",
                run: limit_per_file,
            },
            Case {
                name: "limit_bytes_per_gpu_enospc",
                run: limit_per_gpu,
            },
            Case {
                name: "limit_memlock_enomem",
                run: limit_memlock,
            },
            Case {
                name: "limit_bytes_per_user_enospc",
                run: limit_per_user,
            },
            Case {
                name: "unprivileged_group_member_reads_and_is_limited",
                run: unprivileged_group_member,
            },
            Case {
                name: "unprivileged_non_member_refused_eacces",
                run: unprivileged_non_member,
            },
            Case {
                name: "unsafe_setup_refused",
                run: unsafe_setup_refused,
            },
        ],
        &[
            "reg_closed_fd_ebadf",
            "reg_not_a_dmabuf_einval",
            "reg_udmabuf_einval",
            "unknown_ioctl_enotty",
            "unprivileged_non_member_refused_eacces",
            "unsafe_setup_refused",
        ],
    )
}

fn expect(what: &str, got: Result<u64, Errno>, want: Errno) -> anyhow::Result<()> {
    match got {
        Err(e) if e == want => Ok(()),
        Err(e) => bail!("{what}: got {e}, want {want}"),
        Ok(_) => bail!("{what}: succeeded, want {want}"),
    }
}

fn reg_with(node: &std::fs::File, f: impl FnOnce(&mut uapi::RegBuffer)) -> Result<u64, Errno> {
    let mut arg = uapi::RegBuffer::default();
    f(&mut arg);
    common::reg_raw(node.as_fd(), &mut arg)?;
    Ok(arg.idx)
}

fn reg_bad_arguments() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, 2 * MIB)?;
    let fd = dmabuf.as_raw_fd();
    let bar = common::sysfs_u64("bar_size")?;
    let ok = move |a: &mut uapi::RegBuffer| {
        a.dmabuf_fd = fd;
        a.size = MIB;
    };
    type Setter = Box<dyn Fn(&mut uapi::RegBuffer)>;
    let cases: [(&str, Setter, Errno); 8] = [
        (
            "flags != 0",
            Box::new(move |a| {
                ok(a);
                a.flags = 1;
            }),
            Errno::INVAL,
        ),
        (
            "negative fd",
            Box::new(move |a| {
                ok(a);
                a.dmabuf_fd = -1;
            }),
            Errno::INVAL,
        ),
        (
            "unaligned offset",
            Box::new(move |a| {
                ok(a);
                a.dmabuf_offset = 512;
            }),
            Errno::INVAL,
        ),
        (
            "unaligned size",
            Box::new(move |a| {
                ok(a);
                a.size = MIB + 512;
            }),
            Errno::INVAL,
        ),
        (
            "zero size",
            Box::new(move |a| {
                ok(a);
                a.size = 0;
            }),
            Errno::INVAL,
        ),
        (
            "size beyond the BAR",
            Box::new(move |a| {
                ok(a);
                a.size = bar + PAGE;
            }),
            Errno::INVAL,
        ),
        (
            "offset+size overflows",
            Box::new(move |a| {
                ok(a);
                a.dmabuf_offset = !(PAGE - 1);
            }),
            Errno::OVERFLOW,
        ),
        (
            "beyond the dma-buf",
            Box::new(move |a| {
                ok(a);
                a.dmabuf_offset = 2 * MIB - PAGE;
            }),
            Errno::INVAL,
        ),
    ];
    for (what, f, want) in cases {
        expect(what, reg_with(&node, |a| f(a)), want)?;
    }
    ensure!(
        common::sysfs_u64("buffers")? == 0,
        "a failed REG left a buffer"
    );
    // A bad argument never leaks: a good one still works afterwards.
    let idx = common::reg(&node, dmabuf.as_fd(), 0, MIB).context("valid REG after bad ones")?;
    common::unreg(&node, idx)?;
    ktap::pass()
}

fn reg_closed_fd() -> CaseResult {
    let node = common::open_node()?;
    // SAFETY: creates a fresh descriptor pair we own.
    let fd = unsafe { libc::eventfd(0, 0) };
    ensure!(fd >= 0, "eventfd");
    // SAFETY: closing the descriptor we just made.
    unsafe { libc::close(fd) };
    expect(
        "closed fd",
        reg_with(&node, |a| {
            a.dmabuf_fd = fd;
            a.size = PAGE;
        }),
        Errno::BADF,
    )?;
    ktap::pass()
}

fn reg_not_a_dmabuf() -> CaseResult {
    let node = common::open_node()?;
    let file = std::fs::File::open("/proc/self/status")?;
    expect(
        "regular file",
        reg_with(&node, |a| {
            a.dmabuf_fd = file.as_raw_fd();
            a.size = PAGE;
        }),
        Errno::INVAL,
    )?;
    ktap::pass()
}

fn reg_udmabuf() -> CaseResult {
    let Ok(udmabuf) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/udmabuf")
    else {
        return ktap::skip("no /dev/udmabuf in this kernel (CONFIG_UDMABUF off, as in Debian 6.1)");
    };
    let len = MIB;
    let name = c"fgds-udmabuf";
    // SAFETY: plain system calls on descriptors we own.
    let memfd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_ALLOW_SEALING) };
    ensure!(
        memfd >= 0,
        "memfd_create: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: as above; the memfd is closed on drop.
    let memfd = unsafe { OwnedFd::from_raw_fd(memfd) };
    // SAFETY: as above.
    unsafe {
        ensure!(
            libc::ftruncate(memfd.as_raw_fd(), len as i64) == 0,
            "ftruncate"
        );
        ensure!(
            libc::fcntl(memfd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) == 0,
            "seal"
        );
    }
    #[repr(C)]
    struct UdmabufCreate {
        memfd: u32,
        flags: u32,
        offset: u64,
        size: u64,
    }
    let create = UdmabufCreate {
        memfd: memfd.as_raw_fd() as u32,
        flags: 1,
        offset: 0,
        size: len,
    };
    const UDMABUF_CREATE: rustix::ioctl::Opcode =
        rustix::ioctl::opcode::write::<UdmabufCreate>(b'u', 0x42);
    // SAFETY: struct udmabuf_create, read by the kernel; the result is a new fd.
    let fd = unsafe { libc::ioctl(udmabuf.as_raw_fd(), UDMABUF_CREATE as _, &create) };
    ensure!(
        fd >= 0,
        "UDMABUF_CREATE: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the ioctl returned a new dma-buf fd that we now own.
    let dmabuf = unsafe { OwnedFd::from_raw_fd(fd) };
    let node = common::open_node()?;
    expect(
        "udmabuf",
        common::reg(&node, dmabuf.as_fd(), 0, len),
        Errno::INVAL,
    )?;
    ktap::pass()
}

fn unreg_bad_arguments() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, MIB)?;
    let to_u64 = |r: Result<(), Errno>| r.map(|()| 0);
    expect(
        "unaligned idx",
        to_u64(common::unreg(&node, 17)),
        Errno::INVAL,
    )?;
    expect(
        "unknown idx",
        to_u64(common::unreg(&node, 999 * PAGE)),
        Errno::NOENT,
    )?;
    expect(
        "huge idx",
        to_u64(common::unreg(&node, !(PAGE - 1))),
        Errno::NOENT,
    )?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, MIB)?;
    // A token of another open file is unknown here.
    let other = common::open_node()?;
    expect(
        "other file's idx",
        to_u64(common::unreg(&other, idx)),
        Errno::NOENT,
    )?;
    common::unreg(&node, idx).context("UNREG")?;
    expect(
        "idx unregistered twice",
        to_u64(common::unreg(&node, idx)),
        Errno::NOENT,
    )?;
    ktap::pass()
}

fn mmap_bad_arguments() -> CaseResult {
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, MIB)?;
    let idx = common::reg(&node, dmabuf.as_fd(), 0, MIB)?;
    let m = |idx: u64, len: usize, flags: i32| Map::new(&node, idx, len, flags).map(|_| 0u64);
    expect(
        "MAP_PRIVATE",
        m(idx, MIB as usize, libc::MAP_PRIVATE),
        Errno::INVAL,
    )?;
    expect(
        "shorter",
        m(idx, (MIB - PAGE) as usize, libc::MAP_SHARED),
        Errno::INVAL,
    )?;
    expect(
        "longer",
        m(idx, (MIB + PAGE) as usize, libc::MAP_SHARED),
        Errno::INVAL,
    )?;
    expect(
        "unknown token",
        m(idx + 100 * PAGE, MIB as usize, libc::MAP_SHARED),
        Errno::NOENT,
    )?;
    expect(
        "token 0",
        m(0, MIB as usize, libc::MAP_SHARED),
        Errno::NOENT,
    )?;
    let other = common::open_node()?;
    expect(
        "other file's token",
        Map::new(&other, idx, MIB as usize, libc::MAP_SHARED).map(|_| 0),
        Errno::NOENT,
    )?;
    Map::shared(&node, idx, MIB as usize).context("valid mmap")?;
    ktap::pass()
}

fn unknown_ioctl() -> CaseResult {
    let node = common::open_node()?;
    // SAFETY: an ioctl number fgds does not know, with no argument.
    let r = unsafe { libc::ioctl(node.as_raw_fd(), 0x8803 as _, 0) };
    let e = std::io::Error::last_os_error();
    ensure!(
        r == -1 && e.raw_os_error() == Some(libc::ENOTTY),
        "got {r} {e}"
    );
    ktap::pass()
}

struct Param(&'static str, String);

impl Param {
    fn set(name: &'static str, value: &str) -> anyhow::Result<Param> {
        let path = format!("/sys/module/fgds/parameters/{name}");
        let old = std::fs::read_to_string(&path)?.trim().to_owned();
        std::fs::write(&path, value).with_context(|| format!("cannot set {name}"))?;
        Ok(Param(name, old))
    }
}

impl Drop for Param {
    fn drop(&mut self) {
        let _ = std::fs::write(format!("/sys/module/fgds/parameters/{}", self.0), &self.1);
    }
}

fn limit_per_file() -> CaseResult {
    let _p = Param::set("max_buffers_per_file", "3")?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, MIB)?;
    let mut idx = Vec::new();
    for _ in 0..3 {
        idx.push(common::reg(&node, dmabuf.as_fd(), 0, PAGE).context("REG under the limit")?);
    }
    expect(
        "4th REG",
        common::reg(&node, dmabuf.as_fd(), 0, PAGE),
        Errno::MFILE,
    )?;
    // Another open file has its own budget.
    let other = common::open_node()?;
    common::reg(&other, dmabuf.as_fd(), 0, PAGE).context("REG on another file")?;
    common::unreg(&node, idx[0])?;
    common::reg(&node, dmabuf.as_fd(), 0, PAGE).context("REG after UNREG")?;
    ktap::pass()
}

fn limit_per_gpu() -> CaseResult {
    let before = common::sysfs_u64("bytes")?;
    let _p = Param::set("max_bytes_per_gpu", &(before + 3 * MIB).to_string())?;
    let node = common::open_node()?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, 4 * MIB)?;
    let a = common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB)?;
    expect(
        "over the GPU limit",
        common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB),
        Errno::NOSPC,
    )?;
    common::reg(&node, dmabuf.as_fd(), 0, MIB).context("REG up to the limit")?;
    common::unreg(&node, a)?;
    common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB).context("REG after UNREG")?;
    ktap::pass()
}

/// The node and `len` bytes of GPU memory, opened as root; then this process's RLIMIT_MEMLOCK
/// becomes `memlock` bytes (None: unlimited) and it becomes `uid`, losing CAP_IPC_LOCK with
/// every other capability. For forked children only.
fn become_user(
    uid: libc::uid_t,
    memlock: Option<u64>,
    len: u64,
) -> anyhow::Result<(std::fs::File, OwnedFd)> {
    let node = common::open_node()?;
    let (dmabuf, _) = common::alloc(&common::vgpu()?, len)?;
    drop_to(uid, &[], memlock.unwrap_or(libc::RLIM_INFINITY))?;
    Ok((node, dmabuf))
}

/// Without CAP_IPC_LOCK, registered bytes count against RLIMIT_MEMLOCK (`ENOMEM` past it), as
/// io_uring and RDMA charge pinned memory; the charge goes with the registration.
fn limit_memlock() -> CaseResult {
    let mut child = fault::Child::spawn(|parent| {
        let (node, dmabuf) = become_user(1000, Some(3 * MIB), 4 * MIB)?;
        let reg = |len| common::reg(&node, dmabuf.as_fd(), 0, len);
        expect(
            "4 MiB over a 3 MiB RLIMIT_MEMLOCK",
            reg(4 * MIB),
            Errno::NOMEM,
        )?;
        let a = reg(2 * MIB).context("2 MiB under the limit")?;
        expect("2 more MiB", reg(2 * MIB), Errno::NOMEM)?;
        common::unreg(&node, a)?;
        reg(3 * MIB).context("3 MiB once the first registration went")?;
        parent.ready("done");
        Ok(())
    })?;
    let said = child.wait_ready(std::time::Duration::from_secs(30));
    let status = child.wait()?;
    ensure!(
        said? == "done" && status == 0,
        "the child ended with {status}"
    );
    ktap::pass()
}

/// One user cannot take all of a GPU: `max_bytes_per_user` bounds what one uid registers on
/// it (`ENOSPC` past it, over all its open files), while another uid still can.
fn limit_per_user() -> CaseResult {
    let _p = Param::set("max_bytes_per_user", &(3 * MIB).to_string())?;
    let mut first = fault::Child::spawn(|parent| {
        let (node, dmabuf) = become_user(1000, None, 4 * MIB)?;
        common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB).context("2 MiB")?;
        expect(
            "2 more MiB",
            common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB),
            Errno::NOSPC,
        )?;
        parent.ready("holding");
        parent.wait_released();
        Ok(())
    })?;
    let said = first.wait_ready(std::time::Duration::from_secs(30));
    // While the first user holds its share, another user still registers.
    let second = said.is_ok().then(|| {
        let mut child = fault::Child::spawn(|parent| {
            let (node, dmabuf) = become_user(1001, None, 2 * MIB)?;
            common::reg(&node, dmabuf.as_fd(), 0, 2 * MIB)
                .context("another user, while the first holds its share")?;
            parent.ready("done");
            Ok(())
        })?;
        let said = child.wait_ready(std::time::Duration::from_secs(30));
        let status = child.wait()?;
        anyhow::Ok((said?, status))
    });
    first.release();
    let status = first.wait()?;
    ensure!(
        said? == "holding" && status == 0,
        "the first user's child ended with {status}"
    );
    let (said, status) = second.context("no second child")??;
    ensure!(
        said == "done" && status == 0,
        "the second user's child ended with {status}"
    );
    ktap::pass()
}

/// The group the package's udev rule gives fgds's nodes (`fgds`), as a number in the rig.
const FGDS_GID: libc::gid_t = 2000;

/// The node as the package's udev rule leaves it (`GROUP="fgds", MODE="0660"`) while `f` runs,
/// root's `0600` again after.
fn with_node_as_packaged(f: impl FnOnce() -> CaseResult) -> CaseResult {
    use std::os::unix::fs::PermissionsExt;
    let path = common::node_path()?;
    std::os::unix::fs::chown(&path, Some(0), Some(FGDS_GID))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o660))?;
    let res = f();
    std::os::unix::fs::chown(&path, Some(0), Some(0))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    res
}

/// Becomes `uid` (and gid `uid`) with the supplementary `groups` and RLIMIT_MEMLOCK `memlock`,
/// losing every capability. For forked children only.
fn drop_to(uid: libc::uid_t, groups: &[libc::gid_t], memlock: u64) -> anyhow::Result<()> {
    let rl = libc::rlimit {
        rlim_cur: memlock,
        rlim_max: memlock,
    };
    // SAFETY: plain system calls on this process's own limits and credentials; `groups`
    // outlives the call.
    let failed = unsafe {
        libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) != 0
            || libc::setgroups(groups.len(), groups.as_ptr()) != 0
            || libc::setgid(uid) != 0
            || libc::setuid(uid) != 0
    };
    if failed {
        bail!(
            "cannot become uid {uid}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Runs `body` in a forked child (which becomes the user it needs with [`drop_to`]) while the
/// node is as the package leaves it; the line the child ends with becomes a diagnostic.
fn in_child_as_user(body: impl FnOnce() -> anyhow::Result<String>) -> CaseResult {
    with_node_as_packaged(|| {
        let mut child = fault::Child::spawn(|parent| {
            let line = body()?;
            parent.ready(&line);
            Ok(())
        })?;
        let said = child.wait_ready(std::time::Duration::from_secs(30));
        let status = child.wait()?;
        ensure!(status == 0, "the user's child ended with {status}");
        ktap::diag(said?);
        ktap::pass()
    })
}

/// The crate's error of `what`, which must be `errno` with a message naming `names`.
fn refused(what: &str, res: fgds::Result<()>, errno: i32, names: &str) -> anyhow::Result<String> {
    let err = match res {
        Ok(()) => bail!("{what} succeeded"),
        Err(err) => err,
    };
    let text = err.to_string();
    ensure!(
        err.errno() == errno && text.contains(names),
        "{what}: {text} (errno {}, not {errno} naming {names:?})",
        err.errno()
    );
    Ok(text)
}

/// The PCI address of the GPU fgds serves.
fn first_gpu() -> anyhow::Result<String> {
    Ok(fgds::Gpu::list()?
        .first()
        .context("fgds serves no GPU")?
        .bdf
        .clone())
}

/// A user who is not root but is in the fgds group (as the README's install steps make one)
/// opens the GPU's node itself, registers GPU memory (a runtime's dma-buf it holds), and reads
/// a file of its own into it through fgds's command; past its RLIMIT_MEMLOCK a registration is
/// ENOMEM, and the crate's error names the limit and its value.
fn unprivileged_group_member() -> CaseResult {
    const LEN: u64 = 4 * MIB;
    let Some(dir) = std::env::var_os("FGDS_EXT4") else {
        return ktap::skip("the rig provides no ext4 filesystem (FGDS_EXT4 unset)");
    };
    let file = std::path::Path::new(&dir).join("unprivileged.dat");
    let mut data = vec![0u8; LEN as usize];
    fgds_tests::pattern::fill(0x5e7, 0, &mut data);
    std::fs::write(&file, &data)?;
    let res = in_child_as_user(|| {
        // The GPU runtime's export, made before this process gave up root.
        let (dmabuf, _) = common::alloc(&common::vgpu()?, 2 * LEN)?;
        drop_to(1000, &[FGDS_GID], 6 * MIB)?;
        let gpu =
            fgds::Gpu::open(&first_gpu()?).context("a member of the fgds group opens the node")?;
        let buffer = gpu.register(dmabuf.as_fd(), 0, LEN)?;
        let f = fgds::open_direct(&file, false)?;
        let n = buffer.read_from(&f, 0, 0..LEN as usize)?;
        ensure!(n == LEN as usize, "read {n} of {LEN} bytes");
        // SAFETY: the mapping is the registration's LEN bytes, alive with `buffer`, and only
        // this thread touches it now that the read returned.
        let got = unsafe { std::slice::from_raw_parts(buffer.as_ptr(), LEN as usize) };
        if let Some(at) = fgds_tests::pattern::first_mismatch(0x5e7, 0, got) {
            bail!("the user's file reached GPU memory wrong from byte {at}");
        }
        let text = refused(
            "4 more MiB past a 6 MiB RLIMIT_MEMLOCK",
            gpu.register(dmabuf.as_fd(), LEN, LEN).map(drop),
            libc::ENOMEM,
            "RLIMIT_MEMLOCK, 6144 KiB",
        )?;
        Ok(format!("past the limit: {text}"))
    });
    let _ = std::fs::remove_file(&file);
    res
}

/// A user outside the fgds group cannot open the node (EACCES), and the crate's error says
/// which group to join.
fn unprivileged_non_member() -> CaseResult {
    in_child_as_user(|| {
        drop_to(1001, &[], 64 * MIB)?;
        let text = refused(
            "opening the node outside the fgds group",
            fgds::Gpu::open(&first_gpu()?).map(drop),
            libc::EACCES,
            "fgds group",
        )?;
        Ok(format!("refused: {text}"))
    })
}

/// Under a translating IOMMU fgds must not hand out GENERIC pages: it either uses P2PDMA pages
/// (IOMMU-aware) or refuses with EOPNOTSUPP and sysfs mode "refused"; which of the two, the
/// run's configuration says (the kernel has P2PDMA pages or not).
fn unsafe_setup_refused() -> CaseResult {
    if !common::gpu_dma_translated()? {
        return ktap::skip("the GPU's DMA is not translated by an IOMMU in this run");
    }
    let refused = common::refusal()?;
    let mode = common::sysfs("mode")?;
    let expected = fgds_tests::guest::expected_mode()?;
    ensure!(
        mode == expected,
        "under a translating IOMMU fgds shows mode {mode}; the run's configuration implies \
         {expected}"
    );
    match refused {
        Some(reason) => ktap::diag(reason),
        None => ensure!(
            mode == "p2pdma" || mode == "exporter-p2pdma",
            "fgds accepted GENERIC-style pages under a translating IOMMU (mode {mode})"
        ),
    }
    ktap::pass()
}
