//! Tests of the vLLM start-up log parser against the sample logs and synthetic variants, and of the
//! budget rebuilt from a log that prints no total.

use kvlens_engine::arch::config::bundled_config;
use kvlens_engine::memory::device::device_preset;
use kvlens_engine::memory::log_budget::{rebuild, DeviceTotal};
use kvlens_engine::memory::vllm_log::{
    parse_size_to_bytes, parse_vllm_log, LineKind, ParsedLog, Printed, ProfilingFormat,
};
use kvlens_engine::memory::{PlanRequest, Source};
use proptest::prelude::*;

const NEW_8B: &str = include_str!("fixtures/vllm-logs/qwen3-vl-8b-tp2-new-profiling.log");
const OLD_8B: &str = include_str!("fixtures/vllm-logs/qwen3-vl-8b-tp2-old-profiling.log");
const LOG_32B: &str = include_str!("fixtures/vllm-logs/qwen3-vl-32b-tp2-maxlen262144.log");

const GIB: u128 = 1 << 30;
const MIB: u128 = 1 << 20;

/// `round(mantissa × unit / 10^decimals)`, halves up, computed independently of the parser.
fn exact(mantissa: u128, decimals: u32, unit: u128) -> u64 {
    let den = 10u128.pow(decimals);
    let num = mantissa * unit;
    let q = num / den + u128::from(2 * (num % den) >= den);
    u64::try_from(q).expect("fits u64")
}

fn gib(mantissa: u128, decimals: u32) -> u64 {
    exact(mantissa, decimals, GIB)
}

fn bytes(p: &Option<Printed>) -> Option<u64> {
    p.as_ref().map(|p| p.bytes)
}

fn text(p: &Option<Printed>) -> Option<&str> {
    p.as_ref().map(|p| p.text.as_str())
}

fn non_header_lines(log: &str) -> usize {
    log.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .count()
}

fn recognised_non_header(p: &ParsedLog) -> usize {
    p.recognised.iter().filter(|r| r.kind != LineKind::Header).count()
}

#[test]
fn new_profiling_8b() {
    let p = parse_vllm_log(NEW_8B);
    assert_eq!(non_header_lines(NEW_8B), 8);
    assert_eq!(recognised_non_header(&p), 8, "{:#?}", p.recognised);
    assert_eq!(p.lines_of(LineKind::Header).count(), 1);
    assert_eq!(p.ignored_lines, 0);
    assert!(p.malformed_lines.is_empty());

    assert_eq!(p.weights_load_seconds, Some(4.29));
    assert_eq!(bytes(&p.weights), Some(gib(9_1948, 4)));
    assert_eq!(text(&p.weights), Some("9.1948"));
    assert_eq!(p.encoder_budget_tokens, Some(32_768));
    assert_eq!(p.encoder_profile_items, Some(2));
    assert_eq!(p.encoder_profile_modality.as_deref(), Some("image"));

    assert_eq!(bytes(&p.initial_free), Some(gib(6061, 2)));
    assert_eq!(p.gpu_memory_utilization, Some(0.95));
    assert_eq!(bytes(&p.requested), Some(gib(5791, 2)));
    assert_eq!(bytes(&p.free_after_profiling), Some(gib(5030, 2)));
    assert_eq!(bytes(&p.free_after_profiling_within_requested), Some(gib(4760, 2)));
    assert_eq!(bytes(&p.non_kv), Some(gib(1361, 2)));
    assert_eq!(bytes(&p.torch_peak_increase), Some(gib(386, 2)));
    assert_eq!(bytes(&p.non_torch_increase), Some(gib(56, 2)));
    assert_eq!(bytes(&p.profiled_weights), Some(gib(919, 2)));

    let avail = p.available_kv.clone().expect("available KV");
    assert_eq!(avail.bytes, 47_566_762_803);
    assert_eq!(avail.bytes, gib(4430, 2));
    assert_eq!((avail.text.as_str(), avail.decimals), ("44.30", 2));
    assert_eq!(avail.unit_bytes, 1 << 30);
    assert!(!avail.negative);
    // §10: 5,040 blocks × 9 MiB ≤ avail < 5,041 × 9 MiB, containing the printed 44.30.
    let (lo, hi) = avail.interval();
    let block = 9 * MIB as u64;
    assert!(lo <= 5_040 * block && 5_040 * block <= hi);
    assert!(hi < 5_041 * block);

    assert_eq!(p.kv_cache_tokens, Some(645_120));
    assert_eq!(p.profiling_format(), Some(ProfilingFormat::New));
    assert_eq!(p.total, None);
    assert_eq!(p.old_available, None);

    let cmd = p.command.as_ref().expect("command");
    assert_eq!(cmd.model.as_deref(), Some("Qwen3-VL-8B-Instruct"));
    assert_eq!(cmd.tensor_parallel_size(), Some(2));
    assert_eq!(cmd.max_model_len(), Some(65_536));
    assert_eq!(cmd.max_num_seqs(), Some(8));
    assert_eq!(cmd.max_num_batched_tokens(), Some(32_768));
    assert_eq!(cmd.gpu_memory_utilization(), Some(0.95));
    assert_eq!(cmd.flag("mm-processor-cache-gb"), Some("0"));
    assert_eq!(cmd.flag("--mm_processor_cache_gb"), Some("0"));
    assert_eq!(cmd.block_size(), None);
    assert_eq!(cmd.kv_cache_dtype(), None);
    assert_eq!(cmd.limit_mm_per_prompt(), None);
    assert_eq!(
        cmd.flags,
        vec![
            ("tensor-parallel-size".to_string(), Some("2".to_string())),
            ("max-model-len".to_string(), Some("65536".to_string())),
            ("max-num-seqs".to_string(), Some("8".to_string())),
            ("max-num-batched-tokens".to_string(), Some("32768".to_string())),
            ("gpu-memory-utilization".to_string(), Some("0.95".to_string())),
            ("mm-processor-cache-gb".to_string(), Some("0".to_string())),
        ]
    );
    assert!(cmd.raw.starts_with("vllm serve Qwen3-VL-8B-Instruct"));
    assert!(cmd.raw.ends_with("--mm-processor-cache-gb 0"));
    assert_eq!(p.device_hint.as_deref(), Some("Ascend 910B x2"));
    assert_eq!(p.header_notes, vec!["Ascend 910B x2", "newer vllm-ascend profiling"]);

    // The printed figures are consistent with the §10 arithmetic.
    let sum = p.profiled_weights.as_ref().unwrap().bytes
        + p.torch_peak_increase.as_ref().unwrap().bytes
        + p.non_torch_increase.as_ref().unwrap().bytes;
    assert_eq!(sum, p.non_kv.as_ref().unwrap().bytes);
}

#[test]
fn old_profiling_8b() {
    let p = parse_vllm_log(OLD_8B);
    assert_eq!(recognised_non_header(&p), non_header_lines(OLD_8B));
    assert_eq!(p.ignored_lines, 0);
    assert!(p.malformed_lines.is_empty());
    assert_eq!(p.profiling_format(), Some(ProfilingFormat::Old));

    assert_eq!(bytes(&p.weights), Some(gib(9_1948, 4)));
    assert_eq!(bytes(&p.old_torch_peak), Some(gib(1311, 2)));
    assert_eq!(bytes(&p.old_non_torch), Some(gib(126, 2)));
    assert_eq!(
        p.old_non_torch_all.iter().map(|x| x.bytes).collect::<Vec<_>>(),
        vec![gib(96, 2), gib(126, 2)]
    );
    assert_eq!(bytes(&p.old_available), Some(gib(4340, 2)));
    assert_eq!(bytes(&p.old_available_with_requested), Some(gib(4333, 2)));
    assert_eq!(bytes(&p.total), Some(gib(6096, 2)));
    assert_eq!(bytes(&p.requested), Some(gib(5791, 2)));
    assert_eq!(p.lines_of(LineKind::OldRealProfiling).count(), 1);
    assert_eq!(p.initial_free, None);
    assert_eq!(p.available_kv, None);
    assert_eq!(p.encoder_budget_tokens, None);

    let cmd = p.command.as_ref().expect("command");
    assert_eq!(cmd.tensor_parallel_size(), Some(2));
    assert_eq!(cmd.max_model_len(), Some(65_536));
    assert_eq!(p.header_notes, vec!["Ascend 910B x2", "older vllm-ascend profiling"]);
}

/// The old-profiling 8B log without its "total memory" line: its requested memory (57.91 GiB) and
/// the utilisation of its command (0.95) give the total, whatever the device preset says.
#[test]
fn a_log_without_a_total_infers_it_from_requested_and_utilisation() {
    let trimmed: String = OLD_8B
        .lines()
        .filter(|l| !l.contains("total memory"))
        .map(|l| format!("{l}\n"))
        .collect();
    let log = parse_vllm_log(&trimmed);
    assert_eq!((log.total.as_ref(), log.gpu_memory_utilization), (None, None));
    let request = || {
        let cfg = bundled_config("Qwen3-VL-8B-Instruct").unwrap();
        let mut r = PlanRequest::new("Qwen3-VL-8B-Instruct", cfg, device_preset("h100-80g").unwrap());
        r.tensor_parallel_size = 2;
        r.max_model_len = Some(65_536);
        r
    };
    let preset_total = request().device.total_bytes;
    let requested = gib(5791, 2);

    let b = rebuild(&log, request(), DeviceTotal::Preset).unwrap();
    let p = &b.plan;
    assert_eq!(p.total_bytes, (requested as f64 / 0.95).round() as u64);
    assert_eq!(format!("{:.2}", p.total_bytes as f64 / GIB as f64), "60.96");
    assert_ne!(p.total_bytes, preset_total);
    assert_eq!(
        (p.total_source, p.requested_source),
        (Some(Source::Derived), Source::FromLog)
    );
    assert_eq!((p.requested_bytes, p.gpu_memory_utilization), (requested, 0.95));
    assert_eq!(p.available_kv_bytes, gib(4333, 2) as i64);
    assert_eq!(b.notes.len(), 1);
    assert!(
        b.notes[0].contains("requested / gpu_memory_utilization = 57.91 GiB / 0.95 = 60.96 GiB"),
        "{}",
        b.notes[0]
    );
    assert!(b.notes[0].contains("h100-80g"), "{}", b.notes[0]);
    let formulas: Vec<&str> = b.checks.iter().map(|c| c.formula.as_str()).collect();
    assert!(!formulas.iter().any(|f| f.starts_with("requested")), "{formulas:?}");
    assert!(formulas.iter().any(|f| f.contains("old formula")), "{formulas:?}");

    // A stated total is kept, and the log's requested memory is checked against it.
    let b = rebuild(&log, request(), DeviceTotal::Given).unwrap();
    assert_eq!(
        (b.plan.total_bytes, b.plan.total_source),
        (preset_total, Some(Source::Given))
    );
    assert_eq!(b.plan.requested_source, Source::Derived);
    assert!(b.notes.is_empty());
    let check = b.checks.iter().find(|c| c.formula.starts_with("requested")).unwrap();
    assert!(!check.ok, "{check:?}");

    // The whole log prints its total: read, not inferred.
    let b = rebuild(&parse_vllm_log(OLD_8B), request(), DeviceTotal::Preset).unwrap();
    assert_eq!(
        (b.plan.total_bytes, b.plan.total_source),
        (gib(6096, 2), Some(Source::FromLog))
    );
    assert!(b.notes.is_empty());
}

#[test]
fn qwen3_vl_32b_error() {
    let p = parse_vllm_log(LOG_32B);
    assert_eq!(recognised_non_header(&p), non_header_lines(LOG_32B));
    assert_eq!(bytes(&p.weights), Some(gib(31_4592, 4)));
    assert_eq!(p.encoder_budget_tokens, Some(16_384));
    assert_eq!(p.encoder_profile_items, Some(1));
    assert_eq!(p.encoder_profile_modality.as_deref(), Some("image"));

    let avail = p.old_available.as_ref().expect("old available");
    assert_eq!(avail.bytes, 21_540_531_712);
    assert_eq!((avail.unit_bytes, avail.decimals), (1, 0));
    assert_eq!(avail.interval(), (21_540_531_712, 21_540_531_712));
    assert_eq!(bytes(&p.total), Some(65_452_113_920));
    assert_eq!(p.profiling_format(), Some(ProfilingFormat::Old));

    assert_eq!(p.error_max_model_len, Some(262_144));
    assert_eq!(bytes(&p.error_needed), Some(32 << 30));
    assert_eq!(text(&p.error_needed), Some("32.00"));
    assert_eq!(bytes(&p.error_available), Some(gib(2006, 2)));
    assert_eq!(p.error_estimated_max_model_len, Some(164_224));
    // §10: printed 20.06 ⇒ avail ∈ [20.055, 20.065] GiB and 1,283 × 16 MiB ≤ avail.
    let (lo, hi) = p.error_available.as_ref().unwrap().interval();
    // 20.055 GiB = 21,533,892,280.32 B (ceil), 20.065 GiB = 21,544,629,698.56 B (floor).
    assert_eq!((lo, hi), (21_533_892_281, 21_544_629_698));
    assert!(u128::from(lo - 1) * 1000 < 20_055 * GIB);
    assert!(u128::from(hi + 1) * 1000 > 20_065 * GIB);
    assert!(1_283 * (16 * MIB as u64) <= hi);
    // The printed "Available memory" bytes round to the printed 20.06 GiB.
    assert!(p.error_available.as_ref().unwrap().contains(avail.bytes));

    let cmd = p.command.as_ref().expect("command");
    assert_eq!(cmd.model.as_deref(), Some("Qwen/Qwen3-VL-32B-Instruct"));
    assert_eq!(cmd.tensor_parallel_size(), Some(2));
    assert_eq!(cmd.flag("load-format"), Some("dummy"));
    assert_eq!(cmd.max_model_len(), None);
    assert_eq!(cmd.flags.len(), 2);
    assert_eq!(
        p.header_notes,
        vec!["max_model_len from the config: 262144", "Ascend 910B x2"]
    );
    assert_eq!(p.device_hint.as_deref(), Some("Ascend 910B x2"));
}

#[test]
fn unit_spellings_are_binary() {
    for unit in ["GB", "GiB", "G", "gb"] {
        let p = parse_vllm_log(&format!("Loading model weights took 9.1948 {unit}"));
        assert_eq!(bytes(&p.weights), Some(gib(9_1948, 4)), "{unit}");
    }
    for unit in ["MB", "MiB", "M"] {
        let p = parse_vllm_log(&format!("Available KV cache memory: 512.5 {unit}"));
        assert_eq!(bytes(&p.available_kv), Some(exact(5125, 1, MIB)), "{unit}");
    }
    let p = parse_vllm_log("Model loading took 15.2683 GiB memory and 6.531 seconds");
    assert_eq!(bytes(&p.weights), Some(gib(15_2683, 4)));
    assert_eq!(p.model_loading_seconds, Some(6.531));
    let p = parse_vllm_log("Model loading took 15.27 GiB and 6.5 seconds");
    assert_eq!(bytes(&p.weights), Some(gib(1527, 2)));
    assert_eq!(p.model_loading_seconds, Some(6.5));
}

#[test]
fn thousands_separators() {
    let p = parse_vllm_log(
        "GPU KV cache size: 1,234,567 tokens\n\
         Maximum concurrency for 65,536 tokens per request: 9.84x\n\
         Available memory: 21,540,531,712, total memory: 65,452,113,920",
    );
    assert_eq!(p.kv_cache_tokens, Some(1_234_567));
    assert_eq!(p.max_concurrency_model_len, Some(65_536));
    assert_eq!(p.max_concurrency, Some(9.84));
    assert_eq!(bytes(&p.old_available), Some(21_540_531_712));
    assert_eq!(bytes(&p.total), Some(65_452_113_920));
    assert_eq!(parse_size_to_bytes("645,120", ""), Some(645_120));
    assert_eq!(parse_size_to_bytes("1,024.5", "MiB"), Some(exact(10245, 1, MIB)));
}

#[test]
fn prefixes_and_crlf() {
    let body: Vec<&str> = NEW_8B.lines().collect();
    let prefixes = [
        "INFO 11-22 10:00:00 [worker.py:12] ",
        "(EngineCore_DP0 pid=123) INFO 10-22 12:00:01 [gpu_worker.py:123] ",
        "[rank0]: ",
        "(VllmWorker TP1 pid=4567) DEBUG 10-22 12:00:01 [mem_utils.py:77] Memory profiling takes 5.43 seconds. ",
    ];
    for prefix in prefixes {
        let prefixed: Vec<String> = body
            .iter()
            .map(|l| {
                if l.starts_with('#') {
                    l.to_string()
                } else {
                    format!("{prefix}{l}")
                }
            })
            .collect();
        let crlf = prefixed.join("\r\n") + "\r\n";
        let p = parse_vllm_log(&crlf);
        let plain = parse_vllm_log(NEW_8B);
        assert_eq!(recognised_non_header(&p), 8, "{prefix}");
        assert_eq!(p.available_kv, plain.available_kv);
        assert_eq!(p.non_kv, plain.non_kv);
        assert_eq!(p.kv_cache_tokens, Some(645_120));
        assert_eq!(p.command, plain.command);
        assert!(p.recognised.iter().all(|r| !r.text.ends_with('\r')));
    }
    let p = parse_vllm_log(
        "(VllmWorker TP1 pid=4567) DEBUG [gpu_worker.py:99] Memory profiling takes 5.43 seconds. \
         Total non KV cache memory: 13.61GiB; torch peak memory increase: 3.86GiB; \
         non-torch forward increase memory: -0.02GiB; weights memory: 9.19GiB.",
    );
    assert_eq!(p.profiling_seconds, Some(5.43));
    assert_eq!(bytes(&p.non_kv), Some(gib(1361, 2)));
    let nt = p.non_torch_increase.as_ref().expect("negative increase");
    assert!(nt.negative);
    assert_eq!(nt.signed_bytes(), -i128::from(gib(2, 2)));
}

#[test]
fn error_variants() {
    let no_based = "(EngineCore_DP0 pid=9) ValueError: To serve at least one request with the \
                    models's max seq len (131072), (16.00 GiB KV cache is needed, which is larger \
                    than the available KV cache memory (0.50 GiB). Try increasing \
                    `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.";
    let p = parse_vllm_log(no_based);
    assert_eq!(p.error_max_model_len, Some(131_072));
    assert_eq!(bytes(&p.error_needed), Some(16 << 30));
    assert_eq!(bytes(&p.error_available), Some(1 << 29));
    assert_eq!(p.error_estimated_max_model_len, None);
    assert_eq!(p.lines_of(LineKind::KvCacheTooSmallError).count(), 1);

    let p = parse_vllm_log(
        "ValueError: No available memory for the cache blocks. Try increasing \
         `gpu_memory_utilization` when initializing the engine.",
    );
    assert!(p.error_no_available_memory);

    let p = parse_vllm_log(
        "ValueError: Free memory on device cuda:0 (12.18/23.56 GiB) on startup is less than \
         desired GPU memory utilization (0.92, 21.67 GiB). Decrease GPU memory utilization.",
    );
    assert!(p.error_startup_free_memory);
    assert_eq!(bytes(&p.initial_free), Some(gib(1218, 2)));
    assert_eq!(bytes(&p.total), Some(gib(2356, 2)));
    assert_eq!(p.gpu_memory_utilization, Some(0.92));
    assert_eq!(bytes(&p.requested), Some(gib(2167, 2)));
}

#[test]
fn other_lines() {
    let p = parse_vllm_log(
        "INFO [gpu_model_runner.py:1] Graph capturing finished in 12 secs, took 0.52 GiB\n\
         INFO [core.py:2] init engine (profile, create kv cache, warmup model) took 75.31 seconds\n\
         INFO Available KV cache memory: -1.25 GiB\n\
         Available KV cache memory: lots\n\
         a line with 12 GiB and 3,000 tokens\n\
         \n",
    );
    assert_eq!(bytes(&p.graph_capture), Some(gib(52, 2)));
    assert_eq!(p.graph_capture_seconds, Some(12.0));
    assert_eq!(p.engine_init_seconds, Some(75.31));
    assert!(p.available_kv.as_ref().unwrap().negative);
    assert_eq!(p.malformed_lines, vec![4]);
    assert_eq!(p.ignored_lines, 1);
    assert_eq!(p.recognised.len(), 3);
    assert_eq!(p.profiling_format(), None);
}

#[test]
fn headers() {
    let p = parse_vllm_log(
        "$ vllm serve --model Qwen/Qwen2.5-VL-7B-Instruct -tp 4 --enforce-eager \
         --limit-mm-per-prompt '{\"image\": 2, \"video\": 0}' --kv-cache-dtype=fp8 \
         --block-size 128 --enable-prefix-caching --max-model-len 32k --swap-space -1 (H100 x4)",
    );
    let cmd = p.command.as_ref().expect("command");
    assert_eq!(cmd.model.as_deref(), Some("Qwen/Qwen2.5-VL-7B-Instruct"));
    assert_eq!(cmd.tensor_parallel_size(), Some(4));
    assert!(cmd.has_flag("enforce-eager"));
    assert_eq!(cmd.flag("enforce-eager"), None);
    assert_eq!(cmd.limit_mm_per_prompt(), Some("{\"image\": 2, \"video\": 0}"));
    assert_eq!(cmd.kv_cache_dtype(), Some("fp8"));
    assert_eq!(cmd.block_size(), Some(128));
    assert!(cmd.has_flag("enable_prefix_caching"));
    assert_eq!(cmd.max_model_len(), Some(32_000));
    assert_eq!(cmd.flag("swap-space"), Some("-1"));
    assert_eq!(p.device_hint.as_deref(), Some("H100 x4"));

    let p = parse_vllm_log("# GPU blocks: 5040, # CPU blocks: 512");
    assert_eq!(p.num_gpu_blocks, Some(5_040));
    assert_eq!(p.command, None);
    assert_eq!(p.lines_of(LineKind::GpuBlocks).count(), 1);
    assert_eq!(p.lines_of(LineKind::Header).count(), 0);

    let p = parse_vllm_log("# just a comment, no command\nGPU KV cache size: 16 tokens");
    assert_eq!(p.command, None);
    assert_eq!(p.header_notes, vec!["just a comment", "no command"]);
    assert_eq!(p.kv_cache_tokens, Some(16));
}

#[test]
fn size_helper_edges() {
    assert_eq!(parse_size_to_bytes("44.30", "GiB"), Some(47_566_762_803));
    assert_eq!(parse_size_to_bytes(" 1 ", " G "), Some(1 << 30));
    assert_eq!(parse_size_to_bytes("1.5", "KiB"), Some(1536));
    assert_eq!(parse_size_to_bytes("2", "TiB"), Some(2 << 40));
    assert_eq!(parse_size_to_bytes("99999999999999999999", "GiB"), None);
    assert_eq!(parse_size_to_bytes("1", "GiBs"), None);
    assert_eq!(parse_size_to_bytes("", "GiB"), None);
    assert_eq!(parse_size_to_bytes("1,2", "GiB"), None);
    // Absurd values in a log line are ignored, not wrapped.
    let p = parse_vllm_log("Available KV cache memory: 99999999999999999999999 GiB");
    assert_eq!(p.available_kv, None);
    assert_eq!(p.malformed_lines, vec![1]);
}

const PHRASES: &[&str] = &[
    "took",
    "memory",
    "Available",
    "KV cache",
    "profil",
    "budget",
    "concurrency",
    "To serve",
    "torch",
    "Free memory",
    "capturing",
    "init engine",
    "cache blocks",
    "#",
    "vllm serve",
];

proptest! {
    #[test]
    fn never_panics(s in any::<String>()) {
        let _ = parse_vllm_log(&s);
    }

    #[test]
    fn never_panics_on_bytes(b in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = parse_vllm_log(&String::from_utf8_lossy(&b));
    }

    #[test]
    fn never_panics_on_mangled_known_lines(
        line in prop::sample::select(NEW_8B.lines().chain(OLD_8B.lines()).chain(LOG_32B.lines()).collect::<Vec<_>>()),
        cut in 0usize..400,
        junk in "[0-9,.\\- GiBMx()/:;]{0,12}",
    ) {
        let mut cut = cut.min(line.len());
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        let mangled = format!("{}{}{}", &line[..cut], junk, &line[cut..]);
        let _ = parse_vllm_log(&mangled);
        let _ = parse_vllm_log(&line[..cut]);
    }

    #[test]
    fn unknown_lines_are_not_recognised(
        words in proptest::collection::vec(
            prop_oneof![
                "[a-z]{1,8}",
                "[0-9]{1,25}",
                "[0-9]{1,3}(,[0-9]{3}){0,4}(\\.[0-9]{1,6})?",
                Just("GiB".to_string()),
                Just("GB".to_string()),
                Just("G".to_string()),
                Just("MiB".to_string()),
                Just("tokens".to_string()),
                Just(":".to_string()),
                Just(",".to_string()),
                Just("(".to_string()),
            ],
            0..20,
        )
    ) {
        let line = words.join(" ");
        prop_assume!(!PHRASES.iter().any(|p| line.contains(p)));
        let p = parse_vllm_log(&line);
        prop_assert!(p.recognised.is_empty(), "{line:?} -> {:?}", p.recognised);
        prop_assert!(p.malformed_lines.is_empty());
    }

    #[test]
    fn size_is_exact(m in 0u64..=u64::MAX, d in 0u32..=12) {
        let digits = m.to_string();
        let text = if d == 0 {
            digits.clone()
        } else {
            let padded = format!("{digits:0>width$}", width = d as usize + 1);
            let (i, f) = padded.split_at(padded.len() - d as usize);
            format!("{i}.{f}")
        };
        let den = 10u128.pow(d);
        let num = u128::from(m) * GIB;
        let q = num / den + u128::from(2 * (num % den) >= den);
        let expected = u64::try_from(q).ok();
        prop_assert_eq!(parse_size_to_bytes(&text, "GiB"), expected);
        prop_assert_eq!(parse_size_to_bytes(&text, "GB"), expected);
        prop_assert_eq!(parse_size_to_bytes(&text, "G"), expected);

        // GiB = 1024 MiB exactly: "x GiB" equals "(x × 1024) MiB" printed with the same decimals.
        let m_mib = u128::from(m) * 1024;
        let digits = m_mib.to_string();
        let mib_text = if d == 0 {
            digits
        } else {
            let padded = format!("{digits:0>width$}", width = d as usize + 1);
            let (i, f) = padded.split_at(padded.len() - d as usize);
            format!("{i}.{f}")
        };
        prop_assert_eq!(parse_size_to_bytes(&mib_text, "MiB"), expected);
    }

    #[test]
    fn interval_contains_value_and_rounds_back(m in 0u64..10_000_000, d in 0u32..=4) {
        let den = 10u64.pow(d);
        let text = if d == 0 {
            m.to_string()
        } else {
            format!("{}.{:0>w$}", m / den, m % den, w = d as usize)
        };
        let p = Printed::parse(&text, "GiB").expect("parses");
        let (lo, hi) = p.interval();
        prop_assert!(lo <= p.bytes && p.bytes <= hi);
        // Every byte count at the ends rounds (to d decimals of GiB) to within half a unit.
        for b in [lo, hi] {
            let scaled = u128::from(b) * u128::from(den) * 2;
            let target = u128::from(m) * GIB * 2;
            let diff = scaled.abs_diff(target);
            prop_assert!(diff <= GIB, "{text}: {b}");
        }
        if lo > 0 {
            let scaled = u128::from(lo - 1) * u128::from(den) * 2;
            prop_assert!(u128::from(m) * GIB * 2 - scaled > GIB);
        }
        let scaled = u128::from(hi + 1) * u128::from(den) * 2;
        prop_assert!(scaled - u128::from(m) * GIB * 2 > GIB);
    }
}
