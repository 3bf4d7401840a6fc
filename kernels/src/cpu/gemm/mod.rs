//! Matrix products over slices, with the dimensions and strides checked against the slices
//! before any pointer is formed: f32 and f64 through the `gemm` crate (the crate candle's CPU
//! matmul uses, with its AVX-512 kernels), bf16 × bf16 with f32 sums on CPUs with AVX512-BF16
//! ([`bf16`], on AMX's tile unit where there is one). The modules form a tree: `blocking` (the
//! matrix view and the bf16 blocking) is the leaf; `pack` and `amx` use it; `operand` (packed
//! and row-wise operands) uses `blocking` and `pack`; `along_k` (products whose operands both
//! lie along the depth, in place) uses `blocking`; [`bf16`] uses them all and chooses the unit
//! and the kernel.

pub(crate) mod along_k;
mod amx;
pub mod bf16;
mod blocking;
mod operand;
mod pack;

pub use blocking::Mat;

use crate::cpu::KernelError;

/// An element type the `gemm` crate multiplies here: f32 or f64 (sealed).
pub trait Scalar: Copy + Default + Send + Sync + 'static + sealed::Sealed {
    /// 1.
    const ONE: Self;
}

impl Scalar for f32 {
    const ONE: f32 = 1.0;
}

impl Scalar for f64 {
    const ONE: f64 = 1.0;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// `dst (m × n, row-major) = beta·a·b + (dst if accumulate)`, parallel inside the product when
/// `parallel` (use false when the caller already runs one product per thread).
pub fn gemm<T: Scalar>(
    dst: &mut [T],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    accumulate: bool,
    parallel: bool,
) -> Result<(), KernelError> {
    let Some((m, k, n)) = blocking::product_dims("wick gemm", &a, &b, dst, accumulate)? else {
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
            T::ONE,
            beta,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
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
