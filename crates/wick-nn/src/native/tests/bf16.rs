//! The kernels in bf16: computed in f32 and rounded once, bit for bit against the f32 path where
//! the kernel reads and writes bf16 itself, within a bf16 spacing where products sum in f32.

use super::*;

/// In bf16 each kernel computes in f32 and rounds its result once: within bf16's half spacing
/// (plus the rounding of its bf16 inputs) of the f32 computation on the same (rounded) inputs.
#[test]
fn bf16_inputs_compute_in_f32_and_round_once() {
    let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (x, w, b) = (bf(&randn(&[4, 8, 16], 26)), bf(&randn(&[12, 16], 27)), bf(&randn(&[12], 28)));
    let pairs = [
        (
            native::linear::linear(&x, &w, Some(&b)).unwrap(),
            native::linear::linear(&f32_of(&x), &f32_of(&w), Some(&f32_of(&b))).unwrap(),
        ),
        (native::act::gelu(&x).unwrap(), native::act::gelu(&f32_of(&x)).unwrap()),
        (
            native::row_norm::rms_norm(&x, &f32_of(&randn(&[16], 29)), 1e-6).unwrap(),
            native::row_norm::rms_norm(&f32_of(&x), &f32_of(&randn(&[16], 29)), 1e-6).unwrap(),
        ),
    ];
    for (low, reference) in pairs {
        assert_eq!(low.dtype(), DType::BF16);
        let (l, r) = (values(&low), values(&reference));
        for (a, b) in l.iter().zip(&r) {
            // Round-to-nearest: at most half a bf16 spacing (2⁻⁸ relative).
            assert!((a - b).abs() <= b.abs() * 2f64.powi(-8) + 1e-30, "{a} vs f32 {b}");
        }
    }
}

/// The kernels' own bf16 conversions: widening is exact, narrowing rounds to nearest even
/// (ties to even, carries into the exponent, overflow to infinity, NaN kept) exactly as the
/// `half` crate does. `x + a + b` of bf16 inputs is computed in f32 and narrowed once.
#[test]
fn bf16_conversions_round_to_nearest_even() {
    let dev = Device::Cpu;
    let bf = |v: f32| half::bf16::from_f32(v);
    let mut pairs: Vec<(f32, f32)> = vec![
        (1.0, 2f32.powi(-8)),       // a tie: to even (1.0)
        (1.0, 3.0 * 2f32.powi(-8)), // a tie: to even (1 + 2⁻⁶)
        (1.0, -2f32.powi(-9)),
        (3.3e38, 3.3e38), // overflows f32: infinity
        (f32::INFINITY, -1.0),
        (f32::NAN, 1.0),
        (-0.0, 0.0),
        (1e-40, 1e-40),
    ];
    pairs.extend((0..4000).map(|i| (((i as f32) * 0.7183).sin() * 10f32.powi(i % 20 - 10), (i as f32 * 0.37).cos())));
    let x: Vec<half::bf16> = pairs.iter().map(|p| bf(p.0)).collect();
    let a: Vec<half::bf16> = pairs.iter().map(|p| bf(p.1)).collect();
    let n = pairs.len();
    let xt = Tensor::from_vec(x.clone(), (1, n), &dev).unwrap();
    let at = Tensor::from_vec(a.clone(), (1, n), &dev).unwrap();
    let zero = Tensor::zeros((1, 1), DType::BF16, &dev).unwrap();
    let y: Vec<half::bf16> =
        native::loss::add_broadcast(&xt, &at, &zero).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    for i in 0..n {
        let exact = x[i].to_f32() + a[i].to_f32() + 0.0;
        let expected = bf(exact);
        if exact.is_nan() {
            assert!(y[i].is_nan(), "NaN stays NaN");
        } else {
            assert_eq!(y[i].to_bits(), expected.to_bits(), "bf16 of {exact:e}");
        }
    }
}

/// The element-wise ops and the norms read and write bf16 directly (no widened copies): their
/// outputs and input gradients are, bit for bit, the f32 computation on the same values rounded
/// once to bf16 (widening bf16 is exact, so the f32 path sees the same inputs), and the norms'
/// f32 parameter gradients are the f32 path's own. Backward runs through a weighted sum whose
/// weights are bf16 values, so both paths receive the same output gradient.
#[test]
fn bf16_element_kernels_equal_the_f32_computation_rounded_once() {
    let bits = |t: &Tensor| -> Vec<u16> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    let to = |t: &Tensor, d: DType| t.to_dtype(d).unwrap();
    type Op = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
    let bn = |act: Activation| -> Op {
        Box::new(move |t: &[Tensor]| {
            let (mean, var) = native::norm::batch_stats(&t[0].detach())?;
            native::norm::batch_norm(&t[0], &mean, &var, &t[1], &t[2], 1e-5, true, act)
        })
    };
    // (name, op, input shapes, how many inputs are activations: the rest are f32 parameters)
    let cases: Vec<(&str, Op, Vec<Vec<usize>>, usize)> = vec![
        ("relu", Box::new(|t: &[Tensor]| native::act::relu(&t[0])), vec![vec![70_001]], 1),
        ("relu6", Box::new(|t: &[Tensor]| native::act::relu6(&(&t[0] * 4.0)?)), vec![vec![3, 5, 7]], 1),
        ("gelu", Box::new(|t: &[Tensor]| native::act::gelu(&t[0])), vec![vec![66_000]], 1),
        ("silu_mul", Box::new(|t: &[Tensor]| native::act::silu_mul(&t[0], &t[1])), vec![vec![40_000]; 2], 2),
        ("silu_mul (packed)", Box::new(|t: &[Tensor]| native::act::silu_mul_packed(&t[0])), vec![vec![30, 1_000]], 1),
        ("add_relu", Box::new(|t: &[Tensor]| native::act::add_relu(&t[0], &t[1])), vec![vec![2, 3, 50, 400]; 2], 2),
        ("add", Box::new(|t: &[Tensor]| native::act::add(&t[0], &t[1])), vec![vec![3, 70_000]; 2], 2),
        // Rows copied as stored; each used row's gradient summed in f32 (id 3 three times) and
        // rounded once, the padding row (1) getting none.
        (
            "embedding",
            Box::new(|t: &[Tensor]| {
                let ids = Tensor::new(&[3u32, 1, 3, 0, 6, 3, 1], &Device::Cpu)?;
                native::loss::embedding(&t[0], &ids, Some(1))
            }),
            vec![vec![7, 5]],
            1,
        ),
        // Depthwise convolutions widen images and output gradients as they read them.
        (
            "depthwise 3×3",
            Box::new(|t: &[Tensor]| native::depthwise::depthwise_conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 5, 9, 9], vec![5, 1, 3, 3]],
            1,
        ),
        (
            "depthwise 3×3 /2",
            Box::new(|t: &[Tensor]| native::depthwise::depthwise_conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![2, 5, 10, 10], vec![5, 1, 3, 3]],
            1,
        ),
        (
            "depthwise 3×3 /3",
            Box::new(|t: &[Tensor]| native::depthwise::depthwise_conv2d(&t[0], &t[1], 1, 3)),
            vec![vec![2, 4, 10, 10], vec![4, 1, 3, 3]],
            1,
        ),
        // Rotations of the packed q and k (v copied as stored).
        (
            "rope (packed)",
            Box::new(|t: &[Tensor]| {
                let (cos, sin) = ops::rope_tables(5, 4, 10_000.0, DType::F32, &Device::Cpu)?;
                native::rope::rope_packed(&t[0], 2, &cos, &sin)
            }),
            vec![vec![3, 5, 24]],
            1,
        ),
        // Convolutions gather bf16 images straight into their f32 columns (a 1×1 stride-1 one
        // widens the image first); the same f32 products, rounded once.
        (
            "conv 3×3",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 3, 9, 9], vec![4, 3, 3, 3]],
            1,
        ),
        (
            "conv 3×3 /2",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![2, 3, 10, 10], vec![5, 3, 3, 3]],
            1,
        ),
        (
            "conv 1×1",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 1)),
            vec![vec![2, 6, 5, 5], vec![4, 6, 1, 1]],
            1,
        ),
        (
            "conv 1×1 /2",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 2)),
            vec![vec![3, 6, 6, 6], vec![4, 6, 1, 1]],
            1,
        ),
        // Max pooling widens each plane as it reads it; overlapping windows (ResNet's stem: 3×3,
        // stride 2, padding 1) sum a gradient in f32 from several outputs and round it once.
        (
            "max_pool 3×3 /2",
            Box::new(|t: &[Tensor]| native::pool::max_pool2d(&t[0], 3, 2, 1)),
            vec![vec![2, 3, 17, 16]],
            1,
        ),
        (
            "max_pool 3×3 /1",
            Box::new(|t: &[Tensor]| native::pool::max_pool2d(&t[0], 3, 1, 1)),
            vec![vec![1, 2, 9, 40]],
            1,
        ),
        (
            "max_pool 2×2 /2",
            Box::new(|t: &[Tensor]| native::pool::max_pool2d(&t[0], 2, 2, 0)),
            vec![vec![2, 2, 8, 9]],
            1,
        ),
        (
            "layer_norm",
            Box::new(|t: &[Tensor]| native::row_norm::layer_norm(&t[0], &t[1], &t[2], 1e-5)),
            vec![vec![6, 7, 48], vec![48], vec![48]],
            1,
        ),
        (
            "rms_norm",
            Box::new(|t: &[Tensor]| native::row_norm::rms_norm(&t[0], &t[1], 1e-6)),
            vec![vec![5, 40], vec![40]],
            1,
        ),
        ("batch_norm", bn(Activation::Identity), vec![vec![3, 4, 9, 11], vec![4], vec![4]], 1),
        ("batch_norm+relu", bn(Activation::Relu), vec![vec![3, 4, 9, 11], vec![4], vec![4]], 1),
        ("batch_norm+relu6", bn(Activation::Relu6), vec![vec![2, 3, 40, 41], vec![3], vec![3]], 1),
    ];
    for (case, (name, op, shapes, activations)) in cases.into_iter().enumerate() {
        // The same values in both dtypes: bf16-representable ones.
        let inputs: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let v = randn(s, 100 + 10 * case as u64 + i as u64);
                to(&to(&(v * if i == 0 { 2.0 } else { 1.0 }).unwrap(), DType::BF16), DType::F32)
            })
            .collect();
        let run = |dtype: DType| {
            let vars: Vec<Var> = inputs
                .iter()
                .enumerate()
                .map(|(i, t)| Var::from_tensor(&to(t, if i < activations { dtype } else { DType::F32 })).unwrap())
                .collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = op(&ts).unwrap();
            assert_eq!(y.dtype(), dtype, "{name}: output dtype");
            let n = y.elem_count() as u32;
            let weights = to(
                &to(
                    &Tensor::arange(1u32, n + 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().sin().unwrap(),
                    DType::BF16,
                ),
                dtype,
            );
            let grads = (&y * weights.reshape(y.shape()).unwrap()).unwrap().sum_all().unwrap().backward().unwrap();
            let g: Vec<Tensor> =
                vars.iter().map(|v| grads.get(v).unwrap_or_else(|| panic!("{name}: no gradient")).clone()).collect();
            (y, g)
        };
        let ((y_low, g_low), (y_ref, g_ref)) = (run(DType::BF16), run(DType::F32));
        assert_eq!(bits(&y_low), bits(&y_ref), "{name}: forward");
        for (i, (a, b)) in g_low.iter().zip(&g_ref).enumerate() {
            if i < activations {
                assert_eq!(a.dtype(), DType::BF16, "{name}: gradient {i} dtype");
                assert_eq!(bits(a), bits(b), "{name}: gradient of input {i}");
            } else {
                assert_eq!(values(a), values(b), "{name}: gradient of parameter {i}");
            }
        }
        assert!(values(&g_low[0]).iter().any(|v| *v != 0.0), "{name}: zero gradient");
    }
}

/// With every operand in bf16 (AMP's case), linear layers and convolutions multiply bf16 values
/// with f32 sums (AVX512-BF16 where the CPU has it, widened f32 products elsewhere): outputs and
/// every gradient within one bf16 spacing of the f32 products on the same values (each side
/// rounds its own f32 sum once; the sums differ only in their f32 rounding), over the geometries
/// whose code paths differ: 1×1 stride 1 (the image is the column matrix), 3×3 stride 1 (input
/// gradient as a convolution), 3×3 stride 2 and 7×7 stride 2 (col2im), images grouped per
/// gemm (few output positions), and the direct convolutions on the images (16 or more input
/// channels: forward passes at strides 1 and 2, 1×1 stride 2, and input gradients from 16 or
/// more output channels at stride 1 and, phase by phase, at stride 2), and 1×1 weight
/// gradients summed along large planes.
#[test]
fn bf16_products_are_within_a_bf16_spacing_of_f32_products() {
    type Op = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
    let cases: Vec<(&str, Op, Vec<Vec<usize>>)> = vec![
        (
            "linear",
            Box::new(|t: &[Tensor]| native::linear::linear(&t[0], &t[1], Some(&t[2]))),
            vec![vec![3, 37, 70], vec![45, 70], vec![45]],
        ),
        (
            "conv 1×1",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 1)),
            vec![vec![2, 24, 9, 9], vec![40, 24, 1, 1]],
        ),
        (
            "conv 3×3",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 13, 12, 12], vec![16, 13, 3, 3]],
        ),
        // Planes of 2048 positions or more: the weight gradient summed along them in place, with
        // more output channels than input ones and fewer (a ragged last step of positions).
        (
            "conv 1×1 over large planes",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 1)),
            vec![vec![2, 8, 48, 48], vec![12, 8, 1, 1]],
        ),
        (
            "conv 1×1 over large planes, fewer outputs",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 1)),
            vec![vec![2, 12, 46, 45], vec![4, 12, 1, 1]],
        ),
        (
            "conv 3×3 /2",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![3, 8, 11, 11], vec![20, 8, 3, 3]],
        ),
        (
            "conv 7×7 /2",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 3, 2)),
            vec![vec![2, 3, 20, 20], vec![8, 3, 7, 7]],
        ),
        (
            "conv 3×3 /2 direct",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![2, 18, 9, 10], vec![36, 18, 3, 3]],
        ),
        (
            "conv 3×3 /2 direct, input gradient phase by phase",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 2)),
            vec![vec![2, 20, 8, 10], vec![24, 20, 3, 3]],
        ),
        (
            "conv 1×1 /2, 32 channels",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 2)),
            vec![vec![2, 32, 7, 7], vec![40, 32, 1, 1]],
        ),
        (
            "conv 1×1 /2, 32 channels, input gradient phase by phase",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 0, 2)),
            vec![vec![2, 32, 8, 6], vec![40, 32, 1, 1]],
        ),
        (
            "conv 5×5 direct",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 2, 1)),
            vec![vec![1, 17, 6, 9], vec![20, 17, 5, 5]],
        ),
        (
            "conv grouped",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![9, 32, 4, 4], vec![24, 32, 3, 3]],
        ),
        // Deeper than one slice of the product (576 > 512): f32 sums, rounded afterwards.
        (
            "conv deep",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 64, 5, 5], vec![8, 64, 3, 3]],
        ),
        // An input gradient summed over 64·9 = 576 > 512 output channels and taps.
        (
            "conv deep input gradient",
            Box::new(|t: &[Tensor]| native::conv::conv2d(&t[0], &t[1], 1, 1)),
            vec![vec![2, 8, 5, 5], vec![64, 8, 3, 3]],
        ),
        // Without a bias the sums are rounded as stored; deeper than a slice, afterwards.
        (
            "linear (no bias)",
            Box::new(|t: &[Tensor]| native::linear::linear(&t[0], &t[1], None)),
            vec![vec![2, 19, 70], vec![33, 70]],
        ),
        (
            "linear (deep)",
            Box::new(|t: &[Tensor]| native::linear::linear(&t[0], &t[1], None)),
            vec![vec![5, 600], vec![20, 600]],
        ),
        // A weight gradient summed over 600 rows (deeper than a slice).
        (
            "linear (many rows)",
            Box::new(|t: &[Tensor]| native::linear::linear(&t[0], &t[1], None)),
            vec![vec![2, 300, 16], vec![8, 16]],
        ),
    ];
    for (name, op, shapes) in cases {
        // The same bf16 values as bf16 and as f32 tensors.
        let inputs: Vec<Tensor> =
            shapes.iter().enumerate().map(|(i, s)| randn(s, 40 + i as u64).to_dtype(DType::BF16).unwrap()).collect();
        let run = |dtype: DType| {
            let vars: Vec<candle_core::Var> =
                inputs.iter().map(|t| candle_core::Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()).collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = op(&ts).unwrap();
            assert_eq!(y.dtype(), dtype, "{name}: output dtype");
            // Output-gradient weights that bf16 holds exactly: both runs backpropagate the same.
            let n = y.elem_count() as u32;
            let weights =
                Tensor::arange(1u32, n + 1, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().sin().unwrap();
            let weights =
                weights.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().reshape(y.shape()).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * weights).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            let g: Vec<Tensor> =
                vars.iter().map(|v| grads.get(v).unwrap_or_else(|| panic!("{name}: no gradient")).clone()).collect();
            (y, g)
        };
        let ((y_low, g_low), (y_ref, g_ref)) = (run(DType::BF16), run(DType::F32));
        let close = |what: &str, low: &Tensor, reference: &Tensor| {
            assert_eq!(low.dtype(), DType::BF16, "{name} {what}: dtype");
            // The reference rounded to bf16 as the low-precision path rounds its own sum.
            let r = values(&reference.to_dtype(DType::BF16).unwrap());
            let scale = r.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, (a, b)) in values(low).iter().zip(&r).enumerate() {
                // One bf16 spacing (2⁻⁷ relative) where the f32 sums round to neighbours, plus a
                // floor for sums that cancel to far below the tensor's scale.
                assert!(
                    (a - b).abs() <= b.abs() * 2f64.powi(-7) + scale * 2f64.powi(-16),
                    "{name} {what}[{i}]: {a} vs {b}"
                );
            }
            assert!(scale > 0.0, "{name} {what}: all zero");
        };
        close("forward", &y_low, &y_ref);
        for (i, (a, b)) in g_low.iter().zip(&g_ref).enumerate() {
            close(&format!("gradient {i}"), a, b);
        }
    }
}
