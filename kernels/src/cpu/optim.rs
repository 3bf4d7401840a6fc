//! Optimizer updates over slices, in one pass: AdamW and SGD with momentum applied in place to
//! f32 parameters (or the f32 masters of low-precision ones) from their gradients, reading the
//! old optimizer state and writing the new, in f32 in PyTorch's order of operations (its AdamW on
//! f32 parameters), vectorised. [`AdamW`] is the one description of AdamW's settings: this
//! update and the CUDA update's launcher (whose constants, [`AdamWStep`], it computes) take it.

/// AdamW's settings: decoupled weight decay, bias-corrected moments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

impl AdamW {
    /// `(1 − β1^t, 1 − β2^t)` for step `t` (from 1), in f64.
    pub fn bias_corrections(&self, step: i32) -> (f64, f64) {
        (1.0 - powi(self.beta1, step), 1.0 - powi(self.beta2, step))
    }

    /// The constants of step `t` (from 1) as [`adamw`]'s per-element arithmetic takes them:
    /// computed in f64, each rounded to f32 once. The CUDA optimizer kernels take the same values
    /// as arguments, so the two updates round alike.
    pub fn step_constants(&self, step: i32) -> AdamWStep {
        let (bc1, bc2) = self.bias_corrections(step);
        AdamWStep {
            b1: self.beta1 as f32,
            b2: self.beta2 as f32,
            c1: (1.0 - self.beta1) as f32,
            c2: (1.0 - self.beta2) as f32,
            eps: self.eps as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            step_size: (self.lr / bc1) as f32,
            inv_bc2_sqrt: (1.0 / bc2.sqrt()) as f32,
        }
    }
}

/// `a^b` by repeated squaring, every product rounded on its own: the algorithm `f64::powi` runs
/// (LLVM's `powi` with an exponent known only at run time calls compiler-builtins'
/// `__powidf2`, this loop), written out so the CUDA step's `wick_powi` can follow it operation
/// for operation — the device's bias corrections are then the host's to the bit. A test holds it
/// to `f64::powi`.
pub fn powi(mut a: f64, b: i32) -> f64 {
    let mut n = b.unsigned_abs();
    let mut r = 1.0;
    loop {
        if n & 1 == 1 {
            r *= a;
        }
        n >>= 1;
        if n == 0 {
            break;
        }
        a *= a;
    }
    if b < 0 {
        1.0 / r
    } else {
        r
    }
}

/// One AdamW step's constants in f32 ([`AdamW::step_constants`]): `m = b1·m + c1·g`,
/// `v = b2·v + c2·g²`, `p = p·decay − step_size·m / (√v·inv_bc2_sqrt + eps)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// β1.
    pub b1: f32,
    /// β2.
    pub b2: f32,
    /// 1 − β1.
    pub c1: f32,
    /// 1 − β2.
    pub c2: f32,
    /// ε.
    pub eps: f32,
    /// 1 − lr·weight decay.
    pub decay: f32,
    /// lr / (1 − β1^t).
    pub step_size: f32,
    /// 1 / √(1 − β2^t).
    pub inv_bc2_sqrt: f32,
}

/// One AdamW step of `p` from `g` (each element widened to f32 where it is used, then multiplied
/// by `factor`: gradient clipping's coefficient, 1 for none — exact) and the old moments
/// `(m, v)`, writing the new moments into `(m_new, v_new)`; every slice the same length (the
/// caller checks). The step's constants in f64, the per-element arithmetic in f32.
#[inline(always)]
pub fn adamw<G: Copy + Into<f32>>(
    p: &mut [f32],
    g: &[G],
    (m, v): (&[f32], &[f32]),
    (m_new, v_new): (&mut [f32], &mut [f32]),
    hyper: &AdamW,
    step: i32,
    factor: f32,
) {
    let AdamWStep { b1, b2, c1, c2, eps, decay, step_size, inv_bc2_sqrt } = hyper.step_constants(step);
    let moments = m_new.iter_mut().zip(v_new.iter_mut()).zip(m).zip(v);
    for ((p, (((mn, vn), mo), vo)), g) in p.iter_mut().zip(moments).zip(g) {
        let g: f32 = (*g).into() * factor;
        let m = b1 * *mo + c1 * g;
        let v = b2 * *vo + c2 * g * g;
        let denom = v.sqrt() * inv_bc2_sqrt + eps;
        *p = *p * decay - step_size * m / denom;
        (*mn, *vn) = (m, v);
    }
}

/// One step of SGD with momentum μ (PyTorch's form: `b = μ·b + g`, `p −= lr·b`) from `g` (times
/// `factor`, as in [`adamw`]) and the old buffer `b`, writing the new buffer into `b_new`; every
/// slice the same length.
#[inline(always)]
pub fn sgd_momentum<G: Copy + Into<f32>>(
    p: &mut [f32],
    g: &[G],
    b: &[f32],
    b_new: &mut [f32],
    (lr, momentum): (f64, f64),
    factor: f32,
) {
    let (lr, momentum) = (lr as f32, momentum as f32);
    for (((p, b_new), b_old), g) in p.iter_mut().zip(b_new.iter_mut()).zip(b).zip(g) {
        let b = momentum * *b_old + (*g).into() * factor;
        *b_new = b;
        *p -= lr * b;
    }
}

/// Elements per chunk of [`sum_of_squares`]: fixed, so the sum's rounding does not depend on the
/// number of threads.
const SQUARES_CHUNK: usize = 1 << 16;

/// `Σ x²` over `x` (each element widened to f32, squared and summed in f64): the squared 2-norm
/// that gradient clipping takes. Fixed-size chunks summed in parallel, each in [`super::LANES`]
/// lanes, then the chunks' sums in order: the same bits on every machine and thread count.
pub fn sum_of_squares<T: Copy + Into<f32> + Sync>(x: &[T]) -> f64 {
    use rayon::prelude::*;
    let chunk = |c: &[T]| {
        super::math::vectorized(|| {
            super::lane_sums(c, c, |a, _| {
                let a = f64::from(a.into());
                [a * a]
            })[0]
        })
    };
    if x.len() <= SQUARES_CHUNK {
        return chunk(x);
    }
    let sums: Vec<f64> = x.par_chunks(SQUARES_CHUNK).map(chunk).collect();
    sums.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The written-out power is `f64::powi`'s, to the bit, at the betas people use and random
    /// ones, over a hundred thousand steps, and at the exponents' extremes.
    #[test]
    fn powi_is_the_standard_librarys() {
        let mut bases = vec![0.0, 0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9999, 1.0, -0.9, 1.5];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            bases.push((state >> 11) as f64 / (1u64 << 53) as f64);
        }
        for &a in &bases {
            for b in (1..=100_000).chain([0, -1, -7, i32::MAX, i32::MIN, i32::MAX - 1]) {
                let (got, want) = (powi(a, b), std::hint::black_box(a).powi(std::hint::black_box(b)));
                assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{a}^{b}: {got} vs {want}");
            }
        }
    }

    /// AdamW against its textbook form in f64 (the moments bias-corrected, then the update),
    /// over bf16 and f32 gradients: within f32 rounding.
    #[test]
    fn adamw_is_the_textbook_update() {
        let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 };
        let n = 37;
        let g: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.7).sin()).collect();
        let gb: Vec<half::bf16> = g.iter().map(|&x| half::bf16::from_f32(x)).collect();
        let (m0, v0): (Vec<f32>, Vec<f32>) = ((0..n).map(|i| i as f32 * 1e-3).collect(), vec![1e-4; n]);
        for step in [1, 7] {
            let mut p: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.01).collect();
            let p0 = p.clone();
            let (mut m1, mut v1) = (vec![0f32; n], vec![0f32; n]);
            adamw(&mut p, &gb, (&m0, &v0), (&mut m1, &mut v1), &hyper, step, 1.0);
            let (bc1, bc2) = hyper.bias_corrections(step);
            for i in 0..n {
                let gi = f64::from(f32::from(gb[i]));
                let m = 0.9 * m0[i] as f64 + 0.1 * gi;
                let v = 0.95 * v0[i] as f64 + 0.05 * gi * gi;
                let want = p0[i] as f64 * (1.0 - 1e-2 * 0.1) - 1e-2 * (m / bc1) / ((v / bc2).sqrt() + 1e-8);
                assert!((p[i] as f64 - want).abs() < 1e-6, "step {step} [{i}]: {} vs {want}", p[i]);
                assert!((m1[i] as f64 - m).abs() < 1e-6 && (v1[i] as f64 - v).abs() < 1e-7);
            }
        }
    }

    /// The squared norm against a plain f64 sum, over lengths around the lanes and the chunk.
    #[test]
    fn sum_of_squares_is_the_squared_norm() {
        for n in [0, 1, 7, 8, 9, 1000, SQUARES_CHUNK, SQUARES_CHUNK + 3, 3 * SQUARES_CHUNK + 17] {
            let x: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
            let want: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got = sum_of_squares(&x);
            assert!((got - want).abs() <= want * 1e-12, "{n}: {got} vs {want}");
            let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
            let want_b: f64 = xb.iter().map(|&v| f64::from(f32::from(v)).powi(2)).sum();
            assert!((sum_of_squares(&xb) - want_b).abs() <= want_b * 1e-12);
        }
        assert!(sum_of_squares(&[1.0f32, f32::INFINITY]).is_infinite());
        assert!(sum_of_squares(&[1.0f32, f32::NAN]).is_nan());
    }

    #[test]
    fn sgd_momentum_is_pytorchs_form() {
        let (mut p, g, b) = (vec![1.0f32, -2.0], vec![0.5f32, 0.25], vec![0.1f32, -0.2]);
        let mut b_new = vec![0f32; 2];
        sgd_momentum(&mut p, &g, &b, &mut b_new, (0.1, 0.9), 1.0);
        assert_eq!(b_new, vec![0.9 * 0.1 + 0.5, 0.9 * -0.2 + 0.25]);
        assert_eq!(p, vec![1.0 - 0.1 * b_new[0], -2.0 - 0.1 * b_new[1]]);
        // A clipping factor scales the gradient before anything else.
        let (mut q, mut c_new) = (vec![1.0f32, -2.0], vec![0f32; 2]);
        sgd_momentum(&mut q, &g, &b, &mut c_new, (0.1, 0.9), 0.5);
        assert_eq!(c_new, vec![0.9 * 0.1 + 0.25, 0.9 * -0.2 + 0.125]);
        assert_eq!(q, vec![1.0 - 0.1 * c_new[0], -2.0 - 0.1 * c_new[1]]);
    }
}
