//! The CPU's instruction sets, detected once, and the one way the kernels call code compiled for
//! them ([`fastest!`]).
//!
//! `KVLENS_CPU_ISA=avx2` (or `portable`) caps what the kernels use below what the CPU has, so the
//! paths of an AVX2-only laptop can be measured and tested on an AVX-512 machine.

use std::sync::LazyLock;

/// The instruction sets the CPU kernels have versions for. Off x86_64 the x86 fields stay false
/// (only `avx512_bf16` and `amx_bf16` are read there: the other versions are not compiled); off
/// aarch64, `neon`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Isa {
    /// NEON (Advanced SIMD), which every aarch64 CPU has.
    pub neon: bool,
    /// AVX2, FMA and F16C.
    pub avx2_fma: bool,
    /// AVX-512F and FMA.
    pub avx512_fma: bool,
    /// AVX-512 VNNI with the byte/word and vector-length extensions.
    pub avx512_vnni: bool,
    /// AVX-512F with AVX-512 BF16.
    pub avx512_bf16: bool,
    /// AVX-512 run as two 256-bit halves (AMD Zen 4: family 0x19 with AVX-512), where AVX2
    /// kernels keep up with AVX-512 ones.
    pub avx512_split: bool,
    /// AMX tiles with bfloat16 products, which Linux has let this process use.
    pub amx_bf16: bool,
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
    /// These sets less those above `cap`: `avx2` keeps AVX2, FMA and F16C (nothing on aarch64),
    /// `portable` none; `native` (or no value) keeps all, and any other value too, with a warning.
    fn capped(self, cap: Option<&str>) -> Isa {
        match cap {
            Some("avx2") => Isa {
                avx2_fma: self.avx2_fma,
                ..Isa::default()
            },
            Some("portable") => Isa::default(),
            None | Some("native") => self,
            Some(other) => {
                eprintln!("KVLENS_CPU_ISA={other} is not avx2, portable or native: the CPU's own sets are used");
                self
            }
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
        neon: false,
        avx2_fma: avx2 && fma && f16c,
        avx512_fma: avx512f && fma,
        avx512_vnni: avx512f && bw && vl && vnni,
        avx512_bf16: avx512f && bf16,
        avx512_split: zen4(),
        amx_bf16: amx_bf16_granted(),
    }
}

/// The CPU's maker, as CPUID leaf 0 names it (`GenuineIntel`, `AuthenticAMD`).
#[cfg(target_arch = "x86_64")]
pub(super) fn maker() -> [u8; 12] {
    let id = std::arch::x86_64::__cpuid(0);
    let mut name = [0u8; 12];
    for (bytes, reg) in name.chunks_exact_mut(4).zip([id.ebx, id.edx, id.ecx]) {
        bytes.copy_from_slice(&reg.to_le_bytes());
    }
    name
}

/// Whether the CPU is AMD's Zen 4: family 0x19 (CPUID leaf 1, the extended family added) with
/// AVX-512, which Zen 3, the same family, lacks.
#[cfg(target_arch = "x86_64")]
pub(super) fn zen4() -> bool {
    let signature = std::arch::x86_64::__cpuid(1).eax;
    let family = match (signature >> 8) & 0xF {
        0xF => 0xF + ((signature >> 20) & 0xFF),
        base => base,
    };
    &maker() == b"AuthenticAMD" && family == 0x19 && std::is_x86_feature_detected!("avx512f")
}

/// Whether the CPU has AMX tiles with bfloat16 products (CPUID leaf 7: AMX-BF16, AMX-TILE), the
/// OS saves their state, and Linux granted this process the tile data state
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, which every thread of the process then
/// has).
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
fn amx_bf16_granted() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let leaf7 = (__cpuid(0).eax >= 7).then(|| __cpuid_count(7, 0).edx);
    let has = leaf7.is_some_and(|edx| edx & (1 << 22) != 0 && edx & (1 << 24) != 0);
    // The OS saves the tile state (XCR0 bits 17 and 18), read where it enabled XGETBV (OSXSAVE).
    let saved = __cpuid(1).ecx & (1 << 27) != 0 && {
        let (low, _high): (u32, u32);
        // SAFETY: OSXSAVE is set, so XGETBV exists; it reads XCR0 into eax:edx.
        unsafe { std::arch::asm!("xgetbv", in("ecx") 0, out("eax") low, out("edx") _high, options(nomem, nostack)) };
        low & (3 << 17) == 3 << 17
    };
    has && saved && cfg!(target_os = "linux") && {
        const ARCH_PRCTL: i64 = 158;
        const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
        const XFEATURE_XTILEDATA: i64 = 18;
        let ret: i64;
        // SAFETY: the arch_prctl system call only changes which state the kernel saves for this
        // process; it reads no memory of ours. `syscall` clobbers rcx and r11.
        unsafe {
            std::arch::asm!(
                "syscall",
                inlateout("rax") ARCH_PRCTL => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack)
            );
        }
        ret == 0
    }
}

/// This CPU's instruction sets, whatever `KVLENS_CPU_ISA` says.
#[cfg(target_arch = "aarch64")]
pub(super) fn detected() -> Isa {
    Isa {
        neon: std::arch::is_aarch64_feature_detected!("neon"),
        ..Isa::default()
    }
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(super) fn detected() -> Isa {
    Isa::default()
}

/// `fastest!(feature => call, …, [@aarch64 { feature => call, … }] _ => portable)`: the first
/// `call` whose [`Isa`] field is true on this CPU (the first list on x86_64, the `@aarch64` one
/// there), else `portable`. Each `call` is to a function compiled with `#[target_feature]` for
/// exactly that field's instructions; this is the one place such calls are made.
macro_rules! fastest {
    ($($feature:ident => $fast:expr,)* $(@aarch64 { $($arm:ident => $arm_fast:expr,)* })? _ => $portable:expr $(,)?) => {{
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
        $(
            #[cfg(target_arch = "aarch64")]
            {
                let isa = $crate::backend::cpu::isa::isa();
                $(
                    if isa.$arm {
                        // SAFETY: as above, for `$arm`'s instructions.
                        #[allow(unsafe_code)]
                        let out = unsafe { $arm_fast };
                        return out;
                    }
                )*
            }
        )?
        $portable
    }};
}
pub(super) use fastest;

#[cfg(test)]
mod tests {
    use super::*;

    /// `KVLENS_CPU_ISA` caps what is found, never adds to it; `native` caps nothing.
    #[test]
    fn caps_only_remove_sets() {
        let all = Isa {
            neon: false,
            avx2_fma: true,
            avx512_fma: true,
            avx512_vnni: true,
            avx512_bf16: true,
            avx512_split: true,
            amx_bf16: true,
        };
        let sets = |i: Isa| {
            [
                i.avx2_fma,
                i.avx512_fma,
                i.avx512_vnni,
                i.avx512_bf16,
                i.avx512_split,
                i.amx_bf16,
            ]
        };
        assert_eq!(sets(all.capped(None)), [true; 6]);
        assert_eq!(sets(all.capped(Some("native"))), [true; 6]);
        assert_eq!(
            sets(all.capped(Some("avx2"))),
            [true, false, false, false, false, false]
        );
        assert_eq!(sets(all.capped(Some("portable"))), [false; 6]);
        assert_eq!(sets(Isa::default().capped(Some("avx2"))), [false; 6]);
    }
}
