//! The two element types of the direct convolutions: bf16 (two channels, or two positions, in
//! each 32-bit lane, multiplied by `vdpbf16ps`) and f32 (one in each lane, `vfmadd231ps`).
//!
//! Everything else — the layouts, the packing, the tiles, the transposed stores — is one
//! generic code path: a lane is 32 bits either way, and only loading lanes, the multiply-add and
//! the store of a run of sums differ. Those are the hooks below, inlined into kernels compiled
//! with the element's target features ([`with_features`]).

use half::bf16;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

mod private {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// An element type of the direct convolutions: `bf16` or `f32` (sealed).
pub trait Element: Copy + Send + Sync + PartialEq + std::fmt::Debug + private::Sealed + 'static {
    /// Values one 32-bit lane holds: two neighbouring channels of the images and weights (two
    /// neighbouring positions of the output gradients) for bf16, one for f32.
    const PER_LANE: usize;
    /// True when the kernels need AVX512-BF16 (`vdpbf16ps`).
    const DOT: bool;
    /// Zero.
    const ZERO: Self;
    /// The lane of `lo` (with `hi` in its high half when a lane holds two).
    fn lane(lo: Self, hi: Self) -> u32;
    /// True when this CPU runs the kernels for this element: AVX-512F, BW and VL, and
    /// AVX512-BF16 for bf16.
    fn available() -> bool;

    /// 16 lanes: lane i holds value i of the run at `lo` (and of the run at `hi` when a lane
    /// holds two; zero when `hi` is `None`); lanes past `n` ≤ 16 are zero and not read.
    ///
    /// # Safety
    /// Compiled into a kernel with the element's features; `n` values readable at each run.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn lanes(lo: *const Self, hi: Option<*const Self>, n: usize) -> __m512i;
    /// The first `values` ≤ `16 · PER_LANE` values at `at` as they lie in memory (zeros past them).
    ///
    /// # Safety
    /// As [`Element::lanes`], `values` values readable at `at`.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn run(at: *const Self, values: usize) -> __m512i;
    /// `acc` plus the 32-bit lane at `x`, broadcast, times the 16 lanes of `w` (each lane's one
    /// or two products summed in f32).
    ///
    /// # Safety
    /// As [`Element::lanes`], 32 bits readable at `x`.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn madd(acc: __m512, x: *const u32, w: __m512i) -> __m512;
    /// The f32 sums' first lanes (those set in `mask`) stored at `dst` as elements (bf16: each
    /// rounded to nearest even once, as `round_bf16`).
    ///
    /// # Safety
    /// As [`Element::lanes`], the masked lanes writable at `dst`.
    #[cfg(target_arch = "x86_64")]
    #[doc(hidden)]
    unsafe fn store(dst: *mut Self, mask: u16, sums: __m512);
}

/// The mask of the first `n` ≤ 32 lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn first(n: usize) -> u32 {
    if n >= 32 {
        u32::MAX
    } else {
        (1u32 << n) - 1
    }
}

impl Element for bf16 {
    const PER_LANE: usize = 2;
    const DOT: bool = true;
    const ZERO: Self = bf16::ZERO;
    fn lane(lo: Self, hi: Self) -> u32 {
        lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
    }
    fn available() -> bool {
        super::super::gemm::bf16::available() && <f32 as Element>::available()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn lanes(lo: *const Self, hi: Option<*const Self>, n: usize) -> __m512i {
        let load = first(n) as u16;
        // SAFETY: the caller's contract (n values at each run; lanes past n are not read).
        unsafe {
            let l = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, lo.cast()));
            match hi {
                Some(hi) => {
                    let h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(load, hi.cast()));
                    _mm512_or_si512(l, _mm512_slli_epi32::<16>(h))
                }
                None => l,
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn run(at: *const Self, values: usize) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe { _mm512_maskz_loadu_epi16(first(values), at.cast()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn madd(acc: __m512, x: *const u32, w: __m512i) -> __m512 {
        // SAFETY: the caller's contract; the transmutes reinterpret 512 bits.
        unsafe {
            let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(x.read_unaligned() as i32));
            _mm512_dpbf16_ps(acc, a, std::mem::transmute::<__m512i, __m512bh>(w))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store(dst: *mut Self, mask: u16, sums: __m512) {
        // SAFETY: the caller's contract; `vcvtneps2bf16` rounds to nearest even.
        unsafe {
            let h: __m256bh = _mm512_cvtneps_pbh(sums);
            _mm256_mask_storeu_epi16(dst.cast(), mask, std::mem::transmute::<__m256bh, __m256i>(h));
        }
    }
}

impl Element for f32 {
    const PER_LANE: usize = 1;
    const DOT: bool = false;
    const ZERO: Self = 0.0;
    fn lane(lo: Self, _: Self) -> u32 {
        lo.to_bits()
    }
    fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn lanes(lo: *const Self, _: Option<*const Self>, n: usize) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe { _mm512_maskz_loadu_epi32(first(n) as u16, lo.cast()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn run(at: *const Self, values: usize) -> __m512i {
        // SAFETY: the caller's contract.
        unsafe { _mm512_maskz_loadu_epi32(first(values) as u16, at.cast()) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn madd(acc: __m512, x: *const u32, w: __m512i) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_fmadd_ps(_mm512_set1_ps(x.cast::<f32>().read_unaligned()), _mm512_castsi512_ps(w), acc) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store(dst: *mut Self, mask: u16, sums: __m512) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_mask_storeu_ps(dst, mask, sums) }
    }
}

/// `$vis unsafe fn $name<E: Element>(args)`: calls `$inner::<E, consts…>(args)` (an `#[inline(always)]`
/// kernel built from the hooks above) compiled with E's target features, so that every hook and
/// intrinsic is inlined into it. Callers check [`Element::available`] first.
#[cfg(target_arch = "x86_64")]
macro_rules! with_features {
    ($(#[$m:meta])* $vis:vis unsafe fn $name:ident => $inner:ident $(::<$($c:literal),*>)? ($($a:ident : $t:ty),* $(,)?)) => {
        $(#[$m])*
        $vis unsafe fn $name<E: Element>($($a: $t),*) {
            #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
            unsafe fn plain<E: Element>($($a: $t),*) {
                // SAFETY: the caller's contract.
                unsafe { $inner::<E $($(, $c)*)?>($($a),*) }
            }
            #[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
            unsafe fn dot<E: Element>($($a: $t),*) {
                // SAFETY: the caller's contract.
                unsafe { $inner::<E $($(, $c)*)?>($($a),*) }
            }
            // SAFETY: the caller's contract: the CPU has E's features.
            unsafe {
                if E::DOT {
                    dot::<E>($($a),*)
                } else {
                    plain::<E>($($a),*)
                }
            }
        }
    };
}

/// Elsewhere the kernels do not exist ([`Element::available`] is false).
#[cfg(not(target_arch = "x86_64"))]
macro_rules! with_features {
    ($(#[$m:meta])* $vis:vis unsafe fn $name:ident => $inner:ident $(::<$($c:literal),*>)? ($($a:ident : $t:ty),* $(,)?)) => {
        $(#[$m])*
        $vis unsafe fn $name<E: Element>($($a: $t),*) {
            $(let _ = $a;)*
            unreachable!("the direct convolutions run on x86-64 only")
        }
    };
}
pub(super) use with_features;
