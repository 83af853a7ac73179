//! Rows of the CPU products computed by partners: in the tab, helper Web Workers, each with its own
//! wasm memory (Rust's wasm threads need a nightly toolchain, so the engine's thread pool is one
//! thread there) holding a copy of its share of every matrix's rows. A product starts the partners
//! on their rows, computes the first rows on the calling thread meanwhile, then takes theirs.
//!
//! The caller (the app) installs the partners on the thread that runs the engine; natively there
//! are none and the products run on candle's pool as before. The engine starts no threads itself.

use crate::arch::ggml::GgmlType;
use std::cell::RefCell;
use std::rc::Rc;

/// Somewhere else to compute some rows of the CPU products, with a copy of those rows.
pub trait RowPartner {
    /// Takes a copy of `rows` rows of `cols` values as a GGUF file stores them (`ggml`, `bytes`);
    /// returns the partner's id for them.
    fn adopt(&self, ggml: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<u32, String>;
    /// Starts the products `x · wᵀ` of `x [m, cols]` with the matrices `ids`, all `cols` wide.
    fn start(&self, ids: &[u32], x: &[f32], m: usize) -> Result<(), String>;
    /// Waits for the products [`RowPartner::start`] began: `[m, rows]` for each of its ids.
    fn finish(&self) -> Result<Vec<Vec<f32>>, String>;
    /// Drops the matrix `id`.
    fn forget(&self, id: u32);
    /// The most values one product's activations and results may take (`m · (cols + rows)`); a
    /// larger product is sent in slices of activation rows.
    fn capacity(&self) -> usize;
}

thread_local! {
    static PARTNERS: RefCell<Vec<Rc<dyn RowPartner>>> = const { RefCell::new(Vec::new()) };
    /// Bytes of matrix rows the partners hold.
    static SHARED_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Bytes of matrix rows this thread's partners hold copies of (memory outside the engine's
/// ledger: in the tab, the helper workers' own wasm memories).
pub fn shared_bytes() -> u64 {
    SHARED_BYTES.get()
}

/// Makes `partners` compute their shares of the products this thread runs from now on (none:
/// every row here). Matrices already shared keep their partners.
pub fn install(partners: Vec<Rc<dyn RowPartner>>) {
    PARTNERS.with_borrow_mut(|p| *p = partners);
}

/// The partners of this thread.
pub(super) fn partners() -> Vec<Rc<dyn RowPartner>> {
    PARTNERS.with_borrow(|p| p.clone())
}

/// Matrices of fewer rows stay whole here: their products are shorter than a partner's round trip.
pub(super) const MIN_SHARED_ROWS: usize = 256;

/// Where a matrix's rows are computed: rows `0..ends[0]` here, rows `ends[i]..ends[i + 1]` by
/// partner `i` (of this thread's [`partners`], as installed when it was shared), as its `ids[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Shares {
    pub ends: Vec<usize>,
    pub ids: Vec<u32>,
    /// Bytes the partners hold.
    pub bytes: u64,
}

impl Shares {
    /// Rows computed here.
    pub fn here(&self) -> usize {
        self.ends[0]
    }

    /// Partner `i`'s rows.
    pub fn of(&self, i: usize) -> std::ops::Range<usize> {
        self.ends[i]..self.ends[i + 1]
    }
}

/// The ends of `parts` even shares of `rows` rows, each on a multiple of `align`.
pub(super) fn share_ends(rows: usize, parts: usize, align: usize) -> Vec<usize> {
    let align = align.max(1);
    (1..=parts)
        .map(|i| {
            if i == parts {
                rows
            } else {
                (rows * i / parts / align * align).min(rows)
            }
        })
        .collect()
}

/// Counts `bytes` more held by the partners.
pub(super) fn adopted(bytes: u64) {
    SHARED_BYTES.set(SHARED_BYTES.get() + bytes);
}

/// Tells the partners to drop their copies of a matrix.
pub(super) fn forget(shares: &Shares) {
    SHARED_BYTES.set(SHARED_BYTES.get().saturating_sub(shares.bytes));
    let partners = partners();
    for (p, &id) in partners.iter().zip(&shares.ids) {
        p.forget(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_rows_in_aligned_pieces() {
        assert_eq!(share_ends(1000, 2, 32), [480, 1000]);
        assert_eq!(share_ends(1024, 4, 16), [256, 512, 768, 1024]);
        assert_eq!(share_ends(10, 3, 1), [3, 6, 10]);
        let s = Shares {
            ends: vec![480, 1000],
            ids: vec![7],
            bytes: 0,
        };
        assert_eq!((s.here(), s.of(0)), (480, 480..1000));
    }
}
