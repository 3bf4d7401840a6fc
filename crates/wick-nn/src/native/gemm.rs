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

/// `a·b` into memory that need not be initialised, its rows `dst_row` elements apart: the
/// n elements from each of the m rows' starts written, nothing else
/// ([`kernel::gemm_into_rows_apart`]).
pub(crate) fn gemm_into_rows_apart<T: Real>(
    dst: &mut [std::mem::MaybeUninit<T>],
    dst_row: usize,
    a: Mat<'_, T>,
    b: Mat<'_, T>,
    parallel: bool,
) -> Result<()> {
    kernel::gemm_into_rows_apart(dst, dst_row, a, b, T::one(), parallel).map_err(candle)
}

/// A fresh m × n `beta·a·b` (row-major), written into memory that is not zero-filled first
/// ([`kernel::gemm_into`]).
pub(crate) fn product<T: Real>(a: Mat<'_, T>, b: Mat<'_, T>, beta: T, parallel: bool) -> Result<Vec<T>> {
    let len = a
        .rows
        .checked_mul(b.cols)
        .ok_or_else(|| candle_core::Error::Msg(format!("linear: {} rows of {} outputs overflow", a.rows, b.cols)))?;
    let mut y: Vec<T> = Vec::with_capacity(len);
    kernel::gemm_into(&mut y.spare_capacity_mut()[..len], a, b, beta, parallel).map_err(candle)?;
    // SAFETY: `gemm_into` initialised the first `len` elements (the capacity holds them).
    unsafe { y.set_len(len) };
    Ok(y)
}

/// bf16 × bf16 products with f32 sums ([`kernel::bf16`]).
pub(crate) mod gemm_bf16 {
    use candle_core::Result;
    use half::bf16;
    use wick_kernels::cpu::gemm::bf16 as kernel;

    use super::{candle, Mat};

    pub(crate) use kernel::{available, rounds_directly, PackedA};

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
    /// A left operand prepared for many products with it: the matrix itself where the product
    /// packs its operands per call (the `gemm` crate), packed once for the bf16 kernel.
    type Lhs<'a>: Sync;

    /// `dst = beta·a·b + (dst if accumulate)` (see [`gemm`]).
    fn product(
        dst: &mut [T],
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        beta: T,
        accumulate: bool,
        parallel: bool,
    ) -> Result<()>;

    /// `a` prepared for products with about `n` columns each.
    fn lhs(a: Mat<'_, Self>, n: usize) -> Result<Self::Lhs<'_>>;

    /// The `m × k` left operand whose row r `fill(r, row)` writes, prepared as [`Operand::lhs`]
    /// (the bf16 kernel packs it a panel at a time and never stores it whole).
    fn lhs_rows(
        dims: (usize, usize),
        n: usize,
        fill: &(dyn Fn(usize, &mut [Self]) + Sync),
    ) -> Result<Self::Lhs<'static>>;

    /// [`Operand::product`] with a prepared `a`.
    fn product_by(dst: &mut [T], a: &Self::Lhs<'_>, b: Mat<'_, Self>, parallel: bool) -> Result<()>;
}

/// A matrix the `gemm` crate multiplies: borrowed, or made for the products (rows written by
/// [`Operand::lhs_rows`]).
pub(crate) enum MatBuf<'a, T> {
    Borrowed(Mat<'a, T>),
    Owned(Vec<T>, usize, usize),
}

impl<T: Copy> MatBuf<'_, T> {
    fn mat(&self) -> Mat<'_, T> {
        match self {
            MatBuf::Borrowed(m) => *m,
            MatBuf::Owned(data, rows, cols) => Mat::rows(data, *rows, *cols),
        }
    }
}

impl<T: Real> Operand<T> for T {
    type Lhs<'a> = MatBuf<'a, T>;

    fn product(dst: &mut [T], a: Mat<'_, T>, b: Mat<'_, T>, beta: T, accumulate: bool, parallel: bool) -> Result<()> {
        gemm(dst, a, b, beta, accumulate, parallel)
    }

    fn lhs(a: Mat<'_, T>, _: usize) -> Result<MatBuf<'_, T>> {
        Ok(MatBuf::Borrowed(a))
    }

    fn lhs_rows(
        (m, k): (usize, usize),
        _: usize,
        fill: &(dyn Fn(usize, &mut [T]) + Sync),
    ) -> Result<MatBuf<'static, T>> {
        let len = m.checked_mul(k).ok_or_else(|| candle_core::Error::Msg(format!("a {m}×{k} matrix overflows")))?;
        let mut data = vec![T::zero(); len];
        for (r, row) in data.chunks_exact_mut(k.max(1)).enumerate().take(m) {
            fill(r, row);
        }
        Ok(MatBuf::Owned(data, m, k))
    }

    fn product_by(dst: &mut [T], a: &MatBuf<'_, T>, b: Mat<'_, T>, parallel: bool) -> Result<()> {
        gemm(dst, a.mat(), b, T::one(), false, parallel)
    }
}

impl Operand<f32> for half::bf16 {
    type Lhs<'a> = gemm_bf16::PackedA;

    fn lhs(a: Mat<'_, Self>, n: usize) -> Result<gemm_bf16::PackedA> {
        gemm_bf16::PackedA::new(a, n).map_err(candle)
    }

    fn lhs_rows(
        dims: (usize, usize),
        n: usize,
        fill: &(dyn Fn(usize, &mut [Self]) + Sync),
    ) -> Result<gemm_bf16::PackedA> {
        gemm_bf16::PackedA::from_rows(dims, n, fill).map_err(candle)
    }

    fn product_by(dst: &mut [f32], a: &gemm_bf16::PackedA, b: Mat<'_, Self>, parallel: bool) -> Result<()> {
        kernel::bf16::gemm_bf16_packed(dst, a, b, 1.0, false, parallel).map_err(candle)
    }

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
/// each sum rounded as it is stored ([`kernel::bf16::gemm_bf16_packed_rounded`]).
pub(crate) trait Out<T, P: Operand<T>>: Copy + Default + Send + Sync + 'static {
    /// `dst = a·b` with a prepared `a` ([`Operand::lhs`]).
    fn product_by(dst: &mut [Self], a: &P::Lhs<'_>, b: Mat<'_, P>, parallel: bool) -> Result<()>;
}

impl<T: Real, P: Operand<T>> Out<T, P> for T {
    fn product_by(dst: &mut [T], a: &P::Lhs<'_>, b: Mat<'_, P>, parallel: bool) -> Result<()> {
        P::product_by(dst, a, b, parallel)
    }
}

impl Out<f32, half::bf16> for half::bf16 {
    fn product_by(dst: &mut [Self], a: &gemm_bf16::PackedA, b: Mat<'_, Self>, parallel: bool) -> Result<()> {
        kernel::bf16::gemm_bf16_packed_rounded(dst, a, b, parallel).map_err(candle)
    }
}
