//! Finding an adapter and opening a device with its real limits: natively a hardware adapter when
//! there is one and lavapipe otherwise (or the one [`WgpuOptions::adapter`] names); in the browser
//! the page's WebGPU adapter.

use super::super::{BResult, BackendError};

/// How the backend chooses and opens its device.
#[derive(Debug, Clone, Default)]
pub struct WgpuOptions {
    /// A substring of the adapter's name to pick (case-insensitive; the server takes it from
    /// `KVLENS_WGPU_ADAPTER`); None: the first adapter.
    pub adapter: Option<String>,
    /// Caps the storage-binding size below the adapter's (tests of the split path).
    pub max_binding_bytes: Option<u64>,
    /// Store 2-D weights as f16 (two per `u32`) instead of f32.
    pub f16_weights: bool,
    /// Quantize the matrices this format quantizes on load (`--quantization`); the other 2-D
    /// weights follow `f16_weights`.
    pub quantization: crate::arch::weight_format::WeightFormat,
    /// Use the barrier-free kernels for matmul, norms and attention (None: on CPU adapters such
    /// as lavapipe, where a workgroup barrier is slow) rather than the tiled GEMM, the GEMV and the
    /// workgroup reductions.
    pub barrier_free: Option<bool>,
}

/// The opened device and what it allows.
#[derive(Debug)]
pub(super) struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// Largest storage binding the kernels may use (≤ the device's limit).
    pub max_binding: u64,
}

fn library(msg: String) -> BackendError {
    BackendError::Library(msg.into())
}

fn adapter_line(info: &wgpu::AdapterInfo) -> String {
    format!("{} ({:?}, {:?})", info.name, info.backend, info.device_type)
}

/// Every adapter the instance offers, best first: discrete, integrated, virtual, then CPU
/// (lavapipe) and anything else.
#[cfg(not(target_arch = "wasm32"))]
async fn candidates(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let mut all = instance.enumerate_adapters(wgpu::Backends::all()).await;
    let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    // Vulkan before GL for the same device: GL has neither f16 nor subgroups.
    all.sort_by_key(|a| (rank(a), a.get_info().backend != wgpu::Backend::Vulkan));
    all
}

#[cfg(target_arch = "wasm32")]
async fn candidates(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let opts = wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    };
    instance.request_adapter(&opts).await.into_iter().collect()
}

#[cfg(not(target_arch = "wasm32"))]
const NO_ADAPTER: &str = "no wgpu adapter found: install a GPU driver, or Mesa's lavapipe \
                          (apt-get install mesa-vulkan-drivers) and set WGPU_BACKEND=vulkan";

#[cfg(target_arch = "wasm32")]
const NO_ADAPTER: &str = "this browser offers no WebGPU adapter (no navigator.gpu, or \
                          requestAdapter() gave null): use a browser with WebGPU enabled; headless \
                          Chromium offers its SwiftShader adapter only with --enable-unsafe-webgpu";

/// Opens the device of the chosen adapter with the adapter's own limits.
pub(super) async fn open(opts: &WgpuOptions) -> BResult<Gpu> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let all = candidates(&instance).await;
    let wanted = opts.adapter.clone();
    let names: Vec<String> = all.iter().map(|a| adapter_line(&a.get_info())).collect();
    let adapter = match &wanted {
        Some(name) => all
            .into_iter()
            .find(|a| a.get_info().name.to_lowercase().contains(&name.to_lowercase())),
        None => all.into_iter().next(),
    };
    let Some(adapter) = adapter else {
        let why = match wanted {
            Some(name) => format!("no wgpu adapter matches {name:?}; found: {names:?}"),
            None => NO_ADAPTER.to_string(),
        };
        return Err(library(why));
    };
    let info = adapter.get_info();
    let limits = adapter.limits();
    let features = adapter.features() & wgpu::Features::SHADER_F16;
    let desc = wgpu::DeviceDescriptor {
        label: Some("kvlens"),
        required_features: features,
        required_limits: limits.clone(),
        ..Default::default()
    };
    let (device, queue) = adapter
        .request_device(&desc)
        .await
        .map_err(|e| library(format!("opening {}: {e}", adapter_line(&info))))?;
    let device_limit = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
    let max_binding = opts.max_binding_bytes.map_or(device_limit, |cap| cap.min(device_limit));
    Ok(Gpu {
        device,
        queue,
        info,
        limits,
        max_binding,
    })
}

impl Gpu {
    /// The adapter, its limits and the features in use, for the start-up log.
    pub fn describe(&self) -> String {
        let l = &self.limits;
        format!(
            "wgpu adapter {}: max storage binding {} MiB, max buffer {} MiB, workgroup storage {} KiB, \
             {} invocations per workgroup; kernels split tensors above {} MiB",
            adapter_line(&self.info),
            l.max_storage_buffer_binding_size >> 20,
            l.max_buffer_size >> 20,
            l.max_compute_workgroup_storage_size >> 10,
            l.max_compute_invocations_per_workgroup,
            self.max_binding >> 20
        )
    }
}
