//! The WGSL kernels (one file per family under `kernels/`), their pipelines compiled once and
//! cached ([`check_all`] compiles every one of them up front).

use crate::arch::blocks::BlockKind;
use crate::arch::ggml::GgmlType;
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
    DeltaNet,
}

/// How stored weights are read by a kernel that reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum WeightElem {
    /// One f32 per element.
    F32,
    /// Two f16 per `u32`.
    F16,
    /// GGML's `q8_0` in pairs of blocks (`kernels/weights_blocks.wgsl`).
    Q8_0,
    /// GGML's `q4_0` in pairs of blocks.
    Q4_0,
    /// A GGML block type in a GGUF file's bytes, unchanged ([`WeightElem::stored`]; read by
    /// `kernels/weights_ggml.wgsl` and the type's file).
    Ggml(GgmlType),
}

impl WeightElem {
    /// GGML block type `t` read as a GGUF file stores it; None for the types the kernels do not
    /// read so (`q8_0` and `q4_0` are laid out in pairs of blocks instead).
    pub fn stored(t: GgmlType) -> Option<Self> {
        Self::ggml_reader(t).map(|_| WeightElem::Ggml(t))
    }

    /// The file defining `eight` for a type kept as stored (read after `weights_ggml.wgsl`).
    fn ggml_reader(t: GgmlType) -> Option<&'static str> {
        Some(match t {
            GgmlType::Q4_1 => include_str!("kernels/weights_q4_1.wgsl"),
            GgmlType::Q5_0 => include_str!("kernels/weights_q5_0.wgsl"),
            GgmlType::Q5_1 => include_str!("kernels/weights_q5_1.wgsl"),
            GgmlType::Q4K => include_str!("kernels/weights_q4_k.wgsl"),
            GgmlType::Q5K => include_str!("kernels/weights_q5_k.wgsl"),
            GgmlType::Q6K => include_str!("kernels/weights_q6_k.wgsl"),
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q8_0 | GgmlType::Q4_0 => return None,
        })
    }

    /// The block format, for `q8_0` and `q4_0` (quantized or laid out on load).
    pub fn block_kind(self) -> Option<BlockKind> {
        match self {
            WeightElem::F32 | WeightElem::F16 | WeightElem::Ggml(_) => None,
            WeightElem::Q8_0 => Some(BlockKind::Q8_0),
            WeightElem::Q4_0 => Some(BlockKind::Q4_0),
        }
    }

    /// Bytes of one row of `cols` values in the format's blocks (`cols` a multiple of the
    /// block): what a part holds per row, before its padding to whole words.
    pub fn row_bytes(self, cols: usize) -> u64 {
        let t = match self {
            WeightElem::F32 => GgmlType::F32,
            WeightElem::F16 => GgmlType::F16,
            WeightElem::Q8_0 => GgmlType::Q8_0,
            WeightElem::Q4_0 => GgmlType::Q4_0,
            WeightElem::Ggml(t) => t,
        };
        let (values, bytes) = t.block();
        (cols / values * bytes) as u64
    }
}

impl Kernel {
    /// Every kernel family (what [`check_all`] compiles).
    pub const ALL: [Kernel; 10] = [
        Kernel::Elementwise,
        Kernel::Rows,
        Kernel::Embedding,
        Kernel::Norm,
        Kernel::Rope,
        Kernel::Matmul,
        Kernel::Attention,
        Kernel::KvWrite,
        Kernel::Sample,
        Kernel::DeltaNet,
    ];

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
            Kernel::DeltaNet => include_str!("kernels/delta_net.wgsl"),
        }
    }

    /// The module's full text: the shared helpers, the weight reader if any, the kernel.
    pub fn module_source(self, weights: Option<WeightElem>) -> String {
        let half = include_str!("kernels/half.wgsl");
        let blocks = format!("{half}\n{}", include_str!("kernels/weights_blocks.wgsl"));
        let reader = match weights {
            None => String::new(),
            Some(WeightElem::F32) => include_str!("kernels/weights_f32.wgsl").into(),
            Some(WeightElem::F16) => include_str!("kernels/weights_f16.wgsl").into(),
            Some(WeightElem::Q8_0) => format!("{blocks}\n{}", include_str!("kernels/weights_q8_0.wgsl")),
            Some(WeightElem::Q4_0) => format!("{blocks}\n{}", include_str!("kernels/weights_q4_0.wgsl")),
            Some(WeightElem::Ggml(t)) => format!(
                "{half}\n{}\n{}",
                include_str!("kernels/weights_ggml.wgsl"),
                WeightElem::ggml_reader(t).unwrap_or_default()
            ),
        };
        format!("{}\n{reader}\n{}", include_str!("kernels/common.wgsl"), self.source())
    }

    /// The weight formats the module is built for: every one where it reads stored weights
    /// (`wload`), none otherwise.
    pub fn weight_formats(self) -> &'static [Option<WeightElem>] {
        if self.source().contains("wload") {
            &[
                Some(WeightElem::F32),
                Some(WeightElem::F16),
                Some(WeightElem::Q8_0),
                Some(WeightElem::Q4_0),
                Some(WeightElem::Ggml(GgmlType::Q4_1)),
                Some(WeightElem::Ggml(GgmlType::Q5_0)),
                Some(WeightElem::Ggml(GgmlType::Q5_1)),
                Some(WeightElem::Ggml(GgmlType::Q4K)),
                Some(WeightElem::Ggml(GgmlType::Q5K)),
                Some(WeightElem::Ggml(GgmlType::Q6K)),
            ]
        } else {
            &[None]
        }
    }

    /// The module's compute entry points, read from its source (`@compute … fn NAME(`).
    pub fn entry_points(self) -> Vec<&'static str> {
        self.source()
            .split("@compute")
            .skip(1)
            .filter_map(|rest| {
                let name = rest.split_once("fn ")?.1;
                name.split_once('(').map(|(name, _)| name.trim())
            })
            .collect()
    }
}

/// Compiles every kernel's module for each weight format it reads, and a pipeline for each of its
/// entry points, on `device`: the number of pipelines, or every compiler error and pipeline error
/// (one line each). In the browser the compiler is the browser's own (Chrome: Tint), natively naga.
pub(super) async fn check_all(device: &wgpu::Device) -> Result<usize, Vec<String>> {
    let mut compiled = 0;
    let mut errors = Vec::new();
    for kernel in Kernel::ALL {
        for &weights in kernel.weight_formats() {
            let what = match weights {
                Some(w) => format!("{kernel:?} kernel ({w:?} weights)"),
                None => format!("{kernel:?} kernel"),
            };
            let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
            let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(&what),
                source: wgpu::ShaderSource::Wgsl(kernel.module_source(weights).into()),
            });
            let info = module.get_compilation_info().await;
            let messages: Vec<String> = info
                .messages
                .iter()
                .filter(|m| m.message_type == wgpu::CompilationMessageType::Error)
                .map(|m| {
                    let at = m
                        .location
                        .map(|l| format!(" at line {}:{}", l.line_number, l.line_position));
                    format!("{what}{}: {}", at.unwrap_or_default(), m.message)
                })
                .collect();
            // The compiler's own messages where it gave any (they carry the line), else the error.
            if let Some(e) = scope.pop().await {
                if messages.is_empty() {
                    errors.push(format!("{what}: {e}"));
                }
                errors.extend(messages);
                continue;
            }
            for entry in kernel.entry_points() {
                let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
                let _pipeline = pipeline(device, &module, entry);
                match scope.pop().await {
                    Some(e) => errors.push(format!("{what}, entry point {entry}: {e}")),
                    None => compiled += 1,
                }
            }
        }
    }
    if errors.is_empty() {
        Ok(compiled)
    } else {
        Err(errors)
    }
}

/// The pipeline of one entry point of a module, its bind-group layout derived from the shader.
fn pipeline(device: &wgpu::Device, module: &wgpu::ShaderModule, entry: &str) -> wgpu::ComputePipeline {
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: None,
        module,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    })
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
                Arc::new(pipeline(device, &module, entry))
            })
            .clone()
    }
}

/// The workgroup grid for `groups` workgroups: at most 65,535 along x, the rest along y.
pub(super) fn grid(groups: u64) -> (u32, u32, u32) {
    const MAX: u64 = 65_535;
    let groups = groups.max(1);
    if groups <= MAX {
        (groups as u32, 1, 1)
    } else {
        (MAX as u32, groups.div_ceil(MAX) as u32, 1)
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
        assert_eq!(grid(0), (1, 1, 1));
        assert_eq!(grid(65_535), (65_535, 1, 1));
        assert_eq!(grid(65_536), (65_535, 2, 1));
        assert_eq!(params(&[1, 2, 3]).len(), 16);
        assert_eq!(params(&[0; 5]).len(), 32);
    }

    #[test]
    fn entry_points_and_weight_formats_come_from_the_sources() {
        assert_eq!(Kernel::Embedding.entry_points(), ["gather"]);
        assert!(Kernel::Matmul.entry_points().contains(&"gemv"));
        assert_eq!(Kernel::Matmul.weight_formats().len(), 10);
        // Every type with a reader is compiled for.
        for t in GgmlType::ALL {
            let listed = Kernel::Embedding.weight_formats().contains(&Some(WeightElem::Ggml(t)));
            assert_eq!(WeightElem::stored(t).is_some(), listed, "{t}");
        }
        assert_eq!(Kernel::Norm.weight_formats(), [None]);
        for k in Kernel::ALL {
            assert!(!k.entry_points().is_empty(), "{k:?}");
        }
    }
}
