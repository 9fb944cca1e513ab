//! The control channel: guest tests ask the host for machine-level actions (unplug the GPU,
//! plug it back, any monitor command) at precise points, and wait for them to complete.
//!
//! The guest writes one request line on the virtio-serial port `fgds.ctl` and reads one reply
//! line, `ok [detail]` or `error <reason>`. Requests:
//! - `device_del <id>`: QMP `device_del`, then wait for `DEVICE_DELETED` of that id;
//! - `device_add <driver>,id=<id>[,prop=value...]`: HMP `device_add` (the rig's devices are
//!   plain properties), then the device is there;
//! - `gpu_add`: plugs the GPU back into its slot, with a fresh memory backend over the same
//!   host file (QEMU 7.2 cannot re-register the first backend's RAM block), so its memory is
//!   what it was;
//! - `hmp <command line>`: any HMP command; the reply carries its output on one line;
//! - `gpu_check <offset> <len> <seed> [<pattern-offset>]`: the host reads `len` bytes at
//!   `offset` of the GPU's memory (BAR2) from its backing file now (QEMU maps the file shared,
//!   so it holds what the guest and DMA put there) and compares them with the pattern of
//!   `seed` (`fgds_pattern`) as it stands at `pattern-offset` of its stream (default 0);
//!   `ok` if they match, else `error` with the first differing byte. Numbers are decimal or
//!   `0x` hex; offsets and lengths multiples of 8;
//! - `qemu_cpu`: the CPU time QEMU has used so far, in nanoseconds, all its threads and its
//!   vCPU threads alone: `ok <all> <vcpus>` (`QemuCpu`), for the bench to tell the host's
//!   cost of a mode (device emulation, DMA) from the guest's (under single-threaded TCG one
//!   thread, `ALL CPUs/TCG`, runs every vCPU);
//! - `qemu_backing`: how the host backs the GPU's memory and the guest's RAM (file system,
//!   pages mapped with PMDs, huge pages), from QEMU's smaps: `ok <json>` (`crate::backing`);
//! - `log <text>`: only recorded.
//!
//! Every request, its reply and its timing go to the run's fault log, so a run's artifacts say
//! what was injected and checked when.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::qmp;

/// How long an unplug may take before the request fails: longer than the guest's NVMe driver
/// takes to recover requests a drive never completes (`nvme_core.io_timeout`, 30 s, then an
/// abort; a second 30 s, then a controller reset that retries them). With QEMU 7.2, a removal
/// during I/O into or out of the device being removed now and then waits for that recovery: the
/// drive leaves requests in flight until the guest's timeout cancels them (docs/architecture.md,
/// Hot-unplug during I/O). The tests say how long each removal took.
pub const UNPLUG_TIMEOUT: Duration = Duration::from_secs(90);

/// How long an unplug request waits before it is made again. QEMU lets a request be repeated
/// once 5 s have passed (`pending_deleted_expires_ms`), for a guest that missed the ACPI
/// notification; a guest that got it but is still removing the device ignores the repeat.
const UNPLUG_REPEAT: Duration = Duration::from_secs(10);

/// The host end of the channel, serving requests until the machine stops.
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What `gpu_add` plugs in: the GPU's QEMU id, its slot and its memory's backing file.
#[derive(Debug, Clone)]
pub struct GpuSlot {
    pub id: String,
    pub bus: String,
    pub backing: PathBuf,
    pub bytes: u64,
}

/// Serves the channel at `ctl` (QEMU's socket, which QEMU listens on), executing requests
/// through the QMP socket `qmp_path` and logging them to `log_path`.
pub fn serve(ctl: &Path, qmp_path: &Path, log_path: &Path, gpu: GpuSlot) -> Server {
    let stop = Arc::new(AtomicBool::new(false));
    let (ctl, qmp_path, log_path) = (
        ctl.to_path_buf(),
        qmp_path.to_path_buf(),
        log_path.to_path_buf(),
    );
    let flag = Arc::clone(&stop);
    let thread = std::thread::spawn(move || {
        let mut log = FaultLog::new(&log_path);
        if let Err(err) = run(&ctl, &qmp_path, &flag, &mut log, &gpu) {
            log.line(&format!("control channel ended: {err:#}"));
        }
    });
    Server {
        stop,
        thread: Some(thread),
    }
}

impl Server {
    /// Stops serving (the machine is gone).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct FaultLog {
    path: PathBuf,
    started: Instant,
}

impl FaultLog {
    fn new(path: &Path) -> FaultLog {
        let _ = std::fs::write(path, "");
        FaultLog {
            path: path.to_path_buf(),
            started: Instant::now(),
        }
    }

    fn line(&mut self, text: &str) {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let entry = format!(
            "[{:9.3}s | unix {:.3}] {text}\n",
            self.started.elapsed().as_secs_f64(),
            wall.as_secs_f64()
        );
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.path)
        {
            let _ = f.write_all(entry.as_bytes());
        }
    }
}

fn run(
    ctl: &Path,
    qmp_path: &Path,
    stop: &AtomicBool,
    log: &mut FaultLog,
    gpu: &GpuSlot,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let stream = loop {
        match UnixStream::connect(ctl) {
            Ok(stream) => break stream,
            Err(_) if Instant::now() < deadline && !stop.load(Ordering::Relaxed) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(err) => anyhow::bail!("cannot connect to {}: {err}", ctl.display()),
        }
    };
    stream.set_read_timeout(Some(Duration::from_millis(200)))?;
    let mut session = qmp::connect(qmp_path, Duration::from_secs(10))?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let mut backends = 0;
    let mut qemu = QemuCpu::new(peer_pid(&writer));
    while !stop.load(Ordering::Relaxed) {
        match reader.read_line(&mut line) {
            Ok(0) => break,
            Ok(_) => {
                let request = line.trim().to_owned();
                line.clear();
                if request.is_empty() {
                    continue;
                }
                if request == "qemu_cpu" {
                    // Asked around every turn of a benchmark: answered, not logged.
                    let reply = match qemu.read() {
                        Ok((all, vcpus)) => format!("ok {all} {vcpus}"),
                        Err(err) => format!("error {err:#}"),
                    };
                    writer.write_all(format!("{reply}\n").as_bytes())?;
                    continue;
                }
                if request == "qemu_backing" {
                    let reply = match qemu
                        .pid
                        .ok_or_else(|| {
                            anyhow::format_err!(
                                "QEMU's pid is unknown (SO_PEERCRED on the control socket failed)"
                            )
                        })
                        .and_then(|pid| crate::backing::describe(pid, &gpu.backing))
                    {
                        Ok(json) => format!("ok {json}"),
                        Err(err) => format!("error {}", format!("{err:#}").replace('\n', "; ")),
                    };
                    log.line(&format!("qemu_backing: {reply}"));
                    writer.write_all(format!("{reply}\n").as_bytes())?;
                    continue;
                }
                log.line(&format!("request: {request}"));
                let started = Instant::now();
                let reply = match execute(&mut session, &request, gpu, &mut backends) {
                    Ok(detail) => format!("ok {detail}").trim_end().to_owned(),
                    Err(err) => format!("error {}", format!("{err:#}").replace('\n', "; ")),
                };
                log.line(&format!(
                    "reply after {:.3}s: {reply}",
                    started.elapsed().as_secs_f64()
                ));
                writer.write_all(format!("{reply}\n").as_bytes())?;
            }
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

fn execute(
    session: &mut qmp::Session,
    request: &str,
    gpu: &GpuSlot,
    backends: &mut u32,
) -> anyhow::Result<String> {
    let (verb, rest) = request.split_once(' ').unwrap_or((request, ""));
    match verb {
        "device_del" => device_del(session, rest.trim()),
        "device_add" => Ok(session
            .hmp(&format!("device_add {}", rest.trim()))?
            .replace('\n', " ")),
        "gpu_add" => {
            *backends += 1;
            let memdev = format!("vram-replug{backends}");
            session.hmp(&format!(
                "object_add {}",
                crate::machine::gpu_memory_backend(&memdev, gpu.bytes, &gpu.backing)
            ))?;
            session.hmp(&format!(
                "device_add ivshmem-plain,id={},memdev={memdev},bus={}",
                gpu.id, gpu.bus
            ))?;
            Ok(memdev)
        }
        "hmp" => Ok(session.hmp(rest.trim())?.replace('\n', " ")),
        "gpu_check" => gpu_check(&gpu.backing, gpu.bytes, rest),
        "log" => Ok(String::new()),
        other => anyhow::bail!(
            "unknown request {other:?}: use device_del, device_add, gpu_add, hmp, gpu_check, \
             qemu_cpu, qemu_backing or log"
        ),
    }
}

/// The process at the other end of the control socket: QEMU, which listens on it.
fn peer_pid(stream: &UnixStream) -> Option<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a `ucred` and its size, as SO_PEERCRED
    // needs, and the descriptor is the stream's, open for the call.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid)
}

/// QEMU's CPU time, summed over its threads from `/proc/<pid>/task/*/schedstat` (nanoseconds
/// on the CPU). Threads come and go (the block layer's worker pool): each reading adds what
/// every thread ran since the last one, so a thread that ended loses only its time after it;
/// `/proc/<pid>/stat`, which keeps ended threads' time, counts in 10 ms ticks, too coarse for
/// turns of 0.1 s.
struct QemuCpu {
    pid: Option<i32>,
    /// Each thread's run time at the last reading, and whether it is a vCPU thread.
    seen: HashMap<u32, (u64, bool)>,
    all: u64,
    vcpus: u64,
}

impl QemuCpu {
    fn new(pid: Option<i32>) -> QemuCpu {
        QemuCpu {
            pid,
            seen: HashMap::new(),
            all: 0,
            vcpus: 0,
        }
    }

    /// The nanoseconds QEMU's threads ran so far: all of them, and the vCPU threads alone
    /// (named `CPU <n>/TCG`, `CPU <n>/KVM`, or under single-threaded TCG `ALL CPUs/TCG`). Only
    /// differences between readings mean much.
    fn read(&mut self) -> anyhow::Result<(u64, u64)> {
        use anyhow::Context;
        let pid = self
            .pid
            .context("QEMU's pid is unknown (SO_PEERCRED on the control socket failed)")?;
        let tasks = format!("/proc/{pid}/task");
        let mut now = HashMap::new();
        for entry in std::fs::read_dir(&tasks).with_context(|| format!("cannot list {tasks}"))? {
            let entry = entry?;
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|t| t.parse::<u32>().ok())
            else {
                continue;
            };
            // A thread that ended since the listing has nothing to add.
            let Ok(stat) = std::fs::read_to_string(entry.path().join("schedstat")) else {
                continue;
            };
            let ran = stat
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .with_context(|| format!("{tasks}/{tid}/schedstat: {stat:?}"))?;
            let vcpu = match self.seen.get(&tid) {
                Some(&(_, vcpu)) => vcpu,
                None => std::fs::read_to_string(entry.path().join("comm"))
                    .is_ok_and(|c| is_vcpu_thread(c.trim_end())),
            };
            let grew = ran.saturating_sub(self.seen.get(&tid).map_or(0, |&(r, _)| r));
            self.all += grew;
            if vcpu {
                self.vcpus += grew;
            }
            now.insert(tid, (ran, vcpu));
        }
        self.seen = now;
        Ok((self.all, self.vcpus))
    }
}

/// Whether a QEMU thread of this name runs guest CPUs: `CPU 0/TCG`, `CPU 1/KVM`, `ALL CPUs/TCG`.
fn is_vcpu_thread(comm: &str) -> bool {
    comm.ends_with("/TCG") || comm.ends_with("/KVM")
}

/// `gpu_check <offset> <len> <seed> [<pattern-offset>]` over the GPU's backing file `backing`
/// of `bytes` bytes: the detail of an `ok` reply, or why the memory is not what was asked.
pub fn gpu_check(backing: &Path, bytes: u64, args: &str) -> anyhow::Result<String> {
    use std::os::unix::fs::FileExt;
    let numbers = args
        .split_whitespace()
        .map(|word| {
            let parsed = match word.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => word.parse(),
            };
            parsed.map_err(|_| anyhow::format_err!("{word:?} is not a number"))
        })
        .collect::<anyhow::Result<Vec<u64>>>()?;
    let (offset, len, seed, at) = match numbers[..] {
        [offset, len, seed] => (offset, len, seed, 0),
        [offset, len, seed, at] => (offset, len, seed, at),
        _ => {
            anyhow::bail!("gpu_check takes <offset> <len> <seed> [<pattern-offset>], got {args:?}")
        }
    };
    anyhow::ensure!(
        [offset, len, at].iter().all(|n| n.is_multiple_of(8)),
        "gpu_check: offset {offset:#x}, length {len:#x} and pattern offset {at:#x} must be \
         multiples of 8"
    );
    anyhow::ensure!(
        offset.checked_add(len).is_some_and(|end| end <= bytes),
        "gpu_check: {offset:#x}+{len:#x} is outside the GPU's {bytes:#x} bytes"
    );
    let file = std::fs::File::open(backing)
        .map_err(|err| anyhow::format_err!("cannot open {}: {err}", backing.display()))?;
    let mut buf = vec![0u8; len.min(4 << 20) as usize];
    let mut done = 0;
    while done < len {
        let n = buf.len().min((len - done) as usize);
        let chunk = &mut buf[..n];
        file.read_exact_at(chunk, offset + done).map_err(|err| {
            anyhow::format_err!(
                "cannot read {} at {:#x}: {err}",
                backing.display(),
                offset + done
            )
        })?;
        if let Some(i) = fgds_pattern::first_mismatch(seed, at + done, chunk) {
            let byte = offset + done + i as u64;
            // The 8-byte word there, found and wanted: what was written instead says who wrote.
            let word = i & !7;
            let found = chunk
                .get(word..word + 8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")));
            let mut wanted = [0u8; 8];
            fgds_pattern::fill(seed, at + done + word as u64, &mut wanted);
            anyhow::bail!(
                "the GPU's memory differs from the pattern of seed {seed:#x} at BAR2 byte \
                 {byte:#x} ({:#x} into the {len:#x} bytes checked from {offset:#x}): found \
                 {:#018x}, want {:#018x}",
                done + i as u64,
                found.unwrap_or(0),
                u64::from_le_bytes(wanted)
            );
        }
        done += n as u64;
    }
    Ok(format!("{len:#x} bytes at {offset:#x} hold the pattern"))
}

/// Asks QEMU to unplug `id` and waits up to [`UNPLUG_TIMEOUT`] for `DEVICE_DELETED`, asking
/// again every [`UNPLUG_REPEAT`]; the reply says how many times it asked.
fn device_del(session: &mut qmp::Session, id: &str) -> anyhow::Result<String> {
    let deadline = Instant::now() + UNPLUG_TIMEOUT;
    let mut asked = 0;
    loop {
        match session.device_del(id) {
            Ok(()) => {}
            // A repeat while QEMU still counts the first as recent is refused; the wait goes on.
            Err(_) if asked > 0 => {}
            Err(err) => return Err(err),
        }
        asked += 1;
        let left = deadline.saturating_duration_since(Instant::now());
        match session.wait_device_deleted(id, left.min(UNPLUG_REPEAT)) {
            Ok(()) if asked == 1 => return Ok("DEVICE_DELETED".to_owned()),
            Ok(()) => return Ok(format!("DEVICE_DELETED (asked {asked} times)")),
            Err(_) if left > UNPLUG_REPEAT => {}
            Err(_) => anyhow::bail!(
                "no DEVICE_DELETED for {id} within {} s, asked {asked} times: the guest did not \
                 finish removing it (see the guest's kernel log)",
                UNPLUG_TIMEOUT.as_secs()
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{gpu_check, is_vcpu_thread};

    #[test]
    fn vcpu_threads_by_name() {
        for name in ["CPU 0/TCG", "CPU 1/KVM", "ALL CPUs/TCG"] {
            assert!(is_vcpu_thread(name), "{name}");
        }
        for name in ["qemu-system-x86", "worker", "IO iothread0", "call_rcu"] {
            assert!(!is_vcpu_thread(name), "{name}");
        }
    }
    use fgds_pattern as pattern;

    fn backing(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("fgds-control-{}-{name}", std::process::id()));
        std::fs::write(&path, bytes).expect("temp file");
        path
    }

    #[test]
    fn gpu_check_answers_from_the_file_as_it_is_now() {
        let mut mem = vec![0u8; 64 << 10];
        pattern::fill(7, 0, &mut mem[8192..16384]);
        pattern::fill(9, 4096, &mut mem[32768..36864]);
        let path = backing("now", &mem);
        let bytes = mem.len() as u64;
        assert!(gpu_check(&path, bytes, "8192 8192 7").is_ok());
        assert!(gpu_check(&path, bytes, "0x8000 0x1000 0x9 0x1000").is_ok());
        let err = gpu_check(&path, bytes, "0x8000 0x1000 9").unwrap_err();
        assert!(format!("{err}").contains("at BAR2 byte 0x8000"), "{err}");

        // A later write to the file is what the next check sees.
        mem[9000] ^= 0xff;
        std::fs::write(&path, &mem).expect("rewrite");
        let err = gpu_check(&path, bytes, "8192 8192 7").unwrap_err();
        assert!(format!("{err}").contains("at BAR2 byte 0x2328"), "{err}");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn gpu_check_refuses_bad_requests() {
        let path = backing("bad", &[0u8; 4096]);
        for args in ["0 8", "0 8 1 2 3", "x 8 1", "4 8 1", "0 8192 1", "4096 8 1"] {
            assert!(gpu_check(&path, 4096, args).is_err(), "{args:?} accepted");
        }
        let _ = std::fs::remove_file(&path);
    }
}
