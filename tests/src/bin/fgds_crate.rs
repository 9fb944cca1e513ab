//! The userspace crate against the real driver: registration and synchronous I/O, the io_uring
//! `Transfer` with its exact partial-completion report on a drive error, and the alignment
//! checks that fail before the kernel is asked; the `Transfer` with the buffer as an io_uring
//! fixed buffer, where the kernel pins it long-term.

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;

use anyhow::{Context, bail, ensure};
use fgds::{CpuMapping, Direction, Error, Gpu, Transfer, TransferConfig};
use fgds_tests::guest::{self, AlignedBuf};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::pattern;

const MIB: u64 = 1 << 20;

fn main() {
    // fgds refuses some setups by design (GENERIC pages under a translating IOMMU).
    guest::skip_if_fgds_refuses();
    ktap::run(&[
        Case {
            name: "register_read_write_round_trip",
            run: register_read_write_round_trip,
        },
        Case {
            name: "transfer_reports_partial_completion",
            run: transfer_reports_partial_completion,
        },
        Case {
            name: "transfer_through_a_fixed_buffer",
            run: transfer_through_a_fixed_buffer,
        },
        Case {
            name: "misaligned_io_refused_before_the_kernel",
            run: misaligned_io_refused_before_the_kernel,
        },
    ])
}

/// The rig's GPU opened through the crate, and `len` bytes of vgpu memory registered with it.
fn registered(len: u64) -> anyhow::Result<(fgds::Buffer, std::os::fd::OwnedFd)> {
    let info = Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    let gpu = Gpu::open(&info.bdf)?;
    let dev = fgds::vgpu::open(0)?;
    let (dmabuf, _) = fgds::vgpu::alloc(&dev, len)?;
    let buffer = gpu.register(dmabuf.as_fd(), 0, len)?;
    Ok((buffer, dmabuf))
}

fn register_read_write_round_trip() -> CaseResult {
    let (buffer, _dmabuf) = registered(8 * MIB)?;
    let nvme = fgds::open_direct(&guest::nvme_path()?, true)?;
    buffer.read_at(&nvme, 4 * MIB, 0..buffer.len())?;
    let scratch = 100 * MIB;
    buffer.write_at(&nvme, scratch, 0..buffer.len())?;
    let mut back = AlignedBuf::new(buffer.len())?;
    nvme.read_exact_at(back.as_mut_slice(), scratch)?;
    if let Some(at) = pattern::first_mismatch(pattern::NVME_SEED, 4 * MIB, back.as_slice()) {
        bail!("NVMe -> GPU -> NVMe through the crate changed byte {at}");
    }
    ktap::pass()
}

fn transfer_reports_partial_completion() -> CaseResult {
    const LEN: u64 = 8 * MIB;
    // 4 MiB of known data just before the always-failing area, then the area itself.
    let start = pattern::fault::READ_ALWAYS - 4 * MIB;
    let seed = 0x7a11;
    let nvme = guest::open_direct(&guest::nvme_path()?, true)?;
    let mut known = AlignedBuf::new((4 * MIB) as usize)?;
    pattern::fill(seed, 0, known.as_mut_slice());
    nvme.write_all_at(known.as_slice(), start)?;

    let (buffer, dmabuf) = registered(LEN)?;
    let mut transfer = Transfer::new(TransferConfig {
        chunk_size: MIB as usize,
        queue_depth: 4,
    })?;
    let err = match transfer.run(Direction::Read, &buffer, 0..buffer.len(), &nvme, start) {
        Ok(n) => bail!("a read across the drive's failing area moved {n} bytes without an error"),
        Err(err) => err,
    };
    ensure!(
        matches!(err, Error::Io { .. }),
        "expected an I/O error, got {err}"
    );
    ensure!(
        err.bytes_done() == 4 * MIB,
        "bytes_done {} != 4 MiB: {err}",
        err.bytes_done()
    );
    let raw = match &err {
        Error::Io { source, .. } => source.raw_os_error(),
        _ => None,
    };
    ensure!(
        matches!(raw, Some(libc::EIO) | Some(libc::ENODATA)),
        "errno {raw:?}, expected EIO or ENODATA"
    );
    let cpu = CpuMapping::new(dmabuf.as_fd(), (4 * MIB) as usize)?;
    let mut got = vec![0u8; (4 * MIB) as usize];
    cpu.read(0, &mut got);
    if let Some(at) = pattern::first_mismatch(seed, 0, &got) {
        bail!(
            "the {} bytes reported done differ from the drive at byte {at}",
            err.bytes_done()
        );
    }
    // Later I/O outside the failing area works.
    transfer
        .run(Direction::Read, &buffer, 0..buffer.len(), &nvme, 0)
        .context("I/O after the failure")?;
    ktap::pass()
}

/// NVMe -> GPU -> NVMe through a `Transfer` whose ring has the buffer as its fixed buffer, in
/// chunks that start inside it; the pages are unpinned when the `Transfer` goes, so the buffer
/// unregisters cleanly after.
fn transfer_through_a_fixed_buffer() -> CaseResult {
    const LEN: u64 = 8 * MIB;
    let (buffer, dmabuf) = registered(LEN)?;
    let nvme = fgds::open_direct(&guest::nvme_path()?, true)?;
    let scratch = 120 * MIB;
    {
        let mut transfer = Transfer::new(TransferConfig {
            chunk_size: (3 * MIB / 2) as usize,
            queue_depth: 4,
        })?;
        if let Err(err) = transfer.register_buffer(&buffer) {
            let errno = match &err {
                Error::Io { source, .. } => source.raw_os_error(),
                _ => None,
            };
            return match errno.and_then(guest::fixed_buffer_refusal) {
                Some(reason) => ktap::skip(reason),
                None => bail!("registering the buffer as a fixed buffer: {err}"),
            };
        }
        let second = transfer.register_buffer(&buffer);
        ensure!(
            matches!(second, Err(Error::Invalid(_))),
            "a second fixed buffer on one Transfer gave {second:?}"
        );
        transfer.run(Direction::Read, &buffer, 0..buffer.len(), &nvme, 0)?;
        transfer.run(
            Direction::Write,
            &buffer,
            MIB as usize..buffer.len(),
            &nvme,
            scratch,
        )?;
    }
    let cpu = CpuMapping::new(dmabuf.as_fd(), LEN as usize)?;
    let mut got = vec![0u8; LEN as usize];
    cpu.read(0, &mut got);
    if let Some(at) = pattern::first_mismatch(pattern::NVME_SEED, 0, &got) {
        bail!("the read through the fixed buffer differs from the drive at byte {at}");
    }
    let mut back = AlignedBuf::new((LEN - MIB) as usize)?;
    nvme.read_exact_at(back.as_mut_slice(), scratch)?;
    if let Some(at) = pattern::first_mismatch(pattern::NVME_SEED, MIB, back.as_slice()) {
        bail!("the write through the fixed buffer changed byte {at}");
    }
    drop(buffer);
    ktap::pass()
}

fn misaligned_io_refused_before_the_kernel() -> CaseResult {
    let (buffer, _dmabuf) = registered(MIB)?;
    let nvme = fgds::open_direct(&guest::nvme_path()?, false)?;
    for (file_offset, range) in [(1u64, 0..4096), (0, 100..4196), (0, 0..100)] {
        match buffer.read_at(&nvme, file_offset, range.clone()) {
            Err(Error::Invalid(msg)) if msg.contains("alignment") => {}
            other => bail!(
                "read_at({file_offset}, {range:?}) gave {other:?}, expected an alignment error"
            ),
        }
    }
    let buffered = std::fs::File::open(guest::nvme_path()?)?;
    match buffer.read_at(&buffered, 0, 0..4096) {
        Err(Error::Invalid(msg)) if msg.contains("O_DIRECT") => {}
        other => bail!("a file without O_DIRECT gave {other:?}"),
    }
    match buffer.read_at(&nvme, 0, 0..buffer.len() + 4096) {
        Err(Error::Invalid(msg)) if msg.contains("outside") => {}
        other => bail!("a range past the buffer gave {other:?}"),
    }
    ktap::pass()
}
