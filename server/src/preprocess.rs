//! The host-memory budget of image preprocessing. Each image reserves what decoding and
//! preprocessing it will hold (estimated from its header) before a pixel is decoded; while the
//! budget is full the next image waits, and past a deadline its request is refused as busy. The
//! reserved bytes show in the memory ledger as staging while they are held.

use kvlens_engine::memory::ledger::{Category, Held, MemoryLedger};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Bytes images being preprocessed may hold at once.
#[derive(Debug)]
pub struct PreprocessBudget {
    capacity: u64,
    used: Mutex<u64>,
    freed: Condvar,
    ledger: MemoryLedger,
    wait: Duration,
}

/// The budget was full for longer than the wait: the server is busy, not the request wrong.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Busy(pub String);

/// Bytes reserved in a [`PreprocessBudget`] (and recorded in the ledger) until dropped.
#[derive(Debug)]
pub struct Reserved<'a> {
    budget: &'a PreprocessBudget,
    bytes: u64,
    _ledger: Held,
}

impl PreprocessBudget {
    /// A budget of `capacity` bytes whose reservations wait at most `wait`.
    pub fn new(capacity: u64, ledger: MemoryLedger, wait: Duration) -> Self {
        PreprocessBudget {
            capacity,
            used: Mutex::new(0),
            freed: Condvar::new(),
            ledger,
            wait,
        }
    }

    /// Its size in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// A budget like this one, of `capacity` bytes.
    pub fn with_capacity(&self, capacity: u64) -> Self {
        Self::new(capacity, self.ledger.clone(), self.wait)
    }

    /// Reserves `bytes`, waiting while other images hold the budget. An image larger than the
    /// whole budget waits until it is alone.
    pub fn reserve(&self, bytes: u64) -> Result<Reserved<'_>, Busy> {
        let deadline = Instant::now() + self.wait;
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        while *used > 0 && *used + bytes > self.capacity {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Busy(format!(
                    "image preprocessing is at its memory budget ({:.0} MiB held of {:.0} MiB) after waiting {} s; \
                     retry later",
                    *used as f64 / f64::from(1u32 << 20),
                    self.capacity as f64 / f64::from(1u32 << 20),
                    self.wait.as_secs()
                )));
            }
            used = self.freed.wait_timeout(used, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        *used += bytes;
        Ok(Reserved {
            budget: self,
            bytes,
            _ledger: self.ledger.hold(Category::Staging, bytes),
        })
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        let mut used = self.budget.used.lock().unwrap_or_else(|p| p.into_inner());
        *used -= self.bytes;
        self.budget.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_wait_for_room_and_give_up_at_the_deadline() {
        let ledger = MemoryLedger::new();
        let budget = PreprocessBudget::new(100, ledger.clone(), Duration::from_millis(50));
        let a = budget.reserve(60).unwrap();
        assert_eq!(ledger.bytes(Category::Staging), 60);
        let e = budget.reserve(60).unwrap_err();
        assert!(e.0.contains("memory budget"), "{e}");
        let b = budget.reserve(40).unwrap();
        drop(a);
        // Alone, an image larger than the budget still gets through.
        drop(b);
        let big = budget.reserve(500).unwrap();
        assert_eq!(ledger.bytes(Category::Staging), 500);
        drop(big);
        assert_eq!(ledger.bytes(Category::Staging), 0);
        // A waiter is woken when room frees.
        let budget = std::sync::Arc::new(PreprocessBudget::new(100, ledger, Duration::from_secs(300)));
        let held = budget.reserve(100).unwrap();
        let waiter = {
            let budget = budget.clone();
            std::thread::spawn(move || budget.reserve(100).map(|r| r.bytes))
        };
        drop(held);
        assert_eq!(waiter.join().unwrap().unwrap(), 100);
    }
}
