//! Image preprocessing against transformers' PIL image processor (`Qwen2VLImageProcessorPil`,
//! transformers 5.23 / Pillow 13): the fixtures under tests/fixtures/input were written by
//! tools/golden/input_reference.py. Also the refusals of bad input.

/// Counts the bytes each thread holds, so that a test can check what one call allocated while the
/// other tests run beside it.
#[allow(unsafe_code)] // a global allocator is an unsafe trait; this one only forwards to System
mod alloc_meter {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    thread_local! {
        static LIVE: Cell<usize> = const { Cell::new(0) };
        static PEAK: Cell<usize> = const { Cell::new(0) };
    }

    fn count(bytes: usize) {
        let _ = LIVE.try_with(|live| {
            live.set(live.get() + bytes);
            let _ = PEAK.try_with(|peak| peak.set(peak.get().max(live.get())));
        });
    }

    struct Meter;

    // SAFETY: every call is forwarded unchanged to the system allocator.
    unsafe impl GlobalAlloc for Meter {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            count(layout.size());
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            count(layout.size());
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            let _ = LIVE.try_with(|live| live.set(live.get().saturating_sub(layout.size())));
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    #[global_allocator]
    static METER: Meter = Meter;

    /// `f()` and the most bytes this thread held at once during it beyond what it held before.
    pub fn peak_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
        let before = LIVE.with(Cell::get);
        PEAK.with(|peak| peak.set(before));
        let out = f();
        (out, PEAK.with(Cell::get) - before)
    }
}

/// Inside a module named `input` so that `cargo test -p kvlens-engine input` selects these tests.
mod input {
    use std::io::Cursor;

    use crate::alloc_meter;

    use kvlens_engine::arch::config::{bundled_config, Family, ImageLimits};
    use kvlens_engine::input::image::{decode_image, ProcessorSettings, CLIP_MEAN, CLIP_STD};
    use kvlens_engine::input::{process_image, ImageSource, InputError};

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/input");

    fn fixture(name: &str) -> Vec<u8> {
        std::fs::read(format!("{FIXTURES}/{name}")).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    fn triple(v: &serde_json::Value) -> [f32; 3] {
        let list = v.as_array().unwrap();
        [0, 1, 2].map(|i| list[i].as_f64().unwrap() as f32)
    }

    /// Every reference case: grid, token count and max |Rust − PIL| over all values. PNG cases must
    /// match to float rounding (the resampler is exact); the JPEG case differs only by the decoders
    /// (libjpeg-turbo's fancy chroma upsampling and IDCT vs zune-jpeg's), which is bounded here.
    #[test]
    fn matches_pil_processor() {
        let meta: serde_json::Value = serde_json::from_slice(&fixture("reference.json")).unwrap();
        let cases = meta["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 5);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let patch = case["patch_size"].as_u64().unwrap() as usize;
            let family = if patch == 16 { Family::Qwen3Vl } else { Family::Qwen2Vl };
            let limits = ImageLimits {
                min_pixels: case["min_pixels"].as_u64().unwrap(),
                max_pixels: case["max_pixels"].as_u64().unwrap(),
            };
            let settings = ProcessorSettings::for_family(family, limits);
            assert_eq!(settings.patch_size, patch);
            assert_eq!(settings.image_mean, triple(&case["image_mean"]), "{name}");
            assert_eq!(settings.image_std, triple(&case["image_std"]), "{name}");

            let file = case["image"].as_str().unwrap();
            let out = process_image(&fixture(file), &settings).unwrap();
            let grid: Vec<u32> = case["grid_thw"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(out.grid_thw.to_vec(), grid, "{name}");
            assert_eq!(out.num_tokens, (grid[1] * grid[2] / 4) as usize, "{name}");
            let reference: Vec<f32> = fixture(case["pixel_values"].as_str().unwrap())
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let shape = case["shape"].as_array().unwrap();
            assert_eq!(
                reference.len() as u64,
                shape[0].as_u64().unwrap() * shape[1].as_u64().unwrap()
            );
            assert_eq!(out.pixel_values.len(), reference.len(), "{name}");
            assert_eq!(shape[1].as_u64().unwrap() as usize, settings.row_len());
            let max_diff = out
                .pixel_values
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            let mean_diff = out
                .pixel_values
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .sum::<f32>()
                / reference.len() as f32;
            println!("{name}: grid {grid:?}, max |rust - pil| = {max_diff:e}, mean {mean_diff:e}");
            if file.ends_with(".png") {
                // Pillow's resampling is reproduced bit for bit, so even resized images match to float rounding.
                assert!(max_diff <= 1e-6, "{name}: max difference {max_diff}");
            } else {
                assert!(
                    max_diff <= 0.2 && mean_diff <= 0.01,
                    "{name}: max {max_diff}, mean {mean_diff}"
                );
            }
        }
    }

    #[test]
    fn settings_from_checkpoint_files() {
        let q2 = bundled_config("Qwen2-VL-2B-Instruct").unwrap();
        let shipped = r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "rescale_factor": 0.00392156862745098,
        "image_processor_type": "Qwen2VLImageProcessor"}"#;
        let s = ProcessorSettings::new(&q2, Some(shipped)).unwrap();
        assert_eq!(s, ProcessorSettings::new(&q2, None).unwrap());
        assert_eq!((s.image_mean, s.image_std), (CLIP_MEAN, CLIP_STD));
        assert_eq!(s.limits, ImageLimits::shipped(Family::Qwen2Vl));
        assert_eq!((s.factor(), s.row_len()), (28, 1176));

        let q3 = bundled_config("Qwen3-VL-2B-Instruct").unwrap();
        let s3 =
            ProcessorSettings::new(&q3, Some(r#"{"size": {"shortest_edge": 1024, "longest_edge": 8192}}"#)).unwrap();
        assert_eq!((s3.image_mean, s3.image_std), ([0.5; 3], [0.5; 3]));
        assert_eq!((s3.limits.min_pixels, s3.limits.max_pixels), (1024, 8192));
        assert_eq!((s3.factor(), s3.row_len()), (32, 1536));

        let err = ProcessorSettings::new(&q3, Some(r#"{"patch_size": 14}"#)).unwrap_err();
        assert!(matches!(err, InputError::Preprocessor(_)), "{err}");
        assert!(ProcessorSettings::new(&q3, Some(r#"{"image_mean": [1, 2]}"#)).is_err());
        assert!(ProcessorSettings::new(&q3, Some("{bad")).is_err());
    }

    #[test]
    fn mm_hash_covers_pixels_and_settings() {
        let png = fixture("rgb_84x56.png");
        let limits = ImageLimits {
            min_pixels: 3136,
            max_pixels: 28 * 28 * 16,
        };
        let base = ProcessorSettings::for_family(Family::Qwen2Vl, limits);
        let a = process_image(&png, &base).unwrap();
        assert_eq!(a.mm_hash.len(), 64);
        assert_eq!(process_image(&png, &base).unwrap().mm_hash, a.mm_hash);
        let bigger = ProcessorSettings::for_family(
            Family::Qwen2Vl,
            ImageLimits {
                max_pixels: 28 * 28 * 64,
                ..limits
            },
        );
        let b = process_image(&png, &bigger).unwrap();
        assert_eq!(b.pixel_values, a.pixel_values, "same output, since 84x56 fits both");
        assert_ne!(b.mm_hash, a.mm_hash, "different settings hash differently");
        let other = process_image(&fixture("rgb_93x67.png"), &base).unwrap();
        assert_ne!(other.mm_hash, a.mm_hash);
    }

    /// A PNG made of the given chunks (type, data) after the signature; CRCs are computed.
    fn png_from_chunks(chunks: &[(&[u8; 4], Vec<u8>)]) -> Vec<u8> {
        fn crc32(bytes: &[u8]) -> u32 {
            let mut crc = 0xffff_ffffu32;
            for &b in bytes {
                crc ^= u32::from(b);
                for _ in 0..8 {
                    crc = if crc & 1 != 0 {
                        (crc >> 1) ^ 0xedb8_8320
                    } else {
                        crc >> 1
                    };
                }
            }
            !crc
        }
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        for (kind, data) in chunks {
            out.extend((data.len() as u32).to_be_bytes());
            let mut body = kind.to_vec();
            body.extend(data);
            out.extend(&body);
            out.extend(crc32(&body).to_be_bytes());
        }
        out
    }

    /// An 8-bit RGB PNG header announcing `width × height`, followed by a short IDAT and IEND.
    fn png_header_only(width: u32, height: u32) -> Vec<u8> {
        let mut ihdr = Vec::new();
        ihdr.extend(width.to_be_bytes());
        ihdr.extend(height.to_be_bytes());
        ihdr.extend([8, 2, 0, 0, 0]);
        png_from_chunks(&[
            (b"IHDR", ihdr),
            (b"IDAT", vec![0x78, 0x9c, 0x03, 0x00]),
            (b"IEND", Vec::new()),
        ])
    }

    fn encode_png(width: u32, height: u32) -> Vec<u8> {
        let img = image::DynamicImage::ImageRgb8(image::RgbImage::new(width, height));
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, image::ImageFormat::Png).unwrap();
        out.into_inner()
    }

    /// `img` written in `format` by the image crate's own encoder (WebP: lossless).
    fn encode(img: &image::DynamicImage, format: image::ImageFormat) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        img.write_to(&mut out, format)
            .unwrap_or_else(|e| panic!("{format:?}: {e}"));
        out.into_inner()
    }

    /// A 67 × 45 RGB image of 240 colours (few enough for a GIF palette), no two neighbours alike.
    fn known_rgb() -> image::RgbImage {
        image::RgbImage::from_fn(67, 45, |x, y| {
            let i = (x * 7 + y * 13) % 240;
            image::Rgb([(i * 17 % 256) as u8, (i * 31 % 256) as u8, (i * 47 % 256) as u8])
        })
    }

    /// Every lossless format the engine decodes gives the same pixels, hence the same
    /// `pixel_values` and mm hash, as the PNG of the same image.
    #[test]
    fn webp_gif_bmp_and_tiff_decode_like_the_png() {
        use image::ImageFormat::{Bmp, Gif, Png, Tiff, WebP};
        let s = settings();
        let rgb = image::DynamicImage::ImageRgb8(known_rgb());
        let reference = process_image(&encode(&rgb, Png), &s).unwrap();
        for format in [WebP, Gif, Bmp, Tiff] {
            let out = process_image(&encode(&rgb, format), &s).unwrap_or_else(|e| panic!("{format:?}: {e}"));
            assert_eq!(out.mm_hash, reference.mm_hash, "{format:?}: decoded pixels differ");
            assert_eq!(out, reference, "{format:?}");
        }

        // With alpha: composited onto white the same way whatever carried it (GIF's alpha is
        // only on/off, so it gets 0 and 255 only).
        let rgba = |levels: &[u8]| {
            image::DynamicImage::ImageRgba8(image::RgbaImage::from_fn(67, 45, |x, y| {
                let image::Rgb([r, g, b]) = *known_rgb().get_pixel(x, y);
                image::Rgba([r, g, b, levels[((x + y) as usize) % levels.len()]])
            }))
        };
        let partial = rgba(&[0, 77, 128, 255]);
        let reference = process_image(&encode(&partial, Png), &s).unwrap();
        for format in [WebP, Bmp, Tiff] {
            let out = process_image(&encode(&partial, format), &s).unwrap_or_else(|e| panic!("{format:?}: {e}"));
            assert_eq!(out.mm_hash, reference.mm_hash, "{format:?} with alpha");
        }
        let on_off = rgba(&[0, 255]);
        let gif = process_image(&encode(&on_off, Gif), &s).unwrap();
        assert_eq!(gif.mm_hash, process_image(&encode(&on_off, Png), &s).unwrap().mm_hash);

        // 16 bits a channel: TIFF and PNG keep the high byte alike.
        let deep = image::DynamicImage::ImageRgb16(image::ImageBuffer::from_fn(67, 45, |x, y| {
            image::Rgb([(x * 977) as u16, (y * 1453) as u16, (x * y * 31) as u16])
        }));
        assert_eq!(
            process_image(&encode(&deep, Tiff), &s).unwrap().mm_hash,
            process_image(&encode(&deep, Png), &s).unwrap().mm_hash,
            "16-bit TIFF vs PNG"
        );

        // Float RGBA (TIFF): 0.0–1.0 scaled to 0–255, then alpha composited like 8-bit RGBA.
        let float = image::DynamicImage::ImageRgba32F(image::ImageBuffer::from_fn(67, 45, |x, y| {
            image::Rgba([
                x as f32 / 66.0,
                y as f32 / 44.0,
                0.25,
                if x % 2 == 0 { 1.0 } else { 0.5 },
            ])
        }));
        let as_8bit = image::DynamicImage::ImageRgba8(float.to_rgba8());
        assert_eq!(
            process_image(&encode(&float, Tiff), &s).unwrap().mm_hash,
            process_image(&encode(&as_8bit, Png), &s).unwrap().mm_hash,
            "float TIFF"
        );
    }

    /// Files Pillow wrote (tools/golden/image_formats_reference.py: lossy WebP, animated WebP and
    /// GIF, GIFs whose first frame leaves part of the canvas uncovered, palette and 1-bit BMP, CMYK,
    /// 16-bit gray and RGBA TIFF, …) decode to exactly the pixels of transformers' `convert_to_rgb`.
    #[test]
    fn other_formats_match_pillow() {
        let s = settings();
        let dir = format!("{FIXTURES}/formats");
        let mut files: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|name| !name.ends_with(".rgb.png"))
            .collect();
        files.sort();
        assert_eq!(files.len(), 16, "{files:?}");
        for name in files {
            let ours = decode_image(&fixture(&format!("formats/{name}")), &s).unwrap_or_else(|e| panic!("{name}: {e}"));
            let pillow = decode_image(&fixture(&format!("formats/{name}.rgb.png")), &s).unwrap();
            assert_eq!(ours.mm_hash, pillow.mm_hash, "{name}: pixels differ from Pillow's");
        }
    }

    /// GIF: the first frame is the image, as Pillow's `Image.open` shows it.
    #[test]
    fn an_animated_gif_is_its_first_frame() {
        let s = settings();
        let first = known_rgb();
        let second = image::RgbImage::from_pixel(67, 45, image::Rgb([9, 9, 9]));
        let mut gif = Vec::new();
        {
            let mut encoder = image::codecs::gif::GifEncoder::new(&mut gif);
            for frame in [&first, &second] {
                let rgba = image::DynamicImage::ImageRgb8(frame.clone()).to_rgba8();
                encoder.encode_frame(image::Frame::new(rgba)).unwrap();
            }
        }
        let png = encode(&image::DynamicImage::ImageRgb8(first), image::ImageFormat::Png);
        assert_eq!(
            process_image(&gif, &s).unwrap().mm_hash,
            process_image(&png, &s).unwrap().mm_hash
        );
    }

    /// A GIF whose logical screen is `screen` and whose one frame is `frame` (both `width, height`),
    /// with a two-colour palette and the LZW data of a single pixel.
    fn gif(screen: (u16, u16), frame: (u16, u16)) -> Vec<u8> {
        let mut out = b"GIF89a".to_vec();
        out.extend(screen.0.to_le_bytes());
        out.extend(screen.1.to_le_bytes());
        out.extend([0x80, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0x2c, 0, 0, 0, 0]);
        out.extend(frame.0.to_le_bytes());
        out.extend(frame.1.to_le_bytes());
        out.extend([0, 2, 2, 0x44, 0x01, 0, 0x3b]);
        out
    }

    /// An uncompressed 8-bit grayscale TIFF announcing `width × height` with `data` as its one strip.
    fn tiff(width: u32, height: u32, data: &[u8]) -> Vec<u8> {
        const SHORT: u16 = 3;
        const LONG: u16 = 4;
        let entries: [(u16, u16, u32); 8] = [
            (256, LONG, width),
            (257, LONG, height),
            (258, SHORT, 8),
            (259, SHORT, 1),
            (262, SHORT, 1),
            (273, LONG, 8 + 2 + 8 * 12 + 4),
            (278, LONG, height),
            (279, LONG, data.len() as u32),
        ];
        let mut out = b"II*\0".to_vec();
        out.extend(8u32.to_le_bytes());
        out.extend((entries.len() as u16).to_le_bytes());
        for (tag, kind, value) in entries {
            out.extend(tag.to_le_bytes());
            out.extend(kind.to_le_bytes());
            out.extend(1u32.to_le_bytes());
            out.extend(value.to_le_bytes());
        }
        out.extend(0u32.to_le_bytes());
        out.extend(data);
        out
    }

    /// A 24-bit BMP (BITMAPINFOHEADER) announcing `width × height`, followed by `data`.
    fn bmp(width: i32, height: i32, data: &[u8]) -> Vec<u8> {
        let mut out = b"BM".to_vec();
        out.extend((54 + data.len() as u32).to_le_bytes());
        out.extend(0u32.to_le_bytes());
        out.extend(54u32.to_le_bytes());
        out.extend(40u32.to_le_bytes());
        out.extend(width.to_le_bytes());
        out.extend(height.to_le_bytes());
        out.extend(1u16.to_le_bytes());
        out.extend(24u16.to_le_bytes());
        for field in [0u32, 0, 2835, 2835, 0, 0] {
            out.extend(field.to_le_bytes());
        }
        out.extend(data);
        out
    }

    /// A WebP whose extended header (VP8X) announces a `width × height` canvas, carrying the
    /// lossless bitstream of a 1 × 1 image.
    fn webp_canvas(width: u32, height: u32) -> Vec<u8> {
        let one = encode(
            &image::DynamicImage::ImageRgb8(image::RgbImage::new(1, 1)),
            image::ImageFormat::WebP,
        );
        let vp8l = &one[12..];
        let mut out = b"RIFF".to_vec();
        out.extend((4 + 18 + vp8l.len() as u32).to_le_bytes());
        out.extend(b"WEBPVP8X");
        out.extend(10u32.to_le_bytes());
        out.extend([0; 4]);
        out.extend(&(width - 1).to_le_bytes()[..3]);
        out.extend(&(height - 1).to_le_bytes()[..3]);
        out.extend(vp8l);
        out
    }

    /// A baseline JPEG of 8 × 8 pixels whose frame header (SOF0) is patched to `width × height`.
    fn jpeg_sof(width: u16, height: u16) -> Vec<u8> {
        let mut out = encode(
            &image::DynamicImage::ImageRgb8(image::RgbImage::new(8, 8)),
            image::ImageFormat::Jpeg,
        );
        let sof = out.windows(2).position(|w| w == [0xff, 0xc0]).expect("a SOF0 marker");
        out[sof + 5..sof + 7].copy_from_slice(&height.to_be_bytes());
        out[sof + 7..sof + 9].copy_from_slice(&width.to_be_bytes());
        out
    }

    /// Decompression bombs: a file under 1 KB whose header claims 100 000 × 100 000 pixels, or the
    /// most its format can say (GIF and JPEG store 16-bit sides, a WebP canvas holds at most
    /// 2^32 pixels, the image crate's BMP decoder takes sides up to 65 535), is refused from its
    /// header with `TooLarge`: nothing near the image's size is allocated and nothing is decoded.
    #[test]
    fn decompression_bombs_are_refused_from_the_header() {
        let s = settings();
        let bombs = [
            ("PNG", png_header_only(100_000, 100_000), (100_000, 100_000)),
            ("TIFF", tiff(100_000, 100_000, &[0; 16]), (100_000, 100_000)),
            ("GIF", gif((65_535, 65_535), (1, 1)), (65_535, 65_535)),
            ("JPEG", jpeg_sof(65_535, 65_535), (65_535, 65_535)),
            ("WebP", webp_canvas(65_535, 65_535), (65_535, 65_535)),
            ("BMP", bmp(65_535, 65_535, &[0; 4]), (65_535, 65_535)),
        ];
        for (name, bytes, (w, h)) in bombs {
            assert!(bytes.len() < 1024, "{name}: {} bytes", bytes.len());
            let started = std::time::Instant::now();
            let (result, peak) = alloc_meter::peak_bytes(|| process_image(&bytes, &s));
            let elapsed = started.elapsed();
            println!("{name} claiming {w}x{h}: refused in {elapsed:?}, {peak} bytes allocated");
            assert!(
                matches!(result, Err(InputError::TooLarge { width, height, .. }) if (width, height) == (w, h)),
                "{name}: {result:?}"
            );
            assert!(peak < 1 << 20, "{name}: {peak} bytes allocated");
            // Decoding would take minutes; reading a header takes microseconds (the bound is loose
            // for a busy machine: the allocation bound above is the sharp check).
            assert!(elapsed.as_secs_f64() < 30.0, "{name}: {elapsed:?}");
        }
        // 100 000 × 100 000 in the formats whose decoders refuse such headers themselves.
        for (name, bytes) in [
            ("WebP", webp_canvas(100_000, 100_000)),
            ("BMP", bmp(100_000, 100_000, &[0; 4])),
        ] {
            let (result, peak) = alloc_meter::peak_bytes(|| process_image(&bytes, &s));
            assert!(matches!(result, Err(InputError::Decode(_))), "{name}: {result:?}");
            assert!(peak < 1 << 20, "{name}: {peak} bytes allocated");
        }
    }

    /// What the header does not show is bounded by the decoders' allocation limit: a GIF whose
    /// first frame is far larger than its 1 × 1 screen, and a TIFF whose one strip claims 2 GiB;
    /// and a TIFF tag claiming more values than the file holds is refused before the header is read.
    #[test]
    fn decoders_allocate_within_the_limit() {
        let s = settings();
        let mut strip_bomb = tiff(1, 1, &[]);
        // The last IFD entry, StripByteCounts, ends 4 bytes before the next-IFD offset.
        let at = strip_bomb.len() - 8;
        strip_bomb[at..at + 4].copy_from_slice(&0x7fff_ffffu32.to_le_bytes());
        for (name, bytes) in [("GIF", gif((1, 1), (65_535, 65_535))), ("TIFF strip", strip_bomb)] {
            let (result, peak) = alloc_meter::peak_bytes(|| process_image(&bytes, &s));
            let err = result.expect_err(name);
            assert!(matches!(err, InputError::Decode(_)), "{name}: {err}");
            assert!(
                err.to_string()
                    .ends_with("decoding needs more than the 528 MiB allowed for one image"),
                "{name}: {err}"
            );
            assert!(peak < 1 << 20, "{name}: {peak} bytes allocated");
        }
        // Found by the image fuzz target: a tag that claims 2^22 values made the TIFF decoder
        // reserve over 100 MiB while reading the header, before any limit applied.
        let mut tag_bomb = tiff(1, 1, &[0]);
        // BitsPerSample, the third entry: its value count.
        let count = 8 + 2 + 2 * 12 + 4;
        tag_bomb[count..count + 4].copy_from_slice(&(1u32 << 22).to_le_bytes());
        let (result, peak) = alloc_meter::peak_bytes(|| process_image(&tag_bomb, &s));
        assert!(peak < 1 << 20, "TIFF tag: {peak} bytes allocated");
        assert_eq!(
            result.expect_err("a TIFF tag claiming 2^22 values").to_string(),
            "cannot decode image: a TIFF tag claims more values than the file holds"
        );
    }

    /// Truncated files of every format are a clear decode error (a JPEG cut before its end marker
    /// too, as Pillow refuses it), and corrupted ones never panic.
    #[test]
    fn truncated_and_corrupt_files_are_decode_errors() {
        use image::ImageFormat::{Bmp, Gif, Jpeg, Png, Tiff, WebP};
        let s = settings();
        let rgb = image::DynamicImage::ImageRgb8(known_rgb());
        for format in [Png, Jpeg, Gif, WebP, Bmp, Tiff] {
            let full = encode(&rgb, format);
            // Cut in the pixel data. (Like Pillow, the PNG and GIF decoders accept a file that
            // lacks only its end chunk or trailer.)
            let jpeg_end = if format == Jpeg {
                vec![full.len() - 2]
            } else {
                Vec::new()
            };
            for cut in [full.len() / 4, full.len() / 2, full.len() * 3 / 4]
                .into_iter()
                .chain(jpeg_end)
            {
                let Err(err) = process_image(&full[..cut], &s) else {
                    panic!("{format:?} cut at {cut} of {} bytes decodes", full.len());
                };
                assert!(matches!(err, InputError::Decode(_)), "{format:?} cut at {cut}: {err}");
            }
            // Any outcome but a panic.
            for k in 1..64 {
                let mut bad = full.clone();
                bad[k * full.len() / 64] ^= 0x5a;
                let _ = process_image(&bad, &s);
            }
        }
        // A complete JPEG with an EXIF-like segment holding a thumbnail's markers, stray bytes and
        // trailing data after its end marker still decodes.
        let jpeg = encode(&rgb, Jpeg);
        let mut padded = jpeg[..2].to_vec();
        padded.extend([0xff, 0xe1, 0, 8, 0xff, 0xda, 0xff, 0xd9]);
        padded.extend(&jpeg[2..]);
        padded.extend(b"trailing\xff\xda");
        assert_eq!(
            process_image(&padded, &s).unwrap().mm_hash,
            process_image(&jpeg, &s).unwrap().mm_hash
        );
    }

    fn settings() -> ProcessorSettings {
        ProcessorSettings::for_family(Family::Qwen2Vl, ImageLimits::shipped(Family::Qwen2Vl))
    }

    #[test]
    fn refuses_bad_input_with_clear_errors() {
        let s = settings();

        let err = ImageSource::parse("data:image/png;base64,!!not base64!!").unwrap_err();
        assert!(matches!(err, InputError::Base64(_)), "{err}");

        let err = process_image(b"hello, I am a text file\n", &s).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is not a PNG, JPEG, WebP, GIF, BMP or TIFF file (first bytes: 68 65 6c 6c 6f 2c 20 49)"
        );
        let err = process_image(b"", &s).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is not a PNG, JPEG, WebP, GIF, BMP or TIFF file (first bytes: none, the data is empty)"
        );

        let err = process_image(&png_header_only(0, 5), &s).unwrap_err();
        assert!(
            matches!(err, InputError::EmptyImage { .. } | InputError::Decode(_)),
            "{err}"
        );
        println!("zero-width PNG: {err}");

        let err = process_image(&png_header_only(30000, 30000), &s).unwrap_err();
        assert_eq!(
            err.to_string(),
            "image is 30000x30000 = 900000000 pixels, more than the limit of 64 megapixels (67108864 pixels)"
        );

        let err = process_image(&encode_png(300, 1), &s).unwrap_err();
        assert!(matches!(err, InputError::Resize(_)), "{err}");
        assert_eq!(
            err.to_string(),
            "absolute aspect ratio must be smaller than 200, got 1x300"
        );

        // A truncated PNG: the header is fine, the pixel data is cut.
        let mut cut = encode_png(64, 64);
        cut.truncate(cut.len() / 2);
        let err = process_image(&cut, &s).unwrap_err();
        assert!(matches!(err, InputError::Decode(_)), "{err}");

        // A JPEG signature followed by garbage.
        let err = process_image(&[0xff, 0xd8, 0xff, 0xe0, 1, 2, 3], &s).unwrap_err();
        assert!(matches!(err, InputError::Decode(_)), "{err}");

        // A small limit is honoured before decoding.
        let tight = ProcessorSettings {
            max_decoded_pixels: 1 << 20,
            ..settings()
        };
        let err = process_image(&png_header_only(2000, 1000), &tight).unwrap_err();
        assert!(err.to_string().contains("limit of 1 megapixels"), "{err}");
    }
}
