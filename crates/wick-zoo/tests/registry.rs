//! The registry builds the same models as their own constructors, refuses what does not fit,
//! and its named models have their published sizes.

use candle_core::{DType, Device, Tensor};
use wick_nn::Model;
use wick_zoo::bert::{Bert, BertConfig};
use wick_zoo::llama::{Llama, LlamaConfig};
use wick_zoo::registry::{Input, ModelSpec, ZooBatch, NAMED};
use wick_zoo::resnet::{ResNet, ResNetDepth};
use wick_zoo::vit::VitConfig;

fn scalar(t: &Tensor) -> f32 {
    t.to_scalar::<f32>().unwrap()
}

#[test]
fn a_spec_builds_what_its_constructor_builds() {
    let cpu = Device::Cpu;
    // The constructors are seeded by parameter name, so the same architecture gives the same
    // values and the same loss on the same batch.
    let spec = ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 8, image: 32 };
    let batch = spec.batch(3, DType::F32, &cpu).unwrap();
    let ZooBatch::Images(images) = &batch else { panic!("a ResNet batch is images") };
    assert_eq!(images.inputs.dims(), &[3, 3, 32, 32]);
    assert_eq!(images.labels.to_vec1::<u32>().unwrap(), vec![0, 1, 2]);
    let direct = ResNet::new(ResNetDepth::R18, 10, 8, DType::F32, &cpu).unwrap();
    let built = spec.build(DType::F32, &cpu).unwrap();
    assert_eq!(scalar(&built.loss(&batch).unwrap()), scalar(&direct.loss(images).unwrap()));

    let config = LlamaConfig::tiny(50);
    let spec = ModelSpec::Llama { config, seq: 9 };
    let batch = spec.batch(2, DType::F32, &cpu).unwrap();
    let ZooBatch::Tokens(ids) = &batch else { panic!("a decoder batch is token ids") };
    assert_eq!(ids.dims(), &[2, 9]);
    assert!(ids.flatten_all().unwrap().to_vec1::<u32>().unwrap().iter().all(|&id| id < 50));
    let direct = Llama::new(LlamaConfig { max_seq: 9, ..config }, DType::F32, &cpu).unwrap();
    let built = spec.build(DType::F32, &cpu).unwrap();
    assert_eq!(scalar(&built.loss(&batch).unwrap()), scalar(&direct.loss(ids).unwrap()));
    // Evaluation: logits for every position.
    assert_eq!(built.forward(&batch).unwrap().dims(), &[2, 9, 50]);

    let spec = ModelSpec::Bert { config: BertConfig::tiny(40), seq: 7 };
    let batch = spec.batch(2, DType::F32, &cpu).unwrap();
    let ZooBatch::Sentences(sentences) = &batch else { panic!("a BERT batch is sentences") };
    let direct = Bert::new(BertConfig::tiny(40), DType::F32, &cpu).unwrap();
    let built = spec.build(DType::F32, &cpu).unwrap();
    assert_eq!(scalar(&built.loss(&batch).unwrap()), scalar(&direct.loss(sentences).unwrap()));
    assert_eq!(built.forward(&batch).unwrap().dims(), &[2, 7, 64]);

    // The same arguments give the same batch.
    let again = spec.batch(2, DType::F32, &cpu).unwrap();
    let ZooBatch::Sentences(again) = again else { panic!() };
    let same = |a: &Tensor, b: &Tensor| a.to_dtype(DType::F32).unwrap().eq(&b.to_dtype(DType::F32).unwrap()).unwrap();
    assert!(same(&again.ids, &sentences.ids).flatten_all().unwrap().min(0).unwrap().to_scalar::<u8>().unwrap() == 1);
    assert!(
        same(&again.readout, &sentences.readout).flatten_all().unwrap().min(0).unwrap().to_scalar::<u8>().unwrap() == 1
    );
}

#[test]
fn token_ids_reach_the_whole_vocabulary() {
    // The embedding's memory depends on which rows a batch touches: a real vocabulary must be
    // reached end to end, not only its first rows.
    let spec = ModelSpec::Bert { config: BertConfig::base(), seq: 128 };
    let ZooBatch::Sentences(batch) = spec.batch(8, DType::F32, &Device::Cpu).unwrap() else { panic!() };
    let ids = batch.ids.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    let max = *ids.iter().max().unwrap();
    assert!(max < 30_522 && max > 30_000, "largest id {max}");
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "1024 positions, 1024 different ids");
}

/// torchvision's and Hugging Face's published parameter counts, and Meta's for Llama 2.
#[test]
fn named_models_have_their_published_sizes() {
    let input = Input { image: 32, seq: 16 };
    let counts = [
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("mobilenet_v2", 3_504_872),
        ("vit_b_16", 86_567_656),
        // Hugging Face's counts less the pooler (768² + 768 and 384² + 384), which the zoo's
        // encoder does not have.
        ("bert-base", 109_482_240 - 590_592),
        ("minilm", 22_713_216 - 147_840),
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
    ];
    assert_eq!(counts.map(|(n, _)| n), NAMED.map(|n| n.name), "every named model is checked");
    for (name, count) in counts {
        let spec = ModelSpec::named(name, input).unwrap();
        let numel = match spec.parameter_count() {
            Some(n) => n,
            None => spec.build(DType::F32, &Device::Cpu).unwrap().params().numel(),
        };
        assert_eq!(numel, count, "{name}");
    }
    // The decoders' bytes come from the configuration: f32 here, and under bf16 autocast the
    // norm scales stay f32.
    let llama = ModelSpec::named("llama2-7b", input).unwrap();
    assert!(llama.profiled_by_layers());
    let f32_bytes = llama.param_bytes(DType::F32).unwrap();
    assert_eq!(f32_bytes.total, 6_738_415_616 * 4);
    let norms = (2 * 32 + 1) * 4096;
    assert_eq!(llama.param_bytes(DType::BF16).unwrap().total, (6_738_415_616 - norms) * 2 + norms * 4);
    assert_eq!(f32_bytes.largest, 32_000 * 4096 * 4);
}

#[test]
fn what_does_not_fit_is_refused_by_name() {
    let err = |r: Result<ModelSpec, wick_zoo::ZooError>| r.unwrap_err().to_string();
    let e = err(ModelSpec::named("resnet101", Input::default()));
    assert!(e.contains("resnet101") && e.contains("resnet18") && e.contains("llama2-13b"), "{e}");
    let e = err(ModelSpec::named("resnet50", Input { image: 16, seq: 128 }));
    assert!(e.contains("16") && e.contains("32"), "{e}");
    let e = err(ModelSpec::named("bert-base", Input { image: 224, seq: 513 }));
    assert!(e.contains("512 positions"), "{e}");
    let e = err(ModelSpec::named("llama2-7b", Input { image: 224, seq: 1 }));
    assert!(e.contains("next-token"), "{e}");
    // A spec written by hand is checked when built.
    let vit = ModelSpec::Vit(VitConfig::tiny(10));
    let resnet = ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 8, image: 8 };
    assert!(resnet.build(DType::F32, &Device::Cpu).is_err());
    // A batch of the wrong kind is an error naming both, not a panic.
    let model = vit.build(DType::F32, &Device::Cpu).unwrap();
    let tokens = ModelSpec::Llama { config: LlamaConfig::tiny(10), seq: 4 }.batch(1, DType::F32, &Device::Cpu).unwrap();
    let e = model.loss(&tokens).unwrap_err().to_string();
    assert!(e.contains("ViT") && e.contains("token ids"), "{e}");
    assert!(model.forward(&tokens).is_err());
}

/// An architecture with a count of zero (a vocabulary, heads, classes, a width) or BERT heads
/// that do not divide its width is refused by name before anything is built; a size of 0 that
/// counts nothing (a depth of no layers) still builds.
#[test]
fn zero_sizes_are_refused_by_name() {
    let refused = |spec: ModelSpec, name: &str| {
        let e = spec.check().unwrap_err().to_string();
        assert!(e.contains(&format!("`{name}` is 0")), "{name}: {e}");
        assert!(spec.build(DType::F32, &Device::Cpu).is_err(), "{name}: built");
    };
    let llama = LlamaConfig::tiny(10);
    refused(ModelSpec::Llama { config: LlamaConfig { vocab_size: 0, ..llama }, seq: 4 }, "vocab_size");
    refused(ModelSpec::Llama { config: LlamaConfig { intermediate_size: 0, ..llama }, seq: 4 }, "intermediate_size");
    let bert = BertConfig::tiny(10);
    refused(ModelSpec::Bert { config: BertConfig { type_vocab_size: 0, ..bert.clone() }, seq: 4 }, "type_vocab_size");
    refused(ModelSpec::Vit(VitConfig { num_classes: 0, ..VitConfig::tiny(10) }), "num_classes");
    refused(ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 0, image: 32 }, "width");
    refused(ModelSpec::MobileNetV2 { classes: 0, width_mult: 1.0, image: 32 }, "classes");
    for width_mult in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = ModelSpec::MobileNetV2 { classes: 10, width_mult, image: 32 }.check().unwrap_err().to_string();
        assert!(e.contains("width multiplier"), "{width_mult}: {e}");
    }
    let heads = BertConfig { num_attention_heads: bert.hidden_size + 1, ..bert.clone() };
    let e = ModelSpec::Bert { config: heads, seq: 4 }.check().unwrap_err().to_string();
    assert!(e.contains("not divisible by num_attention_heads"), "{e}");
    let shallow = ModelSpec::Llama { config: LlamaConfig { num_layers: 0, ..llama }, seq: 4 };
    let model = shallow.build(DType::F32, &Device::Cpu).unwrap();
    assert!(scalar(&model.loss(&shallow.batch(2, DType::F32, &Device::Cpu).unwrap()).unwrap()).is_finite());
}

/// `ZooBatch::narrow` takes examples out of a batch: the parts are the whole's rows, BERT's
/// readout is shared, and a range past the batch is refused.
#[test]
fn batches_narrow_to_their_examples() {
    let specs = [
        ModelSpec::Llama { config: LlamaConfig::tiny(32), seq: 6 },
        ModelSpec::named("resnet18", Input { image: 32, seq: 8 }).unwrap(),
        ModelSpec::named("minilm", Input { image: 32, seq: 8 }).unwrap(),
    ];
    let rows = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for spec in specs {
        let whole = spec.batch(4, DType::F32, &Device::Cpu).unwrap();
        let (first, second) = (whole.narrow(0, 1).unwrap(), whole.narrow(1, 3).unwrap());
        let parts = |b: &ZooBatch| -> Vec<Tensor> {
            match b {
                ZooBatch::Tokens(ids) => vec![ids.clone()],
                ZooBatch::Images(l) => vec![l.inputs.clone(), l.labels.clone()],
                ZooBatch::Sentences(s) => vec![s.ids.clone(), s.mask.clone(), s.labels.clone(), s.readout.clone()],
            }
        };
        for (k, ((w, a), b)) in parts(&whole).iter().zip(parts(&first)).zip(parts(&second)).enumerate() {
            if matches!(whole, ZooBatch::Sentences(_)) && k == 3 {
                assert_eq!((rows(&a), rows(&b)), (rows(w), rows(w)), "the readout stays whole");
                continue;
            }
            assert_eq!([rows(&a), rows(&b)].concat(), rows(w), "{spec:?} part {k}");
            assert_eq!((a.dims()[0], b.dims()[0]), (1, 3));
        }
        assert!(whole.narrow(3, 2).is_err(), "past the batch");
    }
}

/// Every zoo batch gives its tensors to a step captured as a CUDA graph and is rebuilt from copies
/// of them (`Model::batch_tensors` / `Model::batch_with`): the rebuilt batch's loss is the
/// original's to the bit, its tensors are the copies (not the originals), and a wrong number of
/// tensors is an error.
#[test]
fn every_zoo_batch_round_trips_through_its_tensors() {
    use wick_zoo::registry::ZooModel;
    let specs = [
        ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 10, width: 8, image: 32 },
        ModelSpec::MobileNetV2 { classes: 10, width_mult: 0.25, image: 32 },
        ModelSpec::Vit(VitConfig::tiny(10)),
        ModelSpec::Bert { config: BertConfig::tiny(64), seq: 8 },
        ModelSpec::Llama { config: LlamaConfig::tiny(64), seq: 8 },
    ];
    for spec in specs {
        let model = spec.build(DType::F32, &Device::Cpu).unwrap();
        let batch = spec.batch(2, DType::F32, &Device::Cpu).unwrap();
        let tensors = ZooModel::batch_tensors(&batch).expect("a zoo batch is tensors alone");
        let expected = match &batch {
            ZooBatch::Images(_) => 2,
            ZooBatch::Sentences(_) => 4,
            ZooBatch::Tokens(_) => 1,
        };
        assert_eq!(tensors.len(), expected, "{spec:?}");
        let copies: Vec<Tensor> = tensors.iter().map(|t| t.copy().unwrap()).collect();
        let rebuilt = ZooModel::batch_with(&batch, &copies).unwrap();
        let again = ZooModel::batch_tensors(&rebuilt).unwrap();
        assert!(again.iter().zip(&copies).all(|(a, c)| a.id() == c.id()), "{spec:?}: the copies are the batch's");
        let loss = |b: &ZooBatch| model.loss(b).unwrap().to_scalar::<f32>().unwrap().to_bits();
        assert_eq!(loss(&rebuilt), loss(&batch), "{spec:?}");
        let short = &copies[..copies.len() - 1];
        let e = ZooModel::batch_with(&batch, short).expect_err("too few tensors").to_string();
        assert!(e.contains(&format!("{} tensors for a batch of {expected}", expected - 1)), "{e}");
    }
}
