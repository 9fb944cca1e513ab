//! `fgds._fgds`: the native half of the Python package `fgds` (python/fgds/). It wraps the
//! crate's [`fgds::GpuFile`] and GPU memory kinds; the Python half turns Python objects (CUDA
//! arrays, DLPack capsules, dma-buf fds) into `Memory` and runs transfers on threads as
//! futures. The types are in python/fgds/_fgds.pyi.

use std::ffi::{CStr, c_void};
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use fgds::memory::{CudaMemory, DmabufMemory};
use fgds::{GpuFile, GpuMemory, Registry};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

pyo3::create_exception!(
    fgds,
    Error,
    PyOSError,
    "An fgds error: `errno` names it, `strerror` says what was wrong and what to do; a transfer that failed part-way has `bytes_done`."
);
pyo3::create_exception!(
    fgds,
    DirectUnavailable,
    Error,
    "The direct path is not there for a transfer and the fallback through host RAM is off."
);

/// The process's registrations, fgds nodes and CUDA driver.
fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Registry::new)
}

/// An fgds error as the Python exception that carries its errno and explanation.
fn py_err(err: fgds::Error) -> PyErr {
    let errno = err.errno();
    let done = err.bytes_done();
    let text = err.to_string();
    let exc = match err {
        fgds::Error::DirectUnavailable { .. } => DirectUnavailable::new_err((errno, text)),
        _ => Error::new_err((errno, text)),
    };
    Python::attach(|py| {
        // OSError instances take attributes; this cannot fail on a fresh exception.
        let _ = exc.value(py).setattr("bytes_done", done);
    });
    exc
}

/// GPU memory resolved for transfers: a CUDA allocation's range or a dma-buf's, with its fgds
/// registration or the reason it has none.
#[pyclass(frozen, module = "fgds._fgds")]
struct Memory {
    inner: Arc<dyn GpuMemory>,
    kind: &'static str,
}

#[pymethods]
impl Memory {
    /// `cuda` or `dmabuf`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// Its length in bytes.
    #[getter]
    fn length(&self) -> u64 {
        self.inner.len()
    }

    /// Whether fgds registered it: transfers can go direct (alignment permitting).
    #[getter]
    fn is_direct(&self) -> bool {
        self.inner.direct().is_ok()
    }

    /// Why transfers into it cannot go direct; None where they can.
    #[getter]
    fn why_not_direct(&self) -> Option<String> {
        self.inner.direct().err().map(|n| n.reason)
    }

    /// The errno naming why not direct; None where direct.
    #[getter]
    fn errno(&self) -> Option<i32> {
        self.inner.direct().err().map(|n| n.errno)
    }

    /// The GPU (PCI address) whose fgds node holds the registration.
    #[getter]
    fn gpu(&self) -> Option<String> {
        self.inner.direct().ok().map(|r| r.gpu)
    }

    fn __repr__(&self) -> String {
        match self.inner.direct() {
            Ok(r) => format!(
                "<fgds memory: {}, direct via GPU {}>",
                self.inner.describe(),
                r.gpu
            ),
            Err(n) => format!(
                "<fgds memory: {}, not direct: {}>",
                self.inner.describe(),
                n.reason
            ),
        }
    }
}

/// `length` bytes of CUDA device memory at `ptr` (one allocation), with its registration
/// from the cache or made now.
#[pyfunction]
fn cuda_memory(py: Python<'_>, ptr: u64, length: u64) -> PyResult<Memory> {
    // SAFETY: fgds/__init__.py keeps the Python object that owns the allocation (the tensor,
    // the array, or the caller's DevicePointer with its owner) alive for as long as it uses
    // this Memory; a bare pointer's allocation is the caller's to keep, as its docs say.
    let memory: CudaMemory = py
        .detach(|| unsafe { registry().cuda_memory(ptr, length) })
        .map_err(py_err)?;
    Ok(Memory {
        inner: Arc::new(memory),
        kind: "cuda",
    })
}

/// `length` bytes at `offset` of the dma-buf `fd`, registered with GPU `gpu` (a PCI address)
/// or the first GPU fgds serves that takes it.
#[pyfunction]
#[pyo3(signature = (fd, offset, length, gpu=None))]
fn dmabuf_memory(
    py: Python<'_>,
    fd: i32,
    offset: u64,
    length: u64,
    gpu: Option<String>,
) -> PyResult<Memory> {
    if fd < 0 {
        return Err(py_err(fgds::Error::Invalid(format!(
            "fd {fd} is not a file descriptor"
        ))));
    }
    let memory: DmabufMemory = py
        .detach(|| {
            // SAFETY: `fd` is the caller's open descriptor for the length of this call; the
            // memory keeps its own duplicate.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            registry().dmabuf_memory(fd, offset, length, gpu.as_deref())
        })
        .map_err(py_err)?;
    Ok(Memory {
        inner: Arc::new(memory),
        kind: "dmabuf",
    })
}

/// `DLDevice`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// `DLDataType`.
#[repr(C)]
#[derive(Clone, Copy)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

/// `DLTensor`.
#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `DLManagedTensor` (capsule `dltensor`).
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// `DLManagedTensorVersioned` (capsule `dltensor_versioned`, DLPack 1.0).
#[repr(C)]
struct DlManagedTensorVersioned {
    version: [u32; 2],
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DlTensor,
}

/// What a DLPack capsule describes: `(address, nbytes, device_type, device_id)` of a
/// C-contiguous tensor. The capsule is not consumed: its producer still owns the tensor.
#[pyfunction]
fn dlpack_info(capsule: &Bound<'_, PyCapsule>) -> PyResult<(u64, u64, i32, i32)> {
    const LEGACY: &CStr = c"dltensor";
    const VERSIONED: &CStr = c"dltensor_versioned";
    let tensor: *const DlTensor = if capsule.is_valid_checked(Some(VERSIONED)) {
        let managed = capsule.pointer_checked(Some(VERSIONED))?;
        // SAFETY: a valid `dltensor_versioned` capsule holds a DLManagedTensorVersioned, which
        // lives while the capsule does; only the address of its member is taken.
        unsafe { &raw const (*managed.cast::<DlManagedTensorVersioned>().as_ptr()).dl_tensor }
    } else if capsule.is_valid_checked(Some(LEGACY)) {
        let managed = capsule.pointer_checked(Some(LEGACY))?;
        // SAFETY: as above, for a `dltensor` capsule's DLManagedTensor.
        unsafe { &raw const (*managed.cast::<DlManagedTensor>().as_ptr()).dl_tensor }
    } else {
        return Err(py_err(fgds::Error::Invalid(
            "not a DLPack capsule (named dltensor or dltensor_versioned), or one already consumed"
                .to_owned(),
        )));
    };
    // SAFETY: the producer keeps the DLTensor and its shape and strides arrays (of `ndim`
    // elements, strides possibly NULL for a compact tensor) valid while the capsule lives,
    // and the capsule is borrowed for this whole call.
    let (data, device, dtype, shape, strides) = unsafe {
        let t = &*tensor;
        let ndim = usize::try_from(t.ndim).unwrap_or(0);
        let shape = if ndim == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(t.shape, ndim)
        };
        let strides = (!t.strides.is_null() && ndim > 0)
            .then(|| std::slice::from_raw_parts(t.strides, ndim).to_vec());
        (
            (t.data as u64).wrapping_add(t.byte_offset),
            t.device,
            t.dtype,
            shape.to_vec(),
            strides,
        )
    };
    let item = (u64::from(dtype.bits) * u64::from(dtype.lanes)).div_ceil(8);
    let mut elements: u64 = 1;
    for &dim in &shape {
        let dim = u64::try_from(dim).map_err(|_| PyValueError::new_err("negative DLPack shape"))?;
        elements = elements.saturating_mul(dim);
    }
    if let Some(strides) = strides {
        // C-contiguous: each stride (in elements) is the product of the dimensions after it;
        // dimensions of extent 1 may have any stride.
        let mut expect: i64 = 1;
        for (dim, stride) in shape.iter().zip(&strides).rev() {
            if *dim != 1 && *stride != expect {
                return Err(py_err(fgds::Error::Invalid(format!(
                    "the DLPack tensor is not C-contiguous (shape {shape:?}, strides {strides:?}): pass a contiguous tensor (.contiguous())"
                ))));
            }
            expect = expect.saturating_mul(*dim);
        }
    }
    Ok((data, elements * item, device.device_type, device.device_id))
}

/// An open file for transfers to and from GPU memory.
#[pyclass(frozen, module = "fgds._fgds")]
struct File {
    inner: Mutex<Option<Arc<GpuFile>>>,
    path: PathBuf,
    mode: String,
}

impl File {
    /// The open file, or Python's error for a closed one.
    fn open_file(&self) -> PyResult<Arc<GpuFile>> {
        self.inner
            .lock()
            .expect("file lock")
            .clone()
            .ok_or_else(|| PyValueError::new_err("I/O operation on closed file"))
    }
}

/// `GpuFile::read` or `GpuFile::write`.
type Direction =
    fn(&GpuFile, &dyn GpuMemory, u64, u64, u64, &fgds::Options) -> fgds::Result<fgds::Completion>;

/// A transfer's `(size, file_offset, memory_offset)`.
type Span = (u64, u64, u64);

/// The options of a transfer from Python's `(compat_mode, task_size, queue_depth)`:
/// kvikio's compatibility mode `"auto"` (the fallback allowed), `"off"` (direct or an error) or
/// `"on"` (through host RAM, always).
fn options(compat_mode: &str, task_size: u64, queue_depth: u32) -> PyResult<fgds::Options> {
    let fallback = match compat_mode {
        "auto" => fgds::Fallback::Allowed,
        "off" => fgds::Fallback::Off,
        "on" => fgds::Fallback::Always,
        other => {
            return Err(PyValueError::new_err(format!(
                "compat_mode {other:?}: use \"auto\", \"on\" or \"off\""
            )));
        }
    };
    let chunk_size = usize::try_from(task_size)
        .map_err(|_| PyValueError::new_err(format!("task_size {task_size} is too large")))?;
    Ok(fgds::Options {
        fallback,
        transfer: fgds::TransferConfig {
            chunk_size,
            queue_depth,
        },
    })
}

impl File {
    /// Runs `call` on `span` with `opts`, the GIL released.
    fn transfer(
        &self,
        py: Python<'_>,
        memory: &Memory,
        (size, file_offset, memory_offset): Span,
        opts: fgds::Options,
        call: Direction,
    ) -> PyResult<Done> {
        let file = self.open_file()?;
        let mem = Arc::clone(&memory.inner);
        py.detach(|| call(&file, mem.as_ref(), size, file_offset, memory_offset, &opts))
            .map(done)
            .map_err(py_err)
    }
}

/// A completed transfer: `(bytes, path, reason, bounced)`.
type Done = (u64, &'static str, Option<String>, u64);

fn done(c: fgds::Completion) -> Done {
    (c.bytes, c.path.as_str(), c.reason, c.bounced)
}

#[pymethods]
impl File {
    #[new]
    fn new(py: Python<'_>, path: PathBuf, mode: &str) -> PyResult<File> {
        let file = py.detach(|| GpuFile::open(&path, mode)).map_err(py_err)?;
        Ok(File {
            inner: Mutex::new(Some(Arc::new(file))),
            path,
            mode: mode.to_owned(),
        })
    }

    #[getter]
    fn path(&self) -> String {
        self.path.to_string_lossy().into_owned()
    }

    #[getter]
    fn mode(&self) -> String {
        self.mode.clone()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().expect("file lock").is_none()
    }

    /// The file's O_DIRECT alignment in bytes.
    #[getter]
    fn alignment(&self) -> PyResult<u64> {
        Ok(self.open_file()?.alignment())
    }

    /// Why the file has no O_DIRECT descriptor; None when it has one.
    #[getter]
    fn why_not_direct(&self) -> PyResult<Option<String>> {
        Ok(self.open_file()?.not_direct().map(|n| n.reason.clone()))
    }

    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        py: Python<'_>,
        memory: &Memory,
        size: u64,
        file_offset: u64,
        memory_offset: u64,
        compat_mode: &str,
        task_size: u64,
        queue_depth: u32,
    ) -> PyResult<Done> {
        let opts = options(compat_mode, task_size, queue_depth)?;
        let span = (size, file_offset, memory_offset);
        self.transfer(py, memory, span, opts, GpuFile::read)
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        memory: &Memory,
        size: u64,
        file_offset: u64,
        memory_offset: u64,
        compat_mode: &str,
        task_size: u64,
        queue_depth: u32,
    ) -> PyResult<Done> {
        let opts = options(compat_mode, task_size, queue_depth)?;
        let span = (size, file_offset, memory_offset);
        self.transfer(py, memory, span, opts, GpuFile::write)
    }

    /// The file's size in bytes.
    fn nbytes(&self) -> PyResult<u64> {
        self.open_file()?.len().map_err(py_err)
    }

    fn fileno(&self) -> PyResult<i32> {
        use std::os::fd::AsRawFd;
        Ok(self.open_file()?.fd().as_raw_fd())
    }

    /// Closes the file; transfers still running keep it open until they end.
    fn close(&self) {
        self.inner.lock().expect("file lock").take();
    }
}

/// Drops every cached CUDA registration; returns how many there were.
#[pyfunction]
fn clear_cache() -> usize {
    registry().clear_cache()
}

/// CUDA allocations with a cached registration (or cached reason for none).
#[pyfunction]
fn cached() -> usize {
    registry().cached()
}

/// `fgds doctor`'s report on this machine: text, or JSON with `json=True`.
#[pyfunction]
#[pyo3(signature = (json=false))]
fn doctor(py: Python<'_>, json: bool) -> String {
    py.detach(|| {
        let report = fgds::doctor::examine(
            std::path::Path::new("/"),
            &fgds::doctor::Identity::current(),
            fgds::doctor::cuda_devices(),
        );
        if json {
            report.json().to_string()
        } else {
            report.text()
        }
    })
}

#[pymodule]
fn _fgds(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("DirectUnavailable", py.get_type::<DirectUnavailable>())?;
    m.add_class::<Memory>()?;
    m.add_class::<File>()?;
    m.add_function(wrap_pyfunction!(cuda_memory, m)?)?;
    m.add_function(wrap_pyfunction!(dmabuf_memory, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack_info, m)?)?;
    m.add_function(wrap_pyfunction!(clear_cache, m)?)?;
    m.add_function(wrap_pyfunction!(cached, m)?)?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    Ok(())
}
