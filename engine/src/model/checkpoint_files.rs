//! What a checkpoint's small JSON files say about the rest, read from their text so that the
//! server (files on disk) and the playground (fetched or picked files) read them alike.

use crate::arch::config::ModelConfig;

/// The safetensors shards `model.safetensors.index.json` names, sorted, each once.
pub fn shard_names(index_json: &str) -> Result<Vec<String>, String> {
    let v: serde_json::Value = serde_json::from_str(index_json).map_err(|e| e.to_string())?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or("no weight_map")?;
    let mut names: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_string)).collect();
    names.sort();
    names.dedup();
    Ok(names)
}

/// End-of-sequence ids: `generation_config.json`'s `eos_token_id` (one id or a list) when it
/// names any, else the config's.
pub fn eos_token_ids(config: &ModelConfig, generation_config_json: Option<&str>) -> Result<Vec<u32>, String> {
    let Some(text) = generation_config_json else {
        return Ok(config.tokens.eos.clone());
    };
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let ids: Vec<u32> = match v.get("eos_token_id") {
        Some(serde_json::Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        None => Vec::new(),
    };
    Ok(if ids.is_empty() { config.tokens.eos.clone() } else { ids })
}

/// The text GGUF and its projector among a folder's file names, as the Hub's GGUF repositories lay
/// them out: `None` when no name ends in `.gguf`; exactly one text model and at most one
/// `mmproj*` file (none: a text model alone), else an error naming what is there.
pub fn gguf_pair(names: &[String]) -> Result<Option<(String, Option<String>)>, String> {
    let mut ggufs: Vec<&String> = names
        .iter()
        .filter(|n| n.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    if ggufs.is_empty() {
        return Ok(None);
    }
    ggufs.sort();
    let (projectors, texts): (Vec<&String>, Vec<&String>) =
        ggufs.iter().partition(|n| n.to_ascii_lowercase().starts_with("mmproj"));
    match (&texts[..], &projectors[..]) {
        ([text], []) => Ok(Some(((*text).clone(), None))),
        ([text], [mmproj]) => Ok(Some(((*text).clone(), Some((*mmproj).clone())))),
        _ => Err(format!(
            "the GGUF files are {ggufs:?}: kvlens reads one text GGUF and at most one mmproj-*.gguf"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gguf_folder_is_one_text_model_and_one_projector() {
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let pair = gguf_pair(&names(&["README.md", "mmproj-M-F16.gguf", "M-Q4_K_M.gguf"])).unwrap();
        assert_eq!(pair, Some(("M-Q4_K_M.gguf".into(), Some("mmproj-M-F16.gguf".into()))));
        assert_eq!(gguf_pair(&names(&["config.json", "model.safetensors"])).unwrap(), None);
        let two = gguf_pair(&names(&["mmproj-a.gguf", "M-Q8_0.gguf", "M-Q4_K_M.gguf"])).unwrap_err();
        assert!(two.contains("M-Q8_0.gguf") && two.contains("M-Q4_K_M.gguf"), "{two}");
        assert_eq!(gguf_pair(&names(&["M.gguf"])).unwrap(), Some(("M.gguf".into(), None)));
        assert!(gguf_pair(&names(&["mmproj-M.gguf"]))
            .unwrap_err()
            .contains("one text GGUF"));
    }

    #[test]
    fn shards_come_sorted_and_once() {
        let index = r#"{"weight_map": {"a": "model-00002.safetensors", "b": "model-00001.safetensors", "c": "model-00002.safetensors"}}"#;
        assert_eq!(
            shard_names(index).unwrap(),
            ["model-00001.safetensors", "model-00002.safetensors"]
        );
        assert!(shard_names("{}").unwrap_err().contains("weight_map"));
        assert!(shard_names("not json").is_err());
    }

    #[test]
    fn generation_config_eos_wins_when_it_names_one() {
        let cfg = ModelConfig::from_json(include_str!("../../../tools/golden/configs/qwen3_vl_tiny.json")).unwrap();
        assert_eq!(eos_token_ids(&cfg, None).unwrap(), cfg.tokens.eos);
        assert_eq!(
            eos_token_ids(&cfg, Some(r#"{"eos_token_id": [1, 2]}"#)).unwrap(),
            [1, 2]
        );
        assert_eq!(eos_token_ids(&cfg, Some(r#"{"eos_token_id": 7}"#)).unwrap(), [7]);
        assert_eq!(eos_token_ids(&cfg, Some("{}")).unwrap(), cfg.tokens.eos);
        assert!(eos_token_ids(&cfg, Some("{")).is_err());
    }
}
