//! `kvlens lesson`: the lessons' steps from the command line, their figures computed by the
//! planner and by the engine on a tiny checkpoint (the same code the playground runs).

mod common;

use common::kvlens;
use serde_json::Value;

/// A step's figure by name.
fn figure<'a>(lesson: &'a Value, step: usize, name: &str) -> &'a Value {
    lesson["steps"][step]["figures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{name}: {lesson:#}"))
}

/// A figure's value as shown.
fn shown(lesson: &Value, step: usize, name: &str) -> String {
    figure(lesson, step, name)["value"].as_str().unwrap().to_string()
}

/// A figure's raw count or bytes.
fn raw(lesson: &Value, step: usize, name: &str) -> u64 {
    figure(lesson, step, name)["raw"].as_u64().unwrap()
}

#[test]
fn lesson_one_names_the_length_that_fits_and_lesson_two_the_kv_line() {
    let model = common::tiny_checkpoint("lesson-planned");
    let l = live("kv-cache-too-small", &model, &[]);
    assert_eq!(shown(&l, 0, "estimated maximum model length"), "164,224");
    assert_eq!(shown(&l, 0, "available KV cache memory"), "20.06 GiB");
    assert!(l["steps"][0]["query"]
        .as_str()
        .unwrap()
        .contains("max_model_len=262144"));

    // Then the tab-scale half: the same refusal on the engine, with its reason.
    assert_eq!(raw(&l, 2, "the longest request (--max-model-len)"), 128);
    let said = shown(&l, 3, "the engine's answer");
    assert!(said.contains("exceeds the maximum context length of 128"), "{said}");

    // Lesson 2 as text, its tab-scale step as the engine measured it (a 64 MiB KV cache by default).
    let out = kvlens(&["lesson", "startup-budget", "--model", model.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "13.61 GiB",
        "57.91 GiB",
        "44.30 GiB",
        "645,120 tokens",
        "Step 3.",
        "weights",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
    let l = live("startup-budget", &model, &[]);
    let kv = raw(&l, 2, "KV cache");
    assert!(kv > 0 && kv <= 64 << 20, "{kv}");
    assert_eq!(
        kv % (raw(&l, 2, "KV blocks") + 1),
        0,
        "whole blocks, the null block included"
    );
    assert!(raw(&l, 2, "weights") > 0 && raw(&l, 2, "peak of start-up's profile run") > 0);

    // Lesson 3's rule on the engine: the budget holds the largest image, and the profile run
    // encoded as many as it holds.
    let l = live("encoder-budget", &model, &[]);
    let budget = raw(&l, 3, "encoder cache budget (tokens)");
    let largest = raw(&l, 3, "largest image start-up profiled (tokens)");
    let items = raw(&l, 3, "largest images start-up's profile run encoded");
    assert!(
        budget >= largest && items >= 1 && items * largest <= budget,
        "{budget} {largest} {items}"
    );
}

#[test]
fn the_list_and_an_unknown_lesson() {
    let out = kvlens(&["lesson"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.lines().count() >= 3 && text.contains("encoder-budget"),
        "{text}"
    );
    let out = kvlens(&["lesson", "nope"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kv-cache-too-small"));
}

/// Runs a live lesson on the tiny checkpoint; its JSON.
fn live(name: &str, model: &std::path::Path, extra: &[&str]) -> Value {
    let mut args = vec!["lesson", name, "--json", "--model", model.to_str().unwrap()];
    args.extend_from_slice(extra);
    let out = kvlens(&args);
    assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn preemption_runs_on_the_engine_and_records_its_timeline() {
    let model = common::tiny_checkpoint("lesson-preemption");
    let json = common::scratch("lesson-preemption.json");
    let svg = common::scratch("lesson-preemption.svg");
    let l = live(
        "preemption",
        &model,
        &["--record", json.to_str().unwrap(), "--record", svg.to_str().unwrap()],
    );
    let preempted = raw(&l, 1, "preemptions");
    assert!(preempted >= 1, "{l:#}");
    assert_eq!(raw(&l, 3, "preemptions"), 0);
    assert!(raw(&l, 3, "tokens computed again because of preemption") > 0);
    // What the resumed request did not find in the prefix cache it computed again.
    let recomputed = raw(&l, 3, "tokens computed again because of preemption");
    assert!(
        recomputed + raw(&l, 1, "prompt tokens found in the prefix cache") >= 16,
        "{l:#}"
    );
    assert_eq!(raw(&l, 3, "prompt tokens found in the prefix cache"), 0);
    assert_eq!(raw(&l, 3, "replies token for token the same as the preempted run's"), 3);
    // The recorded frames where the steps ended hold the same counts.
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let ends: Vec<&Value> = t["marks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["what"].as_str().unwrap().ends_with(" done"))
        .map(|m| &t["frames"][m["frame"].as_u64().unwrap() as usize - 1])
        .collect();
    assert_eq!(ends.len(), 4, "{}", t["marks"]);
    let preemptions = |f: &Value| f["counters"]["num_preemptions"].as_u64().unwrap();
    assert_eq!(preemptions(ends[1]) - preemptions(ends[0]), preempted);
    assert_eq!(ends[0]["kv"]["num_blocks"], 9, "8 blocks and the null block");
    assert!(t["marks"]
        .as_array()
        .unwrap()
        .iter()
        .any(|m| m["what"].as_str().unwrap().ends_with("preempted")));
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("preempted"), "{plot}");
}

#[test]
fn the_other_live_lessons_show_what_they_say() {
    let model = common::tiny_checkpoint("lesson-live");
    let l = live("reset-mm-cache", &model, &[]);
    assert_eq!(raw(&l, 0, "processor cache entries"), 1);
    assert_eq!(raw(&l, 1, "processor cache entries"), 0);
    let encoder = raw(&l, 0, "encoder cache (device memory)");
    assert!(encoder > 0);
    assert_eq!(
        raw(&l, 1, "encoder cache (device memory)"),
        encoder,
        "/reset_mm_cache frees no device memory"
    );
    assert_eq!(raw(&l, 2, "encoder cache (device memory)"), 0);
    assert!(raw(&l, 2, "KV blocks cached (free, still found by hash)") > 0);
    assert_eq!(raw(&l, 3, "KV blocks cached (free, still found by hash)"), 0);

    let l = live("prefix-caching-images", &model, &[]);
    assert_eq!(raw(&l, 0, "prompt tokens found in the prefix cache"), 0);
    assert_eq!(raw(&l, 1, "images through the vision tower"), 0);
    let again = raw(&l, 1, "prompt tokens found in the prefix cache");
    assert_eq!(
        again + raw(&l, 1, "prompt tokens computed"),
        raw(&l, 1, "prompt tokens sent")
    );
    // The image's tokens past the last full block come from the encoder cache.
    assert!(raw(&l, 1, "the image's tokens in the prompt (positions)") > again);
    assert_eq!(raw(&l, 1, "encoder cache hits"), 1);
    let other = raw(&l, 2, "prompt tokens found in the prefix cache");
    assert!(other > 0 && other < again, "{other} of {again}");
    assert_eq!(raw(&l, 2, "images through the vision tower"), 1);

    let l = live("oom-image-29", &model, &[]);
    let profiled = raw(&l, 0, "largest image start-up profiled (tokens)");
    assert_eq!(raw(&l, 1, "the image at its own size (tokens)"), 4 * profiled);
    assert_eq!(raw(&l, 1, "the image as kvlens resized it (tokens)"), profiled);
    for step in 0..2 {
        assert!(
            raw(&l, step, "peak this step (activations, staging, encoder outputs)")
                <= raw(&l, step, "peak of start-up's profile run")
        );
    }
    assert!(
        raw(&l, 1, "peak this step (activations, staging, encoder outputs)") < raw(&l, 1, "the same, as resized"),
        "the kernels never store the scores in full: {l:#}"
    );
    let out = kvlens(&["lesson", "preemption", "--record", "x.txt"]);
    assert_eq!(out.status.code(), Some(2), "a timeline is .json or .svg");
}
