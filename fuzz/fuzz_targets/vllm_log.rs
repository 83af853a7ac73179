//! `kvlens_engine::fuzzing::vllm_log` on every input libFuzzer makes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvlens_engine::fuzzing::vllm_log(data));
