//! The messages between the page and the engine's Web Worker ([`crate::worker`]), as JSON: the
//! page sends what the user does, the worker answers with what the engine did. The engine, its
//! checkpoint loading, tokenizing, image preprocessing and detokenizing all run in the worker, so
//! a step on the CPU fallback never blocks the page.

use crate::local_engine::{Progress, Settings};
use crate::memory_view::{Budget, ResetKind};
use kvlens_engine::lessons::Step;
use kvlens_engine::occupancy::Occupancy;
use kvlens_engine::sample::SamplingParams;
use serde::{Deserialize, Serialize};

/// One turn of the conversation as the page holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// `user` or `assistant`.
    pub role: String,
    /// The text.
    pub text: String,
    /// Images as data URLs.
    pub images: Vec<String>,
}

/// What the page asks of the worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    /// Load a checkpoint from `url` (a directory, or with `mmproj` a GGUF pair), or from the
    /// files posted beside the message.
    Load {
        /// The directory URL, or the GGUF text model's; None: the picked files.
        url: Option<String>,
        /// The GGUF projector's URL, with a GGUF text model's `url`.
        #[serde(default)]
        mmproj: Option<String>,
        /// The engine's settings.
        settings: Settings,
    },
    /// Generate a reply to the conversation.
    Chat {
        /// The request id.
        id: String,
        /// Every turn so far, the new user message last.
        turns: Vec<Turn>,
        /// How to sample.
        params: SamplingParams,
    },
    /// Stop a request.
    Abort {
        /// Its id.
        id: String,
    },
    /// Empty a cache.
    Reset(ResetKind),
    /// Run a lesson's live steps on the loaded model.
    Lesson {
        /// The lesson's name.
        name: String,
    },
}

/// What the worker tells the page.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum FromWorker {
    /// The backend the worker opened (first message: the worker listens from now on).
    Device {
        /// The backend and adapter, in words.
        text: String,
        /// No WebGPU: the CPU backend in wasm, whose start-up profile of a large step takes minutes.
        cpu: bool,
    },
    /// Where loading is.
    Status(String),
    /// The planner's verdict before any weight is read.
    Verdict(String),
    /// Weights converted so far.
    Progress(Progress),
    /// The model is loaded.
    Loaded {
        /// What it runs on, in words.
        device: String,
        /// What start-up planned.
        budget: Budget,
    },
    /// Loading failed.
    Failed(String),
    /// A request was queued.
    Accepted {
        /// Its id.
        id: String,
        /// Prompt tokens.
        prompt_len: usize,
        /// Its images' content hashes, in prompt order.
        mm_hashes: Vec<String>,
    },
    /// A request was refused before it was queued.
    Refused {
        /// Its id.
        id: String,
        /// Why.
        error: String,
    },
    /// A request's next token.
    Token {
        /// Its id.
        id: String,
        /// The token id.
        token: u32,
        /// The text it completes (incremental detokenization).
        text: String,
        /// Why the request ended, when this is its last token.
        finish: Option<String>,
    },
    /// The engine's memory after a step or a reset.
    Occupancy(Box<Occupancy>),
    /// A step failed; the engine dropped every request and emptied its caches.
    StepFailed(String),
    /// What a reset freed.
    Reset(String),
    /// What a lesson runs on, in one sentence (before its first step).
    LessonSetting(String),
    /// A lesson step ended, with its figures.
    LessonStep {
        /// Its place among the lesson's live steps.
        index: usize,
        /// Its sentence and figures.
        step: Step,
    },
    /// A lesson ended: None when it ran through, else why it stopped.
    LessonEnded(Option<String>),
}

impl FromWorker {
    /// The request a message is about, if any.
    pub fn request(&self) -> Option<&str> {
        match self {
            FromWorker::Accepted { id, .. } | FromWorker::Refused { id, .. } | FromWorker::Token { id, .. } => Some(id),
            _ => None,
        }
    }
}

/// A message as JSON text.
pub fn encode<T: Serialize>(msg: &T) -> String {
    serde_json::to_string(msg).expect("the messages serialize")
}

/// A message from JSON text.
pub fn decode<T: for<'de> Deserialize<'de>>(text: &str) -> Result<T, String> {
    serde_json::from_str(text).map_err(|e| format!("a malformed message between page and worker: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_survive_their_json() {
        let msg = ToWorker::Chat {
            id: "chat-0".into(),
            turns: vec![Turn {
                role: "user".into(),
                text: "Describe this image.".into(),
                images: vec!["data:image/png;base64,AAAA".into()],
            }],
            params: SamplingParams {
                max_tokens: 7,
                ..SamplingParams::default()
            },
        };
        let back: ToWorker = decode(&encode(&msg)).unwrap();
        let ToWorker::Chat { turns, params, .. } = back else {
            panic!("{back:?}")
        };
        assert_eq!(turns[0].images.len(), 1);
        assert_eq!(params.max_tokens, 7);
        let load: ToWorker = decode(&encode(&ToWorker::Load {
            url: None,
            mmproj: None,
            settings: Settings::default(),
        }))
        .unwrap();
        assert!(
            matches!(load, ToWorker::Load { url: None, mmproj: None, settings } if settings == Settings::default())
        );
        let token = FromWorker::Token {
            id: "chat-0".into(),
            token: 42,
            text: " a".into(),
            finish: Some("length".into()),
        };
        assert_eq!(token.request(), Some("chat-0"));
        assert!(decode::<FromWorker>("{\"Nope\":1}").is_err());
    }
}
