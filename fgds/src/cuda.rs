//! CUDA memory as dma-bufs, through the CUDA driver API loaded at run time.
//!
//! `libcuda.so.1` (the NVIDIA driver's user-space library) is opened with `dlopen` when
//! [`Cuda::load`] is called: the crate has no build dependency on CUDA, and a machine without
//! it gets [`Error::CudaUnavailable`] saying so. A CUDA allocation (a device pointer and a
//! length, from `cuMemAlloc`, `cudaMalloc` or [`Device::alloc`]) is exported as a dma-buf with
//! `cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`, which the
//! NVIDIA open kernel module supports (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`), and registered
//! with the fgds node of the same GPU, found by its PCI bus id.
//!
//! ```no_run
//! let cuda = fgds::cuda::Cuda::load()?;
//! let device = cuda.device(0)?;
//! let memory = device.alloc(256 << 20)?;
//! let buffer = device.register(memory.ptr(), memory.len())?;
//! let file = fgds::open_direct("/data/model.bin".as_ref(), false)?;
//! buffer.read_at(&file, 0, 0..buffer.len())?;
//! // `buffer` (the registration) goes before `memory` (the allocation).
//! drop(buffer);
//! # Ok::<(), fgds::Error>(())
//! ```
//!
//! Every call makes the device's primary context (the one the CUDA runtime uses too) current
//! on the calling thread first.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// The library `dlopen` looks for: the driver's, not the toolkit's stub.
pub const LIBCUDA: &str = "libcuda.so.1";

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
/// A CUDA device address (`CUdeviceptr`).
pub type DevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
const ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (a `CUmemorytype`, `unsigned int`).
const POINTER_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_BUFFER_ID` (`unsigned long long`): unique per allocation in the
/// process, never reused.
const POINTER_BUFFER_ID: c_int = 7;
/// `CU_POINTER_ATTRIBUTE_IS_MANAGED` (`unsigned int`, as a bool).
const POINTER_IS_MANAGED: c_int = 8;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (`int`).
const POINTER_DEVICE_ORDINAL: c_int = 9;
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` (`CUdeviceptr`): the allocation's first byte.
const POINTER_RANGE_START: c_int = 11;
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE` (`size_t`): the allocation's length.
const POINTER_RANGE_SIZE: c_int = 12;
/// `CU_MEMORYTYPE_DEVICE`.
const MEMORYTYPE_DEVICE: c_uint = 2;

/// The driver API entry points fgds uses, resolved once.
struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> CuResult,
    device_get_pci_bus_id: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut DevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(DevicePtr) -> CuResult,
    memset_d8: unsafe extern "C" fn(DevicePtr, u8, usize) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, DevicePtr, usize) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(DevicePtr, *const c_void, usize) -> CuResult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    get_handle_for_address_range:
        unsafe extern "C" fn(*mut c_void, DevicePtr, usize, c_int, u64) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, DevicePtr) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    /// Keeps the library, and so every pointer above, loaded.
    _lib: libloading::Library,
}

impl Api {
    fn load() -> Result<Api> {
        // SAFETY: loading libcuda runs its initializers, which have no preconditions on the
        // process (CUDA documents dlopen of libcuda.so.1 as a supported way to use it).
        let lib =
            unsafe { libloading::Library::new(LIBCUDA) }.map_err(|err| Error::CudaUnavailable {
                reason: err.to_string(),
            })?;
        /// Resolves `name` as a function of the type of the field it is stored in.
        macro_rules! sym {
            ($name:literal) => {{
                // SAFETY: the type is the field's, which spells the C prototype of `$name` as
                // cuda.h declares it (for the `_v2` names: the ones cuda.h maps the plain
                // names to); the pointer is used only while `_lib` keeps the library loaded.
                let symbol = unsafe { lib.get(concat!($name, "\0").as_bytes()) };
                *symbol.map_err(|err| Error::CudaUnavailable {
                    reason: format!(
                        "{LIBCUDA} has no {}: {err} (a driver older than CUDA 11.7?)",
                        $name
                    ),
                })?
            }};
        }
        Ok(Api {
            init: sym!("cuInit"),
            driver_get_version: sym!("cuDriverGetVersion"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            device_get_name: sym!("cuDeviceGetName"),
            device_get_attribute: sym!("cuDeviceGetAttribute"),
            device_get_pci_bus_id: sym!("cuDeviceGetPCIBusId"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: sym!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_synchronize: sym!("cuCtxSynchronize"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            memset_d8: sym!("cuMemsetD8_v2"),
            memcpy_dtoh: sym!("cuMemcpyDtoH_v2"),
            memcpy_htod: sym!("cuMemcpyHtoD_v2"),
            mem_host_register: sym!("cuMemHostRegister_v2"),
            mem_host_unregister: sym!("cuMemHostUnregister"),
            get_handle_for_address_range: sym!("cuMemGetHandleForAddressRange"),
            pointer_get_attribute: sym!("cuPointerGetAttribute"),
            get_error_name: sym!("cuGetErrorName"),
            get_error_string: sym!("cuGetErrorString"),
            _lib: lib,
        })
    }

    /// `Ok` for `CUDA_SUCCESS`, else an error naming the call, the CUDA error and a hint.
    fn check(&self, call: &'static str, res: CuResult) -> Result<()> {
        if res == CUDA_SUCCESS {
            return Ok(());
        }
        let text = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
            let mut ptr: *const c_char = std::ptr::null();
            // SAFETY: the driver stores a pointer to a static string, or leaves it untouched
            // and returns an error for an unknown code.
            let ok = unsafe { f(res, &mut ptr) } == CUDA_SUCCESS && !ptr.is_null();
            if !ok {
                return None;
            }
            // SAFETY: on success `ptr` is a NUL-terminated string the driver never frees.
            let text = unsafe { CStr::from_ptr(ptr) };
            Some(text.to_string_lossy().into_owned())
        };
        Err(Error::Cuda {
            call,
            code: res,
            name: text(self.get_error_name).unwrap_or_else(|| "CUDA_ERROR_UNKNOWN".to_owned()),
            text: text(self.get_error_string).unwrap_or_else(|| "unknown error".to_owned()),
        })
    }
}

/// The CUDA driver, loaded and initialised.
#[derive(Clone)]
pub struct Cuda {
    api: Arc<Api>,
}

impl Cuda {
    /// Loads `libcuda.so.1` and calls `cuInit`. [`Error::CudaUnavailable`] where the library
    /// is not installed (or too old); [`Error::Cuda`] where the driver does not start (no GPU,
    /// a kernel module that does not match the library).
    pub fn load() -> Result<Cuda> {
        let api = Api::load()?;
        // SAFETY: cuInit takes flags (0) and may be called any number of times.
        api.check("cuInit", unsafe { (api.init)(0) })?;
        Ok(Cuda { api: Arc::new(api) })
    }

    /// The driver's CUDA version, e.g. 13000 for 13.0.
    pub fn driver_version(&self) -> Result<i32> {
        let mut version = 0;
        // SAFETY: writes one int.
        let res = unsafe { (self.api.driver_get_version)(&mut version) };
        self.api.check("cuDriverGetVersion", res)?;
        Ok(version)
    }

    /// How many CUDA devices this process sees.
    pub fn device_count(&self) -> Result<i32> {
        let mut count = 0;
        // SAFETY: writes one int.
        let res = unsafe { (self.api.device_get_count)(&mut count) };
        self.api.check("cuDeviceGetCount", res)?;
        Ok(count)
    }

    /// CUDA device `ordinal` (as `nvidia-smi -L` and `CUDA_VISIBLE_DEVICES` number them), with
    /// its primary context retained for as long as the [`Device`] or memory of it lives.
    pub fn device(&self, ordinal: i32) -> Result<Device> {
        let api = &self.api;
        let mut dev: CuDevice = 0;
        // SAFETY: writes one CUdevice.
        api.check("cuDeviceGet", unsafe {
            (api.device_get)(&mut dev, ordinal)
        })?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: writes one CUcontext; released in `Context::drop`.
        let res = unsafe { (api.primary_ctx_retain)(&mut ctx, dev) };
        api.check("cuDevicePrimaryCtxRetain", res)?;
        Ok(Device {
            ordinal,
            context: Arc::new(Context {
                api: Arc::clone(api),
                dev,
                ctx,
            }),
        })
    }

    /// What CUDA knows of the device address `ptr`: the device and the allocation it lies in.
    /// An address that is not CUDA device memory (host memory, a freed allocation, a number
    /// that is no address) is an error saying so.
    pub fn pointer(&self, ptr: DevicePtr) -> Result<PointerInfo> {
        let api = &self.api;
        /// One attribute of `ptr`, of the type CUDA documents for it.
        fn attribute<T: Default>(api: &Api, attr: c_int, ptr: DevicePtr) -> (CuResult, T) {
            let mut value = T::default();
            // SAFETY: `T` is the type CUDA writes for `attr` (the constants above say which);
            // the driver writes one value of it.
            let res =
                unsafe { (api.pointer_get_attribute)((&mut value as *mut T).cast(), attr, ptr) };
            (res, value)
        }
        let (res, memory_type) = attribute::<c_uint>(api, POINTER_MEMORY_TYPE, ptr);
        if res != CUDA_SUCCESS {
            return Err(Error::Invalid(format!(
                "{ptr:#x} is not CUDA memory (cuPointerGetAttribute: CUDA error {res}): pass a device pointer of a live allocation"
            )));
        }
        if memory_type != MEMORYTYPE_DEVICE {
            return Err(Error::Invalid(format!(
                "{ptr:#x} is CUDA host memory (CUmemorytype {memory_type}), not device memory"
            )));
        }
        let (res, ordinal) = attribute::<c_int>(api, POINTER_DEVICE_ORDINAL, ptr);
        api.check("cuPointerGetAttribute(DEVICE_ORDINAL)", res)?;
        let (res, buffer_id) = attribute::<u64>(api, POINTER_BUFFER_ID, ptr);
        api.check("cuPointerGetAttribute(BUFFER_ID)", res)?;
        let (res, managed) = attribute::<c_uint>(api, POINTER_IS_MANAGED, ptr);
        api.check("cuPointerGetAttribute(IS_MANAGED)", res)?;
        let (res, base) = attribute::<DevicePtr>(api, POINTER_RANGE_START, ptr);
        api.check("cuPointerGetAttribute(RANGE_START_ADDR)", res)?;
        let (res, len) = attribute::<usize>(api, POINTER_RANGE_SIZE, ptr);
        api.check("cuPointerGetAttribute(RANGE_SIZE)", res)?;
        Ok(PointerInfo {
            ordinal,
            buffer_id,
            managed: managed != 0,
            base,
            len: len as u64,
        })
    }

    /// The allocation id of `ptr` now, or `None` where it is no longer CUDA memory: a cached
    /// registration is stale when this differs from the id it was made for.
    pub fn buffer_id(&self, ptr: DevicePtr) -> Option<u64> {
        let mut id = 0u64;
        // SAFETY: BUFFER_ID is an `unsigned long long`, written once.
        let res = unsafe {
            (self.api.pointer_get_attribute)((&mut id as *mut u64).cast(), POINTER_BUFFER_ID, ptr)
        };
        (res == CUDA_SUCCESS).then_some(id)
    }
}

/// A CUDA device address as the driver describes it ([`Cuda::pointer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerInfo {
    /// The device the memory is on.
    pub ordinal: i32,
    /// The allocation's process-wide unique id (`CU_POINTER_ATTRIBUTE_BUFFER_ID`).
    pub buffer_id: u64,
    /// Managed (unified) memory, which the driver migrates and cannot export as a dma-buf.
    pub managed: bool,
    /// The allocation the address lies in: its first byte and its length (an allocator's
    /// whole segment, for memory a caching allocator such as PyTorch's handed out).
    pub base: DevicePtr,
    pub len: u64,
}

/// A retained primary context.
struct Context {
    api: Arc<Api>,
    dev: CuDevice,
    ctx: CuContext,
}

// SAFETY: a CUDA context is not tied to a thread: the driver API is thread safe, and every use
// makes the context current on the calling thread first (`make_current`).
unsafe impl Send for Context {}
// SAFETY: as for Send; `&Context` only passes the handle to the driver.
unsafe impl Sync for Context {}

impl Context {
    fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` is a primary context this value retains.
        let res = unsafe { (self.api.ctx_set_current)(self.ctx) };
        self.api.check("cuCtxSetCurrent", res)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Cuda::device`; nothing uses `ctx` afterwards.
        let _ = unsafe { (self.api.primary_ctx_release)(self.dev) };
    }
}

/// A CUDA device.
#[derive(Clone)]
pub struct Device {
    ordinal: i32,
    context: Arc<Context>,
}

impl Device {
    fn api(&self) -> &Api {
        &self.context.api
    }

    /// The ordinal it was opened with.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `buf.len()` bytes, NUL-terminated.
        let res = unsafe {
            (self.api().device_get_name)(buf.as_mut_ptr(), buf.len() as c_int, self.context.dev)
        };
        self.api().check("cuDeviceGetName", res)?;
        Ok(c_string(&buf))
    }

    /// The GPU's PCI address as sysfs and fgds spell it (`0000:18:00.0`, lower case).
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as c_char; 64];
        // SAFETY: the driver writes at most `buf.len()` bytes, NUL-terminated.
        let res = unsafe {
            (self.api().device_get_pci_bus_id)(
                buf.as_mut_ptr(),
                buf.len() as c_int,
                self.context.dev,
            )
        };
        self.api().check("cuDeviceGetPCIBusId", res)?;
        let raw = c_string(&buf);
        normalize_bus_id(&raw).ok_or_else(|| {
            Error::Invalid(format!(
                "cuDeviceGetPCIBusId returned {raw:?}, not DOMAIN:BUS:DEVICE.FUNCTION"
            ))
        })
    }

    /// Whether the driver can export this device's memory as a dma-buf
    /// (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub fn dma_buf_supported(&self) -> Result<bool> {
        let mut value = 0;
        // SAFETY: writes one int.
        let res = unsafe {
            (self.api().device_get_attribute)(
                &mut value,
                ATTRIBUTE_DMA_BUF_SUPPORTED,
                self.context.dev,
            )
        };
        self.api()
            .check("cuDeviceGetAttribute(DMA_BUF_SUPPORTED)", res)?;
        Ok(value == 1)
    }

    /// Allocates `len` bytes of device memory (`cuMemAlloc`), freed when the returned value
    /// is dropped.
    pub fn alloc(&self, len: u64) -> Result<DeviceMemory> {
        let size = usize::try_from(len)
            .map_err(|_| Error::Invalid(format!("{len:#x} bytes do not fit the address space")))?;
        self.context.make_current()?;
        let mut ptr: DevicePtr = 0;
        // SAFETY: writes one CUdeviceptr; the memory is freed in `DeviceMemory::drop`.
        let res = unsafe { (self.api().mem_alloc)(&mut ptr, size) };
        self.api().check("cuMemAlloc", res)?;
        Ok(DeviceMemory {
            context: Arc::clone(&self.context),
            ptr,
            len,
        })
    }

    /// Exports `len` bytes of device memory at `ptr` (inside one allocation of this device)
    /// as a dma-buf fd. `ptr` and `len` must be multiples of the host's page size; the
    /// device must support it ([`Device::dma_buf_supported`]).
    pub fn export_dmabuf(&self, ptr: DevicePtr, len: u64) -> Result<OwnedFd> {
        let page = rustix::param::page_size() as u64;
        if len == 0 || !len.is_multiple_of(page) || !ptr.is_multiple_of(page) {
            return Err(Error::Invalid(format!(
                "CUDA memory at {ptr:#x}, {len:#x} bytes: a dma-buf export needs a non-zero length and an address that are multiples of the page size ({page:#x}); allocate with a rounded-up length (cuMemAlloc returns 2 MiB-aligned addresses for large allocations)"
            )));
        }
        if !self.dma_buf_supported()? {
            return Err(Error::CudaNoDmabuf {
                ordinal: self.ordinal,
            });
        }
        let size = usize::try_from(len)
            .map_err(|_| Error::Invalid(format!("{len:#x} bytes do not fit the address space")))?;
        self.context.make_current()?;
        let mut fd: c_int = -1;
        // SAFETY: for CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD the handle is an int the driver
        // writes the new fd into; flags 0 is the default mapping.
        let res = unsafe {
            (self.api().get_handle_for_address_range)(
                (&mut fd as *mut c_int).cast(),
                ptr,
                size,
                HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        self.api().check("cuMemGetHandleForAddressRange", res)?;
        if fd < 0 {
            return Err(Error::Invalid(format!(
                "cuMemGetHandleForAddressRange succeeded but returned fd {fd}"
            )));
        }
        // SAFETY: on success the driver installed a new fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Page-locks `len` bytes of host memory at `ptr` for CUDA's copies (`cuMemHostRegister`),
    /// as a CUDA program does with its bounce buffers; unlocked when the returned value is
    /// dropped.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be a mapping of this process that outlives the returned value.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<HostRegistration> {
        self.context.make_current()?;
        // SAFETY: the caller guarantees the range is mapped for the registration's life;
        // flags 0 is a plain page-locked registration.
        let res = unsafe { (self.api().mem_host_register)(ptr.cast(), len, 0) };
        self.api().check("cuMemHostRegister", res)?;
        Ok(HostRegistration {
            context: Arc::clone(&self.context),
            ptr: ptr.cast(),
        })
    }

    /// Waits until every stream of the device's primary context has finished its work
    /// (`cuCtxSynchronize`): DMA that the GPU does not order (an NVMe drive writing its memory)
    /// must not race a kernel still using it.
    pub fn synchronize(&self) -> Result<()> {
        self.context.make_current()?;
        // SAFETY: no arguments; the context is current on this thread.
        let res = unsafe { (self.api().ctx_synchronize)() };
        self.api().check("cuCtxSynchronize", res)
    }

    /// Copies `src` to device memory at `dst` (`cuMemcpyHtoD`: synchronous for page-locked
    /// `src`, and ordered after earlier work of the legacy default stream).
    ///
    /// # Safety
    ///
    /// `dst..dst + src.len()` must be device memory of this device that nothing else writes or
    /// frees during the copy.
    pub unsafe fn copy_to_device(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        self.context.make_current()?;
        // SAFETY: the caller vouches for the destination; the source is a slice of exactly
        // the copied length.
        let res = unsafe { (self.api().memcpy_htod)(dst, src.as_ptr().cast(), src.len()) };
        self.api().check("cuMemcpyHtoD", res)
    }

    /// Copies device memory at `src` into `dst` (`cuMemcpyDtoH`, synchronous).
    ///
    /// # Safety
    ///
    /// `src..src + dst.len()` must be device memory of this device that stays allocated during
    /// the copy.
    pub unsafe fn copy_from_device(&self, dst: &mut [u8], src: DevicePtr) -> Result<()> {
        self.context.make_current()?;
        // SAFETY: the caller vouches for the source; the destination is a writable slice of
        // exactly the copied length.
        let res = unsafe { (self.api().memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len()) };
        self.api().check("cuMemcpyDtoH", res)
    }

    /// The fgds node of this GPU (found by PCI bus id), opened.
    pub fn fgds_gpu(&self) -> Result<Gpu> {
        Gpu::open(&self.pci_bus_id()?)
    }

    /// Exports `len` bytes at `ptr` as a dma-buf and registers the whole of it with the fgds
    /// node of this GPU: the returned [`Buffer`] is the DMA target for direct I/O. The memory
    /// must stay allocated until the buffer is dropped.
    pub fn register(&self, ptr: DevicePtr, len: u64) -> Result<Buffer> {
        let gpu = self.fgds_gpu()?;
        let dmabuf = self.export_dmabuf(ptr, len)?;
        gpu.register(dmabuf.as_fd(), 0, len)
    }
}

/// Device memory from [`Device::alloc`], freed on drop.
pub struct DeviceMemory {
    context: Arc<Context>,
    ptr: DevicePtr,
    len: u64,
}

impl DeviceMemory {
    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the allocation is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets every byte to `value` (`cuMemsetD8`, synchronous).
    pub fn fill(&self, value: u8) -> Result<()> {
        self.context.make_current()?;
        // SAFETY: the range is this allocation, which lives as long as `self`.
        let res = unsafe { (self.context.api.memset_d8)(self.ptr, value, self.len as usize) };
        self.context.api.check("cuMemsetD8", res)
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > self.len) {
            return Err(Error::Invalid(format!(
                "{len} bytes at {offset:#x} are outside the allocation of {:#x} bytes",
                self.len
            )));
        }
        self.context.make_current()
    }

    /// Copies `src` to `offset` (`cuMemcpyHtoD`, synchronous).
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: the destination range is inside this allocation (checked above); the source
        // is a readable slice of exactly the copied length.
        let res = unsafe {
            (self.context.api.memcpy_htod)(self.ptr + offset, src.as_ptr().cast(), src.len())
        };
        self.context.api.check("cuMemcpyHtoD", res)
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` (`cuMemcpyDtoH`, synchronous).
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: the source range is inside this allocation (checked above); the destination
        // is a writable slice of exactly the copied length.
        let res = unsafe {
            (self.context.api.memcpy_dtoh)(dst.as_mut_ptr().cast(), self.ptr + offset, dst.len())
        };
        self.context.api.check("cuMemcpyDtoH", res)
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.context.make_current().is_ok() {
            // SAFETY: frees the allocation this value owns; nothing uses `ptr` afterwards.
            let _ = unsafe { (self.context.api.mem_free)(self.ptr) };
        }
    }
}

/// Host memory page-locked for CUDA ([`Device::register_host`]), unlocked on drop.
pub struct HostRegistration {
    context: Arc<Context>,
    ptr: *mut c_void,
}

// SAFETY: a registration is an address the driver knows; unregistering works from any thread
// once the context is current.
unsafe impl Send for HostRegistration {}
// SAFETY: `&HostRegistration` gives nothing access to the memory.
unsafe impl Sync for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.context.make_current().is_ok() {
            // SAFETY: unregisters the range this value registered; the memory is still mapped
            // (`register_host`'s contract).
            let _ = unsafe { (self.context.api.mem_host_unregister)(self.ptr) };
        }
    }
}

fn c_string(buf: &[c_char]) -> String {
    let bytes = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect::<Vec<_>>();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// `00000000:1B:00.0` (CUDA's spelling, upper-case hex, 4 or 8 domain digits) as sysfs writes
/// it: `0000:1b:00.0`.
fn normalize_bus_id(raw: &str) -> Option<String> {
    let (domain, rest) = raw.trim().split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let device = u8::from_str_radix(device, 16).ok()?;
    let function = u8::from_str_radix(function, 16).ok()?;
    (device < 32 && function < 8)
        .then(|| format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_are_spelled_as_sysfs_does() {
        assert_eq!(
            normalize_bus_id("00000000:1B:00.0").as_deref(),
            Some("0000:1b:00.0")
        );
        assert_eq!(
            normalize_bus_id("0001:c3:1f.7").as_deref(),
            Some("0001:c3:1f.7")
        );
        assert_eq!(normalize_bus_id("0000:1b:00"), None);
        assert_eq!(normalize_bus_id("0000:1b:20.0"), None);
    }

    #[test]
    fn c_strings_stop_at_nul() {
        let buf = [b'H' as c_char, b'2' as c_char, 0, b'x' as c_char];
        assert_eq!(c_string(&buf), "H2");
    }
}
