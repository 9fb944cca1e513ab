//! GPU memory of any origin for [`crate::GpuFile`]: a CUDA allocation or a range of a dma-buf,
//! each with its fgds registration where there can be one, or the reason there is none, and the
//! copies through host RAM that the fallback uses where there is none.
//!
//! CUDA registrations are cached per allocation ([`Registry`]): the first transfer into an
//! allocation exports the whole of it as a dma-buf and registers it with the fgds node of its
//! GPU; later transfers into any part of it reuse that. An entry is keyed by CUDA's allocation
//! id (`CU_POINTER_ATTRIBUTE_BUFFER_ID`, never reused in a process), and dropped as soon as
//! its address no longer belongs to that allocation (freed, or reused by another), so a
//! registration never outlives its memory's identity. A dma-buf's registration belongs to its
//! [`DmabufMemory`] and goes with it.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

use crate::buffer::Buffer;
use crate::cpu_mapping::{self, CpuMapping};
use crate::cuda::{self, DevicePtr};
use crate::dmabuf::DmabufInfo;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// GPU memory that [`crate::GpuFile`] reads into and writes from.
pub trait GpuMemory: Send + Sync {
    /// Its length in bytes.
    fn len(&self) -> u64;

    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The fgds registration that covers it, or why there is none.
    fn direct(&self) -> std::result::Result<DirectRange, NotDirect>;

    /// The dma-buf that holds it and the byte of the dma-buf where it starts, for the kernel's
    /// own dma-buf registered buffers (`crate::upstream`); `None` where the process holds no
    /// dma-buf of it.
    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        None
    }

    /// Where the fallback stages data in host RAM on its way to or from this memory.
    fn staging(&self) -> Result<Arc<StagingPool>>;

    /// Copies `src` from host RAM to `offset` of the memory.
    fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()>;

    /// Copies from `offset` of the memory to `dst` in host RAM.
    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()>;

    /// One line for messages: what memory this is.
    fn describe(&self) -> String;

    /// Waits for the work the GPU runtime has queued that may use the memory, before a
    /// transfer moves data behind the runtime's back (CUDA: `cuCtxSynchronize`).
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// A registration that covers some GPU memory: the memory's first byte is at `offset` of
/// `buffer`.
#[derive(Clone)]
pub struct DirectRange {
    pub buffer: Arc<Buffer>,
    pub offset: u64,
    /// The GPU (PCI address) whose fgds node holds the registration.
    pub gpu: String,
}

impl fmt::Debug for DirectRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirectRange")
            .field("idx", &self.buffer.idx())
            .field("len", &self.buffer.len())
            .field("offset", &self.offset)
            .field("gpu", &self.gpu)
            .finish()
    }
}

/// Why the direct path is not there: an errno naming the obstacle and a sentence saying what
/// it is and what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotDirect {
    pub errno: i32,
    pub reason: String,
}

impl NotDirect {
    pub fn new(errno: i32, reason: impl Into<String>) -> NotDirect {
        NotDirect {
            errno,
            reason: reason.into(),
        }
    }

    fn from_error(err: &Error) -> NotDirect {
        NotDirect::new(err.errno(), err.to_string())
    }
}

/// Page-aligned anonymous host RAM.
struct HostRam {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: plain process memory with no thread affinity; `&HostRam` gives shared slices only.
unsafe impl Send for HostRam {}
// SAFETY: as above.
unsafe impl Sync for HostRam {}

impl HostRam {
    fn new(len: usize) -> Result<HostRam> {
        // SAFETY: a new private anonymous mapping at an address of the kernel's choosing
        // aliases no Rust object.
        let ptr = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|errno| Error::Io {
            op: "mmap of a staging buffer",
            done: 0,
            len: len as u64,
            source: errno.into(),
        })?;
        Ok(HostRam {
            ptr: NonNull::new(ptr.cast()).expect("mmap returned NULL"),
            len,
        })
    }
}

impl Drop for HostRam {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`; no slice of it outlives `self`.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// What pins a staging buffer for a GPU runtime's copies (CUDA: `cuMemHostRegister`); called
/// once per buffer, its result dropped before the buffer.
pub type PinFn = dyn Fn(*mut u8, usize) -> Result<Box<dyn Any + Send + Sync>> + Send + Sync;

/// One staging buffer; `pin` is declared first so that it is dropped before `ram`.
struct Staging {
    _pin: Option<Box<dyn Any + Send + Sync>>,
    ram: HostRam,
}

/// Staging buffers of one size in host RAM, reused across transfers; pinned for a runtime's
/// copies where one asks for it.
pub struct StagingPool {
    chunk: usize,
    idle: Mutex<Vec<Staging>>,
    pin: Option<Box<PinFn>>,
}

/// Buffers kept for reuse; more are made while transfers need them and freed when returned.
const IDLE_STAGING: usize = 6;

impl StagingPool {
    /// A pool of `chunk`-byte buffers, each pinned with `pin` when made.
    pub fn new(chunk: usize, pin: Option<Box<PinFn>>) -> Arc<StagingPool> {
        Arc::new(StagingPool {
            chunk,
            idle: Mutex::new(Vec::new()),
            pin,
        })
    }

    /// The bytes of each buffer.
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// A buffer for this caller alone, back in the pool when the lease is dropped.
    pub fn lease(self: &Arc<Self>) -> Result<Lease> {
        let reused = self.idle.lock().expect("staging pool lock").pop();
        let staging = match reused {
            Some(staging) => staging,
            None => {
                let ram = HostRam::new(self.chunk)?;
                let pin = match &self.pin {
                    Some(pin) => Some(pin(ram.ptr.as_ptr(), ram.len)?),
                    None => None,
                };
                Staging { _pin: pin, ram }
            }
        };
        Ok(Lease {
            pool: Arc::clone(self),
            staging: Some(staging),
        })
    }
}

/// A staging buffer leased from a [`StagingPool`]: host RAM, a plain byte slice.
pub struct Lease {
    pool: Arc<StagingPool>,
    staging: Option<Staging>,
}

impl Deref for Lease {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        let ram = &self.staging.as_ref().expect("leased").ram;
        // SAFETY: the mapping is `len` readable bytes owned by this lease until it is dropped.
        unsafe { std::slice::from_raw_parts(ram.ptr.as_ptr(), ram.len) }
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut [u8] {
        let ram = &self.staging.as_ref().expect("leased").ram;
        // SAFETY: as in `deref`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(ram.ptr.as_ptr(), ram.len) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(staging) = self.staging.take() {
            let mut idle = self.pool.idle.lock().expect("staging pool lock");
            if idle.len() < IDLE_STAGING {
                idle.push(staging);
            }
        }
    }
}

/// Staging buffers for CUDA copies (pinned): 16 MiB each.
const CUDA_CHUNK: usize = 16 << 20;
/// Staging buffers for copies through a dma-buf's CPU mapping: 4 MiB each.
const DMABUF_CHUNK: usize = 4 << 20;
/// CUDA allocations whose registration (or reason for none) is kept.
const CUDA_CACHE: usize = 64;

/// A registration of a whole CUDA allocation, or why there is none.
#[derive(Clone)]
struct CudaEntry {
    ordinal: i32,
    buffer_id: u64,
    base: DevicePtr,
    /// The registered part: device addresses `start..start + len`.
    registration: std::result::Result<(Arc<Buffer>, DevicePtr, String), NotDirect>,
}

/// The process's CUDA driver, fgds nodes, registration cache and staging pools.
#[derive(Default)]
pub struct Registry {
    cuda: OnceLock<std::result::Result<cuda::Cuda, NotDirect>>,
    devices: Mutex<HashMap<i32, cuda::Device>>,
    gpus: Mutex<HashMap<String, Arc<Gpu>>>,
    cuda_regs: Mutex<Vec<CudaEntry>>,
    cuda_staging: Mutex<HashMap<i32, Arc<StagingPool>>>,
    dmabuf_staging: OnceLock<Arc<StagingPool>>,
    doctor: OnceLock<String>,
}

impl Registry {
    pub fn new() -> Registry {
        Registry::default()
    }

    /// The CUDA driver, loaded once.
    pub fn cuda(&self) -> Result<cuda::Cuda> {
        let loaded = self
            .cuda
            .get_or_init(|| cuda::Cuda::load().map_err(|err| NotDirect::from_error(&err)));
        match loaded {
            Ok(cuda) => Ok(cuda.clone()),
            Err(not) => Err(Error::Refused {
                errno: not.errno,
                reason: not.reason.clone(),
            }),
        }
    }

    fn device(&self, ordinal: i32) -> Result<cuda::Device> {
        let mut devices = self.devices.lock().expect("registry lock");
        if let Some(device) = devices.get(&ordinal) {
            return Ok(device.clone());
        }
        let device = self.cuda()?.device(ordinal)?;
        devices.insert(ordinal, device.clone());
        Ok(device)
    }

    /// The fgds node of GPU `bdf`, opened once.
    pub fn gpu(&self, bdf: &str) -> Result<Arc<Gpu>> {
        let mut gpus = self.gpus.lock().expect("registry lock");
        if let Some(gpu) = gpus.get(bdf) {
            return Ok(Arc::clone(gpu));
        }
        let gpu = Arc::new(Gpu::open(bdf)?);
        gpus.insert(bdf.to_owned(), Arc::clone(&gpu));
        Ok(gpu)
    }

    /// What `fgds doctor` finds in the way of the direct path on this machine, in one line
    /// (asked once).
    pub fn doctor_blockers(&self) -> String {
        self.doctor
            .get_or_init(|| {
                let report = crate::doctor::examine(
                    Path::new("/"),
                    &crate::doctor::Identity::current(),
                    crate::doctor::cuda_devices(),
                );
                if report.verdict.blockers.is_empty() {
                    "fgds doctor sees nothing else in the way".to_owned()
                } else {
                    format!("fgds doctor: {}", report.verdict.blockers.join("; "))
                }
            })
            .clone()
    }

    /// Drops every cached registration (each goes once no transfer uses it); returns how many.
    pub fn clear_cache(&self) -> usize {
        let mut regs = self.cuda_regs.lock().expect("registry lock");
        let n = regs.len();
        regs.clear();
        n
    }

    /// CUDA allocations with a cached registration (or a cached reason for none).
    pub fn cached(&self) -> usize {
        self.cuda_regs.lock().expect("registry lock").len()
    }

    /// `len` bytes of CUDA device memory at `ptr`, inside one allocation. Its registration
    /// comes from the cache, or is made (the whole allocation, exported as a dma-buf) and
    /// cached; where it cannot be, [`GpuMemory::direct`] says why.
    ///
    /// # Safety
    ///
    /// The allocation must stay allocated while the returned value is used for transfers:
    /// its copies write to `ptr` with CUDA.
    pub unsafe fn cuda_memory(&self, ptr: DevicePtr, len: u64) -> Result<CudaMemory> {
        let cuda = self.cuda()?;
        let info = cuda.pointer(ptr)?;
        let end = ptr.checked_add(len);
        if end.is_none_or(|end| end > info.base + info.len) {
            return Err(Error::Invalid(format!(
                "{len} bytes at {ptr:#x} run past the end of their CUDA allocation ({:#x}, {} bytes)",
                info.base, info.len
            )));
        }
        let device = self.device(info.ordinal)?;
        let entry = self.cuda_entry(&cuda, &device, &info);
        let direct = entry.registration.and_then(|(buffer, start, gpu)| {
            let reg_end = start + buffer.len() as u64;
            if ptr < start || ptr + len > reg_end {
                return Err(NotDirect::new(
                    libc::EINVAL,
                    format!(
                        "{len} bytes at {ptr:#x} are not all inside the whole pages of their allocation \
                         ({:#x}, {} bytes), which is all a dma-buf export covers: allocate with \
                         cudaMalloc (2 MiB aligned) or align tensors to 4 KiB",
                        info.base, info.len
                    ),
                ));
            }
            Ok(DirectRange {
                buffer,
                offset: ptr - start,
                gpu,
            })
        });
        let staging = self.cuda_staging(&device);
        Ok(CudaMemory {
            device,
            ptr,
            len,
            direct,
            staging,
        })
    }

    fn cuda_staging(&self, device: &cuda::Device) -> Arc<StagingPool> {
        let mut pools = self.cuda_staging.lock().expect("registry lock");
        let pool = pools.entry(device.ordinal()).or_insert_with(|| {
            let device = device.clone();
            StagingPool::new(
                CUDA_CHUNK,
                Some(Box::new(move |ptr, len| {
                    // SAFETY: the staging buffer's mapping outlives the registration, which
                    // `Staging` drops first.
                    let pinned = unsafe { device.register_host(ptr, len) }?;
                    Ok(Box::new(pinned) as Box<dyn Any + Send + Sync>)
                })),
            )
        });
        Arc::clone(pool)
    }

    /// The cached entry of `info`'s allocation, after dropping entries whose address no
    /// longer belongs to the allocation they were made for; a new one if there is none.
    fn cuda_entry(
        &self,
        cuda: &cuda::Cuda,
        device: &cuda::Device,
        info: &cuda::PointerInfo,
    ) -> CudaEntry {
        let mut regs = self.cuda_regs.lock().expect("registry lock");
        regs.retain(|e| cuda.buffer_id(e.base) == Some(e.buffer_id));
        if let Some(at) = regs
            .iter()
            .position(|e| e.ordinal == info.ordinal && e.buffer_id == info.buffer_id)
        {
            // Most recently used last.
            let entry = regs.remove(at);
            regs.push(entry.clone());
            return entry;
        }
        let entry = CudaEntry {
            ordinal: info.ordinal,
            buffer_id: info.buffer_id,
            base: info.base,
            registration: self.register_cuda(device, info),
        };
        // A transient shortage is not remembered: the next transfer tries again.
        let transient = matches!(
            &entry.registration,
            Err(n) if [libc::EMFILE, libc::ENOSPC, libc::ENOMEM, libc::EBUSY].contains(&n.errno)
        );
        if !transient {
            if regs.len() >= CUDA_CACHE {
                regs.remove(0);
            }
            regs.push(entry.clone());
        }
        entry
    }

    fn register_cuda(
        &self,
        device: &cuda::Device,
        info: &cuda::PointerInfo,
    ) -> std::result::Result<(Arc<Buffer>, DevicePtr, String), NotDirect> {
        if info.managed {
            return Err(NotDirect::new(
                libc::EOPNOTSUPP,
                "CUDA managed (unified) memory cannot be exported as a dma-buf: allocate with cudaMalloc",
            ));
        }
        let page = rustix::param::page_size() as u64;
        let start = info.base.next_multiple_of(page);
        let end = (info.base + info.len) / page * page;
        if end <= start {
            return Err(NotDirect::new(
                libc::EINVAL,
                format!(
                    "the CUDA allocation at {:#x} ({} bytes) holds no whole page to export as a dma-buf",
                    info.base, info.len
                ),
            ));
        }
        match device.dma_buf_supported() {
            Ok(true) => {}
            Ok(false) => {
                return Err(NotDirect::from_error(&Error::CudaNoDmabuf {
                    ordinal: device.ordinal(),
                }));
            }
            Err(err) => return Err(NotDirect::from_error(&err)),
        }
        let bdf = device
            .pci_bus_id()
            .map_err(|err| NotDirect::from_error(&err))?;
        let gpu = self.gpu(&bdf).map_err(|err| {
            NotDirect::new(
                err.errno(),
                format!(
                    "CUDA device {} is GPU {bdf}: {err} ({})",
                    device.ordinal(),
                    self.doctor_blockers()
                ),
            )
        })?;
        let dmabuf = device
            .export_dmabuf(start, end - start)
            .map_err(|err| NotDirect::from_error(&err))?;
        let buffer = gpu
            .register(dmabuf.as_fd(), 0, end - start)
            .map_err(|err| NotDirect::new(err.errno(), format!("GPU {bdf}: {err}")))?;
        Ok((Arc::new(buffer), start, bdf))
    }

    fn dmabuf_staging(&self) -> Arc<StagingPool> {
        Arc::clone(
            self.dmabuf_staging
                .get_or_init(|| StagingPool::new(DMABUF_CHUNK, None)),
        )
    }

    /// `len` bytes at `offset` of the dma-buf `dmabuf`, registered (the whole dma-buf) with
    /// the fgds node of GPU `gpu`, or of the first GPU fgds serves that accepts it; where none
    /// does, [`GpuMemory::direct`] says why, and the fallback copies through the dma-buf's CPU
    /// mapping. The fd is duplicated: the caller may close its own.
    pub fn dmabuf_memory(
        &self,
        dmabuf: BorrowedFd<'_>,
        offset: u64,
        len: u64,
        gpu: Option<&str>,
    ) -> Result<DmabufMemory> {
        let info = DmabufInfo::of(dmabuf).map_err(|_| {
            Error::Invalid(format!(
                "fd {} is not a dma-buf: pass the fd a GPU runtime exported (cuMemGetHandleForAddressRange, a DRM PRIME export)",
                dmabuf.as_raw_fd()
            ))
        })?;
        if offset.checked_add(len).is_none_or(|end| end > info.size) {
            return Err(Error::Invalid(format!(
                "{len} bytes at offset {offset} run past the end of the {}-byte dma-buf",
                info.size
            )));
        }
        let fd = dmabuf.try_clone_to_owned().map_err(|source| Error::Io {
            op: "dup of the dma-buf fd",
            done: 0,
            len: 0,
            source,
        })?;
        let direct = self.register_dmabuf(fd.as_fd(), &info, gpu);
        let direct = direct.map(|(buffer, gpu)| DirectRange {
            buffer,
            offset,
            gpu,
        });
        Ok(DmabufMemory {
            fd,
            offset,
            len,
            exporter: info.exporter,
            direct,
            map: Mutex::new(None),
            staging: self.dmabuf_staging(),
        })
    }

    fn register_dmabuf(
        &self,
        fd: BorrowedFd<'_>,
        info: &DmabufInfo,
        gpu: Option<&str>,
    ) -> std::result::Result<(Arc<Buffer>, String), NotDirect> {
        let candidates = match gpu {
            Some(bdf) => vec![bdf.to_owned()],
            None => Gpu::list()
                .map_err(|err| NotDirect::from_error(&err))?
                .into_iter()
                .map(|g| g.bdf)
                .collect(),
        };
        if candidates.is_empty() {
            return Err(NotDirect::new(
                libc::ENODEV,
                format!("fgds serves no GPU ({})", self.doctor_blockers()),
            ));
        }
        let mut refusals = Vec::new();
        for bdf in candidates {
            let gpu = match self.gpu(&bdf) {
                Ok(gpu) => gpu,
                Err(err) => {
                    refusals.push(NotDirect::new(err.errno(), format!("GPU {bdf}: {err}")));
                    continue;
                }
            };
            match gpu.register(fd, 0, info.size) {
                Ok(buffer) => return Ok((Arc::new(buffer), bdf)),
                Err(err) => refusals.push(NotDirect::new(err.errno(), format!("GPU {bdf}: {err}"))),
            }
        }
        // A refusal other than "not this GPU's memory" is the one that matters.
        let errno = refusals
            .iter()
            .map(|r| r.errno)
            .find(|&e| e != libc::EINVAL)
            .unwrap_or(libc::EINVAL);
        let reasons = refusals
            .into_iter()
            .map(|r| r.reason)
            .collect::<Vec<_>>()
            .join("; ");
        Err(NotDirect::new(
            errno,
            format!(
                "fgds did not register the dma-buf (exporter {}): {reasons}",
                info.exporter
            ),
        ))
    }
}

/// CUDA device memory ([`Registry::cuda_memory`]).
pub struct CudaMemory {
    device: cuda::Device,
    ptr: DevicePtr,
    len: u64,
    direct: std::result::Result<DirectRange, NotDirect>,
    staging: Arc<StagingPool>,
}

impl CudaMemory {
    fn check(&self, offset: u64, len: usize) -> Result<()> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::Invalid(format!(
                "{len} bytes at offset {offset} are outside the {}-byte CUDA memory",
                self.len
            )));
        }
        Ok(())
    }
}

impl GpuMemory for CudaMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn direct(&self) -> std::result::Result<DirectRange, NotDirect> {
        self.direct.clone()
    }

    fn staging(&self) -> Result<Arc<StagingPool>> {
        Ok(Arc::clone(&self.staging))
    }

    fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: the range is inside the allocation (checked above and by `cuda_memory`),
        // which the caller of `cuda_memory` keeps allocated.
        unsafe { self.device.copy_to_device(self.ptr + offset, src) }
    }

    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: as in `copy_in`.
        unsafe { self.device.copy_from_device(dst, self.ptr + offset) }
    }

    fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }

    fn describe(&self) -> String {
        format!(
            "{} bytes of CUDA memory at {:#x} on device {}",
            self.len,
            self.ptr,
            self.device.ordinal()
        )
    }
}

/// A range of a dma-buf ([`Registry::dmabuf_memory`]).
pub struct DmabufMemory {
    fd: OwnedFd,
    offset: u64,
    len: u64,
    exporter: String,
    direct: std::result::Result<DirectRange, NotDirect>,
    /// The CPU mapping of the pages that hold the range, with the offset of the range in it;
    /// made on the fallback's first use.
    map: Mutex<Option<Arc<(CpuMapping, usize)>>>,
    staging: Arc<StagingPool>,
}

impl DmabufMemory {
    /// The dma-buf's exporter (`vgpu`, `udmabuf`, `nv_dmabuf`, ...).
    pub fn exporter(&self) -> &str {
        &self.exporter
    }

    /// The dma-buf (this value's own duplicate of the fd).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    fn mapping(&self, offset: u64, len: usize) -> Result<Arc<(CpuMapping, usize)>> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(Error::Invalid(format!(
                "{len} bytes at offset {offset} are outside the {}-byte dma-buf range",
                self.len
            )));
        }
        let mut map = self.map.lock().expect("mapping lock");
        if let Some(map) = &*map {
            return Ok(Arc::clone(map));
        }
        let page = rustix::param::page_size() as u64;
        let start = self.offset / page * page;
        let mapped = CpuMapping::new_at(
            self.fd.as_fd(),
            start,
            (self.offset + self.len - start) as usize,
        )
        .map_err(|err| Error::Refused {
            errno: err.errno(),
            reason: format!(
                "the dma-buf (exporter {}) has no CPU mapping for the fallback's copies: {err}",
                self.exporter
            ),
        })?;
        let made = Arc::new((mapped, (self.offset - start) as usize));
        *map = Some(Arc::clone(&made));
        Ok(made)
    }
}

impl GpuMemory for DmabufMemory {
    fn len(&self) -> u64 {
        self.len
    }

    fn direct(&self) -> std::result::Result<DirectRange, NotDirect> {
        self.direct.clone()
    }

    fn dmabuf(&self) -> Option<(BorrowedFd<'_>, u64)> {
        Some((self.fd.as_fd(), self.offset))
    }

    fn staging(&self) -> Result<Arc<StagingPool>> {
        Ok(Arc::clone(&self.staging))
    }

    fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()> {
        let map = self.mapping(offset, src.len())?;
        let flags = cpu_mapping::SYNC_WRITE;
        cpu_mapping::dmabuf_sync(self.fd.as_fd(), flags)?;
        map.0.copy_in(map.1 + offset as usize, src);
        cpu_mapping::dmabuf_sync(self.fd.as_fd(), flags | cpu_mapping::SYNC_END)
    }

    fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let map = self.mapping(offset, dst.len())?;
        let flags = cpu_mapping::SYNC_READ;
        cpu_mapping::dmabuf_sync(self.fd.as_fd(), flags)?;
        map.0.copy_out(map.1 + offset as usize, dst);
        cpu_mapping::dmabuf_sync(self.fd.as_fd(), flags | cpu_mapping::SYNC_END)
    }

    fn describe(&self) -> String {
        format!(
            "{} bytes at offset {} of a dma-buf (exporter {})",
            self.len, self.offset, self.exporter
        )
    }
}
