//! The bottom layer: what a checkpoint is, before any backend holds it. The model's configuration
//! ([`config`]), the tensors each family has ([`spec`]), how their weights may be stored
//! ([`weight_format`]) and GGML's block formats with their (de)quantization ([`blocks`]); GGUF
//! files' headers ([`gguf`]), the GGML tensor types they store ([`ggml`]) and a Qwen-VL GGUF pair
//! read as the checkpoint it was converted from ([`gguf_model`]).
//!
//! `model/`, `memory/` and every backend import from here; nothing here imports them.

pub mod blocks;
pub mod config;
pub mod ggml;
pub mod gguf;
pub mod gguf_export;
pub mod gguf_model;
pub mod gguf_write;
pub mod spec;
pub mod weight_format;
