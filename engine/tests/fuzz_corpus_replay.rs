//! Replays the committed seed corpus of every fuzz target (fuzz/corpus/<target>/, the seeds plus
//! the inputs that once crashed) through the same harness the target runs, so that every
//! `cargo test` checks them without nightly flags or libFuzzer.

use std::path::{Path, PathBuf};

use kvlens_engine::fuzzing::TARGETS;

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../fuzz/corpus");

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    out.sort();
    out
}

#[test]
fn every_corpus_file_passes_its_harness() {
    let dirs: Vec<String> = files(Path::new(CORPUS))
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let mut names: Vec<String> = TARGETS.iter().map(|(name, _)| name.to_string()).collect();
    names.sort();
    assert_eq!(dirs, names, "one corpus directory per fuzz target");
    for (name, harness) in TARGETS {
        let inputs = files(&Path::new(CORPUS).join(name));
        assert!(inputs.len() >= 3, "{name}: only {} seeds", inputs.len());
        for input in inputs {
            let data = std::fs::read(&input).unwrap();
            println!("{name}: {}", input.display());
            harness(&data);
        }
    }
}
