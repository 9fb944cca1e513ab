//! The guest's end of the rig's control channel (qemu/src/control.rs): ask the host for a
//! machine-level action, such as unplugging the GPU, and wait until it is done.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// The virtio-serial port's name.
pub const PORT_NAME: &str = "fgds.ctl";

/// The QEMU device id of the GPU (ivshmem).
pub const GPU_ID: &str = "gpu0";
/// The QEMU device id of the NVMe controller.
pub const NVME_ID: &str = "nvme0";

/// Sends one request and returns the detail of its `ok` reply; an `error` reply fails with the
/// host's reason. The host logs both in the run's `faults.log`.
pub fn request(line: &str) -> anyhow::Result<String> {
    let path = port_path()?;
    let mut port = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open the control port {}", path.display()))?;
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
pub fn device_del(id: &str) -> anyhow::Result<()> {
    request(&format!("device_del {id}")).map(drop)
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

fn port_path() -> anyhow::Result<PathBuf> {
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
