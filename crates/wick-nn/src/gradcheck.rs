//! Central finite differences, the one numerical check of a gradient that wick's tests use (the
//! ops' and kernels' tests here, the models' in wick-zoo): feature `testing`, or this crate's own
//! tests.

/// For each coordinate in `entries` of the point `base`, the central difference
/// `(f(x + h·eᵢ) − f(x − h·eᵢ)) / 2h` of `eval` (which receives the whole moved point) at each
/// step `h` of `steps`, the one closest to `analytic[i]`, autograd's derivative there. More
/// than one step is for piecewise-smooth functions (ReLU, max pooling): a step that carries an
/// activation across its kink spoils that difference and smaller steps do not, while a wrong
/// gradient is far at every step. Returns the chosen differences, in the order of `entries`;
/// the caller holds them to its own tolerance.
pub fn central_differences(
    base: &[f64],
    entries: &[usize],
    steps: &[f64],
    analytic: &[f64],
    eval: impl Fn(&[f64]) -> f64,
) -> Vec<f64> {
    let mut moved = base.to_vec();
    let mut at = |i: usize, delta: f64| {
        moved[i] = base[i] + delta;
        let value = eval(&moved);
        moved[i] = base[i];
        value
    };
    entries
        .iter()
        .map(|&i| {
            let differences: Vec<f64> = steps.iter().map(|&h| (at(i, h) - at(i, -h)) / (2.0 * h)).collect();
            differences
                .into_iter()
                .min_by(|a, b| (a - analytic[i]).abs().total_cmp(&(b - analytic[i]).abs()))
                .unwrap_or(f64::NAN)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn differences_of_a_smooth_and_a_kinked_function() {
        // x² + sin(y): derivatives 2x and cos(y).
        let f = |v: &[f64]| v[0] * v[0] + v[1].sin();
        let d = central_differences(&[1.5, 0.3], &[0, 1], &[1e-5], &[3.0, 0.3f64.cos()], f);
        assert!((d[0] - 3.0).abs() < 1e-8 && (d[1] - 0.3f64.cos()).abs() < 1e-8, "{d:?}");
        // |x| at 1e-7: a step of 1e-6 crosses the kink, 1e-8 does not; the closer one is chosen.
        let d = central_differences(&[1e-7], &[0], &[1e-6, 1e-8], &[1.0], |v| v[0].abs());
        assert!((d[0] - 1.0).abs() < 1e-6, "{d:?}");
        // A wrong derivative is not rescued by the choice.
        let d = central_differences(&[1.5], &[0], &[1e-5, 1e-6], &[-3.0], |v| v[0] * v[0]);
        assert!((d[0] - 3.0).abs() < 1e-4, "{d:?}");
    }
}
