//! Printed numbers: decimals with thousands separators, sizes with vLLM's units (exact bytes), counts,
//! floats and vLLM's human-readable integers.

use serde::Serialize;

/// A memory figure exactly as the log printed it, with its exact byte value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Printed {
    /// The magnitude in bytes: `round(mantissa × unit_bytes / 10^decimals)`.
    pub bytes: u64,
    /// Whether the printed number had a minus sign (vLLM can print negative profiling increases
    /// or a negative available KV memory); `bytes` is then the magnitude.
    pub negative: bool,
    /// The number as printed, e.g. `"44.30"` or `"21540531712"` (thousands separators kept).
    pub text: String,
    /// How many decimals were printed (`2` for `"44.30"`).
    pub decimals: u32,
    /// Bytes per printed unit: 2^30 for GB/GiB/G, 2^20 for MB/MiB/M, 1 for a bare number.
    pub unit_bytes: u64,
}

impl Printed {
    /// Parses a printed number and its unit (see [`parse_size_to_bytes`] for the accepted
    /// forms); a leading `-` is accepted and recorded in [`Printed::negative`].
    pub fn parse(number: &str, unit: &str) -> Option<Printed> {
        let text = number.trim();
        let dec = parse_decimal(text)?;
        let unit_bytes = unit_bytes(unit)?;
        let bytes = scale_round(dec.mantissa, unit_bytes, dec.decimals)?;
        Some(Printed {
            bytes,
            negative: dec.negative,
            text: text.to_string(),
            decimals: dec.decimals,
            unit_bytes,
        })
    }

    /// The value in bytes with its sign.
    pub fn signed_bytes(&self) -> i128 {
        if self.negative {
            -i128::from(self.bytes)
        } else {
            i128::from(self.bytes)
        }
    }

    /// The printed value in units of 2^30 bytes, for display only (not exact).
    pub fn gib(&self) -> f64 {
        self.signed_bytes() as f64 / (1u64 << 30) as f64
    }

    /// The closed range `(lo, hi)` of byte counts (magnitudes) whose value lies within half a unit
    /// of the last printed digit of this figure, i.e. every byte count that a printer rounding to
    /// `decimals` places could have shown as [`Printed::text`]. Both ends are included because
    /// which way an exact tie rounds depends on the printer. For a bare byte count the range is
    /// `(bytes, bytes)`. Ends are clamped to `0..=u64::MAX`; if the text no longer parses (the
    /// fields were edited by hand) the range is `(bytes, bytes)`.
    pub fn interval(&self) -> (u64, u64) {
        self.try_interval().unwrap_or((self.bytes, self.bytes))
    }

    /// Whether `bytes` (a magnitude) is inside [`Printed::interval`].
    pub fn contains(&self, bytes: u64) -> bool {
        let (lo, hi) = self.interval();
        lo <= bytes && bytes <= hi
    }

    fn try_interval(&self) -> Option<(u64, u64)> {
        let dec = parse_decimal(&self.text)?;
        let unit = u128::from(self.unit_bytes);
        let den = 10u128.checked_pow(dec.decimals)?.checked_mul(2)?;
        let twice = dec.mantissa.checked_mul(2)?;
        let lo_num = twice.saturating_sub(1).checked_mul(unit)?;
        let hi_num = twice.checked_add(1)?.checked_mul(unit)?;
        let lo = lo_num / den + u128::from(lo_num % den != 0);
        let hi = hi_num / den;
        let clamp = |v: u128| u64::try_from(v).unwrap_or(u64::MAX);
        Some((clamp(lo), clamp(hi)))
    }
}

/// Converts a printed size to bytes exactly.
///
/// `number` is a non-negative decimal: ASCII digits, optionally with thousands separators in
/// the integer part (`"645,120"`; groups of exactly three digits after the first), optionally
/// followed by `.` and at least one digit. `unit` is one of (case-insensitive) `""`, `B`, `byte`,
/// `bytes` (1), `K`/`KB`/`KiB` (2^10), `M`/`MB`/`MiB` (2^20), `G`/`GB`/`GiB` (2^30),
/// `T`/`TB`/`TiB` (2^40): vLLM's "GB" is 2^30 bytes. The result is
/// `round(mantissa × unit / 10^decimals)` (halves round up) computed in `u128`; `None` for a
/// malformed number, an unknown unit, a negative number or a result that does not fit `u64`.
pub fn parse_size_to_bytes(number: &str, unit: &str) -> Option<u64> {
    let dec = parse_decimal(number.trim())?;
    if dec.negative {
        return None;
    }
    scale_round(dec.mantissa, unit_bytes(unit)?, dec.decimals)
}

/// An exact decimal: `(-1)^negative × mantissa / 10^decimals`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    mantissa: u128,
    decimals: u32,
}

/// Parses a whole string as a decimal (optional sign, digits with optional strict thousands
/// separators, optional fraction). `None` on anything else or on `u128` overflow.
fn parse_decimal(s: &str) -> Option<Decimal> {
    let (negative, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let (int_part, frac_part) = match body.split_once('.') {
        Some((i, f)) => (i, Some(f)),
        None => (body, None),
    };
    if int_part.is_empty() {
        return None;
    }
    let mut mantissa: u128 = 0;
    let push = |c: u8, m: &mut u128| -> Option<()> {
        *m = m.checked_mul(10)?.checked_add(u128::from(c - b'0'))?;
        Some(())
    };
    for (i, group) in int_part.split(',').enumerate() {
        let ok_len = if i == 0 {
            (1..=3).contains(&group.len()) || !int_part.contains(',')
        } else {
            group.len() == 3
        };
        if !ok_len || group.is_empty() || !group.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        for c in group.bytes() {
            push(c, &mut mantissa)?;
        }
    }
    let mut decimals = 0u32;
    if let Some(frac) = frac_part {
        if frac.is_empty() || !frac.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        for c in frac.bytes() {
            push(c, &mut mantissa)?;
            decimals = decimals.checked_add(1)?;
        }
    }
    Some(Decimal {
        negative,
        mantissa,
        decimals,
    })
}

/// `round(mantissa × unit / 10^decimals)` (halves up) as `u64`, `None` on overflow.
fn scale_round(mantissa: u128, unit: u64, decimals: u32) -> Option<u64> {
    let num = mantissa.checked_mul(u128::from(unit))?;
    let den = 10u128.checked_pow(decimals)?;
    let q = num / den;
    let r = num % den;
    let q = if r >= den - r { q.checked_add(1)? } else { q };
    u64::try_from(q).ok()
}

/// Bytes per unit; `None` for an unknown unit.
fn unit_bytes(unit: &str) -> Option<u64> {
    let u = unit.trim();
    let is = |names: &[&str]| names.iter().any(|n| u.eq_ignore_ascii_case(n));
    if u.is_empty() || is(&["b", "byte", "bytes"]) {
        Some(1)
    } else if is(&["k", "kb", "kib"]) {
        Some(1 << 10)
    } else if is(&["m", "mb", "mib"]) {
        Some(1 << 20)
    } else if is(&["g", "gb", "gib"]) {
        Some(1 << 30)
    } else if is(&["t", "tb", "tib"]) {
        Some(1 << 40)
    } else {
        None
    }
}

/// Splits a leading number off `s` (leading whitespace skipped): optional `-`, digits, thousands
/// groups `,ddd` (only after a first group of at most three digits and only when exactly three
/// digits follow), optional `.digits`. Returns `(number, rest)`.
pub(super) fn split_number(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    let b = s.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let mut i = usize::from(b.first() == Some(&b'-'));
    let start = i;
    while digit(i) {
        i += 1;
    }
    if i == start {
        return None;
    }
    if i - start <= 3 {
        while b.get(i) == Some(&b',') && digit(i + 1) && digit(i + 2) && digit(i + 3) && !digit(i + 4) {
            i += 4;
        }
    }
    if b.get(i) == Some(&b'.') && digit(i + 1) {
        i += 1;
        while digit(i) {
            i += 1;
        }
    }
    // Every index above sits on an ASCII byte, so these are char boundaries.
    Some((s.get(..i)?, s.get(i..)?))
}

/// Splits a size unit off `s` (leading whitespace skipped) if the next word is one; otherwise
/// returns `("", s)`.
pub(super) fn split_unit(s: &str) -> (&str, &str) {
    let t = s.trim_start();
    let end = t
        .char_indices()
        .find(|(_, c)| !c.is_ascii_alphabetic())
        .map_or(t.len(), |(i, _)| i);
    let (word, rest) = t.split_at(end);
    if !word.is_empty() && unit_bytes(word).is_some() {
        (word, rest)
    } else {
        ("", s)
    }
}

/// A number followed by a size unit (the unit must be present).
pub(super) fn split_size(s: &str) -> Option<(Printed, &str)> {
    let (num, rest) = split_number(s)?;
    let (unit, rest) = split_unit(rest);
    if unit.is_empty() {
        return None;
    }
    Some((Printed::parse(num, unit)?, rest))
}

/// A number optionally followed by a size unit (a bare number is a byte count).
pub(super) fn split_size_or_bytes(s: &str) -> Option<(Printed, &str)> {
    let (num, rest) = split_number(s)?;
    let (unit, rest) = split_unit(rest);
    Some((Printed::parse(num, unit)?, rest))
}

/// A non-negative integer (thousands separators allowed) that fits `u64`.
pub(super) fn split_count(s: &str) -> Option<(u64, &str)> {
    let (num, rest) = split_number(s)?;
    let dec = parse_decimal(num)?;
    if dec.negative || dec.decimals != 0 {
        return None;
    }
    Some((u64::try_from(dec.mantissa).ok()?, rest))
}

/// A finite float.
pub(super) fn split_f64(s: &str) -> Option<(f64, &str)> {
    let (num, rest) = split_number(s)?;
    Some((parse_f64(num)?, rest))
}

pub(super) fn parse_f64(s: &str) -> Option<f64> {
    let v: f64 = s.trim().replace(',', "").parse().ok()?;
    v.is_finite().then_some(v)
}

/// vLLM's human-readable integers: `1k` = 1,000, `1K` = 1,024, `25.6k` = 25,600 (also m/M, g/G).
pub(super) fn parse_human_int(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult): (&str, u64) = match s.as_bytes().last() {
        Some(b'k') => (&s[..s.len() - 1], 1_000),
        Some(b'm') => (&s[..s.len() - 1], 1_000_000),
        Some(b'g') => (&s[..s.len() - 1], 1_000_000_000),
        Some(b'K') => (&s[..s.len() - 1], 1 << 10),
        Some(b'M') => (&s[..s.len() - 1], 1 << 20),
        Some(b'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let dec = parse_decimal(num)?;
    if dec.negative {
        return None;
    }
    let v = dec.mantissa.checked_mul(u128::from(mult))? / 10u128.checked_pow(dec.decimals)?;
    u64::try_from(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u128 = 1 << 30;

    #[test]
    fn decimal_forms() {
        let d = parse_decimal("44.30").unwrap();
        assert_eq!((d.negative, d.mantissa, d.decimals), (false, 4430, 2));
        let d = parse_decimal("645,120").unwrap();
        assert_eq!((d.mantissa, d.decimals), (645_120, 0));
        let d = parse_decimal("1,234,567.5").unwrap();
        assert_eq!((d.mantissa, d.decimals), (12_345_675, 1));
        assert!(parse_decimal("-0.56").unwrap().negative);
        for bad in [
            "", ".5", "5.", "1,2", "1234,567", "1,2345", "1.2.3", "abc", "1e9", "--1", ",123",
        ] {
            assert!(parse_decimal(bad).is_none(), "{bad:?}");
        }
        // u128 overflow is rejected, not a panic.
        assert!(parse_decimal(&"9".repeat(60)).is_none());
    }

    #[test]
    fn sizes_are_exact() {
        assert_eq!(parse_size_to_bytes("44.30", "GiB"), Some(47_566_762_803));
        assert_eq!(parse_size_to_bytes("44.30", "GB"), parse_size_to_bytes("44.30", "G"));
        assert_eq!(parse_size_to_bytes("9", "MiB"), Some(9 << 20));
        assert_eq!(parse_size_to_bytes("21540531712", ""), Some(21_540_531_712));
        assert_eq!(parse_size_to_bytes("0.5", "B"), Some(1)); // halves round up
        assert_eq!(parse_size_to_bytes("0.4", "bytes"), Some(0));
        assert_eq!(parse_size_to_bytes("-1", "GiB"), None);
        assert_eq!(parse_size_to_bytes("1", "parsecs"), None);
        assert_eq!(parse_size_to_bytes("17179869184", "GiB"), None); // 2^64 bytes
        assert_eq!(parse_size_to_bytes("17179869183.999999999", "GiB"), Some(u64::MAX));
        let exact = (9_1948u128 * GIB + 5_000) / 10_000;
        assert_eq!(parse_size_to_bytes("9.1948", "GB"), Some(exact as u64));
    }

    #[test]
    fn split_number_stops_at_separators() {
        assert_eq!(split_number("21540531712, total"), Some(("21540531712", ", total")));
        assert_eq!(split_number(" 645,120 tokens"), Some(("645,120", " tokens")));
        assert_eq!(split_number("2.46x"), Some(("2.46", "x")));
        assert_eq!(split_number("1,2"), Some(("1", ",2")));
        assert_eq!(split_number("12,345,6789"), Some(("12,345", ",6789")));
        assert_eq!(split_number("5. Next"), Some(("5", ". Next")));
        assert_eq!(split_number("-0.01 GiB"), Some(("-0.01", " GiB")));
        assert_eq!(split_number("x1"), None);
        assert_eq!(split_number("-"), None);
    }

    #[test]
    fn printed_interval() {
        let p = Printed::parse("44.30", "GiB").unwrap();
        let (lo, hi) = p.interval();
        // 44.295 GiB = 47,561,394,094.08 B; 44.305 GiB = 47,572,131,512.32 B
        assert_eq!((lo, hi), (47_561_394_095, 47_572_131_512));
        assert!(p.contains(5_040 * (9 << 20)));
        assert!(!p.contains(5_041 * (9 << 20)));
        let b = Printed::parse("21540531712", "").unwrap();
        assert_eq!(b.interval(), (21_540_531_712, 21_540_531_712));
        let z = Printed::parse("0.00", "GiB").unwrap();
        assert_eq!(z.interval().0, 0);
        let n = Printed::parse("-0.56", "GiB").unwrap();
        assert!(n.negative);
        assert_eq!(n.signed_bytes(), -i128::from(n.bytes));
    }

    #[test]
    fn human_ints() {
        assert_eq!(parse_human_int("65536"), Some(65_536));
        assert_eq!(parse_human_int("64k"), Some(64_000));
        assert_eq!(parse_human_int("64K"), Some(65_536));
        assert_eq!(parse_human_int("25.6k"), Some(25_600));
        assert_eq!(parse_human_int("-1"), None);
        assert_eq!(parse_human_int(""), None);
        assert_eq!(parse_human_int("k"), None);
    }
}
