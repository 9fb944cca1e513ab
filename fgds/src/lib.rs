//! Direct I/O between NVMe and GPU memory, through the fgds kernel driver.
//!
//! A GPU's driver exports a buffer of its memory as a dma-buf; fgds registers it and maps it
//! into the process, and the mapped address is an ordinary user pointer that `pread(2)`,
//! `pwrite(2)` and io_uring on an `O_DIRECT` file can DMA into and out of, without a copy
//! through host RAM.
//!
//! ```no_run
//! # fn dmabuf_from_gpu_runtime() -> std::os::fd::OwnedFd { unimplemented!() }
//! use std::os::fd::AsFd;
//! use fgds::{Direction, Gpu, Transfer, TransferConfig};
//!
//! let gpu = Gpu::open("0000:03:00.0")?;
//! let dmabuf = dmabuf_from_gpu_runtime();
//! let buffer = gpu.register(dmabuf.as_fd(), 0, 256 << 20)?;
//! let file = fgds::open_direct("/data/model.safetensors".as_ref(), false)?;
//! let mut transfer = Transfer::new(TransferConfig::DEFAULT)?;
//! transfer.run(Direction::Read, &buffer, 0..buffer.len(), &file, 0)?;
//! # Ok::<(), fgds::Error>(())
//! ```

mod buffer;
mod cpu_mapping;
pub mod cuda;
mod dmabuf;
pub mod doctor;
mod error;
pub mod gate;
mod gpu;
mod gpu_file;
pub mod memory;
mod transfer;
pub mod uapi;
pub mod upstream;
pub mod vgpu;

pub use buffer::{Buffer, dio_alignment, open_direct};
pub use cpu_mapping::CpuMapping;
pub use dmabuf::DmabufInfo;
pub use error::{Error, Result};
pub use gpu::{Gpu, GpuInfo, SYSFS_CLASS};
pub use gpu_file::{Completion, Fallback, GpuFile, IoPath, Options};
pub use memory::{GpuMemory, NotDirect, Registry};
pub use transfer::{Direction, Transfer, TransferConfig, TransferPath};
