//! A small synchronous QMP client over the machine's UNIX socket: one JSON object a line each
//! way (`serde_json`), the few commands the rig needs.
//!
//! QEMU greets with `{"QMP": {...}}` and accepts commands once `qmp_capabilities` returned.
//! Each command is a line `{"execute": NAME, "arguments": {...}}`; QEMU answers with a line
//! holding `"return"` (success) or `"error"` (`class` and `desc`), and may send event lines
//! (`"event"`) before it at any time. Events are kept in arrival order until a method that looks
//! at them consumes them ([`Session::wait_device_deleted`], [`Session::guest_panicked`]).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Map, Value, json};

/// How long a read from QEMU may block before the session counts as lost.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A QMP session that completed the capabilities handshake.
pub struct Session {
    /// QEMU's side of the socket, read a line at a time.
    reader: BufReader<UnixStream>,
    /// The same socket, for the commands.
    writer: UnixStream,
    /// The events received with command responses and not yet consumed, oldest first.
    events: Vec<Event>,
}

/// An asynchronous QMP message (`{"event": NAME, "data": {...}, "timestamp": {...}}`).
#[derive(Debug, Clone, PartialEq)]
struct Event {
    /// The event's name, such as `DEVICE_DELETED` or `GUEST_PANICKED`.
    name: String,
    /// Its `data` member (`null` when it has none).
    data: Value,
}

/// Connects to QEMU's QMP socket at `path`, waiting up to `timeout` for QEMU to create it.
pub fn connect(path: &Path, timeout: Duration) -> anyhow::Result<Session> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match UnixStream::connect(path) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(err) => bail!("cannot connect to QMP at {}: {err}", path.display()),
        }
    };
    Session::handshake(stream).context("QMP handshake failed")
}

impl Session {
    /// Reads QEMU's greeting on `stream` and enters command mode (`qmp_capabilities`).
    fn handshake(stream: UnixStream) -> anyhow::Result<Session> {
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        let reader = BufReader::new(stream.try_clone().context("cannot clone the QMP socket")?);
        let mut session = Session {
            reader,
            writer: stream,
            events: Vec::new(),
        };
        let greeting = session.read_message().context("no QMP greeting")?;
        if !greeting.contains_key("QMP") {
            bail!("expected the QMP greeting, got {}", Value::Object(greeting));
        }
        session.execute("qmp_capabilities", None)?;
        Ok(session)
    }

    /// The run state QEMU reports (`running`, `paused`, `guest-panicked`, ...), as QEMU spells it.
    pub fn status(&mut self) -> anyhow::Result<String> {
        let info = self
            .execute("query-status", None)
            .context("query-status failed")?;
        match info.get("status").and_then(Value::as_str) {
            Some(status) => Ok(status.to_owned()),
            None => bail!("query-status returned no status: {info}"),
        }
    }

    /// Asks the guest to power off (ACPI), as a person pressing the power button would.
    pub fn powerdown(&mut self) -> anyhow::Result<()> {
        self.execute("system_powerdown", None)
            .context("system_powerdown failed")?;
        Ok(())
    }

    /// Stops QEMU at once.
    pub fn quit(&mut self) -> anyhow::Result<()> {
        self.execute("quit", None).context("quit failed")?;
        Ok(())
    }

    /// Asks QEMU to unplug device `id` (the guest must cooperate; see
    /// [`Session::wait_device_deleted`]).
    pub fn device_del(&mut self, id: &str) -> anyhow::Result<()> {
        self.execute("device_del", Some(json!({ "id": id })))
            .with_context(|| format!("device_del {id} failed"))?;
        Ok(())
    }

    /// Waits until QEMU reports `DEVICE_DELETED` for `id`, or fails after `timeout`. Consumes
    /// the events received so far, whatever they are.
    pub fn wait_device_deleted(&mut self, id: &str, timeout: Duration) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let deleted = self.take_events().iter().any(|event| {
                event.name == "DEVICE_DELETED"
                    && event.data.get("device").and_then(Value::as_str) == Some(id)
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
            // Any command collects the events QEMU sent meanwhile; this one changes nothing.
            self.execute("query-version", None)
                .context("QMP connection lost while waiting for DEVICE_DELETED")?;
        }
    }

    /// Runs an HMP command and returns its output; output that starts with `Error` fails.
    pub fn hmp(&mut self, command_line: &str) -> anyhow::Result<String> {
        let out = self
            .execute(
                "human-monitor-command",
                Some(json!({ "command-line": command_line })),
            )
            .with_context(|| format!("HMP {command_line:?} failed"))?;
        let Value::String(out) = out else {
            bail!("HMP {command_line:?} returned {out}, not its output as a string");
        };
        if out.trim_start().starts_with("Error") {
            bail!("HMP {command_line:?}: {}", out.trim());
        }
        Ok(out)
    }

    /// Whether QEMU reported a guest panic (pvpanic) among the events received so far (events
    /// arrive with command responses). Consumes those events.
    pub fn guest_panicked(&mut self) -> bool {
        self.take_events()
            .iter()
            .any(|event| event.name == "GUEST_PANICKED")
    }

    /// The events received so far, which the session forgets.
    fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// Sends command `name` with `arguments` (an object, or none) and returns QEMU's `return`
    /// value, keeping the events that arrive before it. QEMU's `error` fails with its class and
    /// description.
    fn execute(&mut self, name: &str, arguments: Option<Value>) -> anyhow::Result<Value> {
        let mut command = json!({ "execute": name });
        if let Some(arguments) = arguments {
            command["arguments"] = arguments;
        }
        let mut line = command.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .with_context(|| format!("cannot send {name} to QEMU"))?;
        loop {
            let mut message = self
                .read_message()
                .with_context(|| format!("no answer from QEMU to {name}"))?;
            if let Some(value) = message.remove("return") {
                return Ok(value);
            }
            if let Some(error) = message.remove("error") {
                let field = |key| error.get(key).and_then(Value::as_str).unwrap_or("?");
                bail!("QEMU: {} ({})", field("desc"), field("class"));
            }
            match message.remove("event") {
                Some(Value::String(name)) => {
                    let data = message.remove("data").unwrap_or(Value::Null);
                    self.events.push(Event { name, data });
                }
                _ => bail!(
                    "unexpected QMP message while waiting for {name}: {}",
                    Value::Object(message)
                ),
            }
        }
    }

    /// Reads QEMU's next message, a JSON object on a line of its own (blank lines skipped).
    fn read_message(&mut self) -> anyhow::Result<Map<String, Value>> {
        let mut line = String::new();
        loop {
            line.clear();
            let read = self
                .reader
                .read_line(&mut line)
                .context("cannot read from the QMP socket")?;
            if read == 0 {
                bail!("QEMU closed the QMP socket");
            }
            if !line.trim().is_empty() {
                break;
            }
        }
        match serde_json::from_str(&line) {
            Ok(Value::Object(message)) => Ok(message),
            Ok(other) => bail!("QMP message is not a JSON object: {other}"),
            Err(err) => bail!("QMP message is not JSON ({err}): {:?}", line.trim_end()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Session, connect};
    use serde_json::{Value, json};
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    /// QEMU 7.2's greeting.
    const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": "Debian 1:7.2+dfsg-7"}, "capabilities": ["oob"]}}"#;

    /// Plays QEMU on `stream`: sends `greeting`, then answers each command line with the lines
    /// `respond` gives for it (CRLF-terminated, as QEMU writes them) until the client hangs up.
    /// Returns the commands received, each checked to be one JSON object on one line.
    fn serve(
        stream: UnixStream,
        greeting: &'static str,
        mut respond: impl FnMut(&Value) -> Vec<String> + Send + 'static,
    ) -> JoinHandle<Vec<Value>> {
        std::thread::spawn(move || {
            let mut writer = stream.try_clone().unwrap();
            let mut reader = BufReader::new(stream);
            write!(writer, "{greeting}\r\n").unwrap();
            let mut commands = Vec::new();
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap() > 0 {
                assert!(
                    line.ends_with('\n'),
                    "command not ended by a newline: {line:?}"
                );
                let command: Value = serde_json::from_str(&line).unwrap();
                assert!(command["execute"].is_string(), "{command}");
                let replies = respond(&command);
                commands.push(command);
                for reply in replies {
                    // A peer that already hung up (a test that ends the session) is fine.
                    let _ = write!(writer, "{reply}\r\n");
                }
                line.clear();
            }
            commands
        })
    }

    /// The answers of a QEMU that takes every command, as `{"return": {}}` (or what `respond`
    /// gives for commands other than `qmp_capabilities`).
    fn qemu(
        mut respond: impl FnMut(&str, &Value) -> Vec<String> + Send + 'static,
    ) -> (Session, JoinHandle<Vec<Value>>) {
        let (client, server) = UnixStream::pair().unwrap();
        let server = serve(server, GREETING, move |command| {
            match command["execute"].as_str().unwrap() {
                "qmp_capabilities" => vec![r#"{"return": {}}"#.to_owned()],
                name => respond(name, command),
            }
        });
        (Session::handshake(client).unwrap(), server)
    }

    fn event(name: &str, data: Value) -> String {
        json!({
            "event": name,
            "data": data,
            "timestamp": {"seconds": 1700000000, "microseconds": 12345},
        })
        .to_string()
    }

    fn names(commands: &[Value]) -> Vec<&str> {
        commands
            .iter()
            .map(|c| c["execute"].as_str().unwrap())
            .collect()
    }

    #[test]
    fn status_with_an_event_before_the_return() {
        let (mut session, server) = qemu(|name, _| match name {
            "query-status" => vec![
                event("GUEST_PANICKED", json!({"action": "pause"})),
                r#"{"return": {"status": "guest-panicked", "singlestep": false, "running": false}}"#
                    .to_owned(),
            ],
            other => panic!("unexpected {other}"),
        });
        assert!(!session.guest_panicked(), "no event before any command");
        assert_eq!(session.status().unwrap(), "guest-panicked");
        assert!(session.guest_panicked());
        assert!(!session.guest_panicked(), "the event was consumed");
        drop(session);
        let commands = server.join().unwrap();
        assert_eq!(names(&commands), ["qmp_capabilities", "query-status"]);
        assert_eq!(commands[0], json!({"execute": "qmp_capabilities"}));
    }

    #[test]
    fn error_reply_fails_with_class_and_description() {
        let (mut session, server) = qemu(|name, command| match name {
            "device_del" => {
                assert_eq!(command["arguments"], json!({"id": "nvme9"}));
                vec![
                    r#"{"error": {"class": "DeviceNotFound", "desc": "Device 'nvme9' not found"}}"#
                        .to_owned(),
                ]
            }
            _ => vec![r#"{"return": {"status": "running", "running": true}}"#.to_owned()],
        });
        let err = format!("{:#}", session.device_del("nvme9").unwrap_err());
        assert!(err.starts_with("device_del nvme9 failed"), "{err}");
        assert!(err.contains("DeviceNotFound"), "{err}");
        assert!(err.contains("Device 'nvme9' not found"), "{err}");
        // The session goes on after an error.
        assert_eq!(session.status().unwrap(), "running");
        drop(session);
        server.join().unwrap();
    }

    #[test]
    fn device_deleted_collected_by_later_commands() {
        let mut polls = 0;
        let (mut session, server) = qemu(move |name, _| match name {
            "device_del" => vec![
                // Another device's event, and a path-only one, before the return.
                event(
                    "DEVICE_DELETED",
                    json!({"device": "nvme2", "path": "/machine/peripheral/nvme2"}),
                ),
                event(
                    "DEVICE_DELETED",
                    json!({"path": "/machine/peripheral/gpu/virtio-backend"}),
                ),
                r#"{"return": {}}"#.to_owned(),
            ],
            "query-version" => {
                polls += 1;
                let mut replies = Vec::new();
                if polls == 2 {
                    replies.push(event(
                        "DEVICE_DELETED",
                        json!({"device": "gpu", "path": "/machine/peripheral/gpu"}),
                    ));
                }
                replies.push(
                    r#"{"return": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}}"#
                        .to_owned(),
                );
                replies
            }
            other => panic!("unexpected {other}"),
        });
        session.device_del("gpu").unwrap();
        let start = Instant::now();
        session
            .wait_device_deleted("gpu", Duration::from_secs(10))
            .unwrap();
        assert!(start.elapsed() < Duration::from_secs(5));
        drop(session);
        let commands = server.join().unwrap();
        assert_eq!(
            names(&commands),
            [
                "qmp_capabilities",
                "device_del",
                "query-version",
                "query-version"
            ]
        );
    }

    #[test]
    fn device_deleted_times_out() {
        let (mut session, server) = qemu(|name, _| match name {
            "query-version" => vec![
                event("DEVICE_DELETED", json!({"device": "other"})),
                r#"{"return": {}}"#.to_owned(),
            ],
            other => panic!("unexpected {other}"),
        });
        let err = session
            .wait_device_deleted("gpu", Duration::from_millis(250))
            .unwrap_err()
            .to_string();
        assert!(err.contains("no DEVICE_DELETED for gpu"), "{err}");
        drop(session);
        assert!(names(&server.join().unwrap()).contains(&"query-version"));
    }

    #[test]
    fn hmp_output_and_errors() {
        let (mut session, server) = qemu(|name, command| {
            assert_eq!(name, "human-monitor-command");
            let output = match command["arguments"]["command-line"].as_str().unwrap() {
                "info status" => "VM status: running\r\n",
                "device_add nope" => "Error: 'nope' is not a valid device model name\r\n",
                other => panic!("unexpected HMP {other}"),
            };
            vec![json!({ "return": output }).to_string()]
        });
        assert_eq!(
            session.hmp("info status").unwrap(),
            "VM status: running\r\n"
        );
        let err = session.hmp("device_add nope").unwrap_err().to_string();
        assert!(
            err.contains("'nope' is not a valid device model name"),
            "{err}"
        );
        drop(session);
        server.join().unwrap();
    }

    #[test]
    fn powerdown_and_quit_then_qemu_hangs_up() {
        let (client, server) = UnixStream::pair().unwrap();
        let server = serve(server, GREETING, |command| {
            match command["execute"].as_str().unwrap() {
                "qmp_capabilities" | "system_powerdown" => vec![r#"{"return": {}}"#.to_owned()],
                // QEMU answers quit, then closes the socket as it exits.
                "quit" => vec![
                    r#"{"return": {}}"#.to_owned(),
                    event(
                        "SHUTDOWN",
                        json!({"guest": false, "reason": "host-qmp-quit"}),
                    ),
                ],
                other => panic!("unexpected {other}"),
            }
        });
        let mut session = Session::handshake(client).unwrap();
        session.powerdown().unwrap();
        session.quit().unwrap();
        assert!(!session.guest_panicked());
        drop(session);
        let commands = server.join().unwrap();
        assert_eq!(
            names(&commands),
            ["qmp_capabilities", "system_powerdown", "quit"]
        );
        assert!(commands.iter().all(|c| c.get("arguments").is_none()));
    }

    #[test]
    fn closed_socket_fails_the_command() {
        let (client, server) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let mut writer = server.try_clone().unwrap();
            let mut reader = BufReader::new(server);
            write!(writer, "{GREETING}\r\n").unwrap();
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            write!(writer, "{{\"return\": {{}}}}\r\n").unwrap();
            line.clear();
            reader.read_line(&mut line).unwrap();
            line
            // Dropping the socket without an answer.
        });
        let mut session = Session::handshake(client).unwrap();
        let err = format!("{:#}", session.status().unwrap_err());
        assert!(err.contains("closed the QMP socket"), "{err}");
        assert!(server.join().unwrap().contains("query-status"));
    }

    #[test]
    fn handshake_needs_the_greeting() {
        let (client, server) = UnixStream::pair().unwrap();
        let server = serve(server, r#"{"return": {}}"#, |_| Vec::new());
        let err = format!("{:#}", Session::handshake(client).err().unwrap());
        assert!(err.contains("expected the QMP greeting"), "{err}");
        assert!(server.join().unwrap().is_empty());

        let (client, server) = UnixStream::pair().unwrap();
        let server = serve(server, "QMP ready", |_| Vec::new());
        let err = format!("{:#}", Session::handshake(client).err().unwrap());
        assert!(err.contains("not JSON"), "{err}");
        server.join().unwrap();
    }

    #[test]
    fn connect_waits_for_the_socket() {
        let dir = std::env::temp_dir().join(format!("fgds-qmp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&path);
        let err = connect(&path, Duration::from_millis(50)).err().unwrap();
        assert!(err.to_string().contains("cannot connect to QMP"), "{err}");

        let listen_at = path.clone();
        let server = std::thread::spawn(move || {
            // QEMU creates the socket a moment after it starts.
            std::thread::sleep(Duration::from_millis(100));
            let listener = UnixListener::bind(&listen_at).unwrap();
            let (stream, _) = listener.accept().unwrap();
            serve(stream, GREETING, |command| {
                match command["execute"].as_str().unwrap() {
                    "qmp_capabilities" => vec![r#"{"return": {}}"#.to_owned()],
                    _ => {
                        vec![r#"{"return": {"status": "prelaunch", "running": false}}"#.to_owned()]
                    }
                }
            })
            .join()
            .unwrap()
        });
        let mut session = connect(&path, Duration::from_secs(10)).unwrap();
        assert_eq!(session.status().unwrap(), "prelaunch");
        drop(session);
        assert_eq!(
            names(&server.join().unwrap()),
            ["qmp_capabilities", "query-status"]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
