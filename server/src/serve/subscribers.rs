//! The memory stream's subscribers (`GET /v1/memory/stream`), capped apart from other connections
//! (`--max-stream-subscribers`): past the cap a new subscriber closes the oldest subscriber's
//! connection, whether or not that one still reads, so subscribers can neither fill the
//! connection limit nor pile up.

use super::listener::Conn;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// The open subscriptions, oldest first.
#[derive(Debug)]
pub struct Subscribers {
    cap: usize,
    open: Mutex<(u64, VecDeque<(u64, Conn)>)>,
}

/// One subscription; it leaves the list when dropped (its stream ended or its connection closed).
#[derive(Debug)]
pub struct Subscription {
    list: Arc<Subscribers>,
    id: u64,
}

impl Subscribers {
    /// At most `cap` subscriptions at once.
    pub fn new(cap: usize) -> Self {
        Subscribers {
            cap: cap.max(1),
            open: Mutex::new((0, VecDeque::new())),
        }
    }

    /// Adds a subscriber on `conn`, closing the oldest subscribers' connections past the cap.
    pub fn join(self: &Arc<Self>, conn: Conn) -> Subscription {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        open.0 += 1;
        let id = open.0;
        open.1.push_back((id, conn));
        while open.1.len() > self.cap {
            if let Some((_, oldest)) = open.1.pop_front() {
                oldest.close();
            }
        }
        Subscription { list: self.clone(), id }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut open = self.list.open.lock().unwrap_or_else(|p| p.into_inner());
        open.1.retain(|(id, _)| *id != self.id);
    }
}
