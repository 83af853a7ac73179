//! `smart_resize`: the size an image is resized to before patchification, exactly as Hugging Face
//! transformers computes it (Python's round-half-to-even included).

use crate::arch::config::ImageLimits;

/// Why an image size cannot be processed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    /// A side is zero.
    #[error("image has an empty side ({height}x{width})")]
    Empty {
        /// Height in pixels.
        height: u64,
        /// Width in pixels.
        width: u64,
    },
    /// Aspect ratio above 200, which the Qwen processors reject.
    #[error("absolute aspect ratio must be smaller than 200, got {height}x{width}")]
    AspectRatio {
        /// Height in pixels.
        height: u64,
        /// Width in pixels.
        width: u64,
    },
}

/// Returns the resized `(height, width)`: multiples of `factor` whose area lies within the limits.
pub fn smart_resize(height: u64, width: u64, factor: u64, limits: ImageLimits) -> Result<(u64, u64), ResizeError> {
    if height == 0 || width == 0 {
        return Err(ResizeError::Empty { height, width });
    }
    if height.max(width) as f64 / height.min(width) as f64 > 200.0 {
        return Err(ResizeError::AspectRatio { height, width });
    }
    let f = factor as f64;
    let (h, w) = (height as f64, width as f64);
    let mut rh = ((h / f).round_ties_even() * f) as u64;
    let mut rw = ((w / f).round_ties_even() * f) as u64;
    if rh * rw > limits.max_pixels {
        let beta = (h * w / limits.max_pixels as f64).sqrt();
        rh = factor.max(((h / beta / f).floor() * f) as u64);
        rw = factor.max(((w / beta / f).floor() * f) as u64);
    } else if rh * rw < limits.min_pixels {
        let beta = (limits.min_pixels as f64 / (h * w)).sqrt();
        rh = ((h * beta / f).ceil() * f) as u64;
        rw = ((w * beta / f).ceil() * f) as u64;
    }
    Ok((rh, rw))
}

/// LLM tokens an image of the given size becomes: `(h'/factor)·(w'/factor)`.
pub fn image_tokens(height: u64, width: u64, factor: u64, limits: ImageLimits) -> Result<u64, ResizeError> {
    let (h, w) = smart_resize(height, width, factor, limits)?;
    Ok((h / factor) * (w / factor))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::Family;

    /// Sizes `smart_resize` of transformers 4.57.1 gives
    /// (<https://github.com/huggingface/transformers/blob/v4.57.1/src/transformers/models/qwen2_vl/image_processing_qwen2_vl.py>).
    #[test]
    fn matches_transformers_worked_values() {
        let q2 = ImageLimits::shipped(Family::Qwen2Vl);
        let q3 = ImageLimits::shipped(Family::Qwen3Vl);
        /// (input h×w, Qwen2/2.5 h×w and tokens, Qwen3 h×w and tokens)
        type Case = ((u64, u64), (u64, u64, u64), (u64, u64, u64));
        let cases: &[Case] = &[
            ((42, 70), (56, 56, 4), (224, 352, 77)),
            ((224, 224), (224, 224, 64), (256, 256, 64)),
            ((480, 640), (476, 644, 391), (480, 640, 300)),
            ((720, 1280), (728, 1288, 1196), (704, 1280, 880)),
            ((1080, 1920), (1092, 1932, 2691), (1088, 1920, 2040)),
            ((2160, 3840), (2156, 3836, 10549), (2176, 3840, 8160)),
            ((3584, 3584), (3584, 3584, 16384), (3584, 3584, 12544)),
            ((4096, 4096), (3584, 3584, 16384), (4096, 4096, 16384)),
            ((8000, 8000), (3584, 3584, 16384), (4096, 4096, 16384)),
            ((10, 1000), (28, 560, 20), (32, 2560, 80)),
            ((1, 1), (56, 56, 4), (256, 256, 64)),
        ];
        for &((h, w), (h2, w2, t2), (h3, w3, t3)) in cases {
            assert_eq!(smart_resize(h, w, 28, q2).unwrap(), (h2, w2), "qwen2 {h}x{w}");
            assert_eq!(image_tokens(h, w, 28, q2).unwrap(), t2, "qwen2 tokens {h}x{w}");
            assert_eq!(smart_resize(h, w, 32, q3).unwrap(), (h3, w3), "qwen3 {h}x{w}");
            assert_eq!(image_tokens(h, w, 32, q3).unwrap(), t3, "qwen3 tokens {h}x{w}");
        }
    }

    #[test]
    fn rejects_degenerate_sizes() {
        let q2 = ImageLimits::shipped(Family::Qwen2Vl);
        assert!(matches!(smart_resize(0, 10, 28, q2), Err(ResizeError::Empty { .. })));
        assert!(matches!(
            smart_resize(1, 201, 28, q2),
            Err(ResizeError::AspectRatio { .. })
        ));
        assert!(smart_resize(1, 200, 28, q2).is_ok());
    }
}
