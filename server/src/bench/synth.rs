//! The `synthetic-vision` dataset: seeded VisionArena-like requests, one image each, from a mix of
//! phone photos, screenshots, small pictures and tall documents; some requests reuse an earlier
//! image. Image content is cheap to draw (a gradient and a few flat shapes, seeded) and sent as a
//! base64 JPEG data URL at Pillow's default quality 75, as vLLM re-encodes VisionArena's images.

use anyhow::Result;
use base64::Engine as _;
use image::codecs::jpeg::JpegEncoder;
use image::RgbImage;
use rand::distr::weighted::WeightedIndex;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One kind of image in the mix.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeClass {
    /// What it stands for.
    pub name: &'static str,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Share of the distinct images.
    pub weight: f64,
}

const fn class(name: &'static str, width: u32, height: u32, weight: f64) -> SizeClass {
    SizeClass {
        name,
        width,
        height,
        weight,
    }
}

/// The size mix: what people send to chat arenas.
pub const SIZE_MIX: [SizeClass; 8] = [
    class("portrait phone photo", 3024, 4032, 0.18),
    class("landscape phone photo", 4032, 3024, 0.12),
    class("1080p screenshot", 1920, 1080, 0.20),
    class("1440p screenshot", 2560, 1440, 0.10),
    class("small picture", 640, 480, 0.17),
    class("small 16:10 picture", 1024, 640, 0.15),
    class("document page", 1240, 3508, 0.05),
    class("long screenshot", 1080, 4320, 0.03),
];

/// Short user prompts in the style of VisionArena's first turns.
const PROMPTS: [&str; 12] = [
    "What is in this image?",
    "Describe this picture in detail.",
    "What does the text in this screenshot say?",
    "How many people are in the photo?",
    "Can you summarize this document?",
    "What is the main color of this image?",
    "Where was this photo taken?",
    "Explain this chart.",
    "Is there anything unusual in this image?",
    "Translate the text in the image into English.",
    "What breed is this dog?",
    "Write a short caption for this image.",
];

/// One distinct image: its size class (an index into [`SIZE_MIX`]) and its content seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpec {
    /// Index into [`SIZE_MIX`].
    pub class: usize,
    /// Seed of the drawing.
    pub seed: u64,
}

/// The requests of a synthetic-vision run, before any image is drawn.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The prompt of each request.
    pub prompts: Vec<&'static str>,
    /// The image of each request: an index into `images`.
    pub image_of: Vec<usize>,
    /// The distinct images.
    pub images: Vec<ImageSpec>,
}

/// Draws `n` requests: `round(reuse_ratio × n)` of them (at most `n − 1`; never the first) reuse
/// the image of a random earlier request, the others get a new image from the size mix.
pub fn plan(n: usize, reuse_ratio: f64, rng: &mut StdRng) -> Plan {
    let reuses = ((reuse_ratio * n as f64).round() as usize).min(n.saturating_sub(1));
    let mut later: Vec<usize> = (1..n).collect();
    later.shuffle(rng);
    let mut reuse = vec![false; n];
    later[..reuses].iter().for_each(|&i| reuse[i] = true);
    let mix = WeightedIndex::new(SIZE_MIX.iter().map(|c| c.weight)).expect("positive weights");
    let mut plan = Plan {
        prompts: Vec::with_capacity(n),
        image_of: Vec::with_capacity(n),
        images: Vec::new(),
    };
    for (i, &reused) in reuse.iter().enumerate() {
        plan.prompts.push(*PROMPTS.choose(rng).expect("prompts"));
        if reused {
            let earlier = plan.image_of[rng.random_range(0..i)];
            plan.image_of.push(earlier);
        } else {
            plan.images.push(ImageSpec {
                class: rng.sample(&mix),
                seed: rng.random(),
            });
            plan.image_of.push(plan.images.len() - 1);
        }
    }
    plan
}

/// Draws an image: a vertical gradient between two colours and a few flat rectangles and ellipses,
/// all from the seed. Rows are filled with slice copies, so a 12-megapixel image costs little
/// more than its memory.
pub fn draw(spec: ImageSpec) -> RgbImage {
    let SizeClass { width, height, .. } = SIZE_MIX[spec.class];
    let (w, h) = (width as usize, height as usize);
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let mut colour = || -> [u8; 3] { rng.random() };
    let (top, bottom) = (colour(), colour());
    let mut buf = vec![0u8; w * h * 3];
    for (y, row) in buf.chunks_exact_mut(w * 3).enumerate() {
        let f = y as f64 / h.max(2) as f64;
        let mix: [u8; 3] = std::array::from_fn(|c| (top[c] as f64 * (1.0 - f) + bottom[c] as f64 * f) as u8);
        row.copy_from_slice(&mix.repeat(w));
    }
    let shapes = rng.random_range(3..=8);
    for _ in 0..shapes {
        let fill = rng.random::<[u8; 3]>().repeat(w);
        let (x0, y0) = (rng.random_range(0..w), rng.random_range(0..h));
        let (sw, sh) = (rng.random_range(1..=w / 2 + 1), rng.random_range(1..=h / 2 + 1));
        let ellipse = rng.random_bool(0.5);
        for y in y0..(y0 + sh).min(h) {
            let (mut a, mut b) = (x0, (x0 + sw).min(w));
            if ellipse {
                // Half-width of the ellipse inscribed in the box at this row.
                let dy = (y - y0) as f64 / sh as f64 * 2.0 - 1.0;
                let half = (1.0 - dy * dy).max(0.0).sqrt() * sw as f64 / 2.0;
                let centre = x0 as f64 + sw as f64 / 2.0;
                a = ((centre - half).max(0.0) as usize).min(w);
                b = ((centre + half) as usize).clamp(a, w);
            }
            buf[(y * w + a) * 3..(y * w + b) * 3].copy_from_slice(&fill[..(b - a) * 3]);
        }
    }
    RgbImage::from_raw(width, height, buf).expect("buffer of the image's size")
}

/// `data:image/jpeg;base64,…` of an image at quality 75.
pub fn jpeg_data_url(img: &RgbImage) -> Result<String> {
    let mut jpeg = Vec::new();
    JpegEncoder::new_with_quality(&mut jpeg, 75).encode_image(img)?;
    Ok(format!(
        "data:image/jpeg;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(jpeg)
    ))
}

/// Draws and encodes every distinct image on all cores; one data URL per image, in order.
pub fn data_urls(images: &[ImageSpec]) -> Result<Vec<Arc<str>>> {
    let next = AtomicUsize::new(0);
    let urls: Mutex<Vec<Option<Arc<str>>>> = Mutex::new(vec![None; images.len()]);
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(images.len());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&spec) = images.get(i) else { return Ok(()) };
                        let url: Arc<str> = jpeg_data_url(&draw(spec))?.into();
                        urls.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(url);
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
    })?;
    let urls = urls.into_inner().unwrap_or_else(|p| p.into_inner());
    Ok(urls.into_iter().map(|u| u.expect("every image encoded")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_of(n: usize, ratio: f64, seed: u64) -> Plan {
        plan(n, ratio, &mut StdRng::seed_from_u64(seed))
    }

    #[test]
    fn seeded() {
        assert_eq!(plan_of(200, 0.3, 5), plan_of(200, 0.3, 5));
        assert_ne!(plan_of(200, 0.3, 5), plan_of(200, 0.3, 6));
        let spec = plan_of(3, 0.0, 1).images[0];
        assert_eq!(draw(spec), draw(spec));
    }

    #[test]
    fn reuse_ratio_is_honoured() {
        for (n, ratio) in [(24, 0.25), (100, 0.0), (100, 0.5), (10, 1.0), (1, 1.0)] {
            let p = plan_of(n, ratio, 3);
            let reused = (0..n).filter(|&i| p.image_of[..i].contains(&p.image_of[i])).count();
            let want = ((ratio * n as f64).round() as usize).min(n - 1);
            assert_eq!(reused, want, "n {n} ratio {ratio}");
            assert_eq!(p.images.len(), n - want);
            // Images are introduced in order: a request reuses only images seen before it.
            let mut seen = 0;
            for &img in &p.image_of {
                assert!(img <= seen);
                seen = seen.max(img + 1);
            }
        }
    }

    #[test]
    fn sizes_follow_the_mix() {
        let p = plan_of(4000, 0.0, 11);
        let total = p.images.len() as f64;
        for (i, class) in SIZE_MIX.iter().enumerate() {
            let share = p.images.iter().filter(|s| s.class == i).count() as f64 / total;
            assert!((share - class.weight).abs() < 0.025, "{}: {share}", class.name);
        }
        assert!((SIZE_MIX.iter().map(|c| c.weight).sum::<f64>() - 1.0).abs() < 1e-9);
        // Distinct images get distinct seeds, so a server's content hash tells them apart.
        let mut seeds: Vec<u64> = p.images.iter().map(|s| s.seed).collect();
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), p.images.len());
    }

    #[test]
    fn images_are_jpeg_data_urls_of_their_size() {
        use base64::Engine as _;
        let specs = [ImageSpec { class: 4, seed: 1 }, ImageSpec { class: 5, seed: 2 }];
        let urls = data_urls(&specs).unwrap();
        for (url, spec) in urls.iter().zip(specs) {
            let b64 = url.strip_prefix("data:image/jpeg;base64,").expect("jpeg data URL");
            let bytes = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
            let img = image::load_from_memory(&bytes).unwrap();
            let class = SIZE_MIX[spec.class];
            assert_eq!((img.width(), img.height()), (class.width, class.height));
        }
        assert_ne!(
            draw(specs[0]).as_raw()[..],
            draw(ImageSpec { class: 4, seed: 3 }).as_raw()[..]
        );
    }
}
