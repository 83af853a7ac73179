//! Turning user input into model input: image sizing now; chat templates, tokenization and
//! patchification arrive with the CPU model.

pub mod resize;
