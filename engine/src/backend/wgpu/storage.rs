//! Device buffers, each recorded in the ledger for as long as it exists, and the pool that reuses
//! activation buffers across steps (a pooled buffer stays counted as activations while the pool
//! keeps it).

use crate::memory::ledger::{Category, Held, MemoryLedger};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Usage of every compute buffer: bound as storage, copied from and to.
pub(super) const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Free buffers the pool may keep, in bytes, before it destroys what comes back.
const POOL_FREE_BYTES: u64 = 256 << 20;

/// A device buffer and its ledger entry; an activation buffer goes back to its pool when dropped.
/// `device_bytes` counts every buffer from its creation to its destruction.
#[derive(Debug)]
pub(super) struct Buf {
    pub buffer: wgpu::Buffer,
    held: Option<Held>,
    pool: Option<Arc<Pool>>,
    device_bytes: Arc<AtomicU64>,
}

impl Buf {
    /// A buffer outside the pool, recorded under `category`.
    pub fn new(buffer: wgpu::Buffer, ledger: &MemoryLedger, category: Category, device_bytes: Arc<AtomicU64>) -> Self {
        let held = ledger.hold(category, buffer.size());
        Buf {
            buffer,
            held: Some(held),
            pool: None,
            device_bytes,
        }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            // The buffer, its ledger entry and its count move to the pool's free list.
            pool.put(Buf {
                buffer: self.buffer.clone(),
                held: self.held.take(),
                pool: None,
                device_bytes: self.device_bytes.clone(),
            });
            return;
        }
        self.device_bytes.fetch_sub(self.buffer.size(), Ordering::Relaxed);
    }
}

/// Activation buffers by size, reused across operations and steps.
#[derive(Debug, Default)]
pub(super) struct Pool {
    free: Mutex<HashMap<u64, Vec<Buf>>>,
}

/// The size class of a request: a multiple of 256 bytes and of a sixteenth of its power of two, so
/// that steps of slightly different lengths reuse the same buffers (at most 12.5 % larger).
pub(super) fn size_class(bytes: u64) -> u64 {
    let bytes = bytes.max(4);
    let grain = (bytes.next_power_of_two() / 16).max(256);
    bytes.div_ceil(grain) * grain
}

impl Pool {
    /// A free buffer of exactly `size` bytes, if the pool has one.
    pub fn take(self: &Arc<Self>, size: u64) -> Option<Buf> {
        let mut buf = self
            .free
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_mut(&size)?
            .pop()?;
        buf.pool = Some(self.clone());
        Some(buf)
    }

    /// Wraps a new activation buffer that returns here when dropped.
    pub fn adopt(self: &Arc<Self>, buffer: wgpu::Buffer, ledger: &MemoryLedger, device_bytes: Arc<AtomicU64>) -> Buf {
        let mut buf = Buf::new(buffer, ledger, Category::Activations, device_bytes);
        buf.pool = Some(self.clone());
        buf
    }

    /// Keeps a free buffer, or destroys it when the pool already keeps enough.
    fn put(&self, buf: Buf) {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let kept: u64 = free.iter().map(|(size, v)| size * v.len() as u64).sum();
        if kept + buf.buffer.size() <= POOL_FREE_BYTES {
            free.entry(buf.buffer.size()).or_default().push(buf);
        }
    }

    /// Destroys every free buffer (after an out-of-memory, before retrying).
    pub fn clear(&self) {
        let drained: Vec<Buf> = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            free.drain().flat_map(|(_, v)| v).collect()
        };
        drop(drained);
    }

    /// Free buffers held, and their bytes.
    pub fn free_buffers(&self) -> (usize, u64) {
        let free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.iter()
            .fold((0, 0), |(n, b), (size, v)| (n + v.len(), b + size * v.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::size_class;

    #[test]
    fn size_classes_round_up_by_at_most_an_eighth() {
        assert_eq!(size_class(1), 256);
        assert_eq!(size_class(256), 256);
        assert_eq!(size_class(257), 512);
        assert_eq!(size_class(4097), 4608);
        assert_eq!(size_class(5000), 5120);
        for bytes in [3000u64, 70_001, 1 << 20, (1 << 20) + 1, 123_456_789] {
            let c = size_class(bytes);
            assert!(c >= bytes && c as f64 <= bytes as f64 * 1.125 + 256.0, "{bytes} -> {c}");
            assert_eq!(size_class(c), c, "a class is its own class");
        }
    }
}
