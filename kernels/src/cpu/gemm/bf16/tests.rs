//! The bf16 products against an f64 product, packed operands against unpacked ones, and
//! their errors.

use super::*;

fn values(n: usize, seed: u32) -> Vec<bf16> {
    (0..n).map(|i| bf16::from_f32(((i as f32 + seed as f32) * 0.7137).sin() * 2.0)).collect()
}

fn reference(a: Mat<'_, bf16>, b: Mat<'_, bf16>) -> Vec<f64> {
    let mut out = vec![0.0; a.rows * b.cols];
    for i in 0..a.rows {
        for j in 0..b.cols {
            out[i * b.cols + j] = (0..a.cols)
                .map(|p| {
                    f64::from(a.data[i * a.row_stride + p * a.col_stride].to_f32())
                        * f64::from(b.data[p * b.row_stride + j * b.col_stride].to_f32())
                })
                .sum();
        }
    }
    out
}

/// (parallel, on the tile unit) for every kernel this CPU runs: the AVX-512 one always (the
/// tests skip without it), AMX's where [`super::super::amx::available`].
fn kernels() -> Vec<(bool, bool)> {
    let amx = super::super::amx::available();
    if !amx {
        eprintln!("note: no AMX tile unit here (or WICK_CPU_AMX=0): only the AVX-512 kernel is tested");
    }
    [(false, false), (true, false), (false, true), (true, true)].into_iter().filter(|&(_, t)| !t || amx).collect()
}

#[test]
fn products_match_an_f64_product_at_ragged_shapes_and_transposes() {
    if !available() {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16");
        return;
    }
    // Ragged in every dimension (odd k, partial tiles, several k-slices and blocks), over
    // every tile shape: 12 × 32 (150×70, 50×98, 5×3, 1×1), 8 × 48 (13×33, 40×600, 8×97), 24 × 16
    // (24×16, 50×15); and a ragged last panel on each width of kernel: 12 × 32 on one register
    // of two (150×70, 50×98), 8 × 48 on one (8×97) and two (40×600) of three.
    let shapes = [
        (1, 1, 1),
        (13, 7, 33),
        (150, 1031, 70),
        (40, 64, 600),
        (5, 2, 3),
        (24, 77, 16),
        (50, 300, 15),
        (50, 300, 98),
        (8, 64, 97),
    ];
    for &(m, k, n) in &shapes {
        let (av, bv) = (values(m * k, 1), values(k * n, 2));
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let ma = if ta { Mat::rows(&av, k, m).t() } else { Mat::rows(&av, m, k) };
            let mb = if tb { Mat::rows(&bv, n, k).t() } else { Mat::rows(&bv, k, n) };
            let expected = reference(ma, mb);
            let bound = |i: usize| {
                // f32 sums of k exact products: k·2⁻²⁴·Σ|products| bounds the rounding.
                let abs: f64 = (0..k)
                    .map(|p| {
                        let (r, c) = (i / n, i % n);
                        (f64::from(ma.data[r * ma.row_stride + p * ma.col_stride].to_f32())
                            * f64::from(mb.data[p * mb.row_stride + c * mb.col_stride].to_f32()))
                        .abs()
                    })
                    .sum();
                abs * (k as f64 + 1.0) * f64::from(f32::EPSILON) + 1e-30
            };
            for (parallel, amx) in kernels() {
                let mut out = vec![7.0f32; m * n];
                gemm_into(&mut out, ma, mb, 1.0, false, parallel, amx).unwrap();
                for (i, (x, y)) in out.iter().zip(&expected).enumerate() {
                    let at = format!("{m}×{k}×{n} {ta} {tb} amx {amx}");
                    assert!((f64::from(*x) - y).abs() <= bound(i), "{at}: {x} vs {y} at {i}");
                }
                // Accumulating adds beta times the product to what is there.
                gemm_into(&mut out, ma, mb, -0.5, true, parallel, amx).unwrap();
                for (i, (x, y)) in out.iter().zip(&expected).enumerate() {
                    assert!((f64::from(*x) - 0.5 * y).abs() <= 2.0 * bound(i), "accumulate at {i}: {x} vs {y}");
                }
            }
        }
    }
}

/// Rounding as the product stores its sums equals rounding the f32 product once (whole
/// tiles through `vcvtneps2bf16`, ragged ones through `round_bf16`); deeper products than
/// one slice are refused.
#[test]
fn rounded_products_are_the_f32_products_rounded_once() {
    if !available() {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16");
        return;
    }
    for &(m, k, n) in &[(13, 7, 33), (150, 300, 70), (24, 512, 16), (40, 64, 600)] {
        let (av, bv) = (values(m * k, 3), values(k * n, 4));
        let (ma, mb) = (Mat::rows(&av, m, k), Mat::rows(&bv, k, n));
        for (parallel, amx) in kernels() {
            let mut wide = vec![0f32; m * n];
            gemm_into(&mut wide, ma, mb, 1.0, false, parallel, amx).unwrap();
            let mut rounded = vec![bf16::ONE; m * n];
            gemm_into(&mut rounded, ma, mb, 1.0, false, parallel, amx).unwrap();
            for (i, (r, w)) in rounded.iter().zip(&wide).enumerate() {
                let want = crate::cpu::round_bf16(*w).to_bits();
                assert_eq!(r.to_bits(), want, "{m}×{k}×{n} amx {amx} at {i}: {r} vs {w}");
            }
        }
    }
    let deep = values(2 * (2 * KC + 1), 5);
    let mut out = vec![bf16::ZERO; 4];
    assert!(!rounds_directly(2 * KC + 1));
    let too_deep = gemm_bf16_rounded(&mut out, Mat::rows(&deep, 2, 2 * KC + 1), Mat::rows(&deep, 2 * KC + 1, 2), false);
    assert!(too_deep.is_err());
}

/// Packed once, `a` gives the same products as packed per product: bit for bit with the
/// micro-tile the product would choose itself, within the f32 bound of an f64 product with
/// any other (a hint of another width), in parallel parts and rounded to bf16.
#[test]
fn packed_operands_give_the_products_of_unpacked_ones() {
    if !available() {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16");
        return;
    }
    let shapes = [(1, 1, 1), (13, 7, 33), (150, 1031, 70), (40, 64, 600), (64, 576, 700), (24, 77, 16), (50, 300, 15)];
    for &(m, k, n) in &shapes {
        let (av, bv) = (values(m * k, 6), values(k * n, 7));
        for ta in [false, true] {
            let ma = if ta { Mat::rows(&av, k, m).t() } else { Mat::rows(&av, m, k) };
            let mb = Mat::rows(&bv, k, n);
            let expected = reference(ma, mb);
            for parallel in [false, true] {
                let mut want = vec![0f32; m * n];
                gemm_into(&mut want, ma, mb, 0.75, false, parallel, false).unwrap();
                for hint in [n, 1, 4096] {
                    let packed = PackedA::packed(ma, hint, false).unwrap();
                    let mut got = vec![3f32; m * n];
                    gemm_bf16_packed(&mut got, &packed, mb, 0.75, false, parallel).unwrap();
                    if packed.tile == tile_for(m, n) {
                        assert_eq!(got, want, "{m}×{k}×{n} hint {hint}");
                    }
                    for (i, (x, y)) in got.iter().zip(&expected).enumerate() {
                        let bound = 1e-5 * (k as f64) * y.abs().max(1.0);
                        assert!((f64::from(*x) - 0.75 * y).abs() <= bound, "{m}×{k}×{n} hint {hint} at {i}");
                    }
                    // Accumulating, and rounded as stored.
                    gemm_bf16_packed(&mut got, &packed, mb, -0.75, true, parallel).unwrap();
                    assert!(got.iter().all(|x| x.abs() <= 1e-5 * k as f32), "{m}×{k}×{n}: {got:?}");
                    if rounds_directly(k) {
                        let mut rounded = vec![bf16::ONE; m * n];
                        gemm_bf16_packed_rounded(&mut rounded, &packed, mb, parallel).unwrap();
                        let mut wide = vec![0f32; m * n];
                        gemm_bf16_packed(&mut wide, &packed, mb, 1.0, false, parallel).unwrap();
                        let want: Vec<u16> = wide.iter().map(|w| crate::cpu::round_bf16(*w).to_bits()).collect();
                        assert_eq!(rounded.iter().map(|r| r.to_bits()).collect::<Vec<_>>(), want);
                    }
                }
            }
        }
    }
    // On the tile unit, where there is one, a packed operand is multiplied there.
    if super::super::amx::available() {
        let (av, bv) = (values(40 * 64, 8), values(64 * 600, 9));
        let (ma, mb) = (Mat::rows(&av, 40, 64), Mat::rows(&bv, 64, 600));
        let mut want = vec![0f32; 40 * 600];
        gemm_into(&mut want, ma, mb, 1.0, false, true, true).unwrap();
        let mut got = vec![0f32; 40 * 600];
        gemm_bf16_packed(&mut got, &PackedA::packed(ma, 600, true).unwrap(), mb, 1.0, false, true).unwrap();
        assert_eq!(got, want);
    }
}

/// Packed from rows its owner writes, an operand equals the same matrix packed from
/// memory, lane for lane (ragged shapes, deeper than one slice), and so does its product;
/// on the tile unit, where there is one, too.
#[test]
fn operands_packed_from_rows_equal_operands_packed_from_a_matrix() {
    if !available() {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16");
        return;
    }
    for &(m, k, n) in &[(1, 1, 1), (13, 7, 33), (150, 1031, 70), (40, 64, 600), (24, 77, 16)] {
        let av = values(m * k, 13);
        let fill = |r: usize, row: &mut [bf16]| row.copy_from_slice(&av[r * k..(r + 1) * k]);
        let (ma, mb) = (Mat::rows(&av, m, k), Mat::rows(&values(k * n, 14), k, n).data.to_vec());
        let mb = Mat::rows(&mb, k, n);
        for amx in [false, true].into_iter().filter(|&t| !t || super::super::amx::available()) {
            let (want, got) =
                (PackedA::packed(ma, n, amx).unwrap(), PackedA::rows_packed((m, k), n, &fill, amx).unwrap());
            assert_eq!((got.tile, &got.lanes, &got.rows), (want.tile, &want.lanes, &want.rows), "{m}×{k} amx {amx}");
            let (mut x, mut y) = (vec![0f32; m * n], vec![1f32; m * n]);
            gemm_bf16_packed(&mut x, &want, mb, 1.0, false, true).unwrap();
            gemm_bf16_packed(&mut y, &got, mb, 1.0, false, true).unwrap();
            assert_eq!(x, y, "{m}×{k}×{n} amx {amx}");
        }
    }
    assert!(PackedA::from_rows((usize::MAX / 2, 3), 1, &|_, _| ()).is_err());
}

#[test]
fn packed_operands_that_do_not_fit_are_errors() {
    if !available() {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16");
        return;
    }
    let a = vec![bf16::ONE; 6];
    let short = Mat { data: &a[..5], rows: 2, cols: 3, row_stride: 3, col_stride: 1 };
    assert!(PackedA::new(short, 8).is_err());
    let packed = PackedA::new(Mat::rows(&a, 2, 3), 8).unwrap();
    let mut out = vec![0f32; 4];
    // Depth 2 against 3, and a destination too short for 2 × 3.
    assert!(gemm_bf16_packed(&mut out, &packed, Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
    assert!(gemm_bf16_packed(&mut out, &packed, Mat::rows(&a, 3, 2), 1.0, false, false).is_ok());
    assert!(gemm_bf16_packed(&mut out[..3], &packed, Mat::rows(&a, 3, 2), 1.0, false, false).is_err());
    let deep = vec![bf16::ONE; 2 * KC * 2 + 2];
    let packed = PackedA::new(Mat::rows(&deep, 1, 2 * KC + 1), 1).unwrap();
    let mut rounded = vec![bf16::ZERO; 1];
    let column = Mat::rows(&deep[..2 * KC + 1], 2 * KC + 1, 1);
    assert!(gemm_bf16_packed_rounded(&mut rounded, &packed, column, false).is_err());
}

#[test]
fn shapes_that_do_not_fit_are_errors() {
    let a = vec![bf16::ONE; 6];
    let mut out = vec![0f32; 4];
    assert!(gemm_bf16(&mut out, Mat::rows(&a, 2, 3), Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
    assert!(gemm_bf16(&mut out, Mat::rows(&a, 3, 2), Mat::rows(&a, 2, 3), 1.0, false, false).is_err());
    let short = Mat { data: &a[..5], rows: 2, cols: 3, row_stride: 3, col_stride: 1 };
    assert!(gemm_bf16(&mut out, short, Mat::rows(&a, 3, 2), 1.0, false, false).is_err());
}

/// Products whose operands both lie along a long depth (`along_k`, in place): every ragged
/// tile on either side (fewer than four rows or columns left), more rows than columns and the
/// reverse, a depth that is no whole number of 32-element steps, parallel or not; the same
/// f32 rounding bound as the blocked products, and accumulating with a factor.
#[test]
fn products_along_the_depth_match_an_f64_product() {
    if !available() || !std::is_x86_feature_detected!("avx512bw") {
        eprintln!("SKIPPED: this CPU has no AVX512-BF16 or AVX512-BW");
        return;
    }
    for &(m, k, n) in &[(64, 2100, 147), (5, 4096, 3), (130, 2048, 7), (3, 2500, 70), (1, 2049, 1)] {
        let (av, bv) = (values(m * k, 8), values(n * k, 9));
        let (ma, mb) = (Mat::rows(&av, m, k), Mat::rows(&bv, n, k).t());
        assert!(super::super::along_k::applies(&ma, &mb), "{m}×{k}×{n} should take the kernel");
        let expected = reference(ma, mb);
        let bound = |i: usize| {
            let (r, c) = (i / n, i % n);
            let abs: f64 =
                (0..k).map(|p| (f64::from(av[r * k + p].to_f32()) * f64::from(bv[c * k + p].to_f32())).abs()).sum();
            abs * (k as f64 + 1.0) * f64::from(f32::EPSILON) + 1e-30
        };
        for parallel in [false, true] {
            let mut out = vec![7.0f32; m * n];
            gemm_bf16(&mut out, ma, mb, 1.0, false, parallel).unwrap();
            for (i, (x, y)) in out.iter().zip(&expected).enumerate() {
                assert!((f64::from(*x) - y).abs() <= bound(i), "{m}×{k}×{n} parallel {parallel}: {x} vs {y} at {i}");
            }
            gemm_bf16(&mut out, ma, mb, -0.5, true, parallel).unwrap();
            for (i, (x, y)) in out.iter().zip(&expected).enumerate() {
                assert!((f64::from(*x) - 0.5 * y).abs() <= 2.0 * bound(i), "accumulate at {i}: {x} vs {y}");
            }
        }
    }
    // Short depths, wide destinations and operands not along the depth stay blocked.
    let v = values(70 * 2048, 1);
    let (a, b) = (Mat::rows(&v, 70, 2048), Mat::rows(&v, 70, 2048).t());
    assert!(!super::super::along_k::applies(&a, &b), "70 × 70 outputs");
    assert!(!super::super::along_k::applies(&Mat::rows(&v[..4 * 100], 4, 100), &Mat::rows(&v[..4 * 100], 4, 100).t()));
    assert!(!super::super::along_k::applies(
        &Mat::rows(&v[..4 * 2048], 2048, 4).t(),
        &Mat::rows(&v[..4 * 2048], 4, 2048).t()
    ));
}
