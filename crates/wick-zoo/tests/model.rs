//! The `Model` trait and the candle traits against what each model's own methods compute: the
//! same loss to the bit, the same logits.

use candle_core::{DType, Device, Module, ModuleT, Tensor};
use wick_nn::ops::cross_entropy;
use wick_nn::params::normal_tensor;
use wick_nn::{Labelled, Model};
use wick_zoo::bert::{Bert, BertConfig, SentenceBatch};
use wick_zoo::llama::{Llama, LlamaConfig};
use wick_zoo::mobilenet::MobileNetV2;
use wick_zoo::resnet::{ResNet, ResNetDepth};
use wick_zoo::vit::{Vit, VitConfig};

fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    scalar(&(a - b).unwrap().abs().unwrap().max_all().unwrap())
}

const BERT: BertConfig = BertConfig::tiny(64);

const VIT: VitConfig = VitConfig::tiny(10);

fn labels(n: usize, classes: usize) -> Tensor {
    Tensor::new((0..n).map(|i| ((i * 7 + 3) % classes) as u32).collect::<Vec<_>>(), &Device::Cpu).unwrap()
}

/// Eight seeded 32×32 images and labels.
fn images() -> Labelled {
    Labelled {
        inputs: normal_tensor(&[8, 3, 32, 32], 1.0, 11, DType::F32, &Device::Cpu).unwrap(),
        labels: labels(8, 10),
    }
}

/// Four sequences of 17 tokens in `0..48`.
fn llama_batch() -> Tensor {
    let ids: Vec<u32> = (0..4 * 17).map(|i| ((i * 5 + i / 3) % 48) as u32).collect();
    Tensor::from_vec(ids, (4, 17), &Device::Cpu).unwrap()
}

/// Four sentences of 16 tokens, the last 5 of the second pair padding, a readout into 2 classes.
fn bert_batch() -> SentenceBatch {
    let cpu = Device::Cpu;
    let ids: Vec<u32> = (0..4 * 16).map(|i| ((i * 7 + i / 5) % 64) as u32).collect();
    let mask: Vec<u32> = (0..4 * 16).map(|i| u32::from(i / 16 < 2 || i % 16 < 11)).collect();
    SentenceBatch {
        ids: Tensor::from_vec(ids, (4, 16), &cpu).unwrap(),
        mask: Tensor::from_vec(mask, (4, 16), &cpu).unwrap(),
        readout: normal_tensor(&[64, 2], 0.5, 5, DType::F32, &cpu).unwrap(),
        labels: labels(4, 2),
    }
}

#[test]
fn each_models_trait_loss_is_its_hand_written_loss() {
    let cpu = Device::Cpu;
    // Decoder: next-token cross-entropy written out.
    let llama = Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu).unwrap();
    let ids = llama_batch();
    let (b, s) = ids.dims2().unwrap();
    let logits = llama.forward(&ids.narrow(1, 0, s - 1).unwrap()).unwrap();
    let by_hand = cross_entropy(
        &logits.reshape((b * (s - 1), 48)).unwrap(),
        &ids.narrow(1, 1, s - 1).unwrap().flatten_all().unwrap(),
    )
    .unwrap();
    assert_eq!(scalar(&llama.loss(&ids).unwrap()), scalar(&by_hand));
    assert!(llama.loss(&ids.narrow(1, 0, 1).unwrap()).is_err(), "one token has no next token");
    // BERT: mean-pooled, read out, cross-entropy.
    let bert = Bert::new(BERT, DType::F32, &cpu).unwrap();
    let batch = bert_batch();
    let pooled = Bert::mean_pool(&bert.forward(&batch.ids, &batch.mask).unwrap(), &batch.mask).unwrap();
    let by_hand = cross_entropy(&pooled.matmul(&batch.readout).unwrap(), &batch.labels).unwrap();
    assert_eq!(scalar(&bert.loss(&batch).unwrap()), scalar(&by_hand));
    // ViT.
    let vit = Vit::new(VIT, DType::F32, &cpu).unwrap();
    let batch = images();
    let by_hand = cross_entropy(&vit.forward(&batch.inputs).unwrap(), &batch.labels).unwrap();
    assert_eq!(scalar(&vit.loss(&batch).unwrap()), scalar(&by_hand));
}

#[test]
fn the_cnns_loss_trains_batch_norm_and_moduled_eval_uses_running_statistics() {
    let cpu = Device::Cpu;
    let batch = images();
    // Two identical models: one through the trait, one by hand; both update their running
    // statistics once, so the eval logits agree afterwards too.
    let (a, b) = (
        ResNet::new(ResNetDepth::R18, 10, 8, DType::F32, &cpu).unwrap(),
        ResNet::new(ResNetDepth::R18, 10, 8, DType::F32, &cpu).unwrap(),
    );
    let by_hand = cross_entropy(&b.forward(&batch.inputs, true).unwrap(), &batch.labels).unwrap();
    assert_eq!(scalar(&a.loss(&batch).unwrap()), scalar(&by_hand));
    let eval = a.forward_t(&batch.inputs, false).unwrap();
    assert_eq!(max_diff(&eval, &b.forward(&batch.inputs, false).unwrap()), 0.0);
    // Training mode differs from eval mode (batch statistics), and ModuleT passes the flag on.
    assert!(max_diff(&a.forward_t(&batch.inputs, true).unwrap(), &eval) > 0.0);

    let (a, b) =
        (MobileNetV2::new(10, 0.25, DType::F32, &cpu).unwrap(), MobileNetV2::new(10, 0.25, DType::F32, &cpu).unwrap());
    let by_hand = cross_entropy(&b.forward(&batch.inputs, true).unwrap(), &batch.labels).unwrap();
    assert_eq!(scalar(&a.loss(&batch).unwrap()), scalar(&by_hand));
    assert_eq!(max_diff(&a.forward_t(&batch.inputs, false).unwrap(), &b.forward(&batch.inputs, false).unwrap()), 0.0);
}

#[test]
fn candle_module_forward_is_the_models_forward_and_errors_keep_their_cause() {
    let cpu = Device::Cpu;
    let llama = Llama::new(LlamaConfig::tiny(48), DType::F32, &cpu).unwrap();
    let ids = llama_batch();
    assert_eq!(max_diff(&Module::forward(&llama, &ids).unwrap(), &llama.forward(&ids).unwrap()), 0.0);
    let vit = Vit::new(VIT, DType::F32, &cpu).unwrap();
    let x = images().inputs;
    assert_eq!(max_diff(&Module::forward(&vit, &x).unwrap(), &vit.forward(&x).unwrap()), 0.0);
    // A sequence longer than the model's: the zoo error, carried through candle's error.
    let long = Tensor::zeros((1, 65), DType::U32, &cpu).unwrap();
    let err = Module::forward(&llama, &long).unwrap_err();
    assert!(err.to_string().contains("exceeds max_seq"), "{err}");
}

#[test]
fn checkpointed_trait_loss_gives_the_plain_gradients() {
    let cpu = Device::Cpu;
    let vit = Vit::new(VIT, DType::F64, &cpu).unwrap();
    let batch = images();
    let batch = Labelled { inputs: batch.inputs.to_dtype(DType::F64).unwrap(), labels: batch.labels };
    let plain = vit.loss(&batch).unwrap().backward().unwrap();
    let ckpt = wick_nn::checkpoint::Checkpointing::new();
    let loss = vit.loss_with(&batch, Some(&ckpt)).unwrap();
    let grads = ckpt.backward(&loss, vit.params()).unwrap();
    for v in vit.vars() {
        let (a, b) = (plain.get(v.as_tensor()).unwrap(), grads.get(v.as_tensor()).unwrap());
        assert!(max_diff(a, b) < 1e-12);
    }
}
