//! The one asynchronous operation: reading a tensor back to the host. A GPU backend's copy
//! completes after the device has run everything recorded before it; in the browser that happens
//! only once control is back in the event loop, so the read is a future that the browser awaits
//! and native callers block on with [`block_on`].

use super::BResult;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

/// Host floats of a tensor, once the device has produced them.
pub type Readback = Pin<Box<dyn Future<Output = BResult<Vec<f32>>>>>;

/// A read that is already complete (the CPU backend's).
pub fn ready(data: BResult<Vec<f32>>) -> Readback {
    Box::pin(std::future::ready(data))
}

/// Wakes the thread that waits in [`block_on`].
struct Unpark(Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on this thread, parking while it is pending. Native callers drive
/// the engine's asynchronous step with it; a future that is ready at once (every CPU read) never
/// parks, so this also works on wasm32 for the CPU backend.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Pending until another thread sets the flag and wakes it.
    struct Later {
        done: Arc<AtomicBool>,
        started: bool,
    }

    impl Future for Later {
        type Output = u32;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
            if self.done.load(Ordering::SeqCst) {
                return Poll::Ready(7);
            }
            if !self.started {
                self.started = true;
                let (done, waker) = (self.done.clone(), cx.waker().clone());
                std::thread::spawn(move || {
                    done.store(true, Ordering::SeqCst);
                    waker.wake();
                });
            }
            Poll::Pending
        }
    }

    #[test]
    fn block_on_waits_for_a_wake_from_elsewhere() {
        let done = Arc::new(AtomicBool::new(false));
        assert_eq!(block_on(Later { done, started: false }), 7);
        assert_eq!(block_on(ready(Ok(vec![1.0]))).unwrap(), vec![1.0]);
    }
}
