//! `kvlens lesson`: the lessons' steps from the command line, their figures computed by the
//! planner (the same code the playground runs).

mod common;

use common::kvlens;
use serde_json::Value;

fn figure(lesson: &Value, step: usize, name: &str) -> String {
    lesson["steps"][step]["figures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
        .unwrap_or_else(|| panic!("{name}: {lesson:#}"))["value"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn lesson_one_names_the_length_that_fits_and_lesson_two_the_kv_line() {
    let out = kvlens(&["lesson", "kv-cache-too-small", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let l: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(figure(&l, 0, "estimated maximum model length"), "164,224");
    assert_eq!(figure(&l, 0, "available KV cache memory"), "20.06 GiB");
    assert!(l["steps"][0]["query"]
        .as_str()
        .unwrap()
        .contains("max_model_len=262144"));

    let out = kvlens(&["lesson", "startup-budget"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for want in ["13.61 GiB", "57.91 GiB", "44.30 GiB", "645,120 tokens", "Step 2."] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
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
