//! ResNet-18/34/50 and MobileNetV2 train: every parameter gets a finite non-zero gradient,
//! autograd agrees with finite differences on tiny widths, and a few steps lower the loss.

use candle_core::{DType, Device, Tensor, Var};
use wick_nn::gradcheck::central_differences;
use wick_nn::ops::cross_entropy;
use wick_nn::params::Params;
use wick_zoo::mobilenet::MobileNetV2;
use wick_zoo::resnet::{ResNet, ResNetDepth};

/// Finite differences need the loss to be reproducible to ~1e-13; candle's CPU kernels split
/// their reductions differently when other tests compete for the thread pool, so the tests of
/// this file take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Two classes: a bright patch top-left (0) or bottom-right (1), on noise.
fn task(dtype: DType) -> (Tensor, Tensor) {
    let dev = Device::Cpu;
    let n = 8;
    let s = 32;
    let mut data = vec![0f32; n * 3 * s * s];
    let mut state = 17u64;
    for v in data.iter_mut() {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2;
    }
    let mut labels = Vec::new();
    for i in 0..n {
        let label = (i % 2) as u32;
        labels.push(label);
        let (y0, x0) = if label == 0 { (2, 2) } else { (20, 20) };
        for c in 0..3 {
            for y in y0..y0 + 10 {
                for x in x0..x0 + 10 {
                    data[((i * 3 + c) * s + y) * s + x] += 1.5;
                }
            }
        }
    }
    let x = Tensor::from_vec(data, (n, 3, s, s), &dev).unwrap().to_dtype(dtype).unwrap();
    (x, Tensor::new(labels, &dev).unwrap())
}

fn check_gradients(params: &Params, grads: &candle_core::backprop::GradStore) {
    for (name, var) in params.iter() {
        let g = grads.get(var).unwrap_or_else(|| panic!("`{name}` received no gradient"));
        let v: Vec<f64> = g.flatten_all().unwrap().to_dtype(DType::F64).unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "`{name}`: non-finite gradient");
        assert!(v.iter().any(|x| *x != 0.0), "`{name}`: all-zero gradient");
    }
}

fn finite_difference(what: &str, var: &Var, analytic: &Tensor, entries: &[usize], loss: impl Fn() -> f64) {
    let shape = var.as_tensor().dims().to_vec();
    let base: Vec<f64> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
    let analytic: Vec<f64> = analytic.flatten_all().unwrap().to_vec1().unwrap();
    // ReLU, ReLU6 and max-pool make these losses piecewise smooth with many kinks: a step that
    // carries one activation across its kink spoils that central difference, and the error
    // shrinks as the step does. So the derivative counts as confirmed when central differences
    // at some step of 1e-6..1e-8 agree with autograd; a wrong gradient disagrees at every step.
    let closest = central_differences(&base, entries, &[1e-6, 1e-7, 1e-8], &analytic, |v| {
        var.set(&Tensor::from_vec(v.to_vec(), shape.as_slice(), &Device::Cpu).unwrap()).unwrap();
        loss()
    });
    for (&i, best) in entries.iter().zip(closest) {
        assert!(
            (best - analytic[i]).abs() <= 1e-6 + 1e-3 * analytic[i].abs(),
            "{what} entry {i}: closest central difference {best}, autograd {}",
            analytic[i]
        );
    }
    var.set(&Tensor::from_vec(base, shape.as_slice(), &Device::Cpu).unwrap()).unwrap();
}

fn train(forward: impl Fn(&Tensor) -> Tensor, params: &Params, lr: f64, steps: usize) -> (f64, f64) {
    let (x, y) = task(DType::F32);
    let loss = |p: &Params| {
        let _ = p;
        cross_entropy(&forward(&x), &y).unwrap()
    };
    let first = loss(params).to_scalar::<f32>().unwrap() as f64;
    for _ in 0..steps {
        let grads = loss(params).backward().unwrap();
        params.sgd_step(&grads, lr).unwrap();
    }
    (first, loss(params).to_scalar::<f32>().unwrap() as f64)
}

/// Gaussian inputs for the finite-difference checks.
fn smooth_batch() -> (Tensor, Tensor) {
    let x = wick_nn::params::normal_tensor(&[8, 3, 32, 32], 1.0, 7, DType::F64, &Device::Cpu).unwrap();
    (x, Tensor::new(&[0u32, 1, 0, 1, 0, 1, 0, 1], &Device::Cpu).unwrap())
}

#[test]
fn resnets_train_every_parameter() {
    let _turn = serial();
    for depth in [ResNetDepth::R18, ResNetDepth::R34, ResNetDepth::R50] {
        let model = ResNet::new(depth, 2, 4, DType::F64, &Device::Cpu).unwrap();
        let (x, y) = smooth_batch();
        let loss = || cross_entropy(&model.forward(&x, true).unwrap(), &y).unwrap();
        let grads = loss().backward().unwrap();
        check_gradients(&model.params, &grads);
        for name in ["conv1.weight", "layer2.0.downsample.0.weight", "layer4.1.bn1.weight", "fc.weight"] {
            let var = model.params.get(name).unwrap();
            finite_difference(&format!("{depth:?} {name}"), var, grads.get(var).unwrap(), &[0, 1], || {
                loss().to_scalar::<f64>().unwrap()
            });
        }
    }
    for depth in [ResNetDepth::R18, ResNetDepth::R34, ResNetDepth::R50] {
        let model = ResNet::new(depth, 2, 8, DType::F32, &Device::Cpu).unwrap();
        let (first, last) = train(|x| model.forward(x, true).unwrap(), &model.params, 0.02, 20);
        assert!(last < 0.5 * first, "{depth:?} loss {first} -> {last}");
    }
    let standard = ResNet::new(ResNetDepth::R50, 1000, 64, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(standard.params.numel(), 25_557_032, "torchvision's ResNet-50 has 25,557,032 parameters");
    let r18 = ResNet::new(ResNetDepth::R18, 1000, 64, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(r18.params.numel(), 11_689_512, "torchvision's ResNet-18 has 11,689,512 parameters");
}

#[test]
fn mobilenet_trains_every_parameter() {
    let _turn = serial();
    let model = MobileNetV2::new(2, 0.25, DType::F64, &Device::Cpu).unwrap();
    let (x, y) = smooth_batch();
    let loss = || cross_entropy(&model.forward(&x, true).unwrap(), &y).unwrap();
    let grads = loss().backward().unwrap();
    check_gradients(&model.params, &grads);
    for name in ["features.0.0.weight", "features.2.conv.1.0.weight", "features.5.conv.3.bias", "classifier.1.weight"] {
        let var = model.params.get(name).unwrap();
        finite_difference(name, var, grads.get(var).unwrap(), &[0, 2], || loss().to_scalar::<f64>().unwrap());
    }
    let model = MobileNetV2::new(2, 0.5, DType::F32, &Device::Cpu).unwrap();
    let (first, last) = train(|x| model.forward(x, true).unwrap(), &model.params, 0.1, 25);
    assert!(last < 0.7 * first, "MobileNetV2 loss {first} -> {last}");
}

#[test]
fn vit_trains_every_parameter() {
    let _turn = serial();
    use wick_zoo::vit::{Vit, VitConfig};
    let config =
        VitConfig { image_size: 32, patch_size: 8, hidden: 16, layers: 2, heads: 2, mlp_dim: 32, num_classes: 2 };
    let model = Vit::new(config, DType::F64, &Device::Cpu).unwrap();
    let (x, y) = smooth_batch();
    let loss = || cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
    let grads = loss().backward().unwrap();
    check_gradients(&model.params, &grads);
    // The position embedding's entries 0 and 1 are the class token's row, 20 and 37 patch rows.
    for (name, entries) in [
        ("conv_proj.weight", &[0, 1][..]),
        ("conv_proj.bias", &[0, 5]),
        ("class_token", &[0, 1]),
        ("encoder.pos_embedding", &[0, 1, 20, 37]),
        ("encoder.layers.encoder_layer_1.self_attention.in_proj_weight", &[0, 1]),
        ("heads.head.bias", &[0, 1]),
    ] {
        let var = model.params.get(name).unwrap();
        finite_difference(name, var, grads.get(var).unwrap(), entries, || loss().to_scalar::<f64>().unwrap());
    }
    let model = Vit::new(config, DType::F32, &Device::Cpu).unwrap();
    let (first, last) = train(|x| model.forward(x).unwrap(), &model.params, 0.1, 40);
    assert!(last < 0.5 * first, "ViT loss {first} -> {last}");
    let b16 = Vit::new(VitConfig::b16(), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(b16.params.numel(), 86_567_656, "torchvision's vit_b_16 has 86,567,656 parameters");
}

/// Inference inside `no_grad` runs each convolution, batch norm (running statistics),
/// residual and activation as one pass over the convolution's output; with gradients on (the
/// parameters are tracked) the same forward runs them as separate ops. The logits are equal
/// bit for bit (the bound is zero: the same operations in the same order), in f32 and f64, at
/// an image size where the stem's columns are cut into chunks, after a few training passes have
/// moved the running statistics away from (0, 1).
#[test]
fn inference_in_one_pass_equals_the_separate_ops() {
    let _turn = serial();
    let x32 = wick_nn::params::normal_tensor(&[2, 3, 112, 112], 1.0, 3, DType::F32, &Device::Cpu).unwrap();
    for dtype in [DType::F32, DType::F64] {
        let x = x32.to_dtype(dtype).unwrap();
        let resnet = ResNet::new(ResNetDepth::R18, 10, 16, dtype, &Device::Cpu).unwrap();
        let mobilenet = MobileNetV2::new(10, 0.5, dtype, &Device::Cpu).unwrap();
        type Forward<'a> = Box<dyn Fn(bool) -> Tensor + 'a>;
        let models: [(&str, Forward); 2] = [
            ("ResNet-18", Box::new(|train| resnet.forward(&x, train).unwrap())),
            ("MobileNetV2", Box::new(|train| mobilenet.forward(&x, train).unwrap())),
        ];
        for (name, forward) in models {
            for _ in 0..3 {
                forward(true);
            }
            let fused = wick_nn::no_grad(|| forward(false));
            let separate = forward(false);
            let bits = |t: &Tensor| -> Vec<u64> {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(fused.dims(), &[2, 10]);
            assert_eq!(
                bits(&fused),
                bits(&separate),
                "{name} {dtype:?}: fused inference differs from the separate ops"
            );
            let spread = separate.to_dtype(DType::F64).unwrap().var(1).unwrap().sum_all().unwrap();
            assert!(spread.to_scalar::<f64>().unwrap() > 0.0, "{name} {dtype:?}: constant logits check nothing");
        }
    }
}
