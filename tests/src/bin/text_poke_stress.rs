//! Not in the suite: flips kernel static keys many times while the other vCPU runs the code
//! they patch, to show whether the machine gets x86 live text patching right
//! (`cargo xtask boot-loop --text-poke-stress`; docs/architecture.md, Boot flakes).
//!
//! CPU 0 toggles `kernel.sched_schedstats` (a static key in the scheduler's enqueue, dequeue
//! and wakeup paths) and `kernel.timer_migration` (one in the timer wheel); two processes on
//! CPU 1 ping-pong a byte over pipes meanwhile, so CPU 1 runs those paths. Every toggle
//! rewrites each site of the key with an INT3 first and three IPI syncs of all CPUs
//! (`smp_text_poke_batch_finish`). A machine that lets a CPU run stale code after the last
//! sync oopses with `Oops: int3`; the rig fails the run on that splat.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fgds_tests::ktap::{self, Case, CaseResult};

/// Key flips per sysctl; the run ends earlier when it reaches [`MAX_TIME`].
const FLIPS: u32 = 4000;
const MAX_TIME: Duration = Duration::from_secs(60);
const SYSCTLS: &[&str] = &[
    "/proc/sys/kernel/sched_schedstats",
    "/proc/sys/kernel/timer_migration",
];

fn main() {
    ktap::run(&[Case {
        name: "static_keys_flip_while_the_other_cpu_runs_them",
        run: flip_keys,
    }])
}

fn flip_keys() -> CaseResult {
    let sysctls = SYSCTLS
        .iter()
        .filter(|p| std::path::Path::new(p).exists())
        .collect::<Vec<_>>();
    if sysctls.is_empty() {
        return ktap::skip("the kernel has neither sched_schedstats nor timer_migration");
    }
    let originals = sysctls
        .iter()
        .map(|p| std::fs::read_to_string(p).with_context(|| format!("read {p}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let children = start_ping_pong()?;
    pin_to_cpu(0)?;
    let started = Instant::now();
    let mut flips = 0u32;
    let result = (|| -> anyhow::Result<()> {
        while flips < FLIPS && started.elapsed() < MAX_TIME {
            for value in ["1\n", "0\n"] {
                for p in &sysctls {
                    std::fs::write(p, value).with_context(|| format!("write {value:?} to {p}"))?;
                }
            }
            flips += 2;
        }
        Ok(())
    })();
    for pid in children {
        // SAFETY: kill(2) and waitpid(2) on our own children; no memory is shared.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
    }
    for (p, original) in sysctls.iter().zip(&originals) {
        std::fs::write(p, original).with_context(|| format!("restore {p}"))?;
    }
    result?;
    ktap::diag(format!(
        "{flips} flips of each of {} keys in {:.1} s, CPU 1 busy",
        sysctls.len(),
        started.elapsed().as_secs_f64()
    ));
    ktap::pass()
}

/// Two processes on CPU 1 that pass a byte back and forth over two pipes until killed.
fn start_ping_pong() -> anyhow::Result<Vec<libc::pid_t>> {
    let mut there = [0; 2];
    let mut back = [0; 2];
    // SAFETY: pipe(2) writes two descriptors into each array of two.
    let made = unsafe { libc::pipe(there.as_mut_ptr()) == 0 && libc::pipe(back.as_mut_ptr()) == 0 };
    if !made {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    let mut pids = Vec::new();
    for (read_fd, write_fd, first) in [(there[0], back[1], false), (back[0], there[1], true)] {
        // SAFETY: the program is single-threaded here; the child only calls async-signal-safe
        // functions (sched_setaffinity, read, write, _exit) and never returns.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            bail!("fork: {}", std::io::Error::last_os_error());
        }
        if pid == 0 {
            let _ = pin_to_cpu(1);
            let mut byte = 0u8;
            // SAFETY: one-byte reads and writes into a local on pipes this process owns.
            unsafe {
                if first {
                    libc::write(write_fd, (&raw const byte).cast(), 1);
                }
                loop {
                    if libc::read(read_fd, (&raw mut byte).cast(), 1) != 1
                        || libc::write(write_fd, (&raw const byte).cast(), 1) != 1
                    {
                        libc::_exit(0);
                    }
                }
            }
        }
        pids.push(pid);
    }
    Ok(pids)
}

fn pin_to_cpu(cpu: usize) -> anyhow::Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET and sched_setaffinity only touch it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
            bail!(
                "sched_setaffinity(CPU {cpu}): {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}
