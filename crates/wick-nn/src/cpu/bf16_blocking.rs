//! The blocking that wick's bf16 products share, whichever unit multiplies ([`super::gemm_bf16`]
//! with AVX512-BF16's `vdpbf16ps`, [`super::gemm_amx`] on AMX's tiles): the depth and column
//! block sizes, the destination element types, how an operand is read along k, and the part of
//! the destination one thread computes. Both kernels depend on it and it on neither.

use half::bf16;

/// Depth of a packed slice, in k-pairs (512 bf16 values of k).
pub(super) const KC: usize = 256;
/// Columns of a block.
pub(super) const NC: usize = 512;

/// A destination element type: f32 sums, or bf16 (rounded once, never accumulated into).
pub(super) trait Dest: Copy + Default + Send + Sync + 'static {
    /// `dst = beta·sums (+ dst when add)`.
    fn put(dst: &mut [Self], sums: &[f32], beta: f32, add: bool);
    /// The same for 16 sums in a register, at `at`.
    ///
    /// # Safety
    /// `at` points at 16 writable elements; the CPU has AVX512-BF16 and AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn put16(at: *mut Self, sums: std::arch::x86_64::__m512, beta: std::arch::x86_64::__m512, add: bool);
}

impl Dest for f32 {
    fn put(dst: &mut [f32], sums: &[f32], beta: f32, add: bool) {
        if add {
            dst.iter_mut().zip(sums).for_each(|(d, s)| *d += beta * s);
        } else {
            dst.iter_mut().zip(sums).for_each(|(d, s)| *d = beta * s);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn put16(at: *mut f32, sums: std::arch::x86_64::__m512, beta: std::arch::x86_64::__m512, add: bool) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract.
        unsafe {
            let x = if add { _mm512_fmadd_ps(sums, beta, _mm512_loadu_ps(at)) } else { _mm512_mul_ps(sums, beta) };
            _mm512_storeu_ps(at, x);
        }
    }
}

impl Dest for bf16 {
    fn put(dst: &mut [bf16], sums: &[f32], beta: f32, _add: bool) {
        dst.iter_mut().zip(sums).for_each(|(d, s)| *d = super::round_bf16(beta * s));
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn put16(at: *mut bf16, sums: std::arch::x86_64::__m512, beta: std::arch::x86_64::__m512, _add: bool) {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract. `vcvtneps2bf16` rounds to nearest even, as
        // `round_bf16` does (f32 subnormals, far below any sum here, become zero).
        unsafe {
            let h: __m256bh = _mm512_cvtneps_pbh(_mm512_mul_ps(sums, beta));
            _mm256_storeu_si256(at.cast(), std::mem::transmute::<__m256bh, __m256i>(h));
        }
    }
}

/// A matrix read along k: element (r, q) — r a row of `a` or a column of `b`, q the depth
/// index — at `r · outer + q · step`.
pub(super) struct KMajor<'a> {
    pub(super) data: &'a [bf16],
    pub(super) outer: usize,
    pub(super) step: usize,
}

/// Rows × columns of the destination (row-major, `n` columns) one thread computes.
#[derive(Clone)]
pub(super) struct Part<'a, D> {
    pub(super) out: &'a super::SharedMut<'a, D>,
    pub(super) n: usize,
    pub(super) rows: std::ops::Range<usize>,
    pub(super) cols: std::ops::Range<usize>,
}
