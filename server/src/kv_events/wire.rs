//! vLLM's msgpack form of a KV event batch (`vllm/distributed/kv_events.py`, msgspec structs with
//! `array_like=True, omit_defaults=True`, events tagged by class name):
//!
//! ```text
//! KVEventBatch     = [ts: float, events: [Event…], data_parallel_rank: int]
//! BlockStored      = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
//!                     lora_id, medium, lora_name, extra_keys]
//! BlockRemoved     = ["BlockRemoved", block_hashes, medium]
//! AllBlocksCleared = ["AllBlocksCleared"]
//! ```
//!
//! Fields after the last one a struct requires are omitted when they hold their default, and a
//! decoder ignores trailing fields it does not know, so vLLM's older and newer subscribers read
//! the same bytes. The reader also takes the map form (a struct without `array_like`, tagged by
//! a `type` key) and block hashes sent as bytes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).

use anyhow::{bail, Context, Result};
use kvlens_engine::cache::{KvCacheEvent, WatchEvent};
use rmpv::Value;

/// The storage medium our blocks live on, as vLLM names the GPU's (`MEDIUM_GPU`).
pub const MEDIUM: &str = "GPU";

/// Encodes one batch: the events of one engine step, stamped `ts` (Unix seconds).
pub fn encode_batch(ts: f64, events: &[KvCacheEvent], data_parallel_rank: i64) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(encode_event).collect()),
        Value::from(data_parallel_rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec cannot fail");
    out
}

fn hashes(h: &[u64]) -> Value {
    Value::Array(h.iter().map(|&x| Value::from(x)).collect())
}

fn encode_event(event: &KvCacheEvent) -> Value {
    match event {
        KvCacheEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            extra_keys,
        } => Value::Array(vec![
            Value::from("BlockStored"),
            hashes(block_hashes),
            parent_block_hash.map_or(Value::Nil, Value::from),
            Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect()),
            Value::from(*block_size as u64),
            Value::Nil, // lora_id
            Value::from(MEDIUM),
            Value::Nil, // lora_name
            Value::Array(
                extra_keys
                    .iter()
                    .map(|k| {
                        k.as_ref().map_or(Value::Nil, |images| {
                            Value::Array(images.iter().map(|i| Value::from(i.as_str())).collect())
                        })
                    })
                    .collect(),
            ),
        ]),
        KvCacheEvent::BlockRemoved { block_hashes } => Value::Array(vec![
            Value::from("BlockRemoved"),
            hashes(block_hashes),
            Value::from(MEDIUM),
        ]),
        KvCacheEvent::AllBlocksCleared => Value::Array(vec![Value::from("AllBlocksCleared")]),
    }
}

/// One decoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct WireBatch {
    /// When the publisher made it (Unix seconds).
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<WatchEvent>,
    /// The data-parallel rank that sent it, when given.
    pub data_parallel_rank: Option<i64>,
}

/// Decodes one batch in either form (array or map), with int or bytes block hashes.
pub fn decode_batch(bytes: &[u8]) -> Result<WireBatch> {
    let value = rmpv::decode::read_value_with_max_depth(&mut &bytes[..], 16).context("not msgpack")?;
    let fields = Fields::of(&value, &["ts", "events", "data_parallel_rank"])?;
    let ts = match fields.get(0) {
        Some(Value::F64(t)) => *t,
        Some(Value::F32(t)) => f64::from(*t),
        Some(Value::Integer(i)) => i.as_f64().unwrap_or(0.0),
        _ => bail!("a batch without its timestamp"),
    };
    let events = match fields.get(1) {
        Some(Value::Array(events)) => events.iter().map(decode_event).collect::<Result<_>>()?,
        _ => bail!("a batch without its event list"),
    };
    Ok(WireBatch {
        ts,
        events,
        data_parallel_rank: fields.get(2).and_then(Value::as_i64),
    })
}

/// A struct's fields by position, from its array form or (by name) from its map form.
struct Fields<'a>(Vec<Option<&'a Value>>);

impl<'a> Fields<'a> {
    fn of(value: &'a Value, names: &[&str]) -> Result<Self> {
        match value {
            Value::Array(items) => Ok(Fields(names.iter().enumerate().map(|(i, _)| items.get(i)).collect())),
            Value::Map(pairs) => Ok(Fields(
                names
                    .iter()
                    .map(|n| pairs.iter().find(|(k, _)| k.as_str() == Some(n)).map(|(_, v)| v))
                    .collect(),
            )),
            _ => bail!("expected an array or a map, found {value}"),
        }
    }

    /// Field `i`, `None` when absent or nil.
    fn get(&self, i: usize) -> Option<&'a Value> {
        self.0.get(i).copied().flatten().filter(|v| !v.is_nil())
    }
}

const STORED: &[&str] = &[
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
];
const REMOVED: &[&str] = &["type", "block_hashes", "medium"];

fn decode_event(value: &Value) -> Result<WatchEvent> {
    let tag = Fields::of(value, &["type"])?
        .get(0)
        .and_then(Value::as_str)
        .context("an event without its tag")?;
    let medium = |f: &Fields<'_>, i| f.get(i).and_then(Value::as_str).map(str::to_owned);
    Ok(match tag {
        "BlockStored" => {
            let f = Fields::of(value, STORED)?;
            WatchEvent::BlockStored {
                block_hashes: hash_list(f.get(1))?,
                parent_block_hash: f.get(2).map(hash_key).transpose()?,
                token_ids: match f.get(3) {
                    Some(Value::Array(t)) => t
                        .iter()
                        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).context("a token id"))
                        .collect::<Result<_>>()?,
                    _ => Vec::new(),
                },
                block_size: f
                    .get(4)
                    .and_then(Value::as_u64)
                    .context("BlockStored without block_size")?,
                medium: medium(&f, 6),
                extra_keys: match f.get(8) {
                    Some(Value::Array(keys)) => keys.iter().map(extra_key).collect(),
                    _ => Vec::new(),
                },
            }
        }
        "BlockRemoved" => {
            let f = Fields::of(value, REMOVED)?;
            WatchEvent::BlockRemoved {
                block_hashes: hash_list(f.get(1))?,
                medium: medium(&f, 2),
            }
        }
        "AllBlocksCleared" => WatchEvent::AllBlocksCleared,
        other => bail!("unknown event {other:?}"),
    })
}

fn hash_list(value: Option<&Value>) -> Result<Vec<String>> {
    match value {
        Some(Value::Array(items)) => items.iter().map(hash_key).collect(),
        _ => bail!("an event without block_hashes"),
    }
}

fn hash_key(value: &Value) -> Result<String> {
    match value {
        Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(format!("{u:016x}")),
            (None, Some(s)) => Ok(format!("{:016x}", s as u64)),
            _ => bail!("a block hash out of range"),
        },
        Value::Binary(b) => Ok(b.iter().map(|x| format!("{x:02x}")).collect()),
        other => bail!("a block hash that is neither an int nor bytes: {other}"),
    }
}

/// One block's extra keys as text: strings as they are, anything else as msgpack's text form.
fn extra_key(value: &Value) -> Option<Vec<String>> {
    match value {
        Value::Nil => None,
        Value::Array(items) => Some(
            items
                .iter()
                .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
                .collect(),
        ),
        other => Some(vec![other.as_str().map_or_else(|| other.to_string(), str::to_owned)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvCacheEvent {
        KvCacheEvent::BlockStored {
            block_hashes: vec![u64::MAX, 7],
            parent_block_hash: Some(1),
            token_ids: vec![1, 2, 151655, 151655],
            block_size: 2,
            extra_keys: vec![None, Some(vec!["abc".into()])],
        }
    }

    #[test]
    fn a_batch_reads_back() {
        let events = [
            stored(),
            KvCacheEvent::BlockRemoved { block_hashes: vec![7] },
            KvCacheEvent::AllBlocksCleared,
        ];
        let batch = decode_batch(&encode_batch(12.5, &events, 0)).unwrap();
        assert_eq!(batch.ts, 12.5);
        assert_eq!(batch.data_parallel_rank, Some(0));
        assert_eq!(
            batch.events[0],
            WatchEvent::BlockStored {
                block_hashes: vec!["ffffffffffffffff".into(), "0000000000000007".into()],
                parent_block_hash: Some("0000000000000001".into()),
                block_size: 2,
                token_ids: vec![1, 2, 151655, 151655],
                medium: Some("GPU".into()),
                extra_keys: vec![None, Some(vec!["abc".into()])],
            }
        );
        assert_eq!(
            batch.events[1],
            WatchEvent::BlockRemoved {
                block_hashes: vec!["0000000000000007".into()],
                medium: Some("GPU".into()),
            }
        );
        assert_eq!(batch.events[2], WatchEvent::AllBlocksCleared);
    }

    #[test]
    fn the_map_form_and_bytes_hashes_read_too() {
        // {"ts": 1.0, "events": [{"type": "BlockRemoved", "block_hashes": [b"\x01\x02"]}]}
        let event = Value::Map(vec![
            (Value::from("type"), Value::from("BlockRemoved")),
            (
                Value::from("block_hashes"),
                Value::Array(vec![Value::Binary(vec![1, 2])]),
            ),
        ]);
        let batch = Value::Map(vec![
            (Value::from("ts"), Value::F64(1.0)),
            (Value::from("events"), Value::Array(vec![event])),
        ]);
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &batch).unwrap();
        let read = decode_batch(&bytes).unwrap();
        assert_eq!(
            read.events,
            vec![WatchEvent::BlockRemoved {
                block_hashes: vec!["0102".into()],
                medium: None
            }]
        );
        assert_eq!(read.data_parallel_rank, None);
    }

    #[test]
    fn every_cut_and_flipped_byte_of_a_batch_decodes_or_errs() {
        let good = encode_batch(
            1.0,
            &[stored(), KvCacheEvent::BlockRemoved { block_hashes: vec![7] }],
            0,
        );
        for n in 0..good.len() {
            let _ = decode_batch(&good[..n]);
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[n] ^= 1 << bit;
                let _ = decode_batch(&bad);
            }
        }
        // Deep nesting stops at the depth limit instead of the stack.
        assert!(decode_batch(&[0x91; 100_000]).is_err());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b""[..],
            b"\xc1",
            b"\x93\xa1x\x90\x00",
            b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x91\xa4Nope",
        ] {
            assert!(decode_batch(bad).is_err(), "{bad:?}");
        }
    }
}
