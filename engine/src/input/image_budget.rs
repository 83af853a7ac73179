//! What preprocessing one image costs in host memory, known from its header before any pixel is
//! decoded: the server admits images against a byte budget with it, so a burst of large images
//! waits instead of exhausting memory.

use super::error::InputError;
use super::image::ProcessorSettings;
use super::resize::smart_resize;
use image::ImageReader;
use std::io::Cursor;

/// The most host bytes decoding and preprocessing the image in `bytes` holds at once: the
/// decoder's RGBA buffer and the RGB copy at the header's size, then at the resized size the RGB
/// bytes, the normalized floats and the patchified `pixel_values` (each frame repeated
/// `temporal_patch_size` times). Refuses, as decoding would, images over the pixel limit or with an
/// impossible shape.
pub fn preprocessing_bytes(bytes: &[u8], settings: &ProcessorSettings) -> Result<u64, InputError> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| InputError::Decode(e.to_string()))?;
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| InputError::Decode(e.to_string()))?;
    let pixels = u64::from(width) * u64::from(height);
    if pixels > settings.max_decoded_pixels {
        return Err(InputError::TooLarge {
            width,
            height,
            pixels,
            max_pixels: settings.max_decoded_pixels,
            max_megapixels: settings.max_decoded_pixels >> 20,
        });
    }
    let (rh, rw) = smart_resize(
        u64::from(height),
        u64::from(width),
        settings.factor() as u64,
        settings.limits,
    )?;
    let resized = rh * rw;
    let frames = settings.temporal_patch_size.max(1) as u64;
    Ok(pixels * (4 + 3) + resized * (3 + 3 * 4 + 3 * 4 * frames))
}

/// The cost of the largest image the settings accept (the pixel limit, resized to `max_pixels`).
pub fn largest_preprocessing_bytes(settings: &ProcessorSettings) -> u64 {
    let frames = settings.temporal_patch_size.max(1) as u64;
    settings.max_decoded_pixels * (4 + 3) + settings.limits.max_pixels * (3 + 3 * 4 + 3 * 4 * frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Family, ImageLimits};
    use crate::input::image::process_image;

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
        assert!(preprocessing_bytes(b"not an image", &settings).is_err());
    }
}
