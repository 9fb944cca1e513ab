//! The guest's end of the rig's control channel (qemu/src/control.rs): ask the host for a
//! machine-level action, such as unplugging the GPU, and wait until it is done, or for a check
//! of the GPU's memory as the host sees it at that moment.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The virtio-serial port's name.
pub const PORT_NAME: &str = "fgds.ctl";

/// The QEMU device id of the GPU (ivshmem).
pub const GPU_ID: &str = "gpu0";
/// The QEMU device id of the NVMe controller.
pub const NVME_ID: &str = "nvme0";

/// How long a request waits for the port while another process holds it open: longer than an
/// unplug may take (`fgds_qemu::control::UNPLUG_TIMEOUT`, 90 s).
const PORT_WAIT: Duration = Duration::from_secs(120);

/// Sends one request and returns the detail of its `ok` reply; an `error` reply fails with the
/// host's reason. The host logs both in the run's `faults.log`.
///
/// A virtio-serial port is open in one process at a time (EBUSY otherwise): concurrent requests
/// (a forked child's, another thread's) wait their turn.
pub fn request(line: &str) -> anyhow::Result<String> {
    let path = port_path()?;
    let deadline = Instant::now() + PORT_WAIT;
    let mut port = loop {
        match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(port) => break port,
            Err(err) if err.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(err) => {
                return Err(err)
                    .with_context(|| format!("cannot open the control port {}", path.display()));
            }
        }
    };
    port.write_all(format!("{line}\n").as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&mut port as &mut File)
        .read_line(&mut reply)
        .context("no reply on the control port")?;
    let reply = reply.trim();
    match reply.split_once(' ').unwrap_or((reply, "")) {
        ("ok", detail) => Ok(detail.to_owned()),
        ("error", reason) => bail!("the host could not {line:?}: {reason}"),
        _ => bail!("malformed reply to {line:?}: {reply:?}"),
    }
}

/// Unplugs QEMU device `id` and waits for QEMU to report it gone.
///
/// When the host gives up waiting, the error carries what the guest was doing: the kernel's
/// messages since the request, with the stacks of its blocked tasks (sysrq `w`).
pub fn device_del(id: &str) -> anyhow::Result<()> {
    let mark = crate::guest::kernel_log_mark().ok();
    request(&format!("device_del {id}"))
        .map(drop)
        .map_err(|err| match mark {
            Some(mark) => anyhow::anyhow!("{err:#}\n{}", removal_snapshot(mark)),
            None => err,
        })
}

/// The kernel's messages after `mark` (at most the last [`SNAPSHOT_LINES`]), once sysrq `w` has
/// logged the stacks of the tasks blocked now: why a removal did not end.
fn removal_snapshot(mark: u64) -> String {
    const SNAPSHOT_LINES: usize = 80;
    let sysrq = std::fs::write("/proc/sysrq-trigger", "w")
        .err()
        .map(|e| format!(" (sysrq w failed: {e})"))
        .unwrap_or_default();
    let lines = match crate::guest::kernel_log_since(mark) {
        Ok(lines) => lines,
        Err(e) => return format!("the guest's kernel log: {e:#}"),
    };
    let skip = lines.len().saturating_sub(SNAPSHOT_LINES);
    format!(
        "the guest's kernel log since the request{sysrq}, last {} of {} lines:\n{}",
        lines.len() - skip,
        lines.len(),
        lines[skip..].join("\n")
    )
}

/// Plugs a device in with HMP `device_add` arguments.
pub fn device_add(args: &str) -> anyhow::Result<()> {
    request(&format!("device_add {args}")).map(drop)
}

/// Plugs the GPU back into its slot after [`device_del`] of [`GPU_ID`], with its memory as it
/// was (the same host file).
pub fn gpu_add() -> anyhow::Result<()> {
    request("gpu_add").map(drop)
}

/// Asks the host to read the GPU's memory now (BAR2, its backing file) and check that `len`
/// bytes at BAR2 offset `offset` hold the pattern of `seed` as [`crate::pattern::fill`] writes
/// it from stream offset 0. Fails with the host's answer (the first differing byte) otherwise.
pub fn gpu_check(offset: u64, len: u64, seed: u64) -> anyhow::Result<()> {
    gpu_check_at(offset, len, seed, 0)
}

/// [`gpu_check`] of the pattern as it stands at byte `pattern_offset` of its stream (the NVMe
/// image's pattern read from drive offset `pattern_offset`, say).
pub fn gpu_check_at(offset: u64, len: u64, seed: u64, pattern_offset: u64) -> anyhow::Result<()> {
    request(&format!(
        "gpu_check {offset:#x} {len:#x} {seed:#x} {pattern_offset:#x}"
    ))
    .map(drop)
}

/// The control channel's port in the guest (`/dev/vportNpM`).
pub fn port_path() -> anyhow::Result<PathBuf> {
    for entry in std::fs::read_dir("/sys/class/virtio-ports")
        .context("no virtio ports")?
        .flatten()
    {
        let name = std::fs::read_to_string(entry.path().join("name")).unwrap_or_default();
        if name.trim() == PORT_NAME {
            return Ok(Path::new("/dev").join(entry.file_name()));
        }
    }
    bail!("no virtio-serial port named {PORT_NAME}: run inside the rig (cargo xtask test-vm)")
}
