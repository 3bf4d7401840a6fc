//! The matrix products of wick's candle ops: `wick_kernels::cpu::gemm` with its errors as
//! candle's (the kernel error kept as the source), and the operand and output element types an
//! op generic over them multiplies as stored.

use candle_core::Result;
use wick_kernels::cpu::gemm as kernel;
use wick_kernels::cpu::KernelError;

use super::Real;

pub(crate) use kernel::Mat;

/// A kernel's error as candle's, keeping it as the source.
fn candle(e: KernelError) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// `dst (m × n, row-major) = beta·a·b + (dst if accumulate)`, parallel inside the product when
/// `parallel` ([`kernel::gemm`]).
pub(crate) fn gemm<T: Real>(
    dst: &mut [T],
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    beta: T,
    accumulate: bool,
    parallel: bool,
) -> Result<()> {
    kernel::gemm(dst, a, b, beta, accumulate, parallel).map_err(candle)
}

/// bf16 × bf16 products with f32 sums ([`kernel::bf16`]).
pub(crate) mod gemm_bf16 {
    use candle_core::Result;
    use half::bf16;
    use wick_kernels::cpu::gemm::bf16 as kernel;

    use super::{candle, Mat};

    pub(crate) use kernel::{available, rounds_directly};

    /// [`kernel::gemm_bf16`].
    pub(crate) fn gemm_bf16(
        dst: &mut [f32],
        a: Mat<'_, bf16>,
        b: Mat<'_, bf16>,
        beta: f32,
        accumulate: bool,
        parallel: bool,
    ) -> Result<()> {
        kernel::gemm_bf16(dst, a, b, beta, accumulate, parallel).map_err(candle)
    }

    /// [`kernel::gemm_bf16_rounded`].
    pub(crate) fn gemm_bf16_rounded(
        dst: &mut [bf16],
        a: Mat<'_, bf16>,
        b: Mat<'_, bf16>,
        parallel: bool,
    ) -> Result<()> {
        kernel::gemm_bf16_rounded(dst, a, b, parallel).map_err(candle)
    }
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
        gemm_bf16::gemm_bf16(dst, a, b, beta, accumulate, parallel)
    }
}

/// The element type a product of operands `P` is written in: the compute type `T`, or bf16 with
/// each sum rounded as it is stored ([`gemm_bf16::gemm_bf16_rounded`]).
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
        gemm_bf16::gemm_bf16_rounded(dst, a, b, parallel)
    }
}
