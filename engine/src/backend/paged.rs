//! A step's attention metadata checked and flattened once on the host: every backend checks its
//! [`PagedBatch`] and its block-table writes here, and the backends whose kernels read flat arrays
//! (wgpu, cuda) upload the [`PagedRows`] and the segments' rows made here.

use super::{BResult, BackendError, KvLayout, PagedBatch, TableWrite};

fn count(n: usize, what: &str) -> BResult<u32> {
    u32::try_from(n).map_err(|_| BackendError::Shape(format!("{what}: {n} is more than a kernel can index")))
}

/// The vision tower's segments as the kernel reads them: `(start, len)` of each row's segment.
pub fn segment_rows(segments: &[(usize, usize)]) -> BResult<Vec<u32>> {
    let mut rows = Vec::new();
    let mut next = 0;
    for &(start, len) in segments {
        if start != next {
            return Err(BackendError::Shape(format!(
                "segments must cover the rows in order: one starts at {start}, expected {next}"
            )));
        }
        next += len;
        for _ in 0..len {
            rows.push(count(start, "segment start")?);
            rows.push(count(len, "segment length")?);
        }
    }
    Ok(rows)
}

/// Block-table writes as flat `(offset, block ids)` into the tables of `layout`, each checked to
/// stay inside its row and name a block of the cache.
pub fn check_writes(layout: &KvLayout, writes: &[TableWrite]) -> BResult<Vec<(usize, Vec<u32>)>> {
    let shape = layout.tables;
    writes
        .iter()
        .map(|w| {
            if w.row >= shape.rows || w.col + w.blocks.len() > shape.max_blocks {
                return Err(BackendError::Shape(format!(
                    "block-table write of {} blocks at row {}, column {} outside {} rows of {}",
                    w.blocks.len(),
                    w.row,
                    w.col,
                    shape.rows,
                    shape.max_blocks
                )));
            }
            if let Some(bad) = w.blocks.iter().find(|&&b| b >= layout.num_blocks) {
                return Err(BackendError::Shape(format!(
                    "block {bad} outside the cache's {}",
                    layout.num_blocks
                )));
            }
            let ids = w.blocks.iter().map(|&b| count(b, "block")).collect::<BResult<_>>()?;
            Ok((w.row * shape.max_blocks + w.col, ids))
        })
        .collect()
}

/// A step's paged-attention metadata as the kernels read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedRows {
    /// KV slot of each query row.
    pub slots: Vec<u32>,
    /// Per query row: the offset of its sequence's row in the block tables, and the number of
    /// keys it sees (its position + 1), as the segments' rows are (start, length).
    pub meta: Vec<u32>,
    /// Query rows.
    pub rows: usize,
}

impl PagedBatch {
    /// Checks the batch against its cache's layout: every slot inside it, the sequences covering
    /// the query rows in order, each inside the blocks written into its row of the block tables
    /// (whose ids [`check_writes`] checked), one slot per query row.
    pub fn check(&self) -> BResult<()> {
        let (block_size, num_blocks) = (self.layout.block_size, self.layout.num_blocks);
        let capacity = num_blocks * block_size;
        if let Some(bad) = self.slots.iter().find(|&&s| s >= capacity) {
            return Err(BackendError::Shape(format!(
                "KV slot {bad} outside the cache's {capacity}"
            )));
        }
        let mut rows = 0;
        let tables = self.layout.tables;
        for s in &self.seqs {
            if s.table_row >= tables.rows || s.table_len > tables.max_blocks {
                return Err(BackendError::Shape(format!(
                    "block-table row {} of {} blocks outside {} rows of {}",
                    s.table_row, s.table_len, tables.rows, tables.max_blocks
                )));
            }
            if s.query_start != rows {
                return Err(BackendError::Shape(
                    "paged_attention: sequences must cover the query rows in order".into(),
                ));
            }
            if s.query_len > s.context_len || s.context_len.div_ceil(block_size.max(1)) > s.table_len {
                return Err(BackendError::Shape(
                    "paged_attention: sequence outside its block table".into(),
                ));
            }
            rows += s.query_len;
        }
        if self.slots.len() != rows {
            return Err(BackendError::Shape(format!(
                "{} KV slots for {rows} query rows",
                self.slots.len()
            )));
        }
        Ok(())
    }

    /// [`Self::check`]s the batch and flattens it for kernels that read flat arrays.
    pub fn flatten(&self) -> BResult<PagedRows> {
        self.check()?;
        let mut out = PagedRows {
            slots: self.slots.iter().map(|&s| count(s, "slot")).collect::<BResult<_>>()?,
            meta: Vec::new(),
            rows: 0,
        };
        for s in &self.seqs {
            let offset = count(s.table_row * self.layout.tables.max_blocks, "block tables")?;
            for i in 0..s.query_len {
                out.meta.push(offset);
                out.meta.push(count(s.context_len - s.query_len + i + 1, "context")?);
            }
            out.rows += s.query_len;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{KvLayout, PagedSeq, TableShape};

    #[test]
    fn segments_give_each_row_its_segment() {
        assert_eq!(segment_rows(&[(0, 2), (2, 1)]).unwrap(), [0, 2, 0, 2, 2, 1]);
        assert!(segment_rows(&[(1, 2)]).is_err());
    }

    fn layout() -> KvLayout {
        KvLayout {
            layers: 1,
            num_blocks: 4,
            block_size: 4,
            kv_heads: 1,
            head_dim: 1,
            tables: TableShape { rows: 3, max_blocks: 2 },
        }
    }

    #[test]
    fn paged_rows_give_each_query_its_context_and_table_row() {
        let batch = PagedBatch {
            layout: layout(),
            slots: vec![12, 13, 5],
            seqs: vec![
                PagedSeq {
                    query_start: 0,
                    query_len: 2,
                    context_len: 6,
                    table_row: 2,
                    table_len: 2,
                },
                PagedSeq {
                    query_start: 2,
                    query_len: 1,
                    context_len: 2,
                    table_row: 0,
                    table_len: 1,
                },
            ],
        };
        let p = batch.flatten().unwrap();
        assert_eq!(p.rows, 3);
        assert_eq!(p.slots, [12, 13, 5]);
        // Rows 0 and 1 are positions 4 and 5 of a context of 6 in table row 2 (offset 4); row 2
        // is position 1 in table row 0.
        assert_eq!(p.meta, [4, 5, 4, 6, 0, 2]);
        let mut bad = batch.clone();
        bad.seqs[1].context_len = 5;
        assert!(bad.flatten().is_err(), "5 tokens need 2 blocks of 4");
        bad = batch.clone();
        bad.seqs[1].query_start = 3;
        assert!(bad.flatten().is_err());
        bad = batch.clone();
        bad.seqs[0].table_row = 3;
        assert!(bad.flatten().is_err(), "3 rows of block tables");
        bad = batch.clone();
        bad.layout.num_blocks = 3;
        assert!(bad.flatten().is_err(), "slots 12, 13 are outside 3 blocks");
        bad = batch;
        bad.slots.pop();
        assert!(bad.flatten().is_err(), "every query row needs its slot");
    }

    #[test]
    fn table_writes_stay_inside_their_row_and_the_cache() {
        let write = |row, col, blocks: &[usize]| TableWrite {
            row,
            col,
            blocks: blocks.to_vec(),
        };
        let flat = check_writes(&layout(), &[write(2, 1, &[3]), write(0, 0, &[1, 2])]).unwrap();
        assert_eq!(flat, [(5, vec![3]), (0, vec![1, 2])]);
        assert!(
            check_writes(&layout(), &[write(0, 1, &[1, 2])]).is_err(),
            "past the row's end"
        );
        assert!(check_writes(&layout(), &[write(3, 0, &[1])]).is_err(), "no fourth row");
        assert!(check_writes(&layout(), &[write(0, 0, &[4])]).is_err(), "no block 4");
    }
}
