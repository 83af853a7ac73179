//! The one way every front end opens a backend and puts a model on it: `kvlens serve`,
//! `kvlens generate` and the playground name a [`BackendChoice`] and hand [`open`] a
//! [`ModelSource`]; what comes back is a runner the engine drives without knowing the backend.

use crate::arch::config::DType;
use crate::arch::weight_format::WeightFormat;
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BackendKind};
use crate::memory::ledger::MemoryLedger;
use crate::runner::StepRunner;

/// Which backend to open and how it keeps the weights.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendChoice {
    /// The backend.
    pub kind: BackendKind,
    /// Keep unquantized weight matrices in the backend's half-precision dtype
    /// ([`Capabilities::half_weights`](crate::backend::Capabilities::half_weights)).
    pub half_weights: bool,
    /// Weight matrices quantized on load into this block format.
    pub quantization: WeightFormat,
    /// wgpu: the adapter to use, by a substring of its name (None: the first).
    pub adapter: Option<String>,
}

impl BackendChoice {
    /// `kind` with the weight storage the flags ask for, as the backend's capabilities allow:
    /// half-precision matrices when `dtype` names a type other than the backend's compute dtype
    /// and the backend keeps half weights, and `quantization` when the backend stores that
    /// block format. Refused, saying what would work, when the build lacks the backend or the
    /// backend cannot store the format.
    pub fn new(kind: BackendKind, dtype: Option<DType>, quantization: WeightFormat) -> Result<Self, String> {
        kind.ensure_built()?;
        let caps = kind
            .capabilities()
            .ok_or_else(|| format!("no {kind} backend in this build"))?;
        if !caps.stores(quantization) {
            let able: Vec<&str> = BackendKind::ALL
                .into_iter()
                .filter(|k| k.capabilities().is_some_and(|c| c.stores(quantization)))
                .map(BackendKind::name)
                .collect();
            return Err(format!(
                "--quantization {quantization}: the {kind} backend keeps {} or half-precision weights (--dtype); \
                 the backends of this build that store {quantization}: {}",
                caps.compute.name(),
                able.join(", ")
            ));
        }
        Ok(BackendChoice {
            kind,
            half_weights: caps.half_weights.is_some() && dtype.is_some_and(|d| d != caps.compute),
            quantization,
            adapter: None,
        })
    }

    /// The dtype the weight matrices are kept in when unquantized.
    pub fn weights_dtype(&self) -> DType {
        let caps = self.kind.capabilities();
        match caps.and_then(|c| c.half_weights) {
            Some(half) if self.half_weights => half,
            _ => caps.map_or(DType::F32, |c| c.compute),
        }
    }
}

/// Where a model's weights come from: it loads them onto whichever backend [`open`] made and
/// returns the runner over them.
#[allow(async_fn_in_trait)] // Called where it is awaited; no caller needs the future to be Send.
pub trait ModelSource {
    /// Loads the model onto `be`.
    async fn load_onto<B: Backend + 'static>(self, be: B) -> Result<Box<dyn StepRunner>, String>;
}

/// Opens the backend `choice` names, its allocations recorded in `ledger`, and loads `source`
/// onto it. Natively the future completes without waiting (use [`crate::backend::block_on`]); in
/// the browser opening a WebGPU device needs the event loop.
pub async fn open<S: ModelSource>(
    choice: &BackendChoice,
    ledger: MemoryLedger,
    source: S,
) -> Result<Box<dyn StepRunner>, String> {
    match choice.kind {
        BackendKind::Cpu => {
            let be = CpuBackend::with_weights(ledger, choice.quantization).with_bf16_matrices(choice.half_weights);
            source.load_onto(be).await
        }
        #[cfg(feature = "wgpu")]
        BackendKind::Wgpu => {
            use crate::backend::wgpu::{WgpuBackend, WgpuOptions};
            let opts = WgpuOptions {
                f16_weights: choice.half_weights,
                quantization: choice.quantization,
                adapter: choice.adapter.clone(),
                ..WgpuOptions::default()
            };
            let be = WgpuBackend::new(ledger, opts).await.map_err(|e| e.to_string())?;
            source.load_onto(be).await
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            use crate::backend::cuda::{CudaBackend, CudaOptions};
            let be = CudaBackend::new(ledger, CudaOptions::from_env(choice.half_weights)).map_err(|e| e.to_string())?;
            source.load_onto(be).await
        }
        #[allow(unreachable_patterns)]
        kind => Err(kind.ensure_built().err().unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_follow_what_each_backend_can_do() {
        let cpu = BackendChoice::new(BackendKind::Cpu, Some(DType::Bf16), WeightFormat::Q4_0).unwrap();
        assert!(cpu.half_weights);
        assert_eq!(cpu.weights_dtype(), DType::Bf16);
        let f32 = BackendChoice::new(BackendKind::Cpu, Some(DType::F32), WeightFormat::Unquantized).unwrap();
        assert!(!f32.half_weights && f32.weights_dtype() == DType::F32);
        let auto = BackendChoice::new(BackendKind::Cpu, None, WeightFormat::Unquantized).unwrap();
        assert!(!auto.half_weights, "auto keeps the compute dtype");
        if cfg!(feature = "cuda") {
            let err = BackendChoice::new(BackendKind::Cuda, None, WeightFormat::Q8_0).unwrap_err();
            assert!(
                err.contains("the cuda backend keeps float32") && err.contains("store q8_0: cpu"),
                "{err}"
            );
        } else {
            let err = BackendChoice::new(BackendKind::Cuda, None, WeightFormat::Unquantized).unwrap_err();
            assert!(err.contains("no cuda backend"), "{err}");
        }
    }
}
