//! `fgds cp SRC DST`: a file into GPU memory, GPU memory into a file, or a file into another
//! through GPU memory, by the best path ([`fgds::GpuFile`]: the kernel's dma-buf buffers,
//! fgds, or host RAM), with a progress line and a last line that says what went direct and what
//! went through RAM, and why.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use fgds::{Completion, Fallback, GpuFile, Options, TransferConfig};

use crate::Source;

/// What `cp` copies between: a file, or the GPU buffer (`gpu:`).
const GPU: &str = "gpu:";

#[derive(clap::Args)]
pub struct Cp {
    /// A file or block device, or `gpu:` (the GPU memory the memory options name).
    src: String,
    /// A file (created where missing, truncated when --dst-offset is 0) or block device, or
    /// `gpu:`.
    dst: String,
    #[command(flatten)]
    source: Source,
    /// Bytes to copy (`4K`, `1M`, `2G`); default: SRC from --src-offset to its end (needed
    /// when SRC is `gpu:`).
    #[arg(long, value_parser = parse_size)]
    len: Option<u64>,
    /// Where in SRC to start (a file's offset, or the GPU buffer's).
    #[arg(long, value_parser = parse_size, default_value = "0")]
    src_offset: u64,
    /// Where in DST to start.
    #[arg(long, value_parser = parse_size, default_value = "0")]
    dst_offset: u64,
    /// GPU memory a file-to-file copy goes through, a piece at a time.
    #[arg(long, value_parser = parse_size, default_value = "64M")]
    buffer: u64,
    /// Bytes per request of the direct path.
    #[arg(long, value_parser = parse_size, default_value = "1M")]
    chunk: u64,
    /// Requests in flight.
    #[arg(long, default_value_t = TransferConfig::DEFAULT.queue_depth)]
    depth: u32,
    /// The fallback through host RAM: `auto` (where the direct path is not there, saying
    /// why), `off` (an error instead) or `on` (always).
    #[arg(long, default_value = "auto", value_parser = ["auto", "off", "on"])]
    fallback: String,
    /// The progress line (rate, bytes, time left) on stderr: `auto` (on a terminal, for copies
    /// that last more than a second), `always` or `never`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "always", "never"])]
    progress: String,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// `4096`, `4K`, `4k`, `1M`, `1MiB`, `2G`, `1T`: bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(digits);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size: write 4096, 4K, 1M or 2G"))?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("{text:?}: unknown unit {unit:?}; use K, M, G or T")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `1536` -> `1.5 KiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// What a copy did, summed over its transfers.
#[derive(Default)]
struct Tally {
    bytes: u64,
    bounced: u64,
    paths: Vec<&'static str>,
    reasons: Vec<String>,
}

impl Tally {
    fn add(&mut self, done: &Completion) {
        self.bytes += done.bytes;
        self.bounced += done.bounced;
        let path = done.path.as_str();
        if !self.paths.contains(&path) {
            self.paths.push(path);
        }
        if let Some(reason) = &done.reason
            && !self.reasons.contains(reason)
        {
            self.reasons.push(reason.clone());
        }
    }

    /// Bytes that went direct: all but those through RAM, unless a transfer went through RAM.
    fn direct(&self) -> u64 {
        self.bytes - self.bounced
    }
}

/// The progress line on stderr.
struct Progress {
    started: Instant,
    total: u64,
    show: bool,
    always: bool,
    shown: bool,
}

impl Progress {
    fn new(total: u64, how: &str) -> Progress {
        Progress {
            started: Instant::now(),
            total,
            show: how == "always" || (how == "auto" && std::io::stderr().is_terminal()),
            always: how == "always",
            shown: false,
        }
    }

    fn update(&mut self, done: u64) {
        let elapsed = self.started.elapsed();
        if !self.show || (!self.always && elapsed < Duration::from_secs(1)) {
            return;
        }
        let secs = elapsed.as_secs_f64().max(1e-9);
        let rate = done as f64 / secs;
        let left = if rate > 0.0 {
            format!("{:.0} s left", (self.total - done) as f64 / rate)
        } else {
            "? s left".to_owned()
        };
        let line = format!(
            "{} of {} ({:.0}%), {}/s, {left}",
            human(done),
            human(self.total),
            100.0 * done as f64 / self.total.max(1) as f64,
            human(rate as u64)
        );
        let mut err = std::io::stderr();
        if err.is_terminal() {
            let _ = write!(err, "\r{line}\x1b[K");
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
        self.shown = true;
    }

    fn finish(&self) {
        if self.shown && std::io::stderr().is_terminal() {
            eprintln!();
        }
    }
}

/// Pieces of a copy: a transfer per piece, so that the progress line moves.
const PIECE: u64 = 64 << 20;

pub fn run(cp: &Cp) -> anyhow::Result<()> {
    let opts = Options {
        fallback: match cp.fallback.as_str() {
            "off" => Fallback::Off,
            "on" => Fallback::Always,
            _ => Fallback::Allowed,
        },
        transfer: TransferConfig {
            chunk_size: usize::try_from(cp.chunk).context("--chunk is too large")?,
            queue_depth: cp.depth,
        },
    };
    let started = Instant::now();
    let legs = match (cp.src.as_str(), cp.dst.as_str()) {
        (GPU, GPU) => bail!("`gpu:` on both sides: name a file as SRC or DST"),
        (src, GPU) => vec![("read", file_to_gpu(cp, Path::new(src), &opts)?)],
        (GPU, dst) => vec![("write", gpu_to_file(cp, Path::new(dst), &opts)?)],
        (src, dst) => file_to_file(cp, Path::new(src), Path::new(dst), &opts)?,
    };
    report(cp, &legs, started.elapsed())
}

/// The length of the copy: `--len`, else SRC's from --src-offset.
fn length(cp: &Cp, src: &GpuFile) -> anyhow::Result<u64> {
    match cp.len {
        Some(len) => Ok(len),
        None => Ok(src.len()?.saturating_sub(cp.src_offset)),
    }
}

fn open_dst(path: &Path, dst_offset: u64) -> anyhow::Result<GpuFile> {
    let mode = if dst_offset == 0 && !is_block_device(path) {
        "w"
    } else {
        "r+"
    };
    GpuFile::open(path, mode).with_context(|| format!("cannot open {}", path.display()))
}

fn is_block_device(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// GPU memory for `len` bytes from the memory options.
fn memory(cp: &Cp, len: u64) -> anyhow::Result<(crate::Dmabuf, fgds::memory::DmabufMemory)> {
    let page = rustix::param::page_size() as u64;
    let want = len.div_ceil(page).max(1) * page;
    let (gpu, dmabuf) = crate::resolve(&cp.source, want)?;
    let info = fgds::DmabufInfo::of(dmabuf.fd()).context("the GPU memory is not a dma-buf")?;
    let mem = fgds::Registry::new()
        .dmabuf_memory(dmabuf.fd(), 0, info.size, Some(&gpu.info().bdf))
        .context("the GPU memory")?;
    Ok((dmabuf, mem))
}

fn file_to_gpu(cp: &Cp, src: &Path, opts: &Options) -> anyhow::Result<Tally> {
    let file = GpuFile::open(src, "r").with_context(|| format!("cannot open {}", src.display()))?;
    let len = length(cp, &file)?;
    // Memory of the caller's goes where it says; memory of the copy's own starts at the file
    // offset's place in a block, so that the whole blocks go direct.
    let at = if cp.source.dmabuf_fd.is_some() {
        cp.dst_offset
    } else {
        cp.dst_offset + file.phase(cp.src_offset)
    };
    let (_dmabuf, mem) = memory(cp, at + len)?;
    let mut tally = Tally::default();
    let mut progress = Progress::new(len, &cp.progress);
    while tally.bytes < len {
        let n = PIECE.min(len - tally.bytes);
        let done = file.read(&mem, n, cp.src_offset + tally.bytes, at + tally.bytes, opts)?;
        let short = done.bytes < n;
        tally.add(&done);
        progress.update(tally.bytes);
        if short {
            break;
        }
    }
    progress.finish();
    Ok(tally)
}

fn gpu_to_file(cp: &Cp, dst: &Path, opts: &Options) -> anyhow::Result<Tally> {
    let len = cp
        .len
        .context("give --len: how many bytes of GPU memory to copy")?;
    let file = open_dst(dst, cp.dst_offset)?;
    let (_dmabuf, mem) = memory(cp, cp.src_offset + len)?;
    let mut tally = Tally::default();
    let mut progress = Progress::new(len, &cp.progress);
    while tally.bytes < len {
        let n = PIECE.min(len - tally.bytes);
        let done = file.write(
            &mem,
            n,
            cp.dst_offset + tally.bytes,
            cp.src_offset + tally.bytes,
            opts,
        )?;
        tally.add(&done);
        progress.update(tally.bytes);
    }
    progress.finish();
    Ok(tally)
}

/// SRC into the GPU buffer, then out to DST, a buffer at a time: a tally per leg.
fn file_to_file(
    cp: &Cp,
    src: &Path,
    dst: &Path,
    opts: &Options,
) -> anyhow::Result<Vec<(&'static str, Tally)>> {
    let from = GpuFile::open(src, "r").with_context(|| format!("cannot open {}", src.display()))?;
    let len = length(cp, &from)?;
    let to = open_dst(dst, cp.dst_offset)?;
    let at = from.phase(cp.src_offset);
    let piece = cp.buffer.max(from.alignment());
    let (_dmabuf, mem) = memory(cp, at + piece.min(len))?;
    let (mut read, mut written) = (Tally::default(), Tally::default());
    let mut progress = Progress::new(len, &cp.progress);
    while written.bytes < len {
        let n = piece.min(len - written.bytes);
        let done = from.read(&mem, n, cp.src_offset + written.bytes, at, opts)?;
        read.add(&done);
        if done.bytes == 0 {
            break;
        }
        let out = to.write(&mem, done.bytes, cp.dst_offset + written.bytes, at, opts)?;
        written.add(&out);
        progress.update(written.bytes);
        if done.bytes < n {
            break;
        }
    }
    progress.finish();
    Ok(vec![("read", read), ("write", written)])
}

/// The last line (or JSON): bytes, time, and per leg the path, bytes direct and through RAM
/// with the reasons.
fn report(cp: &Cp, legs: &[(&str, Tally)], took: Duration) -> anyhow::Result<()> {
    let secs = took.as_secs_f64();
    let bytes = legs.last().map_or(0, |(_, t)| t.bytes);
    if cp.json {
        let json = serde_json::json!({
            "src": cp.src, "dst": cp.dst, "bytes": bytes, "seconds": secs,
            "legs": legs.iter().map(|(name, t)| serde_json::json!({
                "op": name, "bytes": t.bytes, "direct": t.direct(), "bounced": t.bounced,
                "paths": t.paths, "reasons": t.reasons,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    let mut line = format!(
        "{} to {}, {} ({bytes} bytes) in {secs:.2} s ({}/s)",
        cp.src,
        cp.dst,
        human(bytes),
        human((bytes as f64 / secs.max(1e-9)) as u64),
    );
    for (name, t) in legs {
        line.push_str(&format!(
            "; {name} path {}: {} direct, {} through RAM",
            t.paths.join(" and "),
            human(t.direct()),
            human(t.bounced),
        ));
        if !t.reasons.is_empty() {
            line.push_str(&format!(" ({})", t.reasons.join("; ")));
        }
    }
    println!("{line}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("1m"), Ok(1 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("1.5G").is_err());
        assert!(parse_size("12Q").unwrap_err().contains("unknown unit"));
        assert!(
            parse_size("99999999999T")
                .unwrap_err()
                .contains("too large")
        );
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 30), "3.0 GiB");
    }
}
