//! A concurrency fuzzer for fgds's UAPI (issue 22), run by `cargo xtask fuzz` under the debug
//! kernels' KASAN, lockdep and kmemleak, whose splats and leaks fail the run.
//!
//! Worker processes (forked from this one, respawned when they exit or are killed) run threads
//! that pick random operations on shared registrations: vgpu allocations, REG and UNREG (valid
//! and invalid), mmap and munmap (whole and partial), CPU touches, fork and exit with mappings,
//! mremap, madvise, O_DIRECT pread/pwrite and io_uring reads into mappings, io_uring fixed
//! buffers, closes of dma-buf fds and of the node, vgpu revocations and process exit. This
//! process meanwhile unbinds and rebinds the GPU's driver, hot-unplugs and replugs it through
//! the rig's control channel, and kills workers.
//!
//! Checked, not only survived: every call returns success or an errno the UAPI (or the kernel,
//! for mm calls) documents for that state; a CPU access raises SIGBUS only on a revoked buffer
//! (or one whose GPU went away); fgds's counters return to zero; GPU memory outside the
//! fuzzer's window (guards filled with a pattern, never registered) is unchanged, as the host
//! reads it; every read that completed into the window brought the drive's bytes, as the host
//! reads them right after (every read into GPU byte `b` of the window comes from the drive's
//! byte `b - GUARD_LOW`, and CPU stores write the same bytes, so that nothing else may change
//! them, and the window starts out holding other bytes); each operation ran at least a minimum
//! number of times (a run that never exercised something passes nothing); no operation is
//! still running a minute after it should have stopped.
//!
//! Parameters (kernel command line `fgds.fuzz_<name>=`, seen here as `FGDS_FUZZ_<NAME>`):
//! `SECONDS` (default 60), `SEED` (default: from the clock; printed at start), `OPS` (stop
//! after this many operations; 0: no limit), `WORKERS` (processes, default 2), `THREADS` (per
//! worker, default 3), `CHAOS` (seconds between unbinds/unplugs on average, 0: none; default
//! 20). A seed fixes every thread's sequence of operations; the interleaving is the machine's.
//! The summary is one `fgds-fuzz: {json}` line.

use fgds_tests::common;
use fgds_tests::fault;

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use common::{MIB, PAGE};
use fgds_tests::ktap::{self, Case, CaseResult};
use fgds_tests::{ctl, pattern};
use rustix::io::Errno;

fn main() {
    common::run_unless_refused(&[Case {
        name: "fuzz",
        run: fuzz,
    }])
}

/// The operations, in the order of the summary.
const OPS: &[&str] = &[
    "alloc",
    "free_buffer",
    "reg",
    "reg_again",
    "reg_invalid",
    "unreg",
    "unreg_invalid",
    "mmap",
    "mmap_invalid",
    "munmap",
    "munmap_partial",
    "touch",
    "fork_exit",
    "mremap_in_child",
    "madvise",
    "pread",
    "pwrite",
    "fgds_io",
    "fgds_io_cmd",
    "fgds_io_refused",
    "uring_read",
    "uring_fixed_buffer",
    "close_dmabuf",
    "close_node",
    "revoke",
    "exit",
    "unbind_rebind",
    "unplug_replug",
    "kill_worker",
];

fn op_index(name: &str) -> usize {
    OPS.iter()
        .position(|o| *o == name)
        .expect("known operation")
}

/// Outcome columns: success, a short transfer, the two signals, then errno 1..=MAX_ERRNO.
const OK: usize = 0;
const SHORT: usize = 1;
const SIGBUS: usize = 2;
const SIGSEGV: usize = 3;
const MAX_ERRNO: usize = 140;
const OUTCOMES: usize = 4 + MAX_ERRNO;

fn outcome_name(i: usize) -> String {
    match i {
        OK => "ok".into(),
        SHORT => "short".into(),
        SIGBUS => "SIGBUS".into(),
        SIGSEGV => "SIGSEGV".into(),
        e => fgds_tests::errno::name((e - 4 + 1) as i32),
    }
}

fn errno_outcome(e: Errno) -> usize {
    let raw = e.raw_os_error() as usize;
    if (1..=MAX_ERRNO).contains(&raw) {
        4 + raw - 1
    } else {
        4 + MAX_ERRNO - 1
    }
}

const MAX_WORKERS: usize = 16;
/// Failure lines printed before the fuzzer only counts them.
const MAX_FAILURE_LINES: u64 = 40;

/// What every process of the fuzzer shares (an anonymous shared mapping; all atomics, so
/// zeroed memory is a valid value and forked children may use it).
#[repr(C)]
struct Shared {
    stop: AtomicBool,
    paused: AtomicBool,
    /// Bumped before every unbind or unplug and once the GPU is back: a node opened or a
    /// buffer allocated in an earlier epoch may fail with ENODEV, a mapping of it SIGBUS.
    epoch: AtomicU64,
    ops: AtomicU64,
    failures: AtomicU64,
    /// Set from the first bump to the second: the GPU is going or coming back.
    chaos: AtomicBool,
    /// vgpu revocations under way, per worker slot (reset when the worker dies).
    revoking: [AtomicU64; MAX_WORKERS],
    /// Operations running, per worker slot (reset when the worker dies).
    active: [AtomicU64; MAX_WORKERS],
    counts: [[AtomicU64; OUTCOMES]; 32],
    /// Thread time spent in each operation, µs.
    busy_us: [AtomicU64; 32],
    /// Reads whose bytes the host checked, per operation.
    verified: [AtomicU64; 32],
}

fn shared() -> anyhow::Result<&'static Shared> {
    let len = std::mem::size_of::<Shared>();
    // SAFETY: a new anonymous shared mapping that aliases nothing; it is never unmapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    ensure!(
        p != libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: zeroed memory is a valid `Shared` (atomics only), it lives for the process and
    // its children, and is only used through atomics.
    Ok(unsafe { &*p.cast::<Shared>() })
}

impl Shared {
    /// Whether something of `epoch` may have lost its GPU: an unbind or unplug came since, or
    /// one is under way.
    fn stale(&self, epoch: u64) -> bool {
        epoch != self.epoch.load(SeqCst) || self.chaos.load(SeqCst)
    }

    fn count(&self, op: &str, outcome: usize) {
        self.counts[op_index(op)][outcome].fetch_add(1, SeqCst);
    }

    /// A failed check: counted, and printed while few.
    fn fail(&self, op: &str, what: std::fmt::Arguments<'_>) {
        if self.failures.fetch_add(1, SeqCst) < MAX_FAILURE_LINES {
            ktap::diag(format_args!(
                "FAILED {op} (pid {}, at {:.3} s, epoch {}): {what}",
                std::process::id(),
                uptime(),
                self.epoch.load(SeqCst)
            ));
        }
    }

    /// Counts a result; fails unless it is one of `allowed`.
    fn check(&self, op: &str, got: Result<(), Errno>, allowed: &[Errno], why: &str) {
        match got {
            Ok(()) => self.count(op, OK),
            Err(e) => {
                self.count(op, errno_outcome(e));
                if !allowed.contains(&e) {
                    self.fail(op, format_args!("{e} ({why}; allowed {allowed:?})"));
                }
            }
        }
    }
}

/// Seconds since boot, as the kernel log's timestamps count them.
fn uptime() -> f64 {
    rustix::time::clock_gettime(rustix::time::ClockId::Boottime).tv_sec as f64
        + rustix::time::clock_gettime(rustix::time::ClockId::Boottime).tv_nsec as f64 * 1e-9
}

/// splitmix64: each thread's own sequence, from the run's seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn pick<T: Copy>(&mut self, of: &[T]) -> T {
        of[self.below(of.len() as u64) as usize]
    }

    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

fn env_u64(name: &str, default: u64) -> anyhow::Result<u64> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.with_context(|| format!("{name}={v:?}: not a number"))
        }
    }
}

struct Config {
    seconds: u64,
    seed: u64,
    ops: u64,
    workers: usize,
    threads: usize,
    chaos: u64,
}

fn config() -> anyhow::Result<Config> {
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let workers = env_u64("FGDS_FUZZ_WORKERS", 2)? as usize;
    ensure!(
        (1..=MAX_WORKERS).contains(&workers),
        "FGDS_FUZZ_WORKERS must be 1..={MAX_WORKERS}"
    );
    Ok(Config {
        seconds: env_u64("FGDS_FUZZ_SECONDS", 60)?,
        seed: env_u64("FGDS_FUZZ_SEED", clock & 0xffff_ffff)?,
        ops: env_u64("FGDS_FUZZ_OPS", 0)?,
        workers,
        threads: env_u64("FGDS_FUZZ_THREADS", 3)?.clamp(1, 16) as usize,
        chaos: env_u64("FGDS_FUZZ_CHAOS", 20)?,
    })
}

/// GPU memory the fuzzer's buffers come from; the rest of the BAR is guarded.
const GUARD_LOW: u64 = 4 * MIB;
const WINDOW: u64 = 64 * MIB;
const GUARD_SEED: u64 = 0x0047_5541_5244;
/// What the window holds before any read: not the drive's bytes.
const WINDOW_SEED: u64 = 0x0057_494e_444f;

/// Where on the drive a read into GPU byte `bar` of the window comes from: the pattern at the
/// same distance from its start as `bar` from the window's, so that every read into a byte
/// brings the same value, whoever makes it.
fn source_of(bar: u64) -> u64 {
    bar.saturating_sub(GUARD_LOW)
}

/// Checks, through the host, that `len` bytes of GPU memory from `bar` hold the drive's bytes
/// a read from [`source_of`] brought: `op` completed a read there. The window's bytes only
/// ever become those (reads and CPU stores bring nothing else), so a mismatch is a read that
/// went elsewhere, brought other bytes, or did not happen.
fn verify_read(sh: &Shared, op: &str, bar: u64, len: usize) {
    if bar < GUARD_LOW || bar + len as u64 > GUARD_LOW + WINDOW {
        return sh.fail(
            op,
            format_args!("a read completed into BAR {bar:#x}+{len:#x}, outside the window"),
        );
    }
    match ctl::gpu_check_at(bar, len as u64, pattern::NVME_SEED, source_of(bar)) {
        Ok(()) => {
            sh.verified[op_index(op)].fetch_add(1, SeqCst);
        }
        Err(err) => sh.fail(
            op,
            format_args!(
                "a read of {len:#x} bytes into BAR {bar:#x} completed, yet the GPU does not \
                 hold the drive's bytes from {:#x}: {err:#}",
                source_of(bar)
            ),
        ),
    }
}
/// The drive: reads come from the pattern, writes go to this scratch range.
const WRITE_AREA: u64 = 128 * MIB;
const WRITE_AREA_LEN: u64 = 64 * MIB;
/// Each worker's address-space regions that mappings are moved into (2 MiB aligned).
const REGION: usize = 4 * MIB as usize;
const REGIONS: usize = 8;
const MAX_BUFFERS: usize = 6;
const MAX_REGS: usize = 12;
const SIZES: &[u64] = &[PAGE, 16 * PAGE, 64 * PAGE, MIB, 2 * MIB, 4 * MIB];

/// Guard buffers: vgpu memory below and above the window, filled with a pattern, never
/// registered with fgds, checked by the host.
struct Guards {
    ranges: Vec<(u64, u64)>,
    _dmabufs: Vec<OwnedFd>,
}

fn vgpu_fill(off: u64, len: u64, seed: u64) -> anyhow::Result<()> {
    let path = format!("/sys/class/vgpu/{}/fill", common::vgpu_name()?);
    std::fs::write(&path, format!("{off} {len} {seed}")).with_context(|| format!("write {path}"))
}

/// Allocates the guards around the window (vgpu allocates first fit): before any worker
/// allocates. The window is left free.
fn set_guards() -> anyhow::Result<Guards> {
    let vgpu = common::vgpu()?;
    let bar = common::sysfs_u64("bar_size")?;
    ensure!(
        bar > GUARD_LOW + WINDOW,
        "the GPU's BAR ({bar} bytes) is too small for the fuzzer's window"
    );
    let (low, low_off) = common::alloc(&vgpu, GUARD_LOW)?;
    let (window, window_off) = common::alloc(&vgpu, WINDOW)?;
    let high_len = bar - GUARD_LOW - WINDOW;
    let (high, high_off) = common::alloc(&vgpu, high_len)?;
    ensure!(
        low_off == 0 && window_off == GUARD_LOW && high_off == GUARD_LOW + WINDOW,
        "vgpu placed the guards at {low_off:#x} and {high_off:#x}, the window at \
         {window_off:#x}: it is not first fit on an empty BAR"
    );
    vgpu_fill(GUARD_LOW, WINDOW, WINDOW_SEED)?;
    drop(window);
    let ranges = vec![(0, GUARD_LOW), (high_off, high_len)];
    for &(off, len) in &ranges {
        vgpu_fill(off, len, GUARD_SEED)?;
    }
    Ok(Guards {
        ranges,
        _dmabufs: vec![low, high],
    })
}

fn check_guards(ranges: &[(u64, u64)], when: &str) -> anyhow::Result<()> {
    for &(off, len) in ranges {
        ctl::gpu_check(off, len, GUARD_SEED)
            .with_context(|| format!("GPU memory outside the fuzzer's buffers changed ({when})"))?;
    }
    Ok(())
}

fn fuzz() -> CaseResult {
    let cfg = config()?;
    ktap::diag(format_args!(
        "seed {:#x}: {} s{}, {} workers x {} threads, GPU unbind or unplug every ~{} s \
         (replay: cargo xtask fuzz --seed {:#x})",
        cfg.seed,
        cfg.seconds,
        if cfg.ops > 0 {
            format!(" or {} operations", cfg.ops)
        } else {
            String::new()
        },
        cfg.workers,
        cfg.threads,
        cfg.chaos,
        cfg.seed
    ));
    fault::require_idle()?;
    let sh = shared()?;
    let refused = refused_files()?;
    REFUSED
        .set(refused.files)
        .map_err(|_| anyhow::anyhow!("the refused files were set up twice"))?;
    let mut guards = Some(set_guards()?);
    let ranges = guards
        .as_ref()
        .map(|g| g.ranges.clone())
        .unwrap_or_default();
    let mut rng = Rng(cfg.seed ^ 0x6d61_696e);
    let mut generation = 0u64;
    let mut workers: Vec<Option<libc::pid_t>> = vec![None; cfg.workers];
    // The workers this process killed: their SIGKILL is no failure.
    let mut killed = HashSet::new();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(cfg.seconds);
    let mut next_chaos = next_event(&mut rng, cfg.chaos);
    let mut next_kill = next_event(&mut rng, cfg.chaos);
    let mut chaos_events = 0u64;
    let mut chaos_error = None;
    while Instant::now() < deadline && !sh.stop.load(SeqCst) {
        reap(sh, &mut workers, &killed)?;
        for (slot, pid) in workers.iter_mut().enumerate() {
            if pid.is_none() {
                generation += 1;
                *pid = Some(spawn_worker(sh, &cfg, slot, generation)?);
            }
        }
        let now = started.elapsed();
        if next_chaos.is_some_and(|t| now >= t) {
            // The first two events are one of each kind, so that a one-minute run has both.
            let unplug = match chaos_events {
                0 => false,
                1 => true,
                _ => rng.chance(400),
            };
            chaos_events += 1;
            if let Err(err) = chaos(sh, unplug, &mut guards, &ranges, &mut workers, &killed) {
                chaos_error = Some(err);
                break;
            }
            next_chaos = next_event(&mut rng, cfg.chaos).map(|d| d + started.elapsed());
        }
        if next_kill.is_some_and(|t| now >= t) {
            let slot = rng.below(workers.len() as u64) as usize;
            if let Some(p) = workers[slot] {
                // SAFETY: kill(2) of our own child.
                unsafe { libc::kill(p, libc::SIGKILL) };
                killed.insert(p);
                sh.count("kill_worker", OK);
            }
            next_kill = next_event(&mut rng, cfg.chaos).map(|d| d + started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    sh.stop.store(true, SeqCst);
    sh.paused.store(false, SeqCst);
    let mut hung = Vec::new();
    for (slot, pid) in workers.iter().enumerate() {
        let Some(p) = *pid else { continue };
        match wait_deadline(p, Duration::from_secs(60))? {
            Some(status) => judge_exit(sh, status, killed.contains(&p)),
            None => {
                hung.push(format!(
                    "worker {slot} (pid {p}) still runs 60 s after the stop: {}",
                    stacks(p)
                ));
                // SAFETY: kill(2) of our own child.
                unsafe { libc::kill(p, libc::SIGKILL) };
                let _ = common::wait(p);
            }
        }
    }
    let elapsed = started.elapsed();
    let summary = summary(sh, &cfg, elapsed);
    println!("fgds-fuzz: {summary}");
    print_table(sh, elapsed);
    chaos_error.map_or(Ok(()), Err)?;
    ensure!(hung.is_empty(), "{}", hung.join("\n"));
    let failures = sh.failures.load(SeqCst);
    ensure!(failures == 0, "{failures} failed outcome checks (above)");
    let missing = too_rare(sh, &cfg, elapsed);
    ensure!(
        missing.is_empty(),
        "the run did not exercise everything it checks: {}",
        missing.join("; ")
    );
    fault::wait_counters_zero("after the fuzzer stopped")?;
    check_guards(&ranges, "at the end")?;
    drop(guards);
    fault::wait_vgpu_buffers_gone("after the fuzzer stopped: fgds let every buffer go")?;
    ktap::pass()
}

/// Waits for the workers that ended, judges their ends, and clears their slots and counts.
fn reap(
    sh: &Shared,
    workers: &mut [Option<libc::pid_t>],
    killed: &HashSet<libc::pid_t>,
) -> anyhow::Result<()> {
    for (slot, pid) in workers.iter_mut().enumerate() {
        if let Some(p) = *pid
            && let Some(status) = try_wait(p)?
        {
            *pid = None;
            sh.active[slot].store(0, SeqCst);
            sh.revoking[slot].store(0, SeqCst);
            judge_exit(sh, status, killed.contains(&p));
        }
    }
    Ok(())
}

/// When the next event of a kind comes: on average every `every` seconds, none for 0.
fn next_event(rng: &mut Rng, every: u64) -> Option<Duration> {
    (every > 0).then(|| Duration::from_millis(every * 500 + rng.below(every * 1000)))
}

const EXIT_RESPAWN: i32 = 77;

/// A worker's end: a deliberate exit, the fuzzer's own SIGKILL, or the end of the run are fine;
/// anything else (a panic, another signal) is a failure.
fn judge_exit(sh: &Shared, status: i32, killed: bool) {
    match status {
        0 => {}
        EXIT_RESPAWN => {}
        s if s == 128 + libc::SIGKILL && killed => {}
        s => sh.fail(
            "exit",
            format_args!("a worker ended with status {s} (128 + signal, or its exit code)"),
        ),
    }
}

fn try_wait(pid: libc::pid_t) -> anyhow::Result<Option<i32>> {
    let mut status = 0;
    // SAFETY: waitpid on our own child.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    ensure!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
    if r == 0 {
        return Ok(None);
    }
    Ok(Some(if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    }))
}

fn wait_deadline(pid: libc::pid_t, timeout: Duration) -> anyhow::Result<Option<i32>> {
    let end = Instant::now() + timeout;
    while Instant::now() < end {
        if let Some(s) = try_wait(pid)? {
            return Ok(Some(s));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(None)
}

/// The kernel stacks of a process's threads: where a hung operation waits.
fn stacks(pid: libc::pid_t) -> String {
    let mut out = String::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            let stack = std::fs::read_to_string(t.path().join("stack")).unwrap_or_default();
            out += &format!("\n  task {}:\n{stack}", t.file_name().to_string_lossy());
        }
    }
    out
}

/// Unbinds the GPU's driver and binds it again, or hot-unplugs and replugs the GPU, while the
/// workers go on; then pauses them to put the guards back (a new vgpu instance knows nothing
/// of the old guards) and checks the guarded memory.
fn chaos(
    sh: &Shared,
    unplug: bool,
    guards: &mut Option<Guards>,
    ranges: &[(u64, u64)],
    workers: &mut [Option<libc::pid_t>],
    killed: &HashSet<libc::pid_t>,
) -> anyhow::Result<()> {
    let op = if unplug {
        "unplug_replug"
    } else {
        "unbind_rebind"
    };
    let bdf = common::vgpu_bdf()?;
    let node = common::node_path()?;
    let drv = std::fs::canonicalize(format!("/sys/bus/pci/devices/{bdf}/driver"))
        .context("the GPU's driver link")?;
    sh.chaos.store(true, SeqCst);
    sh.epoch.fetch_add(1, SeqCst);
    fault::wait_until(
        "vgpu revocations under way to end",
        Duration::from_secs(60),
        || {
            reap(sh, workers, killed)?;
            Ok(sh.revoking.iter().all(|a| a.load(SeqCst) == 0))
        },
    )
    .with_context(|| format!("{op}: a revocation did not end"))?;
    let mark = fgds_tests::guest::kernel_log_mark()?;
    ktap::diag(format_args!(
        "{op} at {:.3} s, epoch {}",
        uptime(),
        sh.epoch.load(SeqCst)
    ));
    let gone = if unplug {
        ctl::device_del(ctl::GPU_ID)
    } else {
        std::fs::write(drv.join("unbind"), &bdf).context("unbind vgpu")
    };
    // An unbind returns once done (fgds keeps the node of a GPU without a driver); an unplug
    // ends with the node gone.
    let gone = gone.and_then(|()| {
        fault::wait_until(
            "the GPU's fgds node to go",
            Duration::from_secs(120),
            || Ok(!unplug || !node.exists()),
        )
        .map(drop)
    });
    // The workers stop at their next operation; what runs must end.
    sh.paused.store(true, SeqCst);
    let quiet = fault::wait_until(
        "every fuzz operation to end after the pause",
        Duration::from_secs(60),
        || {
            // A worker that ended meanwhile left its count behind.
            reap(sh, workers, killed)?;
            Ok(sh.active.iter().all(|a| a.load(SeqCst) == 0))
        },
    );
    *guards = None;
    let back = if unplug {
        ctl::gpu_add()
    } else {
        std::fs::write(drv.join("bind"), &bdf).context("bind vgpu")
    };
    let back = back.and_then(|()| {
        fault::wait_until(
            "vgpu and the fgds node to come back",
            Duration::from_secs(60),
            || Ok(common::node_path().is_ok() && common::vgpu_name().is_ok()),
        )
        .map(drop)
    });
    // Nodes opened and buffers allocated while the GPU went may be of the old one too.
    sh.epoch.fetch_add(1, SeqCst);
    let result = gone
        .and(quiet)
        .and(back)
        .and_then(|()| check_guards(ranges, op))
        .and_then(|()| {
            *guards = Some(set_guards()?);
            Ok(())
        });
    sh.chaos.store(false, SeqCst);
    sh.paused.store(false, SeqCst);
    match result {
        Ok(()) => {
            sh.count(op, OK);
            Ok(())
        }
        Err(err) => {
            let log = fgds_tests::guest::kernel_log_since(mark).unwrap_or_default();
            let tail = log[log.len().saturating_sub(30)..].join("\n");
            bail!("{op}: {err:#}\nthe kernel logged:\n{tail}")
        }
    }
}

// ---- workers ----------------------------------------------------------------------------

/// A node open in a worker, and the epoch it was opened in.
struct Node {
    file: File,
    epoch: u64,
}

/// A vgpu buffer of a worker.
struct Buffer {
    dmabuf: Mutex<Option<OwnedFd>>,
    bar_off: u64,
    len: u64,
    revoked: AtomicBool,
    epoch: u64,
}

impl Buffer {
    /// Whether the buffer may have been revoked: by the worker, or by an unbind or unplug.
    fn may_be_revoked(&self, sh: &Shared) -> bool {
        self.revoked.load(SeqCst) || sh.stale(self.epoch)
    }
}

/// A registration: part of a buffer, on a node.
struct Reg {
    buf: Arc<Buffer>,
    node: Arc<Node>,
    idx: u64,
    /// Where in the buffer it starts.
    off: u64,
    len: u64,
    /// Whether UNREG was called. Held shared across an mmap of the token, exclusively across
    /// UNREG: a token UNREG gave back may name another registration next (of this worker:
    /// it would be mapped as the wrong buffer).
    gone: RwLock<bool>,
}

/// What one of a worker's address-space regions holds: a mapping of a registration, moved
/// there, and the page ranges unmapped since.
struct Mapped {
    buf: Arc<Buffer>,
    /// The GPU's BAR offset of the mapping's first byte.
    bar: u64,
    node_epoch: u64,
    len: usize,
    holes: Vec<(usize, usize)>,
    /// MADV_DONTFORK was asked for on part of it: a child may not have it.
    dontfork: AtomicBool,
    /// Advice on part of it may have split it into several VMAs, which mremap cannot move.
    split: AtomicBool,
}

impl Mapped {
    fn hole_in(&self, from: usize, to: usize) -> bool {
        self.holes.iter().any(|&(a, b)| a < to && from < b)
    }
}

/// A region: reserved with an inaccessible anonymous mapping whenever nothing is mapped there,
/// so that I/O racing a munmap faults instead of reaching whatever the kernel would put there
/// next. I/O and touches hold it shared; mapping and unmapping hold it exclusively.
struct Region {
    addr: usize,
    state: RwLock<Option<Mapped>>,
}

struct Worker {
    sh: &'static Shared,
    slot: usize,
    node: Mutex<Option<Arc<Node>>>,
    vgpu: Mutex<Option<Arc<File>>>,
    buffers: Mutex<Vec<Arc<Buffer>>>,
    regs: Mutex<Vec<Arc<Reg>>>,
    regions: Vec<Region>,
    nvme_read: File,
    nvme_write: File,
    /// What IORING_REGISTER_BUFFERS fails with on a mapping here.
    fixed_buffer_errno: Errno,
}

fn spawn_worker(
    sh: &'static Shared,
    cfg: &Config,
    slot: usize,
    generation: u64,
) -> anyhow::Result<libc::pid_t> {
    let fixed_buffer_errno = fixed_buffer_errno()?;
    // SAFETY: this process has no other thread when it forks (the fuzzer's main loop runs in
    // the main thread; helpers of earlier steps have ended).
    let pid = unsafe { libc::fork() };
    ensure!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid > 0 {
        return Ok(pid);
    }
    let code = match run_worker(sh, cfg, slot, generation, fixed_buffer_errno) {
        Ok(code) => code,
        Err(err) => {
            sh.fail("exit", format_args!("worker {slot} could not run: {err:#}"));
            1
        }
    };
    // SAFETY: leave without running the parent's exit handlers or unwinding its state.
    unsafe { libc::_exit(code) }
}

/// As fgds_data's io_uring_registered_buffers_refused finds it.
fn fixed_buffer_errno() -> anyhow::Result<Errno> {
    let mode = fgds_tests::guest::expected_mode()?;
    Ok(match mode.as_str() {
        _ if common::kernel_release()?.starts_with("6.1.") => Errno::OPNOTSUPP,
        "generic" => Errno::FAULT,
        _ => Errno::REMOTEIO,
    })
}

fn run_worker(
    sh: &'static Shared,
    cfg: &Config,
    slot: usize,
    generation: u64,
    fixed_buffer_errno: Errno,
) -> anyhow::Result<i32> {
    install_fault_handler()?;
    let base = reserve(REGION * (REGIONS + 1))?;
    let aligned = (base + 2 * MIB as usize - 1) & !(2 * MIB as usize - 1);
    let worker = Arc::new(Worker {
        sh,
        slot,
        node: Mutex::new(None),
        vgpu: Mutex::new(None),
        buffers: Mutex::new(Vec::new()),
        regs: Mutex::new(Vec::new()),
        regions: (0..REGIONS)
            .map(|i| Region {
                addr: aligned + i * REGION,
                state: RwLock::new(None),
            })
            .collect(),
        nvme_read: common::nvme(false)?,
        nvme_write: common::nvme(true)?,
        fixed_buffer_errno,
    });
    let threads: Vec<_> = (0..cfg.threads)
        .map(|t| {
            let w = worker.clone();
            let seed = cfg.seed ^ (slot as u64) << 40 ^ generation << 20 ^ t as u64;
            let max_ops = cfg.ops;
            std::thread::spawn(move || worker_thread(&w, Rng(seed), max_ops))
        })
        .collect();
    for t in threads {
        if t.join().is_err() {
            sh.fail(
                "exit",
                format_args!("a worker thread panicked (its message is above)"),
            );
        }
    }
    Ok(0)
}

/// Reserves `len` bytes of address space, inaccessible.
fn reserve(len: usize) -> anyhow::Result<usize> {
    // SAFETY: a new anonymous mapping at an address the kernel picks.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    ensure!(
        p != libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    Ok(p as usize)
}

/// Puts the inaccessible reservation back over `[addr, addr + len)`: unmaps what was there.
fn unreserve_range(addr: usize, len: usize) -> Result<(), Errno> {
    // SAFETY: the range lies in a region of ours, held exclusively; nothing Rust owns is there.
    let p = unsafe {
        libc::mmap(
            addr as *mut libc::c_void,
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(Errno::from_raw_os_error(last_errno()));
    }
    Ok(())
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn worker_thread(w: &Worker, mut rng: Rng, max_ops: u64) {
    let sh = w.sh;
    while !sh.stop.load(SeqCst) {
        if sh.paused.load(SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        sh.active[w.slot].fetch_add(1, SeqCst);
        if sh.paused.load(SeqCst) {
            sh.active[w.slot].fetch_sub(1, SeqCst);
            continue;
        }
        one_op(w, &mut rng);
        sh.active[w.slot].fetch_sub(1, SeqCst);
        if sh.ops.fetch_add(1, SeqCst) + 1 >= max_ops && max_ops > 0 {
            sh.stop.store(true, SeqCst);
        }
    }
}

type Op = fn(&Worker, &mut Rng);

/// The operations (by their names in [`OPS`]) and their weights: cheap system calls most, I/O
/// next, forks and exits rarely (a fork costs as much as hundreds of the others under TCG).
const WEIGHTS: &[(&str, Op, u64)] = &[
    ("alloc", op_alloc, 40),
    ("free_buffer", op_free_buffer, 15),
    ("reg", |w, r| op_reg(w, r, false), 70),
    ("reg_again", |w, r| op_reg(w, r, true), 25),
    ("reg_invalid", op_reg_invalid, 60),
    ("unreg", op_unreg, 55),
    ("unreg_invalid", op_unreg_invalid, 40),
    ("mmap", op_mmap, 80),
    ("mmap_invalid", op_mmap_invalid, 40),
    ("munmap", |w, r| op_munmap(w, r, false), 35),
    ("munmap_partial", |w, r| op_munmap(w, r, true), 20),
    ("touch", op_touch, 130),
    ("fork_exit", |w, r| op_in_child(w, r, false), 2),
    ("mremap_in_child", |w, r| op_in_child(w, r, true), 1),
    ("madvise", op_madvise, 60),
    ("pread", |w, r| op_io(w, r, false), 90),
    ("pwrite", |w, r| op_io(w, r, true), 25),
    ("fgds_io", |w, r| op_fgds_io(w, r, false), 35),
    ("fgds_io_cmd", |w, r| op_fgds_io(w, r, true), 35),
    ("fgds_io_refused", op_fgds_io_refused, 20),
    ("uring_read", op_uring, 60),
    ("uring_fixed_buffer", op_fixed_buffer, 8),
    ("close_dmabuf", op_close_dmabuf, 20),
    ("close_node", |w, _| op_close_node(w), 6),
    ("revoke", op_revoke, 30),
    // One draw in ~1150, about ten times a minute per worker at the debug kernel's rate: the
    // run's verdict wants every operation, and at a fifth of that a minute's run exited 4 or 5
    // times, and once not at all (CI, seed 0x22: "exit never ran").
    ("exit", |w, _| op_exit(w), 1),
];

/// Draws an operation and runs it; its time goes to its account.
fn one_op(w: &Worker, rng: &mut Rng) {
    let total: u64 = WEIGHTS.iter().map(|(_, _, n)| n).sum();
    let mut draw = rng.below(total);
    for (name, op, n) in WEIGHTS {
        if draw < *n {
            let start = Instant::now();
            op(w, rng);
            w.sh.busy_us[op_index(name)].fetch_add(start.elapsed().as_micros() as u64, SeqCst);
            return;
        }
        draw -= n;
    }
}

fn pick<T>(list: &Mutex<Vec<Arc<T>>>, rng: &mut Rng) -> Option<Arc<T>> {
    let list = list.lock().unwrap();
    (!list.is_empty()).then(|| list[rng.below(list.len() as u64) as usize].clone())
}

/// The worker's node, opened when there is none (None while the GPU is away).
fn node(w: &Worker) -> Option<Arc<Node>> {
    let mut slot = w.node.lock().unwrap();
    if slot.is_none() {
        let epoch = w.sh.epoch.load(SeqCst);
        *slot = common::open_node()
            .ok()
            .map(|file| Arc::new(Node { file, epoch }));
    }
    slot.clone()
}

fn vgpu(w: &Worker) -> Option<Arc<File>> {
    let mut slot = w.vgpu.lock().unwrap();
    if slot.is_none() {
        *slot = common::vgpu().ok().map(Arc::new);
    }
    slot.clone()
}

fn op_alloc(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    if w.buffers.lock().unwrap().len() >= MAX_BUFFERS {
        return op_free_buffer(w, rng);
    }
    let Some(dev) = vgpu(w) else { return };
    let epoch = sh.epoch.load(SeqCst);
    let len = rng.pick(SIZES);
    match fgds::vgpu::alloc(&dev, len) {
        Ok((dmabuf, bar_off)) => {
            sh.count("alloc", OK);
            if bar_off < GUARD_LOW || bar_off + len > GUARD_LOW + WINDOW {
                sh.fail(
                    "alloc",
                    format_args!("vgpu gave {len} bytes at {bar_off:#x}, outside the window"),
                );
            }
            w.buffers.lock().unwrap().push(Arc::new(Buffer {
                dmabuf: Mutex::new(Some(dmabuf)),
                bar_off,
                len,
                revoked: AtomicBool::new(false),
                epoch,
            }));
        }
        Err(err) => {
            let e = io_errno(&err);
            sh.count("alloc", errno_outcome(e));
            // ENOMEM: the window is full. ENODEV/ENXIO: vgpu is going away.
            if e == Errno::NODEV || e == Errno::NXIO || sh.stale(epoch) {
                *w.vgpu.lock().unwrap() = None;
            } else if e != Errno::NOMEM {
                sh.fail("alloc", format_args!("{err}"));
            }
        }
    }
}

fn io_errno(err: &fgds::Error) -> Errno {
    match err {
        fgds::Error::Io { source, .. } => Errno::from_io_error(source).unwrap_or(Errno::IO),
        _ => Errno::IO,
    }
}

fn op_free_buffer(w: &Worker, rng: &mut Rng) {
    let mut list = w.buffers.lock().unwrap();
    if !list.is_empty() {
        let i = rng.below(list.len() as u64) as usize;
        list.swap_remove(i);
        w.sh.count("free_buffer", OK);
    }
}

/// REG of a buffer (or, `again`, of one already registered) on the worker's node.
fn op_reg(w: &Worker, rng: &mut Rng, again: bool) {
    let sh = w.sh;
    let op = if again { "reg_again" } else { "reg" };
    if w.regs.lock().unwrap().len() >= MAX_REGS {
        return op_unreg(w, rng);
    }
    let buf = if again {
        pick(&w.regs, rng).map(|r| r.buf.clone())
    } else {
        pick(&w.buffers, rng)
    };
    let (Some(buf), Some(node)) = (buf, node(w)) else {
        return;
    };
    let pages = buf.len / PAGE;
    let (off, len) = if rng.chance(700) {
        (0, buf.len)
    } else {
        let first = rng.below(pages);
        (first * PAGE, (1 + rng.below(pages - first)) * PAGE)
    };
    let dmabuf = buf.dmabuf.lock().unwrap();
    let Some(fd) = dmabuf.as_ref() else { return };
    match common::reg(&node.file, fd.as_fd(), off, len) {
        Ok(idx) => {
            drop(dmabuf);
            sh.count(op, OK);
            w.regs.lock().unwrap().push(Arc::new(Reg {
                buf,
                node,
                idx,
                off,
                len,
                gone: RwLock::new(false),
            }));
        }
        Err(e) => {
            drop(dmabuf);
            let gpu_gone = sh.stale(node.epoch);
            // EINTR: a signal (or io_uring's task work) came while it waited for the lock.
            let allowed: &[Errno] = if buf.may_be_revoked(sh) || gpu_gone {
                &[Errno::NODEV, Errno::INTR]
            } else {
                &[Errno::INTR]
            };
            sh.check(
                op,
                Err(e),
                allowed,
                &format!(
                    "a valid registration of {:#x}+{:#x}, allocated in epoch {}, node of epoch {}",
                    buf.bar_off, buf.len, buf.epoch, node.epoch
                ),
            );
            if gpu_gone {
                *w.node.lock().unwrap() = None;
            }
        }
    }
}

fn op_reg_invalid(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let Some(node) = node(w) else { return };
    let buf = pick(&w.buffers, rng);
    let dmabuf = buf.as_ref().map(|b| b.dmabuf.lock().unwrap());
    let fd = dmabuf
        .as_ref()
        .and_then(|d| d.as_ref().map(|f| f.as_raw_fd()));
    let len = buf.as_ref().map_or(PAGE, |b| b.len);
    let mut arg = fgds::uapi::RegBuffer {
        dmabuf_fd: fd.unwrap_or(-1),
        flags: 0,
        dmabuf_offset: 0,
        size: len,
        idx: 0,
    };
    let kind = if fd.is_none() { 0 } else { rng.below(10) };
    let want = match kind {
        0 => {
            arg.dmabuf_fd = -1;
            Errno::INVAL
        }
        1 => {
            arg.flags = 1 << rng.below(32);
            Errno::INVAL
        }
        2 => {
            arg.dmabuf_offset = 1 + rng.below(PAGE - 1);
            Errno::INVAL
        }
        3 => {
            arg.size = 0;
            Errno::INVAL
        }
        4 => {
            arg.size = len - 1 - rng.below(PAGE - 1);
            Errno::INVAL
        }
        5 => {
            arg.dmabuf_offset = len;
            arg.size = PAGE;
            Errno::INVAL
        }
        6 => {
            arg.dmabuf_offset = !(PAGE - 1);
            arg.size = 2 * PAGE;
            Errno::OVERFLOW
        }
        7 => {
            arg.dmabuf_fd = 1 << 20;
            Errno::BADF
        }
        8 => {
            arg.dmabuf_fd = w.nvme_read.as_raw_fd();
            Errno::INVAL
        }
        _ => {
            arg.size = (8u64 << 40) + PAGE;
            Errno::INVAL
        }
    };
    let got = common::reg_raw(node.file.as_fd(), &mut arg);
    drop(dmabuf);
    if got.is_ok() {
        sh.count("reg_invalid", OK);
        sh.fail(
            "reg_invalid",
            format_args!("invalid argument (case {kind}) registered: {arg:?}"),
        );
        let _ = common::unreg(&node.file, arg.idx);
        return;
    }
    let mut allowed = vec![want, Errno::INTR];
    if sh.stale(node.epoch) {
        allowed.push(Errno::NODEV);
    }
    sh.check(
        "reg_invalid",
        got,
        &allowed,
        &format!("invalid argument, case {kind}"),
    );
}

fn op_unreg(w: &Worker, rng: &mut Rng) {
    let reg = {
        let mut regs = w.regs.lock().unwrap();
        if regs.is_empty() {
            return;
        }
        let i = rng.below(regs.len() as u64) as usize;
        regs.swap_remove(i)
    };
    let mut gone = reg.gone.write().unwrap();
    *gone = true;
    w.sh.check(
        "unreg",
        common::unreg(&reg.node.file, reg.idx),
        &[],
        "UNREG of a live token",
    );
}

fn op_unreg_invalid(w: &Worker, rng: &mut Rng) {
    let Some(node) = node(w) else { return };
    let (idx, want) = if rng.chance(500) {
        (
            ((rng.next() >> 20) & !(PAGE - 1)) | (1 + rng.below(PAGE - 1)),
            Errno::INVAL,
        )
    } else {
        // Tokens are small multiples of PAGE_SIZE; this one never is one.
        ((1 << 46) + rng.below(1 << 20) * PAGE, Errno::NOENT)
    };
    w.sh.check(
        "unreg_invalid",
        common::unreg(&node.file, idx),
        &[want],
        "UNREG of a token that was never handed out",
    );
}

/// mmap of a registration, moved into a free region.
fn op_mmap(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let Some(reg) = pick(&w.regs, rng) else {
        return;
    };
    let Some(region) = w
        .regions
        .iter()
        .find(|r| r.state.try_read().is_ok_and(|s| s.is_none()))
    else {
        return op_munmap(w, rng, false);
    };
    let Ok(mut state) = region.state.try_write() else {
        return;
    };
    if state.is_some() {
        return;
    }
    let len = reg.len as usize;
    let gone = reg.gone.read().unwrap();
    if *gone {
        return;
    }
    let map = common::Map::new(&reg.node.file, reg.idx, len, libc::MAP_SHARED);
    drop(gone);
    let map = match map {
        Ok(m) => m,
        Err(e) => {
            let mut allowed = Vec::new();
            if reg.buf.may_be_revoked(sh) || sh.stale(reg.node.epoch) {
                allowed.push(Errno::NODEV);
            }
            return sh.check("mmap", Err(e), &allowed, "mmap of a registered token");
        }
    };
    // SAFETY: moves our new mapping over the region's reservation, which we hold exclusively.
    let p = unsafe {
        libc::mremap(
            map.ptr.cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            region.addr as *mut libc::c_void,
        )
    };
    if p == libc::MAP_FAILED {
        let e = Errno::from_raw_os_error(last_errno());
        return sh.check("mmap", Err(e), &[], "mremap of a new mapping into a region");
    }
    std::mem::forget(map);
    sh.count("mmap", OK);
    *state = Some(Mapped {
        buf: reg.buf.clone(),
        bar: reg.buf.bar_off + reg.off,
        node_epoch: reg.node.epoch,
        len,
        holes: Vec::new(),
        dontfork: AtomicBool::new(false),
        split: AtomicBool::new(false),
    });
}

fn op_mmap_invalid(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let Some(node) = node(w) else { return };
    let reg = pick(&w.regs, rng);
    let (idx, len, flags, want, what) = match (rng.below(3), &reg) {
        (0, Some(r)) => (r.idx, r.len, libc::MAP_PRIVATE, Errno::INVAL, "MAP_PRIVATE"),
        (1, Some(r)) => (
            r.idx,
            r.len + PAGE,
            libc::MAP_SHARED,
            Errno::INVAL,
            "a length other than the registered one",
        ),
        _ => (
            (1 << 46) + rng.below(1 << 20) * PAGE,
            PAGE,
            libc::MAP_SHARED,
            Errno::NOENT,
            "an unknown token",
        ),
    };
    let file = reg.as_ref().map_or(&node.file, |r| &r.node.file);
    let gone = reg.as_ref().map(|r| r.gone.read().unwrap());
    if gone.as_ref().is_some_and(|g| **g) {
        return;
    }
    let map = common::Map::new(file, idx, len as usize, flags);
    drop(gone);
    match map {
        Ok(map) => {
            sh.count("mmap_invalid", OK);
            sh.fail("mmap_invalid", format_args!("mmap with {what} worked"));
            drop(map);
        }
        Err(e) => {
            let mut allowed = vec![want];
            if reg
                .as_ref()
                .is_some_and(|r| r.buf.may_be_revoked(sh) || sh.stale(r.node.epoch))
                || sh.stale(node.epoch)
            {
                allowed.push(Errno::NODEV);
            }
            sh.check("mmap_invalid", Err(e), &allowed, what);
        }
    }
}

fn op_munmap(w: &Worker, rng: &mut Rng, partial: bool) {
    let op = if partial { "munmap_partial" } else { "munmap" };
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let Ok(mut state) = region.state.try_write() else {
        return;
    };
    let Some(mapped) = state.as_mut() else { return };
    let pages = mapped.len / PAGE as usize;
    if partial && pages > 1 {
        let first = rng.below(pages as u64) as usize;
        let n = 1 + rng.below((pages - first) as u64) as usize;
        let (from, to) = (first * PAGE as usize, (first + n) * PAGE as usize);
        w.sh.check(
            op,
            unreserve_range(region.addr + from, to - from),
            &[],
            "munmap of part of a mapping",
        );
        mapped.holes.push((from, to));
    } else {
        let len = mapped.len;
        w.sh.check(
            op,
            unreserve_range(region.addr, len),
            &[],
            "munmap of a mapping",
        );
        *state = None;
    }
}

/// A random page-aligned range of a region: (offset, length), up to `max`.
fn range_in(mapped: &Mapped, rng: &mut Rng, max: usize) -> (usize, usize) {
    let pages = mapped.len / PAGE as usize;
    let first = rng.below(pages as u64) as usize;
    let n = 1 + rng.below((pages - first).min(max / PAGE as usize) as u64) as usize;
    (first * PAGE as usize, n * PAGE as usize)
}

// CPU accesses that may fault: one instruction each, which the SIGBUS/SIGSEGV handler steps
// over, returning the signal in rax (0: no fault). Cheaper than a child per access.
std::arch::global_asm!(
    ".globl fgds_fuzz_load",
    "fgds_fuzz_load:",
    "xor eax, eax",
    ".globl fgds_fuzz_load_insn",
    "fgds_fuzz_load_insn:",
    "mov rdx, qword ptr [rdi]",
    ".globl fgds_fuzz_load_end",
    "fgds_fuzz_load_end:",
    "ret",
    ".globl fgds_fuzz_store",
    "fgds_fuzz_store:",
    "xor eax, eax",
    ".globl fgds_fuzz_store_insn",
    "fgds_fuzz_store_insn:",
    "mov qword ptr [rdi], rsi",
    ".globl fgds_fuzz_store_end",
    "fgds_fuzz_store_end:",
    "ret",
);

unsafe extern "C" {
    fn fgds_fuzz_load(p: *const u64) -> u64;
    fn fgds_fuzz_store(p: *mut u64, v: u64) -> u64;
    static fgds_fuzz_load_insn: u8;
    static fgds_fuzz_load_end: u8;
    static fgds_fuzz_store_insn: u8;
    static fgds_fuzz_store_end: u8;
}

/// SIGBUS and SIGSEGV: at one of the probe instructions, step over it with the signal in
/// rax; anywhere else the default action (the worker dies, a failure).
extern "C" fn on_fault(sig: i32, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes the interrupted context; the labels are the probes' own.
    unsafe {
        let uc = &mut *ctx.cast::<libc::ucontext_t>();
        let rip = uc.uc_mcontext.gregs[libc::REG_RIP as usize] as usize;
        let resume = if rip == &raw const fgds_fuzz_load_insn as usize {
            &raw const fgds_fuzz_load_end as usize
        } else if rip == &raw const fgds_fuzz_store_insn as usize {
            &raw const fgds_fuzz_store_end as usize
        } else {
            libc::signal(sig, libc::SIG_DFL);
            return;
        };
        uc.uc_mcontext.gregs[libc::REG_RIP as usize] = resume as i64;
        uc.uc_mcontext.gregs[libc::REG_RAX as usize] = sig as i64;
    }
}

fn install_fault_handler() -> anyhow::Result<()> {
    for sig in [libc::SIGBUS, libc::SIGSEGV] {
        // SAFETY: a plain sigaction with an async-signal-safe handler.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_fault as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        ensure!(r == 0, "sigaction: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// A CPU load or store: SIGBUS only on a revoked buffer, SIGSEGV only in a hole.
fn op_touch(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let state = region.state.read().unwrap();
    let Some(mapped) = state.as_ref() else { return };
    let at = rng.below(mapped.len as u64) as usize & !7;
    let ptr = (region.addr + at) as *mut u64;
    // A store writes what a read of that byte brings (`source_of`).
    let mut value = [0u8; 8];
    pattern::fill(
        pattern::NVME_SEED,
        source_of(mapped.bar + at as u64),
        &mut value,
    );
    // SAFETY: an access to our own region (a mapping, a hole or the reservation); a fault is
    // stepped over by on_fault and reported here.
    let sig = unsafe {
        if rng.chance(500) {
            fgds_fuzz_store(ptr, u64::from_ne_bytes(value))
        } else {
            fgds_fuzz_load(ptr)
        }
    };
    let status = if sig == 0 { 0 } else { 128 + sig as i32 };
    judge_access(sh, "touch", status, mapped, at, at + 8);
}

fn judge_access(sh: &Shared, op: &str, status: i32, mapped: &Mapped, from: usize, to: usize) {
    match status {
        0 => sh.count(op, OK),
        s if s == 128 + libc::SIGBUS => {
            sh.count(op, SIGBUS);
            if !mapped.buf.may_be_revoked(sh) && !sh.stale(mapped.node_epoch) {
                sh.fail(
                    op,
                    format_args!(
                        "SIGBUS at {from:#x} of a mapping of a buffer that was not revoked"
                    ),
                );
            }
        }
        s if s == 128 + libc::SIGSEGV => {
            sh.count(op, SIGSEGV);
            if !mapped.hole_in(from, to) && !mapped.dontfork.load(SeqCst) {
                sh.fail(
                    op,
                    format_args!("SIGSEGV at {from:#x}, where the mapping has no hole"),
                );
            }
        }
        s => {
            sh.count(op, errno_outcome(Errno::IO));
            sh.fail(op, format_args!("the child ended with status {s}"));
        }
    }
}

/// Forks, runs `f` in the child (which must only make system calls: the parent has other
/// threads), returns the child's wait status.
fn fork_wait(f: impl FnOnce() -> i32) -> i32 {
    // SAFETY: the child only runs `f` (system calls and volatile accesses, no allocation or
    // lock) and then _exit()s.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let code = f();
        // SAFETY: leave the child at once.
        unsafe { libc::_exit(code) };
    }
    if pid < 0 {
        return -1;
    }
    common::wait(pid).unwrap_or(-1)
}

/// Fork and exit with the mappings (the child reads into one first), or (`mremap`) a child
/// that moves a mapping, reads into it at its new place, touches it and exits.
fn op_in_child(w: &Worker, rng: &mut Rng, mremap: bool) {
    let sh = w.sh;
    let op = if mremap {
        "mremap_in_child"
    } else {
        "fork_exit"
    };
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let state = region.state.read().unwrap();
    let Some(mapped) = state.as_ref() else { return };
    // A range of several VMAs (holes, or parts the child did not inherit) cannot be moved.
    let mremap = mremap
        && mapped.holes.is_empty()
        && !mapped.dontfork.load(SeqCst)
        && !mapped.split.load(SeqCst);
    let (from, len) = range_in(mapped, rng, 256 * 1024);
    // The child's read lands in the same GPU memory: from where every read of it comes.
    let drive_off = source_of(mapped.bar + from as u64);
    let fd = w.nvme_read.as_raw_fd();
    let addr = region.addr;
    let mlen = mapped.len;
    let status = fork_wait(|| {
        let mut at = addr;
        if mremap {
            // SAFETY: the child's own copy of the mapping, moved anywhere the kernel likes.
            let p = unsafe {
                libc::mremap(addr as *mut libc::c_void, mlen, mlen, libc::MREMAP_MAYMOVE)
            };
            if p == libc::MAP_FAILED {
                return 10 + last_errno().min(80);
            }
            at = p as usize;
        }
        // SAFETY: an O_DIRECT read into the child's mapping (it may fault: EFAULT).
        let n = unsafe {
            libc::pread(
                fd,
                (at + from) as *mut libc::c_void,
                len,
                drive_off as libc::off_t,
            )
        };
        if n < 0 {
            return 100 + last_errno();
        }
        if mremap {
            // SAFETY: a load from the moved mapping (SIGBUS if revoked meanwhile).
            let _ = unsafe { ((at + from) as *const u8).read_volatile() };
        }
        if (n as usize) < len { 1 } else { 0 }
    });
    let fault_ok = mapped.buf.may_be_revoked(sh)
        || sh.stale(mapped.node_epoch)
        || mapped.hole_in(from, from + len)
        || mapped.dontfork.load(SeqCst);
    match status {
        1 if fault_ok => sh.count(op, SHORT),
        1 => {
            sh.count(op, SHORT);
            sh.fail(
                op,
                format_args!("in the child: a short read into a live mapping"),
            );
        }
        100..128 => {
            let e = Errno::from_raw_os_error(status - 100);
            let allowed: &[Errno] = if fault_ok { &[Errno::FAULT] } else { &[] };
            sh.check(op, Err(e), allowed, "in the child: a read into the mapping");
        }
        10..100 => {
            // Another thread's advice may have split the mapping while the child forked.
            let e = Errno::from_raw_os_error(status - 10);
            let allowed: &[Errno] = if mapped.split.load(SeqCst) || mapped.dontfork.load(SeqCst) {
                &[Errno::FAULT]
            } else {
                &[]
            };
            sh.check(op, Err(e), allowed, "in the child: mremap of its mapping");
        }
        s => judge_access(sh, op, s, mapped, from, from + len),
    }
}

/// The advice fuzzed, and what the kernel may answer on an fgds mapping besides success.
const ADVICE: &[(i32, &str, &[Errno])] = &[
    (libc::MADV_DONTNEED, "DONTNEED", &[]),
    (libc::MADV_WILLNEED, "WILLNEED", &[]),
    (libc::MADV_DONTFORK, "DONTFORK", &[]),
    // madvise_behavior_valid() takes it, then VM_IO mappings (P2PDMA pages) refuse it.
    (libc::MADV_DOFORK, "DOFORK", &[Errno::INVAL]),
    // vfs_fallocate() on a character device.
    (libc::MADV_REMOVE, "REMOVE", &[Errno::NODEV]),
    (libc::MADV_FREE, "FREE", &[Errno::INVAL]),
    (libc::MADV_HUGEPAGE, "HUGEPAGE", &[Errno::INVAL]),
    (libc::MADV_NOHUGEPAGE, "NOHUGEPAGE", &[Errno::INVAL]),
    (libc::MADV_COLD, "COLD", &[Errno::INVAL]),
    (libc::MADV_PAGEOUT, "PAGEOUT", &[Errno::INVAL]),
    (libc::MADV_SEQUENTIAL, "SEQUENTIAL", &[]),
];

fn op_madvise(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let state = region.state.read().unwrap();
    let Some(mapped) = state.as_ref() else { return };
    let (from, len) = range_in(mapped, rng, mapped.len);
    let (advice, name, allowed) = rng.pick(ADVICE);
    if advice == libc::MADV_DONTFORK {
        mapped.dontfork.store(true, SeqCst);
    }
    // SAFETY: advice on our own mapping; none of it frees memory Rust owns.
    let r = unsafe { libc::madvise((region.addr + from) as *mut libc::c_void, len, advice) };
    let got = if r == 0 {
        Ok(())
    } else {
        Err(Errno::from_raw_os_error(last_errno()))
    };
    if from != 0 || len != mapped.len {
        mapped.split.store(true, SeqCst);
    }
    let mut allowed = allowed.to_vec();
    // A hole is an anonymous reservation: advice for files only fails there.
    if mapped.hole_in(from, from + len) {
        allowed.push(Errno::INVAL);
    }
    sh.check("madvise", got, &allowed, &format!("MADV_{name}"));
}

/// Whether an access to `[from, from + len)` of a region may fault, and the region's state.
fn may_fault(sh: &Shared, mapped: Option<&Mapped>, from: usize, len: usize) -> bool {
    mapped.is_none_or(|m| {
        m.buf.may_be_revoked(sh)
            || sh.stale(m.node_epoch)
            || m.hole_in(from, from + len)
            || from + len > m.len
    })
}

/// One O_DIRECT pread into a mapping (or pwrite from it to the scratch area of the drive).
fn op_io(w: &Worker, rng: &mut Rng, write: bool) {
    let sh = w.sh;
    let op = if write { "pwrite" } else { "pread" };
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let state = region.state.read().unwrap();
    let (from, len) = match state.as_ref() {
        Some(m) => range_in(m, rng, 256 * 1024),
        None => (0, PAGE as usize),
    };
    let ptr = (region.addr + from) as *mut libc::c_void;
    let bar = state.as_ref().map(|m| m.bar + from as u64);
    // SAFETY: I/O into or from our region; a revoked, unmapped or reserved range faults.
    let n = unsafe {
        if write {
            let off = WRITE_AREA + rng.below((WRITE_AREA_LEN - MIB) / PAGE) * PAGE;
            libc::pwrite(w.nvme_write.as_raw_fd(), ptr, len, off as libc::off_t)
        } else {
            let off = bar.map_or(0, source_of);
            libc::pread(w.nvme_read.as_raw_fd(), ptr, len, off as libc::off_t)
        }
    };
    let fault_ok = may_fault(sh, state.as_ref(), from, len);
    judge_transfer(sh, op, n as i64, len, fault_ok);
    if let (false, Some(bar), true) = (write, bar, n == len as isize) {
        verify_read(sh, op, bar, len);
    }
}

fn judge_transfer(sh: &Shared, op: &str, n: i64, len: usize, fault_ok: bool) {
    if n == len as i64 {
        return sh.count(op, OK);
    }
    if n >= 0 {
        sh.count(op, SHORT);
        if !fault_ok {
            sh.fail(op, format_args!("{n} of {len} bytes into a live mapping"));
        }
        return;
    }
    let e = Errno::from_raw_os_error(if n == -1 { last_errno() } else { -n as i32 });
    let allowed: &[Errno] = if fault_ok { &[Errno::FAULT] } else { &[] };
    sh.check(op, Err(e), allowed, "I/O into a mapping");
}

/// fgds's own reads into (or writes from) a registration: one `FGDS_IOCTL_READ`/`WRITE`, or
/// (`by_command`) up to three `FGDS_URING_CMD_READ`/`WRITE` in flight at once on the thread's
/// ring; no mapping, now and then past the registration's end. A revocation may end them with
/// ENODEV, never with a short count; while they are in flight, its fence waits for them.
fn op_fgds_io(w: &Worker, rng: &mut Rng, by_command: bool) {
    let sh = w.sh;
    let op = if by_command { "fgds_io_cmd" } else { "fgds_io" };
    let Some(reg) = pick(&w.regs, rng) else {
        return;
    };
    // Held across the calls: the token names this registration, not a later one.
    let gone = reg.gone.read().unwrap();
    if *gone {
        return;
    }
    let count = if by_command { 1 + rng.below(3) } else { 1 };
    let calls = (0..count)
        .map(|_| {
            let len = (1 + rng.below(64)) * PAGE;
            let from = rng.below((reg.len + PAGE).saturating_sub(len) / PAGE + 1) * PAGE;
            let write = rng.chance(250);
            let (file, file_offset) = if write {
                let off = WRITE_AREA + rng.below((WRITE_AREA_LEN - MIB) / PAGE) * PAGE;
                (&w.nvme_write, off)
            } else {
                (&w.nvme_read, source_of(reg.buf.bar_off + reg.off + from))
            };
            let arg = fgds::uapi::Io {
                idx: reg.idx,
                offset: from,
                len,
                file_offset,
                fd: file.as_raw_fd(),
                flags: 0,
            };
            (write, arg)
        })
        .collect::<Vec<_>>();
    let results = if by_command {
        match io_commands(&reg.node.file, &calls) {
            Some(results) => results,
            None => {
                sh.fail(op, format_args!("io_uring_enter failed"));
                return;
            }
        }
    } else {
        let (write, arg) = &calls[0];
        let request = if *write {
            fgds::uapi::IOCTL_WRITE
        } else {
            fgds::uapi::IOCTL_READ
        };
        // SAFETY: `Io` is `struct fgds_io`, which the kernel only reads.
        let n = unsafe { libc::ioctl(reg.node.file.as_raw_fd(), request as _, arg) };
        vec![if n < 0 { -last_errno() } else { n }]
    };
    for ((write, arg), res) in calls.iter().zip(results) {
        let past_end = arg.offset + arg.len > reg.len;
        let mut allowed = Vec::new();
        if past_end {
            allowed.push(Errno::INVAL);
        }
        if reg.buf.may_be_revoked(sh) || sh.stale(reg.node.epoch) {
            allowed.push(Errno::NODEV);
        }
        if by_command && !*COMMANDS.get_or_init(|| io_commands_supported(&reg.node.file)) {
            allowed = vec![Errno::OPNOTSUPP];
        }
        let got = match res {
            n if n == arg.len as i32 && !past_end => {
                if !*write {
                    verify_read(
                        sh,
                        op,
                        reg.buf.bar_off + reg.off + arg.offset,
                        arg.len as usize,
                    );
                }
                Ok(())
            }
            n if n >= 0 => {
                sh.count(op, SHORT);
                sh.fail(
                    op,
                    format_args!(
                        "{n} of {} bytes (at {:#x} of {:#x})",
                        arg.len, arg.offset, reg.len
                    ),
                );
                continue;
            }
            n => Err(Errno::from_raw_os_error(-n)),
        };
        sh.check(op, got, &allowed, "fgds's read or write of a live token");
    }
}

/// Files fgds's own reads and writes must refuse (driver/fgds/gate.c), open in the main
/// process before the workers fork: a pipe's ends and a socket (non-blocking, so that a driver
/// that wrongly took one could not hang a worker), a tmpfs file and a loop device over another.
static REFUSED: std::sync::OnceLock<Vec<(&'static str, File)>> = std::sync::OnceLock::new();

/// The files of [`REFUSED`], and the loop device, which the main process keeps attached.
struct Refused {
    files: Vec<(&'static str, File)>,
    _loop: fgds_tests::guest::LoopDevice,
}

const FUZZ_TMPFS: &str = "/mnt/fgds-fuzz";

fn refused_files() -> anyhow::Result<Refused> {
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::path::Path::new(FUZZ_TMPFS);
    fgds_tests::guest::tmpfs(dir)?;
    let mut files = Vec::new();
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array, which we then own.
    let piped = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_DIRECT | libc::O_NONBLOCK) };
    ensure!(piped == 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: fresh descriptors of ours.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    files.push(("a pipe's read end", File::from(r)));
    files.push(("a pipe's write end", File::from(w)));
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK;
    // SAFETY: socketpair writes two descriptors into the array, which we then own.
    let paired = unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) };
    if paired == 0 {
        // SAFETY: fresh descriptors of ours; the other end closes with this scope.
        let (a, _b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        files.push(("a socket", File::from(a)));
    } else {
        // The build: kernels have no networking at all.
        let err = std::io::Error::last_os_error();
        ensure!(
            err.raw_os_error() == Some(libc::ENOSYS),
            "socketpair: {err}"
        );
    }
    let open = |path: &std::path::Path| -> anyhow::Result<File> {
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path);
        match direct {
            Ok(f) => Ok(f),
            // tmpfs before 6.6 takes no O_DIRECT: refused all the same.
            Err(_) => Ok(std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)?),
        }
    };
    for name in ["tmpfs.bin", "loop.bin"] {
        File::create(dir.join(name))?.set_len(4 * MIB)?;
    }
    files.push(("a tmpfs file", open(&dir.join("tmpfs.bin"))?));
    let dev = fgds_tests::guest::LoopDevice::new(&dir.join("loop.bin"))?;
    files.push(("a loop device", open(&dev.path)?));
    Ok(Refused { files, _loop: dev })
}

/// fgds's read or write (ioctl or command) of a live registration with a file of
/// [`REFUSED`]: EREMOTEIO, or what a bad range or a revocation gives first.
fn op_fgds_io_refused(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let op = "fgds_io_refused";
    let Some(files) = REFUSED.get() else {
        return;
    };
    let Some(reg) = pick(&w.regs, rng) else {
        return;
    };
    let gone = reg.gone.read().unwrap();
    if *gone {
        return;
    }
    let (what, file) = &files[rng.below(files.len() as u64) as usize];
    let len = (1 + rng.below(16)) * PAGE;
    let from = rng.below((reg.len + PAGE).saturating_sub(len) / PAGE + 1) * PAGE;
    let write = rng.chance(2);
    let arg = fgds::uapi::Io {
        idx: reg.idx,
        offset: from,
        len,
        file_offset: 0,
        fd: file.as_raw_fd(),
        flags: 0,
    };
    let by_command = rng.chance(2);
    let res = if by_command {
        match io_commands(&reg.node.file, &[(write, arg)]) {
            Some(results) => results[0],
            None => {
                sh.fail(op, format_args!("io_uring_enter failed"));
                return;
            }
        }
    } else {
        let request = if write {
            fgds::uapi::IOCTL_WRITE
        } else {
            fgds::uapi::IOCTL_READ
        };
        // SAFETY: `Io` is `struct fgds_io`, which the kernel only reads.
        let n = unsafe { libc::ioctl(reg.node.file.as_raw_fd(), request as _, &arg) };
        if n < 0 { -last_errno() } else { n }
    };
    let mut allowed = vec![Errno::REMOTEIO];
    if arg.offset + arg.len > reg.len {
        allowed.push(Errno::INVAL);
    }
    if reg.buf.may_be_revoked(sh) || sh.stale(reg.node.epoch) {
        allowed.push(Errno::NODEV);
    }
    if by_command && !*COMMANDS.get_or_init(|| io_commands_supported(&reg.node.file)) {
        allowed = vec![Errno::OPNOTSUPP];
    }
    if res >= 0 {
        sh.fail(
            op,
            format_args!("fgds moved {res} bytes with {what}, which it must refuse"),
        );
        return;
    }
    sh.check(
        op,
        Err(Errno::from_raw_os_error(-res)),
        &allowed,
        "fgds's read or write with a file it must refuse",
    );
}

/// Whether fgds takes `FGDS_URING_CMD_READ` on this kernel (from 6.12): one of no length gives
/// EINVAL if so.
static COMMANDS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn io_commands_supported(node: &File) -> bool {
    let probe = [(false, fgds::uapi::Io::default())];
    io_commands(node, &probe).is_some_and(|res| res[0] == -libc::EINVAL)
}

thread_local! {
    /// Each thread's ring of 128-byte entries for fgds's commands.
    static CMD_RING: std::cell::RefCell<Option<io_uring::IoUring<io_uring::squeue::Entry128>>> =
        const { std::cell::RefCell::new(None) };
}

/// Issues `calls` as `FGDS_URING_CMD_READ`/`WRITE` at once on the thread's ring and waits for
/// all; their results in order, or `None` where io_uring itself failed.
fn io_commands(node: &File, calls: &[(bool, fgds::uapi::Io)]) -> Option<Vec<i32>> {
    CMD_RING.with_borrow_mut(|ring| {
        if ring.is_none() {
            *ring = io_uring::IoUring::<io_uring::squeue::Entry128>::builder()
                .build(4)
                .ok();
        }
        let ring = ring.as_mut()?;
        for (i, (write, arg)) in calls.iter().enumerate() {
            let op = if *write {
                fgds::uapi::URING_CMD_WRITE
            } else {
                fgds::uapi::URING_CMD_READ
            };
            let sqe = io_uring::opcode::UringCmd80::new(io_uring::types::Fd(node.as_raw_fd()), op)
                .cmd(arg.to_cmd())
                .build()
                .user_data(i as u64);
            // SAFETY: the command carries its argument inline; it refers to no memory of ours.
            unsafe { ring.submission().push(&sqe) }.ok()?;
        }
        let mut results = vec![0; calls.len()];
        let mut left = calls.len();
        while left > 0 {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(_) => return None,
            }
            for cqe in ring.completion() {
                results[cqe.user_data() as usize] = cqe.result();
                left -= 1;
            }
        }
        Some(results)
    })
}

thread_local! {
    /// Each thread's io_uring (setting one up costs more than the reads on it).
    static RING: std::cell::RefCell<Option<io_uring::IoUring>> =
        const { std::cell::RefCell::new(None) };
}

/// Up to four io_uring reads into a mapping.
fn op_uring(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let state = region.state.read().unwrap();
    let Some(mapped) = state.as_ref() else { return };
    RING.with_borrow_mut(|ring| {
        if ring.is_none() {
            *ring = io_uring::IoUring::new(4).ok();
        }
        match ring.as_mut() {
            // A ring whose submission failed may hold requests: a new one next time.
            Some(r) => {
                if !uring_reads(w, rng, r, region, mapped) {
                    *ring = None;
                }
            }
            None => sh.fail("uring_read", format_args!("io_uring_setup failed")),
        }
    });
}

fn uring_reads(
    w: &Worker,
    rng: &mut Rng,
    ring: &mut io_uring::IoUring,
    region: &Region,
    mapped: &Mapped,
) -> bool {
    let sh = w.sh;
    let n = 1 + rng.below(4) as usize;
    let mut reqs = Vec::new();
    for i in 0..n {
        let (from, len) = range_in(mapped, rng, 64 * 1024);
        let off = source_of(mapped.bar + from as u64);
        let sqe = io_uring::opcode::Read::new(
            io_uring::types::Fd(w.nvme_read.as_raw_fd()),
            (region.addr + from) as *mut u8,
            len as u32,
        )
        .offset(off)
        .build()
        .user_data(i as u64);
        // SAFETY: the region is held until every completion is reaped below.
        if unsafe { ring.submission().push(&sqe) }.is_err() {
            return false;
        }
        reqs.push((from, len));
    }
    loop {
        match ring.submit_and_wait(reqs.len()) {
            Ok(_) => break,
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
            Err(e) => {
                sh.fail("uring_read", format_args!("io_uring_enter: {e}"));
                return false;
            }
        }
    }
    for cqe in ring.completion() {
        let (from, len) = reqs[cqe.user_data() as usize];
        let fault_ok = may_fault(sh, Some(mapped), from, len);
        judge_transfer(sh, "uring_read", cqe.result() as i64, len, fault_ok);
        if cqe.result() == len as i32 {
            verify_read(sh, "uring_read", mapped.bar + from as u64, len);
        }
    }
    true
}

/// IORING_REGISTER_BUFFERS on a mapping: must fail, in every mode.
fn op_fixed_buffer(w: &Worker, rng: &mut Rng) {
    let region = &w.regions[rng.below(REGIONS as u64) as usize];
    let state = region.state.read().unwrap();
    let Some(mapped) = state.as_ref() else { return };
    RING.with_borrow_mut(|ring| {
        if ring.is_none() {
            *ring = io_uring::IoUring::new(4).ok();
        }
        if let Some(ring) = ring.as_ref() {
            fixed_buffer(w, ring, region, mapped);
        }
    });
}

fn fixed_buffer(w: &Worker, ring: &io_uring::IoUring, region: &Region, mapped: &Mapped) {
    let sh = w.sh;
    let iov = [libc::iovec {
        iov_base: region.addr as *mut libc::c_void,
        iov_len: mapped.len,
    }];
    // SAFETY: the region outlives the ring; a registration that worked is undone at once.
    match unsafe { ring.submitter().register_buffers(&iov) } {
        Ok(()) => {
            let _ = ring.submitter().unregister_buffers();
            sh.count("uring_fixed_buffer", OK);
            sh.fail(
                "uring_fixed_buffer",
                format_args!("io_uring pinned fgds memory long-term as a fixed buffer"),
            );
        }
        Err(err) => {
            let e = Errno::from_io_error(&err).unwrap_or(Errno::IO);
            let mut allowed = vec![w.fixed_buffer_errno];
            if may_fault(sh, Some(mapped), 0, mapped.len) {
                allowed.push(Errno::FAULT);
            }
            sh.check("uring_fixed_buffer", Err(e), &allowed, "a long-term pin");
        }
    }
}

fn op_close_dmabuf(w: &Worker, rng: &mut Rng) {
    if let Some(buf) = pick(&w.buffers, rng)
        && buf.dmabuf.lock().unwrap().take().is_some()
    {
        w.sh.count("close_dmabuf", OK);
    }
}

/// Closes the worker's node: its registrations go (without UNREG) as the last user of each
/// lets go; mappings keep theirs.
fn op_close_node(w: &Worker) {
    let old = w.node.lock().unwrap().take();
    if let Some(old) = old {
        w.regs
            .lock()
            .unwrap()
            .retain(|r| !Arc::ptr_eq(&r.node, &old));
        w.sh.count("close_node", OK);
    }
}

/// vgpu revokes a buffer (and waits for fgds's fences and unmaps).
fn op_revoke(w: &Worker, rng: &mut Rng) {
    let sh = w.sh;
    let Some(buf) = pick(&w.buffers, rng) else {
        return;
    };
    // Only while its fd is open: else vgpu may have freed it and handed its range to a
    // buffer revoked here by mistake.
    let dmabuf = buf.dmabuf.lock().unwrap();
    if dmabuf.is_none() {
        return;
    }
    // vgpu revokes by offset on the instance bound now: a buffer of an earlier instance would
    // name another buffer. The main process waits for revocations under way before it
    // unbinds or unplugs.
    let revoking = &sh.revoking[w.slot];
    revoking.fetch_add(1, SeqCst);
    if sh.stale(buf.epoch) {
        revoking.fetch_sub(1, SeqCst);
        return;
    }
    let already = buf.revoked.swap(true, SeqCst);
    let epoch = sh.epoch.load(SeqCst);
    let path = match common::vgpu_name() {
        Ok(name) => PathBuf::from(format!("/sys/class/vgpu/{name}/revoke")),
        Err(_) => {
            revoking.fetch_sub(1, SeqCst);
            return;
        }
    };
    let got = std::fs::write(&path, buf.bar_off.to_string())
        .map_err(|e| Errno::from_io_error(&e).unwrap_or(Errno::IO));
    revoking.fetch_sub(1, SeqCst);
    drop(dmabuf);
    // ENOENT: no live buffer there (revoked before, or vgpu rebound since).
    let mut allowed = Vec::new();
    if already || buf.epoch != epoch || sh.stale(epoch) {
        allowed.extend([Errno::NOENT, Errno::NODEV]);
    }
    sh.check(
        "revoke",
        got,
        &allowed,
        "vgpu revoking a live buffer (ETIMEDOUT: fgds kept it mapped after its fences)",
    );
}

/// The whole worker exits now, its other threads wherever they are.
fn op_exit(w: &Worker) {
    w.sh.count("exit", OK);
    // SAFETY: exit_group(2): everything is left to the kernel's exit path on purpose.
    unsafe { libc::_exit(EXIT_RESPAWN) };
}

// ---- the summary ----------------------------------------------------------------------------

fn summary(sh: &Shared, cfg: &Config, elapsed: Duration) -> serde_json::Value {
    let ops = sh.ops.load(SeqCst);
    let mut per_op = serde_json::Map::new();
    for (i, name) in OPS.iter().enumerate() {
        let mut outcomes = serde_json::Map::new();
        for (o, c) in sh.counts[i].iter().enumerate() {
            let n = c.load(SeqCst);
            if n > 0 {
                outcomes.insert(outcome_name(o), n.into());
            }
        }
        let busy = sh.busy_us[i].load(SeqCst);
        if busy > 0 {
            outcomes.insert("busy_s".to_owned(), (busy as f64 * 1e-6).into());
        }
        let verified = sh.verified[i].load(SeqCst);
        if verified > 0 {
            outcomes.insert("verified".to_owned(), verified.into());
        }
        if !outcomes.is_empty() {
            per_op.insert((*name).to_owned(), outcomes.into());
        }
    }
    serde_json::json!({
        "seed": format!("{:#x}", cfg.seed),
        "seconds": elapsed.as_secs_f64(),
        "ops": ops,
        "ops_per_s": ops as f64 / elapsed.as_secs_f64().max(1e-9),
        "workers": cfg.workers,
        "threads": cfg.threads,
        "failures": sh.failures.load(SeqCst),
        "counts": per_op,
    })
}

/// Reads whose bytes a run of a minute or more must have checked, per reading operation.
const MIN_VERIFIED: u64 = 10;

/// What a run bound by time (no `OPS` limit) of a minute or more did too rarely: an operation
/// never drawn, a kind of read never checked [`MIN_VERIFIED`] times, a chaos event that never
/// came although the run was long enough for several.
fn too_rare(sh: &Shared, cfg: &Config, elapsed: Duration) -> Vec<String> {
    if cfg.ops > 0 || elapsed < Duration::from_secs(60) {
        return Vec::new();
    }
    let count = |op: &str| -> u64 { sh.counts[op_index(op)].iter().map(|c| c.load(SeqCst)).sum() };
    let mut missing = Vec::new();
    for (op, _, _) in WEIGHTS {
        if count(op) == 0 {
            missing.push(format!("{op} never ran"));
        }
    }
    for op in ["pread", "uring_read", "fgds_io", "fgds_io_cmd"] {
        let unsupported = sh.counts[op_index(op)][errno_outcome(Errno::OPNOTSUPP)].load(SeqCst);
        if op == "fgds_io_cmd" && unsupported == count(op) {
            continue;
        }
        let verified = sh.verified[op_index(op)].load(SeqCst);
        if verified < MIN_VERIFIED {
            missing.push(format!(
                "{op}: {verified} reads checked by the host, want {MIN_VERIFIED}"
            ));
        }
    }
    if cfg.chaos > 0 && cfg.seconds >= 4 * cfg.chaos {
        for op in ["unbind_rebind", "unplug_replug", "kill_worker"] {
            if count(op) == 0 {
                missing.push(format!(
                    "{op} never happened in {} s with an event every ~{} s",
                    cfg.seconds, cfg.chaos
                ));
            }
        }
    }
    missing
}

fn print_table(sh: &Shared, elapsed: Duration) {
    let ops = sh.ops.load(SeqCst);
    ktap::diag(format_args!(
        "{ops} operations in {:.0} s ({:.0}/s), {} failed checks",
        elapsed.as_secs_f64(),
        ops as f64 / elapsed.as_secs_f64().max(1e-9),
        sh.failures.load(SeqCst)
    ));
    for (i, name) in OPS.iter().enumerate() {
        let mut cells: Vec<String> = sh.counts[i]
            .iter()
            .enumerate()
            .filter(|(_, c)| c.load(SeqCst) > 0)
            .map(|(o, c)| format!("{} {}", outcome_name(o), c.load(SeqCst)))
            .collect();
        let verified = sh.verified[i].load(SeqCst);
        if verified > 0 {
            cells.push(format!("bytes checked {verified}"));
        }
        if !cells.is_empty() {
            ktap::diag(format_args!("{name:<20} {}", cells.join(", ")));
        }
    }
}
