//! The linear layer's three row-major products as cuBLAS's column-major `gemm` calls (used by
//! the CUDA body, `super::cuda::linear`; plain arithmetic, so it is tested here on any machine
//! against a column-major reference of cuBLAS's definition).
//!
//! cuBLAS computes `C (m × n) = op(A) (m × k) · op(B) (k × n)` on column-major buffers. A
//! row-major `r × c` buffer is the column-major `c × r` matrix, its transpose: so each row-major
//! product `P = L · R` is computed as `Pᵀ = Rᵀ · Lᵀ`, with the buffers as they lie.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Which of a product's two buffers cuBLAS takes as A (the other is B).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operands {
    /// A = the weights W, B = the inputs x (forward) or the output gradient g (input gradient).
    WeightFirst,
    /// A = the inputs x, B = the output gradient g (weight gradient).
    InputFirst,
}

/// One `gemm` call: transposes of A and B, sizes and leading dimensions (column-major).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Gemm {
    pub(crate) transa: bool,
    pub(crate) transb: bool,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) lda: usize,
    pub(crate) ldb: usize,
    pub(crate) ldc: usize,
    pub(crate) operands: Operands,
}

/// `y = x · Wᵀ` for x (rows × k), W (n × k): y (rows × n). A = W (transposed), B = x.
pub(crate) fn forward(rows: usize, k: usize, n: usize) -> Gemm {
    Gemm { transa: true, transb: false, m: n, n: rows, k, lda: k, ldb: k, ldc: n, operands: Operands::WeightFirst }
}

/// `dx = g · W` for g (rows × n), W (n × k): dx (rows × k). A = W, B = g.
pub(crate) fn input_grad(rows: usize, k: usize, n: usize) -> Gemm {
    Gemm { transa: false, transb: false, m: k, n: rows, k: n, lda: k, ldb: n, ldc: k, operands: Operands::WeightFirst }
}

/// `dW = gᵀ · x` for g (rows × n), x (rows × k): dW (n × k). A = x, B = g (transposed).
pub(crate) fn weight_grad(rows: usize, k: usize, n: usize) -> Gemm {
    Gemm { transa: false, transb: true, m: k, n, k: rows, lda: k, ldb: n, ldc: k, operands: Operands::InputFirst }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cuBLAS's gemm by its definition: `C = op(A) · op(B) + beta · C`, column-major with leading
    /// dimensions (element (i, j) of a matrix at `i + j · ld`); C is not read when beta is 0.
    fn gemm(g: &Gemm, a: &[f64], b: &[f64], c: &mut [f64], beta: f64) {
        let at = |i: usize, l: usize| if g.transa { a[l + i * g.lda] } else { a[i + l * g.lda] };
        let bt = |l: usize, j: usize| if g.transb { b[j + l * g.ldb] } else { b[l + j * g.ldb] };
        for i in 0..g.m {
            for j in 0..g.n {
                let s: f64 = (0..g.k).map(|l| at(i, l) * bt(l, j)).sum();
                c[i + j * g.ldc] = if beta == 0.0 { s } else { s + beta * c[i + j * g.ldc] };
            }
        }
    }

    fn values(len: usize, seed: u64) -> Vec<f64> {
        (0..len).map(|i| ((i as u64 * 2654435761 + seed) % 1000) as f64 / 250.0 - 2.0).collect()
    }

    #[test]
    fn the_three_calls_compute_the_row_major_products() {
        for (rows, k, n) in [(1, 1, 1), (3, 5, 7), (8, 4, 2), (5, 16, 3)] {
            let (x, w, g) = (values(rows * k, 1), values(n * k, 2), values(rows * n, 3));
            let bias = values(n, 4);
            // Forward onto rows filled with the bias (beta = 1), as the CUDA body runs it.
            let mut y: Vec<f64> = (0..rows * n).map(|i| bias[i % n]).collect();
            let f = forward(rows, k, n);
            assert_eq!(f.operands, Operands::WeightFirst);
            gemm(&f, &w, &x, &mut y, 1.0);
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k).map(|l| x[r * k + l] * w[j * k + l]).sum::<f64>() + bias[j];
                    assert!((y[r * n + j] - want).abs() < 1e-12, "forward {rows}×{k}×{n} at ({r}, {j})");
                }
            }
            let mut dx = vec![f64::NAN; rows * k];
            gemm(&input_grad(rows, k, n), &w, &g, &mut dx, 0.0);
            for r in 0..rows {
                for l in 0..k {
                    let want: f64 = (0..n).map(|j| g[r * n + j] * w[j * k + l]).sum();
                    assert!((dx[r * k + l] - want).abs() < 1e-12, "dx {rows}×{k}×{n} at ({r}, {l})");
                }
            }
            let mut dw = vec![f64::NAN; n * k];
            let wg = weight_grad(rows, k, n);
            assert_eq!(wg.operands, Operands::InputFirst);
            gemm(&wg, &x, &g, &mut dw, 0.0);
            for j in 0..n {
                for l in 0..k {
                    let want: f64 = (0..rows).map(|r| g[r * n + j] * x[r * k + l]).sum();
                    assert!((dw[j * k + l] - want).abs() < 1e-12, "dW {rows}×{k}×{n} at ({j}, {l})");
                }
            }
        }
    }
}
