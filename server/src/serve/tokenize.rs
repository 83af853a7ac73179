//! `POST /tokenize` and `POST /detokenize` in vLLM's shapes. A prompt is tokenized as the
//! completions endpoint tokenizes it; a chat goes through the chat endpoint's path (allowed remote
//! images fetched, the template rendered, every image preprocessed and its placeholder expanded to
//! the image's token count), so `count` is the `usage.prompt_tokens` the same request would get,
//! within the same guards (a text whose length alone proves it longer than `max_model_len` is
//! refused untokenized; images wait for the preprocessing budget). Neither fills the processor
//! cache nor reaches the engine.

use super::errors::{json_response, ApiError};
use super::generate::{preprocessing_error, read_json, served_model, CancelWhenDropped};
use super::media::resolve_remote_images;
use super::App;
use crate::runtime::PromptOptions;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvlens_engine::input::chat::{ChatMessage, RenderOptions};
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`).
#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    /// A served model name (the first one when absent).
    model: Option<String>,
    /// The text of a completion request.
    prompt: Option<String>,
    /// The conversation of a chat request.
    messages: Option<Vec<ChatMessage>>,
    /// Special tokens from the tokenizer's post-processor [default: true for a prompt, false for a
    /// chat, whose template writes its own].
    add_special_tokens: Option<bool>,
    /// Chat: end with the assistant turn's header [default: true].
    add_generation_prompt: Option<bool>,
    /// Chat: end inside the last message, for the model to continue it [default: false].
    continue_final_message: Option<bool>,
    /// Also answer each token's vocabulary string.
    return_token_strs: Option<bool>,
    /// Chat: tool definitions, which kvlens cannot render: refused rather than ignored.
    tools: Option<Value>,
    /// Chat: another template than the server's: refused rather than ignored.
    chat_template: Option<Value>,
    /// Chat: extra template variables: refused rather than ignored.
    chat_template_kwargs: Option<Value>,
}

/// vLLM's `DetokenizeRequest`.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    /// A served model name (the first one when absent).
    model: Option<String>,
    /// The ids to turn into text.
    tokens: Vec<u32>,
}

/// `POST /tokenize`: `{count, max_model_len, tokens, token_strs}`.
pub async fn tokenize(State(app): State<Arc<App>>, request: Request) -> Response {
    let cancel = CancelWhenDropped::default();
    let answer = async {
        let ready = app.ready()?;
        let (req, mut held): (TokenizeRequest, _) = read_json(&app, &ready.frontend.preprocess_budget, request).await?;
        served_model(ready, req.model.as_deref())?;
        for (field, given) in [
            ("tools", &req.tools),
            ("chat_template", &req.chat_template),
            ("chat_template_kwargs", &req.chat_template_kwargs),
        ] {
            if given.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::bad_request(format!(
                    "{field} is not supported by kvlens's /tokenize"
                )));
            }
        }
        let frontend = ready.frontend.clone();
        let cancel = cancel.0.clone();
        let tokens = match (req.prompt, req.messages) {
            (Some(prompt), None) => {
                let special = req.add_special_tokens.unwrap_or(true);
                tokio::task::spawn_blocking(move || frontend.encode_if_it_can_fit(&prompt, special, &cancel))
                    .await
                    .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
                    .map_err(preprocessing_error)?
            }
            (None, Some(mut messages)) => {
                let options = PromptOptions {
                    render: RenderOptions {
                        add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
                        continue_final_message: req.continue_final_message.unwrap_or(false),
                        ..RenderOptions::default()
                    },
                    add_special_tokens: req.add_special_tokens.unwrap_or(false),
                    allow_files: false,
                    skip_processor_cache: true,
                };
                resolve_remote_images(&mut messages, &app.media, &mut held).await?;
                tokio::task::spawn_blocking(move || frontend.prompt(&messages, options, &cancel))
                    .await
                    .map_err(|e| ApiError::internal(format!("preprocessing failed: {e}")))?
                    .map_err(preprocessing_error)?
                    .ids
            }
            _ => {
                return Err(ApiError::bad_request(
                    "give either prompt (a string) or messages (a chat), not both",
                ))
            }
        };
        drop(held);
        let tokenizer = &ready.frontend.tokenizer;
        let token_strs = req.return_token_strs.unwrap_or(false).then(|| {
            tokens
                .iter()
                .map(|&id| tokenizer.id_to_token(id).unwrap_or_default())
                .collect::<Vec<_>>()
        });
        Ok::<_, ApiError>(json_response(
            StatusCode::OK,
            &json!({
                "count": tokens.len(),
                "max_model_len": ready.max_model_len,
                "tokens": tokens,
                "token_strs": token_strs,
            }),
        ))
    };
    answer.await.unwrap_or_else(IntoResponse::into_response)
}

/// `POST /detokenize`: `{prompt}`, special tokens included (vLLM decodes them too).
pub async fn detokenize(State(app): State<Arc<App>>, request: Request) -> Response {
    let answer = async {
        let ready = app.ready()?;
        let (req, _held): (DetokenizeRequest, _) = read_json(&app, &ready.frontend.preprocess_budget, request).await?;
        served_model(ready, req.model.as_deref())?;
        let vocab = ready.frontend.tokenizer.vocab_size();
        if let Some(bad) = req.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::bad_request(format!(
                "token id {bad} is outside the vocabulary of {vocab} tokens"
            )));
        }
        let frontend = ready.frontend.clone();
        let prompt = tokio::task::spawn_blocking(move || frontend.tokenizer.decode(&req.tokens, false))
            .await
            .map_err(|e| ApiError::internal(format!("detokenizing failed: {e}")))?
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        Ok(json_response(StatusCode::OK, &json!({ "prompt": prompt })))
    };
    answer.await.unwrap_or_else(IntoResponse::into_response)
}
