//! Image preprocessing exactly like transformers' PIL image processor (`Qwen2VLImageProcessorPil`,
//! which Qwen3-VL shares with other settings): decode, convert to RGB (transparency composited onto
//! white, as transformers' `convert_to_rgb` does), `smart_resize`, Pillow's bicubic resampling,
//! rescale, normalize and patchify into `pixel_values` rows.
//!
//! Resampling reimplements Pillow's convolution resampler (`ImagingResample`): separable, a
//! horizontal pass then a vertical pass, each skipped when that side keeps its size; the Keys cubic
//! kernel with `a = -0.5` widened by the downscale factor; coefficients normalised per output pixel
//! and turned into 22-bit fixed point; every pass rounds and clips to `u8`.

use std::io::Cursor;
use std::sync::Arc;

use image::{DynamicImage, ImageError, ImageFormat, ImageReader, Limits};
use sha2::{Digest, Sha256};

use super::resize::smart_resize;
use super::InputError;
use crate::arch::config::{Family, ImageLimits, ModelConfig};

/// CLIP's per-channel mean as transformers writes it (Python floats).
const CLIP_MEAN_F64: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
/// CLIP's per-channel standard deviation as transformers writes it.
const CLIP_STD_F64: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
/// CLIP's per-channel mean, used by Qwen2-VL and Qwen2.5-VL, rounded to `f32` from the Python
/// float as numpy does (decimal → f64 → f32).
pub const CLIP_MEAN: [f32; 3] = [
    CLIP_MEAN_F64[0] as f32,
    CLIP_MEAN_F64[1] as f32,
    CLIP_MEAN_F64[2] as f32,
];
/// CLIP's per-channel standard deviation, used by Qwen2-VL and Qwen2.5-VL (rounded like [`CLIP_MEAN`]).
pub const CLIP_STD: [f32; 3] = [CLIP_STD_F64[0] as f32, CLIP_STD_F64[1] as f32, CLIP_STD_F64[2] as f32];
/// Default cap on decoded pixels: 64 megapixels (8192 × 8192), checked from the header before decoding.
pub const DEFAULT_MAX_DECODED_PIXELS: u64 = 8192 * 8192;

/// Everything that decides how an image becomes `pixel_values`.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessorSettings {
    /// Resized area bounds (`min_pixels` / `max_pixels`).
    pub limits: ImageLimits,
    /// Patch side `P`.
    pub patch_size: usize,
    /// Merge window side `m`.
    pub merge_size: usize,
    /// Frames per temporal patch `T` (a still image is repeated `T` times).
    pub temporal_patch_size: usize,
    /// Per-channel mean subtracted after rescaling.
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation divided by after subtracting the mean.
    pub image_std: [f32; 3],
    /// Multiplier from `u8` to `[0, 1]` (1/255).
    pub rescale_factor: f64,
    /// Largest `width × height` an image header may announce; larger images are refused unread.
    /// Does not change the output, so it is not part of the hash.
    pub max_decoded_pixels: u64,
}

impl ProcessorSettings {
    /// Settings of a checkpoint: its `config.json` and, when it has one, its `preprocessor_config.json`
    /// (`min_pixels`/`max_pixels` or `size`, `image_mean`, `image_std`, `rescale_factor`); what that
    /// file leaves out takes the family's shipped values. Patch, merge and temporal sizes come from
    /// `config.json`; a preprocessor file that disagrees with them is an error.
    pub fn new(config: &ModelConfig, preprocessor_json: Option<&str>) -> Result<Self, InputError> {
        let family = config.family;
        let shipped = Self::for_family(family, ImageLimits::shipped(family));
        // A text model alone takes no images: the family's settings stand unused.
        let mut settings = match &config.vision {
            Some(v) => ProcessorSettings {
                patch_size: v.patch_size,
                merge_size: v.spatial_merge_size,
                temporal_patch_size: v.temporal_patch_size,
                ..shipped
            },
            None => shipped,
        };
        let Some(text) = preprocessor_json else {
            return Ok(settings);
        };
        settings.limits =
            ImageLimits::from_preprocessor_json(text, family).map_err(|e| InputError::Preprocessor(e.to_string()))?;
        let root: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| InputError::Preprocessor(format!("preprocessor_config.json is not valid JSON: {e}")))?;
        if let Some(v) = root.get("image_mean") {
            settings.image_mean = channel_triple(v, "image_mean")?;
        }
        if let Some(v) = root.get("image_std") {
            settings.image_std = channel_triple(v, "image_std")?;
            if settings.image_std.contains(&0.0) {
                return Err(InputError::Preprocessor("image_std must not contain 0".into()));
            }
        }
        if let Some(v) = root.get("rescale_factor") {
            settings.rescale_factor = v
                .as_f64()
                .ok_or_else(|| InputError::Preprocessor("rescale_factor must be a number".into()))?;
        }
        for (key, expected) in [
            ("patch_size", settings.patch_size),
            ("merge_size", settings.merge_size),
            ("temporal_patch_size", settings.temporal_patch_size),
        ] {
            if let Some(v) = root.get(key).filter(|v| !v.is_null()) {
                if v.as_u64() != Some(expected as u64) {
                    return Err(InputError::Preprocessor(format!(
                        "preprocessor_config.json {key} = {v} disagrees with config.json ({expected})"
                    )));
                }
            }
        }
        Ok(settings)
    }

    /// The family's shipped settings with explicit limits (handy for tests and the planner).
    pub fn for_family(family: Family, limits: ImageLimits) -> Self {
        let qwen3 = family.is_qwen3();
        ProcessorSettings {
            limits,
            patch_size: if qwen3 { 16 } else { 14 },
            merge_size: 2,
            temporal_patch_size: 2,
            image_mean: if qwen3 { [0.5; 3] } else { CLIP_MEAN },
            image_std: if qwen3 { [0.5; 3] } else { CLIP_STD },
            rescale_factor: 1.0 / 255.0,
            max_decoded_pixels: DEFAULT_MAX_DECODED_PIXELS,
        }
    }

    /// Pixels per LLM token side: `patch_size × merge_size`.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Values per `pixel_values` row: `3 · T · P · P`.
    pub fn row_len(&self) -> usize {
        3 * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    fn hash_into(&self, hasher: &mut Sha256) {
        for n in [
            self.limits.min_pixels,
            self.limits.max_pixels,
            self.patch_size as u64,
            self.merge_size as u64,
            self.temporal_patch_size as u64,
        ] {
            hasher.update(n.to_le_bytes());
        }
        for v in self.image_mean.iter().chain(&self.image_std) {
            hasher.update(v.to_le_bytes());
        }
        hasher.update(self.rescale_factor.to_le_bytes());
    }
}

fn channel_triple(v: &serde_json::Value, key: &str) -> Result<[f32; 3], InputError> {
    let bad = || InputError::Preprocessor(format!("{key} must be a number or a list of 3 numbers"));
    if let Some(x) = v.as_f64() {
        return Ok([x as f32; 3]);
    }
    let list = v.as_array().filter(|l| l.len() == 3).ok_or_else(bad)?;
    let mut out = [0.0f32; 3];
    for (o, x) in out.iter_mut().zip(list) {
        *o = x.as_f64().ok_or_else(bad)? as f32;
    }
    Ok(out)
}

/// One image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// `grid_t·grid_h·grid_w` rows of `3·T·P·P` values, row-major; shared (not copied) with the
    /// requests that use the image.
    pub pixel_values: Arc<Vec<f32>>,
    /// `(grid_t, grid_h, grid_w)` in patches.
    pub grid_thw: [u32; 3],
    /// LLM tokens the image becomes: `t·h·w / m²`.
    pub num_tokens: usize,
    /// SHA-256 (hex) of the decoded RGB pixels, their size and the settings: the multimodal hash
    /// for the prefix and encoder caches.
    pub mm_hash: String,
}

/// A decoded image with its multimodal hash, before resizing: what a processor-cache lookup needs.
#[derive(Clone)]
pub struct DecodedImage {
    rgb: Rgb,
    /// See [`ProcessedImage::mm_hash`].
    pub mm_hash: String,
}

impl std::fmt::Debug for DecodedImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DecodedImage({}x{}, {})",
            self.rgb.width, self.rgb.height, self.mm_hash
        )
    }
}

/// Decodes a PNG, JPEG, WebP, GIF (first frame), BMP or TIFF and hashes its pixels with the settings.
pub fn decode_image(bytes: &[u8], settings: &ProcessorSettings) -> Result<DecodedImage, InputError> {
    let rgb = decode_rgb(bytes, settings)?;
    let mut hasher = Sha256::new();
    hasher.update(b"kvlens image v1");
    hasher.update((rgb.width as u64).to_le_bytes());
    hasher.update((rgb.height as u64).to_le_bytes());
    settings.hash_into(&mut hasher);
    hasher.update(&rgb.pixels);
    let mm_hash = hex(&hasher.finalize());
    Ok(DecodedImage { rgb, mm_hash })
}

/// Decodes an image (see [`decode_image`]) and turns it into `pixel_values`.
pub fn process_image(bytes: &[u8], settings: &ProcessorSettings) -> Result<ProcessedImage, InputError> {
    decode_image(bytes, settings)?.process(settings)
}

impl DecodedImage {
    /// Resizes, normalizes and patchifies.
    pub fn process(self, settings: &ProcessorSettings) -> Result<ProcessedImage, InputError> {
        let DecodedImage { rgb, mm_hash } = self;
        let (width, height) = (rgb.width as usize, rgb.height as usize);
        let factor = settings.factor() as u64;
        let (rh, rw) = smart_resize(height as u64, width as u64, factor, settings.limits)?;
        let (rh, rw) = (rh as usize, rw as usize);
        let pixels = if (rh, rw) == (height, width) {
            rgb.pixels
        } else {
            resize_bicubic(&rgb.pixels, width, height, rw, rh)
        };
        let p = settings.patch_size;
        let m = settings.merge_size;
        let (gh, gw) = (rh / p, rw / p);
        let pixel_values = patchify(&normalize(&pixels, settings), rh, rw, settings);
        Ok(ProcessedImage {
            pixel_values: Arc::new(pixel_values),
            grid_thw: [1, gh as u32, gw as u32],
            num_tokens: gh * gw / (m * m),
            mm_hash,
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Interleaved RGB8 pixels.
#[derive(Clone)]
struct Rgb {
    width: u32,
    height: u32,
    pixels: Vec<u8>,
}

/// Bytes per pixel of the widest image the decoders return for integer samples: RGBA with 16 bits
/// a channel (16-bit PNG and TIFF).
pub(crate) const MAX_DECODED_BYTES_PER_PIXEL: u64 = 8;
/// Decoder working memory allowed on top of that: inflate windows, row, palette and strip buffers.
const DECODER_MARGIN_BYTES: u64 = 16 << 20;

/// The `image` crate's allocation limit for one image: the widest decoded image at the pixel
/// limit plus [`DECODER_MARGIN_BYTES`] (528 MiB at the default 64 megapixels). It covers the output
/// buffer and the buffers of the decoders that honour it (PNG, GIF, TIFF); a TIFF decodes into a
/// buffer of its own before copying, so its two copies share this budget.
fn decoder_limits(max_decoded_pixels: u64) -> Limits {
    let mut limits = Limits::default();
    limits.max_alloc = Some(
        max_decoded_pixels
            .saturating_mul(MAX_DECODED_BYTES_PER_PIXEL)
            .saturating_add(DECODER_MARGIN_BYTES),
    );
    limits
}

/// A decoder failure as an [`InputError::Decode`]; running into the allocation limit says so.
fn decode_error(err: ImageError, limits: &Limits) -> InputError {
    match (&err, limits.max_alloc) {
        (ImageError::Limits(_), Some(max)) => InputError::Decode(format!(
            "{err}: decoding needs more than the {} MiB allowed for one image",
            max >> 20
        )),
        _ => InputError::Decode(err.to_string()),
    }
}

/// What an image's header says, checked against the settings before any pixel is decoded.
pub(crate) struct Header {
    /// The file's format.
    pub format: ImageFormat,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// `(height, width)` after `smart_resize`.
    pub resized: (u64, u64),
    /// The decoder's allocation limit.
    limits: Limits,
}

fn reader<'a>(bytes: &'a [u8], format: ImageFormat, limits: &Limits) -> ImageReader<Cursor<&'a [u8]>> {
    let mut r = ImageReader::with_format(Cursor::new(bytes), format);
    r.limits(limits.clone());
    r
}

/// Reads and checks the header: a format kvlens decodes, a non-empty size within the pixel limit,
/// an aspect ratio `smart_resize` accepts.
pub(crate) fn read_header(bytes: &[u8], settings: &ProcessorSettings) -> Result<Header, InputError> {
    let format = match image::guess_format(bytes) {
        Ok(
            f @ (ImageFormat::Png
            | ImageFormat::Jpeg
            | ImageFormat::WebP
            | ImageFormat::Gif
            | ImageFormat::Bmp
            | ImageFormat::Tiff),
        ) => f,
        _ => {
            let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
            let head = if head.is_empty() {
                "none, the data is empty".to_string()
            } else {
                head.join(" ")
            };
            return Err(InputError::NotAnImage(head));
        }
    };
    if format == ImageFormat::Tiff && !tiff_values_fit_the_file(bytes) {
        return Err(InputError::Decode(
            "a TIFF tag claims more values than the file holds".into(),
        ));
    }
    let limits = decoder_limits(settings.max_decoded_pixels);
    let (width, height) = reader(bytes, format, &limits)
        .into_dimensions()
        .map_err(|e| decode_error(e, &limits))?;
    if width == 0 || height == 0 {
        return Err(InputError::EmptyImage { width, height });
    }
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
    // Refuse impossible aspect ratios before spending time on decoding.
    let resized = smart_resize(
        u64::from(height),
        u64::from(width),
        settings.factor() as u64,
        settings.limits,
    )?;
    Ok(Header {
        format,
        width,
        height,
        resized,
        limits,
    })
}

/// Reads the header, checks the size, decodes and converts to RGB the way transformers does.
fn decode_rgb(bytes: &[u8], settings: &ProcessorSettings) -> Result<Rgb, InputError> {
    let Header {
        format,
        width,
        height,
        limits,
        ..
    } = read_header(bytes, settings)?;
    if format == ImageFormat::Jpeg && !jpeg_reaches_end_marker(bytes) {
        return Err(InputError::Decode(
            "the JPEG data ends before its end-of-image marker (the file is truncated)".into(),
        ));
    }
    // GIF and animated WebP: the first frame, as Pillow's `Image.open` shows it.
    let mut decoded = reader(bytes, format, &limits)
        .decode()
        .map_err(|e| decode_error(e, &limits))?;
    if let (ImageFormat::Gif, DynamicImage::ImageRgba8(canvas)) = (format, &mut decoded) {
        gif_canvas_like_pillow(bytes, canvas)?;
    }
    if decoded.width() != width || decoded.height() != height {
        return Err(InputError::Decode(format!(
            "decoded size {}x{} differs from the header's {width}x{height}",
            decoded.width(),
            decoded.height()
        )));
    }
    Ok(Rgb {
        width,
        height,
        pixels: to_rgb_like_transformers(decoded),
    })
}

/// Whether every entry of a TIFF's first directory claims no more value bytes than the file has.
/// The tiff decoder reads that directory before the image crate hands it the allocation limit,
/// and reserves room for the values a tag claims (up to 256 MiB, whatever the file's size); a
/// value cannot be larger than the file holding it, so refusing such entries first keeps what the
/// header costs proportional to the file. Anything else malformed is left to the decoder.
fn tiff_values_fit_the_file(bytes: &[u8]) -> bool {
    let big_endian = bytes.starts_with(b"MM");
    let read = |at: usize, len: usize| -> Option<u64> {
        let field = bytes.get(at..at.checked_add(len)?)?;
        let mut value = [0u8; 8];
        if big_endian {
            value[8 - len..].copy_from_slice(field);
            Some(u64::from_be_bytes(value))
        } else {
            value[..len].copy_from_slice(field);
            Some(u64::from_le_bytes(value))
        }
    };
    // Classic TIFF: 2-byte entry count, 12-byte entries, 4-byte counts; BigTIFF: 8, 20 and 8.
    let (directory, count_len, entry_len, value_count_len) = match read(2, 2) {
        Some(42) => (read(4, 4), 2, 12, 4),
        Some(43) => (read(8, 8), 8, 20, 8),
        _ => return true,
    };
    let Some(directory) = directory.and_then(|d| usize::try_from(d).ok()) else {
        return true;
    };
    let Some(entries) = read(directory, count_len) else {
        return true;
    };
    let file_len = bytes.len() as u64;
    let mut at = directory.saturating_add(count_len);
    for _ in 0..entries {
        let (Some(kind), Some(count)) = (read(at + 2, 2), read(at + 4, value_count_len)) else {
            return true;
        };
        let value_len = match kind {
            3 | 8 => 2,
            4 | 9 | 11 | 13 => 4,
            5 | 10 | 12 | 16..=18 => 8,
            _ => 1,
        };
        if count.saturating_mul(value_len) > file_len {
            return false;
        }
        at = at.saturating_add(entry_len);
    }
    true
}

/// Whether a JPEG's markers run to its end-of-image marker. Pillow (libjpeg) refuses a JPEG cut
/// before it ("image file is truncated"); zune-jpeg, as the image crate runs it, fills the missing
/// part in. Segments are skipped by their length, so thumbnails inside them are passed over;
/// entropy-coded data runs to the next `0xFF` that is neither a stuffed `0x00` nor a restart
/// marker; stray bytes between markers are skipped, as libjpeg skips them.
fn jpeg_reaches_end_marker(bytes: &[u8]) -> bool {
    let next_ff = |from: usize| Some(from + bytes.get(from..)?.iter().position(|&b| b == 0xff)?);
    // After the start-of-image marker.
    let mut at = 2;
    while let Some(ff) = next_ff(at) {
        let Some(&marker) = bytes.get(ff + 1) else {
            return false;
        };
        at = ff + 2;
        match marker {
            0xd9 => return true,
            // A fill byte before a marker.
            0xff => at -= 1,
            // Markers without a length (TEM, the restart markers) and stray stuffed zeros.
            0x00 | 0x01 | 0xd0..=0xd7 => {}
            _ => {
                let Some(&[hi, lo]) = bytes.get(at..at + 2) else {
                    return false;
                };
                at += usize::from(u16::from_be_bytes([hi, lo]));
                if marker == 0xda {
                    // The scan's data: to the next real marker.
                    let Some(end) = bytes.get(at..).and_then(|scan| {
                        scan.windows(2)
                            .position(|w| w[0] == 0xff && !matches!(w[1], 0x00 | 0xd0..=0xd7 | 0xff))
                    }) else {
                        return false;
                    };
                    at += end;
                }
            }
        }
    }
    false
}

/// Pillow opens a GIF's first frame on a canvas of palette index 0, or of the transparent index
/// when the frame has one; the image crate leaves what the frame does not cover transparent (white
/// once composited). Paints that part with index 0's colour when the frame has no transparent index.
fn gif_canvas_like_pillow(bytes: &[u8], canvas: &mut image::RgbaImage) -> Result<(), InputError> {
    let gif_error = |e: gif::DecodingError| InputError::Decode(e.to_string());
    let mut options = gif::DecodeOptions::new();
    options.set_color_output(gif::ColorOutput::Indexed);
    let mut decoder = options.read_info(bytes).map_err(gif_error)?;
    let global = decoder.global_palette().map(<[u8]>::to_vec);
    let Some(frame) = decoder.next_frame_info().map_err(gif_error)? else {
        return Ok(());
    };
    let (left, top) = (u32::from(frame.left), u32::from(frame.top));
    let (right, bottom) = (left + u32::from(frame.width), top + u32::from(frame.height));
    let covers = left == 0 && top == 0 && right >= canvas.width() && bottom >= canvas.height();
    if frame.transparent.is_some() || covers {
        return Ok(());
    }
    let fill = match frame.palette.as_deref().or(global.as_deref()) {
        Some([r, g, b, ..]) => image::Rgba([*r, *g, *b, 255]),
        _ => image::Rgba([0, 0, 0, 255]),
    };
    for (x, y, pixel) in canvas.enumerate_pixels_mut() {
        if !(left..right).contains(&x) || !(top..bottom).contains(&y) {
            *pixel = fill;
        }
    }
    Ok(())
}

/// RGB8 the way transformers' `convert_to_rgb` + Pillow produce it: alpha is composited onto
/// white with Pillow's `alpha_composite` arithmetic; 16-bit channels keep their high byte, as
/// Pillow's 16-bit PNG and TIFF unpackers do, except 16-bit grayscale, which Pillow opens as
/// `I;16` and clips to 255 when converting.
fn to_rgb_like_transformers(image: DynamicImage) -> Vec<u8> {
    match image {
        DynamicImage::ImageRgb8(img) => img.into_raw(),
        DynamicImage::ImageLuma8(img) => img.into_raw().iter().flat_map(|&v| [v; 3]).collect(),
        DynamicImage::ImageLumaA8(img) => img
            .into_raw()
            .chunks_exact(2)
            .flat_map(|la| [composite_on_white(la[0], la[1]); 3])
            .collect(),
        DynamicImage::ImageRgba8(img) => rgba_on_white(&img.into_raw()),
        DynamicImage::ImageLuma16(img) => img.into_raw().iter().flat_map(|&v| [v.min(255) as u8; 3]).collect(),
        DynamicImage::ImageLumaA16(img) => img
            .into_raw()
            .chunks_exact(2)
            .flat_map(|la| [composite_on_white((la[0] >> 8) as u8, (la[1] >> 8) as u8); 3])
            .collect(),
        DynamicImage::ImageRgb16(img) => img.into_raw().iter().map(|&v| (v >> 8) as u8).collect(),
        DynamicImage::ImageRgba16(img) => img
            .into_raw()
            .chunks_exact(4)
            .flat_map(|p| [0, 1, 2].map(|c| composite_on_white((p[c] >> 8) as u8, (p[3] >> 8) as u8)))
            .collect(),
        // Float RGBA (TIFF): Pillow opens no multi-channel float image (only single-channel `F`),
        // so these take the image crate's 0.0–1.0 → 0–255 conversion, then alpha is composited
        // like 8-bit RGBA.
        img @ DynamicImage::ImageRgba32F(_) => rgba_on_white(&img.to_rgba8().into_raw()),
        // Float RGB (TIFF) likewise; `DynamicImage` is non-exhaustive, so a variant a later image
        // release adds takes the same conversion.
        other => other.to_rgb8().into_raw(),
    }
}

/// Interleaved RGBA8 composited onto white, as RGB8.
fn rgba_on_white(rgba: &[u8]) -> Vec<u8> {
    rgba.chunks_exact(4)
        .flat_map(|p| [0, 1, 2].map(|c| composite_on_white(p[c], p[3])))
        .collect()
}

/// One channel of Pillow's `alpha_composite(white, src)`.
fn composite_on_white(value: u8, alpha: u8) -> u8 {
    const BITS: u32 = 7;
    if alpha == 0 {
        return 255;
    }
    let (s, a) = (u32::from(value), u32::from(alpha));
    let blend = 255 * (255 - a);
    let out_a255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << BITS) / out_a255;
    let coef2 = 255 * (1 << BITS) - coef1;
    let tmp = s * coef1 + 255 * coef2 + (0x80 << BITS);
    ((((tmp >> 8) + tmp) >> 8) >> BITS) as u8
}

/// Fixed-point fraction bits of Pillow's 8-bit resampler.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Pillow's bicubic kernel (Keys, `a = -0.5`).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per-output-pixel windows of one axis: `(first input index, count)` and fixed-point weights.
struct Coefficients {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

impl Coefficients {
    /// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for a full-image box.
    fn new(in_size: usize, out_size: usize) -> Self {
        const SUPPORT: f64 = 2.0;
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = SUPPORT * filterscale;
        let ksize = support.ceil() as usize * 2 + 1;
        let mut bounds = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * ksize];
        let mut k = vec![0f64; ksize];
        for xx in 0..out_size {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            // C's (int) casts truncate toward zero, as `as i64` does.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
            let (xmin, count) = (xmin as usize, xmax.max(0) as usize);
            let mut total = 0.0;
            for (x, w) in k.iter_mut().enumerate().take(count) {
                *w = bicubic(((x + xmin) as f64 - center + 0.5) * ss);
                total += *w;
            }
            let row = &mut weights[xx * ksize..xx * ksize + count];
            for (fixed, &w) in row.iter_mut().zip(&k) {
                let w = if total != 0.0 { w / total } else { w };
                let scaled = w * f64::from(1u32 << PRECISION_BITS);
                *fixed = if w < 0.0 {
                    (scaled - 0.5) as i32
                } else {
                    (scaled + 0.5) as i32
                };
            }
            bounds.push((xmin, count));
        }
        Coefficients { ksize, bounds, weights }
    }

    fn window(&self, out: usize) -> (usize, &[i32]) {
        let (start, count) = self.bounds[out];
        (start, &self.weights[out * self.ksize..out * self.ksize + count])
    }
}

/// Rounds a fixed-point accumulator to `u8` (Pillow's `clip8`).
fn clip8(acc: i64) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

/// `Image.resize((new_w, new_h), Image.BICUBIC)` of Pillow on interleaved RGB8. Pillow 13 runs the
/// horizontal pass first, except when it enlarges horizontally and reduces vertically: then the
/// vertical pass runs first (checked against Pillow on every combination of the two directions).
fn resize_bicubic(src: &[u8], width: usize, height: usize, new_w: usize, new_h: usize) -> Vec<u8> {
    let horizontal = Coefficients::new(width, new_w);
    let vertical = Coefficients::new(height, new_h);
    if new_w > width && new_h < height {
        let stage = vertical_pass(src, width, &vertical, new_h, 0);
        return horizontal_pass(&stage, width, &horizontal, new_w, 0..new_h);
    }
    // Rows of the source the vertical pass reads (all of them when it is skipped).
    let rows = if new_h != height {
        let (last_start, last_count) = vertical.bounds[new_h - 1];
        vertical.bounds[0].0..last_start + last_count
    } else {
        0..height
    };
    let first_row = rows.start;
    let stage = if new_w != width {
        horizontal_pass(src, width, &horizontal, new_w, rows)
    } else {
        src.to_vec()
    };
    if new_h == height {
        return stage;
    }
    let offset = if new_w != width { first_row } else { 0 };
    vertical_pass(&stage, new_w, &vertical, new_h, offset)
}

/// Resamples each of `rows` of an RGB8 image `width` wide to `new_w` columns.
fn horizontal_pass(src: &[u8], width: usize, k: &Coefficients, new_w: usize, rows: std::ops::Range<usize>) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut out = vec![0u8; rows.len() * new_w * 3];
    for (y, out_row) in rows.zip(out.chunks_exact_mut(new_w * 3)) {
        let in_row = &src[y * width * 3..(y + 1) * width * 3];
        for (xx, px) in out_row.chunks_exact_mut(3).enumerate() {
            let (start, w) = k.window(xx);
            for (c, v) in px.iter_mut().enumerate() {
                let acc = w.iter().enumerate().fold(half, |acc, (i, &wi)| {
                    acc + i64::from(in_row[(start + i) * 3 + c]) * i64::from(wi)
                });
                *v = clip8(acc);
            }
        }
    }
    out
}

/// Resamples the columns of an RGB8 image `width` wide to `new_h` rows; `offset` is the source row
/// that `src` starts at.
fn vertical_pass(src: &[u8], width: usize, k: &Coefficients, new_h: usize, offset: usize) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let row_len = width * 3;
    let mut out = vec![0u8; new_h * row_len];
    for (yy, out_row) in out.chunks_exact_mut(row_len).enumerate() {
        let (start, w) = k.window(yy);
        let start = start - offset;
        for (i, v) in out_row.iter_mut().enumerate() {
            let acc = w.iter().enumerate().fold(half, |acc, (j, &wj)| {
                acc + i64::from(src[(start + j) * row_len + i]) * i64::from(wj)
            });
            *v = clip8(acc);
        }
    }
    out
}

/// Channel-planar normalized values: `((v · rescale) as f32 − mean) / std`, as numpy computes them.
fn normalize(pixels: &[u8], settings: &ProcessorSettings) -> [Vec<f32>; 3] {
    let lut: [[f32; 256]; 3] = std::array::from_fn(|c| {
        std::array::from_fn(|v| {
            ((v as f64 * settings.rescale_factor) as f32 - settings.image_mean[c]) / settings.image_std[c]
        })
    });
    std::array::from_fn(|c| pixels.chunks_exact(3).map(|p| lut[c][usize::from(p[c])]).collect())
}

/// `pixel_values` of one still image: the frame repeated `T` times, rows in merge-window order,
/// each row `(C, T, P, P)` (as `Qwen2VLImageProcessor._preprocess` in
/// <https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_vl/image_processing_qwen2_vl.py>).
fn patchify(planes: &[Vec<f32>; 3], height: usize, width: usize, settings: &ProcessorSettings) -> Vec<f32> {
    let (p, m, t) = (settings.patch_size, settings.merge_size, settings.temporal_patch_size);
    let (gh, gw) = (height / p, width / p);
    let mut out = Vec::with_capacity(gh * gw * settings.row_len());
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for plane in planes {
                        for _ in 0..t {
                            for y in y0..y0 + p {
                                out.extend_from_slice(&plane[y * width + x0..y * width + x0 + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_and_coefficients() {
        assert_eq!(bicubic(0.0), 1.0);
        assert_eq!(bicubic(1.0), 0.0);
        assert_eq!(bicubic(2.0), 0.0);
        assert_eq!(bicubic(0.5), 0.5625);
        assert_eq!(bicubic(-1.5), -0.0625);
        // Every window's fixed-point weights sum to one within rounding.
        for (i, o) in [(93, 84), (20, 56), (240, 96), (7, 3)] {
            let c = Coefficients::new(i, o);
            for x in 0..o {
                let (start, k) = c.window(x);
                let sum: i32 = k.iter().sum();
                assert!(
                    (sum - (1 << PRECISION_BITS)).abs() <= k.len() as i32,
                    "{i}->{o} at {x}: {sum}"
                );
                assert!(start + k.len() <= i);
            }
        }
    }

    #[test]
    fn constant_images_stay_constant() {
        let src = vec![77u8; 31 * 17 * 3];
        for (w, h) in [(12, 40), (62, 9), (31, 5)] {
            assert!(resize_bicubic(&src, 31, 17, w, h).iter().all(|&v| v == 77), "{w}x{h}");
        }
    }

    #[test]
    fn alpha_composite_matches_pillow_endpoints() {
        assert_eq!(composite_on_white(10, 0), 255);
        assert_eq!(composite_on_white(10, 255), 10);
        assert_eq!(composite_on_white(0, 128), 127);
    }

    #[test]
    fn patchify_layout() {
        // 4 × 4 image, P = 1, m = 2, T = 2: rows follow merge windows, each row is (C, T).
        let settings = ProcessorSettings {
            patch_size: 1,
            ..ProcessorSettings::for_family(Family::Qwen2Vl, ImageLimits::shipped(Family::Qwen2Vl))
        };
        let plane: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let planes = [
            plane.clone(),
            plane.iter().map(|v| v + 100.0).collect(),
            plane.iter().map(|v| v + 200.0).collect(),
        ];
        let out = patchify(&planes, 4, 4, &settings);
        assert_eq!(out.len(), 16 * 6);
        assert_eq!(&out[..6], &[0.0, 0.0, 100.0, 100.0, 200.0, 200.0]);
        let firsts: Vec<f32> = out.chunks(6).map(|r| r[0]).collect();
        assert_eq!(
            firsts,
            vec![0., 1., 4., 5., 2., 3., 6., 7., 8., 9., 12., 13., 10., 11., 14., 15.]
        );
    }
}
