//! Matrix transposition for the products' operands: `dst[p · ld + i] = a(i, p)`, f32 by register
//! blocks — 16 × 16 in AVX-512 registers (16 loads, 64 shuffles, 16 stores a block) on CPUs with
//! AVX-512 ([`crate::cpu::avx512`]), 8 × 8 in AVX2 registers (8 loads, 24 shuffles, 8 stores)
//! on the others with AVX2 — the edges and other types element by element. Written through a
//! pointer, element by element where it lies, so that a destination may be one thread's columns
//! of a matrix whose other columns other threads write. A leaf of the gemm modules (it reads
//! [`Mat`]).
//!
//! Users: W's panels for the crate (`pack::fill_panel`, `tiles_f32`), x and y around the
//! transposed products (`transposed`), the bf16 pairs' panels (`pack`, 8 × 8 on 32-bit lanes).
//! W's panels in 16 × 16 blocks instead of 8 × 8 on AVX-512 made whole passes that take them
//! 1.02–1.04× faster (ViT-B/16 and ViT-S/16 at one image, 197 rows; the decoder's prefill at
//! 256 tokens; medians of 8 alternating rounds, BENCHMARKS.md "W read in place").

use super::blocking::Mat;

/// Rows (and lanes) of the AVX2 blocks.
pub(super) const T8: usize = 8;

/// `dst[p · ld + i] = a(i, p)` for every element of `a` (rows × cols): register blocks where
/// `a`'s rows are contiguous and T is f32 (see the module's doc), the edges (and everything else)
/// element by element. Writes those elements only, through the pointer.
///
/// # Safety
/// `dst.add(p · ld + i)` is valid for writes for every i < a.rows, p < a.cols, and nothing else
/// reads or writes those elements meanwhile.
pub(super) unsafe fn transpose<T: Copy + 'static>(dst: *mut T, ld: usize, a: Mat<'_, T>) {
    let (rows, cols) = (a.rows, a.cols);
    assert!(a.fits(), "the transposed matrix lies in its slice");
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let (mut whole_i, mut whole_p) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() && a.col_stride == 1 && rows > 0 && cols > 0 {
        let src: *const f32 = a.data.as_ptr().cast();
        if crate::cpu::avx512() {
            (whole_i, whole_p) = (rows / 16 * 16, cols / 16 * 16);
            // SAFETY: AVX-512F is present; T is f32; every (i, p) with i < rows, p < cols lies
            // at i·row_stride + p inside `a.data` (`fits`, col_stride 1); the writes are the
            // caller's.
            unsafe { blocks16(src, a.row_stride, (whole_i, whole_p), dst.cast(), ld) };
        } else if std::is_x86_feature_detected!("avx2") {
            (whole_i, whole_p) = (rows / T8 * T8, cols / T8 * T8);
            // SAFETY: as above, with AVX2.
            unsafe { blocks8(src, a.row_stride, (whole_i, whole_p), dst.cast(), ld) };
        }
    }
    for i in 0..rows {
        let ps = if i < whole_i { whole_p..cols } else { 0..cols };
        for p in ps {
            // SAFETY: i < rows, p < cols: the caller's contract.
            unsafe { dst.add(p * ld + i).write(a.data[i * a.row_stride + p * a.col_stride]) };
        }
    }
}

/// The 8 × 8 blocks of [`transpose`] on AVX2: as [`blocks16`], rows and cols multiples of 8.
///
/// # Safety
/// The CPU has AVX2; as [`blocks16`]'s otherwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn blocks8(src: *const f32, src_row: usize, (rows, cols): (usize, usize), dst: *mut f32, ld: usize) {
    for i0 in (0..rows).step_by(T8) {
        for p0 in (0..cols).step_by(T8) {
            let mut rows8 = [std::ptr::null::<u8>(); T8];
            for (r, row) in rows8.iter_mut().enumerate() {
                *row = src.wrapping_add((i0 + r) * src_row + p0).cast();
            }
            // SAFETY: rows i0..i0 + 8 hold elements p0..p0 + 8 (readable, the caller's
            // contract); lanes (p0 + p)·ld + i0.. for p < 8 are writable.
            unsafe { transpose8x8(rows8, dst.add(p0 * ld + i0).cast(), ld) };
        }
    }
}

/// The 16 × 16 blocks of [`transpose`]: `dst[p · ld + i] = src[i · src_row + p]` for i < rows,
/// p < cols, both multiples of 16. Per block 16 loads, 64 shuffles and 16 stores.
///
/// # Safety
/// The CPU has AVX-512F; `src[i · src_row + p]` is readable and `dst[p · ld + i]` writable (and
/// untouched by others) for those i and p.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn blocks16(src: *const f32, src_row: usize, (rows, cols): (usize, usize), dst: *mut f32, ld: usize) {
    use std::arch::x86_64::*;
    let lo = |a: __m512, b: __m512| _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    let hi = |a: __m512, b: __m512| _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
    for i0 in (0..rows).step_by(16) {
        for p0 in (0..cols).step_by(16) {
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, reg) in r.iter_mut().enumerate() {
                // SAFETY: row i0 + i, elements p0..p0 + 16: readable (the caller's contract).
                *reg = unsafe { _mm512_loadu_ps(src.add((i0 + i) * src_row + p0)) };
            }
            // Lanes of row pairs interleaved, then lane pairs, then 128-bit quarters twice: row
            // q of the result holds lane q of every source row.
            let mut t = [_mm512_setzero_ps(); 16];
            for q in 0..8 {
                t[2 * q] = _mm512_unpacklo_ps(r[2 * q], r[2 * q + 1]);
                t[2 * q + 1] = _mm512_unpackhi_ps(r[2 * q], r[2 * q + 1]);
            }
            for q in 0..4 {
                let b = 4 * q;
                r[b] = lo(t[b], t[b + 2]);
                r[b + 1] = hi(t[b], t[b + 2]);
                r[b + 2] = lo(t[b + 1], t[b + 3]);
                r[b + 3] = hi(t[b + 1], t[b + 3]);
            }
            for h in 0..2 {
                let b = 8 * h;
                for q in 0..4 {
                    t[b + q] = _mm512_shuffle_f32x4::<0x88>(r[b + q], r[b + q + 4]);
                    t[b + q + 4] = _mm512_shuffle_f32x4::<0xdd>(r[b + q], r[b + q + 4]);
                }
            }
            for q in 0..8 {
                r[q] = _mm512_shuffle_f32x4::<0x88>(t[q], t[q + 8]);
                r[q + 8] = _mm512_shuffle_f32x4::<0xdd>(t[q], t[q + 8]);
            }
            for (p, reg) in r.iter().enumerate() {
                // SAFETY: depth p0 + p, rows i0..i0 + 16: writable (the caller's contract).
                unsafe { _mm512_storeu_ps(dst.add((p0 + p) * ld + i0), *reg) };
            }
        }
    }
}

/// Eight rows of eight 32-bit lanes transposed: lane p of row r to `dst[p · stride + r]`.
///
/// # Safety
/// The CPU has AVX2; each `src[r]` is readable for 32 bytes; `dst[p · stride..][..8]` is
/// writable for every p < 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose8x8(src: [*const u8; T8], dst: *mut u32, stride: usize) {
    use std::arch::x86_64::*;
    // A loop, not `std::array::from_fn` (whose closure is not inlined under target features).
    let mut r = [_mm256_setzero_si256(); T8];
    for (reg, row) in r.iter_mut().zip(&src) {
        // SAFETY: 32 readable bytes (the caller's contract), read unaligned.
        *reg = unsafe { _mm256_loadu_si256(row.cast()) };
    }
    // Pairs of rows interleaved by lane, then by lane pairs, then the 128-bit halves exchanged.
    let t = [
        _mm256_unpacklo_epi32(r[0], r[1]),
        _mm256_unpackhi_epi32(r[0], r[1]),
        _mm256_unpacklo_epi32(r[2], r[3]),
        _mm256_unpackhi_epi32(r[2], r[3]),
        _mm256_unpacklo_epi32(r[4], r[5]),
        _mm256_unpackhi_epi32(r[4], r[5]),
        _mm256_unpacklo_epi32(r[6], r[7]),
        _mm256_unpackhi_epi32(r[6], r[7]),
    ];
    let u = [
        _mm256_unpacklo_epi64(t[0], t[2]),
        _mm256_unpackhi_epi64(t[0], t[2]),
        _mm256_unpacklo_epi64(t[1], t[3]),
        _mm256_unpackhi_epi64(t[1], t[3]),
        _mm256_unpacklo_epi64(t[4], t[6]),
        _mm256_unpackhi_epi64(t[4], t[6]),
        _mm256_unpacklo_epi64(t[5], t[7]),
        _mm256_unpackhi_epi64(t[5], t[7]),
    ];
    let out = [
        _mm256_permute2x128_si256::<0x20>(u[0], u[4]),
        _mm256_permute2x128_si256::<0x20>(u[1], u[5]),
        _mm256_permute2x128_si256::<0x20>(u[2], u[6]),
        _mm256_permute2x128_si256::<0x20>(u[3], u[7]),
        _mm256_permute2x128_si256::<0x31>(u[0], u[4]),
        _mm256_permute2x128_si256::<0x31>(u[1], u[5]),
        _mm256_permute2x128_si256::<0x31>(u[2], u[6]),
        _mm256_permute2x128_si256::<0x31>(u[3], u[7]),
    ];
    for (p, o) in out.iter().enumerate() {
        // SAFETY: lanes p·stride..p·stride + 8 are writable (the caller's contract).
        unsafe { _mm256_storeu_si256(dst.add(p * stride).cast(), *o) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transposition under test: the destination, its `ld`, the source.
    type Body<'f, T> = &'f dyn Fn(*mut T, usize, Mat<'_, T>);

    /// `body` against the definition: whole blocks, ragged edges both ways, rows of the source
    /// wider than its columns, a destination with room between its rows that stays untouched.
    fn check<T: Copy + PartialEq + std::fmt::Debug>(of: impl Fn(usize) -> T, gap: T, body: Body<'_, T>) {
        for rows in [1, 7, 8, 15, 16, 17, 33, 64] {
            for cols in [1, 8, 16, 31, 48] {
                let (src_row, ld) = (cols + 3, rows + 5);
                let src: Vec<T> = (0..rows * src_row).map(&of).collect();
                let a = Mat { data: &src[..], rows, cols, row_stride: src_row, col_stride: 1 };
                let mut dst = vec![gap; cols * ld];
                body(dst.as_mut_ptr(), ld, a);
                for p in 0..cols {
                    for i in 0..ld {
                        let want = if i < rows { src[i * src_row + p] } else { gap };
                        assert_eq!(dst[p * ld + i], want, "{rows}×{cols} at ({i}, {p})");
                    }
                }
            }
        }
    }

    /// f32 through the dispatch, f64 element by element, and each register body this CPU has
    /// (AVX-512's 16 × 16, AVX2's 8 × 8) on its whole blocks, the edges by a plain loop.
    #[test]
    fn transposes_by_definition() {
        check(|i| i as f32, -1.0, &|dst, ld, a| {
            // SAFETY: `check` hands a destination of cols runs of ld ≥ rows elements.
            unsafe { transpose(dst, ld, a) }
        });
        check(|i| i as f64, -1.0, &|dst, ld, a| {
            // SAFETY: as above.
            unsafe { transpose(dst, ld, a) }
        });
        #[cfg(target_arch = "x86_64")]
        {
            type Blocks = unsafe fn(*const f32, usize, (usize, usize), *mut f32, usize);
            let by = |blocks: Blocks, n: usize| {
                move |dst: *mut f32, ld: usize, a: Mat<'_, f32>| {
                    let whole = (a.rows / n * n, a.cols / n * n);
                    // SAFETY: the CPU has the body's instructions (checked below); the whole
                    // blocks lie inside `a` (row-major) and the destination (`check`'s).
                    unsafe { blocks(a.data.as_ptr(), a.row_stride, whole, dst, ld) };
                    for i in 0..a.rows {
                        for p in (0..a.cols).filter(|&p| i >= whole.0 || p >= whole.1) {
                            // SAFETY: inside the destination (`check`'s).
                            unsafe { dst.add(p * ld + i).write(a.data[i * a.row_stride + p]) };
                        }
                    }
                }
            };
            if std::is_x86_feature_detected!("avx512f") {
                check(|i| i as f32, -1.0, &by(blocks16, 16));
            }
            if std::is_x86_feature_detected!("avx2") {
                check(|i| i as f32, -1.0, &by(blocks8, T8));
            }
        }
    }
}
