//! The CPU's instruction sets, detected once, and the one way the kernels call code compiled for
//! them ([`fastest!`]).

use std::sync::LazyLock;

/// The instruction sets the CPU kernels have versions for (all false off x86_64, where only
/// `avx512_bf16` is read: the other versions are not compiled).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Isa {
    /// AVX2 and FMA.
    pub avx2_fma: bool,
    /// AVX-512F and FMA.
    pub avx512_fma: bool,
    /// AVX-512 VNNI with the byte/word and vector-length extensions.
    pub avx512_vnni: bool,
    /// AVX-512F with AVX-512 BF16.
    pub avx512_bf16: bool,
}

/// This CPU's instruction sets.
pub(super) fn isa() -> Isa {
    static ISA: LazyLock<Isa> = LazyLock::new(detect);
    *ISA
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    let (avx2, fma, avx512f) = (
        std::is_x86_feature_detected!("avx2"),
        std::is_x86_feature_detected!("fma"),
        std::is_x86_feature_detected!("avx512f"),
    );
    let (bw, vl, vnni, bf16) = (
        std::is_x86_feature_detected!("avx512bw"),
        std::is_x86_feature_detected!("avx512vl"),
        std::is_x86_feature_detected!("avx512vnni"),
        std::is_x86_feature_detected!("avx512bf16"),
    );
    Isa {
        avx2_fma: avx2 && fma,
        avx512_fma: avx512f && fma,
        avx512_vnni: avx512f && bw && vl && vnni,
        avx512_bf16: avx512f && bf16,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
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
