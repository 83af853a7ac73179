//! The CUDA backend (`--features cuda`): cudarc loads the driver, NVRTC and cuBLAS at run time, so
//! the build needs no CUDA toolkit and links no CUDA library; our kernels (`kernels.cu`) are
//! compiled by NVRTC for the device when the backend starts. GEMMs run on cuBLAS (f32 weights with
//! `sgemm`, bf16 weights with `cublasGemmEx` over bf16 inputs and f32 accumulation); activations
//! and the paged KV cache are f32. Every allocation is recorded in the ledger.
//!
//! Kernel launches, uninitialised device allocations and cuBLAS calls are unsafe in cudarc, so this
//! module allows `unsafe` (the CPU backend's are its instruction-set dispatch, `cpu/isa.rs`, and
//! its intrinsic kernels). Each block states what makes it sound.
#![allow(unsafe_code)]

mod launch;
mod profile;
#[cfg(test)]
mod tests;

use super::{
    fused, Activation, BResult, Backend, BackendError, DeltaNetInput, DeviceMemory, KvLayout, PagedBatch, RawDType,
    RawTensor, Readback, StateLayout, StateSeq, TableWrite,
};
use crate::fault::ledger_summary;
use crate::memory::ledger::{Category, Held, MemoryLedger};
use crate::sample::DeviceSampling;
use cudarc::cublas::{sys as blas, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    sys as drv, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, LaunchConfig,
    PushKernelArg,
};
use launch::Geometry;
pub use launch::{compile_options, KERNELS, SOURCE};
pub use profile::{kernel_profile, requested as profile_requested};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Arc;

/// How to open the CUDA backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaOptions {
    /// The device's ordinal.
    pub ordinal: usize,
    /// Keep 2-D weights (the embedding table too) in bf16: a bf16 checkpoint's as stored, others
    /// rounded; activations and the KV cache stay f32.
    pub bf16_weights: bool,
    /// Attention over many query rows in shared-memory tiles (`segment_attention_tiled` for the
    /// vision tower, `paged_attention_tiled` for prefill) rather than one block per query row.
    /// Off by default until a GPU run has checked it (`KVLENS_CUDA_ATTENTION=tiled` turns it on:
    /// [`CudaOptions::from_env`]).
    pub tiled_attention: bool,
    /// Products of a few rows (decode: up to `GEMV_MAX_ROWS`) with bf16 weights by `gemv_bf16`,
    /// the matrices of one input (q/k/v, gate/up) in one launch, rather than by cuBLAS after a
    /// bf16 copy of the rows. On by default; `KVLENS_CUDA_GEMV=cublas` turns it off.
    pub gemv: bool,
    /// Attention of few rows over many keys split into parts that run side by side
    /// (`paged_attention_split`, then `paged_attention_merge`) rather than one block per row and
    /// head walking every key. On by default; `KVLENS_CUDA_DECODE_ATTENTION=rows` turns it off.
    pub split_attention: bool,
    /// Decode's fused kernels: a residual add with the next RMSNorm (`add_rms_norm`), each head's
    /// q/k norm with its rotary embedding (`norm_rope`), and with `gemv`, SwiGLU's gate and up
    /// products with the SiLU product in one launch (`gemv_bf16_glu`). On by default;
    /// `KVLENS_CUDA_FUSED=off` turns them off.
    pub fused: bool,
}

impl Default for CudaOptions {
    /// Device 0, f32 weights, the row attention kernels for many rows, `gemv_bf16`, split
    /// attention and the fused kernels for few.
    fn default() -> Self {
        CudaOptions {
            ordinal: 0,
            bf16_weights: false,
            tiled_attention: false,
            gemv: true,
            split_attention: true,
            fused: true,
        }
    }
}

impl CudaOptions {
    /// Device 0, with `bf16_weights`; `KVLENS_CUDA_ATTENTION` (`tiled` or `rows`),
    /// `KVLENS_CUDA_GEMV` (`cublas` turns `gemv_bf16` off), `KVLENS_CUDA_DECODE_ATTENTION`
    /// (`rows` turns split attention off) and `KVLENS_CUDA_FUSED` (`off`) choose the kernels.
    pub fn from_env(bf16_weights: bool) -> Self {
        let var = |name: &str, value: &str| std::env::var(name).is_ok_and(|v| v == value);
        CudaOptions {
            bf16_weights,
            tiled_attention: var("KVLENS_CUDA_ATTENTION", "tiled"),
            gemv: !var("KVLENS_CUDA_GEMV", "cublas"),
            split_attention: !var("KVLENS_CUDA_DECODE_ATTENTION", "rows"),
            fused: !var("KVLENS_CUDA_FUSED", "off"),
            ..CudaOptions::default()
        }
    }
}

/// One weight matrix of a `gemv_bf16` launch, as `GemvJob` in kernels.cu: device addresses of
/// the weights, the bias (0: none) and the output, the matrix's rows and its first block.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GemvJob {
    w: u64,
    b: u64,
    y: u64,
    m: u32,
    first_block: u32,
}

/// `gemv_bf16`'s argument (`GemvJobs` in kernels.cu): the launch's matrices, `count` of them.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct GemvJobs {
    job: [GemvJob; launch::GEMV_JOBS],
    count: u32,
}

// SAFETY: plain data of the C layout kernels.cu declares (u64 for each pointer, no references),
// passed to the kernel by value.
unsafe impl cudarc::driver::DeviceRepr for GemvJobs {}

/// A weight matrix's device storage.
#[derive(Debug)]
enum Data {
    F32(CudaSlice<f32>),
    /// bf16 bit patterns.
    Bf16(CudaSlice<u16>),
}

impl Data {
    fn bytes(&self) -> u64 {
        match self {
            Data::F32(s) => 4 * s.len() as u64,
            Data::Bf16(s) => 2 * s.len() as u64,
        }
    }
}

/// An f32 tensor on the GPU: its storage (shared by views) and the ledger entry that counts it.
#[derive(Debug, Clone)]
pub struct CudaTensor {
    data: Arc<CudaSlice<f32>>,
    shape: Vec<usize>,
    _held: Arc<Held>,
}

/// A weight matrix `[rows, cols]` on the GPU, in f32 or bf16, and its ledger entry.
#[derive(Debug, Clone)]
pub struct CudaWeight {
    data: Arc<Data>,
    rows: usize,
    cols: usize,
    _held: Arc<Held>,
}

impl CudaTensor {
    fn f32(&self) -> &CudaSlice<f32> {
        &self.data
    }

    fn dims2(&self) -> BResult<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            [c] => Ok((1, c)),
            _ => Err(BackendError::Shape(format!(
                "expected a 2-D tensor, got {:?}",
                self.shape
            ))),
        }
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The paged KV cache: per layer, keys and values as `[num_blocks · block_size, kv_heads · head_dim]`.
#[derive(Debug)]
pub struct CudaKvCache {
    layout: KvLayout,
    keys: Vec<CudaSlice<f32>>,
    values: Vec<CudaSlice<f32>>,
    _held: Held,
}

/// A hybrid model's states: per Gated DeltaNet layer, the conv windows `[slots, conv_len,
/// conv_dim]` and the recurrent states `[slots, heads, key_dim, value_dim]`, f32.
#[derive(Debug)]
pub struct CudaStates {
    layout: StateLayout,
    conv: Vec<CudaSlice<f32>>,
    recurrent: Vec<CudaSlice<f32>>,
    _held: Held,
}

/// The block tables on the device: `rows × max_blocks` u32 block ids, shared with the steps
/// recorded over them.
#[derive(Debug)]
pub struct CudaBlockTables {
    layout: KvLayout,
    ids: Arc<CudaSlice<u32>>,
    _held: Held,
}

/// A step's paged-attention metadata on the device, checked against the KV cache's layout.
#[derive(Debug)]
pub struct CudaPaged {
    slots: CudaSlice<u32>,
    meta: CudaSlice<u32>,
    tables: Arc<CudaSlice<u32>>,
    rows: usize,
    layout: KvLayout,
    /// With tiled attention, for a step where at least half the rows belong to sequences of
    /// [`TILED_PREFILL_ROWS`] rows or more: `paged_attention_tiled`'s tiles, their number and
    /// rows per warp.
    tiles: Option<(CudaSlice<u32>, usize, u32)>,
    /// The most keys any row sees (its position + 1): how far split attention may cut.
    max_keys: usize,
    _held: Held,
}

/// The fewest query rows of one sequence for which a step's attention runs in tiles: below that
/// (decode, short chunks) most of a tile's rows would be idle.
const TILED_PREFILL_ROWS: usize = 16;

/// The vision tower's segments on the device: each row's `(start, len)`.
#[derive(Debug)]
pub struct CudaSegments {
    rows: CudaSlice<u32>,
    num_rows: usize,
    _held: Held,
}

/// The CUDA backend on one device.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: HashMap<&'static str, CudaFunction>,
    ledger: MemoryLedger,
    options: CudaOptions,
    device_name: String,
    compute_capability: (i32, i32),
    /// The layout of the KV cache allocated last: step metadata is checked against it.
    kv_layout: Cell<Option<KvLayout>>,
    /// `KVLENS_CUDA_PROFILE=1`: every launch timed (see [`kernel_profile`]).
    profile: bool,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.device_name)
            .field("compute_capability", &self.compute_capability)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Launches kernel `$name` of `$be` over geometry `$g` with the arguments in order. Scalars must
/// be named locals: the launch reads them through their addresses.
macro_rules! launch {
    ($be:expr, $name:literal, $g:expr; $($arg:expr),* $(,)?) => {{
        let g = $g;
        let mut args = $be.stream.launch_builder($be.kernel($name)?);
        $( args.arg($arg); )*
        $be.run($name, args, g)
    }};
}

fn lib<E: std::error::Error + Send + Sync + 'static>(e: E) -> BackendError {
    BackendError::Library(Box::new(e))
}

fn missing(what: &str) -> BackendError {
    BackendError::Library(what.into())
}

/// [`SOURCE`] compiled by NVRTC for compute capability `major.minor` (needs only the NVRTC
/// library, no GPU).
pub fn compile(major: i32, minor: i32) -> BResult<cudarc::nvrtc::Ptx> {
    let options = cudarc::nvrtc::CompileOptions {
        options: compile_options(major, minor),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, options).map_err(lib)
}

impl CudaBackend {
    /// Opens device `options.ordinal`, compiles the kernels with NVRTC and creates a cuBLAS handle.
    /// Fails with what is missing when the driver, NVRTC or cuBLAS library cannot be loaded.
    pub fn new(ledger: MemoryLedger, options: CudaOptions) -> BResult<Self> {
        // SAFETY: each probe only tries to open the shared library (dlopen), nothing is called.
        if !unsafe { drv::is_culib_present() } {
            return Err(missing(
                "the CUDA driver library (libcuda.so.1) was not found: is an NVIDIA driver installed?",
            ));
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(missing(
                "NVRTC (libnvrtc.so.13 or .12) was not found: add the CUDA runtime libraries to LD_LIBRARY_PATH",
            ));
        }
        if !unsafe { blas::is_culib_present() } {
            return Err(missing(
                "cuBLAS (libcublas.so.13 or .12) was not found: add the CUDA libraries to LD_LIBRARY_PATH",
            ));
        }
        let ctx = CudaContext::new(options.ordinal).map_err(lib)?;
        // SAFETY: the backend uses one stream, so cross-stream event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let compute_capability = ctx.compute_capability().map_err(lib)?;
        let device_name = ctx.name().map_err(lib)?;
        let (major, minor) = compute_capability;
        let ptx = compile(major, minor)?;
        let module = ctx.load_module(ptx).map_err(lib)?;
        let kernels = KERNELS
            .iter()
            .map(|&name| Ok((name, module.load_function(name).map_err(lib)?)))
            .collect::<BResult<HashMap<_, _>>>()?;
        let blas = CudaBlas::new(stream.clone()).map_err(lib)?;
        Ok(CudaBackend {
            ctx,
            stream,
            blas,
            kernels,
            ledger,
            options,
            device_name,
            compute_capability,
            kv_layout: Cell::new(None),
            profile: profile::requested(),
        })
    }

    /// The device's name and compute capability, for the start-up log.
    pub fn describe(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!(
            "CUDA device {}: {} (compute capability {major}.{minor}), weights in {}{}{}",
            self.options.ordinal,
            self.device_name,
            if self.options.bf16_weights { "bf16" } else { "f32" },
            if self.options.tiled_attention {
                ", attention in shared-memory tiles"
            } else {
                ""
            },
            self.decode_kernels()
        )
    }

    /// ", decode by …" naming the decode kernels turned on, or nothing.
    fn decode_kernels(&self) -> String {
        let o = &self.options;
        let on: Vec<&str> = [
            (o.gemv, "gemv_bf16"),
            (o.split_attention, "split attention"),
            (o.fused, "fused kernels"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        if on.is_empty() {
            String::new()
        } else {
            format!(", decode by {}", on.join(", "))
        }
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Free and total memory of the device now.
    pub fn memory(&self) -> BResult<DeviceMemory> {
        let (free, total) = self.ctx.mem_get_info().map_err(lib)?;
        Ok(DeviceMemory {
            free: free as u64,
            total: total as u64,
        })
    }

    fn oom(&self, bytes: u64) -> BackendError {
        BackendError::OutOfMemory {
            bytes,
            ledger: ledger_summary(&self.ledger),
        }
    }

    /// Maps a driver error of an allocation of `bytes`, naming out-of-memory as such.
    fn alloc_err(&self, bytes: u64) -> impl Fn(cudarc::driver::DriverError) -> BackendError + '_ {
        move |e| {
            if e.0 == drv::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                self.oom(bytes)
            } else {
                lib(e)
            }
        }
    }

    /// An uninitialised f32 buffer of `n` elements.
    fn alloc_f32(&self, n: usize) -> BResult<CudaSlice<f32>> {
        // SAFETY: every caller writes all `n` elements (a kernel or a copy) before reading them.
        unsafe { self.stream.alloc::<f32>(n.max(1)) }.map_err(self.alloc_err(4 * n as u64))
    }

    fn wrap(&self, data: CudaSlice<f32>, shape: Vec<usize>, category: Category) -> CudaTensor {
        let bytes = 4 * data.len() as u64;
        CudaTensor {
            data: Arc::new(data),
            shape,
            _held: Arc::new(self.ledger.hold(category, bytes)),
        }
    }

    fn activation(&self, data: CudaSlice<f32>, shape: Vec<usize>) -> CudaTensor {
        self.wrap(data, shape, Category::Activations)
    }

    /// A checkpoint tensor's values in f32 on the device, checked against its shape.
    fn floats(&self, raw: &RawTensor<'_>) -> BResult<CudaSlice<f32>> {
        refuse_blocks(raw)?;
        let n: usize = raw.shape.iter().product();
        let expected = raw.dtype.bytes_of(n).unwrap_or(usize::MAX);
        if raw.data.len() != expected {
            return Err(BackendError::Shape(format!(
                "weight of shape {:?} has {} bytes, expected {expected}",
                raw.shape,
                raw.data.len()
            )));
        }
        let host = crate::model::weights::host_f32(raw);
        let host = if host.is_empty() { vec![0.0] } else { host };
        self.stream
            .clone_htod(&host)
            .map_err(self.alloc_err(4 * host.len() as u64))
    }

    fn upload_u32(&self, data: &[u32]) -> BResult<CudaSlice<u32>> {
        let data = if data.is_empty() { &[0][..] } else { data };
        self.stream
            .clone_htod(data)
            .map_err(self.alloc_err(4 * data.len() as u64))
    }

    fn kernel(&self, name: &str) -> BResult<&CudaFunction> {
        self.kernels
            .get(name)
            .ok_or_else(|| missing("a kernel missing from the compiled module"))
    }

    /// Launches kernel `name`'s prepared arguments over `g` (timed where `KVLENS_CUDA_PROFILE=1`).
    fn run(&self, name: &'static str, mut args: LaunchArgs<'_>, g: Geometry) -> BResult<()> {
        let cfg = LaunchConfig {
            grid_dim: g.grid,
            block_dim: g.block,
            shared_mem_bytes: g.shared_bytes,
        };
        let profiled = if self.profile {
            let timing = Some(drv::CUevent_flags::CU_EVENT_DEFAULT);
            let (start, end) = (self.ctx.new_event(timing), self.ctx.new_event(timing));
            let (start, end) = (start.map_err(lib)?, end.map_err(lib)?);
            start.record(&self.stream).map_err(lib)?;
            Some((start, end, std::time::Instant::now()))
        } else {
            None
        };
        // SAFETY: every `launch!` passes the arguments its kernel in kernels.cu declares, in order,
        // with buffers at least as long as the element counts it is given.
        unsafe { args.launch(cfg) }.map_err(lib)?;
        if let Some((start, end, clock)) = profiled {
            let host_s = clock.elapsed().as_secs_f64();
            end.record(&self.stream).map_err(lib)?;
            profile::launched(name, host_s, start, end);
        }
        Ok(())
    }

    fn same_shape(a: &CudaTensor, b: &CudaTensor, op: &str) -> BResult<()> {
        if a.shape == b.shape {
            Ok(())
        } else {
            Err(BackendError::Shape(format!(
                "{op}: shapes {:?} and {:?}",
                a.shape, b.shape
            )))
        }
    }

    /// `y [n, out] = x [n, in] · wᵀ` with bf16 weights: x rounded to bf16, f32 accumulation.
    fn gemm_bf16(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<u16>,
        y: &mut CudaSlice<f32>,
        dims: (usize, usize, usize),
    ) -> BResult<()> {
        let (n, k, m) = dims;
        // SAFETY: `to_bf16` below writes all `n · k` values before the GEMM reads them.
        let mut xb = unsafe { self.stream.alloc::<u16>((n * k).max(1)) }.map_err(self.alloc_err(2 * (n * k) as u64))?;
        let _held = self.ledger.hold(Category::Activations, 2 * (n * k) as u64);
        let count = (n * k) as u32;
        launch!(self, "to_bf16", launch::elementwise(n * k)?; x, &mut xb, &count)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _w) = w.device_ptr(&self.stream);
        let (xp, _x) = xb.device_ptr(&self.stream);
        let (yp, _y) = y.device_ptr_mut(&self.stream);
        // SAFETY: column-major view of row-major data: wᵀ is [k, m] (ld k), x is [k, n] (ld k),
        // y is [m, n] (ld m); each buffer holds at least that many elements.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                blas::cudaDataType::CUDA_R_16BF,
                k as i32,
                xp as *const _,
                blas::cudaDataType::CUDA_R_16BF,
                k as i32,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                blas::cudaDataType::CUDA_R_32F,
                m as i32,
                blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(lib)
    }

    /// `x [n, k] · wᵀ (+ b)` for each `(w, b)` by `gemv_bf16`, [`launch::GEMV_JOBS`] matrices a
    /// launch; None where it does not apply (turned off, more rows than
    /// [`launch::GEMV_MAX_ROWS`], an f32 weight, a shape `linear` refuses).
    fn gemv(&self, x: &CudaTensor, ws: &[(&CudaWeight, Option<&CudaTensor>)]) -> BResult<Option<Vec<CudaTensor>>> {
        let Some((n, k)) = self.gemv_shape(x)? else {
            return Ok(None);
        };
        let mut matrices = Vec::with_capacity(ws.len());
        for &(w, b) in ws {
            match &*w.data {
                Data::Bf16(bits) if w.cols == k && w.rows > 0 && b.is_none_or(|b| b.numel() == w.rows) => {
                    matrices.push((bits, w.rows, b))
                }
                _ => return Ok(None),
            }
        }
        let (n32, k32) = (n as u32, k as u32);
        let mut out = Vec::with_capacity(ws.len());
        for chunk in matrices.chunks(launch::GEMV_JOBS) {
            let mut jobs = GemvJobs {
                count: chunk.len() as u32,
                ..GemvJobs::default()
            };
            let mut blocks = 0;
            for (job, &(bits, m, b)) in jobs.job.iter_mut().zip(chunk) {
                let mut y = self.alloc_f32(n * m)?;
                // The addresses stay valid: the weights and bias are borrowed for this call and
                // `y` moves into the returned tensor; one stream orders the launch after them.
                *job = GemvJob {
                    w: bits.device_ptr(&self.stream).0,
                    b: b.map_or(0, |b| b.f32().device_ptr(&self.stream).0),
                    y: y.device_ptr_mut(&self.stream).0,
                    m: m as u32,
                    first_block: blocks as u32,
                };
                blocks += m.div_ceil(launch::GEMV_WARPS as usize);
                out.push(self.activation(y, vec![n, m]));
            }
            launch!(self, "gemv_bf16", launch::gemv(blocks)?; x.f32(), &n32, &k32, &jobs)?;
        }
        Ok(Some(out))
    }

    /// Holds the stream for about `d` (`hold`, not itself timed): see [`profile`].
    fn hold(&self, d: std::time::Duration) -> BResult<()> {
        let clock_khz = self
            .ctx
            .attribute(drv::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
            .map_err(lib)?;
        let cycles = (d.as_secs_f64() * f64::from(clock_khz) * 1e3) as i64;
        let mut args = self.stream.launch_builder(self.kernel("hold")?);
        args.arg(&cycles);
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `hold` takes one 64-bit integer and touches no memory.
        unsafe { args.launch(one) }.map(|_| ()).map_err(lib)
    }

    /// x's rows and columns where the gemv kernels take it: turned on, 1 to
    /// [`launch::GEMV_MAX_ROWS`] rows, some columns.
    fn gemv_shape(&self, x: &CudaTensor) -> BResult<Option<(usize, usize)>> {
        let (n, k) = x.dims2()?;
        Ok((self.options.gemv && (1..=launch::GEMV_MAX_ROWS).contains(&n) && k > 0).then_some((n, k)))
    }

    /// SwiGLU's `silu(x · gateᵀ) ⊙ (x · upᵀ)` by `gemv_bf16_glu`; None where it does not apply
    /// (as for [`CudaBackend::gemv`], the fused kernels turned off, or gate and up of other shapes).
    fn gemv_glu(&self, x: &CudaTensor, gate: &CudaWeight, up: &CudaWeight) -> BResult<Option<CudaTensor>> {
        let Some((n, k)) = self.gemv_shape(x)? else {
            return Ok(None);
        };
        let (Data::Bf16(g), Data::Bf16(u)) = (&*gate.data, &*up.data) else {
            return Ok(None);
        };
        let m = gate.rows;
        if !self.options.fused || m == 0 || gate.cols != k || (up.rows, up.cols) != (m, k) {
            return Ok(None);
        }
        let (n32, k32, m32) = (n as u32, k as u32, m as u32);
        let mut y = self.alloc_f32(n * m)?;
        let geometry = launch::gemv(m.div_ceil(launch::GEMV_WARPS as usize))?;
        launch!(self, "gemv_bf16_glu", geometry; x.f32(), &n32, &k32, g, u, &mut y, &m32)?;
        Ok(Some(self.activation(y, vec![n, m])))
    }

    /// x's rows and columns for a norm with one weight a column.
    fn norm_dims(x: &CudaTensor, w: &CudaTensor, op: &str) -> BResult<(usize, usize)> {
        let (rows, cols) = x.dims2()?;
        if w.numel() != cols {
            return Err(BackendError::Shape(format!(
                "{op}: {cols} columns, {} weights",
                w.numel()
            )));
        }
        Ok((rows, cols))
    }

    /// x's rows and columns and the values `d` of each head of `head` that turn (cos/sin `[n, d]`).
    fn rope_dims(x: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor, head: usize) -> BResult<(usize, usize, usize)> {
        let (n, cols) = x.dims2()?;
        let (cn, d) = cos.dims2()?;
        if d == 0 || head < d || !d.is_multiple_of(2) || !cols.is_multiple_of(head) || cn != n || sin.shape != cos.shape
        {
            return Err(BackendError::Shape(format!(
                "rope: x {:?}, cos {:?}, sin {:?}, heads of {head}",
                x.shape, cos.shape, sin.shape
            )));
        }
        Ok((n, cols, d))
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type BlockTables = CudaBlockTables;
    type KvCache = CudaKvCache;
    type Paged = CudaPaged;
    type Segments = CudaSegments;
    type StateCache = CudaStates;

    const CAPABILITIES: super::Capabilities = super::Capabilities {
        compute: crate::arch::config::DType::F32,
        quantized: &[],
        half_weights: Some(crate::arch::config::DType::Bf16),
        sampling: super::DeviceSamplingSupport::Greedy,
    };

    fn describe(&self) -> String {
        CudaBackend::describe(self)
    }

    fn device_memory(&self) -> Option<BResult<DeviceMemory>> {
        Some(self.memory())
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn ledger(&self) -> &MemoryLedger {
        &self.ledger
    }

    fn load_weight(&self, raw: RawTensor<'_>, _usage: super::MatrixUse) -> BResult<CudaWeight> {
        let Some((rows, cols)) = raw.matrix_dims() else {
            return Err(BackendError::Shape(format!("a weight matrix of shape {:?}", raw.shape)));
        };
        // Matrices in bf16 when asked: a bf16 checkpoint's bits as stored, others rounded to
        // nearest even.
        refuse_blocks(&raw)?;
        let data = if self.options.bf16_weights && raw.shape.len() == 2 {
            if raw.dtype.bytes_of(rows * cols) != Some(raw.data.len()) {
                return Err(BackendError::Shape(format!(
                    "weight of shape {:?} has {} bytes",
                    raw.shape,
                    raw.data.len()
                )));
            }
            let bits: Vec<u16> = match raw.dtype {
                RawDType::Bf16 => raw
                    .data
                    .chunks_exact(2)
                    .map(|b| u16::from_le_bytes([b[0], b[1]]))
                    .collect(),
                _ => crate::model::weights::host_f32(&raw)
                    .into_iter()
                    .map(|v| half::bf16::from_f32(v).to_bits())
                    .collect(),
            };
            let bits = if bits.is_empty() { vec![0] } else { bits };
            Data::Bf16(
                self.stream
                    .clone_htod(&bits)
                    .map_err(self.alloc_err(2 * bits.len() as u64))?,
            )
        } else {
            Data::F32(self.floats(&raw)?)
        };
        Ok(CudaWeight {
            _held: Arc::new(self.ledger.hold(Category::Weights, data.bytes())),
            data: Arc::new(data),
            rows,
            cols,
        })
    }

    fn load_tensor(&self, raw: RawTensor<'_>) -> BResult<CudaTensor> {
        let data = self.floats(&raw)?;
        Ok(self.wrap(data, raw.shape, Category::Weights))
    }

    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> BResult<CudaTensor> {
        if data.len() != shape.iter().product::<usize>() {
            return Err(BackendError::Shape(format!(
                "{} values for shape {shape:?}",
                data.len()
            )));
        }
        let host = if data.is_empty() { vec![0.0] } else { data };
        let s = self
            .stream
            .clone_htod(&host)
            .map_err(self.alloc_err(4 * host.len() as u64))?;
        Ok(self.activation(s, shape.to_vec()))
    }

    fn keep(&self, t: &CudaTensor, category: Category) -> CudaTensor {
        let bytes = 4 * t.data.len() as u64;
        CudaTensor {
            data: t.data.clone(),
            shape: t.shape.clone(),
            _held: Arc::new(self.ledger.hold(category, bytes)),
        }
    }

    /// The copy (which waits for the stream) happens when the read is first polled, so recording
    /// a step ends before its kernels finish: the engine's one wait is the await of this future.
    fn read(&self, t: &CudaTensor) -> Readback {
        let (n, data, stream) = (t.numel(), t.data.clone(), self.stream.clone());
        Box::pin(async move {
            let mut v = stream.clone_dtoh(&*data).map_err(lib)?;
            v.truncate(n);
            Ok(v)
        })
    }

    fn alloc_block_tables(&self, layout: KvLayout) -> BResult<CudaBlockTables> {
        let len = (layout.tables.rows * layout.tables.max_blocks).max(1);
        let ids = self
            .stream
            .alloc_zeros::<u32>(len)
            .map_err(self.alloc_err(4 * len as u64))?;
        Ok(CudaBlockTables {
            layout,
            ids: Arc::new(ids),
            _held: self.ledger.hold(Category::Activations, 4 * len as u64),
        })
    }

    fn write_block_tables(&self, tables: &mut CudaBlockTables, writes: &[TableWrite]) -> BResult<()> {
        let writes = super::paged::check_writes(&tables.layout, writes)?;
        if Arc::get_mut(&mut tables.ids).is_none() {
            // A step recorded before still holds them: it keeps them as they were.
            tables.ids = Arc::new(tables.ids.try_clone().map_err(lib)?);
        }
        let ids = Arc::get_mut(&mut tables.ids).expect("unshared above");
        for (at, blocks) in writes.iter().filter(|(_, b)| !b.is_empty()) {
            self.stream
                .memcpy_htod(blocks, &mut ids.slice_mut(*at..*at + blocks.len()))
                .map_err(lib)?;
        }
        Ok(())
    }

    fn upload_paged(&self, batch: PagedBatch, tables: &CudaBlockTables) -> BResult<CudaPaged> {
        if batch.layout != tables.layout {
            return Err(BackendError::Shape("a step's batch for other block tables".into()));
        }
        let layout = batch.layout;
        let rows = batch.flatten()?;
        if self.profile {
            self.hold(profile::step(rows.rows, launch::GEMV_MAX_ROWS))?;
        }
        // Tiles pay where most rows prefill: a decode row in a tile keeps one warp of eight busy.
        let prefill_rows: usize = batch
            .seqs
            .iter()
            .map(|s| s.query_len)
            .filter(|&n| n >= TILED_PREFILL_ROWS)
            .sum();
        let per_warp = launch::tile_rows_per_warp(layout.head_dim)
            .filter(|_| self.options.tiled_attention && prefill_rows > 0 && 2 * prefill_rows >= rows.rows);
        let tiles = match per_warp {
            Some(per_warp) => {
                let seqs: Vec<_> = batch.seqs.iter().map(|s| (s.query_start, s.query_len)).collect();
                let t = launch::causal_tiles(&seqs, per_warp)?;
                Some((self.upload_u32(&t)?, t.len() / 2, per_warp))
            }
            None => None,
        };
        let tile_words = tiles.as_ref().map_or(0, |(_, n, _)| 2 * n);
        let bytes = 4 * (rows.slots.len() + rows.meta.len() + tile_words) as u64;
        Ok(CudaPaged {
            slots: self.upload_u32(&rows.slots)?,
            meta: self.upload_u32(&rows.meta)?,
            tables: tables.ids.clone(),
            rows: rows.rows,
            layout,
            tiles,
            max_keys: rows.meta.iter().skip(1).step_by(2).max().map_or(0, |&n| n as usize),
            _held: self.ledger.hold(Category::Activations, bytes),
        })
    }

    fn upload_segments(&self, segments: &[(usize, usize)]) -> BResult<CudaSegments> {
        let rows = super::paged::segment_rows(segments)?;
        Ok(CudaSegments {
            _held: self.ledger.hold(Category::Activations, 4 * rows.len() as u64),
            num_rows: rows.len() / 2,
            rows: self.upload_u32(&rows)?,
        })
    }

    fn shape(&self, t: &CudaTensor) -> Vec<usize> {
        t.shape.clone()
    }

    fn linear(&self, x: &CudaTensor, w: &CudaWeight, b: Option<&CudaTensor>) -> BResult<CudaTensor> {
        let (n, k) = x.dims2()?;
        let (m, wk) = (w.rows, w.cols);
        if wk != k || b.is_some_and(|b| b.numel() != m) {
            return Err(BackendError::Shape(format!(
                "linear: x {:?}, w [{m}, {wk}], bias {:?}",
                x.shape,
                b.map(|b| &b.shape)
            )));
        }
        if let Some(mut y) = self.gemv(x, &[(w, b)])? {
            return y
                .pop()
                .ok_or_else(|| BackendError::Shape("gemv_bf16 gave no product".into()));
        }
        let xs = x.f32();
        let mut y = self.alloc_f32(n * m)?;
        if n == 0 || m == 0 || k == 0 {
            self.stream.memset_zeros(&mut y).map_err(lib)?;
        } else {
            match &*w.data {
                Data::F32(ws) => {
                    let cfg = GemmConfig {
                        transa: blas::cublasOperation_t::CUBLAS_OP_T,
                        transb: blas::cublasOperation_t::CUBLAS_OP_N,
                        m: m as i32,
                        n: n as i32,
                        k: k as i32,
                        alpha: 1.0f32,
                        lda: k as i32,
                        ldb: k as i32,
                        beta: 0.0f32,
                        ldc: m as i32,
                    };
                    // SAFETY: as in gemm_bf16, with f32 buffers of the stated sizes.
                    unsafe { self.blas.gemm(cfg, ws, xs, &mut y) }.map_err(lib)?;
                }
                Data::Bf16(ws) => self.gemm_bf16(xs, ws, &mut y, (n, k, m))?,
            }
        }
        if let Some(b) = b {
            let (bs, rows, cols) = (b.f32(), n as u32, m as u32);
            launch!(self, "add_bias", launch::elementwise(n * m)?; &mut y, bs, &rows, &cols)?;
        }
        Ok(self.activation(y, vec![n, m]))
    }

    /// By `gemv_bf16` where it applies (decode: one launch for all of `ws`), else one
    /// [`Backend::linear`] each.
    fn linears(&self, x: &CudaTensor, ws: &[(&CudaWeight, Option<&CudaTensor>)]) -> BResult<Vec<CudaTensor>> {
        match self.gemv(x, ws)? {
            Some(out) => Ok(out),
            None => ws.iter().map(|&(w, b)| self.linear(x, w, b)).collect(),
        }
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> BResult<CudaTensor> {
        let (vocab, dim) = (table.rows, table.cols);
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(BackendError::Shape(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        let idx = self.upload_u32(ids)?;
        let mut out = self.alloc_f32(ids.len() * dim)?;
        let (n, d, g) = (ids.len() as u32, dim as u32, launch::elementwise(ids.len() * dim)?);
        match &*table.data {
            Data::F32(t) => launch!(self, "embedding_f32", g; t, &idx, &mut out, &n, &d)?,
            Data::Bf16(t) => launch!(self, "embedding_bf16", g; t, &idx, &mut out, &n, &d)?,
        }
        Ok(self.activation(out, vec![ids.len(), dim]))
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaTensor, eps: f64) -> BResult<CudaTensor> {
        let (rows, cols) = Self::norm_dims(x, w, "rms_norm")?;
        let (xs, ws, c, e) = (x.f32(), w.f32(), cols as u32, eps as f32);
        let mut out = self.alloc_f32(rows * cols)?;
        if rows > 0 {
            launch!(self, "rms_norm", launch::per_row(rows)?; xs, ws, &mut out, &c, &e)?;
        }
        Ok(self.activation(out, x.shape.clone()))
    }

    fn layer_norm(&self, x: &CudaTensor, w: &CudaTensor, b: &CudaTensor, eps: f64) -> BResult<CudaTensor> {
        let (rows, cols) = x.dims2()?;
        if w.numel() != cols || b.numel() != cols {
            return Err(BackendError::Shape(format!(
                "layer_norm: {cols} columns, {} weights",
                w.numel()
            )));
        }
        let (xs, ws, bs, c, e) = (x.f32(), w.f32(), b.f32(), cols as u32, eps as f32);
        let mut out = self.alloc_f32(rows * cols)?;
        if rows > 0 {
            launch!(self, "layer_norm", launch::per_row(rows)?; xs, ws, bs, &mut out, &c, &e)?;
        }
        Ok(self.activation(out, x.shape.clone()))
    }

    fn activate(&self, x: &CudaTensor, act: Activation) -> BResult<CudaTensor> {
        let (xs, n, kind) = (x.f32(), x.numel() as u32, launch::activation_kind(act));
        let mut out = self.alloc_f32(x.numel())?;
        launch!(self, "activate", launch::elementwise(x.numel())?; xs, &mut out, &n, &kind)?;
        Ok(self.activation(out, x.shape.clone()))
    }

    fn silu_mul(&self, gate: &CudaTensor, up: &CudaTensor) -> BResult<CudaTensor> {
        Self::same_shape(gate, up, "silu_mul")?;
        let (g, u, n) = (gate.f32(), up.f32(), gate.numel() as u32);
        let mut out = self.alloc_f32(gate.numel())?;
        launch!(self, "silu_mul", launch::elementwise(gate.numel())?; g, u, &mut out, &n)?;
        Ok(self.activation(out, gate.shape.clone()))
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> BResult<CudaTensor> {
        Self::same_shape(a, b, "add")?;
        let (x, y, n) = (a.f32(), b.f32(), a.numel() as u32);
        let mut out = self.alloc_f32(a.numel())?;
        launch!(self, "add", launch::elementwise(a.numel())?; x, y, &mut out, &n)?;
        Ok(self.activation(out, a.shape.clone()))
    }

    /// By `add_rms_norm` (one launch) unless the fused kernels are off.
    fn add_rms_norm(
        &self,
        x: &CudaTensor,
        y: &CudaTensor,
        w: &CudaTensor,
        eps: f64,
    ) -> BResult<(CudaTensor, CudaTensor)> {
        if !self.options.fused {
            return fused::add_rms_norm(self, x, y, w, eps);
        }
        Self::same_shape(x, y, "add_rms_norm")?;
        let (rows, cols) = Self::norm_dims(x, w, "add_rms_norm")?;
        let (c, e) = (cols as u32, eps as f32);
        let (mut sum, mut out) = (self.alloc_f32(rows * cols)?, self.alloc_f32(rows * cols)?);
        if rows > 0 {
            launch!(self, "add_rms_norm", launch::per_row(rows)?; x.f32(), y.f32(), w.f32(), &mut sum, &mut out, &c, &e)?;
        }
        Ok((
            self.activation(sum, x.shape.clone()),
            self.activation(out, x.shape.clone()),
        ))
    }

    /// By `norm_rope` (one launch) unless the fused kernels are off or the heads are wider than
    /// it holds.
    fn norm_rope(
        &self,
        x: &CudaTensor,
        w: Option<&CudaTensor>,
        eps: f64,
        cos: &CudaTensor,
        sin: &CudaTensor,
        head_dim: usize,
    ) -> BResult<CudaTensor> {
        if !self.options.fused || head_dim > launch::MAX_HEAD_DIM {
            return fused::norm_rope(self, x, w, eps, cos, sin, head_dim);
        }
        let (n, cols, d) = Self::rope_dims(x, cos, sin, head_dim)?;
        if let Some(w) = w.filter(|w| w.numel() != head_dim) {
            return Err(BackendError::Shape(format!(
                "norm_rope: heads of {head_dim}, {} norm weights",
                w.numel()
            )));
        }
        let heads = cols / head_dim;
        let (norm, ws) = w.map_or((0u32, x.f32()), |w| (1, w.f32()));
        let (n32, heads32, h32, d32, e) = (n as u32, heads as u32, head_dim as u32, d as u32, eps as f32);
        let mut out = self.alloc_f32(n * cols)?;
        if n > 0 {
            launch!(self, "norm_rope", launch::per_head(n * heads, head_dim)?;
                x.f32(), ws, &norm, cos.f32(), sin.f32(), &mut out, &n32, &heads32, &h32, &d32, &e)?;
        }
        Ok(self.activation(out, x.shape.clone()))
    }

    /// By `gemv_bf16_glu` where it applies (decode with bf16 weights), else the two products and
    /// `silu_mul`.
    fn swiglu(&self, x: &CudaTensor, gate: &CudaWeight, up: &CudaWeight) -> BResult<CudaTensor> {
        match self.gemv_glu(x, gate, up)? {
            Some(y) => Ok(y),
            None => fused::swiglu(self, x, gate, up),
        }
    }

    fn rope(&self, x: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor) -> BResult<CudaTensor> {
        let d = cos.dims2()?.1;
        self.rope_partial(x, cos, sin, d)
    }

    fn rope_partial(&self, x: &CudaTensor, cos: &CudaTensor, sin: &CudaTensor, head: usize) -> BResult<CudaTensor> {
        let (n, cols, d) = Self::rope_dims(x, cos, sin, head)?;
        let (xs, cs, ss) = (x.f32(), cos.f32(), sin.f32());
        let (n32, c32, d32, h32) = (n as u32, cols as u32, d as u32, head as u32);
        let mut out = self.alloc_f32(n * cols)?;
        launch!(self, "rope", launch::elementwise(n * cols)?; xs, cs, ss, &mut out, &n32, &c32, &d32, &h32)?;
        Ok(self.activation(out, x.shape.clone()))
    }

    fn sigmoid_mul(&self, gate: &CudaTensor, x: &CudaTensor) -> BResult<CudaTensor> {
        Self::same_shape(gate, x, "sigmoid_mul")?;
        let (g, v, n) = (gate.f32(), x.f32(), gate.numel() as u32);
        let mut out = self.alloc_f32(gate.numel())?;
        launch!(self, "sigmoid_mul", launch::elementwise(gate.numel())?; g, v, &mut out, &n)?;
        Ok(self.activation(out, gate.shape.clone()))
    }

    fn alloc_states(&self, layout: StateLayout) -> BResult<CudaStates> {
        let (conv, rec) = layout.slot_values();
        let bytes = layout.bytes(4);
        let make = |per_slot: usize| -> BResult<Vec<CudaSlice<f32>>> {
            (0..layout.layers)
                .map(|_| {
                    self.stream
                        .alloc_zeros::<f32>((layout.slots * per_slot).max(1))
                        .map_err(self.alloc_err(bytes))
                })
                .collect()
        };
        Ok(CudaStates {
            layout,
            conv: make(conv)?,
            recurrent: make(rec)?,
            _held: self.ledger.hold(Category::StateCache, bytes),
        })
    }

    fn gated_delta_net(
        &self,
        states: &mut CudaStates,
        layer: usize,
        input: DeltaNetInput<'_, CudaTensor>,
        seqs: &[StateSeq],
    ) -> BResult<CudaTensor> {
        let l = states.layout;
        let shapes = [input.qkv, input.a, input.b, input.conv, input.a_log, input.dt_bias].map(|t| t.shape.as_slice());
        let rows = l.check_input(layer, shapes, seqs)?;
        let conv_dim = l.conv_dim;
        let meta: Vec<u32> = seqs
            .iter()
            .flat_map(|s| [s.start, s.len, s.slot, usize::from(s.fresh)].map(|v| v as u32))
            .collect();
        let meta = self.upload_u32(&meta)?;
        let mut mixed = self.alloc_f32(rows * conv_dim)?;
        let mut out = self.alloc_f32(rows * l.heads * l.value_dim)?;
        let (n_seqs, cd, len) = (seqs.len() as u32, conv_dim as u32, l.conv_len as u32);
        let (heads, key_heads, dk, dv) = (l.heads as u32, l.key_heads as u32, l.key_dim as u32, l.value_dim as u32);
        if !seqs.is_empty() {
            let (x, w) = (input.qkv.f32(), input.conv.f32());
            let window = &mut states.conv[layer];
            launch!(self, "delta_conv", launch::elementwise(seqs.len() * conv_dim)?;
                x, w, window, &mut mixed, &meta, &n_seqs, &cd, &len)?;
            let (a, b, a_log, dt) = (input.a.f32(), input.b.f32(), input.a_log.f32(), input.dt_bias.f32());
            let state = &mut states.recurrent[layer];
            launch!(self, "delta_rule", launch::delta_rule(seqs.len(), l.heads)?;
                &mixed, a, b, a_log, dt, state, &mut out, &meta, &cd, &heads, &key_heads, &dk, &dv)?;
        }
        Ok(self.activation(out, vec![rows, l.heads * l.value_dim]))
    }

    fn narrow_cols(&self, x: &CudaTensor, start: usize, len: usize) -> BResult<CudaTensor> {
        let (rows, cols) = x.dims2()?;
        if start + len > cols {
            return Err(BackendError::Shape(format!("narrow_cols: {start}+{len} of {cols}")));
        }
        let xs = x.f32();
        let (r, c, s, l) = (rows as u32, cols as u32, start as u32, len as u32);
        let mut out = self.alloc_f32(rows * len)?;
        launch!(self, "narrow_cols", launch::elementwise(rows * len)?; xs, &mut out, &r, &c, &s, &l)?;
        Ok(self.activation(out, vec![rows, len]))
    }

    fn reshape(&self, x: &CudaTensor, rows: usize, cols: usize) -> BResult<CudaTensor> {
        if rows * cols != x.numel() {
            return Err(BackendError::Shape(format!("reshape {:?} to {rows}×{cols}", x.shape)));
        }
        Ok(CudaTensor {
            shape: vec![rows, cols],
            ..x.clone()
        })
    }

    fn gather_rows(&self, x: &CudaTensor, idx: &[usize]) -> BResult<CudaTensor> {
        let (rows, cols) = x.dims2()?;
        if let Some(bad) = idx.iter().find(|&&i| i >= rows) {
            return Err(BackendError::Shape(format!("gather_rows: row {bad} of {rows}")));
        }
        let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
        let dev = self.upload_u32(&ids)?;
        let (xs, n, c) = (x.f32(), idx.len() as u32, cols as u32);
        let mut out = self.alloc_f32(idx.len() * cols)?;
        launch!(self, "gather_rows", launch::elementwise(idx.len() * cols)?; xs, &dev, &mut out, &n, &c)?;
        Ok(self.activation(out, vec![idx.len(), cols]))
    }

    fn scale_rows(&self, x: &CudaTensor, scales: &[f32]) -> BResult<CudaTensor> {
        let (rows, cols) = x.dims2()?;
        if scales.len() != rows {
            return Err(BackendError::Shape(format!("{} scales for {rows} rows", scales.len())));
        }
        let s = self.upload(scales.to_vec(), &[rows])?;
        let (xs, ss, n, c) = (x.f32(), s.f32(), (rows * cols) as u32, cols as u32);
        let mut out = self.alloc_f32(rows * cols)?;
        launch!(self, "scale_rows", launch::elementwise(rows * cols)?; xs, ss, &mut out, &n, &c)?;
        Ok(self.activation(out, vec![rows, cols]))
    }

    fn scatter_rows(&self, x: &CudaTensor, idx: &[usize], src: &CudaTensor, add: bool) -> BResult<CudaTensor> {
        let (rows, cols) = x.dims2()?;
        let (srows, scols) = src.dims2()?;
        if scols != cols || srows != idx.len() || idx.iter().any(|&i| i >= rows) {
            return Err(BackendError::Shape(format!(
                "scatter of {srows}×{scols} rows into {rows}×{cols} at {} positions",
                idx.len()
            )));
        }
        let mut out = self.alloc_f32(rows * cols)?;
        if rows * cols > 0 {
            self.stream.memcpy_dtod(x.f32(), &mut out).map_err(lib)?;
        }
        let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
        let dev = self.upload_u32(&ids)?;
        let (s, n, c, a32) = (src.f32(), idx.len() as u32, cols as u32, add as u32);
        launch!(self, "scatter_rows", launch::elementwise(idx.len() * cols)?; &mut out, &dev, s, &n, &c, &a32)?;
        Ok(self.activation(out, vec![rows, cols]))
    }

    fn concat_rows(&self, parts: &[CudaTensor]) -> BResult<CudaTensor> {
        let cols = match parts.first() {
            Some(p) => p.dims2()?.1,
            None => return Err(BackendError::Shape("concat_rows of nothing".into())),
        };
        let mut rows = 0;
        for p in parts {
            let (r, c) = p.dims2()?;
            if c != cols {
                return Err(BackendError::Shape(format!(
                    "concat_rows: {c} columns, expected {cols}"
                )));
            }
            rows += r;
        }
        let mut out = self.alloc_f32(rows * cols)?;
        let mut at = 0;
        for p in parts {
            let n = p.numel();
            if n > 0 {
                let mut dst = out.slice_mut(at..at + n);
                self.stream.memcpy_dtod(&p.f32().slice(0..n), &mut dst).map_err(lib)?;
            }
            at += n;
        }
        Ok(self.activation(out, vec![rows, cols]))
    }

    fn segment_attention(
        &self,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        heads: usize,
        segments: &CudaSegments,
    ) -> BResult<CudaTensor> {
        let (rows, cols) = q.dims2()?;
        if heads == 0
            || !cols.is_multiple_of(heads)
            || k.shape != q.shape
            || v.shape != q.shape
            || segments.num_rows != rows
        {
            return Err(BackendError::Shape(format!(
                "segment_attention: q {:?}, k {:?}, v {:?}, {heads} heads, segments of {} rows",
                q.shape, k.shape, v.shape, segments.num_rows
            )));
        }
        let d = cols / heads;
        let g = launch::attention(rows, heads, d)?;
        let tiles = if self.options.tiled_attention {
            launch::segment_tiles(rows, heads, d)?
        } else {
            None
        };
        let (qs, ks, vs) = (q.f32(), k.f32(), v.f32());
        let (h, d32, scale) = (heads as u32, d as u32, 1.0 / (d as f32).sqrt());
        let mut out = self.alloc_f32(rows * cols)?;
        match tiles {
            _ if rows == 0 => {}
            Some((g, per_warp)) => {
                let n = rows as u32;
                launch!(self, "segment_attention_tiled", g; qs, ks, vs, &segments.rows, &mut out, &n, &h, &d32, &scale, &per_warp)?
            }
            None => launch!(self, "segment_attention", g; qs, ks, vs, &segments.rows, &mut out, &h, &d32, &scale)?,
        }
        Ok(self.activation(out, vec![rows, cols]))
    }

    fn alloc_kv(&self, layout: KvLayout) -> BResult<CudaKvCache> {
        let per_layer = layout.num_blocks * layout.block_size * layout.kv_heads * layout.head_dim;
        let bytes = layout.bytes(4);
        let mut keys = Vec::with_capacity(layout.layers);
        let mut values = Vec::with_capacity(layout.layers);
        for _ in 0..layout.layers {
            for side in [&mut keys, &mut values] {
                side.push(
                    self.stream
                        .alloc_zeros::<f32>(per_layer.max(1))
                        .map_err(self.alloc_err(bytes))?,
                );
            }
        }
        self.kv_layout.set(Some(layout));
        Ok(CudaKvCache {
            layout,
            keys,
            values,
            _held: self.ledger.hold(Category::KvCache, bytes),
        })
    }

    fn write_kv(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        k: &CudaTensor,
        v: &CudaTensor,
        batch: &CudaPaged,
    ) -> BResult<()> {
        let l = cache.layout;
        let width = l.kv_heads * l.head_dim;
        if batch.layout != l || k.numel() != batch.rows * width || v.shape != k.shape || layer >= l.layers {
            return Err(BackendError::Shape(format!(
                "write_kv: {} slots for k {:?} in layer {layer}",
                batch.rows, k.shape
            )));
        }
        let (ks, vs, n, w) = (k.f32(), v.f32(), batch.rows as u32, width as u32);
        if batch.rows > 0 {
            let (kc, vc) = (&mut cache.keys[layer], &mut cache.values[layer]);
            launch!(self, "write_kv", launch::elementwise(batch.rows * width)?; kc, vc, ks, vs, &batch.slots, &n, &w)?;
        }
        Ok(())
    }

    fn paged_attention(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaTensor,
        heads: usize,
        batch: &CudaPaged,
    ) -> BResult<CudaTensor> {
        let l = cache.layout;
        let (rows, cols) = q.dims2()?;
        let d = l.head_dim;
        if batch.layout != l
            || cols != heads * d
            || l.kv_heads == 0
            || !heads.is_multiple_of(l.kv_heads)
            || layer >= l.layers
            || rows != batch.rows
        {
            return Err(BackendError::Shape(format!(
                "paged_attention: q {rows}×{cols}, {heads} heads of {d}, {} batch rows",
                batch.rows
            )));
        }
        let g = launch::attention(rows, heads, d)?;
        let qs = q.f32();
        let (h, kvh, d32, bs) = (heads as u32, l.kv_heads as u32, d as u32, l.block_size as u32);
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = self.alloc_f32(rows * cols)?;
        let (kc, vc) = (&cache.keys[layer], &cache.values[layer]);
        match &batch.tiles {
            _ if rows == 0 => {}
            Some((tiles, n, per_warp)) => {
                let g = launch::paged_tiles(*n, heads, d, *per_warp)?;
                launch!(self, "paged_attention_tiled", g; qs, kc, vc, &batch.meta, &*batch.tables, tiles, &mut out, &h, &kvh, &d32, &bs, &scale, per_warp)?
            }
            None => match launch::attention_parts(rows, heads, batch.max_keys) {
                parts if parts > 1 && self.options.split_attention => {
                    let blocks = rows * heads * parts;
                    let mut partial = self.alloc_f32(blocks * d)?;
                    let mut stats = self.alloc_f32(2 * blocks)?;
                    let _held = self.ledger.hold(Category::Activations, 4 * (blocks * (d + 2)) as u64);
                    let gs = launch::split_attention(rows, heads, d, parts)?;
                    launch!(self, "paged_attention_split", gs; qs, kc, vc, &batch.meta, &*batch.tables, &mut partial, &mut stats, &h, &kvh, &d32, &bs, &scale)?;
                    let n_parts = parts as u32;
                    let gm = launch::attention_merge(rows, heads, d)?;
                    launch!(self, "paged_attention_merge", gm; &partial, &stats, &mut out, &h, &d32, &n_parts)?
                }
                _ => {
                    launch!(self, "paged_attention", g; qs, kc, vc, &batch.meta, &*batch.tables, &mut out, &h, &kvh, &d32, &bs, &scale)?
                }
            },
        }
        Ok(self.activation(out, vec![rows, cols]))
    }

    fn sample(&self, logits: &CudaTensor, rows: &[DeviceSampling]) -> BResult<CudaTensor> {
        let (n, width) = logits.dims2()?;
        if n != rows.len() || width == 0 {
            return Err(BackendError::Shape(format!(
                "sample: {} settings for {n} rows of {width} logits",
                rows.len()
            )));
        }
        if let Some(s) = rows.iter().find(|s| !Self::CAPABILITIES.samples(s)) {
            // The engine reads such a step's logits for the host instead (`CAPABILITIES`).
            return Err(BackendError::Shape(format!(
                "sample: the cuda backend samples greedy rows only, not {s:?}"
            )));
        }
        let allowed: Vec<u32> = rows.iter().map(|s| s.allowed.clamp(1, width) as u32).collect();
        let dev = self.upload_u32(&allowed)?;
        let (ls, w) = (logits.f32(), width as u32);
        let mut out = self.alloc_f32(2 * n)?;
        launch!(self, "greedy", launch::per_row(n)?; ls, &dev, &mut out, &w)?;
        Ok(self.activation(out, vec![n, 2]))
    }
}

/// GGML's block types have no CUDA kernels yet: a one-line refusal naming the type.
fn refuse_blocks(raw: &RawTensor<'_>) -> BResult<()> {
    match raw.dtype {
        RawDType::Blocks(t) => Err(BackendError::Unsupported {
            backend: "cuda",
            dtype: t.name(),
            what: "use --backend cpu or wgpu",
        }),
        _ => Ok(()),
    }
}
