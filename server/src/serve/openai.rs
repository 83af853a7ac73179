//! OpenAI's request and response shapes for `/v1/chat/completions` and `/v1/completions`, with
//! vLLM's extensions (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
//! `return_token_ids`): parsing into [`SamplingParams`], and the JSON of answers and SSE chunks.

use super::errors::ApiError;
use kvlens_engine::engine::FinishReason;
use kvlens_engine::input::chat::ChatMessage;
use kvlens_engine::input::tokenizer::Tokenizer;
use kvlens_engine::output::{Delta, TokenLogprobs};
use kvlens_engine::sample::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Value};

/// Most top log-probabilities per token (vLLM's default `max_logprobs`).
const MAX_LOGPROBS: usize = 20;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// `"stop": "…"`
    One(String),
    /// `"stop": ["…", …]`
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct StreamOptions {
    /// Send a last chunk with the token counts.
    pub include_usage: bool,
}

/// Fields shared by chat and completion requests.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CommonFields {
    /// A served model name (the first one when absent).
    pub model: Option<String>,
    /// Most tokens to generate [default: what is left of max_model_len].
    pub max_tokens: Option<usize>,
    /// Same as `max_tokens` (the newer OpenAI spelling wins).
    pub max_completion_tokens: Option<usize>,
    /// 0 is greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling mass.
    pub top_p: Option<f32>,
    /// Keep the k most likely tokens (0 or -1: all).
    pub top_k: Option<i32>,
    /// Drop tokens below `min_p × p_max`.
    pub min_p: Option<f32>,
    /// Seed of this request's sampler.
    pub seed: Option<u64>,
    /// Strings that end the output (not included in it).
    pub stop: Option<Stop>,
    /// Token ids that end the output.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Number of choices (only 1).
    pub n: Option<usize>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: Option<bool>,
    /// OpenAI's presence penalty.
    pub presence_penalty: Option<f32>,
    /// OpenAI's frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// vLLM's repetition penalty.
    pub repetition_penalty: Option<f32>,
    /// vLLM: add `prompt_token_ids` and each choice's `token_ids`.
    pub return_token_ids: Option<bool>,
    /// Stream Server-Sent Events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Token id (as a string, OpenAI's shape) → bias added to its logit, in [-100, 100].
    pub logit_bias: Option<std::collections::HashMap<String, f32>>,
    /// Tool definitions: kvlens has no tool-call parser, so any tools are refused.
    pub tools: Option<Value>,
    /// Only `"none"` (what no tools means) is accepted.
    pub tool_choice: Option<Value>,
    /// Only `{"type": "text"}` (plain text) is accepted: kvlens has no structured output.
    pub response_format: Option<Value>,
    /// vLLM: end the output after the stop string instead of before it.
    pub include_stop_str_in_output: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Report the sampled tokens' log-probabilities.
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// And this many alternatives per token.
    #[serde(default)]
    pub top_logprobs: Option<usize>,
    /// The rest.
    #[serde(flatten)]
    pub common: CommonFields,
}

/// `prompt` of a completion request: one string (a list of one is accepted too).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// `"prompt": "…"`
    One(String),
    /// `"prompt": ["…"]`
    Many(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// The text to continue.
    pub prompt: Prompt,
    /// Report this many top log-probabilities per token (legacy shape).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Prepend the prompt to the answer: refused (kvlens computes no prompt log-probabilities).
    #[serde(default)]
    pub echo: Option<bool>,
    /// Choices sampled to return the best: only 1 (vLLM's V1 engine refuses more too).
    #[serde(default)]
    pub best_of: Option<usize>,
    /// Text after the insertion point: refused, as vLLM does.
    #[serde(default)]
    pub suffix: Option<String>,
    /// The rest.
    #[serde(flatten)]
    pub common: CommonFields,
}

impl Prompt {
    /// The single prompt.
    pub fn into_text(self) -> Result<String, ApiError> {
        match self {
            Prompt::One(s) => Ok(s),
            Prompt::Many(mut v) if v.len() == 1 => Ok(v.remove(0)),
            Prompt::Many(v) => Err(ApiError::bad_request(format!(
                "kvlens takes one prompt per request, got {}",
                v.len()
            ))),
        }
    }
}

/// What a request asks for, checked.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Sampling settings (`max_tokens` is settled once the prompt length is known).
    pub params: SamplingParams,
    /// `max_tokens` as sent.
    pub max_tokens: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream the answer.
    pub stream: bool,
    /// Stream a usage chunk at the end.
    pub include_usage: bool,
    /// Report log-probabilities with this many alternatives.
    pub logprobs: Option<usize>,
    /// Report token ids.
    pub return_token_ids: bool,
    /// End the output after a stop string instead of before it.
    pub include_stop: bool,
}

impl ChatRequest {
    /// The checked settings.
    pub fn spec(&self) -> Result<Spec, ApiError> {
        let logprobs = match (self.logprobs, self.top_logprobs) {
            (Some(true), k) => Some(k.unwrap_or(0)),
            (_, Some(k)) if k > 0 => {
                return Err(ApiError::bad_request("top_logprobs needs logprobs set to true"));
            }
            _ => None,
        };
        self.common.spec(logprobs)
    }
}

impl CompletionRequest {
    /// The checked settings: `echo`, `best_of` above 1 and `suffix` are refused, not ignored.
    pub fn spec(&self) -> Result<Spec, ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::bad_request(
                "echo is not supported by kvlens (it would need the prompt's log-probabilities)",
            ));
        }
        if let Some(n) = self.best_of.filter(|&n| n != 1) {
            return Err(ApiError::bad_request(format!(
                "best_of must be 1 (kvlens returns one choice per request), got {n}"
            )));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::bad_request("suffix is not supported by kvlens"));
        }
        self.common.spec(self.logprobs)
    }
}

impl CommonFields {
    fn spec(&self, logprobs: Option<usize>) -> Result<Spec, ApiError> {
        if let Some(n) = self.n.filter(|&n| n != 1) {
            return Err(ApiError::bad_request(format!(
                "n must be 1 (kvlens returns one choice per request), got {n}"
            )));
        }
        if let Some(k) = logprobs.filter(|&k| k > MAX_LOGPROBS) {
            return Err(ApiError::bad_request(format!(
                "at most {MAX_LOGPROBS} log-probabilities per token may be asked for, got {k}"
            )));
        }
        self.refuse_unsupported()?;
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        let d = SamplingParams::default();
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            seed: self.seed,
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            max_tokens: max_tokens.unwrap_or(1),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logprobs,
            logit_bias: self.logit_bias()?,
        };
        params.validate().map_err(ApiError::bad_request)?;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        Ok(Spec {
            params,
            max_tokens,
            stop,
            stream: self.stream.unwrap_or(false),
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            logprobs,
            return_token_ids: self.return_token_ids.unwrap_or(false),
            include_stop: self.include_stop_str_in_output.unwrap_or(false),
        })
    }
}

impl CommonFields {
    /// 400 naming the field for what the engine cannot do (rather than ignoring it silently).
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let tools = self.tools.as_ref().filter(|t| !t.is_null() && *t != &json!([]));
        let choice = self.tool_choice.as_ref().filter(|c| !c.is_null() && *c != "none");
        let format = self
            .response_format
            .as_ref()
            .filter(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text"));
        for (field, given) in [("tools", tools), ("tool_choice", choice), ("response_format", format)] {
            if let Some(v) = given {
                return Err(ApiError::bad_request(format!(
                    "{field} is not supported by kvlens (no tool calling or structured output), got {v}"
                )));
            }
        }
        Ok(())
    }

    /// `logit_bias` as (token id, bias) pairs, sorted by id.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let mut bias = self
            .logit_bias
            .iter()
            .flatten()
            .map(|(id, &b)| {
                id.trim()
                    .parse::<u32>()
                    .map(|id| (id, b))
                    .map_err(|_| ApiError::bad_request(format!("logit_bias keys must be token ids, got {id:?}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        bias.sort_by_key(|&(id, _)| id);
        Ok(bias)
    }
}

/// Which endpoint answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
}

/// One request's identity and the options that shape its answer.
#[derive(Debug, Clone)]
pub struct Job {
    /// `chatcmpl-…` / `cmpl-…` (also the engine's request id).
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// Which endpoint.
    pub kind: Kind,
    /// The prompt as the engine runs it (image placeholders expanded).
    pub prompt_ids: Vec<u32>,
    /// Log-probabilities asked for.
    pub logprobs: Option<usize>,
    /// Token ids asked for.
    pub return_token_ids: bool,
}

/// A log-probability JSON can carry (`-inf` becomes vLLM's -9999).
fn finite(lp: f32) -> f32 {
    if lp.is_finite() {
        lp
    } else {
        -9999.0
    }
}

/// The text of one token, special tokens included.
fn token_text(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat's `{"token", "logprob", "bytes"}`.
fn chat_entry(tok: &Tokenizer, id: u32, lp: f32) -> Value {
    let text = token_text(tok, id);
    json!({"token": text, "logprob": finite(lp), "bytes": text.as_bytes()})
}

/// Chat's `logprobs` object.
fn chat_logprobs(tok: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let mut entry = chat_entry(tok, t.token, t.logprob);
            entry["top_logprobs"] = t.top.iter().map(|&(id, lp)| chat_entry(tok, id, lp)).collect();
            entry
        })
        .collect();
    json!({ "content": content })
}

/// The completions API's legacy `logprobs` object.
fn completion_logprobs(tok: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
    let texts: Vec<String> = tokens.iter().map(|t| token_text(tok, t.token)).collect();
    let top: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let map: serde_json::Map<String, Value> = t
                .top
                .iter()
                .map(|&(id, lp)| (token_text(tok, id), json!(finite(lp))))
                .collect();
            Value::Object(map)
        })
        .collect();
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|t| finite(t.logprob)).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": tokens.iter().map(|t| t.offset).collect::<Vec<_>>(),
    })
}

impl Job {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_ids.len(),
            "total_tokens": self.prompt_ids.len() + completion_tokens,
            "completion_tokens": completion_tokens,
        })
    }

    /// The choice's `logprobs` (null unless asked for).
    fn logprobs(&self, tok: &Tokenizer, tokens: &[TokenLogprobs]) -> Value {
        match (self.logprobs, self.kind) {
            (None, _) => Value::Null,
            (Some(_), Kind::Chat) => chat_logprobs(tok, tokens),
            (Some(_), Kind::Completion) => completion_logprobs(tok, tokens),
        }
    }

    /// One choice; `text` goes in `message` / `delta` / `text` by kind.
    fn choice(
        &self,
        tok: &Tokenizer,
        text: &str,
        tokens: &[TokenLogprobs],
        finish: Option<FinishReason>,
        chunk: bool,
        first: bool,
    ) -> Value {
        let mut choice = json!({
            "index": 0,
            "logprobs": self.logprobs(tok, tokens),
            "finish_reason": finish.map(FinishReason::as_str),
        });
        match (self.kind, chunk) {
            (Kind::Chat, false) => choice["message"] = json!({"role": "assistant", "content": text}),
            (Kind::Chat, true) if first => choice["delta"] = json!({"role": "assistant", "content": text}),
            (Kind::Chat, true) => choice["delta"] = json!({"content": text}),
            (Kind::Completion, _) => choice["text"] = json!(text),
        }
        if self.return_token_ids {
            choice["token_ids"] = tokens.iter().map(|t| t.token).collect();
            if self.kind == Kind::Completion && (first || !chunk) {
                choice["prompt_token_ids"] = json!(self.prompt_ids);
            }
        }
        choice
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The whole answer of a non-streamed request.
    pub fn response(&self, tok: &Tokenizer, text: &str, tokens: &[TokenLogprobs], finish: FinishReason) -> Value {
        let choice = self.choice(tok, text, tokens, Some(finish), false, false);
        let mut v = self.envelope(false, vec![choice]);
        v["usage"] = self.usage(tokens.len());
        if self.return_token_ids {
            v["prompt_token_ids"] = json!(self.prompt_ids);
        }
        v
    }

    /// One streamed chunk for `delta` (`first` adds the role and the prompt ids).
    pub fn chunk(&self, tok: &Tokenizer, delta: &Delta, first: bool) -> Value {
        let tokens: Vec<TokenLogprobs> = delta.token.iter().cloned().collect();
        let choice = self.choice(tok, &delta.text, &tokens, delta.finish, true, first);
        let mut v = self.envelope(true, vec![choice]);
        if first && self.return_token_ids {
            v["prompt_token_ids"] = json!(self.prompt_ids);
        }
        v
    }

    /// The last chunk of a stream with `include_usage`: no choices, the token counts.
    pub fn usage_chunk(&self, completion_tokens: usize) -> Value {
        let mut v = self.envelope(true, Vec::new());
        v["usage"] = self.usage(completion_tokens);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(json: &str) -> Result<Spec, ApiError> {
        serde_json::from_str::<ChatRequest>(json).unwrap().spec()
    }

    #[test]
    fn chat_fields_map_onto_sampling_params() {
        let s = chat(
            r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7,
                "max_tokens": 3, "temperature": 0, "top_k": 5, "min_p": 0.1, "seed": 9, "stop": "x",
                "ignore_eos": true, "repetition_penalty": 1.1, "logprobs": true, "top_logprobs": 2,
                "stream": true, "stream_options": {"include_usage": true}, "return_token_ids": true,
                "n": 1, "unknown_field": null}"#,
        )
        .unwrap();
        assert_eq!(s.max_tokens, Some(7));
        assert_eq!((s.params.temperature, s.params.top_k, s.params.seed), (0.0, 5, Some(9)));
        assert_eq!(s.stop, ["x"]);
        assert!(s.params.ignore_eos && s.stream && s.include_usage && s.return_token_ids);
        assert_eq!(s.logprobs, Some(2));
        assert_eq!(s.params.logprobs, Some(2));
    }

    #[test]
    fn out_of_range_fields_are_bad_requests() {
        let msgs = r#""messages": [{"role": "user", "content": "hi"}]"#;
        for bad in [
            r#""temperature": -1"#,
            r#""n": 2"#,
            r#""max_tokens": 0"#,
            r#""top_p": 0"#,
            r#""top_logprobs": 3"#,
            r#""logprobs": true, "top_logprobs": 21"#,
        ] {
            let e = chat(&format!("{{{msgs}, {bad}}}")).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{bad}");
        }
    }

    #[test]
    fn prompts_are_single_strings() {
        let one: CompletionRequest = serde_json::from_str(r#"{"prompt": ["a"], "logprobs": 1}"#).unwrap();
        assert_eq!(one.spec().unwrap().logprobs, Some(1));
        assert_eq!(one.prompt.into_text().unwrap(), "a");
        let two: CompletionRequest = serde_json::from_str(r#"{"prompt": ["a", "b"]}"#).unwrap();
        assert!(two.prompt.into_text().is_err());
    }

    #[test]
    fn completion_fields_kvlens_cannot_honour_are_refused_not_ignored() {
        let spec = |extra: &str| {
            let req: CompletionRequest = serde_json::from_str(&format!(r#"{{"prompt": "a"{extra}}}"#)).unwrap();
            req.spec()
        };
        for (bad, says) in [
            (r#", "echo": true"#, "echo"),
            (r#", "best_of": 3"#, "best_of"),
            (r#", "suffix": "z""#, "suffix"),
        ] {
            let e = spec(bad).unwrap_err();
            assert!(e.status.as_u16() == 400 && e.message.contains(says), "{bad}: {e}");
        }
        for fine in [r#", "echo": false"#, r#", "best_of": 1"#, r#", "suffix": """#] {
            assert!(spec(fine).is_ok(), "{fine}");
        }
        assert!(spec(r#", "include_stop_str_in_output": true"#).unwrap().include_stop);
        assert!(!spec("").unwrap().include_stop);
    }
}
