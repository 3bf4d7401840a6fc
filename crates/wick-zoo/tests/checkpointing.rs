//! Activation checkpointing gives the same gradients with less activation memory. This binary
//! installs the counting allocator so peaks are exact; its tests take turns.

use candle_core::{DType, Device, Tensor};
use wick::host_memory::{counted_heap, counted_peak, reset_counted_peak};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::Model;
use wick_zoo::llama::{Llama, LlamaConfig};

wick::heap!(counting);

/// The heap counters are process-wide, so the tests of this binary take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn llama_checkpointing_same_gradients_less_memory() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let config = LlamaConfig {
        vocab_size: 64,
        hidden_size: 64,
        num_layers: 6,
        num_heads: 4,
        intermediate_size: 256,
        max_seq: 128,
        rms_eps: 1e-6,
        rope_theta: 10_000.0,
    };
    let model = Llama::new(config, DType::F64, &Device::Cpu).unwrap();
    let ids =
        Tensor::from_vec((0..8 * 96).map(|i| (i * 7 % 64) as u32).collect::<Vec<_>>(), (8, 96), &Device::Cpu).unwrap();
    // Plain.
    let plain = model.loss(&ids).unwrap().backward().unwrap();
    // Checkpointed: every decoder layer recomputed in backward.
    let ckpt = Checkpointing::new();
    let loss = model.loss_with(&ids, Some(&ckpt)).unwrap();
    assert_eq!(loss.to_scalar::<f64>().unwrap(), model.loss(&ids).unwrap().to_scalar::<f64>().unwrap());
    let checkpointed = ckpt.backward(&loss, &model.params).unwrap();
    drop(loss);
    for (name, var) in model.params.iter() {
        let a = plain.get(var).unwrap_or_else(|| panic!("{name}: no plain gradient"));
        let b = checkpointed.get(var).unwrap_or_else(|| panic!("{name}: no checkpointed gradient"));
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        let scale = a.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        assert!(diff <= 1e-10 * (1.0 + scale), "{name}: gradients differ by {diff}");
    }
    drop((plain, checkpointed));

    // Peak heap of one training step (forward + backward), each way.
    let step_peak = |ckpt: Option<&Checkpointing>| {
        let base = counted_heap().unwrap();
        reset_counted_peak();
        let loss = model.loss_with(&ids, ckpt).unwrap();
        let grads = match ckpt {
            Some(c) => c.backward(&loss, &model.params).unwrap(),
            None => loss.backward().unwrap(),
        };
        drop((loss, grads));
        counted_peak().unwrap() - base
    };
    let plain_peak = step_peak(None);
    let ckpt_peak = step_peak(Some(&Checkpointing::new()));
    println!("training-step peak: plain {} MiB, checkpointed {} MiB", plain_peak >> 20, ckpt_peak >> 20);
    assert!(
        (ckpt_peak as f64) < 0.6 * plain_peak as f64,
        "checkpointing saves activation memory: {ckpt_peak} vs {plain_peak}"
    );
}

/// Gradients of `loss(None)` and `loss(Some(ckpt))` agree for every parameter.
fn same_gradients(params: &wick_nn::params::Params, loss: impl Fn(Option<&Checkpointing>) -> Tensor) {
    let plain = loss(None).backward().unwrap();
    let ckpt = Checkpointing::new();
    let l = loss(Some(&ckpt));
    let checkpointed = ckpt.backward(&l, params).unwrap();
    for (name, var) in params.iter() {
        let a = plain.get(var).unwrap_or_else(|| panic!("{name}: no plain gradient"));
        let b = checkpointed.get(var).unwrap_or_else(|| panic!("{name}: no checkpointed gradient"));
        let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        let scale = a.abs().unwrap().max_all().unwrap().to_scalar::<f64>().unwrap();
        assert!(diff <= 1e-9 * (1.0 + scale), "{name}: gradients differ by {diff}");
    }
}

/// Peak heap of one forward+backward and the activations the graph keeps after the forward
/// pass, plain vs checkpointed: ((peak, kept) plain, (peak, kept) checkpointed).
type Measured = ((usize, usize), (usize, usize));
fn peaks(params: &wick_nn::params::Params, loss: impl Fn(Option<&Checkpointing>) -> Tensor) -> Measured {
    let run = |ckpt: Option<&Checkpointing>| {
        let base = counted_heap().unwrap();
        reset_counted_peak();
        let l = loss(ckpt);
        let kept = wick_nn::graph::graph_bytes(&l).total;
        let g = match ckpt {
            Some(c) => c.backward(&l, params).unwrap(),
            None => l.backward().unwrap(),
        };
        drop((l, g));
        (counted_peak().unwrap() - base, kept)
    };
    (run(None), run(Some(&Checkpointing::new())))
}

#[test]
fn checkpointing_works_on_every_zoo_model() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use wick_nn::ops::cross_entropy;
    use wick_zoo::bert::{Bert, BertConfig};
    use wick_zoo::mobilenet::MobileNetV2;
    use wick_zoo::resnet::{ResNet, ResNetDepth};
    use wick_zoo::vit::{Vit, VitConfig};
    let dev = Device::Cpu;
    let labels = Tensor::new(&[0u32, 1, 0, 1], &dev).unwrap();
    let images = |dtype| wick_nn::params::normal_tensor(&[4, 3, 64, 64], 1.0, 11, dtype, &dev).unwrap();
    let mut report = Vec::new();
    for dtype in [DType::F64, DType::F32] {
        let bert = Bert::new(
            BertConfig {
                vocab_size: 50,
                hidden_size: 64,
                num_hidden_layers: 4,
                num_attention_heads: 4,
                intermediate_size: 256,
                max_position_embeddings: 128,
                type_vocab_size: 2,
                layer_norm_eps: 1e-12,
                pad_token_id: Some(0),
            },
            dtype,
            &dev,
        )
        .unwrap();
        let ids =
            Tensor::from_vec((0..4 * 96).map(|i| (i * 3 % 50) as u32).collect::<Vec<_>>(), (4, 96), &dev).unwrap();
        let mask = Tensor::ones((4, 96), DType::U32, &dev).unwrap();
        let bert_loss =
            |c: Option<&Checkpointing>| bert.forward_with(&ids, &mask, c).unwrap().sqr().unwrap().mean_all().unwrap();
        let vit = Vit::new(
            VitConfig { image_size: 64, patch_size: 8, hidden: 64, layers: 4, heads: 4, mlp_dim: 128, num_classes: 2 },
            dtype,
            &dev,
        )
        .unwrap();
        let x = images(dtype);
        let vit_loss = |c: Option<&Checkpointing>| cross_entropy(&vit.forward_with(&x, c).unwrap(), &labels).unwrap();
        let r18 = ResNet::new(ResNetDepth::R18, 2, 16, dtype, &dev).unwrap();
        let r18_loss =
            |c: Option<&Checkpointing>| cross_entropy(&r18.forward_with(&x, true, c).unwrap(), &labels).unwrap();
        let r50 = ResNet::new(ResNetDepth::R50, 2, 16, dtype, &dev).unwrap();
        let r50_loss =
            |c: Option<&Checkpointing>| cross_entropy(&r50.forward_with(&x, true, c).unwrap(), &labels).unwrap();
        let mbn = MobileNetV2::new(2, 0.5, dtype, &dev).unwrap();
        let mbn_loss =
            |c: Option<&Checkpointing>| cross_entropy(&mbn.forward_with(&x, true, c).unwrap(), &labels).unwrap();
        if dtype == DType::F64 {
            same_gradients(&bert.params, bert_loss);
            same_gradients(&vit.params, vit_loss);
            same_gradients(&r18.params, r18_loss);
            same_gradients(&r50.params, r50_loss);
            same_gradients(&mbn.params, mbn_loss);
        } else {
            for (name, ((plain, plain_kept), (ckpt, ckpt_kept))) in [
                ("bert", peaks(&bert.params, bert_loss)),
                ("vit", peaks(&vit.params, vit_loss)),
                ("resnet18", peaks(&r18.params, r18_loss)),
                ("resnet50", peaks(&r50.params, r50_loss)),
                ("mobilenet_v2", peaks(&mbn.params, mbn_loss)),
            ] {
                println!(
                    "{name}: training-step peak plain {:.1} MiB, checkpointed {:.1} MiB; activations kept {:.1} vs {:.1} MiB",
                    plain as f64 / 1048576.0,
                    ckpt as f64 / 1048576.0,
                    plain_kept as f64 / 1048576.0,
                    ckpt_kept as f64 / 1048576.0,
                );
                report.push((name, plain, ckpt, plain_kept, ckpt_kept));
            }
        }
    }
    for (name, plain, ckpt, plain_kept, ckpt_kept) in report {
        // Every model keeps far fewer activations, and its training step peaks lower by at least
        // half of the activation bytes checkpointing removes (the rest of a peak — parameter
        // gradients, the recomputed segment, the ops' scratch — it cannot touch; at these test
        // sizes that is most of a small CNN's peak, and the parallel ops' scratch moves a peak
        // by a few hundred KiB from run to run).
        assert!((ckpt_kept as f64) < 0.6 * plain_kept as f64, "{name}: kept {ckpt_kept} vs {plain_kept}");
        let saved = plain_kept - ckpt_kept;
        assert!(
            ckpt + saved / 2 <= plain,
            "{name}: the peak falls by less than half the {saved} activation bytes checkpointing removes ({ckpt} vs {plain})"
        );
    }
}

/// A weight read inside a checkpointed segment and outside it: the backward hook is never handed
/// part of its gradient. Its outer part is complete at the outer graph's point for it, but the
/// segment's part comes from the segment's own backward pass; the hook is skipped for it and the
/// store returned holds the whole gradient (data-parallel overlap reduces what the hook takes,
/// so a partial gradient there would be reduced short).
#[test]
fn a_weight_shared_with_a_segment_reaches_the_hook_never_in_part() {
    let _turn = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    use wick_nn::params::Params;
    let mut params = Params::with_seed(7);
    let init = wick_nn::params::Init::Normal(0.5);
    let w = params.create("w", &[4, 4], init, DType::F64, &Device::Cpu).unwrap();
    let b = params.create("b", &[4], init, DType::F64, &Device::Cpu).unwrap();
    let x = Tensor::arange(0f64, 8.0, &Device::Cpu).unwrap().reshape((2, 4)).unwrap();
    let loss = |ckpt: Option<&Checkpointing>| {
        let inner = |x: &Tensor, ws: &[Tensor]| x.matmul(&ws[0])?.broadcast_add(&ws[1])?.tanh();
        let y = match ckpt {
            Some(c) => c.segment(&x, vec![w.clone(), b.clone()], inner).unwrap(),
            None => inner(&x, &[w.clone(), b.clone()]).unwrap(),
        };
        // `w` read outside the segment too.
        (y.sum_all().unwrap() + w.sqr().unwrap().sum_all().unwrap()).unwrap()
    };
    let plain = loss(None).backward().unwrap();
    let ckpt = Checkpointing::new();
    let mut handed = Vec::new();
    let mut hook = |v: &Tensor, store: &mut candle_core::backprop::GradStore| {
        if let Some(g) = store.remove(v) {
            handed.push((v.id(), g));
        }
        Ok(())
    };
    let rest = ckpt.backward_with_hook(&loss(Some(&ckpt)), &params, &mut hook).unwrap();
    for var in [&w, &b] {
        let expected = plain.get(var).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let from_hook: Vec<_> = handed.iter().filter(|(id, _)| *id == var.id()).collect();
        assert!(from_hook.is_empty(), "a segment's weight is not handed to the hook");
        let got = rest.get(var).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for (g, e) in got.iter().zip(&expected) {
            assert!((g - e).abs() <= 1e-12 * e.abs().max(1.0), "{got:?} against {expected:?}");
        }
    }
}
