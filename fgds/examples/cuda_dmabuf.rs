//! Exports CUDA memory as a dma-buf through `fgds::cuda` and checks what the kernel says of it
//! (`/proc/self/fdinfo`: exporter, size, O_RDWR), then registers it with fgds where the module
//! is loaded. One line per check in KTAP form; exit 0 only if every check passed.
//!
//! ```sh
//! cargo run --release -p fgds --example cuda_dmabuf -- [DEVICE] [MIB]
//! ```

use std::os::fd::AsFd;
use std::process::ExitCode;

use fgds::DmabufInfo;
use fgds::cuda::{Cuda, Device, DeviceMemory};

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let ordinal = args.next().map_or(Ok(0), |a| a.parse()).unwrap_or(-1);
    let mib: u64 = args.next().map_or(Ok(64), |a| a.parse()).unwrap_or(0);
    if ordinal < 0 || mib < 8 {
        eprintln!("usage: cuda_dmabuf [DEVICE] [MIB]  (DEVICE: a CUDA ordinal; MIB: 8 or more)");
        return ExitCode::from(2);
    }
    let mut checks = Checks::default();
    if let Err(err) = run(ordinal, mib << 20, &mut checks) {
        checks.record("setup", Err(format!("{err:#}")));
    }
    println!("1..{}", checks.count);
    println!(
        "# {} passed, {} failed, {} skipped",
        checks.passed, checks.failed, checks.skipped
    );
    if checks.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(ordinal: i32, len: u64, checks: &mut Checks) -> fgds::Result<()> {
    let cuda = Cuda::load()?;
    println!(
        "# CUDA driver {}, {} device(s)",
        cuda.driver_version()?,
        cuda.device_count()?
    );
    let device = cuda.device(ordinal)?;
    println!(
        "# device {ordinal}: {} at {}",
        device.name()?,
        device.pci_bus_id()?
    );
    let supported = device.dma_buf_supported()?;
    checks.record(
        "dma_buf_supported_attribute",
        expect(supported, "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED is 0"),
    );
    let memory = device.alloc(len)?;
    memory.fill(0xa5)?;
    println!("# {} MiB at {:#x}", len >> 20, memory.ptr());

    checks.record("export_whole_allocation", export(&device, &memory, 0, len));
    let two_mib = 2 << 20;
    checks.record(
        "export_inner_range",
        export(&device, &memory, two_mib, 4 << 20),
    );
    checks.record("misaligned_export_refused", misaligned(&device, &memory));
    checks.record("memory_intact_after_export", intact(&memory));
    match device.register(memory.ptr(), len) {
        Ok(buffer) => checks.record(
            "registered_with_fgds",
            expect(
                buffer.len() as u64 == len,
                &format!("the buffer is {} bytes, not {len}", buffer.len()),
            ),
        ),
        Err(err @ fgds::Error::NoSuchGpu { .. }) => {
            checks.skip("registered_with_fgds", &format!("{err}"))
        }
        Err(err) => checks.record("registered_with_fgds", Err(format!("{err}"))),
    }
    Ok(())
}

/// Exports `len` bytes at `offset` of `memory` and checks the dma-buf's fdinfo.
fn export(device: &Device, memory: &DeviceMemory, offset: u64, len: u64) -> Result<(), String> {
    let fd = device
        .export_dmabuf(memory.ptr() + offset, len)
        .map_err(|e| e.to_string())?;
    let info = DmabufInfo::of(fd.as_fd()).map_err(|e| e.to_string())?;
    println!(
        "# fd {fd:?}: exp_name {}, size {}, flags {:#o}",
        info.exporter, info.size, info.flags
    );
    if info.exporter != "nv_dmabuf" {
        return Err(format!("exporter {:?}, not nv_dmabuf", info.exporter));
    }
    if info.size != len {
        return Err(format!("size {}, not {len}", info.size));
    }
    expect(
        info.read_write(),
        &format!("flags {:#o} are not O_RDWR", info.flags),
    )
}

/// An address or length off the page size is refused before the driver is asked.
fn misaligned(device: &Device, memory: &DeviceMemory) -> Result<(), String> {
    for (ptr, len) in [
        (memory.ptr() + 512, 4 << 20),
        (memory.ptr(), (4 << 20) + 512),
        (memory.ptr(), 0),
    ] {
        match device.export_dmabuf(ptr, len) {
            Err(fgds::Error::Invalid(why)) => println!("# {ptr:#x}+{len:#x}: {why}"),
            Err(other) => return Err(format!("{ptr:#x}+{len:#x}: the wrong error: {other}")),
            Ok(_) => return Err(format!("{ptr:#x}+{len:#x} was exported")),
        }
    }
    Ok(())
}

fn intact(memory: &DeviceMemory) -> Result<(), String> {
    let mut head = vec![0u8; 4096];
    memory
        .copy_to_host(0, &mut head)
        .map_err(|e| e.to_string())?;
    expect(
        head.iter().all(|&b| b == 0xa5),
        "the memory no longer holds its fill",
    )
}

fn expect(ok: bool, why: &str) -> Result<(), String> {
    if ok { Ok(()) } else { Err(why.to_owned()) }
}

#[derive(Default)]
struct Checks {
    count: usize,
    passed: usize,
    failed: usize,
    skipped: usize,
}

impl Checks {
    fn record(&mut self, name: &str, res: Result<(), String>) {
        self.count += 1;
        match res {
            Ok(()) => {
                self.passed += 1;
                println!("ok {} {name}", self.count);
            }
            Err(why) => {
                self.failed += 1;
                println!("not ok {} {name}", self.count);
                println!("# {why}");
            }
        }
    }

    fn skip(&mut self, name: &str, why: &str) {
        self.count += 1;
        self.skipped += 1;
        println!("ok {} {name} # SKIP {why}", self.count);
    }
}
