//! A system-wide sampling profiler for the guest, the part of `perf record -a -g` the benchmark
//! needs: a `cpu-clock` software event on every CPU (it needs no PMU, so it works under TCG),
//! kernel call chains, and symbols from /proc/kallsyms. `cargo xtask bench --profile` uses it to
//! show where a mode spends the guest's CPU time.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};

/// `struct perf_event_attr` up to `sample_max_stack` (PERF_ATTR_SIZE_VER5).
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
    config2: u64,
    branch_sample_type: u64,
    sample_regs_user: u64,
    sample_stack_user: u32,
    clockid: i32,
    sample_regs_intr: u64,
    aux_watermark: u32,
    sample_max_stack: u16,
    reserved: u16,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_CPU_CLOCK: u64 = 0;
const PERF_SAMPLE_IP: u64 = 1 << 0;
const PERF_SAMPLE_TID: u64 = 1 << 1;
const PERF_SAMPLE_CALLCHAIN: u64 = 1 << 5;
const FLAG_DISABLED: u64 = 1 << 0;
const FLAG_EXCLUDE_HV: u64 = 1 << 6;
const FLAG_EXCLUDE_CALLCHAIN_USER: u64 = 1 << 22;
const PERF_RECORD_SAMPLE: u32 = 9;
const PERF_RECORD_LOST: u32 = 2;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
const PERF_CONTEXT_MAX: u64 = -4095i64 as u64;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
const PERF_EVENT_IOC_DISABLE: libc::c_ulong = 0x2401;
/// Offsets of `data_head` and `data_tail` in `struct perf_event_mmap_page`.
const DATA_HEAD: usize = 1024;
const DATA_TAIL: usize = 1032;
/// Ring buffer pages per CPU (a power of two), after the header page.
const RING_PAGES: usize = 64;
/// Sampling period: 2 kHz of CPU time.
const PERIOD_NS: u64 = 500_000;
/// CPU milliseconds one sample stands for.
pub const SAMPLE_MS: f64 = PERIOD_NS as f64 / 1e6;

/// Samples of one run: each call chain (leaf first) with its count.
#[derive(Default)]
pub struct Profile {
    chains: HashMap<Vec<String>, u64>,
    /// Samples in the idle task, not counted in `chains`.
    pub idle: u64,
    /// Samples in user space (leaf `[user]`).
    pub user: u64,
    /// Samples the kernel dropped because a ring buffer was full.
    pub lost: u64,
}

impl Profile {
    /// Busy samples (kernel and user, not idle).
    pub fn busy(&self) -> u64 {
        self.chains.values().sum()
    }

    /// Functions by samples in which they are the leaf, most first.
    pub fn self_time(&self) -> Vec<(String, u64)> {
        let mut by = HashMap::<&str, u64>::new();
        for (chain, n) in &self.chains {
            *by.entry(chain[0].as_str()).or_default() += n;
        }
        sorted(by)
    }

    /// Functions by samples in which they are anywhere in the chain, most first.
    pub fn inclusive(&self) -> Vec<(String, u64)> {
        let mut by = HashMap::<&str, u64>::new();
        for (chain, n) in &self.chains {
            let mut seen = chain.iter().map(String::as_str).collect::<Vec<_>>();
            seen.sort_unstable();
            seen.dedup();
            for f in seen {
                *by.entry(f).or_default() += n;
            }
        }
        sorted(by)
    }

    /// Call chains folded root first (`a;b;c`), most samples first.
    pub fn folded(&self) -> Vec<(String, u64)> {
        let mut v = self
            .chains
            .iter()
            .map(|(c, n)| {
                let mut c = c.clone();
                c.reverse();
                (c.join(";"), *n)
            })
            .collect::<Vec<_>>();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }
}

fn sorted(by: HashMap<&str, u64>) -> Vec<(String, u64)> {
    let mut v = by
        .into_iter()
        .map(|(k, n)| (k.to_owned(), n))
        .collect::<Vec<_>>();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

/// Kernel text symbols, sorted by address.
struct Symbols(Vec<(u64, String)>);

impl Symbols {
    fn load() -> anyhow::Result<Symbols> {
        // Root sees addresses unless kptr_restrict is 2.
        let _ = std::fs::write("/proc/sys/kernel/kptr_restrict", "0");
        let text = std::fs::read_to_string("/proc/kallsyms").context("/proc/kallsyms")?;
        let mut syms = text
            .lines()
            .filter_map(|line| {
                let mut it = line.split_whitespace();
                let addr = u64::from_str_radix(it.next()?, 16).ok()?;
                let kind = it.next()?;
                let name = it.next()?;
                matches!(kind, "t" | "T" | "W" | "w").then(|| (addr, name.to_owned()))
            })
            .filter(|(addr, _)| *addr != 0)
            .collect::<Vec<_>>();
        if syms.is_empty() {
            bail!("/proc/kallsyms shows no addresses (kernel.kptr_restrict=2?)");
        }
        syms.sort();
        Ok(Symbols(syms))
    }

    fn name(&self, ip: u64) -> String {
        match self.0.partition_point(|(a, _)| *a <= ip) {
            0 => format!("{ip:#x}"),
            i => self.0[i - 1].1.clone(),
        }
    }
}

/// One CPU's event and ring buffer.
struct Ring {
    fd: OwnedFd,
    base: *mut u8,
    len: usize,
}

// SAFETY: the ring is only read by the one collector thread that owns it after setup.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `open_ring`.
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), self.len) };
    }
}

fn open_ring(cpu: i32) -> anyhow::Result<Ring> {
    let attr = PerfEventAttr {
        kind: PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        config: PERF_COUNT_SW_CPU_CLOCK,
        sample_period: PERIOD_NS,
        sample_type: PERF_SAMPLE_IP | PERF_SAMPLE_TID | PERF_SAMPLE_CALLCHAIN,
        flags: FLAG_DISABLED | FLAG_EXCLUDE_HV | FLAG_EXCLUDE_CALLCHAIN_USER,
        sample_max_stack: 64,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid perf_event_attr of the size it states; pid -1 with a CPU is a
    // system-wide event on that CPU.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            -1,
            cpu,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("perf_event_open(cpu-clock, cpu {cpu})"));
    }
    // SAFETY: the syscall returned a new file descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let len = (RING_PAGES + 1) * 4096;
    // SAFETY: a new shared mapping of the event's ring buffer, which the kernel sized for us.
    let base = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            len,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::SHARED,
            &fd,
            0,
        )
    }
    .context("mmap of a perf ring buffer")?;
    Ok(Ring {
        fd,
        base: base.cast(),
        len,
    })
}

/// Raw samples: (pid, call chain of kernel addresses, leaf first; empty for user space).
type Raw = Vec<(u32, Vec<u64>)>;

/// Takes the records between the ring's tail and head.
fn drain(ring: &Ring, out: &mut Raw, lost: &AtomicU64) {
    let data = RING_PAGES * 4096;
    // SAFETY: data_head and data_tail are u64 fields of the header page the kernel shares;
    // the head is read with acquire and the tail published with release, as perf does.
    let (head, tail) = unsafe {
        let head = &*(ring.base.add(DATA_HEAD) as *const AtomicU64);
        let tail = &*(ring.base.add(DATA_TAIL) as *const AtomicU64);
        (head, tail)
    };
    let end = head.load(Ordering::Acquire);
    let mut pos = tail.load(Ordering::Relaxed);
    // SAFETY: the data area follows the header page and is `data` bytes long.
    let area = unsafe { std::slice::from_raw_parts(ring.base.add(4096), data) };
    let read = |at: u64, n: usize| -> Vec<u8> {
        (0..n)
            .map(|i| area[((at as usize) + i) % data])
            .collect::<Vec<_>>()
    };
    let u64_at = |bytes: &[u8], i: usize| u64::from_ne_bytes(bytes[i..i + 8].try_into().unwrap());
    while pos < end {
        let header = read(pos, 8);
        let kind = u32::from_ne_bytes(header[0..4].try_into().unwrap());
        let size = u16::from_ne_bytes(header[6..8].try_into().unwrap()) as usize;
        if size < 8 {
            break;
        }
        let rec = read(pos, size);
        if kind == PERF_RECORD_SAMPLE && size >= 32 {
            let ip = u64_at(&rec, 8);
            let pid = u32::from_ne_bytes(rec[16..20].try_into().unwrap());
            let nr = u64_at(&rec, 24) as usize;
            let chain = (0..nr)
                .filter_map(|i| rec.get(32 + 8 * i..40 + 8 * i))
                .map(|b| u64::from_ne_bytes(b.try_into().unwrap()))
                .filter(|&a| a < PERF_CONTEXT_MAX)
                .collect::<Vec<_>>();
            let kernel = ip >= 0xffff_0000_0000_0000;
            out.push((pid, if kernel { chain } else { Vec::new() }));
        } else if kind == PERF_RECORD_LOST && size >= 24 {
            lost.fetch_add(u64_at(&rec, 16), Ordering::Relaxed);
        }
        pos += size as u64;
    }
    tail.store(pos, Ordering::Release);
}

/// Runs `work` while sampling every CPU, and returns its result with the profile.
pub fn profile<T>(work: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<(T, Profile)> {
    let symbols = Symbols::load()?;
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rings = (0..cpus)
        .map(|cpu| open_ring(cpu as i32))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let stop = Arc::new(AtomicBool::new(false));
    let lost = Arc::new(AtomicU64::new(0));
    let fds = rings.iter().map(|r| r.fd.as_raw_fd()).collect::<Vec<_>>();
    let collector = {
        let (stop, lost) = (stop.clone(), lost.clone());
        std::thread::spawn(move || {
            let mut raw = Raw::new();
            loop {
                let last = stop.load(Ordering::Acquire);
                for ring in &rings {
                    drain(ring, &mut raw, &lost);
                }
                if last {
                    return raw;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    for &fd in &fds {
        // SAFETY: an ioctl without argument on a perf event fd the collector keeps open.
        unsafe { libc::ioctl(fd, PERF_EVENT_IOC_ENABLE, 0) };
    }
    let result = work();
    for &fd in &fds {
        // SAFETY: as above.
        unsafe { libc::ioctl(fd, PERF_EVENT_IOC_DISABLE, 0) };
    }
    stop.store(true, Ordering::Release);
    let raw = collector
        .join()
        .map_err(|_| anyhow::format_err!("profiler thread panicked"))?;
    let result = result?;
    let mut prof = Profile {
        lost: lost.load(Ordering::Relaxed),
        ..Default::default()
    };
    for (pid, chain) in raw {
        if pid == 0 {
            prof.idle += 1;
            continue;
        }
        let names = if chain.is_empty() {
            prof.user += 1;
            vec!["[user]".to_owned()]
        } else {
            chain.iter().map(|&ip| symbols.name(ip)).collect()
        };
        *prof.chains.entry(names).or_default() += 1;
    }
    Ok((result, prof))
}

/// Runs `work` with the given tracepoints (`subsystem/event`) enabled and returns the trace
/// it produced, as `/sys/kernel/tracing/trace` prints it.
pub fn trace<T>(
    events: &[&str],
    work: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(T, String)> {
    let root = std::path::Path::new("/sys/kernel/tracing");
    if !root.join("trace").exists() {
        let _ = std::fs::create_dir_all(root);
        rustix::mount::mount(
            "tracefs",
            root,
            "tracefs",
            rustix::mount::MountFlags::empty(),
            None,
        )
        .context("mount tracefs on /sys/kernel/tracing")?;
    }
    let write = |file: &str, value: &str| {
        std::fs::write(root.join(file), value).with_context(|| format!("write {value:?} to {file}"))
    };
    write("tracing_on", "0")?;
    write("trace", "")?;
    write("buffer_size_kb", "4096")?;
    for event in events {
        write(&format!("events/{event}/enable"), "1")?;
    }
    write("tracing_on", "1")?;
    let result = work();
    write("tracing_on", "0")?;
    for event in events {
        write(&format!("events/{event}/enable"), "0")?;
    }
    let text = std::fs::read_to_string(root.join("trace")).context("read the trace")?;
    write("trace", "")?;
    Ok((result?, text))
}
