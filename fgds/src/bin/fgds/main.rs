//! `fgds`: list GPUs fgds serves, move files into and out of GPU memory, and benchmark the
//! direct path against the alternatives.

mod bench;
mod cp;
mod drive;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use fgds::Gpu;

#[derive(Parser)]
#[command(
    name = "fgds",
    about = "Direct I/O between NVMe and GPU memory",
    arg_required_else_help = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The GPUs fgds serves: PCI address, node, BAR size, page mode, IOMMU, registrations.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Copy a file into GPU memory (`fgds cp FILE gpu:`), GPU memory into a file (`fgds cp gpu:
    /// FILE`), or a file into another through GPU memory, by the best path, saying which.
    Cp(cp::Cp),
    /// Measure throughput, latency and CPU time of direct, bounce, ram and p2pmem I/O.
    Bench(bench::Options),
    /// Which path a read into GPU memory would take on this machine, and why not the direct
    /// one: module, nodes, page mode, IOMMU, P2PDMA, drives, CUDA, the fgds group. With FILE:
    /// which path a read of that file into the GPU's memory (or a write of it, --write) takes,
    /// as fgds's driver answers without moving data.
    Doctor {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        /// The file (or block device) to ask about.
        file: Option<std::path::PathBuf>,
        /// Ask about writing GPU memory to FILE (opened for writing, never changed).
        #[arg(long, requires = "file")]
        write: bool,
        #[command(flatten)]
        source: Source,
    },
}

/// Where the GPU memory comes from.
#[derive(clap::Args, Clone)]
pub struct Source {
    /// The GPU's PCI address; defaults to the only GPU fgds serves.
    #[arg(long)]
    gpu: Option<String>,
    /// A dma-buf fd inherited from the parent process (a GPU runtime's export).
    #[arg(long, conflicts_with_all = ["vgpu", "cuda"])]
    dmabuf_fd: Option<i32>,
    /// Allocate from the rig's test exporter /dev/vgpuN.
    #[arg(long, conflicts_with = "cuda")]
    vgpu: Option<u32>,
    /// Allocate CUDA memory on this device (its ordinal, as nvidia-smi -L numbers them) and
    /// export it as a dma-buf (libcuda.so.1, loaded at run time); the GPU is the CUDA
    /// device's, found by PCI bus id.
    #[arg(long, value_name = "DEVICE")]
    cuda: Option<i32>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.command {
        Command::List { json } => list(json),
        Command::Cp(c) => cp::run(&c),
        Command::Bench(opts) => bench::run(&opts),
        Command::Doctor {
            json,
            file: Some(file),
            write,
            source,
        } => doctor_file(&file, write, &source, json),
        Command::Doctor { json, .. } => doctor(json),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("fgds: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn list(json: bool) -> anyhow::Result<()> {
    let gpus = Gpu::list()?;
    if json {
        let items = gpus
            .iter()
            .map(|g| {
                serde_json::json!({
                    "bdf": g.bdf, "node": g.node, "bar_size": g.bar_size, "mode": g.mode,
                    "iommu": g.iommu, "buffers": g.buffers, "bytes": g.bytes,
                })
            })
            .collect::<Vec<_>>();
        println!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(());
    }
    if gpus.is_empty() {
        println!(
            "no GPUs: is the fgds module loaded (modprobe fgds), and does a GPU have a prefetchable BAR of 64 MiB or more?"
        );
        return Ok(());
    }
    println!(
        "{:<14} {:<26} {:>10} {:<16} {:<10} {:>8} {:>12}",
        "GPU", "NODE", "BAR", "MODE", "IOMMU", "BUFFERS", "BYTES"
    );
    for g in gpus {
        println!(
            "{:<14} {:<26} {:>7} MiB {:<16} {:<10} {:>8} {:>12}",
            g.bdf,
            g.node.display(),
            g.bar_size >> 20,
            g.mode,
            g.iommu,
            g.buffers,
            g.bytes
        );
    }
    Ok(())
}

fn doctor(json: bool) -> anyhow::Result<()> {
    let report = fgds::doctor::examine(
        std::path::Path::new("/"),
        &fgds::doctor::Identity::current(),
        fgds::doctor::cuda_devices(),
    );
    if json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

/// How much GPU memory `fgds doctor FILE` registers to ask with.
const DOCTOR_BYTES: u64 = 2 << 20;

/// `fgds doctor FILE`: the driver's gate on FILE for one registration of the GPU's memory; for
/// a disk without a PCI device (md), its verdict on each member too.
fn doctor_file(
    path: &std::path::Path,
    write: bool,
    source: &Source,
    json: bool,
) -> anyhow::Result<()> {
    let (gpu, dmabuf) = resolve(source, DOCTOR_BYTES)?;
    let buffer = gpu.register(dmabuf.fd(), 0, DOCTOR_BYTES)?;
    let what = if write { "a write of" } else { "a read into" };
    let file = match fgds::open_direct(path, write) {
        Ok(file) => file,
        Err(err) => {
            let reason = format!(
                "it cannot be opened with O_DIRECT ({err}): its file system takes no direct I/O"
            );
            let answer = Answer {
                direct: false,
                verdict: None,
                reason,
                members: Vec::new(),
            };
            return print_answer(path, what, &gpu.info().bdf, &answer, json);
        }
    };
    let verdict = buffer.check_file(&file, write)?;
    let members = if verdict.gate == fgds::gate::Gate::NoPci {
        buffer.check_members(&file, write)
    } else {
        Vec::new()
    };
    let all_direct = !members.is_empty()
        && members
            .iter()
            .all(|(_, v)| v.as_ref().is_ok_and(fgds::gate::Verdict::mapping_reaches));
    let (direct, reason) = if verdict.is_direct() {
        (true, verdict.explain())
    } else if all_direct {
        (
            true,
            format!(
                "fgds's own I/O cannot check a disk without a PCI device, so the data goes \
                 through the registration's mapped address, whose pages the kernel's P2PDMA \
                 checks take member by member: {}",
                fgds::gate::describe_members(&members)
            ),
        )
    } else if members.is_empty() {
        (false, verdict.explain())
    } else {
        (
            false,
            format!(
                "{}; its members: {}",
                verdict.explain(),
                fgds::gate::describe_members(&members)
            ),
        )
    };
    let answer = Answer {
        direct,
        verdict: Some(verdict),
        reason,
        members,
    };
    print_answer(path, what, &gpu.info().bdf, &answer, json)
}

/// What `fgds doctor FILE` found.
struct Answer {
    direct: bool,
    verdict: Option<fgds::gate::Verdict>,
    reason: String,
    members: Vec<(String, Result<fgds::gate::Verdict, String>)>,
}

fn print_answer(
    path: &std::path::Path,
    what: &str,
    gpu: &str,
    answer: &Answer,
    json: bool,
) -> anyhow::Result<()> {
    let route = if answer.direct { "direct" } else { "bounce" };
    if json {
        let members = answer
            .members
            .iter()
            .map(|(name, verdict)| match verdict {
                Ok(v) => serde_json::json!({
                    "name": name, "gate": v.gate.name(), "dma_device": v.dma_dev,
                }),
                Err(err) => serde_json::json!({ "name": name, "error": err }),
            })
            .collect::<Vec<_>>();
        let value = serde_json::json!({
            "file": path, "gpu": gpu, "write": what.starts_with("a write"), "path": route,
            "gate": answer.verdict.as_ref().map(|v| v.gate.name()),
            "dma_device": answer.verdict.as_ref().and_then(|v| v.dma_dev.clone()),
            "members": members,
            "reason": answer.reason,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else if answer.direct {
        println!(
            "{}: {what} GPU {gpu} memory goes direct: {}",
            path.display(),
            answer.reason
        );
    } else {
        println!(
            "{}: {what} GPU {gpu} memory goes through RAM (bounce): {}",
            path.display(),
            answer.reason
        );
    }
    Ok(())
}

/// A dma-buf to register: inherited, allocated from vgpu (kept alive by `owned`), or exported
/// from CUDA memory (kept allocated by `_cuda`: drop the registration first).
pub struct Dmabuf {
    owned: Option<OwnedFd>,
    raw: i32,
    _cuda: Option<fgds::cuda::DeviceMemory>,
}

impl Dmabuf {
    pub fn fd(&self) -> BorrowedFd<'_> {
        match &self.owned {
            Some(fd) => fd.as_fd(),
            // SAFETY: an inherited fd the user named; it stays open for the process's life.
            None => unsafe { BorrowedFd::borrow_raw(self.raw) },
        }
    }
}

/// The GPU and dma-buf a command works on.
pub fn resolve(source: &Source, len: u64) -> anyhow::Result<(Gpu, Dmabuf)> {
    if let Some(ordinal) = source.cuda {
        return resolve_cuda(ordinal, source.gpu.as_deref(), len);
    }
    let bdf = match &source.gpu {
        Some(bdf) => bdf.clone(),
        None => match Gpu::list()?.as_slice() {
            [only] => only.bdf.clone(),
            [] => bail!(
                "fgds serves no GPU: load the fgds module (with devices=<BDF> for a GPU that is not of display class)"
            ),
            many => bail!("fgds serves {} GPUs: name one with --gpu", many.len()),
        },
    };
    let gpu = Gpu::open(&bdf)?;
    let dmabuf = match (source.dmabuf_fd, source.vgpu) {
        (Some(raw), None) => Dmabuf {
            owned: None,
            raw,
            _cuda: None,
        },
        (None, Some(n)) => {
            let dev = fgds::vgpu::open(n)?;
            let (fd, _) = fgds::vgpu::alloc(&dev, len)?;
            Dmabuf {
                owned: Some(fd),
                raw: -1,
                _cuda: None,
            }
        }
        _ => bail!(
            "name the GPU memory: --cuda DEVICE (CUDA memory), --dmabuf-fd N (a dma-buf inherited from your GPU runtime) or --vgpu N (the rig's test exporter)"
        ),
    };
    Ok((gpu, dmabuf))
}

/// `len` bytes of CUDA memory on device `ordinal`, exported as a dma-buf, and the fgds node of
/// the same GPU.
fn resolve_cuda(ordinal: i32, gpu: Option<&str>, len: u64) -> anyhow::Result<(Gpu, Dmabuf)> {
    let cuda = fgds::cuda::Cuda::load()?;
    let device = cuda.device(ordinal)?;
    let bdf = device.pci_bus_id()?;
    if let Some(named) = gpu
        && named != bdf
    {
        bail!("--gpu {named} is not CUDA device {ordinal}, which is {bdf}: leave --gpu out");
    }
    let gpu = Gpu::open(&bdf).with_context(|| format!("CUDA device {ordinal} is GPU {bdf}"))?;
    let page = rustix::param::page_size() as u64;
    let len = len.div_ceil(page) * page;
    let memory = device
        .alloc(len)
        .with_context(|| format!("allocating {len} bytes on CUDA device {ordinal}"))?;
    let fd = device.export_dmabuf(memory.ptr(), len)?;
    Ok((
        gpu,
        Dmabuf {
            owned: Some(fd),
            raw: -1,
            _cuda: Some(memory),
        },
    ))
}
