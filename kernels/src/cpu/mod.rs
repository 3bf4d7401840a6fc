//! wick's CPU compute kernels over plain slices, without candle's types: matrix products
//! ([`gemm`]: f32/f64 through the `gemm` crate, bf16 with f32 sums on AVX512-BF16 or AMX),
//! direct convolutions on the images in place, bf16 and f32 on AVX-512 ([`conv`]), the
//! vectorisable `exp`/`erf` and the widest-vector dispatch ([`math`]), batch norm's sums
//! ([`bn_sums`]: backward's and the statistics'), max pooling's window sweep ([`pool`]), the
//! exponentials of attention's softmax rows ([`softmax`]), cross-entropy's log-sum-exps and
//! probabilities over a vocabulary ([`cross_entropy`]), the optimizer updates ([`optim`]),
//! and the helpers every slice kernel shares: parallel ranges ([`par_ranges`]), disjoint writes
//! from many threads ([`SharedMut`]), f64 lane sums ([`lane_sums`]) and bf16 rounding
//! ([`round_bf16`]). wick-nn wraps them as candle ops with
//! their backward passes.

pub mod bn_sums;
pub mod conv;
pub mod cross_entropy;
pub mod gemm;
pub mod math;
pub mod optim;
pub mod pool;
pub mod softmax;

use half::bf16;

/// A kernel's arguments do not fit together (shapes, strides, lengths) or the CPU lacks what
/// the kernel needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelError {
    /// The kernel.
    pub kernel: &'static str,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kernel, self.message)
    }
}

impl std::error::Error for KernelError {}

/// `x` rounded to bf16, to nearest even; a NaN keeps its sign and becomes quiet (rounding
/// could carry its payload to ±inf). The same result as `half::bf16::from_f32`, in a form that
/// vectorises.
#[inline(always)]
pub fn round_bf16(x: f32) -> bf16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let nan = ((bits >> 16) as u16) | 0x0040;
    bf16::from_bits(if x.is_nan() { nan } else { rounded })
}

/// True when the CPU has AVX-512F and `WICK_CPU_AVX512` is not `0` (decided once per process).
/// The kernels that choose between AVX-512 and AVX2 code ([`math::vectorized`], wick-nn's wide
/// kernels, the f32 products of a few rows along the depth, the blocks and panels in which the
/// other f32 products reach the `gemm` crate) ask here, so that `WICK_CPU_AVX512=0` measures an
/// AVX2 machine's paths on an AVX-512 one. The `gemm` crate (the other f32 products;
/// its AVX-512 kernels are a build feature) and the kernels that need AVX-512 itself (bf16, AMX,
/// the direct convolutions) keep their own checks.
pub fn avx512() -> bool {
    static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX512.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f") && std::env::var_os("WICK_CPU_AVX512").is_none_or(|v| v != "0")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Lanes of the f64 sums below: independent accumulators, so the loops vectorise (a single
/// running float sum cannot be reordered by the compiler).
pub const LANES: usize = 8;

/// `K` sums at once, `Σ f(a[i], b[i])[k]` over the common length in f64: for each sum, element
/// `i` is added into accumulator `i mod LANES`, the remainder after the last whole group of
/// lanes summed apart, and the lanes then summed. Fixed-width chunks, so that where it is inlined
/// into code compiled for wide vectors the loop vectorises (the per-index form kept its bounds
/// checks and ran scalar). Sums taken together equal the same sums taken alone, to the bit.
#[inline(always)]
pub fn lane_sums<const K: usize, T: Copy>(a: &[T], b: &[T], f: impl Fn(T, T) -> [f64; K]) -> [f64; K] {
    let n = a.len().min(b.len());
    let (ac, bc) = (a[..n].chunks_exact(LANES), b[..n].chunks_exact(LANES));
    let (ar, br) = (ac.remainder(), bc.remainder());
    let mut acc = [[0.0f64; LANES]; K];
    for (xa, xb) in ac.zip(bc) {
        for j in 0..LANES {
            let terms = f(xa[j], xb[j]);
            for k in 0..K {
                acc[k][j] += terms[k];
            }
        }
    }
    let mut tail = [-0.0f64; K];
    for (x, y) in ar.iter().zip(br) {
        let terms = f(*x, *y);
        for k in 0..K {
            tail[k] += terms[k];
        }
    }
    std::array::from_fn(|k| acc[k].iter().sum::<f64>() + tail[k])
}

/// Splits `0..n` into about one chunk per thread (at least `min` items each) and runs `f` on
/// each chunk's range in parallel, compiled for the CPU's widest vector instructions.
pub fn par_ranges(n: usize, min: usize, f: impl Fn(std::ops::Range<usize>) + Send + Sync) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads().max(1);
    let chunk = n.div_ceil(threads).max(min.max(1));
    let chunks = n.div_ceil(chunk);
    if chunks <= 1 {
        // Too little work to share: no hand-over to the thread pool.
        return math::vectorized(|| f(0..n));
    }
    // Each chunk runs compiled for the CPU's widest vectors (see `math::vectorized`).
    (0..chunks).into_par_iter().for_each(|c| math::vectorized(|| f(c * chunk..((c + 1) * chunk).min(n))));
}

/// A mutable slice shared between threads that write disjoint parts of it. It borrows the slice
/// for `'a`, so the slice outlives every part handed out (only their disjointness is left to
/// [`SharedMut::range`]'s caller).
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    borrow: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: users write disjoint ranges only (each `range` call's contract).
unsafe impl<T: Send> Send for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    /// Shares `v` for the parts to be handed out.
    pub fn new(v: &'a mut [T]) -> Self {
        SharedMut { ptr: v.as_mut_ptr(), len: v.len(), borrow: std::marker::PhantomData }
    }

    /// A pointer to element `start` (at most the length), for writers whose parts interleave
    /// (columns of a row-major matrix): each writes only its own elements, as with [`Self::range`].
    pub fn ptr_at(&self, start: usize) -> *mut T {
        assert!(start <= self.len, "SharedMut: start out of bounds");
        // SAFETY: in bounds or one past the end (checked).
        unsafe { self.ptr.add(start) }
    }

    /// The elements `start..start + len`.
    ///
    /// # Safety
    /// No two live slices obtained from this value overlap.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start.checked_add(len).is_some_and(|end| end <= self.len), "SharedMut: range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rounding case against the `half` crate's conversion: ties both ways, the largest
    /// finite values (rounding up to infinity), infinities, subnormals, signed zeros, NaNs of
    /// both signs with payloads that rounding would carry out of the mantissa, and a sweep.
    #[test]
    fn bf16_rounding_is_halfs() {
        let mut bits: Vec<u32> = vec![
            0x0000_0000,
            0x8000_0000,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x7F7F_FFFF,
            0xFF7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x0000_0001,
            0x8000_8000,
            0x7F80_0001,
            0xFFFF_FFFF,
            0x7FC0_0000,
            0x7FBF_FFFF,
        ];
        bits.extend((0..=u32::MAX).step_by(65_537));
        for b in bits {
            let x = f32::from_bits(b);
            assert_eq!(round_bf16(x).to_bits(), bf16::from_f32(x).to_bits(), "{b:#010x}");
        }
    }
}
