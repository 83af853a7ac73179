//! The host-memory budget of the request path (`--preprocess-memory-gib`). What a request holds on
//! its way to the engine reserves its bytes here before it holds them: a body as it is read, fetched
//! image bytes as they arrive, each tokenization (estimated from the text's length) and each
//! image's decode and preprocessing (estimated from its header, before a pixel is decoded). While
//! the budget is full the next reservation waits, and past a deadline its request is refused as
//! busy. Reserved bytes show in the memory ledger while they are held: images as staging, the rest
//! as requests.

use kvlens_engine::memory::ledger::{Category, MemoryLedger};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Bytes the request path may hold at once.
#[derive(Debug)]
pub struct PreprocessBudget {
    capacity: u64,
    used: Mutex<u64>,
    /// Wakes threads waiting in [`PreprocessBudget::reserve`].
    freed: Condvar,
    /// Wakes tasks waiting in [`Reserved::grow_to`].
    freed_async: Notify,
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
    category: Category,
    bytes: u64,
}

impl PreprocessBudget {
    /// A budget of `capacity` bytes whose reservations wait at most `wait`.
    pub fn new(capacity: u64, ledger: MemoryLedger, wait: Duration) -> Self {
        PreprocessBudget {
            capacity,
            used: Mutex::new(0),
            freed: Condvar::new(),
            freed_async: Notify::new(),
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

    /// Nothing reserved yet, in `category`: grow it with [`Reserved::grow_to`].
    pub fn empty(&self, category: Category) -> Reserved<'_> {
        Reserved {
            budget: self,
            category,
            bytes: 0,
        }
    }

    fn used(&self) -> std::sync::MutexGuard<'_, u64> {
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `more` bytes for a holder of `own` bytes if they fit, or if the holder would be alone
    /// (a reservation larger than the whole budget waits until it is alone, then goes ahead).
    fn take(used: &mut u64, own: u64, more: u64, capacity: u64) -> bool {
        let fits = *used == own || *used + more <= capacity;
        if fits {
            *used += more;
        }
        fits
    }

    fn busy(&self, used: u64) -> Busy {
        Busy(format!(
            "the request path is at its host-memory budget ({:.0} MiB held of {:.0} MiB, --preprocess-memory-gib) \
             after waiting {} s; retry later",
            used as f64 / f64::from(1u32 << 20),
            self.capacity as f64 / f64::from(1u32 << 20),
            self.wait.as_secs()
        ))
    }

    /// Reserves `bytes` in `category`, blocking the thread while others hold the budget.
    pub fn reserve(&self, category: Category, bytes: u64) -> Result<Reserved<'_>, Busy> {
        let deadline = Instant::now() + self.wait;
        let mut used = self.used();
        while !Self::take(&mut used, 0, bytes, self.capacity) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.busy(*used));
            }
            used = self.freed.wait_timeout(used, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(used);
        self.ledger.alloc(category, bytes);
        Ok(Reserved {
            budget: self,
            category,
            bytes,
        })
    }

    fn release(&self, bytes: u64) {
        *self.used() -= bytes;
        self.freed.notify_all();
        self.freed_async.notify_waiters();
    }
}

impl Reserved<'_> {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Grows the reservation to `bytes`, waiting (without blocking the thread) while others hold
    /// the budget.
    pub async fn grow_to(&mut self, bytes: u64) -> Result<(), Busy> {
        let Some(more) = bytes.checked_sub(self.bytes).filter(|&m| m > 0) else {
            return Ok(());
        };
        let budget = self.budget;
        let deadline = tokio::time::Instant::now() + budget.wait;
        loop {
            let freed = budget.freed_async.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if Self::take_more(budget, self.bytes, more) {
                break;
            }
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                return Err(budget.busy(*budget.used()));
            }
        }
        budget.ledger.alloc(self.category, more);
        self.bytes = bytes;
        Ok(())
    }

    fn take_more(budget: &PreprocessBudget, own: u64, more: u64) -> bool {
        PreprocessBudget::take(&mut budget.used(), own, more, budget.capacity)
    }

    /// Gives back all but `bytes`.
    pub fn shrink_to(&mut self, bytes: u64) {
        if let Some(less) = self.bytes.checked_sub(bytes).filter(|&l| l > 0) {
            self.budget.ledger.free(self.category, less);
            self.budget.release(less);
            self.bytes = bytes;
        }
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.shrink_to(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_wait_for_room_and_give_up_at_the_deadline() {
        let ledger = MemoryLedger::new();
        let budget = PreprocessBudget::new(100, ledger.clone(), Duration::from_millis(50));
        let a = budget.reserve(Category::Staging, 60).unwrap();
        assert_eq!(ledger.bytes(Category::Staging), 60);
        let e = budget.reserve(Category::Staging, 60).unwrap_err();
        assert!(e.0.contains("host-memory budget"), "{e}");
        let b = budget.reserve(Category::Requests, 40).unwrap();
        assert_eq!(ledger.bytes(Category::Requests), 40);
        drop(a);
        // Alone, a reservation larger than the budget still gets through.
        drop(b);
        let big = budget.reserve(Category::Staging, 500).unwrap();
        assert_eq!(ledger.bytes(Category::Staging), 500);
        drop(big);
        assert_eq!(ledger.bytes(Category::Staging), 0);
        assert_eq!(ledger.bytes(Category::Requests), 0);
        // A waiter is woken when room frees.
        let budget = std::sync::Arc::new(PreprocessBudget::new(100, ledger, Duration::from_secs(300)));
        let held = budget.reserve(Category::Staging, 100).unwrap();
        let waiter = {
            let budget = budget.clone();
            std::thread::spawn(move || budget.reserve(Category::Staging, 100).map(|r| r.bytes))
        };
        drop(held);
        assert_eq!(waiter.join().unwrap().unwrap(), 100);
    }

    #[tokio::test]
    async fn a_growing_reservation_waits_for_room_and_shrinks() {
        let ledger = MemoryLedger::new();
        let budget = std::sync::Arc::new(PreprocessBudget::new(100, ledger.clone(), Duration::from_secs(300)));
        let mut body = budget.empty(Category::Requests);
        body.grow_to(30).await.unwrap();
        body.grow_to(20).await.unwrap();
        assert_eq!((body.bytes(), ledger.bytes(Category::Requests)), (30, 30));
        let image = budget.reserve(Category::Staging, 70).unwrap();
        // Full: the body's growth waits until the image is done.
        let grown = {
            let budget = budget.clone();
            tokio::spawn(async move {
                let mut other = budget.empty(Category::Requests);
                other.grow_to(50).await.map(|()| other.bytes())
            })
        };
        tokio::task::yield_now().await;
        assert!(!grown.is_finished());
        drop(image);
        assert_eq!(grown.await.unwrap().unwrap(), 50);
        body.shrink_to(10);
        assert_eq!(ledger.bytes(Category::Requests), 10);
        // Alone, a holder may grow past the budget.
        body.grow_to(500).await.unwrap();
        drop(body);
        assert_eq!(ledger.bytes(Category::Requests), 0);
        // Past the wait it is refused as busy.
        let short = PreprocessBudget::new(100, ledger, Duration::from_millis(20));
        let _held = short.reserve(Category::Staging, 90).unwrap();
        let mut late = short.empty(Category::Requests);
        assert!(late.grow_to(20).await.is_err());
    }
}
