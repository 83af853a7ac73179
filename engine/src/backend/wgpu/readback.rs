//! A tensor's copy to the host as a future: the staging buffer is mapped once the device has run
//! everything submitted before it. Natively the future waits on the device when polled; in the
//! browser the map callback wakes it from the event loop.

use super::storage::Buf;
use super::WgpuBackend;
use crate::backend::{BResult, BackendError};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

#[derive(Default)]
struct MapState {
    done: Option<Result<(), wgpu::BufferAsyncError>>,
    waker: Option<Waker>,
}

/// A read in flight.
pub(super) struct Pending {
    staging: Buf,
    floats: usize,
    backend: WgpuBackend,
    state: Arc<Mutex<MapState>>,
}

impl Pending {
    /// Maps `staging` (already copied into and submitted) for reading `floats` values.
    pub fn start(staging: Buf, floats: usize, backend: WgpuBackend) -> Self {
        let state: Arc<Mutex<MapState>> = Arc::default();
        let sink = state.clone();
        staging.buffer.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
            s.done = Some(r);
            if let Some(w) = s.waker.take() {
                w.wake();
            }
        });
        Pending {
            staging,
            floats,
            backend,
            state,
        }
    }

    fn finish(&self, mapped: Result<(), wgpu::BufferAsyncError>) -> BResult<Vec<f32>> {
        self.backend.device_error()?;
        mapped.map_err(|e| BackendError::Library(format!("reading back a tensor: {e}").into()))?;
        let data = {
            let view = self
                .staging
                .buffer
                .slice(..)
                .get_mapped_range()
                .map_err(|e| BackendError::Library(format!("reading back a tensor: {e}").into()))?;
            bytemuck::cast_slice::<u8, f32>(&view[..self.floats * 4]).to_vec()
        };
        self.staging.buffer.unmap();
        Ok(data)
    }
}

impl Future for Pending {
    type Output = BResult<Vec<f32>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        #[cfg(not(target_arch = "wasm32"))]
        {
            let waiting = this.state.lock().unwrap_or_else(|p| p.into_inner()).done.is_none();
            if waiting {
                if let Err(e) = this.backend.inner.gpu.device.poll(wgpu::PollType::wait_indefinitely()) {
                    return Poll::Ready(Err(BackendError::Library(
                        format!("waiting for the device: {e}").into(),
                    )));
                }
            }
        }
        let mut s = this.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.done.take() {
            Some(mapped) => {
                drop(s);
                Poll::Ready(this.finish(mapped))
            }
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}
