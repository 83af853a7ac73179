//! A log's header: the `vllm serve …` (or `kvlens serve …`) command line and the free-text notes
//! after it, such as the device.

use super::numbers::{parse_f64, parse_human_int};
use super::{LineKind, ParsedLog, RecognisedLine};
use serde::Serialize;

/// The `vllm serve …` command recorded in a log header.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CommandLine {
    /// The command text from `vllm serve` (or `…api_server`) up to where the command ends.
    pub raw: String,
    /// The model: the positional argument after `serve`, else the value of `--model`.
    pub model: Option<String>,
    /// The flags in order, without leading dashes and as spelled (`tensor-parallel-size`,
    /// `max_model_len`, `tp`), with their value (`None` for a boolean flag).
    pub flags: Vec<(String, Option<String>)>,
    /// Positional arguments other than the model.
    pub positional: Vec<String>,
}

impl CommandLine {
    /// The value of the last occurrence of flag `name` (with or without leading dashes;
    /// `_` and `-` are interchangeable; `tp`, `pp`, `dp` are aliases of the parallel sizes).
    /// `None` if the flag is absent or its last occurrence has no value (see
    /// [`CommandLine::has_flag`]).
    pub fn flag(&self, name: &str) -> Option<&str> {
        let want = canonical_flag(name);
        self.flags
            .iter()
            .rev()
            .find(|(n, _)| canonical_flag(n) == want)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Whether flag `name` occurs at all (with or without a value); names as in
    /// [`CommandLine::flag`].
    pub fn has_flag(&self, name: &str) -> bool {
        let want = canonical_flag(name);
        self.flags.iter().any(|(n, _)| canonical_flag(n) == want)
    }

    /// `--tensor-parallel-size` / `-tp`.
    pub fn tensor_parallel_size(&self) -> Option<u64> {
        parse_human_int(self.flag("tensor-parallel-size")?)
    }

    /// `--max-model-len` (accepts vLLM's human-readable forms `64k` = 64,000, `64K` = 65,536).
    pub fn max_model_len(&self) -> Option<u64> {
        parse_human_int(self.flag("max-model-len")?)
    }

    /// `--max-num-seqs`.
    pub fn max_num_seqs(&self) -> Option<u64> {
        parse_human_int(self.flag("max-num-seqs")?)
    }

    /// `--max-num-batched-tokens` (human-readable forms accepted).
    pub fn max_num_batched_tokens(&self) -> Option<u64> {
        parse_human_int(self.flag("max-num-batched-tokens")?)
    }

    /// `--gpu-memory-utilization`.
    pub fn gpu_memory_utilization(&self) -> Option<f64> {
        parse_f64(self.flag("gpu-memory-utilization")?)
    }

    /// `--block-size`.
    pub fn block_size(&self) -> Option<u64> {
        parse_human_int(self.flag("block-size")?)
    }

    /// `--kv-cache-dtype` (raw string, e.g. `auto`, `fp8`).
    pub fn kv_cache_dtype(&self) -> Option<&str> {
        self.flag("kv-cache-dtype")
    }

    /// `--limit-mm-per-prompt` (raw string, e.g. `{"image": 2, "video": 0}`).
    pub fn limit_mm_per_prompt(&self) -> Option<&str> {
        self.flag("limit-mm-per-prompt")
    }
}

pub(super) fn push_header(log: &mut ParsedLog, line_no: usize, line: &str) {
    apply_header(log, line);
    log.recognised.push(RecognisedLine {
        line: line_no,
        kind: LineKind::Header,
        text: line.to_string(),
    });
}

/// Where the command's arguments start: after `vllm serve`, the OpenAI api_server module or
/// `kvlens serve` (whose start-up log follows vLLM's).
fn command_start(body: &str) -> Option<(usize, usize)> {
    for anchor in ["vllm serve", "vllm.entrypoints.openai.api_server", "kvlens serve"] {
        let mut from = 0;
        while let Some(pos) = body.get(from..).and_then(|s| s.find(anchor)) {
            let start = from + pos;
            let end = start + anchor.len();
            let next = body.get(end..).and_then(|s| s.chars().next());
            if next.is_none_or(char::is_whitespace) {
                return Some((start, end));
            }
            from = end;
        }
    }
    None
}

fn apply_header(log: &mut ParsedLog, line: &str) {
    let body = line.trim_start().trim_start_matches('#').trim();
    let notes_text;
    if let Some((start, args_start)) = command_start(body) {
        let (tokens, end) = tokenize_command(body.get(args_start..).unwrap_or(""));
        let cmd_end = args_start + end;
        let raw = body.get(start..cmd_end).unwrap_or("").trim().to_string();
        notes_text = body.get(cmd_end..).unwrap_or("");
        if log.command.is_none() {
            log.command = Some(build_command(raw, tokens));
        }
    } else {
        notes_text = body;
    }
    let notes = split_notes(notes_text);
    if log.device_hint.is_none() {
        log.device_hint = notes.iter().find(|n| looks_like_device(n)).cloned();
    }
    log.header_notes.extend(notes);
}

/// Shell-like tokenizer. Stops (returning the byte offset where the command ends) at an unquoted
/// `,` that ends a token and is followed by whitespace or the end, or at an unquoted `(` that
/// starts a token. Quotes `'…'` / `"…"` and `{…}` / `[…]` groups keep their spaces and commas.
fn tokenize_command(s: &str) -> (Vec<String>, usize) {
    let mut tokens = Vec::new();
    let mut chars = s.char_indices().peekable();
    loop {
        while chars.next_if(|(_, c)| c.is_whitespace()).is_some() {}
        let Some(&(start, first)) = chars.peek() else {
            return (tokens, s.len());
        };
        if first == '(' || first == ',' {
            return (tokens, start);
        }
        let mut tok = String::new();
        let mut depth = 0usize;
        let mut stop_at = None;
        while let Some(&(i, c)) = chars.peek() {
            match c {
                '\'' | '"' => {
                    chars.next();
                    for (_, q) in chars.by_ref() {
                        if q == c {
                            break;
                        }
                        tok.push(q);
                    }
                    continue;
                }
                '\\' => {
                    chars.next();
                    if let Some((_, e)) = chars.next() {
                        if !e.is_whitespace() {
                            tok.push(e);
                        }
                    }
                    continue;
                }
                '{' | '[' => depth += 1,
                '}' | ']' => depth = depth.saturating_sub(1),
                ',' if depth == 0 => {
                    let after_comma = s.get(i + 1..).and_then(|r| r.chars().next());
                    if after_comma.is_none_or(char::is_whitespace) {
                        stop_at = Some(i);
                        break;
                    }
                }
                c if c.is_whitespace() && depth == 0 => break,
                _ => {}
            }
            tok.push(c);
            chars.next();
        }
        if !tok.is_empty() {
            tokens.push(tok);
        }
        if let Some(i) = stop_at {
            return (tokens, i);
        }
    }
}

fn build_command(raw: String, tokens: Vec<String>) -> CommandLine {
    let mut cmd = CommandLine {
        raw,
        ..CommandLine::default()
    };
    let mut positional_model = None;
    let mut iter = tokens.into_iter().peekable();
    while let Some(tok) = iter.next() {
        let name_part = if let Some(n) = tok.strip_prefix("--") {
            n
        } else if is_flag_token(&tok) {
            &tok[1..]
        } else {
            if positional_model.is_none() && cmd.positional.is_empty() {
                positional_model = Some(tok);
            } else {
                cmd.positional.push(tok);
            }
            continue;
        };
        if name_part.is_empty() {
            continue; // a bare `--`
        }
        let (name, value) = match name_part.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => {
                let name = name_part.to_string();
                let boolean = is_boolean_flag(&name);
                let value = iter.next_if(|next| {
                    !is_flag_token(next)
                        && (!boolean || next.eq_ignore_ascii_case("true") || next.eq_ignore_ascii_case("false"))
                });
                (name, value)
            }
        };
        cmd.flags.push((name, value));
    }
    cmd.model = positional_model.or_else(|| cmd.flag("model").map(str::to_string));
    cmd
}

/// `-x…` or `--x…` where the character after the dashes is not a digit or `.` (so `-1` is a value).
fn is_flag_token(tok: &str) -> bool {
    let Some(rest) = tok.strip_prefix('-') else {
        return false;
    };
    let rest = rest.strip_prefix('-').unwrap_or(rest);
    rest.chars().next().is_some_and(|c| !c.is_ascii_digit() && c != '.')
}

/// Flags that take no value (a following `true`/`false` is still accepted).
fn is_boolean_flag(name: &str) -> bool {
    let n = canonical_flag(name);
    const KNOWN: &[&str] = &[
        "enforce-eager",
        "trust-remote-code",
        "skip-tokenizer-init",
        "disable-sliding-window",
        "disable-cascade-attn",
        "disable-async-output-proc",
        "disable-mm-preprocessor-cache",
        "async-scheduling",
        "headless",
        "help",
        "version",
    ];
    KNOWN.contains(&n.as_str()) || n.starts_with("enable-") || n.starts_with("disable-") || n.starts_with("no-")
}

/// Flag name without dashes, `_` → `-`, short aliases expanded.
fn canonical_flag(name: &str) -> String {
    let n = name.trim_start_matches('-').replace('_', "-");
    match n.as_str() {
        "tp" => "tensor-parallel-size".to_string(),
        "pp" => "pipeline-parallel-size".to_string(),
        "dp" => "data-parallel-size".to_string(),
        _ => n,
    }
}

/// Splits header notes at top-level `,` and at parentheses.
fn split_notes(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut depth = 0usize;
    let flush = |cur: &mut String, out: &mut Vec<String>| {
        let t = cur.trim().trim_matches(',').trim();
        if !t.is_empty() {
            out.push(t.to_string());
        }
        cur.clear();
    };
    for c in s.chars() {
        match c {
            '(' => {
                if depth == 0 {
                    flush(&mut cur, &mut out);
                } else {
                    cur.push(c);
                }
                depth += 1;
            }
            ')' if depth > 0 => {
                depth -= 1;
                if depth == 0 {
                    flush(&mut cur, &mut out);
                } else {
                    cur.push(c);
                }
            }
            ',' if depth == 0 => flush(&mut cur, &mut out),
            _ => cur.push(c),
        }
    }
    flush(&mut cur, &mut out);
    out
}

fn looks_like_device(note: &str) -> bool {
    const WORDS: &[&str] = &[
        "Ascend", "910B", "910C", "NVIDIA", "H100", "H200", "H800", "H20", "A100", "A800", "L40", "L20", "RTX",
        "MI300", "MI250", "GPU", "NPU",
    ];
    WORDS.iter().any(|w| note.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_cuts_at_notes() {
        let (t, end) =
            tokenize_command(" Qwen/X --limit-mm-per-prompt '{\"image\": 2, \"video\": 0}' --a=1, Ascend 910B");
        assert_eq!(
            t,
            vec![
                "Qwen/X",
                "--limit-mm-per-prompt",
                "{\"image\": 2, \"video\": 0}",
                "--a=1"
            ]
        );
        assert_eq!(
            &" Qwen/X --limit-mm-per-prompt '{\"image\": 2, \"video\": 0}' --a=1, Ascend 910B"[end..],
            ", Ascend 910B"
        );
        let (t, _) = tokenize_command(" m --x 1 (note), other");
        assert_eq!(t, vec!["m", "--x", "1"]);
    }
}
