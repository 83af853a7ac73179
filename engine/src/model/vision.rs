//! The vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL: patch embedding as one matmul, 2-D
//! rotary, Qwen2.5-VL window attention, Qwen3-VL's interpolated position embedding and deepstack
//! mergers, and the patch merger, as transformers writes them (`Qwen2VisionTransformerPretrainedModel`,
//! `Qwen2_5_VisionTransformerPretrainedModel`, `Qwen3VLVisionModel` in `modeling_qwen2_vl.py`,
//! `modeling_qwen2_5_vl.py`, `modeling_qwen3_vl.py` under
//! <https://github.com/huggingface/transformers/tree/main/src/transformers/models>).

use super::weights::{Loader, TensorSource};
use super::ModelError;
use crate::arch::config::{ModelConfig, VisionConfig, VisionMlp};
use crate::arch::spec::{Affine, MergerSpec, NormSpec, VisionMlpSpec, VisionSpec};
use crate::backend::{Activation, Backend};

/// A normalisation layer of the vision tower.
#[derive(Debug)]
enum Norm<B: Backend> {
    Layer { w: B::Tensor, b: B::Tensor },
    Rms { w: B::Tensor },
}

impl<B: Backend> Norm<B> {
    fn load<S: TensorSource<B>>(l: &Loader<'_, '_, S, B>, spec: &NormSpec) -> Result<Self, ModelError> {
        Ok(match spec {
            NormSpec::Layer(a) => Norm::Layer {
                w: l.load(&a.weight)?,
                b: l.load(&a.bias)?,
            },
            NormSpec::Rms(w) => Norm::Rms { w: l.load(w)? },
        })
    }

    fn apply(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(match self {
            Norm::Layer { w, b } => be.layer_norm(x, w, b, 1e-6)?,
            Norm::Rms { w } => be.rms_norm(x, w, 1e-6)?,
        })
    }
}

/// A linear layer with bias.
#[derive(Debug)]
struct Linear<B: Backend> {
    w: B::Weight,
    b: B::Tensor,
}

impl<B: Backend> Linear<B> {
    fn load<S: TensorSource<B>>(l: &Loader<'_, '_, S, B>, spec: &Affine) -> Result<Self, ModelError> {
        Ok(Linear {
            w: l.matrix(&spec.weight)?,
            b: l.load(&spec.bias)?,
        })
    }

    fn apply(&self, be: &B, x: &B::Tensor) -> Result<B::Tensor, ModelError> {
        Ok(be.linear(x, &self.w, Some(&self.b))?)
    }
}

#[derive(Debug)]
enum Mlp<B: Backend> {
    Plain {
        fc1: Linear<B>,
        fc2: Linear<B>,
        act: Activation,
    },
    Gated {
        gate: Linear<B>,
        up: Linear<B>,
        down: Linear<B>,
    },
}

#[derive(Debug)]
struct Block<B: Backend> {
    norm1: Norm<B>,
    norm2: Norm<B>,
    qkv: Linear<B>,
    proj: Linear<B>,
    mlp: Mlp<B>,
}

/// The patch merger: 2×2 windows of ViT tokens to one LLM-width vector.
#[derive(Debug)]
struct Merger<B: Backend> {
    norm: Norm<B>,
    /// Deepstack mergers normalise after the 2×2 shuffle (over 4E), the main merger before (over E).
    post_shuffle: bool,
    fc1: Linear<B>,
    fc2: Linear<B>,
}

impl<B: Backend> Merger<B> {
    fn apply(&self, be: &B, x: &B::Tensor, merged: usize, width: usize) -> Result<B::Tensor, ModelError> {
        let u = if self.post_shuffle {
            self.norm.apply(be, &be.reshape(x, merged, width)?)?
        } else {
            be.reshape(&self.norm.apply(be, x)?, merged, width)?
        };
        let h = be.activate(&self.fc1.apply(be, &u)?, Activation::GeluErf)?;
        self.fc2.apply(be, &h)
    }
}

/// Vision-tower outputs for a batch of images: main features and deepstack features, `[tokens, H]`.
#[derive(Debug)]
pub struct VisionOutput<B: Backend> {
    /// Merger output, one row per LLM image token, images in order.
    pub main: B::Tensor,
    /// Qwen3-VL deepstack features (one tensor per deepstack layer).
    pub deepstack: Vec<B::Tensor>,
}

/// A vision tower.
#[derive(Debug)]
pub struct VisionTower<B: Backend> {
    width: usize,
    heads: usize,
    merge: usize,
    patch_w: B::Weight,
    patch_b: Option<B::Tensor>,
    /// Qwen3-VL learned position table, kept on the host for interpolation.
    pos_table: Option<Vec<f32>>,
    blocks: Vec<Block<B>>,
    merger: Merger<B>,
    deepstack: Vec<(usize, Merger<B>)>,
    fullatt: Vec<usize>,
    window_merged: usize,
}

impl<B: Backend> Merger<B> {
    fn load<S: TensorSource<B>>(
        l: &Loader<'_, '_, S, B>,
        spec: &MergerSpec,
        post_shuffle: bool,
    ) -> Result<Self, ModelError> {
        Ok(Merger {
            norm: Norm::load(l, &spec.norm)?,
            post_shuffle,
            fc1: Linear::load(l, &spec.fc1)?,
            fc2: Linear::load(l, &spec.fc2)?,
        })
    }
}

impl<B: Backend> VisionTower<B> {
    /// Loads the tower's weights, named and shaped by its [`VisionSpec`]. The learned position
    /// table is read straight to the host, where it is interpolated.
    pub fn load<S: TensorSource<B>>(
        cfg: &ModelConfig,
        v: &VisionConfig,
        l: &Loader<'_, '_, S, B>,
    ) -> Result<Self, ModelError> {
        let spec = VisionSpec::new(cfg, v);
        let patch_w = l.matrix(&spec.patch_weight)?;
        let patch_b = spec.patch_bias.as_ref().map(|b| l.load(b)).transpose()?;
        let pos_table = spec.pos_embed.as_ref().map(|t| l.host(t)).transpose()?;
        let mut blocks = Vec::with_capacity(spec.blocks.len());
        for b in &spec.blocks {
            let mlp = match &b.mlp {
                VisionMlpSpec::Plain { fc1, fc2 } => Mlp::Plain {
                    fc1: Linear::load(l, fc1)?,
                    fc2: Linear::load(l, fc2)?,
                    act: if v.mlp == VisionMlp::Fc {
                        Activation::QuickGelu
                    } else {
                        Activation::GeluTanh
                    },
                },
                VisionMlpSpec::Gated { gate, up, down } => Mlp::Gated {
                    gate: Linear::load(l, gate)?,
                    up: Linear::load(l, up)?,
                    down: Linear::load(l, down)?,
                },
            };
            blocks.push(Block {
                norm1: Norm::load(l, &b.norm1)?,
                norm2: Norm::load(l, &b.norm2)?,
                qkv: Linear::load(l, &b.qkv)?,
                proj: Linear::load(l, &b.proj)?,
                mlp,
            });
        }
        let merger = Merger::load(l, &spec.merger, false)?;
        let mut deepstack = Vec::with_capacity(spec.deepstack.len());
        for (&layer, d) in v.deepstack_visual_indexes.iter().zip(&spec.deepstack) {
            deepstack.push((layer, Merger::load(l, d, true)?));
        }
        Ok(VisionTower {
            width: v.hidden_size,
            heads: v.num_heads,
            merge: v.spatial_merge_size,
            patch_w,
            patch_b,
            pos_table,
            blocks,
            merger,
            deepstack,
            fullatt: v.fullatt_block_indexes.clone(),
            window_merged: if v.window_size > 0 {
                v.window_size / v.spatial_merge_size / v.patch_size
            } else {
                0
            },
        })
    }

    /// Runs the tower on `pixel_values [patches, C·T·P·P]` of images with `grids` `(t, h, w)` in patches.
    pub fn forward(
        &self,
        be: &B,
        pixel_values: &B::Tensor,
        grids: &[[usize; 3]],
    ) -> Result<VisionOutput<B>, ModelError> {
        let patches: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
        let rows = be.shape(pixel_values).first().copied().unwrap_or(0);
        if rows != patches {
            return Err(ModelError::Input(format!(
                "{rows} patch rows for grids totalling {patches}"
            )));
        }
        let mut x = be.linear(pixel_values, &self.patch_w, self.patch_b.as_ref())?;
        if let Some(table) = &self.pos_table {
            let pe = interpolated_positions(table, self.width, grids, self.merge);
            x = be.add(&x, &be.upload(pe, &[patches, self.width])?)?;
        }
        let head_dim = self.width / self.heads;
        let (cos, sin) = vision_rotary(grids, self.merge, head_dim);
        let mut cos = be.upload(cos, &[patches, head_dim])?;
        let mut sin = be.upload(sin, &[patches, head_dim])?;
        let full = be.upload_segments(&frame_segments(grids))?;
        let unit = self.merge * self.merge;
        // Qwen2.5-VL: the window order of merged cells and the window segments.
        let mut window: Option<(Vec<usize>, B::Segments)> = None;
        if self.window_merged > 0 {
            let (index, segments) = window_index(grids, self.merge, self.window_merged);
            let rows: Vec<usize> = index
                .iter()
                .flat_map(|&m| (0..unit).map(move |u| m * unit + u))
                .collect();
            x = be.gather_rows(&x, &rows)?;
            cos = be.gather_rows(&cos, &rows)?;
            sin = be.gather_rows(&sin, &rows)?;
            window = Some((index, be.upload_segments(&segments)?));
        }
        let mut deep = Vec::new();
        let merged_rows = patches / unit;
        for (i, block) in self.blocks.iter().enumerate() {
            let segs = match &window {
                Some((_, w)) if !self.fullatt.contains(&i) => w,
                _ => &full,
            };
            x = self.block(be, block, &x, &cos, &sin, segs)?;
            if let Some((_, m)) = self.deepstack.iter().find(|(layer, _)| *layer == i) {
                deep.push(m.apply(be, &x, merged_rows, self.width * unit)?);
            }
        }
        let mut main = self.merger.apply(be, &x, merged_rows, self.width * unit)?;
        if let Some((index, _)) = window {
            let mut inverse = vec![0; index.len()];
            for (pos, &m) in index.iter().enumerate() {
                inverse[m] = pos;
            }
            main = be.gather_rows(&main, &inverse)?;
        }
        Ok(VisionOutput { main, deepstack: deep })
    }

    fn block(
        &self,
        be: &B,
        b: &Block<B>,
        x: &B::Tensor,
        cos: &B::Tensor,
        sin: &B::Tensor,
        segs: &B::Segments,
    ) -> Result<B::Tensor, ModelError> {
        let e = self.width;
        let h = b.norm1.apply(be, x)?;
        let qkv = b.qkv.apply(be, &h)?;
        let q = be.rope(&be.narrow_cols(&qkv, 0, e)?, cos, sin)?;
        let k = be.rope(&be.narrow_cols(&qkv, e, e)?, cos, sin)?;
        let v = be.narrow_cols(&qkv, 2 * e, e)?;
        let a = be.segment_attention(&q, &k, &v, self.heads, segs)?;
        let x = be.add(x, &b.proj.apply(be, &a)?)?;
        let h = b.norm2.apply(be, &x)?;
        let m = match &b.mlp {
            Mlp::Plain { fc1, fc2, act } => fc2.apply(be, &be.activate(&fc1.apply(be, &h)?, *act)?)?,
            Mlp::Gated { gate, up, down } => down.apply(be, &be.silu_mul(&gate.apply(be, &h)?, &up.apply(be, &h)?)?)?,
        };
        Ok(be.add(&x, &m)?)
    }
}

/// Merged-cell permutation and the attention segments of Qwen2.5-VL's windows.
type WindowOrder = (Vec<usize>, Vec<(usize, usize)>);

/// (row, col) of every ViT token in merge-window order, frames after each other, images in order.
fn token_coords(grids: &[[usize; 3]], m: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for &[t, h, w] in grids {
        for _ in 0..t {
            for br in 0..h / m {
                for bc in 0..w / m {
                    for ir in 0..m {
                        for ic in 0..m {
                            out.push((br * m + ir, bc * m + ic));
                        }
                    }
                }
            }
        }
    }
    out
}

/// One full-attention segment per frame of each image.
fn frame_segments(grids: &[[usize; 3]]) -> Vec<(usize, usize)> {
    let mut segs = Vec::new();
    let mut start = 0;
    for &[t, h, w] in grids {
        for _ in 0..t {
            segs.push((start, h * w));
            start += h * w;
        }
    }
    segs
}

/// 2-D rotary tables `[tokens, head_dim]` (transformers' `VisionRotaryEmbedding` and `rot_pos_emb`,
/// <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_vl/modeling_qwen2_vl.py>): angles `concat(row·f, col·f)` mirrored twice.
fn vision_rotary(grids: &[[usize; 3]], m: usize, head_dim: usize) -> (Vec<f32>, Vec<f32>) {
    let d = head_dim / 2;
    let inv: Vec<f32> = (0..d / 2)
        .map(|j| 1.0 / 10000f32.powf((2 * j) as f32 / d as f32))
        .collect();
    let coords = token_coords(grids, m);
    let mut cos = Vec::with_capacity(coords.len() * head_dim);
    let mut sin = Vec::with_capacity(coords.len() * head_dim);
    for (r, c) in coords {
        let theta: Vec<f32> = inv
            .iter()
            .map(|f| r as f32 * f)
            .chain(inv.iter().map(|f| c as f32 * f))
            .collect();
        for _ in 0..2 {
            cos.extend(theta.iter().map(|a| a.cos()));
            sin.extend(theta.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

/// Qwen3-VL's learned positions bilinearly resampled to each image's grid, in merge-window order
/// (`fast_pos_embed_interpolate`, <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_vl/modeling_qwen3_vl.py>).
fn interpolated_positions(table: &[f32], width: usize, grids: &[[usize; 3]], m: usize) -> Vec<f32> {
    let g = ((table.len() / width) as f64).sqrt() as usize;
    let mut out = Vec::new();
    for &[t, h, w] in grids {
        let sample = |i: usize, n: usize| -> (usize, usize, f32) {
            let y = if n > 1 {
                i as f32 * (g - 1) as f32 / (n - 1) as f32
            } else {
                0.0
            };
            let y0 = y as usize;
            (y0, (y0 + 1).min(g - 1), y - y0 as f32)
        };
        let row = |a: usize, b: usize| &table[(a * g + b) * width..(a * g + b + 1) * width];
        let mut grid_pe = vec![0.0f32; h * w * width];
        for i in 0..h {
            let (y0, y1, dy) = sample(i, h);
            for j in 0..w {
                let (x0, x1, dx) = sample(j, w);
                let weights = [(1.0 - dy) * (1.0 - dx), (1.0 - dy) * dx, dy * (1.0 - dx), dy * dx];
                let corners = [row(y0, x0), row(y0, x1), row(y1, x0), row(y1, x1)];
                let dst = &mut grid_pe[(i * w + j) * width..(i * w + j + 1) * width];
                for (k, d) in dst.iter_mut().enumerate() {
                    *d = corners.iter().zip(weights).map(|(c, wt)| wt * c[k]).sum();
                }
            }
        }
        for _ in 0..t {
            for (r, c) in token_coords(&[[1, h, w]], m) {
                out.extend_from_slice(&grid_pe[(r * w + c) * width..(r * w + c + 1) * width]);
            }
        }
    }
    out
}

/// Qwen2.5-VL window order of merged cells and the window segments in ViT tokens (`get_window_index`,
/// <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_5_vl/modeling_qwen2_5_vl.py>).
fn window_index(grids: &[[usize; 3]], m: usize, ws: usize) -> WindowOrder {
    let mut index = Vec::new();
    let mut segs = Vec::new();
    let mut base = 0;
    let mut start = 0;
    let unit = m * m;
    for &[t, h, w] in grids {
        let (hh, ww) = (h / m, w / m);
        let ws = ws.max(1);
        for f in 0..t {
            for wr in 0..hh.div_ceil(ws) {
                for wc in 0..ww.div_ceil(ws) {
                    let mut cells = 0;
                    for i in wr * ws..((wr + 1) * ws).min(hh) {
                        for j in wc * ws..((wc + 1) * ws).min(ww) {
                            index.push(base + f * hh * ww + i * ww + j);
                            cells += 1;
                        }
                    }
                    segs.push((start, cells * unit));
                    start += cells * unit;
                }
            }
        }
        base += t * hh * ww;
    }
    (index, segs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_window_order_matches_the_worked_example() {
        let c = token_coords(&[[1, 4, 6]], 2);
        assert_eq!(
            &c[..8],
            &[(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
        );
        assert_eq!(c[12], (2, 0));
    }

    #[test]
    fn window_index_matches_transformers() {
        // transformers' `get_window_index` on grid (1, 20, 12) → merged 10×6, windows of 4×4 merged cells.
        let (index, segs) = window_index(&[[1, 20, 12]], 2, 4);
        assert_eq!(
            &index[..24],
            &[0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15, 18, 19, 20, 21, 4, 5, 10, 11, 16, 17, 22, 23]
        );
        assert_eq!(index[24], 24);
        let ends: Vec<usize> = segs
            .iter()
            .scan(0, |acc, &(_, len)| {
                *acc += len;
                Some(*acc)
            })
            .collect();
        assert_eq!(ends, vec![64, 96, 160, 192, 224, 240]);
        let (_, segs) = window_index(&[[1, 16, 8]], 2, 4);
        assert_eq!(segs.iter().map(|s| s.1).collect::<Vec<_>>(), vec![64, 64]);
    }

    #[test]
    fn interpolation_hits_the_table_corners() {
        // A 2×2 table of width 1 resampled to a 3×3 grid: corners exact, centre the mean.
        let table = [0.0, 1.0, 2.0, 3.0];
        let pe = interpolated_positions(&table, 1, &[[1, 3, 3]], 1);
        assert_eq!(pe, vec![0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 2.5, 3.0]);
    }
}
