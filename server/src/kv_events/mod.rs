//! KV cache events in vLLM's wire format: `kvlens serve --kv-events-config JSON` publishes every
//! block our prefix cache stores and removes ([`publisher`]); `kvlens watch` reads the same
//! stream from a vLLM or vllm-ascend server ([`subscriber`]). The format is [`wire`]'s; the
//! config is vLLM's `KVEventsConfig`, spelled and defaulted as vLLM does.

pub mod publisher;
pub mod subscriber;
pub mod wire;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// The most batches kept for replay or queued for the publisher.
const MAX_QUEUE: usize = 10_000_000;

/// `--kv-events-config`, vLLM's `KVEventsConfig` (`vllm/config/kv_events.py`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Record and publish the events at all.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; unset means `"zmq"` when enabled, as in vLLM.
    pub publisher: Option<String>,
    /// The PUB socket: bound when it holds `*` (any interface) or `::`, connected otherwise.
    pub endpoint: String,
    /// The ROUTER socket that answers replay requests (bound), if any.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// The PUB socket's send high-water mark (messages queued per subscriber); fixed at
    /// [`publisher::PUB_QUEUE`] here, another value is ignored with a warning.
    pub hwm: usize,
    /// Batches queued between the engine and the publisher before the engine waits.
    pub max_queue_size: usize,
    /// The topic frame sent before each batch.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: publisher::PUB_QUEUE,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// The flag's value parser (clap wants a `String` error).
    pub fn flag(json: &str) -> Result<Self, String> {
        Self::parse(json).map_err(|e| e.to_string())
    }

    /// Parses the flag's JSON and says what is wrong with it in one line.
    pub fn parse(json: &str) -> Result<Self> {
        let config: Self = serde_json::from_str(json).map_err(|e| anyhow::anyhow!("--kv-events-config: {e}"))?;
        match config.publisher.as_deref() {
            None | Some("zmq" | "null") => {}
            Some(other) => bail!("--kv-events-config: publisher must be \"zmq\" or \"null\", got {other:?}"),
        }
        for (name, n) in [
            ("buffer_steps", config.buffer_steps),
            ("max_queue_size", config.max_queue_size),
        ] {
            if !(1..=MAX_QUEUE).contains(&n) {
                bail!("--kv-events-config: {name} must be 1 to {MAX_QUEUE}, got {n}");
            }
        }
        for e in std::iter::once(&config.endpoint).chain(&config.replay_endpoint) {
            if !e.starts_with("tcp://") {
                bail!("--kv-events-config: only tcp:// endpoints are supported, got {e:?}");
            }
        }
        Ok(config)
    }

    /// Whether events are published: enabled, and the publisher is not `"null"`.
    pub fn publishes(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref() != Some("null")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_defaults_and_its_spelling() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}"#,
        )
        .unwrap();
        assert!(c.publishes());
        assert_eq!(c.buffer_steps, 10_000);
        assert_eq!(c.replay_endpoint.as_deref(), Some("tcp://*:5558"));
        assert!(!KvEventsConfig::parse("{}").unwrap().publishes());
        assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#)
            .unwrap()
            .publishes());
        assert!(
            !KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "null"}"#)
                .unwrap()
                .publishes()
        );
    }

    #[test]
    fn mistakes_are_named() {
        for (json, says) in [
            (r#"{"enable_kv_cache_events": true, "publisher": "kafka"}"#, "publisher"),
            (r#"{"enable_kv_cache_event": true}"#, "unknown field"),
            (r#"{"endpoint": "ipc:///tmp/x"}"#, "tcp://"),
            (r#"{"buffer_steps": 0}"#, "buffer_steps"),
            (r#"{"max_queue_size": 18446744073709551615}"#, "max_queue_size"),
            ("not json", "--kv-events-config"),
        ] {
            let err = KvEventsConfig::parse(json).unwrap_err().to_string();
            assert!(err.contains(says), "{json}: {err}");
        }
    }
}
