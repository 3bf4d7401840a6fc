//! Matrix products through the `gemm` crate (the crate candle's CPU matmul uses), with the
//! dimensions and strides checked against the slices before any pointer is formed.

use candle_core::Result;

use super::Real;

/// A read-only matrix view: `rows × cols` elements of `data`, element (i, j) at
/// `i * row_stride + j * col_stride`. Transposing is swapping the two.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
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
    fn fits(&self) -> bool {
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
    what: &str,
    a: &Mat<'_, T>,
    b: &Mat<'_, T>,
    dst: &mut [D],
    accumulate: bool,
) -> Result<Option<(usize, usize, usize)>> {
    let (m, k, n, len) = (a.rows, a.cols, b.cols, dst.len());
    if b.rows != k || !a.fits() || !b.fits() || m.checked_mul(n).is_none_or(|mn| mn > len) {
        return Err(candle_core::Error::Msg(format!(
            "{what}: ({}×{})·({}×{}) into {len} elements",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    if k == 0 && !accumulate {
        dst[..m * n].fill(D::default());
    }
    Ok((m > 0 && n > 0 && k > 0).then_some((m, k, n)))
}

/// `dst (m × n, row-major) = beta·a·b + (dst if accumulate)`, parallel inside the product when
/// `parallel` (use false when the caller already runs one product per thread).
pub(crate) fn gemm<T: Real>(
    dst: &mut [T],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    accumulate: bool,
    parallel: bool,
) -> Result<()> {
    let Some((m, k, n)) = product_dims("wick gemm", &a, &b, dst, accumulate)? else {
        return Ok(());
    };
    let threads = rayon::current_num_threads();
    let parallelism =
        if parallel && threads > 1 { ::gemm::Parallelism::Rayon(threads) } else { ::gemm::Parallelism::None };
    // SAFETY: every element of `a`, `b` and the m×n row-major destination lies inside its slice
    // (checked above), strides fit in isize (they index slices), and `dst` does not alias the
    // inputs (a `&mut` borrow).
    unsafe {
        ::gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            T::one(),
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

/// The element type of a product's operands for the compute type `T`: `T` itself (the `gemm`
/// crate), or bf16 with f32 sums ([`super::gemm_bf16`], for bf16 tensors on CPUs with
/// AVX512-BF16), so an op generic over it multiplies its matrices as stored.
pub(crate) trait Operand<T>: Copy + Default + Send + Sync + 'static {
    /// `dst = beta·a·b + (dst if accumulate)` (see [`gemm`]).
    fn product(
        dst: &mut [T],
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        beta: T,
        accumulate: bool,
        parallel: bool,
    ) -> Result<()>;
}

impl<T: Real> Operand<T> for T {
    fn product(dst: &mut [T], a: Mat<'_, T>, b: Mat<'_, T>, beta: T, accumulate: bool, parallel: bool) -> Result<()> {
        gemm(dst, a, b, beta, accumulate, parallel)
    }
}

impl Operand<f32> for half::bf16 {
    fn product(
        dst: &mut [f32],
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        beta: f32,
        accumulate: bool,
        parallel: bool,
    ) -> Result<()> {
        super::gemm_bf16::gemm_bf16(dst, a, b, beta, accumulate, parallel)
    }
}

/// The element type a product of operands `P` is written in: the compute type `T`, or bf16 with
/// each sum rounded as it is stored ([`super::gemm_bf16::gemm_bf16_rounded`]).
pub(crate) trait Out<T, P>: Copy + Default + Send + Sync + 'static {
    /// `dst = a·b`.
    fn product(dst: &mut [Self], a: Mat<'_, P>, b: Mat<'_, P>, parallel: bool) -> Result<()>;
}

impl<T: Real, P: Operand<T>> Out<T, P> for T {
    fn product(dst: &mut [T], a: Mat<'_, P>, b: Mat<'_, P>, parallel: bool) -> Result<()> {
        P::product(dst, a, b, T::one(), false, parallel)
    }
}

impl Out<f32, half::bf16> for half::bf16 {
    fn product(dst: &mut [Self], a: Mat<'_, Self>, b: Mat<'_, Self>, parallel: bool) -> Result<()> {
        super::gemm_bf16::gemm_bf16_rounded(dst, a, b, parallel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: Mat<'_, f64>, b: Mat<'_, f64>) -> Vec<f64> {
        let mut out = vec![0.0; a.rows * b.cols];
        for i in 0..a.rows {
            for j in 0..b.cols {
                out[i * b.cols + j] = (0..a.cols)
                    .map(|p| a.data[i * a.row_stride + p * a.col_stride] * b.data[p * b.row_stride + j * b.col_stride])
                    .sum();
            }
        }
        out
    }

    #[test]
    fn products_with_transposes_match_a_naive_loop() {
        let a: Vec<f64> = (0..35).map(|i| (i as f64 * 0.37).sin()).collect();
        let b: Vec<f64> = (0..35).map(|i| (i as f64 * 0.11).cos()).collect();
        // (5×7)·(7×5), (5×7)·(5×7)ᵀ, (7×5)ᵀ·(7×5).
        for (ma, mb) in [
            (Mat::rows(&a, 5, 7), Mat::rows(&b, 7, 5)),
            (Mat::rows(&a, 5, 7), Mat::rows(&b, 5, 7).t()),
            (Mat::rows(&a, 7, 5).t(), Mat::rows(&b, 7, 5)),
        ] {
            let mut out = vec![1.0; ma.rows * mb.cols];
            gemm(&mut out, ma, mb, 1.0, false, true).unwrap();
            let expected = naive(ma, mb);
            assert!(out.iter().zip(&expected).all(|(x, y)| (x - y).abs() < 1e-12));
            // Accumulating adds to what is there.
            gemm(&mut out, ma, mb, 2.0, true, false).unwrap();
            assert!(out.iter().zip(&expected).all(|(x, y)| (x - 3.0 * y).abs() < 1e-12));
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let a = vec![0f32; 6];
        let mut out = vec![0f32; 4];
        assert!(gemm(&mut out, Mat::rows(&a, 2, 3), Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
        assert!(gemm(&mut out, Mat::rows(&a, 3, 2), Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
        let short = Mat { data: &a[..5], rows: 2, cols: 3, row_stride: 3, col_stride: 1 };
        assert!(gemm(&mut out, short, Mat::rows(&a, 3, 2), 1.0, false, false).is_err());
    }
}
