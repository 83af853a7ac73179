//! The runner's side of the block tables (vLLM's `BlockTable` in its `InputBatch`): which row each
//! running request has and the block ids written into it, kept between steps. A step brings only
//! the blocks each request gained since the step before, and the requests that left; the runner
//! writes those blocks into its row on the device and computes the KV slots of the step's tokens
//! from the host copy.

use crate::backend::{TableShape, TableWrite};
use crate::cache::RequestId;
use crate::model::ModelError;
use std::collections::HashMap;

/// Rows of the block tables by request, and the host copy of each row.
#[derive(Debug, Default)]
pub(crate) struct BlockTables {
    row_of: HashMap<RequestId, usize>,
    free: Vec<usize>,
    rows: Vec<Vec<usize>>,
    max_blocks: usize,
}

impl BlockTables {
    /// Every row of `shape` free.
    pub fn new(shape: TableShape) -> Self {
        BlockTables {
            row_of: HashMap::new(),
            free: (0..shape.rows).rev().collect(),
            rows: vec![Vec::new(); shape.rows],
            max_blocks: shape.max_blocks,
        }
    }

    /// Each occupied row with the request in it.
    pub fn holders(&self) -> Vec<(usize, RequestId)> {
        self.row_of.iter().map(|(id, &row)| (row, id.clone())).collect()
    }

    /// Frees the row of a request that finished, was aborted or was preempted (none: nothing).
    pub fn release(&mut self, id: &RequestId) {
        if let Some(row) = self.row_of.remove(id) {
            self.rows[row].clear();
            self.free.push(row);
        }
    }

    /// Appends `blocks`, which start at index `start` of request `id`'s table (0: its table starts
    /// afresh, in a new row if it has none), and returns the write that puts them on the device
    /// and the request's row.
    pub fn extend(
        &mut self,
        id: &RequestId,
        start: usize,
        blocks: &[usize],
    ) -> Result<(TableWrite, usize), ModelError> {
        let row = match self.row_of.get(id) {
            Some(&row) => row,
            None if start == 0 => {
                let row = self.free.pop().ok_or_else(|| {
                    ModelError::Input(format!(
                        "request {id}: all {} block-table rows are in use",
                        self.rows.len()
                    ))
                })?;
                self.row_of.insert(id.clone(), row);
                row
            }
            None => {
                return Err(ModelError::Input(format!(
                    "request {id}: blocks from index {start} of a table the runner never had"
                )))
            }
        };
        let table = &mut self.rows[row];
        if start == 0 {
            table.clear();
        }
        if start != table.len() || start + blocks.len() > self.max_blocks {
            return Err(ModelError::Input(format!(
                "request {id}: blocks {start}..{} for a table row of {} (at most {})",
                start + blocks.len(),
                table.len(),
                self.max_blocks
            )));
        }
        table.extend_from_slice(blocks);
        let write = TableWrite {
            row,
            col: start,
            blocks: blocks.to_vec(),
        };
        Ok((write, row))
    }

    /// The block ids of a row.
    pub fn row(&self, row: usize) -> &[usize] {
        &self.rows[row]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_grow_by_the_new_blocks_and_come_back_when_released() {
        let mut t = BlockTables::new(TableShape { rows: 2, max_blocks: 3 });
        let (a, b, c) = ("a".into(), "b".into(), "c".into());
        let (w, row_a) = t.extend(&a, 0, &[5, 6]).unwrap();
        assert_eq!((w.row, w.col, w.blocks), (row_a, 0, vec![5, 6]));
        let (w, _) = t.extend(&a, 2, &[7]).unwrap();
        assert_eq!((w.col, w.blocks), (2, vec![7]));
        assert_eq!(t.row(row_a), [5, 6, 7]);
        assert!(t.extend(&a, 3, &[8]).is_err(), "a row holds 3 blocks");
        assert!(t.extend(&a, 1, &[8]).is_err(), "blocks must continue the table");
        assert!(t.extend(&c, 1, &[1]).is_err(), "a table the runner never had");
        let (_, row_b) = t.extend(&b, 0, &[1]).unwrap();
        assert_ne!(row_a, row_b);
        assert!(t.extend(&c, 0, &[2]).is_err(), "both rows are in use");
        t.release(&a);
        let (_, row_c) = t.extend(&c, 0, &[2]).unwrap();
        assert_eq!(row_c, row_a, "a released row is reused");
        assert_eq!(t.row(row_c), [2]);
        // A table that starts afresh (a preempted request readmitted) replaces the row's blocks.
        let (w, row) = t.extend(&c, 0, &[3, 4]).unwrap();
        assert_eq!((row, w.col), (row_c, 0));
        assert_eq!(t.row(row_c), [3, 4]);
    }
}
