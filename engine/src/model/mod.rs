//! The Qwen-VL forward pass, written once against [`Backend`](crate::backend::Backend).

pub mod checkpoint_files;
pub mod gguf_tensors;
mod mlp;
pub mod random_weights;
pub mod rope;
pub mod stream;
pub mod text;
pub mod vision;
pub mod weights;

use crate::arch::config::ModelConfig;
use crate::backend::{Backend, BackendError};
use text::TextModel;
use vision::VisionTower;
use weights::{Loader, TensorSource};

/// Why loading or running the model failed.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The checkpoint is missing tensors, has wrong shapes or is not readable.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    /// A model the engine cannot run yet.
    #[error("{0}")]
    Unsupported(String),
    /// Inputs that do not fit the model.
    #[error("input: {0}")]
    Input(String),
    /// The backend failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// A loaded Qwen-VL model.
#[derive(Debug)]
pub struct QwenVl<B: Backend> {
    /// The parsed config.
    pub cfg: ModelConfig,
    /// The vision tower; None for a text model alone.
    pub vision: Option<VisionTower<B>>,
    /// The language model.
    pub text: TextModel<B>,
}

impl<B: Backend> QwenVl<B> {
    /// Loads every weight from `source` (checkpoint bytes, or tensors converted as a checkpoint
    /// streamed in: [`stream::StreamLoader`]); `progress` is called after the vision tower and the
    /// decoder with (tensors, bytes) loaded so far.
    pub fn load<S: TensorSource<B>>(
        cfg: ModelConfig,
        source: &S,
        be: &B,
        mut progress: impl FnMut(usize, u64),
    ) -> Result<Self, ModelError> {
        check_supported(&cfg)?;
        let loader = Loader::new(source, be);
        let vision = cfg
            .vision
            .as_ref()
            .map(|v| VisionTower::load(&cfg, v, &loader))
            .transpose()?;
        let (n, bytes) = loader.progress();
        progress(n, bytes);
        let text = TextModel::load(&cfg, &loader, be)?;
        let (n, bytes) = loader.progress();
        progress(n, bytes);
        Ok(QwenVl { cfg, vision, text })
    }
}

/// Refuses the models the forward pass cannot run, before any weight is read.
fn check_supported(cfg: &ModelConfig) -> Result<(), ModelError> {
    // The experts' routing reads the router's scores back mid-step, which a browser's GPU
    // answers only once the page's event loop runs again.
    if cfg!(target_arch = "wasm32") && cfg.text.moe.is_some() {
        return Err(ModelError::Unsupported(
            "mixture-of-experts models run natively only (`kvlens serve`), not in the browser".into(),
        ));
    }
    Ok(())
}
