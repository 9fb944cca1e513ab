//! The rig's control channel and fault areas work: the host unplugs and replugs the GPU on
//! request, checks the GPU's memory as it is when asked, and the drive fails I/O exactly in its
//! fault areas.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use fgds_tests::guest::{self, AlignedBuf};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};

fn main() {
    ktap::run(&[
        Case {
            name: "gpu_unplug_and_replug",
            run: gpu_unplug_and_replug,
        },
        Case {
            name: "read_fault_areas",
            run: read_fault_areas,
        },
        Case {
            name: "gpu_check_sees_memory_as_it_is_now",
            run: gpu_check_sees_memory_as_it_is_now,
        },
        Case {
            name: "unknown_request_is_refused",
            run: unknown_request_is_refused,
        },
    ])
}

/// The host's `gpu_check` answers from the GPU's memory at the moment it is asked: it passes on
/// what the guest just wrote, fails on any other seed or pattern offset, and after the guest
/// overwrites one word it fails at exactly that byte.
fn gpu_check_sees_memory_as_it_is_now() -> CaseResult {
    use std::os::fd::AsFd;
    const LEN: u64 = 1 << 20;
    const SEED: u64 = 0x6374_6c31;
    if let Some(reason) = guest::vgpu_absence() {
        return ktap::skip(reason);
    }
    let (dmabuf, bar_off) = fgds::vgpu::alloc(&guest::vgpu_open()?, LEN)?;
    let map = fgds::CpuMapping::new(dmabuf.as_fd(), LEN as usize)?;
    let mut data = vec![0u8; LEN as usize];
    pattern::fill(SEED, 0, &mut data);
    map.write(0, &data);
    ctl::gpu_check(bar_off, LEN, SEED).context("the pattern just written")?;
    ensure!(
        ctl::gpu_check(bar_off, LEN, SEED + 1).is_err(),
        "gpu_check passed with another seed"
    );
    ensure!(
        ctl::gpu_check_at(bar_off, LEN, SEED, 8).is_err(),
        "gpu_check passed with another pattern offset"
    );
    map.write(4096, &[0xee; 8]);
    match ctl::gpu_check(bar_off, LEN, SEED) {
        Err(err) if format!("{err:#}").contains(&format!("byte {:#x}", bar_off + 4096)) => {}
        other => bail!("after overwriting byte 4096: {other:?}, want a mismatch there"),
    }
    ktap::pass()
}

fn vgpu_present() -> bool {
    Path::new("/dev/vgpu0").exists()
}

fn wait_for(what: &str, cond: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        if Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn gpu_unplug_and_replug() -> CaseResult {
    if let Some(reason) = guest::vgpu_absence() {
        return ktap::skip(reason);
    }
    ensure!(vgpu_present(), "/dev/vgpu0 is missing before the test");
    ctl::device_del(ctl::GPU_ID)?;
    wait_for("/dev/vgpu0 to go", || !vgpu_present())?;
    ctl::gpu_add()?;
    // The downstream port's hotplug slot tells the kernel; pciehp probes the device.
    wait_for("/dev/vgpu0 to come back", vgpu_present)?;
    ktap::pass()
}

fn read_fault_areas() -> CaseResult {
    let nvme = guest::open_direct(&guest::nvme_path()?, false)?;
    let mut buf = AlignedBuf::new(4096)?;
    use std::os::unix::fs::FileExt;
    let read = |buf: &mut AlignedBuf, at: u64| nvme.read_at(buf.as_mut_slice(), at);
    let err = read(&mut buf, pattern::fault::READ_ALWAYS)
        .err()
        .context("a read of the always-failing area succeeded")?;
    ensure!(
        matches!(err.raw_os_error(), Some(libc::EIO) | Some(libc::ENODATA)),
        "unexpected error {err}"
    );
    ensure!(
        read(&mut buf, pattern::fault::READ_ALWAYS).is_err(),
        "the always-failing area read once fine"
    );
    ensure!(
        read(&mut buf, pattern::fault::READ_ALWAYS - 4096).is_ok(),
        "the block before the fault area fails too"
    );
    // The once-failing area: the kernel retries a media error, so the first read may already
    // succeed on its retry; it must succeed from then on either way.
    let _ = read(&mut buf, pattern::fault::READ_ONCE);
    read(&mut buf, pattern::fault::READ_ONCE).context("the once-failing area still fails")?;
    ktap::pass()
}

fn unknown_request_is_refused() -> CaseResult {
    match ctl::request("explode gpu0") {
        Err(err) if format!("{err:#}").contains("unknown request") => ktap::pass(),
        other => bail!("expected a refusal, got {other:?}"),
    }
}
