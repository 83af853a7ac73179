//! Prompt expansion: each image's single `<|image_pad|>` becomes as many pads as the image has
//! LLM tokens, and the placeholders' positions are recorded for M-RoPE and the caches.

use super::InputError;

/// Where one image's placeholder tokens sit in the expanded prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImagePlaceholder {
    /// Index of the first `<|image_pad|>` of this image.
    pub offset: usize,
    /// Number of `<|image_pad|>` tokens (the image's `num_tokens`).
    pub length: usize,
}

/// A prompt with every image placeholder expanded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpandedPrompt {
    /// The token ids.
    pub ids: Vec<u32>,
    /// One entry per image, in prompt order.
    pub images: Vec<ImagePlaceholder>,
}

/// Replaces the `k`-th `image_pad` id of `ids` by `num_tokens[k]` copies (pass the images'
/// [`ProcessedImage::num_tokens`](super::image::ProcessedImage::num_tokens) in prompt order).
/// Fails when the number of pads and images differ.
pub fn expand_image_pads(ids: &[u32], image_pad: u32, num_tokens: &[usize]) -> Result<ExpandedPrompt, InputError> {
    let pads = ids.iter().filter(|&&id| id == image_pad).count();
    if pads != num_tokens.len() {
        return Err(InputError::PadMismatch {
            pads,
            images: num_tokens.len(),
        });
    }
    let total = ids.len() - pads + num_tokens.iter().sum::<usize>();
    let mut out = Vec::with_capacity(total);
    let mut images = Vec::with_capacity(pads);
    let mut counts = num_tokens.iter();
    for &id in ids {
        // The counts match, so every pad finds its length.
        match (id == image_pad).then(|| counts.next()).flatten() {
            Some(&length) => {
                images.push(ImagePlaceholder {
                    offset: out.len(),
                    length,
                });
                out.extend(std::iter::repeat_n(image_pad, length));
            }
            None => out.push(id),
        }
    }
    Ok(ExpandedPrompt { ids: out, images })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAD: u32 = 151655;
    const VS: u32 = 151652;
    const VE: u32 = 151653;

    #[test]
    fn two_images() {
        let ids = [151644, 872, 198, VS, PAD, VE, 9, VS, PAD, VE, 151645];
        let out = expand_image_pads(&ids, PAD, &[4, 2]).unwrap();
        assert_eq!(
            out.images,
            vec![
                ImagePlaceholder { offset: 4, length: 4 },
                ImagePlaceholder { offset: 11, length: 2 }
            ]
        );
        assert_eq!(
            out.ids,
            vec![151644, 872, 198, VS, PAD, PAD, PAD, PAD, VE, 9, VS, PAD, PAD, VE, 151645]
        );
        for p in &out.images {
            assert_eq!(out.ids[p.offset - 1], VS);
            assert_eq!(out.ids[p.offset + p.length], VE);
        }
    }

    #[test]
    fn mismatch() {
        let err = expand_image_pads(&[VS, PAD, VE], PAD, &[4, 4]).unwrap_err();
        assert_eq!(err, InputError::PadMismatch { pads: 1, images: 2 });
        assert_eq!(
            err.to_string(),
            "the prompt has 1 image placeholders but 2 images were given"
        );
        assert!(expand_image_pads(&[1, 2], PAD, &[3]).is_err());
        assert_eq!(expand_image_pads(&[1, 2], PAD, &[]).unwrap().ids, vec![1, 2]);
    }
}
