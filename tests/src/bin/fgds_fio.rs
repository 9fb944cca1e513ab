//! fio with the project's `fgds` ioengine (fio/fgds.c, staged with Debian's fio by
//! xtask/src/fio.rs): jobs that write through GPU memory and read back with fio's own verify
//! on (so fio checks every byte that came back into GPU memory), on the raw namespace and on a
//! file of ext4, through io_uring commands and through ioctls; a file fgds cannot reach
//! (tmpfs) and a job without `direct=1` fail the job, with nothing moved.
//!
//! Booted with `fgds.fio=bench` (`cargo xtask fio`) it runs the grid instead: the `fgds`
//! engine into GPU memory against fio's own `io_uring` engine into RAM, one `# fgds-fio:`
//! JSON line per job.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail, ensure};
use fgds_tests::guest;
use fgds_tests::ktap::{self, Case, CaseResult};
use serde_json::Value;

const FIO: &str = "/usr/bin/fio";
const ENGINE: &str = "/usr/lib/fgds/fio-fgds.so";
const MIB: u64 = 1 << 20;
/// The raw drive's bytes the jobs write (scratch: past the pattern, clear of the fault areas).
const AREA: u64 = 144 * MIB;

fn main() {
    // fio keeps its job table in SysV shared memory (shmget).
    if !Path::new("/proc/sysvipc").exists() {
        println!(
            "KTAP version 1\n1..0 # SKIP the kernel has no SysV IPC (CONFIG_SYSVIPC), where fio \
             keeps its job table"
        );
        std::process::exit(4);
    }
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    if cmdline.split_whitespace().any(|w| w == "fgds.fio=bench") {
        // Reports fgds's mode, which the host checks against the configuration.
        guest::skip_if_fgds_refuses();
        ktap::run(&[Case {
            name: "grid",
            run: grid,
        }]);
    }
    if cmdline.split_whitespace().any(|w| w == "fgds.fio=job") {
        guest::skip_if_fgds_refuses();
        ktap::run(&[Case {
            name: "job",
            run: given_job,
        }]);
    }
    guest::skip_unless_vgpu();
    guest::skip_if_fgds_refuses();
    ktap::run(&[
        Case {
            name: "example_job_file_verifies",
            run: example_job_file_verifies,
        },
        Case {
            name: "write_then_verify_depth_8",
            run: write_then_verify_depth_8,
        },
        Case {
            name: "randwrite_verify_4k_depth_32",
            run: randwrite_verify_4k_depth_32,
        },
        Case {
            name: "ioctl_path_verify",
            run: ioctl_path_verify,
        },
        Case {
            name: "ext4_file_verify",
            run: ext4_file_verify,
        },
        Case {
            name: "tmpfs_file_fails_with_eremoteio",
            run: tmpfs_file_fails_with_eremoteio,
        },
        Case {
            name: "buffered_job_refused",
            run: buffered_job_refused,
        },
    ])
}

/// Where xtask/src/fio.rs stages fio/'s job files (and `cargo xtask fio --job`'s as job.fio).
const JOBS: &str = "/usr/share/fgds/fio";

/// Runs the job file `path` with the variables fio/'s job files expect; fio's JSON output.
fn fio_job_file(path: &str, json: bool) -> anyhow::Result<Run> {
    let vgpu = guest::vgpu_name()?;
    let out = Command::new(FIO)
        .args(json.then_some("--output-format=json"))
        .arg(path)
        .env("FGDS_ENGINE", ENGINE)
        .env("FGDS_FILE", guest::nvme_path()?)
        .env("FGDS_OFFSET", AREA.to_string())
        .env(
            "FGDS_DMABUF",
            format!("vgpu:{}", vgpu.trim_start_matches("vgpu")),
        )
        .output()
        .with_context(|| format!("cannot run {FIO} {path}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json = json
        .then(|| stdout.find('{'))
        .flatten()
        .and_then(|at| serde_json::from_str(&stdout[at..]).ok());
    Ok(Run {
        ok: out.status.success(),
        json,
        text: format!("{}{}", String::from_utf8_lossy(&out.stderr), stdout),
    })
}

/// fio/fgds-verify.fio, the job file users start from: each of its jobs wrote its size through
/// GPU memory and verified all of it, with no error.
fn example_job_file_verifies() -> CaseResult {
    let run = fio_job_file(&format!("{JOBS}/fgds-verify.fio"), true)?;
    if !run.ok && run.text.contains("cannot carry fgds's commands") {
        return ktap::skip(
            "EOPNOTSUPP: this kernel's io_uring loses the byte count (fgds_ioctl=1 runs here)",
        );
    }
    ensure!(run.ok, "fio failed:\n{}", run.text);
    let jobs = run
        .json
        .as_ref()
        .and_then(|j| j["jobs"].as_array())
        .with_context(|| format!("fio printed no job results:\n{}", run.text))?;
    ensure!(
        jobs.len() == 2,
        "{} jobs ran, not 2:\n{}",
        jobs.len(),
        run.text
    );
    for (job, want) in jobs.iter().zip([16 * MIB, 4 * MIB]) {
        let (written, read) = (
            job["write"]["io_bytes"].as_u64().unwrap_or_default(),
            job["read"]["io_bytes"].as_u64().unwrap_or_default(),
        );
        ensure!(
            job["error"] == 0 && written == want && read == want,
            "job {}: error {}, {written} bytes written and {read} verified, not {want}",
            job["jobname"],
            job["error"]
        );
    }
    ktap::pass()
}

/// `cargo xtask fio --job FILE`: the file, fio's own output as diagnostics (`fio| ` lines for
/// the host), its exit status the verdict.
fn given_job() -> CaseResult {
    let run = fio_job_file(&format!("{JOBS}/job.fio"), false)?;
    for line in run.text.lines() {
        ktap::diag(format_args!("fio| {line}"));
    }
    ensure!(run.ok, "fio failed (its output is above)");
    ktap::pass()
}

/// One fio job's result: the exit status, fio's JSON (where it printed one) and its stderr.
struct Run {
    ok: bool,
    json: Option<Value>,
    text: String,
}

/// Runs one fio job given as `--name=value` options, with JSON output.
fn fio(args: &[String]) -> anyhow::Result<Run> {
    let out = Command::new(FIO)
        .args(["--output-format=json", "--name=job"])
        .args(args)
        .output()
        .with_context(|| format!("cannot run {FIO}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    // fio prints its own errors before the JSON on stdout.
    let json = stdout
        .find('{')
        .and_then(|at| serde_json::from_str(&stdout[at..]).ok());
    let text = format!("{}{}", String::from_utf8_lossy(&out.stderr), stdout);
    Ok(Run {
        ok: out.status.success(),
        json,
        text,
    })
}

/// The `fgds` engine's options for a job on `filename`, with the rig's GPU memory.
fn fgds_job(filename: &str, extra: &[&str]) -> anyhow::Result<Vec<String>> {
    let vgpu = guest::vgpu_name()?;
    let mut args = vec![
        format!("--ioengine=external:{ENGINE}"),
        format!("--filename={filename}"),
        format!("--fgds_dmabuf=vgpu:{}", vgpu.trim_start_matches("vgpu")),
        "--direct=1".to_owned(),
    ];
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    Ok(args)
}

/// Bytes the job's reads and writes moved, and fio's error code.
fn moved(run: &Run) -> anyhow::Result<(u64, u64, i64)> {
    let job = run
        .json
        .as_ref()
        .and_then(|j| j["jobs"].get(0))
        .with_context(|| format!("fio printed no job result:\n{}", run.text))?;
    Ok((
        job["read"]["io_bytes"].as_u64().unwrap_or_default(),
        job["write"]["io_bytes"].as_u64().unwrap_or_default(),
        job["error"].as_i64().unwrap_or_default(),
    ))
}

/// A write job with fio's verify: every block written from GPU memory, then read back into
/// GPU memory and checked by fio.
fn verified_write(filename: &str, size: u64, extra: &[&str]) -> CaseResult {
    let mut opts = vec!["--verify=crc32c", "--verify_fatal=1", "--do_verify=1"];
    opts.extend_from_slice(extra);
    let size = format!("--size={size}");
    opts.push(&size);
    let run = fio(&fgds_job(filename, &opts)?)?;
    if !run.ok && run.text.contains("cannot carry fgds's commands") {
        return ktap::skip(
            "EOPNOTSUPP: this kernel's io_uring loses the byte count (fgds_ioctl=1 runs here)",
        );
    }
    if !run.ok {
        bail!("fio failed:\n{}", run.text);
    }
    let (read, written, error) = moved(&run)?;
    let want = size.trim_start_matches("--size=").parse::<u64>()?;
    ensure!(error == 0, "fio reports error {error}:\n{}", run.text);
    ensure!(
        written == want && read == want,
        "fio wrote {written} and verified {read} bytes, not {want} each:\n{}",
        run.text
    );
    ktap::diag(format_args!(
        "{want} bytes written from GPU memory and verified"
    ));
    ktap::pass()
}

fn write_then_verify_depth_8() -> CaseResult {
    let nvme = guest::nvme_path()?;
    verified_write(
        &nvme.to_string_lossy(),
        16 * MIB,
        &[
            "--rw=write",
            "--bs=64k",
            "--iodepth=8",
            &format!("--offset={AREA}"),
        ],
    )
}

fn randwrite_verify_4k_depth_32() -> CaseResult {
    let nvme = guest::nvme_path()?;
    verified_write(
        &nvme.to_string_lossy(),
        4 * MIB,
        &[
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            &format!("--offset={AREA}"),
        ],
    )
}

fn ioctl_path_verify() -> CaseResult {
    let nvme = guest::nvme_path()?;
    verified_write(
        &nvme.to_string_lossy(),
        8 * MIB,
        &[
            "--rw=write",
            "--bs=128k",
            "--fgds_ioctl=1",
            &format!("--offset={}", AREA + 16 * MIB),
        ],
    )
}

fn ext4_file_verify() -> CaseResult {
    let dir = std::env::var("FGDS_EXT4").context("the rig provides no ext4 (FGDS_EXT4)")?;
    let file = Path::new(&dir).join("fio.dat");
    let res = verified_write(
        &file.to_string_lossy(),
        8 * MIB,
        &["--rw=write", "--bs=1m", "--iodepth=4"],
    );
    let _ = std::fs::remove_file(&file);
    res
}

/// tmpfs takes O_DIRECT (from Linux 6.6) but is no block device: fgds refuses it
/// (EREMOTEIO), the job fails, and nothing counts as moved.
fn tmpfs_file_fails_with_eremoteio() -> CaseResult {
    let dir = Path::new("/tmp/fio-tmpfs");
    guest::tmpfs(dir)?;
    let file = dir.join("fio.dat");
    std::fs::write(&file, vec![0u8; MIB as usize])?;
    let run = fio(&fgds_job(
        &file.to_string_lossy(),
        &["--rw=read", "--bs=64k", "--size=1m", "--fgds_ioctl=1"],
    )?)?;
    let _ = std::fs::remove_file(&file);
    if run.text.contains("Invalid argument") && !run.text.contains("Remote I/O error") {
        return ktap::skip("this kernel's tmpfs takes no O_DIRECT (from Linux 6.6)");
    }
    ensure!(!run.ok, "fio succeeded on a tmpfs file:\n{}", run.text);
    ensure!(
        run.text.contains("Remote I/O error"),
        "fio failed, but not with EREMOTEIO:\n{}",
        run.text
    );
    if let Ok((read, _, _)) = moved(&run) {
        ensure!(
            read == 0,
            "fio counted {read} bytes read from tmpfs as moved"
        );
    }
    ktap::pass()
}

fn buffered_job_refused() -> CaseResult {
    let nvme = guest::nvme_path()?;
    let mut args = fgds_job(
        &nvme.to_string_lossy(),
        &["--rw=read", "--size=1m", "--fgds_ioctl=1"],
    )?;
    args.retain(|a| a != "--direct=1");
    let run = fio(&args)?;
    ensure!(!run.ok, "fio ran a job without direct=1:\n{}", run.text);
    ensure!(
        run.text.contains("set direct=1"),
        "the refusal does not say what to set:\n{}",
        run.text
    );
    ktap::pass()
}

/// The grid's engines: fgds's into GPU memory; fio's io_uring into RAM as fio allocates it
/// (4 KiB pages, each request pinning them); and into RAM in 2 MiB huge pages registered once
/// as fixed buffers (the row that says how much of a gap is RAM's page size and pinning).
const ENGINES: [&str; 3] = ["fgds", "io_uring", "io_uring-huge"];

/// Reads and writes the disk under `dev` has completed (/sys/block/NAME/stat).
fn disk_ios(dev: &Path) -> anyhow::Result<(u64, u64)> {
    let name = dev.file_name().context("no disk name")?.to_string_lossy();
    let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat"))?;
    let f = stat
        .split_whitespace()
        .map(|w| w.parse::<u64>().unwrap_or_default())
        .collect::<Vec<_>>();
    ensure!(f.len() > 4, "/sys/block/{name}/stat: {stat:?}");
    Ok((f[0], f[4]))
}

/// The grid: each workload, block size and depth with each engine on the same drive area.
fn grid() -> CaseResult {
    let cmdline = std::fs::read_to_string("/proc/cmdline")?;
    let runtime: u64 = cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("fgds.fio_runtime="))
        .unwrap_or("2")
        .parse()
        .context("fgds.fio_runtime")?;
    let nvme = guest::nvme_path()?;
    let dev = nvme.to_string_lossy().into_owned();
    // Requests up to 4 MiB reach the drive whole for every engine (as for the bench).
    guest::max_sectors_to_hw(&nvme)?;
    // io_uring-huge's buffers: 32 x 4 MiB and fio's alignment, in 2 MiB pages.
    std::fs::write("/proc/sys/vm/nr_hugepages", "80")?;
    let huge = std::fs::read_to_string("/proc/sys/vm/nr_hugepages")?;
    ensure!(
        huge.trim().parse::<u64>()? >= 80,
        "the guest reserved only {} of 80 huge pages",
        huge.trim()
    );
    let vgpu = guest::vgpu_name()?;
    let mut failures = Vec::new();
    for rw in ["read", "randread", "write", "randwrite"] {
        for bs in [4 << 10, 64 << 10, MIB, 4 * MIB] {
            for depth in [1u64, 32] {
                for engine in ENGINES {
                    let mut args = vec![
                        format!("--filename={dev}"),
                        format!("--rw={rw}"),
                        format!("--bs={bs}"),
                        format!("--iodepth={depth}"),
                        format!("--offset={}", 64 * MIB),
                        format!("--size={}", 160 * MIB),
                        "--direct=1".to_owned(),
                        "--time_based=1".to_owned(),
                        format!("--runtime={runtime}"),
                        "--ramp_time=0".to_owned(),
                    ];
                    match engine {
                        "fgds" => {
                            args.push(format!("--ioengine=external:{ENGINE}"));
                            args.push(format!(
                                "--fgds_dmabuf=vgpu:{}",
                                vgpu.trim_start_matches("vgpu")
                            ));
                        }
                        "io_uring" => args.push("--ioengine=io_uring".to_owned()),
                        _ => args.extend(
                            ["--ioengine=io_uring", "--iomem=shmhuge", "--fixedbufs=1"]
                                .map(str::to_owned),
                        ),
                    }
                    let before = disk_ios(&nvme)?;
                    let run = fio(&args)?;
                    let after = disk_ios(&nvme)?;
                    let job = run.json.as_ref().and_then(|j| j["jobs"].get(0));
                    let Some(job) = job.filter(|_| run.ok) else {
                        failures.push(format!("{engine} {rw} {bs} qd{depth}:\n{}", run.text));
                        continue;
                    };
                    let side = if rw.contains("read") { "read" } else { "write" };
                    let r = &job[side];
                    // What the drive saw: requests it completed per I/O fio made.
                    let requests = if side == "read" {
                        after.0 - before.0
                    } else {
                        after.1 - before.1
                    };
                    let ios = r["total_ios"].as_u64().unwrap_or_default();
                    let row = serde_json::json!({
                        "engine": engine,
                        "rw": rw,
                        "bs": bs,
                        "iodepth": depth,
                        "gib_s": r["bw_bytes"].as_f64().unwrap_or_default() / (1u64 << 30) as f64,
                        "iops": r["iops"].as_f64().unwrap_or_default(),
                        "lat_us": r["lat_ns"]["mean"].as_f64().unwrap_or_default() / 1000.0,
                        "usr_cpu": job["usr_cpu"],
                        "sys_cpu": job["sys_cpu"],
                        "io_bytes": r["io_bytes"],
                        "requests_per_io": requests as f64 / ios.max(1) as f64,
                    });
                    ktap::diag(format_args!("fgds-fio: {row}"));
                }
            }
        }
    }
    if !failures.is_empty() {
        bail!("{} jobs failed:\n{}", failures.len(), failures.join("\n"));
    }
    ktap::pass()
}
