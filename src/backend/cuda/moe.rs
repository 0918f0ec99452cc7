//! CUDA launch wrappers for kernels/moe.cu (see kernels/README.md): the one
//! MoE pipeline of `crate::moe` on the device.
//!
//! - `route_topk`: router softmax + top-k (`moe::route`).
//! - decode (T <= 8 rows): `expert_gate_up_gemv` then `expert_down_gemv`,
//!   which also sums each token's experts (the combine) in j order.
//!   One token on sm_90+ with `STRATA_FUSED_MOE=1`: `fused_decode`, both
//!   in one launch (the same bits; slower on an H100, so off by default).
//!   With `STRATA_STAGED_MOE=1` the routed pair stages its weights in
//!   shared memory (`Gpu::staged_moe`; the same bits; slower on an H100).
//! - prefill: `group_by_expert` (counting sort on the device), then
//!   `expert_gate_up_grouped` / `expert_down_grouped` over the rows of each
//!   expert (tensor cores on sm_80+, the SIMT kernels elsewhere), then
//!   `moe_combine`.
//!
//! Experts are found through a per-layer device table `u64 [E]` of blob
//! addresses (docs/pack-format.md, "experts.bin and the expert blob"); every
//! kernel reads an expert's three global scales from its blob's tail, so no
//! call can drop them. Blob addresses must be 256-byte aligned (the pack's
//! blobs and cache slots are 4096-aligned). An expert id at or past the
//! table's length makes the rows that use it NaN (never a wild read).
//! Wrappers check lengths and shapes and return `Error::InvalidArgument`
//! before launching; everything is queued on `gpu.stream()`.
//!
//! Shapes: hidden and intermediate are any positive multiples of 16 (the
//! NVFP4 block). The fast kernels read 32-element chunks (16 code bytes, two
//! scales) of the dimension they reduce over (H for gate/up, I for down);
//! when that dimension is not a multiple of 32 (its code rows are then only
//! 8-byte aligned) the wrapper launches the generic `*16` kernel instead,
//! which reads one 16-element block (8 code bytes, one scale) at a time. The
//! grouped entry points then use the SIMT generic kernel for that matrix,
//! also on tensor-core devices (f32 throughout).

use super::{
    CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, Gpu, KernelArgs, LaunchConfig, PushKernelArg, PREWAIT_DOWN,
};
use crate::error::{Error, Result};
use crate::pack::format::ExpertLayout;

/// Largest `top_k` of the kernels (`MOE_MAX_TOP_K`).
pub const MAX_TOP_K: usize = 16;
/// Largest expert count of `route_topk` (`MOE_ROUTE_MAX_EXPERTS`).
pub const ROUTE_MAX_EXPERTS: usize = 1024;
/// Most experts `expert_gate_up_gemv_routed` routes inside the GEMV
/// (`MOE_FUSED_ROUTE_MAX`); above, it launches `route_topk` first.
pub const FUSED_ROUTE_MAX_EXPERTS: usize = 512;
/// Largest expert count of `group_by_expert` (its shared memory: 17 * E * 4 bytes).
pub const GROUP_MAX_EXPERTS: usize = 512;
/// Rows of one tile of the grouped GEMM (`MOE_TILE_M`); `tile_offsets` count these.
pub const TILE_M: usize = 64;

/// moe_route_topk is one warp per token.
const ROUTE_THREADS: u32 = 32;
const GU_WARPS: usize = 8;
const DOWN_WARPS: usize = 4;
/// The fast down GEMV (`moe_down_gemv`): output rows per block (`MOE_DN_ROWS`)
/// and threads per block (`MOE_DN_RW * MOE_DN_JW` warps).
const DOWN_FAST_ROWS: usize = 8;
const DOWN_FAST_THREADS: u32 = 512;
/// Static shared memory the kernels may add to their dynamic shared memory
/// (ptxas, sm_90: 4800 bytes in the fast down GEMV, 4416 in the tensor-core
/// one, 4224 in the fast gate/up GEMV); the dynamic limit is raised when
/// both together could pass the default.
const SMEM_STATIC_RESERVE: usize = 8 * 1024;
/// Rows per warp of the gate/up GEMV (`MOE_GEMV_ROWS`) and of the down GEMV (`MOE_DOWN_ROWS_PER_WARP`).
const GEMV_ROWS: usize = 2;
const DOWN_ROWS: usize = 4;
const GROUP_WARPS: usize = 16;
/// Default dynamic shared memory limit; above it a kernel's limit is raised.
const SMEM_DEFAULT: usize = 48 * 1024;
/// Threads of the tensor-core grouped GEMM (8 warps).
const MMA_THREADS: u32 = 256;
/// Output features per block of the tensor-core grouped GEMMs (gate/up: 128 of
/// each matrix; down: 256).
const MMA_FEATURES_GATE_UP: usize = 128;
const MMA_FEATURES_DOWN: usize = 256;

/// The blob layout passed to kernels by value (`MoeBlobLayout` in
/// kernels/moe.cu): u64 offsets inside a blob, mirroring
/// `pack::format::ExpertLayout` without its stride.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobLayout {
    pub hidden: u64,
    pub intermediate: u64,
    pub gate_codes: u64,
    pub gate_scales: u64,
    pub up_codes: u64,
    pub up_scales: u64,
    pub down_codes: u64,
    pub down_scales: u64,
    pub tail: u64,
}

// SAFETY: #[repr(C)] plain old data of nine u64, the layout of MoeBlobLayout.
unsafe impl DeviceRepr for BlobLayout {}

impl From<&ExpertLayout> for BlobLayout {
    fn from(l: &ExpertLayout) -> Self {
        BlobLayout {
            hidden: l.hidden,
            intermediate: l.intermediate,
            gate_codes: l.gate_codes,
            gate_scales: l.gate_scales,
            up_codes: l.up_codes,
            up_scales: l.up_scales,
            down_codes: l.down_codes,
            down_scales: l.down_scales,
            tail: l.tail,
        }
    }
}

impl BlobLayout {
    /// Both dimensions must be positive multiples of 16 (one E4M3 scale per
    /// 16 elements) and every section 16-byte aligned (the pack aligns them
    /// to 256): code rows of a dimension that is a multiple of 32 are then
    /// 16-byte aligned (the fast kernels), of any other multiple of 16 8-byte
    /// aligned (the generic kernels).
    fn check(&self) -> Result<(usize, usize)> {
        let (h, i) = (self.hidden as usize, self.intermediate as usize);
        if h == 0 || i == 0 || h % 16 != 0 || i % 16 != 0 || h > i32::MAX as usize / 8 || i > i32::MAX as usize / 8 {
            return Err(invalid(format!(
                "expert layout: hidden {h} and intermediate {i} must be positive multiples of 16"
            )));
        }
        let sections = [
            self.gate_codes,
            self.gate_scales,
            self.up_codes,
            self.up_scales,
            self.down_codes,
            self.down_scales,
            self.tail,
        ];
        if sections.iter().any(|o| o % 16 != 0) {
            return Err(invalid(format!("expert layout: every section must be 16-byte aligned: {self:?}")));
        }
        Ok((h, i))
    }
}

/// Whether the fast kernels (32-element chunks, 16-byte code loads) can
/// reduce over `cols`; otherwise the generic `*16` kernels run.
fn fast_cols(cols: usize) -> bool {
    cols % 32 == 0
}

/// Output rows of a tensor-core decode GEMV block (`moe_*_gemv_tc`: one
/// mma.sync tile), the K elements of one warp slice, the gate/up block's
/// warps and the shared memory of a down block's warp (its staged x slice).
const TC_ROWS: usize = 16;
const TC_SLICE: usize = 256;
const TC_GU_WARPS: usize = 8;
const TC_WARP_SMEM: usize = 1024;
/// `MOE_TC_DN_MAX_PARTS`: the (expert, K slice) partials a down block holds.
const TC_DN_MAX_PARTS: usize = 64;
/// `MOE_TC_DN_MAX_WARPS`: the most warps of a down block (its launch bounds).
const TC_DN_MAX_WARPS: usize = 24;

/// Whether the decode gate/up GEMV runs on tensor cores (`moe_gate_up_gemv_tc`):
/// the device allows it (`Gpu::tc_gemv`), H a multiple of 256, I of 16.
fn tc_gate_up(gpu: &Gpu, h: usize, i: usize) -> bool {
    gpu.tc_gemv() && h % TC_SLICE == 0 && i % TC_ROWS == 0
}

/// Whether the decode down GEMV runs on tensor cores (`moe_down_gemv_tc`):
/// the device allows it, I a multiple of 256, H of 16, and the block's
/// (expert, slice) partials within `TC_DN_MAX_PARTS`.
fn tc_down(gpu: &Gpu, h: usize, i: usize, top_k: usize) -> bool {
    gpu.tc_gemv() && i % TC_SLICE == 0 && h % TC_ROWS == 0 && top_k * (i / TC_SLICE) <= TC_DN_MAX_PARTS
}

/// Warps of a `moe_down_gemv_tc_st` block (`MOE_DN_ST_WARPS`).
const DN_ST_WARPS: usize = 8;

/// Whether the routed decode GEMVs take their staged pair (`moe_gate_up_gemv_tc_st` and
/// `moe_down_gemv_tc_st`, moe.cu section 2d): `Gpu::staged_moe`, and the down GEMV routes itself before its
/// wait (`PREWAIT_DOWN`), which is what the pair is for.
fn staged_pair(gpu: &Gpu) -> bool {
    gpu.staged_moe() && gpu.prewait(PREWAIT_DOWN)
}

/// The staged pair's shared memory: the dynamic bytes allowed, and the SMs' carveout set to its largest, so
/// a down block fits beside three gate/up blocks (an SM's carveout is chosen as its first blocks start).
fn allow_staged(f: &super::CudaFunction, bytes: usize) -> Result<()> {
    // (Always: with their static shared memory both pass the default 48 KB.)
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        i32_of("shared memory bytes", bytes)?,
    )?;
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )?;
    Ok(())
}

/// Warps of a `moe_down_gemv_tc` block: one per (expert, slice) part, at most `TC_DN_MAX_WARPS`.
fn tc_down_warps(i: usize, top_k: usize) -> usize {
    (top_k * (i / TC_SLICE)).clamp(1, TC_DN_MAX_WARPS)
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn need(what: &str, len: usize, want: usize) -> Result<()> {
    if len < want {
        return Err(invalid(format!("{what} holds {len} elements, {want} needed")));
    }
    Ok(())
}

fn i32_of(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| invalid(format!("{what} = {v} does not fit a 32-bit kernel argument")))
}

fn check_top_k(tokens: usize, top_k: usize) -> Result<()> {
    if top_k == 0 || top_k > MAX_TOP_K {
        return Err(invalid(format!("top_k {top_k} is not in 1..={MAX_TOP_K}")));
    }
    i32_of("tokens * top_k", tokens * top_k)?;
    Ok(())
}

/// Raises a kernel's dynamic shared memory limit to `bytes` when `bytes` plus
/// the kernel's static shared memory (at most `SMEM_STATIC_RESERVE`) could
/// exceed the default.
fn allow_smem(f: &super::CudaFunction, bytes: usize) -> Result<()> {
    if bytes + SMEM_STATIC_RESERVE > SMEM_DEFAULT {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32_of("shared memory bytes", bytes)?,
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Routing.

/// `moe::route` on the device: for each of `tokens` rows of `logits [T, E]`,
/// softmax in f32, the `top_k` largest probabilities (ties: the lower expert
/// id), renormalized to sum 1 when `norm_topk_prob`. Writes `ids [T * k]`
/// (highest probability first) and `weights [T * k]`. E <= 1024, k <= 16.
#[allow(clippy::too_many_arguments)]
pub fn route_topk(
    gpu: &Gpu,
    logits: &CudaSlice<f32>,
    tokens: usize,
    num_experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
    ids: &mut impl DevicePtrMut<u32>,
    weights: &mut CudaSlice<f32>,
) -> Result<()> {
    if num_experts == 0 || num_experts > ROUTE_MAX_EXPERTS {
        return Err(invalid(format!("route_topk: {num_experts} experts is not in 1..={ROUTE_MAX_EXPERTS}")));
    }
    check_top_k(tokens, top_k)?;
    if top_k > num_experts {
        return Err(invalid(format!("route_topk: top_k {top_k} of {num_experts} experts")));
    }
    need("route_topk: logits", logits.len(), tokens * num_experts)?;
    need("route_topk: ids", ids.len(), tokens * top_k)?;
    need("route_topk: weights", weights.len(), tokens * top_k)?;
    if tokens == 0 {
        return Ok(());
    }
    let f = gpu.function("moe_route_topk")?;
    let (e, k, norm) = (num_experts as i32, top_k as i32, norm_topk_prob as i32);
    let cfg = LaunchConfig { grid_dim: (tokens as u32, 1, 1), block_dim: (ROUTE_THREADS, 1, 1), shared_mem_bytes: 0 };
    let (ids_ptr, _ids_sync) = ids.device_ptr_mut(gpu.stream());
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(logits).arg(&e).arg(&k).arg(&norm).arg(&ids_ptr).arg(weights);
    // SAFETY: moe_route_topk(const float* logits [T, E], int E, int k, int norm,
    // unsigned* ids [T * k], float* weights [T * k]); lengths checked above.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Decode.

/// `act[t*k + j] = silu(gate_e . x_t) * (up_e . x_t)` for `e = ids[t*k + j]`,
/// each matrix with its own global scale from the blob tail.
/// `x [T, H]`, `ids [T * k]`, `table [E]` blob addresses, `act [T * k, I]`.
/// Meant for T <= 8 (decode); correct for any T. The shared expert is a
/// table of one entry, ids all 0, k = 1. On tensor cores where
/// `tc_gate_up` allows (x as f16 hi + lo after a power-of-two prescale,
/// f32 accumulation), else on CUDA cores in f32; `expert_down_gemv`
/// likewise (`tc_down`).
#[allow(clippy::too_many_arguments)]
pub fn expert_gate_up_gemv(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    ids: &impl DevicePtr<u32>,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    tokens: usize,
    top_k: usize,
    act: &mut CudaSlice<f32>,
) -> Result<()> {
    need("expert_gate_up_gemv: ids", ids.len(), tokens * top_k)?;
    gate_up_gemv_launch::<_, CudaSlice<u32>>(gpu, x, GateUpIds::Given(ids), table, layout, tokens, top_k, act)
}

/// Routing for `expert_gate_up_gemv_routed`: the router logits `[T, E]` and
/// what `route_topk` takes; the chosen ids and weights are written to `ids`
/// and `weights` `[T * k]` for the down GEMV (`ids` may be a view: a
/// layer's part of a buffer of every layer's ids).
pub struct Route<'a, I = CudaSlice<u32>> {
    pub logits: &'a CudaSlice<f32>,
    pub num_experts: usize,
    pub norm_topk_prob: bool,
    pub ids: &'a mut I,
    pub weights: &'a mut CudaSlice<f32>,
    /// The table may point into page-locked host memory (a mapped decode
    /// step): see `expert_down_gemv_routed`.
    pub host_blobs: bool,
}

/// `route_topk` fused into `expert_gate_up_gemv` (decode: one launch
/// fewer a layer): each block routes its token (the same operations as
/// `route_topk`, so the same ids and weights) and uses its choice; the
/// routing is written to `route.ids` / `route.weights`. Falls back to the
/// two launches where the fused kernel does not apply (H not a multiple of 32).
#[allow(clippy::too_many_arguments)]
pub fn expert_gate_up_gemv_routed<I: DevicePtr<u32> + DevicePtrMut<u32>>(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    route: Route<'_, I>,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    tokens: usize,
    top_k: usize,
    act: &mut CudaSlice<f32>,
) -> Result<()> {
    let (h, _) = layout.check()?;
    if !fast_cols(h) || route.num_experts > FUSED_ROUTE_MAX_EXPERTS {
        route_topk(
            gpu,
            route.logits,
            tokens,
            route.num_experts,
            top_k,
            route.norm_topk_prob,
            route.ids,
            route.weights,
        )?;
        return expert_gate_up_gemv(gpu, x, &*route.ids, table, layout, tokens, top_k, act);
    }
    // Here num_experts <= FUSED_ROUTE_MAX_EXPERTS (< ROUTE_MAX_EXPERTS).
    let e = route.num_experts;
    if e == 0 || top_k > e {
        return Err(invalid(format!("expert_gate_up_gemv_routed: top_k {top_k} of {e} experts")));
    }
    need("expert_gate_up_gemv_routed: logits", route.logits.len(), tokens * e)?;
    need("expert_gate_up_gemv_routed: ids", route.ids.len(), tokens * top_k)?;
    need("expert_gate_up_gemv_routed: weights", route.weights.len(), tokens * top_k)?;
    gate_up_gemv_launch::<CudaSlice<u32>, _>(gpu, x, GateUpIds::Routed(route), table, layout, tokens, top_k, act)
}

enum GateUpIds<'a, G, R> {
    Given(&'a G),
    Routed(Route<'a, R>),
}

#[allow(clippy::too_many_arguments)]
fn gate_up_gemv_launch<G: DevicePtr<u32>, R: DevicePtrMut<u32>>(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    ids: GateUpIds<'_, G, R>,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    tokens: usize,
    top_k: usize,
    act: &mut CudaSlice<f32>,
) -> Result<()> {
    let (h, i) = layout.check()?;
    check_top_k(tokens, top_k)?;
    need("expert_gate_up_gemv: x", x.len(), tokens * h)?;
    need("expert_gate_up_gemv: act", act.len(), tokens * top_k * i)?;
    let table_len = i32_of("table length", table.len())?;
    if tokens == 0 {
        return Ok(());
    }
    let routed = matches!(&ids, GateUpIds::Routed(_));
    let host_blobs = matches!(&ids, GateUpIds::Routed(r) if r.host_blobs);
    let tc = tc_gate_up(gpu, h, i) && !host_blobs;
    let fast = tc || fast_cols(h);
    // The staged pair (moe.cu section 2d) where its down GEMV follows: routed, the down GEMV routing itself.
    let staged = tc && routed && staged_pair(gpu);
    let f = gpu.function(if staged {
        "moe_gate_up_gemv_tc_st"
    } else if tc {
        "moe_gate_up_gemv_tc"
    } else if fast {
        "moe_gate_up_gemv"
    } else {
        "moe_gate_up_gemv16"
    })?;
    let cfg = if tc {
        // 16 rows of gate and up a block, its 8 warps over K in 256-element slices (staged: a unit of
        // shared memory per slice).
        let smem = if staged { TC_GU_WARPS * (h / TC_SLICE).div_ceil(TC_GU_WARPS) * FU_SLOT } else { 0 };
        if staged {
            allow_staged(&f, smem)?;
        }
        LaunchConfig {
            grid_dim: ((tokens * top_k) as u32, (i / TC_ROWS) as u32, 1),
            block_dim: ((TC_GU_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    } else {
        let smem = h * 4;
        allow_smem(&f, smem)?;
        LaunchConfig {
            grid_dim: ((tokens * top_k) as u32, i.div_ceil(GU_WARPS * GEMV_ROWS) as u32, 1),
            block_dim: ((GU_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    };
    let k = top_k as i32;
    let (e, norm) = match &ids {
        GateUpIds::Routed(r) => (r.num_experts as i32, r.norm_topk_prob as i32),
        GateUpIds::Given(_) => (0, 0),
    };
    if fast {
        let mut a = KernelArgs::new();
        a.buf(gpu, x);
        match &ids {
            GateUpIds::Given(ids) => a.buf(gpu, *ids),
            GateUpIds::Routed(_) => a.null(),
        };
        a.buf(gpu, table).val(table_len).val(*layout).val(k).buf_mut(gpu, act);
        match ids {
            GateUpIds::Routed(r) => {
                a.buf(gpu, r.logits).val(e).val(norm).buf_mut(gpu, r.ids).buf_mut(gpu, r.weights);
            }
            GateUpIds::Given(_) => {
                a.null().val(e).val(norm).null().null();
            }
        }
        // The down GEMV after a routed one may route before its wait (expert_down_gemv_routed): then trigger it
        // only after this kernel's wait, when the router's logits are final.
        a.val((routed && gpu.prewait(PREWAIT_DOWN)) as i32);
        // SAFETY: moe_gate_up_gemv[_tc[_st]](const float* x [T, H], const unsigned* ids [T*k] or null, const u64* table
        // [table_len], int table_len, MoeBlobLayout, int k, float* act [T*k, I], const float* logits [T, E] or
        // null, int E, int norm, unsigned* ids_out [T*k], float* weights_out [T*k], int late_trigger) (null ids exactly when logits
        // are given); lengths checked above and by the callers; ids past the table give NaN rows; the kernel waits
        // for its predecessor (strata_pdl_wait) before touching memory.
        unsafe { gpu.launch(&f, cfg, &mut a) }?;
        return Ok(());
    }
    let GateUpIds::Given(ids) = ids else { unreachable!("expert_gate_up_gemv_routed routes only on the fast kernel") };
    let (ids_ptr, _ids_sync) = ids.device_ptr(gpu.stream());
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(&ids_ptr).arg(table).arg(&table_len).arg(layout).arg(&k).arg(act);
    // SAFETY: moe_gate_up_gemv16(const float* x [T, H], const unsigned* ids [T*k], const u64* table [table_len],
    // int table_len, MoeBlobLayout, int k, float* act [T*k, I]); lengths checked above; ids past the table give
    // NaN rows.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `out[t] (+)= sum_j weights[t*k + j] * (down_e . act[t*k + j])` for
/// `e = ids[t*k + j]`, with the down matrix's global scale from the blob tail;
/// the sum over j runs in j order (deterministic). `act [T * k, I]`,
/// `out [T, H]`; `accumulate` adds to `out` instead of overwriting it (the
/// shared expert: weights = its sigmoid gate, k = 1).
#[allow(clippy::too_many_arguments)]
pub fn expert_down_gemv(
    gpu: &Gpu,
    act: &CudaSlice<f32>,
    ids: &impl DevicePtr<u32>,
    weights: &CudaSlice<f32>,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    tokens: usize,
    top_k: usize,
    out: &mut CudaSlice<f32>,
    accumulate: bool,
) -> Result<()> {
    expert_down_gemv_routed(gpu, act, ids, weights, None, false, table, layout, tokens, top_k, out, accumulate)
}

/// The router logits a decode down GEMV may route from itself
/// (`expert_down_gemv_routed`): what `Route` gives the gate/up GEMV.
#[derive(Clone, Copy)]
pub struct Logits<'a> {
    pub logits: &'a CudaSlice<f32>,
    pub num_experts: usize,
    pub norm_topk_prob: bool,
}

/// `expert_down_gemv` after `expert_gate_up_gemv_routed` (decode): given
/// the router logits, the kernel routes each token itself (the same
/// operations, so the ids and weights in `ids` / `weights`) before its
/// programmatic wait, and issues its first weight loads there too, so they
/// overlap the end of the gate/up GEMV (`Gpu::prewait`; its CUDA-core and
/// tensor-core kernels, E <= 512). Otherwise it reads `ids` and `weights`.
/// **Call it only right after `expert_gate_up_gemv_routed` on the same
/// logits**: that kernel then triggers this one only after its own wait, so
/// the router's logits are final when this one starts; after anything else
/// the routing may read logits still being written (wrong experts, though
/// never a read outside the table).
///
/// `host_blobs`: the table may point into page-locked host memory (a mapped
/// decode step), so both GEMVs (`Route::host_blobs`) take their CUDA-core
/// kernels, whose warps read 512 contiguous bytes of a row per load: the
/// tensor-core ones read 64-byte pieces of 8 rows, which the host link
/// serves slower (H200, 25% of the experts in slots: 20.4 ms a step
/// against 17.6 ms; docs/performance.md).
#[allow(clippy::too_many_arguments)]
pub fn expert_down_gemv_routed(
    gpu: &Gpu,
    act: &CudaSlice<f32>,
    ids: &impl DevicePtr<u32>,
    weights: &CudaSlice<f32>,
    logits: Option<Logits<'_>>,
    host_blobs: bool,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    tokens: usize,
    top_k: usize,
    out: &mut CudaSlice<f32>,
    accumulate: bool,
) -> Result<()> {
    let (h, i) = layout.check()?;
    check_top_k(tokens, top_k)?;
    need("expert_down_gemv: act", act.len(), tokens * top_k * i)?;
    need("expert_down_gemv: ids", ids.len(), tokens * top_k)?;
    need("expert_down_gemv: weights", weights.len(), tokens * top_k)?;
    need("expert_down_gemv: out", out.len(), tokens * h)?;
    let table_len = i32_of("table length", table.len())?;
    if tokens == 0 {
        return Ok(());
    }
    let tc = tc_down(gpu, h, i, top_k) && !host_blobs;
    let fast = tc || fast_cols(i);
    if fast && !tc && (h * i / 2) as u64 > u32::MAX as u64 {
        // moe_down_gemv keeps row offsets in 32 bits.
        return Err(invalid(format!("expert_down_gemv: hidden {h} x intermediate {i} is too large")));
    }
    let routed = logits.filter(|l| {
        fast && gpu.prewait(PREWAIT_DOWN)
            && l.num_experts > 0
            && l.num_experts <= FUSED_ROUTE_MAX_EXPERTS
            && top_k <= l.num_experts
    });
    // The staged kernel only after the staged gate/up GEMV (`staged_pair`), which triggers it after its wait.
    let staged = tc && routed.is_some() && staged_pair(gpu);
    let f = gpu.function(if staged {
        "moe_down_gemv_tc_st"
    } else if tc {
        "moe_down_gemv_tc"
    } else if fast {
        "moe_down_gemv"
    } else {
        "moe_down_gemv16"
    })?;
    let smem = if staged {
        top_k * (i / TC_SLICE) * FU_SLOT / 2
    } else if tc {
        tc_down_warps(i, top_k) * TC_WARP_SMEM
    } else {
        top_k * i * 4
    };
    if staged {
        allow_staged(&f, smem)?;
    } else {
        allow_smem(&f, smem)?;
    }
    let cfg = if staged {
        // 16 output rows a block; DN_ST_WARPS warps over the (expert, K slice) parts, each part's weights in
        // shared memory.
        LaunchConfig {
            grid_dim: (tokens as u32, (h / TC_ROWS) as u32, 1),
            block_dim: ((DN_ST_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    } else if tc {
        // 16 output rows a block; its warps over the (expert, 256-element K slice) parts.
        LaunchConfig {
            grid_dim: (tokens as u32, (h / TC_ROWS) as u32, 1),
            block_dim: ((tc_down_warps(i, top_k) * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    } else if fast {
        // 8 output rows per block; 16 warps: 2 row groups x 8 expert warps
        // (experts j and j + 8), per-expert partials added in j order.
        LaunchConfig {
            grid_dim: (tokens as u32, h.div_ceil(DOWN_FAST_ROWS) as u32, 1),
            block_dim: (DOWN_FAST_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    } else {
        // One warp per row group (4 rows), all experts in order.
        LaunchConfig {
            grid_dim: (tokens as u32, h.div_ceil(DOWN_WARPS * DOWN_ROWS) as u32, 1),
            block_dim: ((DOWN_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        }
    };
    let (k, acc) = (top_k as i32, accumulate as i32);
    if fast {
        if let Some(l) = routed {
            need("expert_down_gemv_routed: logits", l.logits.len(), tokens * l.num_experts)?;
        }
        let mut a = KernelArgs::new();
        a.buf(gpu, act).buf(gpu, ids).buf(gpu, weights).buf(gpu, table).val(table_len).val(*layout).val(k);
        a.buf_mut(gpu, out).val(acc);
        match routed {
            Some(l) => a.buf(gpu, l.logits).val(l.num_experts as i32).val(l.norm_topk_prob as i32),
            None => a.null().val(0i32).val(0i32),
        };
        // SAFETY: moe_down_gemv / moe_down_gemv_tc[_st] take moe_down_gemv16's arguments (below) plus (const float* logits [T, E] or null, int E,
        // int norm) (E <= MOE_FUSED_ROUTE_MAX, top_k <= E, length checked above); both wait for their predecessor
        // (strata_pdl_wait) before touching memory, except (logits given) the logits, the table and the expert
        // blobs (codes, scales, tails): the caller's predecessor is the routed gate/up GEMV, which triggers only
        // after its own wait.
        unsafe { gpu.launch(&f, cfg, &mut a) }?;
        return Ok(());
    }
    let (ids_ptr, _ids_sync) = ids.device_ptr(gpu.stream());
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(act).arg(&ids_ptr).arg(weights).arg(table).arg(&table_len).arg(layout).arg(&k).arg(out).arg(&acc);
    // SAFETY: moe_down_gemv16(const float* act [T*k, I], const unsigned* ids,
    // const float* weights [T*k], const u64* table, int table_len, MoeBlobLayout, int k, float* out [T, H], int accumulate).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

// ---------------------------------------------------------------------------
// The decode MoE of one token in one launch (`moe_fused_decode_tc`).

/// A `moe_fused_decode_tc` block's warps, the most tiles and K slices a
/// block holds (`MOE_FU_MAX_*`), and the bytes of a ring slot (`MOE_FU_SLOT`).
const FU_WARPS: usize = 8;
const FU_MAX_TG: usize = 6;
const FU_MAX_TD: usize = 16;
const FU_MAX_P: usize = 4;
const FU_SLOT: usize = 4608;
/// Cluster sizes the fused kernel may take, the preferred first (16: every
/// SM holds a block with 8 clusters of k = 8; 8: half of them).
const FU_CLUSTERS: [usize; 2] = [16, 8];
/// The largest cluster (the counters' length).
const FU_MAX_CS: usize = 16;

/// What `fused_decode` needs besides the step's buffers: each expert's sums
/// of the token's output rows (`[k, H]`) and the clusters' arrival counters
/// (zero between launches).
pub struct FusedScratch {
    part: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    /// The global exchange's arrival counts per expert slot (they only grow).
    xchg: CudaSlice<u32>,
}

impl FusedScratch {
    pub fn new(gpu: &Gpu, hidden: usize, top_k: usize) -> Result<FusedScratch> {
        Ok(FusedScratch {
            part: gpu.alloc_zeros(hidden * top_k.max(1))?,
            counters: gpu.alloc_zeros(FU_MAX_CS)?,
            xchg: gpu.alloc_zeros(MAX_TOP_K)?,
        })
    }
}

/// How `moe_fused_decode_tc` runs a shape: blocks an expert, whether they
/// form a cluster (sharing the activations in distributed shared memory) or
/// exchange them through global memory (every block of the grid resident at
/// once), and ring slots a warp (0: every weight of the block in shared
/// memory at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedShape {
    pub cluster: usize,
    pub global: bool,
    pub ring: usize,
}

impl FusedShape {
    /// Shared memory of one warp's units for hidden `h` and intermediate `i`.
    fn warp_bytes(&self, h: usize, i: usize) -> usize {
        if self.ring > 0 {
            return self.ring * FU_SLOT;
        }
        let cs = self.cluster;
        let gu = i / (TC_ROWS * cs) * (h / TC_SLICE).div_ceil(FU_WARPS);
        let dn = (h / (TC_ROWS * cs) * (i / TC_SLICE)).div_ceil(FU_WARPS);
        gu * FU_SLOT + dn * FU_SLOT / 2
    }

    /// Dynamic shared memory of a block.
    pub fn smem(&self, h: usize, i: usize) -> usize {
        FU_WARPS * self.warp_bytes(h, i)
    }
}

/// Whether the shapes suit `moe_fused_decode_tc` in clusters of `cs` (H and
/// I multiples of 16 * cs and of 256, within its tile bounds; k and E within
/// the routing's).
fn fused_shapes(cs: usize, h: usize, i: usize, top_k: usize, num_experts: usize) -> bool {
    let step = TC_ROWS * cs;
    h % step == 0
        && i % step == 0
        && h % TC_SLICE == 0
        && i % TC_SLICE == 0
        && i / step <= FU_MAX_TG
        && h / step <= FU_MAX_TD
        && i / TC_SLICE <= FU_MAX_P
        && (1..=MAX_TOP_K).contains(&top_k)
        && (top_k..=FUSED_ROUTE_MAX_EXPERTS).contains(&num_experts)
}

/// How `fused_decode` runs a token of this shape on `gpu`, or `None` where
/// it does not apply: the fused kernel is off (`Gpu::fused_moe`, sm_90+),
/// the shapes do not suit it, or the device cannot run the whole grid (the
/// global exchange) or the `top_k` clusters at once. In order: 16 blocks an
/// expert exchanging through global memory with every weight in shared
/// memory, then clusters of 16 and of 8 with the most ring slots (2 to 6)
/// that still run k clusters at once. `STRATA_FUSED_SHAPE` may name one
/// (`global`, `cluster16`, `cluster8`). Asked of the driver once per device
/// and shape.
pub fn fused_decode_shape(gpu: &Gpu, h: usize, i: usize, top_k: usize, num_experts: usize) -> Option<FusedShape> {
    if !gpu.fused_moe() {
        return None;
    }
    type Key = (usize, usize, usize, usize, usize);
    static SHAPES: parking_lot::Mutex<Vec<(Key, Option<FusedShape>)>> = parking_lot::Mutex::new(Vec::new());
    let key = (gpu.ordinal(), h, i, top_k, num_experts);
    let mut shapes = SHAPES.lock();
    if let Some((_, s)) = shapes.iter().find(|(k, _)| *k == key) {
        return *s;
    }
    let only = std::env::var("STRATA_FUSED_SHAPE").ok();
    let wanted = |name: &str| only.as_deref().is_none_or(|o| o.trim() == name);
    let mut candidates = Vec::new();
    if wanted("global") {
        candidates.push(FusedShape { cluster: 16, global: true, ring: 0 });
    }
    for cs in FU_CLUSTERS {
        if wanted(&format!("cluster{cs}")) {
            candidates.extend((2..=6).rev().map(|ring| FusedShape { cluster: cs, global: false, ring }));
        }
    }
    let found = candidates.into_iter().find(|s| {
        fused_shapes(s.cluster, h, i, top_k, num_experts) && fused_runs_at_once(gpu, *s, h, i, top_k).unwrap_or(false)
    });
    shapes.push((key, found));
    found
}

/// Whether the device runs a launch of `moe_fused_decode_tc` in `shape` for
/// `top_k` experts in one wave: the whole grid (global exchange: its blocks
/// wait for each other) or the k clusters.
fn fused_runs_at_once(gpu: &Gpu, shape: FusedShape, h: usize, i: usize, top_k: usize) -> Result<bool> {
    let smem = shape.smem(h, i);
    if shape.global {
        let f = gpu.function("moe_fused_decode_tc")?;
        allow_smem(&f, smem)?;
        let per_sm = gpu.max_active_blocks(&f, (FU_WARPS * 32) as u32, smem)?;
        return Ok(per_sm * gpu.sm_count() as usize >= top_k * shape.cluster);
    }
    Ok(fused_clusters(gpu, shape.cluster, smem)? >= top_k)
}

/// How many clusters of `cluster` `moe_fused_decode_tc` blocks with `smem`
/// bytes of dynamic shared memory each the driver runs at once on `gpu`.
pub fn fused_clusters(gpu: &Gpu, cluster: usize, smem: usize) -> Result<usize> {
    let f = gpu.function("moe_fused_decode_tc")?;
    allow_smem(&f, smem)?;
    gpu.allow_large_clusters(&f)?;
    let cfg = LaunchConfig {
        grid_dim: (cluster as u32, 1, 1),
        block_dim: ((FU_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    gpu.max_active_clusters(&f, cfg, cluster as u32)
}

/// One token's routed experts in one launch (decode, T = 1): the results of
/// `expert_gate_up_gemv_routed` then `expert_down_gemv_routed`, bit for bit
/// (`route`'s ids and weights, `act [k, I]`, `out [H]`, added to where
/// `accumulate`), by 16 blocks an expert that share the expert's
/// activations (kernels/moe.cu, section 2c; `FusedShape`).
/// Only where `fused_decode_shape` gives a shape; `route.host_blobs` must be false.
#[allow(clippy::too_many_arguments)]
pub fn fused_decode<I: DevicePtr<u32> + DevicePtrMut<u32>>(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    route: Route<'_, I>,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    top_k: usize,
    act: &mut CudaSlice<f32>,
    scratch: &mut FusedScratch,
    out: &mut CudaSlice<f32>,
    accumulate: bool,
) -> Result<()> {
    let (h, i) = layout.check()?;
    let e = route.num_experts;
    if route.host_blobs {
        return Err(invalid("fused_decode: the table may point into host memory".into()));
    }
    let Some(shape) = fused_decode_shape(gpu, h, i, top_k, e) else {
        return Err(invalid(format!(
            "fused_decode: hidden {h}, intermediate {i}, top_k {top_k} of {e} experts do not fit the fused kernel \
             on this device"
        )));
    };
    need("fused_decode: x", x.len(), h)?;
    need("fused_decode: logits", route.logits.len(), e)?;
    need("fused_decode: ids", route.ids.len(), top_k)?;
    need("fused_decode: weights", route.weights.len(), top_k)?;
    need("fused_decode: act", act.len(), top_k * i)?;
    need("fused_decode: out", out.len(), h)?;
    need("fused_decode: part", scratch.part.len(), top_k * h)?;
    need("fused_decode: counters", scratch.counters.len(), shape.cluster)?;
    let table_len = i32_of("table length", table.len())?;
    let f = gpu.function("moe_fused_decode_tc")?;
    let smem = shape.smem(h, i);
    allow_smem(&f, smem)?;
    gpu.allow_large_clusters(&f)?;
    let cfg = LaunchConfig {
        grid_dim: ((top_k * shape.cluster) as u32, 1, 1),
        block_dim: ((FU_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let warp_bytes = i32_of("fused_decode: a warp's shared memory", shape.warp_bytes(h, i))?;
    let mut a = KernelArgs::new();
    a.buf(gpu, x).buf(gpu, table).val(table_len).val(*layout).val(top_k as i32);
    a.buf(gpu, route.logits).val(e as i32).val(route.norm_topk_prob as i32);
    a.buf_mut(gpu, route.ids).buf_mut(gpu, route.weights).buf_mut(gpu, act);
    a.buf_mut(gpu, &mut scratch.part).buf_mut(gpu, &mut scratch.counters).buf_mut(gpu, out).val(accumulate as i32);
    a.val(shape.ring as i32).val(shape.cluster as i32);
    if shape.global {
        a.buf_mut(gpu, &mut scratch.xchg);
    } else {
        a.null();
    }
    a.val(warp_bytes);
    // SAFETY: moe_fused_decode_tc(const float* x [H], const u64* table [table_len], int table_len, MoeBlobLayout,
    // int k, const float* logits [E], int E, int norm, unsigned* ids_out [k], float* weights_out [k], float* act
    // [k, I], float* part [k, H], unsigned* counters [CS] (zero), float* out [H], int accumulate, int ring, int
    // group, unsigned* xchg [k] or null, int warp_bytes); lengths and shapes checked above (fused_decode_shape: the
    // kernel's bounds, and its shared memory fits the device, since the driver runs the grid or its clusters at
    // once, which the global exchange's waits need); grid x = k groups of shape.cluster blocks; ids past the table
    // give NaN rows; the kernel waits for its predecessor (strata_pdl_wait) before touching memory.
    if shape.global {
        unsafe { gpu.launch(&f, cfg, &mut a) }?;
    } else {
        unsafe { gpu.launch_cluster(&f, cfg, shape.cluster as u32, &mut a) }?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Prefill.

/// The assignments `a = t * k + j` of a batch sorted by expert on the device
/// (`moe::group_by_expert`): slot `s` in `[offsets[e], offsets[e+1])` belongs
/// to expert `e`, and an expert's slots are in ascending `a` (token order).
pub struct ExpertGrouping {
    pub tokens: usize,
    pub top_k: usize,
    pub num_experts: usize,
    /// `[E + 1]` exclusive scan of the per-expert counts.
    pub offsets: CudaSlice<u32>,
    /// `[E + 1]` exclusive scan of `ceil(count / TILE_M)`: the grouped GEMM's row tiles.
    pub tile_offsets: CudaSlice<u32>,
    /// `[T * k]` slot -> assignment `t * k + j`.
    pub rows: CudaSlice<u32>,
    /// `[T * k]` assignment -> slot (`u32::MAX` for an id >= E).
    pub slot_of: CudaSlice<u32>,
    /// `[T * k]` slot -> expert.
    pub slot_expert: CudaSlice<u32>,
}

impl ExpertGrouping {
    /// Buffers for up to `max_assignments` (T * k) assignments over `num_experts`.
    pub fn new(gpu: &Gpu, max_assignments: usize, num_experts: usize) -> Result<Self> {
        let n = max_assignments.max(1);
        Ok(ExpertGrouping {
            tokens: 0,
            top_k: 1,
            num_experts,
            offsets: gpu.alloc_zeros(num_experts + 1)?,
            tile_offsets: gpu.alloc_zeros(num_experts + 1)?,
            rows: gpu.alloc_zeros(n)?,
            slot_of: gpu.alloc_zeros(n)?,
            slot_expert: gpu.alloc_zeros(n)?,
        })
    }

    pub fn assignments(&self) -> usize {
        self.tokens * self.top_k
    }

    /// An upper bound on the number of row tiles (grid size of the grouped GEMM).
    fn max_tiles(&self) -> usize {
        let n = self.assignments();
        n.div_ceil(TILE_M) + n.min(self.num_experts)
    }
}

/// Groups `ids [T * k]` by expert into new buffers (see `group_by_expert_into`).
pub fn group_by_expert(
    gpu: &Gpu,
    ids: &CudaSlice<u32>,
    tokens: usize,
    top_k: usize,
    num_experts: usize,
) -> Result<ExpertGrouping> {
    let mut g = ExpertGrouping::new(gpu, tokens * top_k, num_experts)?;
    group_by_expert_into(gpu, ids, tokens, top_k, &mut g)?;
    Ok(g)
}

/// Counting sort of the assignments by expert on the device, one block,
/// deterministic (no atomics): fills `g`'s offsets, tile offsets, rows,
/// slot_of and slot_expert for `tokens * top_k` assignments.
pub fn group_by_expert_into(
    gpu: &Gpu,
    ids: &CudaSlice<u32>,
    tokens: usize,
    top_k: usize,
    g: &mut ExpertGrouping,
) -> Result<()> {
    let e = g.num_experts;
    if e == 0 || e > GROUP_MAX_EXPERTS {
        return Err(invalid(format!("group_by_expert: {e} experts is not in 1..={GROUP_MAX_EXPERTS}")));
    }
    check_top_k(tokens, top_k)?;
    let n = tokens * top_k;
    need("group_by_expert: ids", ids.len(), n)?;
    need("group_by_expert: offsets", g.offsets.len(), e + 1)?;
    need("group_by_expert: tile_offsets", g.tile_offsets.len(), e + 1)?;
    need("group_by_expert: rows", g.rows.len(), n)?;
    need("group_by_expert: slot_of", g.slot_of.len(), n)?;
    need("group_by_expert: slot_expert", g.slot_expert.len(), n)?;
    g.tokens = tokens;
    g.top_k = top_k;
    let f = gpu.function("moe_group_by_expert")?;
    let smem = (GROUP_WARPS + 1) * e * 4;
    allow_smem(&f, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: ((GROUP_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (n_i, e_i) = (n as i32, e as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(ids)
        .arg(&n_i)
        .arg(&e_i)
        .arg(&mut g.offsets)
        .arg(&mut g.tile_offsets)
        .arg(&mut g.rows)
        .arg(&mut g.slot_of)
        .arg(&mut g.slot_expert);
    // SAFETY: moe_group_by_expert(const unsigned* ids [n], int n, int E, unsigned* offsets [E+1],
    // unsigned* tile_offsets [E+1], unsigned* rows [n], unsigned* slot_of [n], unsigned* slot_expert [n]).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

fn check_grouped(what: &str, g: &ExpertGrouping, table: &CudaSlice<u64>) -> Result<i32> {
    if g.top_k == 0 || g.top_k > MAX_TOP_K {
        return Err(invalid(format!("{what}: the grouping was not filled (top_k {})", g.top_k)));
    }
    need(&format!("{what}: rows"), g.rows.len(), g.assignments())?;
    need(&format!("{what}: slot_expert"), g.slot_expert.len(), g.assignments())?;
    need(&format!("{what}: offsets"), g.offsets.len(), g.num_experts + 1)?;
    need(&format!("{what}: tile_offsets"), g.tile_offsets.len(), g.num_experts + 1)?;
    need(&format!("{what}: table"), table.len(), g.num_experts)?;
    i32_of("table length", table.len())
}

/// Whether the grouped GEMMs run on tensor cores on this device (sm_80+)
/// for layouts whose dimensions are multiples of 32.
pub fn grouped_uses_tensor_cores(gpu: &Gpu) -> bool {
    gpu.compute_capability().0 >= 8
}

/// Whether `expert_gate_up_grouped` and `expert_down_grouped` run on tensor
/// cores for `layout` on this device: sm_80+ and the dimension the matrix
/// reduces over (H for gate/up, I for down) a multiple of 32; otherwise the
/// SIMT kernels (f32) run. Returns (gate/up, down).
pub fn grouped_tensor_core_paths(gpu: &Gpu, layout: &BlobLayout) -> (bool, bool) {
    let tc = grouped_uses_tensor_cores(gpu);
    (tc && fast_cols(layout.hidden as usize), tc && fast_cols(layout.intermediate as usize))
}

/// Operand precision of the grouped tensor-core kernels (the weights are
/// exact in bf16; this is the rounding of the activations: x for gate/up, act
/// for down). The SIMT kernels (no tensor cores, or a reduced dimension not a
/// multiple of 32) are f32 whatever this says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GroupedPrecision {
    /// Activations rounded to bf16 (one mma per fragment; 2^-9 relative).
    #[default]
    Bf16,
    /// Activations as bf16 hi + lo (two mma per fragment into the same f32
    /// accumulators), ~16 significant bits: about twice the MMA time.
    Split,
}

/// `act[s] = silu(gate_e . x_t) * (up_e . x_t)` for every slot `s` of the
/// grouping (`t = rows[s] / k`, `e` its expert): the rows of each expert as
/// one GEMM (tensor cores when `grouped_tensor_core_paths(..).0`, else the
/// SIMT kernel). `x [T, H]`, `act [T * k, I]` in slot order.
/// `expert_gate_up_grouped_with(.., GroupedPrecision::Bf16)`.
pub fn expert_gate_up_grouped(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    g: &ExpertGrouping,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    act: &mut CudaSlice<f32>,
) -> Result<()> {
    expert_gate_up_grouped_with(gpu, x, g, table, layout, act, GroupedPrecision::Bf16)
}

/// `expert_gate_up_grouped` with the tensor-core operand precision chosen
/// (`moe_gate_up_grouped_mma` or `moe_gate_up_grouped_mma_split`).
pub fn expert_gate_up_grouped_with(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    g: &ExpertGrouping,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    act: &mut CudaSlice<f32>,
    precision: GroupedPrecision,
) -> Result<()> {
    if !grouped_tensor_core_paths(gpu, layout).0 {
        return expert_gate_up_grouped_simple(gpu, x, g, table, layout, act);
    }
    let (h, i) = layout.check()?;
    check_grouped("expert_gate_up_grouped", g, table)?;
    let n = g.assignments();
    need("expert_gate_up_grouped: x", x.len(), g.tokens * h)?;
    need("expert_gate_up_grouped: act", act.len(), n * i)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(match precision {
        GroupedPrecision::Bf16 => "moe_gate_up_grouped_mma",
        GroupedPrecision::Split => "moe_gate_up_grouped_mma_split",
    })?;
    let cfg = LaunchConfig {
        grid_dim: (g.max_tiles() as u32, i.div_ceil(MMA_FEATURES_GATE_UP) as u32, 1),
        block_dim: (MMA_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (e, k) = (g.num_experts as i32, g.top_k as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(x).arg(&g.rows).arg(&g.offsets).arg(&g.tile_offsets).arg(&e).arg(table).arg(layout).arg(&k).arg(act);
    // SAFETY: moe_gate_up_grouped_mma[_split](const float* x [T, H], const unsigned* rows [n],
    // const unsigned* offsets [E+1], const unsigned* tile_offsets [E+1], int E, const u64* table [>= E],
    // MoeBlobLayout, int k, float* act [n, I]); blocks past tile_offsets[E] exit.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `y[s] = down_e . act[s]` for every slot (`y [T * k, H]` in slot order);
/// tensor cores when `grouped_tensor_core_paths(..).1`, else the SIMT kernel.
/// `expert_down_grouped_with(.., GroupedPrecision::Bf16)`.
pub fn expert_down_grouped(
    gpu: &Gpu,
    act: &CudaSlice<f32>,
    g: &ExpertGrouping,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    expert_down_grouped_with(gpu, act, g, table, layout, y, GroupedPrecision::Bf16)
}

/// `expert_down_grouped` with the tensor-core operand precision chosen
/// (`moe_down_grouped_mma` or `moe_down_grouped_mma_split`).
pub fn expert_down_grouped_with(
    gpu: &Gpu,
    act: &CudaSlice<f32>,
    g: &ExpertGrouping,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    y: &mut CudaSlice<f32>,
    precision: GroupedPrecision,
) -> Result<()> {
    if !grouped_tensor_core_paths(gpu, layout).1 {
        return expert_down_grouped_simple(gpu, act, g, table, layout, y);
    }
    let (h, i) = layout.check()?;
    check_grouped("expert_down_grouped", g, table)?;
    let n = g.assignments();
    need("expert_down_grouped: act", act.len(), n * i)?;
    need("expert_down_grouped: y", y.len(), n * h)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(match precision {
        GroupedPrecision::Bf16 => "moe_down_grouped_mma",
        GroupedPrecision::Split => "moe_down_grouped_mma_split",
    })?;
    let cfg = LaunchConfig {
        grid_dim: (g.max_tiles() as u32, h.div_ceil(MMA_FEATURES_DOWN) as u32, 1),
        block_dim: (MMA_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let e = g.num_experts as i32;
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(act).arg(&g.offsets).arg(&g.tile_offsets).arg(&e).arg(table).arg(layout).arg(y);
    // SAFETY: moe_down_grouped_mma[_split](const float* act [n, I], const unsigned* offsets [E+1],
    // const unsigned* tile_offsets [E+1], int E, const u64* table [>= E], MoeBlobLayout, float* y [n, H]).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `expert_gate_up_grouped` by the SIMT kernel (f32 throughout; one slot per block row).
pub fn expert_gate_up_grouped_simple(
    gpu: &Gpu,
    x: &CudaSlice<f32>,
    g: &ExpertGrouping,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    act: &mut CudaSlice<f32>,
) -> Result<()> {
    let (h, i) = layout.check()?;
    let table_len = check_grouped("expert_gate_up_grouped", g, table)?;
    let n = g.assignments();
    need("expert_gate_up_grouped: x", x.len(), g.tokens * h)?;
    need("expert_gate_up_grouped: act", act.len(), n * i)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(if fast_cols(h) { "moe_gate_up_grouped_simple" } else { "moe_gate_up_grouped16" })?;
    let smem = h * 4;
    allow_smem(&f, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, i.div_ceil(GU_WARPS * GEMV_ROWS) as u32, 1),
        block_dim: ((GU_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let k = g.top_k as i32;
    let mut b = gpu.stream().launch_builder(&f);
    let filled = g.offsets.slice(g.num_experts..);
    b.arg(x).arg(&g.rows).arg(&g.slot_expert).arg(&filled).arg(table).arg(&table_len).arg(layout).arg(&k).arg(act);
    // SAFETY: moe_gate_up_grouped_simple / moe_gate_up_grouped16(const float* x [T, H], const unsigned* rows [n],
    // const unsigned* slot_expert [n], const unsigned* filled (&offsets[E]), const u64* table,
    // int table_len, MoeBlobLayout, int k, float* act [n, I]).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `expert_down_grouped` by the SIMT kernel (f32 throughout).
pub fn expert_down_grouped_simple(
    gpu: &Gpu,
    act: &CudaSlice<f32>,
    g: &ExpertGrouping,
    table: &CudaSlice<u64>,
    layout: &BlobLayout,
    y: &mut CudaSlice<f32>,
) -> Result<()> {
    let (h, i) = layout.check()?;
    let table_len = check_grouped("expert_down_grouped", g, table)?;
    let n = g.assignments();
    need("expert_down_grouped: act", act.len(), n * i)?;
    need("expert_down_grouped: y", y.len(), n * h)?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.function(if fast_cols(i) { "moe_down_grouped_simple" } else { "moe_down_grouped16" })?;
    let smem = i * 4;
    allow_smem(&f, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, h.div_ceil(DOWN_WARPS * DOWN_ROWS) as u32, 1),
        block_dim: ((DOWN_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut b = gpu.stream().launch_builder(&f);
    let filled = g.offsets.slice(g.num_experts..);
    b.arg(act).arg(&g.slot_expert).arg(&filled).arg(table).arg(&table_len).arg(layout).arg(y);
    // SAFETY: moe_down_grouped_simple / moe_down_grouped16(const float* act [n, I], const unsigned* slot_expert [n],
    // const unsigned* filled (&offsets[E]), const u64* table, int table_len, MoeBlobLayout, float* y [n, H]).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `out[t] (+)= sum_j weights[t*k + j] * y[slot_of(t*k + j)]`, j in order.
/// `y [T * k, H]` in slot order, `out [T, H]`; H a multiple of 4 (so every
/// row is 16-byte aligned for the float4 loads; any multiple of 16 is).
pub fn moe_combine(
    gpu: &Gpu,
    y: &CudaSlice<f32>,
    g: &ExpertGrouping,
    weights: &CudaSlice<f32>,
    hidden: usize,
    out: &mut CudaSlice<f32>,
    accumulate: bool,
) -> Result<()> {
    if hidden == 0 || hidden % 4 != 0 {
        return Err(invalid(format!("moe_combine: hidden {hidden} must be a positive multiple of 4")));
    }
    let (t, n) = (g.tokens, g.assignments());
    need("moe_combine: y", y.len(), n * hidden)?;
    need("moe_combine: slot_of", g.slot_of.len(), n)?;
    need("moe_combine: weights", weights.len(), n)?;
    need("moe_combine: out", out.len(), t * hidden)?;
    let h_i = i32_of("hidden", hidden)?;
    if t == 0 {
        return Ok(());
    }
    let f = gpu.function("moe_combine")?;
    let cfg = LaunchConfig {
        grid_dim: (t as u32, (hidden / 4).div_ceil(256) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (k, acc) = (g.top_k as i32, accumulate as i32);
    let mut b = gpu.stream().launch_builder(&f);
    b.arg(y).arg(&g.slot_of).arg(weights).arg(&h_i).arg(&k).arg(out).arg(&acc);
    // SAFETY: moe_combine(const float* y [n, H], const unsigned* slot_of [n], const float* weights [n],
    // int H, int k, float* out [T, H], int accumulate).
    unsafe { b.launch(cfg) }?;
    Ok(())
}
