//! Where attention's operands and results lie: a head's rows apart or packed side by side
//! ([`Heads`]), and the shared result buffer the heads' threads write their rows into ([`Target`]).

use candle_core::Result;

#[cfg(feature = "cuda")]
use super::cuda;
use super::{err, gemm, Mat, Real, SharedMut};

/// Where an operand's rows lie: row `i` of head (b, h) starts at `base + b·batch + h·head +
/// i·row`, its head_dim elements contiguous. Heads apart ((B, H, S, D)) or packed along the last
/// axis of (B, S, parts·H·D), as a projection writes them: the packed form needs no split and
/// transposed copies of q, k and v, nor their gradients' reassembly.
#[derive(Clone, Copy, Debug)]
pub(super) struct Heads {
    base: usize,
    batch: usize,
    head: usize,
    row: usize,
}

impl Heads {
    /// The layout as the CUDA kernels take it.
    #[cfg(feature = "cuda")]
    pub(super) fn lay(self) -> cuda::Lay {
        cuda::Lay::new([self.base, self.batch, self.head, self.row])
    }

    /// (B, H, S, D), contiguous.
    pub(super) fn apart(heads: usize, seq: usize, d: usize) -> Self {
        Heads { base: 0, batch: heads * seq * d, head: seq * d, row: d }
    }

    /// Part `which` of `parts` packed along the last axis of (B, S, parts·H·D).
    pub(super) fn packed(which: usize, parts: usize, heads: usize, seq: usize, d: usize) -> Self {
        let width = parts * heads * d;
        Heads { base: which * heads * d, batch: seq * width, head: d, row: width }
    }

    /// Where head `bh` (batch-major) starts.
    pub(super) fn start(&self, bh: usize, heads: usize) -> usize {
        self.base + (bh / heads) * self.batch + (bh % heads) * self.head
    }

    /// Head `bh`'s `rows × d` matrix in `data`.
    pub(super) fn mat<'a, T>(
        &self,
        data: &'a [T],
        bh: usize,
        heads: usize,
        rows: usize,
        d: usize,
    ) -> Result<Mat<'a, T>> {
        self.rows_from(data, bh, heads, (0, rows), d)
    }

    /// Rows `first..first + rows` of head `bh`'s matrix in `data`, as a `rows × d` matrix.
    pub(super) fn rows_from<'a, T>(
        &self,
        data: &'a [T],
        bh: usize,
        heads: usize,
        (first, rows): (usize, usize),
        d: usize,
    ) -> Result<Mat<'a, T>> {
        let at = self.start(bh, heads) + first * self.row;
        let data = data.get(at..).ok_or_else(|| err("attention: operand out of range".into()))?;
        Ok(Mat { data, rows, cols: d, row_stride: self.row, col_stride: 1 })
    }
}

/// A result buffer shared by the heads' threads and where each head's rows go in it.
pub(super) struct Target<'a, T> {
    pub(super) data: &'a SharedMut<'a, T>,
    pub(super) layout: Heads,
}

impl<T: Real> Target<'_, T> {
    /// `gemm` of rows `first..first + rows` of head `bh` (`rows × d`) into their places: straight
    /// in when the head's rows are one block, through `scratch` otherwise.
    ///
    /// # Safety
    /// No other call writes those rows of head `bh` of this target at the same time.
    pub(super) unsafe fn put_rows(
        &self,
        bh: usize,
        heads: usize,
        (first, rows, d): (usize, usize, usize),
        scratch: &mut [T],
        (a, b): (Mat<'_, T>, Mat<'_, T>),
        scale: Scale<'_, T>,
    ) -> Result<()> {
        let start = self.layout.start(bh, heads) + first * self.layout.row;
        let alpha = match scale {
            Scale::All(alpha) => alpha,
            Scale::Rows(_) => T::one(),
        };
        let contiguous = self.layout.row == d;
        let block = if contiguous {
            // SAFETY: head `bh`'s block, written by this call only (the caller's contract).
            unsafe { self.data.range(start, rows * d) }
        } else {
            &mut scratch[..rows * d]
        };
        gemm(block, a, b, alpha, false, false)?;
        if let Scale::Rows(by) = scale {
            let by = by.get(..rows).ok_or_else(|| err("attention: fewer row scales than rows".into()))?;
            scale_rows::<T>(block, d, by);
        }
        if contiguous {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { self.write_rows(bh, heads, (first, rows, d), block) }
    }
}

impl<T: Copy> Target<'_, T> {
    /// Writes `src` (`rows × d`, contiguous) as rows `first..first + rows` of head `bh`.
    ///
    /// # Safety
    /// No other call writes those rows of head `bh` of this target at the same time.
    pub(super) unsafe fn write_rows(
        &self,
        bh: usize,
        heads: usize,
        (first, rows, d): (usize, usize, usize),
        src: &[T],
    ) -> Result<()> {
        let src = src.get(..rows * d).ok_or_else(|| err("attention: fewer values than rows".into()))?;
        let start = self.layout.start(bh, heads) + first * self.layout.row;
        if self.layout.row == d {
            // SAFETY: head `bh`'s rows, written by this call only (the caller's contract).
            unsafe { self.data.range(start, rows * d) }.copy_from_slice(src);
            return Ok(());
        }
        for (i, r) in src.chunks_exact(d.max(1)).enumerate() {
            // SAFETY: row `i` of head `bh`, written by this call only (the caller's contract);
            // the heads' rows of a packed layout do not overlap.
            unsafe { self.data.range(start + i * self.layout.row, d) }.copy_from_slice(r);
        }
        Ok(())
    }
}

/// How [`Target::put_rows`] scales its product: all of it by one factor, or each row by its own.
#[derive(Clone, Copy)]
pub(super) enum Scale<'a, T> {
    /// `alpha·a·b`.
    All(T),
    /// Row `i` of `a·b` times `by[i]` (the forward pass's softmax normalisation, applied to the
    /// `head_dim` outputs of a row instead of its probabilities).
    Rows(&'a [T]),
}

wide_kernel! {
    /// Each `d`-long row of `m` times its factor in `by`.
    fn scale_rows<T>(m: &mut [T], d: usize, by: &[T]) {
        for (row, f) in m.chunks_exact_mut(d).zip(by) {
            row.iter_mut().for_each(|v| *v = *v * *f);
        }
    }
}
