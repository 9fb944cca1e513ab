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

    /// Whether QEMU reported a guest panic (pvpanic) among the events received so far (events
    /// arrive with command responses).
    pub fn guest_panicked(&mut self) -> bool {
        self.qmp
            .events()
            .any(|event| matches!(event, qmp::Event::GUEST_PANICKED { .. }))
    }
}
