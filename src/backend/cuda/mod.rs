//! The CUDA device: one context, one stream, and the kernels of kernels/*.cu
//! (compiled by build.rs into one fatbin embedded here) loaded as one module.
//!
//! cudarc loads libcuda/libcublas dynamically, so the library itself never
//! needs CUDA; every entry point checks for the driver library before the
//! first driver call (cudarc panics without it) and returns `Error::NoCuda`.
//! `<family>.rs` holds the launch wrappers of `kernels/<family>.cu`.

pub mod attention;
pub mod ceilings;
pub mod deltanet;
pub mod dense;
pub mod moe;
pub mod sampling;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaModule, DriverError};
use parking_lot::{Mutex, ReentrantMutex};

/// The whole binding, for what the names below do not cover (tests reach
/// it through here: cudarc is not a dependency of theirs).
pub use cudarc;
pub use cudarc::cublas::CudaBlas;
pub use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};

use crate::error::{Error, Result};

/// The fatbin build.rs made from kernels/*.cu (sm_75 .. sm_90/sm_90a).
static KERNELS_FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/strata_kernels.fatbin"));

/// cuDriverGetVersion of CUDA 13.0, the toolkit the kernels are built with.
const MIN_DRIVER_VERSION: i32 = 13000;

/// Threads per block of the simple elementwise kernels (fill).
const ELEMENTWISE_THREADS: u32 = 256;

/// `CU_MEMHOSTALLOC_DEVICEMAP`: page-locked memory mapped into the device's
/// address space, which kernels may read in place (`Gpu::mapped_host_address`).
pub const HOST_DEVICE_MAP: u32 = 0x02;

/// Whether the CUDA driver library (libcuda) can be loaded; asked once per
/// process. Every path to the driver checks this first: cudarc panics on the
/// first driver call without it.
pub fn driver_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the driver library and closes it again.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Whether the cuBLAS library can be loaded; asked once per process. Every
/// CUDA engine needs it (prefill's projections), so `probe` refuses a device
/// without it, and `Gpu::blas` checks again (cudarc panics without it).
pub fn cublas_library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libcublas and closes it again.
    *PRESENT.get_or_init(|| unsafe { cudarc::cublas::sys::is_culib_present() })
}

const NO_CUBLAS: &str = "the cuBLAS library (libcublas.so.13) was not found: the CUDA engine needs it";

/// Number of CUDA devices. `Error::NoCuda` when the driver library is absent,
/// fails to initialize, or sees no device.
pub fn device_count() -> Result<usize> {
    if !driver_library_present() {
        return Err(Error::NoCuda("the CUDA driver library (libcuda.so.1) was not found".into()));
    }
    // An older driver cannot load CUDA 13 machine code, and cudarc's CUDA 13
    // bindings panic on a driver entry point it lacks.
    let mut version = 0;
    // SAFETY: writes one int; needs no cuInit.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    if version < MIN_DRIVER_VERSION {
        return Err(Error::NoCuda(format!(
            "the CUDA driver supports CUDA {}.{}; this build needs CUDA 13.0 or newer (driver 580+)",
            version / 1000,
            version % 1000 / 10
        )));
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => Ok(n as usize),
        Ok(_) | Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => {
            Err(Error::NoCuda("no CUDA device (the driver reports none on this machine)".into()))
        }
        Err(e) => Err(Error::NoCuda(format!("the CUDA driver failed to initialize: {e}"))),
    }
}

/// Starts (`on`) or stops the collection of an attached profiler, so that
/// `ncu --profile-from-start off` sees only the marked work (the bench marks
/// its decode steps under `STRATA_PROFILE_DECODE=1`). Needs a current
/// context: call it on a thread that opened a device.
pub fn profiler_collect(on: bool) -> Result<()> {
    device_count()?;
    // SAFETY: no arguments; a no-op without a profiler attached.
    unsafe {
        if on {
            sys::cuProfilerStart()
        } else {
            sys::cuProfilerStop()
        }
    }
    .result()?;
    Ok(())
}

/// The arguments of one `Gpu::launch`, in the kernel's parameter order:
/// each value is copied into 8-byte-aligned storage owned here, so the
/// pointers the driver reads stay valid until the launch.
#[derive(Default)]
pub struct KernelArgs {
    store: Vec<Box<[u64]>>,
}

impl KernelArgs {
    pub fn new() -> KernelArgs {
        KernelArgs::default()
    }

    /// A value passed by copy: an integer, a float or a `#[repr(C)]` struct.
    pub fn val<T: DeviceRepr + Copy>(&mut self, v: T) -> &mut Self {
        let size = std::mem::size_of::<T>();
        let mut b = vec![0u64; size.div_ceil(8).max(1)].into_boxed_slice();
        // SAFETY: `b` holds at least size bytes, 8-byte aligned (>= T's alignment for the kernel argument types).
        unsafe { std::ptr::copy_nonoverlapping(&v as *const T as *const u8, b.as_mut_ptr() as *mut u8, size) };
        self.store.push(b);
        self
    }

    /// A device buffer the kernel reads.
    pub fn buf<T>(&mut self, gpu: &Gpu, b: &impl DevicePtr<T>) -> &mut Self {
        let (ptr, _sync) = b.device_ptr(gpu.stream());
        self.val(ptr)
    }

    /// A device buffer the kernel writes.
    pub fn buf_mut<T>(&mut self, gpu: &Gpu, b: &mut impl DevicePtrMut<T>) -> &mut Self {
        let (ptr, _sync) = b.device_ptr_mut(gpu.stream());
        self.val(ptr)
    }

    /// A null pointer argument.
    pub fn null(&mut self) -> &mut Self {
        self.val(0u64)
    }
}

/// Checks that device `cuda:ordinal` exists without opening it: `Error::NoCuda`
/// naming the cause (no driver, no device, an ordinal past the count, no
/// cuBLAS).
pub fn probe(ordinal: usize) -> Result<()> {
    let count = device_count()?;
    if !cublas_library_present() {
        return Err(Error::NoCuda(NO_CUBLAS.into()));
    }
    if ordinal >= count {
        return Err(Error::NoCuda(format!(
            "cuda:{ordinal} does not exist: this machine has {count} CUDA device{}",
            if count == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}

/// A launch shape `Gpu::active_clusters` memoizes: kernel, grid, threads,
/// dynamic shared bytes, cluster blocks.
type ClusterShape = (String, (u32, u32, u32), u32, u32, u32);

/// One CUDA device, ready to launch the embedded kernels. Shared as
/// `Arc<Gpu>`; every method may be called from any thread (cudarc binds the
/// context to the calling thread before each driver call).
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// `blocks_per_sm`'s answers by (kernel, threads, dynamic shared bytes).
    occupancy: Mutex<HashMap<(&'static str, u32, usize), usize>>,
    /// `active_clusters`' answers by (kernel, grid, threads, dynamic shared bytes, cluster).
    cluster_occupancy: Mutex<HashMap<ClusterShape, usize>>,
    blas: OnceLock<CudaBlas>,
    name: String,
    compute_capability: (u32, u32),
    sm_count: u32,
    /// Whether `launch` asks for programmatic dependent launch (sm_90+,
    /// unless `STRATA_PDL=0`).
    pdl: bool,
    /// Whether the batch-1 expert GEMVs may run on tensor cores (sm_80+,
    /// unless `STRATA_TC_GEMV=0`; tests may switch it: `set_tc_gemv`).
    tc_gemv: AtomicBool,
    /// Which kernels start their first loads before their programmatic
    /// wait (`PREWAIT_ATTN | PREWAIT_DOWN` unless `STRATA_PREWAIT` says
    /// otherwise; tests may switch it: `set_prewait`).
    prewait: AtomicU8,
    /// Whether a decode step's routed experts may run as one launch
    /// (`moe::fused_decode`: sm_90+ with
    /// `STRATA_FUSED_MOE=1`, off by default: slower than the two GEMV
    /// launches on an H100, docs/performance.md; tests may switch it:
    /// `set_fused_moe`).
    fused_moe: AtomicBool,
    /// Whether the routed decode expert GEMVs stage their weights in shared
    /// memory (`moe_gate_up_gemv_tc_st`, `moe_down_gemv_tc_st`: the down
    /// GEMV's blocks then sit beside the gate/up GEMV's and request all of
    /// their weights before their wait; sm_80+ with `STRATA_STAGED_MOE=1`,
    /// off by default: slower than the register-staged pair on an H100,
    /// docs/performance.md; tests may switch it: `set_staged_moe`).
    staged_moe: AtomicBool,
    /// Held (`StreamHold`) by the thread that queues work on `stream`, for
    /// the length of one whole operation: a forward (which may capture the
    /// stream into a CUDA graph: anything another thread queued meanwhile
    /// would land in the graph), a session state's allocation, copy or
    /// free. Reentrant: an operation may call another.
    queue: ReentrantMutex<()>,
}

/// `Gpu::prewait`: the one-row attention's first key tile before its wait.
pub const PREWAIT_ATTN: u8 = 1;
/// `Gpu::prewait`: the decode down GEMV's routing and first weights before its wait.
pub const PREWAIT_DOWN: u8 = 2;

/// The `prewait` mask of `STRATA_PREWAIT`: unset, `all` or `3`: both; `0`,
/// `none`, `off` or `false`: neither; `attn` (1) or `down` (2): that one.
/// Anything else: both.
pub fn prewait_from_env(v: Option<&str>) -> u8 {
    match v.map(str::trim) {
        Some("0") | Some("none") | Some("off") | Some("false") => 0,
        Some("1") | Some("attn") => PREWAIT_ATTN,
        Some("2") | Some("down") => PREWAIT_DOWN,
        _ => PREWAIT_ATTN | PREWAIT_DOWN,
    }
}

// The engine shares one Gpu between threads.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<Gpu>()
};

/// The streams of some devices, held by the calling thread until this
/// drops: no other thread queues work on them meanwhile (`Gpu::queue`).
/// Devices are taken in the order given; every caller gives a model's
/// devices in stage order, so two callers never wait on each other.
pub struct StreamHold {
    gpus: Vec<Arc<Gpu>>,
    /// Released by the thread that took it: not `Send`.
    _thread: std::marker::PhantomData<*const ()>,
}

impl StreamHold {
    pub fn new<'a>(gpus: impl IntoIterator<Item = &'a Arc<Gpu>>) -> StreamHold {
        let gpus: Vec<Arc<Gpu>> = gpus.into_iter().cloned().collect();
        for g in &gpus {
            // Held until `drop` (a guard would borrow `gpus`).
            std::mem::forget(g.queue.lock());
        }
        StreamHold { gpus, _thread: std::marker::PhantomData }
    }
}

impl Drop for StreamHold {
    fn drop(&mut self) {
        for g in self.gpus.iter().rev() {
            // SAFETY: `new` took this lock on this thread (a StreamHold is
            // not Send) and forgot its guard; this is its one release.
            unsafe { g.queue.force_unlock() };
        }
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal())
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Gpu {
    /// Opens device `ordinal` (`cuda:N`): checks the driver, creates the
    /// context and the stream, and loads the embedded fatbin as one module.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        probe(ordinal)?;
        let ctx = CudaContext::new(ordinal)?;
        // One stream does all of this device's work, so cudarc's per-buffer
        // event tracking (an event recorded per buffer argument of every
        // launch, for ordering across streams) is pure overhead: off, before
        // any buffer exists.
        // SAFETY: every buffer of this context is used on `stream` only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let name = ctx.name()?;
        let (major, minor) = ctx.compute_capability()?;
        let sm_count = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(KERNELS_FATBIN.to_vec())).map_err(|e| {
            Error::Cuda(format!(
                "loading the kernels on cuda:{ordinal} ({name}, compute capability {major}.{minor}): {e} \
                     (this build has machine code for sm_75, sm_80, sm_86, sm_89, sm_90; STRATA_CUDA_ARCHS may \
                     have restricted it)"
            ))
        })?;
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            module,
            functions: Mutex::new(HashMap::new()),
            occupancy: Mutex::new(HashMap::new()),
            cluster_occupancy: Mutex::new(HashMap::new()),
            blas: OnceLock::new(),
            name,
            compute_capability: (major as u32, minor as u32),
            sm_count: sm_count as u32,
            pdl: major >= 9 && std::env::var("STRATA_PDL").map_or(true, |v| v != "0"),
            tc_gemv: AtomicBool::new(major >= 8 && std::env::var("STRATA_TC_GEMV").map_or(true, |v| v != "0")),
            prewait: AtomicU8::new(prewait_from_env(std::env::var("STRATA_PREWAIT").ok().as_deref())),
            fused_moe: AtomicBool::new(major >= 9 && std::env::var("STRATA_FUSED_MOE").is_ok_and(|v| v == "1")),
            staged_moe: AtomicBool::new(major >= 8 && std::env::var("STRATA_STAGED_MOE").is_ok_and(|v| v == "1")),
            queue: ReentrantMutex::new(()),
        }))
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// (major, minor), e.g. (9, 0) for Hopper.
    pub fn compute_capability(&self) -> (u32, u32) {
        self.compute_capability
    }

    /// Whether the decode expert GEMVs may use their tensor-core kernels
    /// (sm_80+; `STRATA_TC_GEMV=0` keeps the CUDA-core ones, for comparison).
    pub fn tc_gemv(&self) -> bool {
        self.tc_gemv.load(Ordering::Relaxed)
    }

    /// Tests (`test-hooks`): lets the expert GEMV wrappers take the
    /// tensor-core kernels (`on`, where the device has them) or the CUDA-core
    /// ones from the next launch on (a decode step's CUDA graph keeps what it
    /// captured); returns the previous setting.
    #[cfg(feature = "test-hooks")]
    pub fn set_tc_gemv(&self, on: bool) -> bool {
        self.tc_gemv.swap(on && self.compute_capability.0 >= 8, Ordering::Relaxed)
    }

    /// Whether a decode step's routed experts may run as one launch
    /// (`moe::fused_decode`; sm_90+ with
    /// `STRATA_FUSED_MOE=1`, for comparison: the two GEMV launches are the
    /// default).
    pub fn fused_moe(&self) -> bool {
        self.fused_moe.load(Ordering::Relaxed)
    }

    /// Tests (`test-hooks`): allows the fused decode MoE (`on`, on sm_90+)
    /// or not from the next launch on; returns the
    /// previous setting.
    #[cfg(feature = "test-hooks")]
    pub fn set_fused_moe(&self, on: bool) -> bool {
        self.fused_moe.swap(on && self.compute_capability.0 >= 9, Ordering::Relaxed)
    }

    /// Whether the routed decode expert GEMVs stage their weights in shared
    /// memory (sm_80+ with `STRATA_STAGED_MOE=1`, for comparison: the
    /// register-staged pair is the default).
    pub fn staged_moe(&self) -> bool {
        self.staged_moe.load(Ordering::Relaxed)
    }

    /// Tests (`test-hooks`): lets the routed decode expert GEMVs stage their
    /// weights in shared memory (`on`, on sm_80+) or not from the next
    /// launch on; returns the previous setting.
    #[cfg(feature = "test-hooks")]
    pub fn set_staged_moe(&self, on: bool) -> bool {
        self.staged_moe.swap(on && self.compute_capability.0 >= 8, Ordering::Relaxed)
    }

    /// Whether `what` (`PREWAIT_ATTN`: the one-row attention reads its first
    /// key tile, `PREWAIT_DOWN`: the decode down GEMV routes its token and
    /// reads its first weights) happens before the kernel's programmatic
    /// wait. Each rests on the kernel before it triggering only after its own
    /// wait (attn_qkv_prep, the routed gate/up GEMVs; they do when the flag
    /// is set), which delays that kernel's launch: the bench compares
    /// (`STRATA_PREWAIT`, see `prewait_from_env`).
    pub fn prewait(&self, what: u8) -> bool {
        self.prewait.load(Ordering::Relaxed) & what != 0
    }

    /// Tests (`test-hooks`): sets the `prewait` mask from the next launch on
    /// (a decode step's CUDA graph keeps what it captured); returns the
    /// previous one.
    #[cfg(feature = "test-hooks")]
    pub fn set_prewait(&self, mask: u8) -> u8 {
        self.prewait.swap(mask & (PREWAIT_ATTN | PREWAIT_DOWN), Ordering::Relaxed)
    }

    /// Number of streaming multiprocessors (sizes persistent grids).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// (free, total) bytes of device memory now.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The one stream every launch, copy and cuBLAS call of this device goes on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A kernel of the embedded fatbin, looked up once and cached.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        let mut functions = self.functions.lock();
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let f = self
            .module
            .load_function(name)
            .map_err(|e| Error::Cuda(format!("kernel {name} is not in the embedded kernels (kernels/*.cu): {e}")))?;
        functions.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// cuBLAS on `self.stream()`, created on first use.
    pub fn blas(&self) -> Result<&CudaBlas> {
        if let Some(blas) = self.blas.get() {
            return Ok(blas);
        }
        if !cublas_library_present() {
            return Err(Error::NoCuda(NO_CUBLAS.into()));
        }
        let blas = CudaBlas::new(self.stream.clone())?;
        // Two threads may race here; the loser's handle is dropped.
        let _ = self.blas.set(blas);
        Ok(self.blas.get().expect("set above"))
    }

    /// Copies `host` into a new device buffer (ordered on the stream).
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// A new device buffer of `n` zeroed elements.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(n)?)
    }

    /// Waits for the stream, returns the contents.
    pub fn download<T: DeviceRepr + Clone + Default>(&self, d: &CudaSlice<T>) -> Result<Vec<T>> {
        let mut host = vec![T::default(); d.len()];
        self.stream.memcpy_dtoh(d, &mut host)?;
        self.stream.synchronize()?;
        Ok(host)
    }

    /// Launches `f` on the stream with `args` as a programmatic dependent
    /// launch where the device has it (sm_90+, unless `STRATA_PDL=0`): the
    /// kernel's blocks may start before the previous kernel on the stream
    /// has finished, so a decode step's ~10 launches a layer overlap their
    /// start-up with their predecessor's tail (and a GEMV fetches its
    /// weights meanwhile). Elsewhere a plain launch.
    ///
    /// # Safety
    /// `args` must match `f`'s parameters, and `f` must call
    /// `strata_pdl_wait()` (kernels/common.cuh) before it reads anything an
    /// earlier kernel writes or writes anything an earlier kernel touches.
    pub unsafe fn launch(&self, f: &CudaFunction, cfg: LaunchConfig, args: &mut KernelArgs) -> Result<()> {
        // SAFETY: as this function's.
        unsafe { self.launch_ex(f, cfg, None, args) }
    }

    /// `launch` in thread-block clusters of `cluster` blocks along x (sm_90+;
    /// the grid's x a multiple of it). A cluster of more than 8 blocks needs
    /// `allow_large_clusters` on `f` first.
    ///
    /// # Safety
    /// As `launch`.
    pub unsafe fn launch_cluster(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        cluster: u32,
        args: &mut KernelArgs,
    ) -> Result<()> {
        // SAFETY: as this function's.
        unsafe { self.launch_ex(f, cfg, Some(cluster), args) }
    }

    /// The attributes of a launch: programmatic dependent launch where the
    /// device has it, clusters of `cluster` blocks along x.
    fn launch_attrs(&self, cluster: Option<u32>) -> ([sys::CUlaunchAttribute; 2], u32) {
        // SAFETY: zero is a valid bit pattern of this plain C union.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if self.pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if let Some(c) = cluster {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: c, y: 1, z: 1 };
            n += 1;
        }
        (attrs, n as u32)
    }

    fn launch_config(
        cfg: &LaunchConfig,
        stream: sys::CUstream,
        attrs: &mut [sys::CUlaunchAttribute; 2],
        n: u32,
    ) -> sys::CUlaunchConfig {
        sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream,
            attrs: attrs.as_mut_ptr(),
            numAttrs: n,
        }
    }

    /// # Safety
    /// As `launch`.
    unsafe fn launch_ex(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        cluster: Option<u32>,
        args: &mut KernelArgs,
    ) -> Result<()> {
        self.ctx.bind_to_thread()?;
        let mut params: Vec<*mut std::ffi::c_void> =
            args.store.iter_mut().map(|b| b.as_mut_ptr() as *mut std::ffi::c_void).collect();
        let (mut attrs, n) = self.launch_attrs(cluster);
        let config = Self::launch_config(&cfg, self.stream.cu_stream(), &mut attrs, n);
        // SAFETY: the caller vouches for the arguments; `params` points into `args`' storage, alive until return;
        // `config` and `attrs` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()?;
        Ok(())
    }

    /// Lets `f` launch in clusters of more than 8 blocks (up to 16 on sm_90).
    pub fn allow_large_clusters(&self, f: &CudaFunction) -> Result<()> {
        f.set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)?;
        Ok(())
    }

    /// How many blocks of the kernel `name` with `threads` threads and
    /// `smem` bytes of dynamic shared memory one SM runs at once (0: it does
    /// not fit), asked of the driver once per (name, threads, smem). Above
    /// the default 48 KB the kernel's dynamic shared memory limit is raised
    /// to the device's opt-in maximum (less its static shared memory) first,
    /// so a launch of that shape is allowed; past that the answer is 0.
    pub fn blocks_per_sm(&self, name: &'static str, threads: u32, smem: usize) -> Result<usize> {
        // (A static name: a launch that asks again allocates nothing.)
        let key = (name, threads, smem);
        if let Some(&n) = self.occupancy.lock().get(&key) {
            return Ok(n);
        }
        let f = self.function(name)?;
        let n = if smem > 48 << 10 {
            let optin =
                self.ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
            // The limit covers dynamic memory only; with the static it may not pass the opt-in maximum.
            let fixed = f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?;
            let room = optin.max(0).saturating_sub(fixed.max(0)) as usize;
            if smem > room {
                0
            } else {
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    room as std::ffi::c_int,
                )?;
                self.max_active_blocks(&f, threads, smem)?
            }
        } else {
            self.max_active_blocks(&f, threads, smem)?
        };
        self.occupancy.lock().insert(key, n);
        Ok(n)
    }

    /// How many blocks of `f` with `threads` threads and `smem` bytes of
    /// dynamic shared memory one SM runs at once.
    pub fn max_active_blocks(&self, f: &CudaFunction, threads: u32, smem: usize) -> Result<usize> {
        self.ctx.bind_to_thread()?;
        let mut count: std::ffi::c_int = 0;
        // SAFETY: `count` is written once; the function handle is alive.
        unsafe { sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut count, f.cu_function(), threads as i32, smem) }
            .result()?;
        Ok(count.max(0) as usize)
    }

    /// `max_active_clusters` of the kernel `name` in the shape `cfg`, asked of
    /// the driver once per (name, grid, threads, dynamic shared memory,
    /// cluster); 0 where the driver refuses the query (remembered too, so
    /// every later call gives the same answer). The caller has set the
    /// kernel's dynamic shared memory limit; a cluster of more than 8 blocks
    /// is allowed here first.
    pub fn active_clusters(&self, name: &str, cfg: LaunchConfig, cluster: u32) -> usize {
        let key = (name.to_string(), cfg.grid_dim, cfg.block_dim.0, cfg.shared_mem_bytes, cluster);
        if let Some(&n) = self.cluster_occupancy.lock().get(&key) {
            return n;
        }
        let ask = || -> Result<usize> {
            let f = self.function(name)?;
            if cluster > 8 {
                self.allow_large_clusters(&f)?;
            }
            self.max_active_clusters(&f, cfg, cluster)
        };
        let n = ask().unwrap_or(0);
        self.cluster_occupancy.lock().insert(key, n);
        n
    }

    /// How many clusters of `cluster` blocks of `f` in the shape `cfg` the
    /// device runs at once (0: none fits).
    pub fn max_active_clusters(&self, f: &CudaFunction, cfg: LaunchConfig, cluster: u32) -> Result<usize> {
        self.ctx.bind_to_thread()?;
        let (mut attrs, n) = self.launch_attrs(Some(cluster));
        let config = Self::launch_config(&cfg, self.stream.cu_stream(), &mut attrs, n);
        let mut count: std::ffi::c_int = 0;
        // SAFETY: `config` and `attrs` outlive the call; `count` is written once.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut count, f.cu_function(), &config) }.result()?;
        Ok(count.max(0) as usize)
    }

    /// Waits until everything queued on the stream has run; a kernel's
    /// fault surfaces here as `Error::Cuda`.
    pub fn sync(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// A launch shape for a grid-stride loop over `n` elements: 256 threads
    /// a block, at most 32 blocks per SM.
    pub fn grid_stride_config(&self, n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(ELEMENTWISE_THREADS as usize).clamp(1, self.sm_count.max(1) as usize * 32) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ELEMENTWISE_THREADS, 1, 1), shared_mem_bytes: 0 }
    }

    /// The device address of `ptr`, a byte of page-locked memory allocated
    /// with `HOST_DEVICE_MAP` by this device's context (the driver refuses
    /// any other pointer with an error).
    pub fn mapped_host_address(&self, ptr: *const u8) -> Result<u64> {
        self.ctx.bind_to_thread()?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: the driver only looks `ptr` up among its page-locked allocations (an unknown one is
        // CUDA_ERROR_INVALID_VALUE) and writes the one address `d`.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, ptr as *mut std::ffi::c_void, 0) }.result()?;
        Ok(d)
    }

    /// Queues a kernel that only waits `cycles` SM clock cycles (tests:
    /// delays a producer stream, so that a missing cross-stream wait shows).
    pub fn spin(&self, cycles: i64) -> Result<()> {
        let f = self.function("infra_spin")?;
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(&cycles);
        // SAFETY: infra_spin(long long cycles) touches no memory.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Fills an f32 buffer with `value` on the stream (tests poison outputs with NaN).
    pub fn fill_f32(&self, d: &mut CudaSlice<f32>, value: f32) -> Result<()> {
        if d.is_empty() {
            return Ok(());
        }
        let f = self.function("infra_fill_f32")?;
        let (cfg, n) = (self.grid_stride_config(d.len()), d.len() as u64);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(d).arg(&value).arg(&n);
        // SAFETY: infra_fill_f32(float*, float, unsigned long long n) writes
        // out[0..n) of a buffer of n floats.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Fills a buffer with random non-zero words made on the device from `seed`.
    pub fn fill_random_u32(&self, d: &mut CudaSlice<u32>, seed: u64) -> Result<()> {
        if d.is_empty() {
            return Ok(());
        }
        let f = self.function("infra_fill_random_u32")?;
        let (cfg, n) = (self.grid_stride_config(d.len()), d.len() as u64);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(d).arg(&seed).arg(&n);
        // SAFETY: infra_fill_random_u32(unsigned*, u64 seed, u64 n) writes out[0..n).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// Fills a bf16 buffer with values uniform in [-1, 1) made on the device from `seed`.
    pub fn fill_uniform_bf16(&self, d: &mut CudaSlice<half::bf16>, seed: u64) -> Result<()> {
        if d.is_empty() {
            return Ok(());
        }
        let f = self.function("infra_fill_uniform_bf16")?;
        let (cfg, n) = (self.grid_stride_config(d.len()), d.len() as u64);
        let mut launch = self.stream.launch_builder(&f);
        launch.arg(d).arg(&seed).arg(&n);
        // SAFETY: infra_fill_uniform_bf16(bf16*, u64 seed, u64 n) writes out[0..n).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
