//! The kernel's own dma-buf registered buffers: the design the dma-buf maintainers asked for,
//! where the NVMe driver (the device that does the DMA) attaches the dma-buf itself, maps it
//! once, and io_uring reads and writes at offsets into it (`READ_FIXED`/`WRITE_FIXED`).
//! Pavel Begunkov's io_uring dma-buf series (v3, April 2026) adds it; no released kernel has
//! it as of Linux 7.3, and the rig builds it as `build:7.2+io-uring-dmabuf` (docs/upstream.md).
//! Where a kernel has it, fgds is not needed at all: [`crate::Transfer::run_dmabuf`] and
//! [`crate::GpuFile`] take it first.
//!
//! The interface, as the series defines it (`include/uapi/linux/io_uring.h`): a sparse buffer
//! table, then `IORING_REGISTER_BUFFERS_UPDATE` with `IORING_RSRC_UPDATE_EXTENDED` and a
//! `struct io_uring_regbuf_desc` of type `IO_REGBUF_TYPE_DMABUF` naming the dma-buf and the
//! file the buffer is for (an `O_DIRECT` NVMe block device: `EOPNOTSUPP` for anything else);
//! the buffer's address is then a byte offset into the dma-buf, valid only on that file
//! (`EBADF` elsewhere), and a request may complete with a spurious `EAGAIN`.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::OnceLock;

use io_uring::IoUring;
use io_uring::squeue::Entry128;

use crate::memory::NotDirect;

/// `IORING_REGISTER_BUFFERS_UPDATE`.
const REGISTER_BUFFERS_UPDATE: libc::c_uint = 16;
/// `IORING_RSRC_UPDATE_EXTENDED`: the update's `data` holds `struct io_uring_regbuf_desc`s.
const RSRC_UPDATE_EXTENDED: u32 = 1 << 1;
/// `IO_REGBUF_TYPE_EMPTY`: clears a slot.
const REGBUF_TYPE_EMPTY: u32 = 0;
/// `IO_REGBUF_TYPE_DMABUF`.
const REGBUF_TYPE_DMABUF: u32 = 2;

/// `struct io_uring_rsrc_update2`.
#[repr(C)]
struct RsrcUpdate2 {
    offset: u32,
    flags: u32,
    data: u64,
    tags: u64,
    nr: u32,
    resv2: u32,
}

/// `struct io_uring_regbuf_desc`.
#[repr(C)]
struct RegbufDesc {
    kind: u32,
    flags: u32,
    size: u64,
    uaddr: u64,
    dmabuf_fd: i32,
    target_fd: i32,
    resv: [u64; 6],
}

const _: () = assert!(std::mem::size_of::<RsrcUpdate2>() == 32);
const _: () = assert!(std::mem::size_of::<RegbufDesc>() == 80);

/// Puts `desc` into slot `slot` of the ring's (sparse) buffer table.
fn update(ring: RawFd, slot: u32, desc: &RegbufDesc) -> std::io::Result<()> {
    let update = RsrcUpdate2 {
        offset: slot,
        flags: RSRC_UPDATE_EXTENDED,
        data: desc as *const RegbufDesc as u64,
        tags: 0,
        nr: 1,
        resv2: 0,
    };
    // SAFETY: io_uring_register(2) reads `update` and the one descriptor it points to, both
    // alive for the call; it writes nothing of ours.
    let res = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring,
            REGISTER_BUFFERS_UPDATE,
            &update as *const RsrcUpdate2,
            std::mem::size_of::<RsrcUpdate2>() as libc::c_uint,
        )
    };
    match res {
        1 => Ok(()),
        r if r < 0 => Err(std::io::Error::last_os_error()),
        r => Err(std::io::Error::other(format!(
            "IORING_REGISTER_BUFFERS_UPDATE updated {r} buffers, not 1"
        ))),
    }
}

/// Whether this kernel has dma-buf registered buffers, asked once per process: a ring with a
/// sparse buffer table of one slot takes an extended update of an empty descriptor where it
/// does, and refuses the flag (`EINVAL`) where it does not.
pub fn supported() -> Result<(), NotDirect> {
    static KNOWN: OnceLock<Result<(), NotDirect>> = OnceLock::new();
    KNOWN
        .get_or_init(|| {
            let not = |err: std::io::Error, what: &str| {
                NotDirect::new(
                    err.raw_os_error().unwrap_or(libc::EINVAL),
                    format!(
                        "this kernel has no dma-buf registered buffers for io_uring ({what}: \
                         {err}); they come with Begunkov's io_uring dma-buf series, in no \
                         released kernel as of Linux 7.3"
                    ),
                )
            };
            let ring = IoUring::<Entry128>::builder()
                .build(2)
                .map_err(|err| not(err, "io_uring_setup"))?;
            ring.submitter()
                .register_buffers_sparse(1)
                .map_err(|err| not(err, "a sparse buffer table"))?;
            update(ring.as_raw_fd(), 0, &empty())
                .map_err(|err| not(err, "IORING_RSRC_UPDATE_EXTENDED"))
        })
        .clone()
}

fn empty() -> RegbufDesc {
    RegbufDesc {
        kind: REGBUF_TYPE_EMPTY,
        flags: 0,
        size: 0,
        uaddr: 0,
        dmabuf_fd: 0,
        target_fd: 0,
        resv: [0; 6],
    }
}

/// Registers `dmabuf` as buffer `slot` of `ring` (whose table is sparse and at least that
/// large) for I/O on `target`, an `O_DIRECT` NVMe block device: the NVMe driver attaches and
/// maps the dma-buf.
pub fn register_in(
    ring: &IoUring<Entry128>,
    slot: u32,
    dmabuf: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
) -> std::io::Result<()> {
    let desc = RegbufDesc {
        kind: REGBUF_TYPE_DMABUF,
        dmabuf_fd: dmabuf.as_raw_fd(),
        target_fd: target.as_raw_fd(),
        ..empty()
    };
    update(ring.as_raw_fd(), slot, &desc)
}

/// Empties buffer `slot` of `ring`: the kernel lets the dma-buf go once no request uses it.
pub(crate) fn unregister(ring: &IoUring<Entry128>, slot: u32) -> std::io::Result<()> {
    update(ring.as_raw_fd(), slot, &empty())
}

/// What the reason for not taking this path says about an errno of the registration.
pub fn refusal(err: &std::io::Error) -> NotDirect {
    let errno = err.raw_os_error().unwrap_or(libc::EIO);
    let why = match errno {
        libc::EOPNOTSUPP => {
            "the kernel's dma-buf registered buffers take only a raw NVMe namespace (nvme-pci), \
             not a file on a file system or another driver's device"
        }
        libc::EINVAL => {
            "the kernel refused the dma-buf as a registered buffer (the file must be open with \
             O_DIRECT; the dma-buf at most 1 GiB)"
        }
        _ => "the kernel could not register the dma-buf for the file",
    };
    NotDirect::new(errno, format!("{why}: {err}"))
}
