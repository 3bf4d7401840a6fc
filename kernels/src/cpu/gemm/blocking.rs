//! What the products share, the leaf of the gemm modules: the matrix view and its checks
//! ([`Mat`], [`product_dims`]), and the blocking of the bf16 products whichever unit multiplies
//! (`bf16` with AVX512-BF16's `vdpbf16ps`, `amx` on AMX's tiles): the depth and column block
//! sizes, the destination element types, how an operand is read along k, and the part of the
//! destination one thread computes. Every other gemm module depends on it and it on none.

use half::bf16;

use crate::cpu::{round_bf16, KernelError, SharedMut};

/// A read-only matrix view: `rows × cols` elements of `data`, element (i, j) at
/// `i * row_stride + j * col_stride`. Transposing is swapping the two.
#[derive(Clone, Copy)]
pub struct Mat<'a, T> {
    /// The elements.
    pub data: &'a [T],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Elements from one row to the next.
    pub row_stride: usize,
    /// Elements from one column to the next.
    pub col_stride: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major `rows × cols` matrix.
    pub fn rows(data: &'a [T], rows: usize, cols: usize) -> Self {
        Mat { data, rows, cols, row_stride: cols, col_stride: 1 }
    }

    /// The transpose (no copy).
    pub fn t(self) -> Self {
        Mat { rows: self.cols, cols: self.rows, row_stride: self.col_stride, col_stride: self.row_stride, ..self }
    }

    /// True when every element lies inside `data`.
    pub(super) fn fits(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        let last = (self.rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|a| (self.cols - 1).checked_mul(self.col_stride).and_then(|b| a.checked_add(b)));
        last.is_some_and(|l| l < self.data.len())
    }
}

/// (m, k, n) of `a·b` into the row-major destination `dst`, or None when the product is empty
/// (m or n is 0; k = 0 leaves zeros, or `dst` as it is when accumulating). An error unless the
/// inner dimensions agree and every element of `a`, `b` and the m × n destination lies inside its
/// slice.
pub(crate) fn product_dims<T, D: Copy + Default>(
    what: &'static str,
    a: &Mat<'_, T>,
    b: &Mat<'_, T>,
    dst: &mut [D],
    accumulate: bool,
) -> Result<Option<(usize, usize, usize)>, KernelError> {
    product_dims_of(what, (a.rows, a.cols, a.fits()), b, (dst, b.cols), accumulate)
}

/// [`product_dims`] for an `a` of `rows × cols` that lies inside its storage when `fits` (a
/// packed operand, checked when it was packed), into a destination whose rows lie `dst_row ≥ n`
/// elements apart (`b.cols` for a row-major m × n one; the elements between rows untouched).
pub(crate) fn product_dims_of<T, D: Copy + Default>(
    what: &'static str,
    (m, k, fits): (usize, usize, bool),
    b: &Mat<'_, T>,
    (dst, dst_row): (&mut [D], usize),
    accumulate: bool,
) -> Result<Option<(usize, usize, usize)>, KernelError> {
    check_product(what, (m, k, fits), b, (dst.len(), dst_row))?;
    let n = b.cols;
    if k == 0 && !accumulate && n > 0 {
        dst.chunks_mut(dst_row).take(m).for_each(|row| row[..n].fill(D::default()));
    }
    Ok((m > 0 && n > 0 && k > 0).then_some((m, k, n)))
}

/// The checks of [`product_dims_of`] against a destination of `len` elements, rows `dst_row`
/// apart, without touching it.
pub(crate) fn check_product<T>(
    what: &'static str,
    (m, k, fits): (usize, usize, bool),
    b: &Mat<'_, T>,
    (len, dst_row): (usize, usize),
) -> Result<(), KernelError> {
    let n = b.cols;
    // Elements from the destination's first to past its last: m rows dst_row apart, n the last.
    let extent = if m == 0 || n == 0 { Some(0) } else { (m - 1).checked_mul(dst_row).and_then(|e| e.checked_add(n)) };
    if b.rows != k || !fits || !b.fits() || dst_row < n || extent.is_none_or(|e| e > len) {
        let apart = if dst_row == n { String::new() } else { format!(", rows {dst_row} apart") };
        return Err(KernelError {
            kernel: what,
            message: format!("({m}×{k})·({}×{}) into {len} elements{apart}", b.rows, b.cols),
        });
    }
    Ok(())
}

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
        dst.iter_mut().zip(sums).for_each(|(d, s)| *d = round_bf16(beta * s));
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

impl<'a> KMajor<'a> {
    /// A left operand read along k: its rows, each along its columns.
    pub(super) fn rows_of(a: &Mat<'a, bf16>) -> Self {
        KMajor { data: a.data, outer: a.row_stride, step: a.col_stride }
    }

    /// A right operand read along k: its columns, each along its rows.
    pub(super) fn cols_of(b: &Mat<'a, bf16>) -> Self {
        KMajor { data: b.data, outer: b.col_stride, step: b.row_stride }
    }
}

/// Rows × columns of the destination (row-major, `n` columns) one thread computes.
#[derive(Clone)]
pub(super) struct Part<'a, D> {
    pub(super) out: &'a SharedMut<'a, D>,
    pub(super) n: usize,
    pub(super) rows: std::ops::Range<usize>,
    pub(super) cols: std::ops::Range<usize>,
}
