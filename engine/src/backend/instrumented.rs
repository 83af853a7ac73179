//! A backend wrapper for tests: it counts what crosses from the host to the device and can hold
//! every read back until the test releases it, the way a GPU read completes only when the browser's
//! event loop runs. Every operation is the wrapped backend's.

use super::{
    Activation, BResult, Backend, DeltaNetInput, KvLayout, PagedBatch, RawTensor, Readback, StateLayout, StateSeq,
    TableWrite,
};
use crate::memory::ledger::{Category, MemoryLedger};
use crate::sample::DeviceSampling;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// Transfers counted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Host data handed over: [`Backend::upload`], [`Backend::upload_paged`],
    /// [`Backend::upload_segments`], and the per-row settings of [`Backend::sample`].
    pub uploads: u64,
    /// Operations that take a host index list (embedding ids, row gathers and scatters).
    pub index_lists: u64,
    /// Reads queued.
    pub reads: u64,
    /// Floats those reads bring back.
    pub read_floats: u64,
    /// Block ids written into the block tables ([`Backend::write_block_tables`]).
    pub table_ids: u64,
}

#[derive(Debug, Default)]
struct State {
    transfers: Transfers,
    holding: bool,
    /// Reads with a ticket below this have been released.
    released: u64,
    wakers: Vec<Waker>,
}

/// `B` with counted transfers and reads that may wait for [`Instrumented::release_reads`].
#[derive(Debug, Clone)]
pub struct Instrumented<B> {
    inner: B,
    state: Arc<Mutex<State>>,
}

impl<B: Backend> Instrumented<B> {
    /// Wraps `inner`; reads complete as the inner backend's do until [`Self::hold_reads`].
    pub fn new(inner: B) -> Self {
        Instrumented {
            inner,
            state: Arc::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// From now on every read stays pending until [`Self::release_reads`].
    pub fn hold_reads(&self) {
        self.state().holding = true;
    }

    /// Reads queued and not yet released.
    pub fn pending_reads(&self) -> u64 {
        let s = self.state();
        s.transfers.reads - s.released
    }

    /// Lets every read queued so far complete and wakes whoever waits on them.
    pub fn release_reads(&self) {
        let mut s = self.state();
        s.released = s.transfers.reads;
        for w in s.wakers.drain(..) {
            w.wake();
        }
    }

    /// Transfers counted so far.
    pub fn transfers(&self) -> Transfers {
        self.state().transfers
    }

    fn upload_counted(&self) {
        self.state().transfers.uploads += 1;
    }

    fn index_list(&self) {
        self.state().transfers.index_lists += 1;
    }
}

/// A read that waits for its release, then for the inner read.
struct HeldRead {
    ticket: u64,
    state: Arc<Mutex<State>>,
    inner: Readback,
}

impl Future for HeldRead {
    type Output = BResult<Vec<f32>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if self.ticket >= s.released {
                s.wakers.push(cx.waker().clone());
                return Poll::Pending;
            }
        }
        self.inner.as_mut().poll(cx)
    }
}

impl<B: Backend> Backend for Instrumented<B> {
    type Tensor = B::Tensor;
    type Weight = B::Weight;
    type KvCache = B::KvCache;
    type BlockTables = B::BlockTables;
    type Paged = B::Paged;
    type Segments = B::Segments;
    type StateCache = B::StateCache;

    const CAPABILITIES: super::Capabilities = B::CAPABILITIES;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn device_memory(&self) -> Option<BResult<super::DeviceMemory>> {
        self.inner.device_memory()
    }
    fn ledger(&self) -> &MemoryLedger {
        self.inner.ledger()
    }
    fn load_weight(&self, raw: RawTensor<'_>, usage: super::MatrixUse) -> BResult<Self::Weight> {
        self.inner.load_weight(raw, usage)
    }
    fn load_tensor(&self, raw: RawTensor<'_>) -> BResult<Self::Tensor> {
        self.inner.load_tensor(raw)
    }
    fn upload(&self, data: Vec<f32>, shape: &[usize]) -> BResult<Self::Tensor> {
        self.upload_counted();
        self.inner.upload(data, shape)
    }
    fn keep(&self, t: &Self::Tensor, category: Category) -> Self::Tensor {
        self.inner.keep(t, category)
    }
    fn read(&self, t: &Self::Tensor) -> Readback {
        let inner = self.inner.read(t);
        let floats: usize = self.inner.shape(t).iter().product();
        let mut s = self.state();
        let ticket = s.transfers.reads;
        s.transfers.reads += 1;
        s.transfers.read_floats += floats as u64;
        if !s.holding {
            s.released = s.transfers.reads;
        }
        Box::pin(HeldRead {
            ticket,
            state: self.state.clone(),
            inner,
        })
    }
    fn alloc_block_tables(&self, layout: KvLayout) -> BResult<Self::BlockTables> {
        self.inner.alloc_block_tables(layout)
    }
    fn write_block_tables(&self, tables: &mut Self::BlockTables, writes: &[TableWrite]) -> BResult<()> {
        let ids: usize = writes.iter().map(|w| w.blocks.len()).sum();
        self.state().transfers.table_ids += ids as u64;
        self.inner.write_block_tables(tables, writes)
    }
    fn upload_paged(&self, batch: PagedBatch, tables: &Self::BlockTables) -> BResult<Self::Paged> {
        self.upload_counted();
        self.inner.upload_paged(batch, tables)
    }
    fn upload_segments(&self, segments: &[(usize, usize)]) -> BResult<Self::Segments> {
        self.upload_counted();
        self.inner.upload_segments(segments)
    }
    fn shape(&self, t: &Self::Tensor) -> Vec<usize> {
        self.inner.shape(t)
    }
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, b: Option<&Self::Tensor>) -> BResult<Self::Tensor> {
        self.inner.linear(x, w, b)
    }
    fn linears(&self, x: &Self::Tensor, ws: &[(&Self::Weight, Option<&Self::Tensor>)]) -> BResult<Vec<Self::Tensor>> {
        self.inner.linears(x, ws)
    }
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> BResult<Self::Tensor> {
        self.index_list();
        self.inner.embedding(table, ids)
    }
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Tensor, eps: f64) -> BResult<Self::Tensor> {
        self.inner.rms_norm(x, w, eps)
    }
    fn layer_norm(&self, x: &Self::Tensor, w: &Self::Tensor, b: &Self::Tensor, eps: f64) -> BResult<Self::Tensor> {
        self.inner.layer_norm(x, w, b, eps)
    }
    fn activate(&self, x: &Self::Tensor, act: Activation) -> BResult<Self::Tensor> {
        self.inner.activate(x, act)
    }
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> BResult<Self::Tensor> {
        self.inner.silu_mul(gate, up)
    }
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> BResult<Self::Tensor> {
        self.inner.add(a, b)
    }
    fn add_rms_norm(
        &self,
        x: &Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Tensor,
        eps: f64,
    ) -> BResult<(Self::Tensor, Self::Tensor)> {
        self.inner.add_rms_norm(x, y, w, eps)
    }
    fn norm_rope(
        &self,
        x: &Self::Tensor,
        w: Option<&Self::Tensor>,
        eps: f64,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        head_dim: usize,
    ) -> BResult<Self::Tensor> {
        self.inner.norm_rope(x, w, eps, cos, sin, head_dim)
    }
    fn swiglu(&self, x: &Self::Tensor, gate: &Self::Weight, up: &Self::Weight) -> BResult<Self::Tensor> {
        self.inner.swiglu(x, gate, up)
    }
    fn rope(&self, x: &Self::Tensor, cos: &Self::Tensor, sin: &Self::Tensor) -> BResult<Self::Tensor> {
        self.inner.rope(x, cos, sin)
    }
    fn rope_partial(
        &self,
        x: &Self::Tensor,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        head_dim: usize,
    ) -> BResult<Self::Tensor> {
        self.inner.rope_partial(x, cos, sin, head_dim)
    }
    fn sigmoid_mul(&self, gate: &Self::Tensor, x: &Self::Tensor) -> BResult<Self::Tensor> {
        self.inner.sigmoid_mul(gate, x)
    }
    fn alloc_states(&self, layout: StateLayout) -> BResult<Self::StateCache> {
        self.inner.alloc_states(layout)
    }
    fn gated_delta_net(
        &self,
        states: &mut Self::StateCache,
        layer: usize,
        input: DeltaNetInput<'_, Self::Tensor>,
        seqs: &[StateSeq],
    ) -> BResult<Self::Tensor> {
        self.inner.gated_delta_net(states, layer, input, seqs)
    }
    fn narrow_cols(&self, x: &Self::Tensor, start: usize, len: usize) -> BResult<Self::Tensor> {
        self.inner.narrow_cols(x, start, len)
    }
    fn reshape(&self, x: &Self::Tensor, rows: usize, cols: usize) -> BResult<Self::Tensor> {
        self.inner.reshape(x, rows, cols)
    }
    fn gather_rows(&self, x: &Self::Tensor, idx: &[usize]) -> BResult<Self::Tensor> {
        self.index_list();
        self.inner.gather_rows(x, idx)
    }
    fn scale_rows(&self, x: &Self::Tensor, scales: &[f32]) -> BResult<Self::Tensor> {
        self.upload_counted();
        self.inner.scale_rows(x, scales)
    }
    fn scatter_rows(&self, x: &Self::Tensor, idx: &[usize], src: &Self::Tensor, add: bool) -> BResult<Self::Tensor> {
        self.index_list();
        self.inner.scatter_rows(x, idx, src, add)
    }
    fn concat_rows(&self, parts: &[Self::Tensor]) -> BResult<Self::Tensor> {
        self.inner.concat_rows(parts)
    }
    fn segment_attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        heads: usize,
        segments: &Self::Segments,
    ) -> BResult<Self::Tensor> {
        self.inner.segment_attention(q, k, v, heads, segments)
    }
    fn alloc_kv(&self, layout: KvLayout) -> BResult<Self::KvCache> {
        self.inner.alloc_kv(layout)
    }
    fn write_kv(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        k: &Self::Tensor,
        v: &Self::Tensor,
        batch: &Self::Paged,
    ) -> BResult<()> {
        self.inner.write_kv(cache, layer, k, v, batch)
    }
    fn paged_attention(
        &self,
        cache: &Self::KvCache,
        layer: usize,
        q: &Self::Tensor,
        heads: usize,
        batch: &Self::Paged,
    ) -> BResult<Self::Tensor> {
        self.inner.paged_attention(cache, layer, q, heads, batch)
    }
    fn sample(&self, logits: &Self::Tensor, rows: &[DeviceSampling]) -> BResult<Self::Tensor> {
        self.upload_counted();
        self.inner.sample(logits, rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::block_on;
    use crate::backend::cpu::CpuBackend;
    use std::task::Waker;

    crate::backend_suite!(Instrumented::new(CpuBackend::default()));
    crate::backend_suite!(hybrid; Instrumented::new(CpuBackend::default()));

    #[test]
    fn held_reads_wait_for_their_release() {
        let b = Instrumented::new(CpuBackend::default());
        let x = b.upload(vec![1.0, 2.0], &[1, 2]).unwrap();
        b.hold_reads();
        let mut read = b.read(&x);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(read.as_mut().poll(&mut cx).is_pending());
        assert_eq!(b.pending_reads(), 1);
        b.release_reads();
        assert_eq!(block_on(read).unwrap(), vec![1.0, 2.0]);
        assert_eq!(
            b.transfers(),
            Transfers {
                uploads: 1,
                index_lists: 0,
                reads: 1,
                read_floats: 2,
                table_ids: 0,
            }
        );
    }
}
