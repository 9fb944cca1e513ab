//! A synchronous QMP client over the machine's UNIX socket, through the `qapi` crate.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use qapi::{Qmp, Stream, qmp};

/// A QMP session that completed the capabilities handshake.
pub struct Session {
    qmp: Qmp<Stream<BufReader<UnixStream>, UnixStream>>,
}

/// Connects to QEMU's QMP socket at `path`, waiting up to `timeout` for QEMU to create it.
pub fn connect(path: &Path, timeout: Duration) -> anyhow::Result<Session> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match UnixStream::connect(path) {
            Ok(stream) => break stream,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(err) => bail!("cannot connect to QMP at {}: {err}", path.display()),
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let reader = BufReader::new(stream.try_clone().context("cannot clone the QMP socket")?);
    let mut qmp = Qmp::new(Stream::new(reader, stream));
    qmp.handshake().context("QMP handshake failed")?;
    Ok(Session { qmp })
}

impl Session {
    /// The run state QEMU reports (`running`, `paused`, `guest-panicked`, ...).
    pub fn status(&mut self) -> anyhow::Result<String> {
        let info = self
            .qmp
            .execute(&qmp::query_status {})
            .context("query-status failed")?;
        Ok(format!("{:?}", info.status).to_lowercase())
    }

    /// Asks the guest to power off (ACPI), as a person pressing the power button would.
    pub fn powerdown(&mut self) -> anyhow::Result<()> {
        self.qmp
            .execute(&qmp::system_powerdown {})
            .context("system_powerdown failed")?;
        Ok(())
    }

    /// Stops QEMU at once.
    pub fn quit(&mut self) -> anyhow::Result<()> {
        self.qmp.execute(&qmp::quit {}).context("quit failed")?;
        Ok(())
    }

    /// Asks QEMU to unplug device `id` (the guest must cooperate; see
    /// [`Session::wait_device_deleted`]).
    pub fn device_del(&mut self, id: &str) -> anyhow::Result<()> {
        self.qmp
            .execute(&qmp::device_del { id: id.to_owned() })
            .with_context(|| format!("device_del {id} failed"))?;
        Ok(())
    }

    /// Waits until QEMU reports `DEVICE_DELETED` for `id`, or fails after `timeout`.
    pub fn wait_device_deleted(&mut self, id: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let deleted = self.qmp.events().any(|event| {
                matches!(event, qmp::Event::DEVICE_DELETED { data, .. } if data.device.as_deref() == Some(id))
            });
            if deleted {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "no DEVICE_DELETED for {id} within {} s: did the guest refuse the unplug?",
                    timeout.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
            // Any command collects the events QEMU sent meanwhile.
            self.qmp
                .nop()
                .context("QMP connection lost while waiting for DEVICE_DELETED")?;
        }
    }

    /// Runs an HMP command and returns its output; output that starts with `Error` fails.
    pub fn hmp(&mut self, command_line: &str) -> anyhow::Result<String> {
        let out = self
            .qmp
            .execute(&qmp::human_monitor_command {
                command_line: command_line.to_owned(),
                cpu_index: None,
            })
            .with_context(|| format!("HMP {command_line:?} failed"))?;
        if out.trim_start().starts_with("Error") {
            bail!("HMP {command_line:?}: {}", out.trim());
        }
        Ok(out)
    }

    /// Whether QEMU reported a guest panic (pvpanic) among the events received so far (events
    /// arrive with command responses).
    pub fn guest_panicked(&mut self) -> bool {
        self.qmp
            .events()
            .any(|event| matches!(event, qmp::Event::GUEST_PANICKED { .. }))
    }
}
