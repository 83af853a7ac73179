//! The CPU's instruction sets, detected once, and the one way the kernels call code compiled for
//! them ([`fastest!`]).
//!
//! `KVLENS_CPU_ISA=avx2` (or `portable`) caps what the kernels use below what the CPU has, so the
//! paths of an AVX2-only laptop can be measured and tested on an AVX-512 machine.

use std::sync::LazyLock;

/// The instruction sets the CPU kernels have versions for (all false off x86_64, where only
/// `avx512_bf16` is read: the other versions are not compiled).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Isa {
    /// AVX2, FMA and F16C.
    pub avx2_fma: bool,
    /// AVX-512F and FMA.
    pub avx512_fma: bool,
    /// AVX-512 VNNI with the byte/word and vector-length extensions.
    pub avx512_vnni: bool,
    /// AVX-512F with AVX-512 BF16.
    pub avx512_bf16: bool,
}

/// The instruction sets the kernels use: this CPU's, capped by `KVLENS_CPU_ISA`.
pub(super) fn isa() -> Isa {
    static ISA: LazyLock<Isa> = LazyLock::new(|| {
        let cap = std::env::var("KVLENS_CPU_ISA").ok();
        detected().capped(cap.as_deref())
    });
    *ISA
}

impl Isa {
    /// These sets less those above `cap`: `avx2` keeps AVX2 and FMA, `portable` none; any other
    /// value (or none) keeps all.
    fn capped(self, cap: Option<&str>) -> Isa {
        match cap {
            Some("avx2") => Isa {
                avx2_fma: self.avx2_fma,
                ..Isa::default()
            },
            Some("portable") => Isa::default(),
            _ => self,
        }
    }

    /// The widest set the block products and f32 dot products use: `avx512-vnni`, `avx512`,
    /// `avx2` or `portable`.
    pub fn name(self) -> &'static str {
        if self.avx512_vnni {
            "avx512-vnni"
        } else if self.avx512_fma {
            "avx512"
        } else if self.avx2_fma {
            "avx2"
        } else {
            "portable"
        }
    }
}

/// This CPU's instruction sets, whatever `KVLENS_CPU_ISA` says.
#[cfg(target_arch = "x86_64")]
pub(super) fn detected() -> Isa {
    let (avx2, fma, f16c, avx512f) = (
        std::is_x86_feature_detected!("avx2"),
        std::is_x86_feature_detected!("fma"),
        std::is_x86_feature_detected!("f16c"),
        std::is_x86_feature_detected!("avx512f"),
    );
    let (bw, vl, vnni, bf16) = (
        std::is_x86_feature_detected!("avx512bw"),
        std::is_x86_feature_detected!("avx512vl"),
        std::is_x86_feature_detected!("avx512vnni"),
        std::is_x86_feature_detected!("avx512bf16"),
    );
    Isa {
        avx2_fma: avx2 && fma && f16c,
        avx512_fma: avx512f && fma,
        avx512_vnni: avx512f && bw && vl && vnni,
        avx512_bf16: avx512f && bf16,
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(super) fn detected() -> Isa {
    Isa::default()
}

/// `fastest!(feature => call, …, _ => portable)`: the first `call` whose [`Isa`] field is true on
/// this CPU, else `portable`. Each `call` is to a function compiled with `#[target_feature]` for
/// exactly that field's instructions; this is the one place such calls are made.
macro_rules! fastest {
    ($($feature:ident => $fast:expr,)* _ => $portable:expr $(,)?) => {{
        #[cfg(target_arch = "x86_64")]
        {
            let isa = $crate::backend::cpu::isa::isa();
            $(
                if isa.$feature {
                    // SAFETY: the function called was compiled for `$feature`'s instructions,
                    // which this CPU was found to have.
                    #[allow(unsafe_code)]
                    let out = unsafe { $fast };
                    return out;
                }
            )*
        }
        $portable
    }};
}
pub(super) use fastest;

#[cfg(test)]
mod tests {
    use super::*;

    /// `KVLENS_CPU_ISA` caps what is found, never adds to it; an unknown value caps nothing.
    #[test]
    fn caps_only_remove_sets() {
        let all = Isa {
            avx2_fma: true,
            avx512_fma: true,
            avx512_vnni: true,
            avx512_bf16: true,
        };
        assert_eq!(all.capped(None).name(), "avx512-vnni");
        assert_eq!(all.capped(Some("avx512")).name(), "avx512-vnni");
        let avx2 = all.capped(Some("avx2"));
        assert!(avx2.avx2_fma && !avx2.avx512_fma && !avx2.avx512_vnni && !avx2.avx512_bf16);
        assert_eq!(avx2.name(), "avx2");
        assert_eq!(all.capped(Some("portable")).name(), "portable");
        assert_eq!(Isa::default().capped(Some("avx2")).name(), "portable");
    }
}
