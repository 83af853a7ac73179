//! The WGSL kernels (one file per family under `kernels/`), their pipelines compiled once and
//! cached, and the step's command encoder every dispatch is recorded into until a read submits it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A kernel family: its WGSL source and whether it reads stored weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Kernel {
    Elementwise,
    Rows,
    Embedding,
    Norm,
    Rope,
    Matmul,
    Attention,
    KvWrite,
    Sample,
}

/// How stored weights are read by a kernel that reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum WeightElem {
    /// One f32 per element.
    F32,
    /// Two f16 per `u32`.
    F16,
}

impl Kernel {
    fn source(self) -> &'static str {
        match self {
            Kernel::Elementwise => include_str!("kernels/elementwise.wgsl"),
            Kernel::Rows => include_str!("kernels/rows.wgsl"),
            Kernel::Embedding => include_str!("kernels/embedding.wgsl"),
            Kernel::Norm => include_str!("kernels/norm.wgsl"),
            Kernel::Rope => include_str!("kernels/rope.wgsl"),
            Kernel::Matmul => include_str!("kernels/matmul.wgsl"),
            Kernel::Attention => include_str!("kernels/attention.wgsl"),
            Kernel::KvWrite => include_str!("kernels/kv_write.wgsl"),
            Kernel::Sample => include_str!("kernels/sample.wgsl"),
        }
    }

    /// The module's full text: the shared helpers, the weight reader if any, the kernel.
    pub fn module_source(self, weights: Option<WeightElem>) -> String {
        let reader = match weights {
            None => "",
            Some(WeightElem::F32) => include_str!("kernels/weights_f32.wgsl"),
            Some(WeightElem::F16) => include_str!("kernels/weights_f16.wgsl"),
        };
        format!("{}\n{reader}\n{}", include_str!("kernels/common.wgsl"), self.source())
    }
}

/// What a pipeline is compiled for: kernel, weight format, entry point.
type PipelineKey = (Kernel, Option<WeightElem>, &'static str);

/// Compiled pipelines by kernel, weight format and entry point.
#[derive(Debug, Default)]
pub(super) struct Pipelines {
    cache: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
}

impl Pipelines {
    pub fn get(
        &self,
        device: &wgpu::Device,
        kernel: Kernel,
        weights: Option<WeightElem>,
        entry: &'static str,
    ) -> Arc<wgpu::ComputePipeline> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry((kernel, weights, entry))
            .or_insert_with(|| {
                let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(entry),
                    source: wgpu::ShaderSource::Wgsl(kernel.module_source(weights).into()),
                });
                Arc::new(device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(entry),
                    layout: None,
                    module: &module,
                    entry_point: Some(entry),
                    compilation_options: Default::default(),
                    cache: None,
                }))
            })
            .clone()
    }
}

/// The workgroup grid for `groups` workgroups: at most 65,535 along x, the rest along y.
pub(super) fn grid(groups: u64) -> (u32, u32) {
    const MAX: u64 = 65_535;
    let groups = groups.max(1);
    if groups <= MAX {
        (groups as u32, 1)
    } else {
        (MAX as u32, groups.div_ceil(MAX) as u32)
    }
}

/// Packs kernel parameters (u32 and f32 fields) into a uniform block, padded to 16 bytes.
pub(super) fn params(words: &[u32]) -> Vec<u8> {
    let mut bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    bytes.resize(bytes.len().div_ceil(16).max(1) * 16, 0);
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_stay_inside_the_dimension_limit() {
        assert_eq!(grid(0), (1, 1));
        assert_eq!(grid(65_535), (65_535, 1));
        assert_eq!(grid(65_536), (65_535, 2));
        assert_eq!(params(&[1, 2, 3]).len(), 16);
        assert_eq!(params(&[0; 5]).len(), 32);
    }
}
