//! What preprocessing one image costs in host memory, known from its header before any pixel is
//! decoded: the server admits images against a byte budget with it, so a burst of large images
//! waits instead of exhausting memory.

use super::error::InputError;
use super::image::{read_header, ProcessorSettings, MAX_DECODED_BYTES_PER_PIXEL};

/// The most host bytes decoding and preprocessing the image in `bytes` holds at once: the
/// decoder's buffer (at most [`MAX_DECODED_BYTES_PER_PIXEL`] a pixel) and the RGB copy at the
/// header's size, then at the resized size the RGB bytes, the normalized floats and the
/// patchified `pixel_values` (each frame repeated `temporal_patch_size` times); a TIFF's decoder
/// buffer twice. Refuses what
/// decoding would refuse from the header alone, with the same errors.
pub fn preprocessing_bytes(bytes: &[u8], settings: &ProcessorSettings) -> Result<u64, InputError> {
    let header = read_header(bytes, settings)?;
    let pixels = u64::from(header.width) * u64::from(header.height);
    let mut bytes = cost(pixels, header.resized.0 * header.resized.1, settings);
    if header.format == image::ImageFormat::Tiff {
        // The TIFF decoder fills a buffer of its own before the image's: a second copy.
        bytes = bytes.saturating_add(pixels.saturating_mul(MAX_DECODED_BYTES_PER_PIXEL));
    }
    Ok(bytes)
}

/// The cost of the largest image the settings accept (the pixel limit, resized to `max_pixels`),
/// in any format but TIFF (a larger TIFF waits until it is alone in the budget).
pub fn largest_preprocessing_bytes(settings: &ProcessorSettings) -> u64 {
    cost(settings.max_decoded_pixels, settings.limits.max_pixels, settings)
}

fn cost(pixels: u64, resized: u64, settings: &ProcessorSettings) -> u64 {
    let frames = settings.temporal_patch_size.max(1) as u64;
    pixels
        .saturating_mul(MAX_DECODED_BYTES_PER_PIXEL + 3)
        .saturating_add(resized.saturating_mul(3 + 3 * 4 + 3 * 4 * frames))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::config::{Family, ImageLimits};
    use crate::input::image::process_image;

    use std::io::Cursor;

    fn png(width: u32, height: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(width, height, |x, y| image::Rgb([x as u8, y as u8, 7]));
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    }

    #[test]
    fn the_estimate_covers_the_output_and_refuses_what_decoding_refuses() {
        let settings = ProcessorSettings::for_family(Family::Qwen3Vl, ImageLimits::shipped(Family::Qwen3Vl));
        let bytes = png(300, 200);
        let cost = preprocessing_bytes(&bytes, &settings).unwrap();
        let out = process_image(&bytes, &settings).unwrap();
        let output_bytes = (out.pixel_values.len() * 4) as u64;
        assert!(cost >= output_bytes + 300 * 200 * 3, "{cost} vs {output_bytes}");
        assert!(cost <= largest_preprocessing_bytes(&settings));
        let small = ProcessorSettings {
            max_decoded_pixels: 100,
            ..settings.clone()
        };
        assert!(matches!(
            preprocessing_bytes(&bytes, &small),
            Err(InputError::TooLarge { .. })
        ));
        assert!(matches!(
            preprocessing_bytes(b"not an image", &settings),
            Err(InputError::NotAnImage(_))
        ));
    }
}
