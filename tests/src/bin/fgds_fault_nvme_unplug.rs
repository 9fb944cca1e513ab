//! Issue 7 (c): NVMe hot-unplug during direct I/O into GPU memory. The host removes the second
//! drive (QEMU `device_del nvme1`, alone on its hot-pluggable slot) while two readers move data
//! from it into a registered GPU buffer, one with pread(2), one with the crate's io_uring
//! `Transfer`. Each must end within a bounded time (never hang): with an errno (EIO for I/O in
//! flight, ENODEV or ENXIO), or at end of file for a read issued once the NVMe driver has set
//! the namespace's capacity to 0 during the removal; the GPU buffer
//! then still works with the first drive (FGDS_NVME), fgds's counters are unchanged, and after
//! the drive is plugged back it works with fgds again and still holds what was written to it.

use fgds_tests::common;
use fgds_tests::fault;

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::MIB;
use fgds::{Direction, Gpu, Transfer, TransferConfig};
use fgds_tests::guest::{self, AlignedBuf};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};

/// QEMU's id of the second drive's controller, and how to plug it back (the rig's own
/// arguments: same serial, same backing node, same slot).
const NVME2_ID: &str = "nvme1";
const NVME2_ADD: &str = "nvme,id=nvme1,serial=fgds1,drive=nvme1-disk,bus=dn2";
const NVME2_SERIAL: &str = "fgds1";
/// Bytes each reader moves per call, and the buffer (one half per reader).
const HALF: u64 = 16 * MIB;
const LEN: u64 = 2 * HALF;
const SEED: u64 = 0x4e56_4d32;
/// How long a reader may take to fail once the removal has completed.
const BOUND: Duration = Duration::from_secs(10);

fn main() {
    common::run_unless_refused(&[Case {
        name: "nvme_unplug_during_direct_io",
        run: nvme_unplug_during_direct_io,
    }])
}

fn nvme2_path() -> anyhow::Result<PathBuf> {
    let env = std::env::var_os("FGDS_NVME2")
        .map(PathBuf::from)
        .context("FGDS_NVME2 is not set: run inside the rig")?;
    match fault::drive_by_serial(NVME2_SERIAL) {
        Some(dev) if dev == env => {
            // Rebound by an earlier program (fgds_revoke), the drive's queue may merge again.
            guest::no_merges(&dev)?;
            Ok(dev)
        }
        Some(dev) => bail!(
            "FGDS_NVME2 is {} but the drive of serial {NVME2_SERIAL} is {}",
            env.display(),
            dev.display()
        ),
        None => bail!("no drive of serial {NVME2_SERIAL} (was it unplugged and not put back?)"),
    }
}

/// Stands for "end of file" where a reader's end holds an errno: once the NVMe driver starts
/// removing a namespace it sets the disk's capacity to 0 (nvme_ns_remove), so a read issued
/// after that point returns 0 bytes instead of failing.
const EOF: i32 = 0;

/// How a reader ended: reads completed, then the error (errno, or EOF) and when it came.
type Ended = (u32, Option<i32>, Instant);

fn nvme_unplug_during_direct_io() -> CaseResult {
    fault::require_idle()?;
    let nvme2 = nvme2_path()?;
    // Known data on the drive, so that reads are real and the replugged drive can be checked.
    {
        let file = guest::open_direct(&nvme2, true)?;
        let mut ram = AlignedBuf::new(LEN as usize)?;
        pattern::fill(SEED, 0, ram.as_mut_slice());
        file.write_all_at(ram.as_slice(), 0)?;
    }

    let info = Gpu::list()?
        .into_iter()
        .next()
        .context("fgds serves no GPU")?;
    let gpu = Gpu::open(&info.bdf)?;
    let vgpu = common::vgpu()?;
    let (dmabuf, _) = common::alloc(&vgpu, LEN)?;
    let buffer = std::sync::Arc::new(gpu.register(dmabuf.as_fd(), 0, LEN)?);

    let (tx, rx) = mpsc::channel::<(&'static str, Ended)>();
    let started = Instant::now();
    // Reader 1: pread(2) of the first half, over and over.
    {
        let (tx, buffer, path) = (tx.clone(), buffer.clone(), nvme2.clone());
        std::thread::spawn(move || {
            let Ok(file) = guest::open_direct(&path, false) else {
                let _ = tx.send(("pread", (0, None, Instant::now())));
                return;
            };
            let mut ok = 0;
            let end = loop {
                match common::pread_raw(&file, buffer.as_ptr(), HALF as usize, 0) {
                    Ok(n) if n == HALF as usize => ok += 1,
                    // End of the device: its capacity dropped to 0.
                    Ok(_) => break Some(EOF),
                    Err(e) => break Some(e.raw_os_error()),
                }
            };
            let _ = tx.send(("pread", (ok, end, Instant::now())));
        });
    }
    // Reader 2: io_uring through the crate, the second half.
    {
        let (tx, buffer, path) = (tx.clone(), buffer.clone(), nvme2.clone());
        std::thread::spawn(move || {
            let run = || -> anyhow::Result<Ended> {
                let file = fgds::open_direct(&path, false)?;
                let mut t = Transfer::new(TransferConfig {
                    chunk_size: MIB as usize,
                    queue_depth: 8,
                })?;
                let mut ok = 0;
                loop {
                    let range = HALF as usize..LEN as usize;
                    match t.run(Direction::Read, &buffer, range, &file, HALF) {
                        Ok(_) => ok += 1,
                        Err(fgds::Error::Io { source, .. }) => {
                            return Ok((ok, source.raw_os_error(), Instant::now()));
                        }
                        Err(fgds::Error::ShortTransfer { .. }) => {
                            return Ok((ok, Some(EOF), Instant::now()));
                        }
                        Err(e) => {
                            ktap::diag(format_args!("io_uring reader: {e}"));
                            return Ok((ok, None, Instant::now()));
                        }
                    }
                }
            };
            let ended = run().unwrap_or((0, None, Instant::now()));
            let _ = tx.send(("io_uring", ended));
        });
    }
    drop(tx);

    // Let both read for a while, then pull the drive.
    std::thread::sleep(Duration::from_millis(500));
    fault::host_log(&format!(
        "fgds_fault_nvme_unplug: device_del {NVME2_ID} with pread and io_uring reads from it \
         into GPU memory in flight"
    ))?;
    let del_start = Instant::now();
    let removed = ctl::device_del(NVME2_ID);
    let removed_at = Instant::now();
    let mut ended = Vec::new();
    let deadline = removed_at + BOUND;
    while ended.len() < 2 {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(e) => ended.push(e),
            Err(_) => break,
        }
    }
    // Whatever happened, put the drive back so the machine is as the rig made it.
    let replug = if removed.is_ok() {
        ctl::device_add(NVME2_ADD).and_then(|_| {
            fault::wait_until(
                "the replugged drive's block device",
                Duration::from_secs(30),
                || Ok(fault::drive_by_serial(NVME2_SERIAL).is_some()),
            )?;
            // A new queue merges again: fgds's reads of it need nomerges 2 (gate.c).
            let dev =
                fault::drive_by_serial(NVME2_SERIAL).context("the replugged drive went away")?;
            guest::no_merges(&dev)
        })
    } else {
        Ok(())
    };
    removed.context("device_del of the second drive")?;
    ktap::diag(format_args!(
        "readers started {:?} before the removal; device_del took {:?}",
        del_start - started,
        removed_at - del_start
    ));
    for (who, (ok, errno, at)) in &ended {
        let when = if *at >= removed_at {
            format!("{:?} after DEVICE_DELETED", *at - removed_at)
        } else {
            format!("{:?} before DEVICE_DELETED", removed_at - *at)
        };
        let what = match errno {
            Some(EOF) => "end of file (capacity 0)".to_owned(),
            Some(e) => std::io::Error::from_raw_os_error(*e).to_string(),
            None => "no errno".to_owned(),
        };
        ktap::diag(format_args!(
            "{who} reader: {ok} full reads, then {what}, {when}"
        ));
    }
    ensure!(
        ended.len() == 2,
        "a reader did not end within {BOUND:?} of the drive's removal: it hangs"
    );
    for (who, (ok, errno, at)) in &ended {
        ensure!(
            *ok > 0,
            "the {who} reader never completed a read before the unplug"
        );
        ensure!(
            *at >= del_start,
            "the {who} reader failed before the unplug was requested: errno {errno:?}"
        );
        ensure!(
            matches!(
                errno,
                Some(libc::EIO) | Some(libc::ENODEV) | Some(libc::ENXIO) | Some(EOF)
            ),
            "the {who} reader ended with errno {errno:?}, want EIO, ENODEV, ENXIO or end of file"
        );
    }

    // The GPU buffer still works, with the first drive.
    ensure!(
        fault::counters()? == (1, LEN),
        "fgds counts {:?} after the unplug, want 1 buffer of {LEN} bytes",
        fault::counters()?
    );
    let nvme = fgds::open_direct(&guest::nvme_path()?, false)?;
    let mut t = Transfer::new(TransferConfig::DEFAULT)?;
    t.run(Direction::Read, &buffer, 0..LEN as usize, &nvme, 0)
        .context("reading FGDS_NVME into the buffer after the unplug")?;
    common::check_nvme_pattern(
        0,
        &common::gpu_read(dmabuf.as_fd(), LEN as usize, 0, LEN as usize)?,
    )
    .context("data read from FGDS_NVME after the unplug")?;

    // The drive came back with its data, and works with fgds.
    replug.context("plugging the second drive back")?;
    let back = fault::drive_by_serial(NVME2_SERIAL).context("the replugged drive vanished")?;
    let file: File = fgds::open_direct(&back, false)?;
    t.run(Direction::Read, &buffer, 0..LEN as usize, &file, 0)
        .context("reading the replugged drive into the buffer")?;
    let got = common::gpu_read(dmabuf.as_fd(), LEN as usize, 0, LEN as usize)?;
    if let Some(at) = pattern::first_mismatch(SEED, 0, &got) {
        bail!("the replugged drive's data, read into GPU memory, differs at byte {at}");
    }
    ktap::diag(format_args!("the drive is back as {}", back.display()));
    drop(buffer);
    fault::wait_counters_zero("after the case")?;
    ktap::pass()
}
