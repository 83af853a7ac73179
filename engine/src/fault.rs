//! Fault injection: makes the N-th operation of one kind fail, so that the paths which recover
//! from a failed step (every request dropped with an error, both caches emptied, the engine ready
//! for the next request) can be tested end to end. Off unless a plan is set; `kvlens serve` reads
//! one from the `KVLENS_FAULT` environment variable (`vision:N`, `decoder:N` or `alloc:N`).

use crate::backend::BackendError;
use crate::memory::ledger::{Category, MemoryLedger};

/// The kinds of operation a plan can make fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// One image through the vision tower.
    VisionTower,
    /// One batched decoder pass.
    Decoder,
    /// The upload of one image's pixels before the vision tower (fails as an out-of-memory).
    Alloc,
}

/// Fail the `nth` (1-based) operation of `kind`, once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultPlan {
    /// Which operation.
    pub kind: FaultKind,
    /// Which occurrence of it, counting from 1.
    pub nth: u64,
}

impl std::str::FromStr for FaultPlan {
    type Err = String;

    /// `vision:N`, `decoder:N` or `alloc:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("a fault plan is vision:N, decoder:N or alloc:N with N >= 1, got {s:?}");
        let (kind, nth) = s.split_once(':').ok_or_else(bad)?;
        let kind = match kind.trim() {
            "vision" => FaultKind::VisionTower,
            "decoder" => FaultKind::Decoder,
            "alloc" => FaultKind::Alloc,
            _ => return Err(bad()),
        };
        let nth = nth.trim().parse().ok().filter(|&n| n >= 1).ok_or_else(bad)?;
        Ok(FaultPlan { kind, nth })
    }
}

/// Counts operations and fails the planned one.
#[derive(Debug, Default)]
pub struct Faults {
    plan: Option<FaultPlan>,
    seen: u64,
}

impl Faults {
    /// Counts operations from zero under `plan`.
    pub fn new(plan: Option<FaultPlan>) -> Self {
        Faults { plan, seen: 0 }
    }

    /// Counts one operation of `kind` about to allocate `bytes`; the planned one fails (an
    /// allocation as an out-of-memory that reports the ledger).
    pub fn check(&mut self, kind: FaultKind, bytes: u64, ledger: &MemoryLedger) -> Result<(), BackendError> {
        let Some(plan) = self.plan.filter(|p| p.kind == kind) else {
            return Ok(());
        };
        self.seen += 1;
        if self.seen != plan.nth {
            return Ok(());
        }
        Err(match kind {
            FaultKind::Alloc => BackendError::OutOfMemory {
                bytes,
                ledger: ledger_summary(ledger),
            },
            _ => BackendError::Injected(format!("{kind:?} operation {}", plan.nth)),
        })
    }
}

/// `weights 1.20 MiB, kv_cache …`: what the ledger holds now, for out-of-memory messages.
pub fn ledger_summary(ledger: &MemoryLedger) -> String {
    Category::ALL
        .iter()
        .map(|&c| {
            let name = serde_json::to_value(c).ok();
            let name = name.as_ref().and_then(|v| v.as_str()).unwrap_or("?");
            format!("{name} {:.2} MiB", ledger.bytes(c) as f64 / f64::from(1u32 << 20))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse_and_fail_once_at_the_nth_operation() {
        let plan: FaultPlan = "decoder:3".parse().unwrap();
        assert_eq!(
            plan,
            FaultPlan {
                kind: FaultKind::Decoder,
                nth: 3
            }
        );
        for bad in ["decoder", "decoder:0", "gpu:1", "vision:x", ""] {
            assert!(bad.parse::<FaultPlan>().is_err(), "{bad}");
        }
        let ledger = MemoryLedger::new();
        ledger.alloc(Category::KvCache, 3 << 20);
        let mut f = Faults::new(Some(plan));
        let results: Vec<bool> = (0..5)
            .map(|_| {
                f.check(FaultKind::VisionTower, 0, &ledger).unwrap();
                f.check(FaultKind::Decoder, 0, &ledger).is_ok()
            })
            .collect();
        assert_eq!(results, [true, true, false, true, true]);
        let mut f = Faults::new(Some("alloc:1".parse().unwrap()));
        let e = f.check(FaultKind::Alloc, 4096, &ledger).unwrap_err().to_string();
        assert!(e.contains("4096") && e.contains("kv_cache 3.00 MiB"), "{e}");
    }
}
