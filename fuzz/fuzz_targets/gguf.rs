//! `kvlens_engine::fuzzing::gguf` on every input libFuzzer makes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlens_engine::fuzzing::gguf(data));
