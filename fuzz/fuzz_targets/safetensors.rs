//! `kvlens_engine::fuzzing::safetensors` on every input libFuzzer makes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlens_engine::fuzzing::safetensors(data));
