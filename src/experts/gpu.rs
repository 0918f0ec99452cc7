//! The GPU executor of the tier planner: slots and the prefill ring are
//! device memory, host buffers one page-locked allocation, the mapped pack
//! is read into page-locked staging blobs; copies run on a copy stream that
//! the compute stream waits for through events. Kernels find each expert
//! through a per-layer table of blob addresses (`table`), which this cache
//! points at the slot or ring slot holding it before the layer computes:
//! the experts' kernels are the all-resident path's, unchanged.
//!
//! Per MoE step (`plan_step`): the step's routed experts (the ids, copied
//! to the host) are planned; misses are copied into slots (copy stream,
//! then an event the compute stream waits on); the table of the layer is
//! written. A step with streamed experts computes in waves
//! (`Waves`): the experts in slots first, then the ring's entries in waves
//! of half the ring, whose copies overlap the compute of the wave before;
//! after each wave its promoted experts are copied from their ring slots
//! into their slots (device to device, on the compute stream).
//!
//! Mapped decode (`ExpertCacheOptions::mapped_decode`, when every expert
//! has a host buffer or a slot): a decode step needs no plan. The tables
//! point every expert at its slot, or else at its page-locked host buffer,
//! which the kernels read in place over the host link; the routed ids land
//! in a per-layer buffer read back once after the step (statistics, use
//! counts). Nothing waits on the host between layers, so the step is a CUDA
//! graph like the all-resident engine's. Adaptive swaps re-point the
//! evicted expert at its host buffer, copy on the swap stream, and re-point
//! the new one at its slot at a later step once the copy is done: no step
//! waits for them. A planned (prefill) forward rewrites the tables for its
//! steps; they are set back to the mapped addresses after it.
//!
//! Adaptive swaps (both modes) copy on a stream of their own, after the
//! steps queued before them, and read the pack on a thread of their own
//! (`HostFiller`: into host buffers, and, for slot fills of experts in no
//! host buffer, straight from its map of the pack, which the driver
//! stages); the planner keeps each swapped-in slot or host buffer pending
//! until its copy is done (`finish_swaps`, `finish_host_fills`, at the
//! start of a forward). A planned step that needs an expert still pending
//! waits for that one copy on the device (`Place::Slot { ready: false }`;
//! first on the host if the thread has yet to queue it), copies of an
//! expert whose host buffer is pending read the pack, and a step's copies
//! neither queue behind swap copies on one stream nor wait for a staging
//! blob: swaps use none.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys};

use super::tiers::{match_ring_holds, Fills, HostEntries, Place, Planner, Source, StepPlan};
use super::{ExpertCacheOptions, ExpertKey, ExpertStats};
use crate::backend::cuda::{CudaEvent, CudaSlice, CudaStream, CudaViewMut, DevicePtr, Gpu, HOST_DEVICE_MAP};
use crate::error::{Error, Result};
use crate::pack::Pack;

/// Page-locked host memory held through its raw pointer: sub-ranges are
/// copy sources (cudarc's `PinnedHostSlice` copies only whole).
struct Pinned {
    _mem: cudarc::driver::PinnedHostSlice<u8>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned by `_mem` for the lifetime of `ptr`;
// every access goes through `&mut self` (writes) or a copy ordered by the
// cache's events, and the cache is used under the engine's lock.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    fn new(gpu: &Gpu, len: usize) -> Result<Pinned> {
        Pinned::with_flags(gpu, len, 0)
    }

    fn with_flags(gpu: &Gpu, len: usize, flags: u32) -> Result<Pinned> {
        // SAFETY: page-locked bytes, written before any copy reads them.
        let mut mem = unsafe { gpu.context().alloc_pinned_with_flags::<u8>(len.max(1), flags) }?;
        let ptr = mem.as_mut_ptr()?;
        Ok(Pinned { _mem: mem, ptr, len })
    }

    /// The device address of the first byte (an allocation made with
    /// `HOST_DEVICE_MAP`).
    fn device_address(&self, gpu: &Gpu) -> Result<u64> {
        gpu.mapped_host_address(self.ptr)
    }

    fn range(&self, off: usize, n: usize) -> &[u8] {
        assert!(off + n <= self.len, "pinned range {off}+{n} past {}", self.len);
        // SAFETY: in bounds (asserted); the allocation lives as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), n) }
    }

    fn range_mut(&mut self, off: usize, n: usize) -> &mut [u8] {
        assert!(off + n <= self.len, "pinned range {off}+{n} past {}", self.len);
        // SAFETY: in bounds (asserted); &mut self: no other host reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), n) }
    }
}

/// The waves of a step with streamed experts: `slots` (the experts already
/// in slots, computed first, maybe empty), then `ring[w]`, the entries of
/// the step's ring (indices into `StepPlan::ring`) of wave `w`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waves {
    pub slots: Vec<usize>,
    pub ring: Vec<Vec<usize>>,
}

/// One engine's expert cache on one CUDA device.
pub struct GpuExpertCache {
    /// Numbers the layers from 0: the model's layer `first_layer + l` is
    /// its layer `l` (and `ExpertKey::layer`'s, here).
    planner: Planner,
    first_layer: usize,
    gpu: Arc<Gpu>,
    experts: usize,
    stride: usize,
    /// Bytes of a blob a copy moves (`ExpertLayout::used_len`).
    used: usize,
    /// The slots' memory (held: copies and kernels use `slot_base`).
    _slots: CudaSlice<u8>,
    ring: CudaSlice<u8>,
    /// Device addresses of `slots`, `ring` and each table (asked once:
    /// cudarc orders every address request on the stream).
    slot_base: u64,
    ring_base: u64,
    table_addrs: Vec<u64>,
    host: Pinned,
    /// One staging blob per pool worker, and the event of its last copy.
    staging: Vec<(Pinned, CudaEvent)>,
    next_staging: usize,
    copy: Arc<CudaStream>,
    /// The stream of adaptive swaps' slot fills (`queue_swaps`), so that a
    /// step's copies on `copy` do not queue behind them.
    swap_copy: Arc<CudaStream>,
    /// Slot fills of adaptive swaps in flight: (slot, its copy's event).
    /// The planner holds such a slot pending until the event completes.
    swaps: Vec<(usize, CudaEvent)>,
    /// Slot fills of adaptive swaps from the pack sent to the filler
    /// thread and not yet reported queued (pending in the planner too).
    swaps_sent: Vec<usize>,
    /// The thread that reads adaptive swaps from the pack (started by the
    /// first of them).
    filler: Option<HostFiller>,
    /// Recorded on the copy stream after a step's copies; the compute
    /// stream waits on it.
    copied: CudaEvent,
    /// Recorded on the compute stream after each ring wave (by ring half).
    computed: [CudaEvent; 2],
    /// The ring half of the last `wave_computed`.
    last_half: usize,
    /// The fraction of the layer's experts the last planned step routed
    /// to: the next layer's ring is prefetched only after a step that
    /// routed to most of them (`PREFETCH_MIN_ROUTED`).
    last_routed: f64,
    /// Slots the last planned step promotes into whose copies are not yet
    /// queued (`wave_computed`); left over when that step failed first, and
    /// then forgotten by the planner before anything else is planned.
    pending_promotions: Vec<usize>,
    /// What each ring slot holds, in copy-stream order: the expert the
    /// last copy queued into it writes (a step skips the copy of an entry
    /// its ring slot already holds: a prefetch).
    ring_holds: Vec<Option<RingHeld>>,
    /// Recorded on the copy stream after the prefetched copies into each
    /// ring half (`prefetch_ring`).
    prefetch_ready: [CudaEvent; 2],
    /// Per layer: the device address of each expert's blob where it is
    /// (stale for experts the step does not route to; never read for them).
    tables: Vec<CudaSlice<u64>>,
    /// The tables' host copy (page-locked: the writes are asynchronous).
    mirror: Pinned,
    /// Page-locked landing place of a step's routed ids (u32 bytes).
    ids: Pinned,
    /// Host time of a forward's MoE steps by phase (`TracePhase`), printed
    /// and reset at its end under `STRATA_TRACE_FORWARD=1`.
    trace: [std::time::Duration; 3],
    /// Set by a failed copy: every later step fails with it.
    poisoned: Option<String>,
    /// Timing events around each run of copies queued together on the copy
    /// or the swap stream (start, end), in the order queued, until they
    /// complete and their time is added to the planner's `copy_ns`
    /// (`harvest_copy_spans`).
    copy_spans: Vec<(CudaEvent, CudaEvent)>,
    /// Mapped decode, when on.
    mapped: Option<Mapped>,
}

/// A ring slot's contents (`GpuExpertCache::ring_holds`).
#[derive(Clone, Copy, Debug)]
struct RingHeld {
    key: ExpertKey,
    /// Written by a prefetch into this ring half: a step using it waits for
    /// `prefetch_ready[half]`. (Other copies were waited for by the compute
    /// stream before the step's routed ids were read back.)
    prefetch: Option<usize>,
}

/// What a mapped decode step of one layer needs (`mapped_step`).
pub struct MappedStep<'a> {
    /// Every expert's blob address.
    pub table: &'a CudaSlice<u64>,
    /// Where the step writes its routed ids.
    pub ids: CudaViewMut<'a, u32>,
    /// Whether the table points into host memory (`moe::Route::host_blobs`).
    pub host_blobs: bool,
}

/// The state of mapped decode (see the module documentation).
struct Mapped {
    /// Device address of the host buffers' first byte.
    host_base: u64,
    /// Every layer's routed ids of a decode step, `ids_per_layer` each.
    ids: CudaSlice<u32>,
    ids_per_layer: usize,
    ids_host: Pinned,
    /// Routed ids per layer the last forward left in `ids` (0: it was not
    /// a mapped decode forward).
    pending_ids: usize,
    /// A planned forward pointed some table entries elsewhere.
    tables_dirty: bool,
    /// Which table entries point into host memory (`mapped_step`'s kernels).
    hosts: HostEntries,
}

/// A timing event (cudarc's default event records no time) recorded on
/// `stream`: it completes when the stream reaches this point.
fn timing_event(gpu: &Gpu, stream: &CudaStream) -> Result<CudaEvent> {
    let e = gpu.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    e.record(stream)?;
    Ok(e)
}

/// A host buffer's first byte, written only by the filler thread while
/// the planner holds that buffer pending.
struct FillDst(*mut u8);

// SAFETY: the pointer is into the cache's page-locked host buffers, which
// outlive the thread (the cache joins it before freeing them); the planner
// lets nothing else read or write a buffer while its fill is pending.
unsafe impl Send for FillDst {}

/// A job of the filler thread (`HostFiller`).
enum FillJob {
    /// A host fill: `len` bytes at `offset` of the pack's experts file
    /// into host buffer `host`, once the work queued before it on the
    /// copy, swap and compute streams (which may read the buffer's old
    /// expert) is done.
    Host {
        host: usize,
        offset: usize,
        len: usize,
        dst: FillDst,
        after: [CudaEvent; 3],
        /// Tests: milliseconds to wait first (`hold_swaps_for`).
        hold_ms: u64,
    },
    /// An adaptive swap's slot fill from the pack: `len` bytes at `offset`
    /// copied from the thread's map to the device address `dst` on the swap
    /// stream (after what the cache queued there before sending the job:
    /// the wait for the steps that read the slot).
    Slot { slot: usize, offset: usize, len: usize, dst: u64 },
}

/// What the filler thread reports of a job.
enum FillDone {
    Host(usize, std::result::Result<(), String>),
    /// The slot's copy is queued: its timing events (start, end) and the
    /// event that completes with it.
    Slot(usize, std::result::Result<(CudaEvent, CudaEvent, CudaEvent), String>),
}

/// Queues on `stream` the copy of `src` (pageable: the mapped pack) to the
/// device address `dst`: (start, end, done) events. The driver stages a
/// pageable source itself: the call waits for the work queued on `stream`
/// before it, and returns once `src` has been read (the filler thread's
/// time, no one else's).
fn copy_pageable(stream: &CudaStream, src: &[u8], dst: u64) -> Result<(CudaEvent, CudaEvent, CudaEvent)> {
    stream.context().bind_to_thread()?;
    let start = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    // SAFETY: dst is a slot of at least src.len() bytes (the cache's `slot_addr`, alive until the cache has
    // joined the filler thread and synchronized the swap stream); src is the mapped pack, never rewritten.
    unsafe { result::memcpy_htod_async(dst, src, stream.cu_stream()) }?;
    let end = stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok((start, end, stream.record_event(None)?))
}

/// The thread that reads adaptive swaps from the pack, so the forward that
/// triggers them returns at once: host fills (each filled buffer stays
/// pending in the planner, copies of its expert read the pack, until
/// `GpuExpertCache::finish_host_fills` sees it done) and slot fills (copied
/// from its map of the pack on the swap stream, `copy_pageable`; the slot
/// stays pending until the copy is done). It maps the experts file itself
/// (a pack is never rewritten), so it borrows nothing.
struct HostFiller {
    jobs: Option<std::sync::mpsc::Sender<FillJob>>,
    done: std::sync::mpsc::Receiver<FillDone>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HostFiller {
    /// Starts the thread; `swap` is the stream of slot fills.
    fn start(experts_file: std::path::PathBuf, swap: Arc<CudaStream>) -> Result<HostFiller> {
        let (jobs, rx) = std::sync::mpsc::channel::<FillJob>();
        let (tx, done) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("strata-host-fill".into())
            .spawn(move || {
                let map = std::fs::File::open(&experts_file).and_then(|f| {
                    // SAFETY: a pack's files are written once and never changed while mapped (as Pack maps them).
                    unsafe { memmap2::Mmap::map(&f) }
                });
                let read = |offset: usize, len: usize| -> std::result::Result<&[u8], String> {
                    let map = map.as_ref().map_err(|e| format!("{}: {e}", experts_file.display()))?;
                    map.get(offset..offset + len)
                        .ok_or_else(|| format!("{}: blob at {offset} past the end", experts_file.display()))
                };
                for job in rx {
                    let report = match job {
                        FillJob::Host { host, offset, len, dst, after, hold_ms } => {
                            if hold_ms > 0 {
                                std::thread::sleep(std::time::Duration::from_millis(hold_ms));
                            }
                            let r = (|| -> std::result::Result<(), String> {
                                for e in &after {
                                    e.synchronize().map_err(|e| e.to_string())?;
                                }
                                let src = read(offset, len)?;
                                // SAFETY: dst is `len` bytes of a host buffer (FillDst) that nothing else touches
                                // until this fill is reported done; src is the mapped file.
                                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0, len) };
                                Ok(())
                            })();
                            FillDone::Host(host, r)
                        }
                        FillJob::Slot { slot, offset, len, dst } => {
                            let r = read(offset, len)
                                .and_then(|src| copy_pageable(&swap, src, dst).map_err(|e| e.to_string()));
                            FillDone::Slot(slot, r)
                        }
                    };
                    if tx.send(report).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Cuda(format!("expert cache: cannot start the host-fill thread: {e}")))?;
        Ok(HostFiller { jobs: Some(jobs), done, thread: Some(thread) })
    }
}

impl Drop for HostFiller {
    /// Lets the thread finish the fills queued (they write buffers the
    /// cache frees after this) and joins it.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Bytes of a pack blob one pool thread reads into staging at a time
/// (`copy_many`).
const READ_PIECE: usize = 256 << 10;

/// Most rows of a mapped decode step: the engine's GEMV path (whose
/// kernels take no row-tile offsets, so a table is all they need).
pub const MAPPED_MAX_ROWS: usize = 8;

impl Drop for GpuExpertCache {
    /// Copies still queued (adaptive swaps are waited for by no step)
    /// read host buffers and write slots this drop frees: wait first.
    fn drop(&mut self) {
        // Host fills write host buffers this drop frees: the thread ends first.
        drop(self.filler.take());
        let _ = self.copy.synchronize();
        let _ = self.swap_copy.synchronize();
        let _ = self.gpu.stream().synchronize();
    }
}

/// Tests: milliseconds every batch of adaptive swaps waits before copying
/// (slot fills on their stream, host fills on the filler thread; 0: none),
/// so a test can run steps while swaps are still in flight
/// (`hold_swaps_for`).
#[cfg(feature = "test-hooks")]
static SWAP_HOLD_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Tests: holds every later batch of adaptive swaps (slot and host fills)
/// back `ms` milliseconds (0: no more holds), as a slow link or disk would.
#[cfg(feature = "test-hooks")]
pub fn hold_swaps_for(ms: u64) {
    SWAP_HOLD_MS.store(ms, std::sync::atomic::Ordering::Relaxed);
}

/// Queues the hold `hold_swaps_for` asks for on `stream`: a host function
/// the stream runs (the driver's thread sleeps; nothing later on the
/// stream starts before it returns).
#[cfg(feature = "test-hooks")]
fn hold_swaps(stream: &CudaStream) -> Result<()> {
    unsafe extern "C" fn sleep_ms(ms: *mut std::ffi::c_void) {
        std::thread::sleep(std::time::Duration::from_millis(ms as u64));
    }
    let ms = SWAP_HOLD_MS.load(std::sync::atomic::Ordering::Relaxed);
    if ms == 0 {
        return Ok(());
    }
    // SAFETY: the callback takes its argument by value (a number, no pointer behind it) and calls no CUDA
    // function, as host functions must not.
    unsafe { sys::cuLaunchHostFunc(stream.cu_stream(), Some(sleep_ms), ms as usize as *mut std::ffi::c_void) }
        .result()?;
    Ok(())
}

/// The phases of a cached MoE step the trace times.
#[derive(Clone, Copy, Debug)]
pub enum TracePhase {
    /// Routing, and the wait for the routed ids (the queued layers' work).
    Route = 0,
    /// Planning, copies, the table.
    Plan = 1,
    /// Queueing the expert kernels (and streamed waves).
    Compute = 2,
}

/// Ring prefetch across layers (`GpuExpertCache::prefetch_ring`); off with
/// `STRATA_RING_PREFETCH=0`, to measure what it brings.
fn prefetch_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_RING_PREFETCH").map_or(true, |v| v != "0"))
}

/// The least fraction of a layer's experts a streamed step must route to
/// for the next layer's ring to be prefetched. The prefetch guesses that
/// the next step routes to every expert; after a step that routed to fewer
/// (a prefill chunk of 16-32 tokens routes to 63-87% of 128 experts), many
/// guesses are copies no step uses, and they hold the link ahead of the
/// step's own copies: on the H200 a prefill in chunks of 16 tokens (63% of
/// 128 experts routed a step) copied 1.8x the bytes of copying its misses
/// into slots with the prefetch on every streamed step. (At 32 tokens, 87%,
/// the prefetch still runs: it moved 15% more bytes for no change in time.)
const PREFETCH_MIN_ROUTED: f64 = 0.75;

fn trace_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_TRACE_FORWARD").is_ok_and(|v| v == "1"))
}

/// The distinct experts of `ids` (ascending) with their row counts, as the
/// planner takes them. An id >= `experts` marks a non-finite routing:
/// nothing to place; the kernels turn it into NaN, which the guard reports.
fn routed_experts(ids: &[u32], experts: usize) -> Vec<(usize, usize)> {
    let mut counts = vec![0usize; experts];
    for &id in ids.iter().filter(|&&id| (id as usize) < experts) {
        counts[id as usize] += 1;
    }
    counts.iter().enumerate().filter(|c| *c.1 > 0).map(|(e, &n)| (e, n)).collect()
}

fn address<T>(gpu: &Gpu, buf: &CudaSlice<T>) -> u64 {
    let (ptr, _sync) = buf.device_ptr(gpu.stream());
    ptr
}

impl GpuExpertCache {
    /// The cache `opts` asks for over `pack`'s layers `layers` on `gpu`
    /// (`None` when it is off), with the initial placement copied in: every
    /// layer for one device, a stage's layers on a split (each stage has its
    /// own; `super::plan_cache` says what share of the budgets it gets).
    /// Fails, naming the budget and the need, when a budget is below the
    /// minimum, or when the device cannot hold what the budget allows. The
    /// methods take the model's layer numbers.
    pub fn load(
        pack: &Pack,
        gpu: &Arc<Gpu>,
        opts: &ExpertCacheOptions,
        layers: std::ops::Range<usize>,
    ) -> Result<Option<GpuExpertCache>> {
        let first_layer = layers.start;
        let Some((cap, planner, fills)) = super::plan_cache(pack, opts, layers.clone())? else {
            return Ok(None);
        };
        let c = pack.config();
        let layout = pack.layout();
        let (stride, used) = (layout.stride as usize, layout.used_len() as usize);
        let (free, _) = gpu.memory_info()?;
        let want = (cap.slots + cap.ring_slots) * stride;
        if want > free {
            return Err(Error::InvalidArgument(format!(
                "expert cache: {} slots + {} ring slots of {:.1} MiB need {:.1} MiB of device memory, {:.1} MiB \
                 are free",
                cap.slots,
                cap.ring_slots,
                stride as f64 / 1048576.0,
                want as f64 / 1048576.0,
                free as f64 / 1048576.0
            )));
        }
        let (layers, experts) = (layers.len(), c.num_experts);
        let ctx = gpu.context();
        let mut staging = Vec::with_capacity(cap.staging_blobs.max(1));
        for _ in 0..cap.staging_blobs.max(1) {
            staging.push((Pinned::new(gpu, used)?, ctx.new_event(None)?));
        }
        let slots = gpu.alloc_zeros::<u8>(cap.slots * stride)?;
        let ring = gpu.alloc_zeros::<u8>(cap.ring_slots * stride)?;
        let mut tables = Vec::with_capacity(layers);
        for _ in 0..layers {
            // Until a step points them somewhere: slot 0 (readable memory).
            tables.push(gpu.upload(&vec![address(gpu, &slots); experts])?);
        }
        let table_addrs = tables.iter().map(|t| address(gpu, t)).collect();
        let mut cache = GpuExpertCache {
            slot_base: address(gpu, &slots),
            ring_base: address(gpu, &ring),
            table_addrs,
            planner,
            first_layer,
            gpu: gpu.clone(),
            experts,
            stride,
            used,
            _slots: slots,
            ring,
            host: Pinned::with_flags(gpu, cap.host_blobs * stride, HOST_DEVICE_MAP)?,
            staging,
            next_staging: 0,
            copy: ctx.new_stream()?,
            swap_copy: ctx.new_stream()?,
            swaps: Vec::new(),
            swaps_sent: Vec::new(),
            filler: None,
            copied: ctx.new_event(None)?,
            computed: [ctx.new_event(None)?, ctx.new_event(None)?],
            last_half: 0,
            last_routed: 0.0,
            pending_promotions: Vec::new(),
            ring_holds: vec![None; cap.ring_slots],
            prefetch_ready: [ctx.new_event(None)?, ctx.new_event(None)?],
            tables,
            mirror: Pinned::new(gpu, layers * experts * 8)?,
            ids: Pinned::new(gpu, c.num_experts_per_tok * 64 * 4)?,
            trace: Default::default(),
            poisoned: None,
            copy_spans: Vec::new(),
            mapped: None,
        };
        // The placement is complete before the first step: no slot pending.
        let placed = cache.apply_fills(pack, &fills);
        cache.poison_on(placed)?;
        // The placement's copies are timed here, at load, with its bytes (not in the first forward's).
        cache.copy.synchronize()?;
        cache.harvest_copy_spans()?;
        if opts.mapped_decode && cache.planner.all_mapped() {
            let per = MAPPED_MAX_ROWS * c.num_experts_per_tok;
            cache.mapped = Some(Mapped {
                host_base: cache.host.device_address(gpu)?,
                ids: gpu.alloc_zeros::<u32>(layers * per)?,
                ids_per_layer: per,
                ids_host: Pinned::new(gpu, layers * per * 4)?,
                pending_ids: 0,
                tables_dirty: true,
                hosts: HostEntries::new(layers, experts),
            });
            cache.write_mapped_tables()?;
        }
        gpu.sync()?;
        Ok(Some(cache))
    }

    /// Whether decode steps of `rows` rows run mapped: every routed expert
    /// read where it is, through the table and ids of `mapped_step` (no
    /// `plan_step`).
    pub fn mapped_decode(&self, rows: usize) -> bool {
        self.mapped.is_some() && rows <= MAPPED_MAX_ROWS
    }

    /// A mapped decode step of `layer`: its table, where it writes its
    /// routed ids (`rows * k` of them; `note_mapped_forward` once the
    /// forward is queued), and whether the table points into host memory
    /// (`Route::host_blobs`: else every expert is in a slot, and the step
    /// takes the all-resident engine's kernels).
    pub fn mapped_step(&mut self, layer: usize) -> Result<MappedStep<'_>> {
        let layer = self.local(layer);
        let m = self.mapped.as_mut().ok_or_else(|| Error::Cuda("mapped_step without mapped decode".into()))?;
        let per = m.ids_per_layer;
        let host_blobs = m.hosts.any(layer);
        Ok(MappedStep { table: &self.tables[layer], ids: m.ids.slice_mut(layer * per..(layer + 1) * per), host_blobs })
    }

    /// Changes whenever a layer's mapped table starts or stops pointing
    /// into host memory (so `mapped_step`'s kernels change): a captured
    /// decode step is captured again. 0 without mapped decode.
    pub fn mapped_epoch(&self) -> u64 {
        self.mapped.as_ref().map_or(0, |m| m.hosts.epoch())
    }

    /// A mapped decode forward of `rows` rows is queued: its ids' copy to
    /// the host is queued behind it (so the forward's own wait covers it),
    /// and `end_forward` records them.
    pub fn note_mapped_forward(&mut self, rows: usize, top_k: usize) -> Result<()> {
        let gpu = self.gpu.clone();
        let layers = self.tables.len();
        let Some(m) = self.mapped.as_mut() else { return Ok(()) };
        m.pending_ids = 0;
        let src = address(&gpu, &m.ids);
        let bytes = layers * m.ids_per_layer * 4;
        // SAFETY: copies every layer's ids (the buffer's whole length) into the page-locked landing buffer of
        // that size, which the host reads only after the stream has been synchronized (after_forward).
        unsafe { result::memcpy_dtoh_async(m.ids_host.range_mut(0, bytes), src, gpu.stream().cu_stream()) }?;
        m.pending_ids = rows * top_k;
        Ok(())
    }

    /// The address a mapped step reads `key` from: its slot once filled,
    /// else its host buffer (then `true`).
    fn mapped_addr(&self, m: &Mapped, key: ExpertKey) -> Result<(u64, bool)> {
        if let Some((slot, true)) = self.planner.slot_of(key) {
            return Ok((self.slot_addr(slot), false));
        }
        match self.planner.host_of(key) {
            Some(h) => Ok((m.host_base + (h * self.stride) as u64, true)),
            None => Err(Error::Cuda(format!(
                "mapped decode: expert {} of layer {} is neither in a slot nor in host memory",
                key.expert,
                self.first_layer + key.layer
            ))),
        }
    }

    /// Points every table at the mapped addresses (after load, and after a
    /// planned forward pointed entries at the ring or new slots). Waits for
    /// the stream first: the mirror may be the source of a queued copy.
    fn write_mapped_tables(&mut self) -> Result<()> {
        let Some(mut m) = self.mapped.take() else { return Ok(()) };
        let r = (|| -> Result<()> {
            self.gpu.stream().synchronize()?;
            let layers = self.tables.len();
            for l in 0..layers {
                for e in 0..self.experts {
                    let (addr, in_host) = self.mapped_addr(&m, ExpertKey::new(l, e))?;
                    m.hosts.set(ExpertKey::new(l, e), in_host);
                    let at = (l * self.experts + e) * 8;
                    self.mirror.range_mut(at, 8).copy_from_slice(&addr.to_le_bytes());
                }
            }
            let stream = self.gpu.stream().cu_stream();
            for l in 0..layers {
                let row = self.mirror.range(l * self.experts * 8, self.experts * 8);
                // SAFETY: the table holds `experts` u64; the page-locked source is rewritten only after the
                // stream has completed this copy (see above).
                unsafe { result::memcpy_htod_async(self.table_addrs[l], row, stream) }?;
            }
            Ok(())
        })();
        self.mapped = Some(Mapped { tables_dirty: r.is_err(), ..m });
        r
    }

    /// Sets table entry `key` to `addr` (in host memory when `in_host`)
    /// on the compute stream (by value: no host buffer outlives the call).
    fn set_entry(&mut self, key: ExpertKey, addr: u64, in_host: bool) -> Result<()> {
        let dst = self.table_addrs[key.layer] + (key.expert * 8) as u64;
        let stream = self.gpu.stream().cu_stream();
        self.gpu.context().bind_to_thread()?;
        for (off, word) in [(0u64, addr as u32), (4, (addr >> 32) as u32)] {
            // SAFETY: one 32-bit word of the table entry `key` (in bounds: expert < experts).
            unsafe { sys::cuMemsetD32Async(dst + off, word, 1, stream) }.result()?;
        }
        if let Some(m) = self.mapped.as_mut() {
            m.hosts.set(key, in_host);
        }
        Ok(())
    }

    /// Completed swap copies make their slot ready (mapped decode: and
    /// point its table entry at it); the others stay pending. Never waits.
    fn finish_swaps(&mut self) -> Result<()> {
        let mut r = self.gpu.context().bind_to_thread().map_err(Error::from);
        let mut left = Vec::new();
        for (slot, done) in std::mem::take(&mut self.swaps) {
            if r.is_err() {
                left.push((slot, done));
                continue;
            }
            match done.try_is_complete() {
                Ok(true) => {}
                Ok(false) => {
                    left.push((slot, done));
                    continue;
                }
                Err(x) => {
                    // A failed copy: the slot is not what the planner believes (poisoned below).
                    r = Err(x.into());
                    left.push((slot, done));
                    continue;
                }
            }
            self.planner.slot_fill_done(slot);
            if self.mapped.is_some() {
                if let (Some(key), Ok(())) = (self.planner.slot_key(slot), &r) {
                    r = self.set_entry(key, self.slot_addr(slot), false);
                }
            }
        }
        self.swaps = left;
        self.poison_on(r)
    }

    /// Mapped decode: queues adaptive swaps without blocking a step: the
    /// evicted expert's entry goes back to its host buffer first (the
    /// compute stream), the copy waits for the steps queued before it, and
    /// `finish_swaps` points the entry at the slot once the copy is done.
    fn apply_mapped_swaps(&mut self, pack: &Pack, fills: &Fills) -> Result<()> {
        // Host fills only when every expert has a slot (with every expert in
        // host memory there is nothing to swap in): no kernel reads a host
        // buffer in place then, so they are filled as without mapping.
        self.queue_host_fills(pack, fills)?;
        let Some(m) = self.mapped.as_ref() else { return Ok(()) };
        let mut evicted = Vec::new();
        for f in &fills.slots {
            if let Some(old) = f.evicted {
                evicted.push((old, self.mapped_addr(m, old)?));
            }
        }
        for (old, (addr, in_host)) in evicted {
            self.set_entry(old, addr, in_host)?;
        }
        self.queue_swaps(pack, fills)
    }

    /// Queues the slot fills of adaptive swaps on the swap stream, after
    /// everything queued on the compute stream so far (the steps that read
    /// the evicted experts); each slot stays pending until its copy's
    /// event has completed (`finish_swaps`).
    fn queue_swaps(&mut self, pack: &Pack, fills: &Fills) -> Result<()> {
        if fills.slots.is_empty() {
            return Ok(());
        }
        self.swap_copy.wait(&self.gpu.stream().record_event(None)?)?;
        #[cfg(feature = "test-hooks")]
        hold_swaps(&self.swap_copy)?;
        if trace_on() {
            let sent = fills.slots.iter().filter(|f| f.from == Source::Pack).count();
            eprintln!(
                "strata: expert cache, swaps: {} slot fills ({sent} read by the filler thread)",
                fills.slots.len()
            );
        }
        // The copies from host buffers, queued here, are one timed run (`copy_spans`).
        let mut run_start = None;
        for f in &fills.slots {
            let dst = self.slot_addr(f.slot);
            match f.from {
                Source::Pack => {
                    // Read and copied by the filler thread: `finish_host_fills` takes its report.
                    self.filler(pack)?;
                    let offset = self.file_offset(pack, f.key);
                    self.send_fill(FillJob::Slot { slot: f.slot, offset, len: self.used, dst })?;
                    self.swaps_sent.push(f.slot);
                }
                Source::Host(h) => {
                    if run_start.is_none() {
                        run_start = Some(timing_event(&self.gpu, &self.swap_copy)?);
                    }
                    self.copy_from_host(h, dst, &self.swap_copy)?;
                    self.swaps.push((f.slot, self.swap_copy.record_event(None)?));
                }
            }
        }
        if let Some(start) = run_start {
            self.copy_spans.push((start, timing_event(&self.gpu, &self.swap_copy)?));
        }
        Ok(())
    }

    /// The filler thread, started by the first adaptive swap it reads.
    fn filler(&mut self, pack: &Pack) -> Result<&HostFiller> {
        if self.filler.is_none() {
            let file = pack.dir().join(crate::pack::format::EXPERTS_FILE);
            self.filler = Some(HostFiller::start(file, self.swap_copy.clone())?);
        }
        Ok(self.filler.as_ref().expect("started above"))
    }

    fn send_fill(&self, job: FillJob) -> Result<()> {
        let sent = self.filler.as_ref().and_then(|h| h.jobs.as_ref()).map(|j| j.send(job).is_ok());
        if sent != Some(true) {
            return Err(Error::Cuda("expert cache: the host-fill thread has stopped".into()));
        }
        Ok(())
    }

    /// After a forward: reads a mapped decode forward's ids back and records
    /// its steps; after a planned forward, points the tables back at the
    /// mapped addresses.
    fn after_forward(&mut self) -> Result<()> {
        let Some(m) = self.mapped.as_mut() else { return Ok(()) };
        let n = m.pending_ids;
        m.pending_ids = 0;
        if n == 0 {
            // A planned forward: its steps pointed entries at the ring and filled slots.
            return if m.tables_dirty { self.write_mapped_tables() } else { Ok(()) };
        }
        let layers = self.tables.len();
        let per = m.ids_per_layer;
        // The copy was queued by note_mapped_forward; the forward's wait
        // has normally covered it already (then this returns at once).
        self.gpu.stream().synchronize()?;
        let m = self.mapped.as_ref().expect("checked above");
        let bytes = m.ids_host.range(0, layers * per * 4);
        let all: Vec<u32> = bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        for l in 0..layers {
            self.planner.record_mapped(l, &routed_experts(&all[l * per..l * per + n], self.experts));
        }
        Ok(())
    }

    pub fn stats(&self) -> ExpertStats {
        self.planner.stats()
    }

    pub fn planner(&self) -> &Planner {
        &self.planner
    }

    /// The blob-address table of `layer` (valid for the experts of the
    /// step last planned there).
    pub fn table(&self, layer: usize) -> &CudaSlice<u64> {
        &self.tables[self.local(layer)]
    }

    /// The planner's number of the model's layer `layer`.
    fn local(&self, layer: usize) -> usize {
        assert!(layer >= self.first_layer, "layer {layer} before the cache's first, {}", self.first_layer);
        layer - self.first_layer
    }

    /// The pack's expert blob of the planner's `key`.
    fn blob<'p>(&self, pack: &'p Pack, key: ExpertKey) -> Result<&'p [u8]> {
        Ok(pack.expert(self.first_layer + key.layer, key.expert)?.blob)
    }

    /// Where the planner's `key` lies in the pack's experts file (what the
    /// filler thread reads from its own map of it).
    fn file_offset(&self, pack: &Pack, key: ExpertKey) -> usize {
        pack.layout().blob_offset(pack.config().num_experts, self.first_layer + key.layer, key.expert) as usize
    }

    fn slot_addr(&self, slot: usize) -> u64 {
        self.slot_base + (slot * self.stride) as u64
    }

    fn ring_slots(&self) -> usize {
        (self.ring.len() / self.stride.max(1)).max(1)
    }

    fn ring_addr(&self, ring_slot: usize) -> u64 {
        self.ring_base + (ring_slot * self.stride) as u64
    }

    /// Queues on the copy stream the copies of `(key, from, dst)`: each
    /// blob from its source to the device address `dst`. Host sources are
    /// sent as they are; pack sources are read into the staging blobs a
    /// batch at a time (waiting for each blob's previous copy), the batch's
    /// reads in `READ_PIECE` pieces in parallel on the pool, then sent.
    fn copy_many(&mut self, pack: &Pack, items: &[(ExpertKey, Source, u64)]) -> Result<()> {
        use rayon::prelude::*;
        let mut from_pack = Vec::new();
        let mut from_host = Vec::new();
        for &(key, from, dst) in items {
            match from {
                Source::Host(h) => from_host.push((h, dst)),
                Source::Pack => from_pack.push((self.blob(pack, key)?, dst)),
            }
        }
        // Each run of copies queued together is timed (`copy_spans`).
        if !from_host.is_empty() {
            let start = timing_event(&self.gpu, &self.copy)?;
            for &(h, dst) in &from_host {
                self.copy_from_host(h, dst, &self.copy)?;
            }
            self.copy_spans.push((start, timing_event(&self.gpu, &self.copy)?));
        }
        let (n, used, stream) = (self.staging.len(), self.used, self.copy.cu_stream());
        for batch in from_pack.chunks(n) {
            let first = self.next_staging;
            self.next_staging = (first + batch.len()) % n;
            // The batch's staging blobs (distinct: a batch is at most one of each).
            let mut all: Vec<Option<&mut (Pinned, CudaEvent)>> = self.staging.iter_mut().map(Some).collect();
            let mut picked: Vec<&mut (Pinned, CudaEvent)> =
                (0..batch.len()).map(|j| all[(first + j) % n].take().expect("distinct staging blobs")).collect();
            for (_, done) in picked.iter() {
                done.synchronize()?;
            }
            // The reads in pieces, all of the batch's at once on the pool: a
            // decode step misses a blob or two a layer, and one thread
            // copying from the page cache is several times slower than many.
            let pieces: Vec<(&mut [u8], &[u8])> = picked
                .iter_mut()
                .zip(batch)
                .flat_map(|(staging, (blob, _))| {
                    staging.0.range_mut(0, used).chunks_mut(READ_PIECE).zip(blob[..used].chunks(READ_PIECE))
                })
                .collect();
            pieces.into_par_iter().for_each(|(dst, src)| dst.copy_from_slice(src));
            // (Its run starts after its host reads: link time only.)
            let start = timing_event(&self.gpu, &self.copy)?;
            for (staging, &(_, dst)) in picked.iter_mut().zip(batch) {
                // SAFETY: dst is a slot or ring slot of `used` bytes (addresses from this cache's allocations);
                // the staging blob is rewritten only after `done` (recorded below) has completed.
                unsafe { result::memcpy_htod_async(dst, staging.0.range(0, used), stream) }?;
                staging.1.record(&self.copy)?;
            }
            self.copy_spans.push((start, timing_event(&self.gpu, &self.copy)?));
        }
        Ok(())
    }

    /// Adds the time of every completed run of copies to the planner's
    /// `copy_ns`, without waiting for the others (the first incomplete run
    /// stops the walk: a later one is counted at a later call).
    fn harvest_copy_spans(&mut self) -> Result<()> {
        let mut done = 0;
        for (start, end) in &self.copy_spans {
            if !end.try_is_complete()? {
                break;
            }
            let ms = f64::from(start.elapsed_ms(end)?);
            self.planner.record_copy_time((ms * 1e6).max(0.0) as u64);
            done += 1;
        }
        self.copy_spans.drain(..done);
        Ok(())
    }

    /// The statistics, with the host link's time of every copy completed
    /// by now (`ExpertStats::copy_ns`).
    pub fn stats_now(&mut self) -> Result<ExpertStats> {
        self.harvest_copy_spans()?;
        Ok(self.planner.stats())
    }

    /// Queues on `on` (the copy or the swap stream) a copy of host buffer
    /// `h` to the device address `dst`.
    fn copy_from_host(&self, h: usize, dst: u64, on: &CudaStream) -> Result<()> {
        let src = self.host.range(h * self.stride, self.used);
        // SAFETY: dst is a slot or ring slot of `used` bytes (addresses from this cache's allocations); the
        // source is page-locked and not rewritten before this copy is done (a host fill waits for the copies
        // queued before it on both streams: a synchronize at load, events on the filler thread).
        unsafe { result::memcpy_htod_async(dst, src, on.cu_stream()) }?;
        Ok(())
    }

    /// The planner takes a planned copy as done: after a failed one, the
    /// slots no longer hold what it believes, so the cache refuses every
    /// later step (the engine must be reloaded).
    fn poison_on(&mut self, r: Result<()>) -> Result<()> {
        if let Err(e) = &r {
            self.poisoned = Some(e.to_string());
        }
        r
    }

    fn check_usable(&self) -> Result<()> {
        match &self.poisoned {
            Some(why) => {
                Err(Error::Cuda(format!("the expert cache is unusable after a failed copy ({why}); reload the engine")))
            }
            None => Ok(()),
        }
    }

    /// Carries out the initial placement: host fills, then slot fills, which
    /// the compute stream waits for before its next kernel. (Adaptive
    /// swaps: `queue_host_fills`, `queue_swaps`.)
    fn apply_fills(&mut self, pack: &Pack, fills: &Fills) -> Result<()> {
        self.apply_host_fills(pack, fills)?;
        if !fills.slots.is_empty() {
            // The slots' last readers and writers on the compute stream (a
            // step's kernels, its promotions) come first, whether or not the
            // caller waited for them.
            self.copy.wait(&self.gpu.stream().record_event(None)?)?;
        }
        let items: Vec<_> = fills.slots.iter().map(|f| (f.key, f.from, self.slot_addr(f.slot))).collect();
        self.copy_many(pack, &items)?;
        for f in &fills.slots {
            self.planner.slot_fill_done(f.slot);
        }
        if !fills.slots.is_empty() {
            self.copied.record(&self.copy)?;
            self.gpu.stream().wait(&self.copied)?;
        }
        Ok(())
    }

    /// The initial placement's host fills, read from the pack here, after
    /// the copies that may still read those buffers (on either copy
    /// stream). Adaptive swaps' go to the filler thread (`queue_host_fills`).
    fn apply_host_fills(&mut self, pack: &Pack, fills: &Fills) -> Result<()> {
        if fills.host.is_empty() {
            return Ok(());
        }
        self.copy.synchronize()?;
        self.swap_copy.synchronize()?;
        for f in &fills.host {
            let blob = self.blob(pack, f.key)?;
            self.host.range_mut(f.host * self.stride, self.used).copy_from_slice(&blob[..self.used]);
            self.planner.host_fill_done(f.host);
        }
        Ok(())
    }

    /// Adaptive swaps' host fills: queued to the filler thread, each after
    /// the work queued so far on the copy, swap and compute streams (which
    /// may read the buffer's old expert: copies, or kernels in place);
    /// the buffers stay pending until `finish_host_fills` sees them done.
    fn queue_host_fills(&mut self, pack: &Pack, fills: &Fills) -> Result<()> {
        if fills.host.is_empty() {
            return Ok(());
        }
        self.filler(pack)?;
        #[cfg(feature = "test-hooks")]
        let hold_ms = SWAP_HOLD_MS.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(feature = "test-hooks"))]
        let hold_ms = 0;
        for (i, f) in fills.host.iter().enumerate() {
            // (A test's hold delays the batch, not each fill.)
            let hold_ms = if i == 0 { hold_ms } else { 0 };
            let offset = self.file_offset(pack, f.key);
            // (Blocking-sync events: the thread waits on them without spinning a core.)
            let blocking = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
            let after = [
                self.copy.record_event(blocking)?,
                self.swap_copy.record_event(blocking)?,
                self.gpu.stream().record_event(blocking)?,
            ];
            let dst = FillDst(self.host.range_mut(f.host * self.stride, self.used).as_mut_ptr());
            self.send_fill(FillJob::Host { host: f.host, offset, len: self.used, dst, after, hold_ms })?;
        }
        Ok(())
    }

    /// Takes the filler thread's reports without waiting: host fills done
    /// make their buffers ready; slot fills queued join `swaps` (pending
    /// until their copy completes, `finish_swaps`). A failed one poisons
    /// the cache.
    fn finish_host_fills(&mut self) -> Result<()> {
        let mut r = Ok(());
        while let Some(f) = self.filler.as_ref() {
            let done = match f.done.try_recv() {
                Ok(done) => done,
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    // The thread is gone (it never stops on its own): fills it had may never be done.
                    r = Err(Error::Cuda("expert cache: the host-fill thread has stopped".into()));
                    break;
                }
            };
            if let Err(x) = self.take_fill_report(done) {
                r = Err(x);
            }
        }
        self.poison_on(r)
    }

    fn take_fill_report(&mut self, done: FillDone) -> Result<()> {
        match done {
            FillDone::Host(host, Ok(())) => self.planner.host_fill_done(host),
            FillDone::Host(_, Err(why)) => return Err(Error::Cuda(format!("expert cache: a host fill failed: {why}"))),
            FillDone::Slot(slot, r) => {
                self.swaps_sent.retain(|&s| s != slot);
                let (start, end, copied) =
                    r.map_err(|why| Error::Cuda(format!("expert cache: a swap's slot fill failed: {why}")))?;
                self.copy_spans.push((start, end));
                self.swaps.push((slot, copied));
            }
        }
        Ok(())
    }

    /// Waits on the host until the filler thread has queued the copy into
    /// `slot` (a step needs that expert now), taking its other reports on
    /// the way.
    fn await_sent_swap(&mut self, slot: usize) -> Result<()> {
        while self.swaps_sent.contains(&slot) {
            let done = match self.filler.as_ref().map(|f| f.done.recv()) {
                Some(Ok(done)) => done,
                _ => return Err(Error::Cuda("expert cache: the host-fill thread has stopped".into())),
            };
            self.take_fill_report(done)?;
        }
        Ok(())
    }

    /// A forward of `tokens` tokens starts: swaps whose copies are done
    /// take effect; the others stay pending (no wait).
    pub fn begin_forward(&mut self, tokens: usize) -> Result<()> {
        self.check_usable()?;
        self.forget_pending_promotions();
        self.planner.begin_forward(tokens);
        let decode = self.mapped_decode(tokens);
        if let Some(m) = self.mapped.as_mut() {
            // (A forward that failed left its ids or its planned tables.)
            m.pending_ids = 0;
            if decode && m.tables_dirty {
                let r = self.write_mapped_tables();
                self.poison_on(r)?;
            }
        }
        self.finish_host_fills()?;
        self.finish_swaps()
    }

    /// A forward ended: queues the adaptive swaps it triggers. No step
    /// waits for them; one that needs a swapped-in expert before its copy
    /// has completed waits (on the device) for that copy alone.
    pub fn end_forward(&mut self, pack: &Pack, tokens: usize) -> Result<()> {
        self.check_usable()?;
        if trace_on() {
            let [r, p, c] = self.trace.map(|d| d.as_secs_f64() * 1e3);
            eprintln!("strata: expert cache, forward of {tokens} rows: route+ids {r:.3} ms, plan+copies {p:.3} ms, queue experts {c:.3} ms");
        }
        self.trace = Default::default();
        let r = self.after_forward().and_then(|_| self.harvest_copy_spans());
        self.poison_on(r)?;
        let fills = self.planner.end_forward(tokens);
        let r = if self.mapped.is_some() {
            self.apply_mapped_swaps(pack, &fills)
        } else {
            self.queue_host_fills(pack, &fills).and_then(|()| self.queue_swaps(pack, &fills))
        };
        self.poison_on(r)
    }

    /// Adds host time to a phase of the forward's trace.
    pub fn trace(&mut self, phase: TracePhase, since: Instant) {
        self.trace[phase as usize] += since.elapsed();
    }

    /// The first `n` routed ids of a step (`[T * k]` on the device), read
    /// back through page-locked memory; waits for the stream.
    pub fn read_ids(&mut self, ids: &CudaSlice<u32>, n: usize) -> Result<Vec<u32>> {
        if ids.len() < n {
            return Err(Error::InvalidArgument(format!("read_ids: {n} ids of {}", ids.len())));
        }
        if self.ids.len < 4 * n {
            self.ids = Pinned::new(&self.gpu, 4 * n.next_power_of_two())?;
        }
        let stream = self.gpu.stream();
        let src = address(&self.gpu, ids);
        // SAFETY: copies 4 n bytes from the first n ids (checked above) into the page-locked buffer,
        // which nothing else reads or writes until the stream is synchronized below.
        unsafe { result::memcpy_dtoh_async(self.ids.range_mut(0, 4 * n), src, stream.cu_stream()) }?;
        stream.synchronize()?;
        let bytes = self.ids.range(0, 4 * n);
        Ok(bytes.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).collect())
    }

    /// Plans the MoE step of `layer` whose routed expert ids (`[T * k]`,
    /// on the host) are `ids`, copies its misses into slots (the compute
    /// stream waits for them) and points the layer's table at every routed
    /// expert: a slot, or for a streamed one its ring slot (filled by
    /// `stream_wave`). Returns the plan (`StepPlan::layer` in the
    /// planner's numbering).
    pub fn plan_step(&mut self, pack: &Pack, layer: usize, ids: &[u32]) -> Result<StepPlan> {
        self.check_usable()?;
        self.forget_pending_promotions();
        let layer = self.local(layer);
        let mut plan = self.planner.plan_step(layer, &routed_experts(ids, self.experts));
        self.pending_promotions = plan.ring.iter().filter_map(|r| r.promote).collect();
        self.last_routed = plan.experts.len() as f64 / self.experts.max(1) as f64;
        let holds: Vec<Option<ExpertKey>> = self.ring_holds.iter().map(|h| h.map(|h| h.key)).collect();
        match_ring_holds(plan.layer, &mut plan.ring, &holds);
        if let Some(m) = self.mapped.as_mut() {
            m.tables_dirty = true;
        }
        // The previous steps' kernels are complete (the caller read these
        // ids back after them), so slots and ring slots may be overwritten.
        let started = Instant::now();
        let items: Vec<_> = plan.fills.iter().map(|f| (f.key, f.from, self.slot_addr(f.slot))).collect();
        let copied = self.copy_many(pack, &items);
        self.poison_on(copied)?;
        for f in &plan.fills {
            self.planner.slot_fill_done(f.slot);
        }
        let ring_slots = self.ring_slots();
        let row = layer * self.experts * 8;
        for &(e, place) in &plan.experts {
            let addr = match place {
                Place::Slot { slot, .. } => self.slot_addr(slot),
                Place::Ring(n) => self.ring_addr(plan.ring[n].ring_slot % ring_slots),
            };
            self.mirror.range_mut(row + e * 8, 8).copy_from_slice(&addr.to_le_bytes());
        }
        let gpu = self.gpu.clone();
        let stream = gpu.stream();
        // Experts an adaptive swap is still copying into their slot: the
        // step's kernels wait for those copies (and no others).
        for &(_, place) in &plan.experts {
            if let Place::Slot { slot, ready: false } = place {
                // (A copy the filler thread has yet to queue: until it has.)
                let sent = self.await_sent_swap(slot);
                self.poison_on(sent)?;
                let waited = match self.swaps.iter().find(|(s, _)| *s == slot) {
                    Some((_, done)) => stream.wait(done).map_err(Error::from),
                    None => Err(Error::Cuda(format!("expert cache: slot {slot} is pending with no copy in flight"))),
                };
                self.poison_on(waited)?;
                self.planner.record_swap_wait();
            }
        }
        if !plan.fills.is_empty() {
            let waited = (|| -> Result<()> {
                self.copied.record(&self.copy)?;
                stream.wait(&self.copied)?;
                // The step cannot compute before its misses are in: that wait.
                self.copied.synchronize()?;
                Ok(())
            })();
            self.poison_on(waited)?;
            self.planner.record_wait(started.elapsed().as_nanos() as u64);
        }
        let dst = self.table_addrs[layer];
        // SAFETY: the table holds `experts` u64; the source row is page-locked and rewritten only by
        // the next plan_step of this layer, which comes after this step's ids were read back (so
        // after this copy, queued before them).
        unsafe { result::memcpy_htod_async(dst, self.mirror.range(row, self.experts * 8), stream.cu_stream()) }?;
        Ok(plan)
    }

    /// The waves of a step with streamed experts: the slot experts, then
    /// the ring entries in waves of half the ring (one entry for a ring of
    /// one), so a wave's copies overlap the previous wave's compute.
    pub fn waves(&self, plan: &StepPlan) -> Waves {
        let ring_slots = self.ring_slots();
        let per_wave = (ring_slots / 2).max(1);
        let slots = plan.experts.iter().filter(|(_, p)| matches!(p, Place::Slot { .. })).map(|&(e, _)| e).collect();
        let ring = (0..plan.ring.len()).collect::<Vec<_>>().chunks(per_wave).map(|c| c.to_vec()).collect();
        Waves { slots, ring }
    }

    /// Queues the copies of ring wave `w` (after the compute of the wave
    /// that last used its ring slots) and makes the compute stream wait for
    /// them. Call in wave order, each before that wave's kernels, and
    /// `wave_computed(plan, waves, w)` after them (which also copies the
    /// wave's promoted experts into their slots).
    pub fn stream_wave(&mut self, pack: &Pack, plan: &StepPlan, waves: &Waves, w: usize) -> Result<()> {
        let r = self.stream_wave_copies(pack, plan, waves, w);
        self.poison_on(r)
    }

    fn stream_wave_copies(&mut self, pack: &Pack, plan: &StepPlan, waves: &Waves, w: usize) -> Result<()> {
        let started = Instant::now();
        let ring_slots = self.ring_slots();
        if w >= 1 && ring_slots >= 2 {
            // Wave w uses the ring half wave w - 2 used (wave w - 1 the other half).
            if w >= 2 {
                self.copy.wait(&self.computed[w % 2])?;
            }
        } else if w >= 1 {
            // One ring slot: every wave reuses it.
            self.copy.wait(&self.computed[(w - 1) % 2])?;
        }
        let mut items = Vec::new();
        let mut prefetched = [false; 2];
        for &n in &waves.ring[w] {
            let entry = plan.ring[n];
            let (key, slot) = (ExpertKey::new(plan.layer, entry.expert), entry.ring_slot % ring_slots);
            if let Some(held) = self.ring_holds[slot].as_mut().filter(|h| h.key == key) {
                // Already there (a prefetch, or left by an earlier step): no second copy.
                let from_prefetch = held.prefetch.take();
                if let Some(half) = from_prefetch {
                    prefetched[half] = true;
                }
                self.planner.record_copy_skipped(entry.from, from_prefetch.is_some());
                continue;
            }
            self.ring_holds[slot] = Some(RingHeld { key, prefetch: None });
            items.push((key, entry.from, self.ring_addr(slot)));
        }
        if !items.is_empty() {
            self.copy_many(pack, &items)?;
            self.copied.record(&self.copy)?;
            self.gpu.stream().wait(&self.copied)?;
        }
        for (ready, _) in self.prefetch_ready.iter().zip(prefetched).filter(|p| p.1) {
            self.gpu.stream().wait(ready)?;
        }
        self.planner.record_wait(started.elapsed().as_nanos() as u64);
        Ok(())
    }

    /// After a streamed step of the layer before `layer` (its last wave
    /// queued): queues the copies of `layer`'s first two ring waves as if
    /// its step will route to every expert (a large prefill chunk does),
    /// so the link works while that layer's attention and router run and
    /// the host waits for its routed ids. The step's entry `n` is its `n`th
    /// expert in no slot, ascending, in ring slot `n mod ring_slots`; an
    /// entry whose ring slot already holds it is not copied again
    /// (`stream_wave`), and a wrong guess only costs link time. Each half's
    /// copies wait for the compute that last used it (`computed`), the half
    /// freed first first. Only experts in host buffers (no host read here)
    /// and only for an even ring of at least 2 slots (its waves are halves).
    /// The copies are counted when queued (`bytes_copied`), whether or not
    /// a step uses them; a step that does counts a `prefetched` miss.
    pub fn prefetch_ring(&mut self, pack: &Pack, layer: usize) -> Result<()> {
        let r = self.prefetch_ring_copies(pack, layer);
        self.poison_on(r)
    }

    fn prefetch_ring_copies(&mut self, pack: &Pack, layer: usize) -> Result<()> {
        let layer = self.local(layer);
        let rs = self.ring_slots();
        if !prefetch_on()
            || rs < 2
            || rs % 2 == 1
            || layer >= self.tables.len()
            || self.last_routed < PREFETCH_MIN_ROUTED
        {
            return Ok(());
        }
        let per_wave = rs / 2;
        let next: Vec<usize> =
            (0..self.experts).filter(|&e| self.planner.slot_of(ExpertKey::new(layer, e)).is_none()).take(rs).collect();
        let first = 1 - self.last_half;
        for half in [first, 1 - first] {
            let mut items = Vec::new();
            for (n, &e) in next.iter().enumerate().skip(half * per_wave).take(per_wave) {
                let key = ExpertKey::new(layer, e);
                let Some(h) = self.planner.host_of(key) else { continue };
                if self.ring_holds[n].is_some_and(|held| held.key == key) {
                    continue;
                }
                self.ring_holds[n] = Some(RingHeld { key, prefetch: Some(half) });
                self.planner.record_unplanned_copy(Source::Host(h));
                items.push((key, Source::Host(h), self.ring_addr(n)));
            }
            if items.is_empty() {
                continue;
            }
            self.copy.wait(&self.computed[half])?;
            self.copy_many(pack, &items)?;
            self.prefetch_ready[half].record(&self.copy)?;
        }
        Ok(())
    }

    /// Ring wave `w`'s kernels are queued. Queues after them, on the
    /// compute stream, the copies of the wave's promoted entries from their
    /// ring slots into their slots (device memory to device memory), then
    /// records that the wave's ring slots may be refilled once all of it
    /// completes. Call after each ring wave's kernels, in wave order.
    pub fn wave_computed(&mut self, plan: &StepPlan, waves: &Waves, w: usize) -> Result<()> {
        let r = self.promote_and_record(plan, waves, w);
        self.poison_on(r)
    }

    fn promote_and_record(&mut self, plan: &StepPlan, waves: &Waves, w: usize) -> Result<()> {
        let (ring_slots, stream) = (self.ring_slots(), self.gpu.stream().cu_stream());
        for &n in &waves.ring[w] {
            let entry = plan.ring[n];
            if let Some(s) = entry.promote {
                let (dst, src) = (self.slot_addr(s), self.ring_addr(entry.ring_slot % ring_slots));
                // SAFETY: both addresses are `used` bytes of this cache's allocations (a slot and a ring
                // slot); the compute stream orders the copy after the wave's kernels and its waits for
                // the ring slot's copy, and before every later reader of the slot and, through
                // `computed`, every later writer of the ring slot.
                unsafe { result::memcpy_dtod_async(dst, src, self.used, stream) }?;
                self.pending_promotions.retain(|&p| p != s);
            }
        }
        self.computed[w % 2].record(self.gpu.stream())?;
        self.last_half = w % 2;
        Ok(())
    }

    /// Promotions of a step that failed before their copies: the planner
    /// forgets those slots (empty, not holding what it planned).
    fn forget_pending_promotions(&mut self) {
        for s in std::mem::take(&mut self.pending_promotions) {
            self.planner.forget_slot(s);
        }
    }
}
