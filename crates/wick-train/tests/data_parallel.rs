//! Data-parallel training in a group of one process (no MPI needed): replicated and ZeRO-1/2/3
//! take the same steps, to the bit, as the plain trainer, and a sharded run saves a checkpoint
//! that a plain run resumes from.

use candle_core::{DType, Device, Tensor};
use wick_train::dist::{DataParallelOptions, ProcessGroup, Sharding};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::CheckpointDir;
use wick_zoo::llama::{Llama, LlamaConfig};

fn trainer(sharding: Option<Sharding>) -> Trainer<Llama> {
    trainer_with(sharding, TrainOptions::default())
}

fn trainer_with(sharding: Option<Sharding>, options: TrainOptions) -> Trainer<Llama> {
    let model = Llama::new(LlamaConfig::tiny(32), DType::F32, &Device::Cpu).unwrap();
    let t = Trainer::new(model, serde_json::json!({"model": "tiny"}), None, options).unwrap();
    match sharding {
        None => t,
        Some(sharding) => {
            t.data_parallel(ProcessGroup::single(), DataParallelOptions { sharding, ..Default::default() }).unwrap()
        }
    }
}

/// One trainer per sharding (replicated, ZeRO-1, -2, -3), each in a group of one process.
fn every_sharding(options: TrainOptions) -> Vec<Trainer<Llama>> {
    [Sharding::None, Sharding::OptimizerState, Sharding::Gradients, Sharding::Parameters]
        .map(|s| trainer_with(Some(s), options))
        .into()
}

/// A small BERT and ViT of `layers` blocks each.
fn small_encoders(layers: usize) -> (wick_zoo::bert::BertConfig, wick_zoo::vit::VitConfig) {
    let bert = wick_zoo::bert::BertConfig {
        vocab_size: 50,
        hidden_size: 32,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        intermediate_size: 64,
        max_position_embeddings: 32,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        pad_token_id: Some(0),
    };
    let vit = wick_zoo::vit::VitConfig {
        image_size: 32,
        patch_size: 8,
        hidden: 32,
        layers,
        heads: 4,
        mlp_dim: 64,
        num_classes: 2,
    };
    (bert, vit)
}

/// Every value of `t` as the bits of an f32.
fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    t.to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

/// Every parameter of `t`, gathered whole (a collective under ZeRO-3), as f32 bits.
fn weights<M: wick_nn::Model>(t: &Trainer<M>) -> Vec<u32> {
    t.gathered_parameters().unwrap().iter().flat_map(|(_, v)| bits(v)).collect()
}

#[test]
fn one_process_groups_step_as_the_plain_trainer() {
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], &Device::Cpu).unwrap();
    let mut plain = trainer(None);
    let mut others = every_sharding(TrainOptions::default());
    for _ in 0..3 {
        let loss = plain.train_step(std::slice::from_ref(&ids)).unwrap().loss;
        for t in &mut others {
            assert_eq!(t.train_step(std::slice::from_ref(&ids)).unwrap().loss.to_bits(), loss.to_bits());
            assert_eq!(weights(t), weights(&plain));
        }
    }
    // A sharded (one-shard) checkpoint, resumed by a plain run, continues as the plain run does.
    let dir = std::env::temp_dir().join(format!("wick-dp-one-{}", std::process::id()));
    let checkpoints = CheckpointDir::new(&dir, 2).unwrap();
    others[2].save(&checkpoints, serde_json::json!({})).unwrap();
    let mut resumed = trainer(None);
    assert_eq!(resumed.resume(&checkpoints).unwrap().step, 3);
    plain.train_step(std::slice::from_ref(&ids)).unwrap();
    resumed.train_step(std::slice::from_ref(&ids)).unwrap();
    assert_eq!(weights(&resumed), weights(&plain));
    // ZeRO-3's checkpoint too (every piece, no whole parameter), resumed plain and at stage 3.
    let stage3 = &others[3];
    let dir3 = std::env::temp_dir().join(format!("wick-dp-one-z3-{}", std::process::id()));
    let checkpoints = CheckpointDir::new(&dir3, 2).unwrap();
    stage3.save(&checkpoints, serde_json::json!({})).unwrap();
    let mut resumed = trainer(None);
    assert_eq!(resumed.resume(&checkpoints).unwrap().step, 3);
    let mut again = trainer(Some(Sharding::Parameters));
    again.resume(&checkpoints).unwrap();
    resumed.train_step(std::slice::from_ref(&ids)).unwrap();
    again.train_step(std::slice::from_ref(&ids)).unwrap();
    // `plain` took its fourth step above.
    assert_eq!(weights(&resumed), weights(&plain));
    assert_eq!(weights(&again), weights(&plain));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&dir3);
}

/// Clipping under every sharding: the norm is of all gradients, each rank's share of the squares
/// summed (ZeRO-1/2/3 hold pieces of the gradients), so the norm and the steps are the plain
/// trainer's — the norm to f64 rounding (the pieces' squares are added in another order), the
/// parameters to f32 rounding.
#[test]
fn clipping_steps_as_the_plain_trainer_under_every_sharding() {
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], &Device::Cpu).unwrap();
    let options = TrainOptions { clip_grad_norm: Some(0.1), ..TrainOptions::default() };
    let mut plain = trainer_with(None, options);
    let mut others = every_sharding(options);
    for _ in 0..3 {
        let want = plain.train_step(std::slice::from_ref(&ids)).unwrap().grad_norm.unwrap();
        assert!(want > 0.1, "{want}: the bound clips");
        for t in &mut others {
            let norm = t.train_step(std::slice::from_ref(&ids)).unwrap().grad_norm.unwrap();
            assert!((norm - want).abs() <= want * 1e-12, "{norm} vs {want}");
            let (a, b) = (weights(t), weights(&plain));
            for (x, y) in a.iter().zip(&b) {
                let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
                assert!((x - y).abs() <= 1e-6 * y.abs().max(1.0), "{x} vs {y}");
            }
        }
    }
}

/// After ZeRO-3's first step the model's own copies of the blocks' parameters are handed back
/// (their whole pages read as zeros), those read outside the blocks stay, and the gathered
/// values are a plain run's.
#[test]
fn zero3_hands_back_the_model_copies_of_block_parameters() {
    use wick_nn::Model;
    let config = LlamaConfig { hidden_size: 128, intermediate_size: 256, ..LlamaConfig::tiny(64) };
    let build = || Llama::new(config, DType::F32, &Device::Cpu).unwrap();
    let mut plain = Trainer::new(build(), serde_json::json!({}), None, TrainOptions::default()).unwrap();
    let parallel = DataParallelOptions { sharding: Sharding::Parameters, ..Default::default() };
    let mut sharded = Trainer::new(build(), serde_json::json!({}), None, TrainOptions::default())
        .unwrap()
        .data_parallel(ProcessGroup::single(), parallel)
        .unwrap();
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 7, 3, 8, 8]], &Device::Cpu).unwrap();
    plain.train_step(std::slice::from_ref(&ids)).unwrap();
    sharded.train_step(std::slice::from_ref(&ids)).unwrap();
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let q = values(sharded.model().params().get("layers.0.q.weight").unwrap().as_tensor());
    // 64 KiB: at most the two partial pages at its ends (4 KiB pages or larger) keep values.
    let zeros = q.iter().filter(|v| **v == 0.0).count();
    assert!(zeros >= q.len() - 2 * 1024, "{zeros} of {} zeros", q.len());
    let embed = values(sharded.model().params().get("embed.weight").unwrap().as_tensor());
    assert_eq!(embed, values(plain.model().params().get("embed.weight").unwrap().as_tensor()));
    let gathered = sharded.gathered_parameters().unwrap();
    for ((name, v), (_, p)) in gathered.iter().zip(plain.model().params().iter()) {
        assert_eq!(values(v), values(p.as_tensor()), "{name}");
    }
}

/// ZeRO-3 works for every family of the zoo, f32 and bf16: in a one-process group (each block
/// gathered, recomputed — or kept, its parameters released after forward and gathered again in
/// backward — and reduced through the shards) BERT, ViT, ResNet-18 and MobileNetV2 take the plain
/// trainer's steps, to the bit — losses and every gathered parameter — and the model's copies of
/// the blocks' parameters are handed back.
#[test]
fn zero3_steps_as_the_plain_trainer_for_every_zoo_family() {
    use wick_nn::Autocast;
    use wick_zoo::registry::ModelSpec;
    use wick_zoo::resnet::ResNetDepth;
    let (bert, vit) = small_encoders(2);
    let specs = [
        ModelSpec::Bert { config: bert, seq: 16 },
        ModelSpec::Vit(vit),
        ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 3, width: 8, image: 32 },
        ModelSpec::MobileNetV2 { classes: 3, width_mult: 0.25, image: 32 },
    ];
    for spec in specs {
        for (dtype, autocast) in [(DType::F32, Autocast::off()), (DType::BF16, Autocast::bf16())] {
            let options = TrainOptions { autocast, ..TrainOptions::default() };
            let build = || spec.build(dtype, &Device::Cpu).unwrap();
            let mut plain = Trainer::new(build(), serde_json::json!({}), None, options).unwrap();
            let sharded_with = |prefetch, recompute| {
                let parallel =
                    DataParallelOptions { sharding: Sharding::Parameters, prefetch, recompute, ..Default::default() };
                Trainer::new(build(), serde_json::json!({}), None, options)
                    .unwrap()
                    .data_parallel(ProcessGroup::single(), parallel)
                    .unwrap()
            };
            // Recomputing and keeping the activations, each without and with the next block's
            // gather prefetched (from the second step on).
            let mut runs = [(false, true), (true, true), (false, false), (true, false)]
                .map(|(prefetch, recompute)| (prefetch, recompute, sharded_with(prefetch, recompute)));
            let batch = spec.batch(2, dtype, &Device::Cpu).unwrap();
            for step in 0..3 {
                // The last step accumulates two micro-batches (each block's gradients added on
                // the shards once per micro-batch).
                let micro = if step == 2 { vec![batch.clone(), batch.clone()] } else { vec![batch.clone()] };
                let a = plain.train_step(&micro).unwrap().loss;
                for (prefetch, recompute, t) in &mut runs {
                    let what = format!("{spec:?} {dtype:?} step {step}, prefetch {prefetch}, recompute {recompute}");
                    let b = t.train_step(&micro).unwrap().loss;
                    assert_eq!(a.to_bits(), b.to_bits(), "{what}: loss {a} against {b}");
                    let prefetched = t.last_reduce().map_or(0, |r| r.prefetched);
                    assert_eq!(prefetched > 0, *prefetch && step > 0, "{what}: {prefetched} prefetched");
                }
            }
            let p = plain.gathered_parameters().unwrap();
            for (prefetch, recompute, t) in &runs {
                for ((name, a), (_, b)) in p.iter().zip(&t.gathered_parameters().unwrap()) {
                    assert_eq!(
                        bits(a),
                        bits(b),
                        "{spec:?} {dtype:?}, prefetch {prefetch}, recompute {recompute}: {name}"
                    );
                }
            }
            let sharded = &runs[0].2;
            let summary = wick::Engine::cpu();
            sharded.account(&summary);
            let text = summary.memory_report().to_string();
            let pieces = text.lines().find(|l| l.contains("parameter pieces (ZeRO-3")).unwrap_or_default();
            // The blocks took their parameters from the shards: an f32 model's pieces of them.
            assert!(!pieces.is_empty() && (dtype != DType::F32 || !pieces.trim_end().ends_with(" 0 B")), "{text}");
        }
    }
}

/// The reduction started from inside backward (`overlap`, the default) and after it, at stages
/// 0–2, with two micro-batches (the second's gradients added to the first's inside the hook),
/// f32 and bf16 autocast: every step the plain trainer's, to the bit; with overlap some buckets
/// start inside backward, without none does.
#[test]
fn an_overlapped_reduction_accumulates_as_the_plain_trainer() {
    use wick_nn::Autocast;
    let a = Tensor::new(&[[1u32, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[[3u32, 2, 2, 9, 11, 0], [7, 1, 5, 5, 8, 2]], &Device::Cpu).unwrap();
    for (dtype, autocast) in [(DType::F32, Autocast::off()), (DType::BF16, Autocast::bf16())] {
        let make = || {
            let model = Llama::new(LlamaConfig::tiny(32), dtype, &Device::Cpu).unwrap();
            let options = TrainOptions { autocast, ..TrainOptions::default() };
            Trainer::new(model, serde_json::json!({"model": "tiny"}), None, options).unwrap()
        };
        let mut plain = make();
        let mut runs = Vec::new();
        for sharding in [Sharding::None, Sharding::OptimizerState, Sharding::Gradients] {
            for overlap in [true, false] {
                // Small buckets, so that the model spans several.
                let options = DataParallelOptions {
                    sharding,
                    overlap,
                    bucket_bytes: 8 << 10,
                    first_bucket_bytes: 2 << 10,
                    ..Default::default()
                };
                runs.push((sharding, overlap, make().data_parallel(ProcessGroup::single(), options).unwrap()));
            }
        }
        for _ in 0..3 {
            let loss = plain.train_step(&[a.clone(), b.clone()]).unwrap().loss;
            for (sharding, overlap, t) in &mut runs {
                let what = format!("{dtype:?} {sharding:?} overlap {overlap}");
                assert_eq!(t.train_step(&[a.clone(), b.clone()]).unwrap().loss.to_bits(), loss.to_bits(), "{what}");
                assert_eq!(weights(t), weights(&plain), "{what}");
                let r = t.last_reduce().unwrap();
                assert!(r.buckets > 2, "{what}: several buckets");
                if *overlap {
                    assert!(r.overlapped > 0 && r.overlapped < r.buckets, "{what}: {r:?}");
                } else {
                    assert_eq!(r.overlapped, 0, "{what}");
                }
                assert!(r.exposed_s >= 0.0 && (0.0..=1.0).contains(&r.hidden_fraction()), "{what}: {r:?}");
            }
        }
    }
}

/// With activation checkpointing the blocks' parameters are not on the outer graph (their
/// gradients come from the segments' own backward passes, after the hook's): they reach the
/// reduction after backward, and the step is still the plain trainer's, to the bit.
#[test]
fn an_overlapped_reduction_with_checkpointing_steps_as_the_plain_trainer() {
    let a = Tensor::new(&[[1u32, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[[3u32, 2, 2, 9, 11, 0], [7, 1, 5, 5, 8, 2]], &Device::Cpu).unwrap();
    let make = || {
        let model = Llama::new(LlamaConfig::tiny(32), DType::F32, &Device::Cpu).unwrap();
        let options = TrainOptions { activation_checkpointing: true, ..TrainOptions::default() };
        Trainer::new(model, serde_json::json!({"model": "tiny"}), None, options).unwrap()
    };
    let mut plain = make();
    let options = DataParallelOptions { bucket_bytes: 8 << 10, first_bucket_bytes: 2 << 10, ..Default::default() };
    let mut overlapped = make().data_parallel(ProcessGroup::single(), options).unwrap();
    for _ in 0..2 {
        let loss = plain.train_step(&[a.clone(), b.clone()]).unwrap().loss;
        assert_eq!(overlapped.train_step(&[a.clone(), b.clone()]).unwrap().loss.to_bits(), loss.to_bits());
        assert_eq!(weights(&overlapped), weights(&plain));
        let r = overlapped.last_reduce().unwrap();
        assert!(r.buckets > 2 && r.overlapped < r.buckets, "{r:?}");
    }
}

/// A step that fails in its second micro-batch — after the first one's backward, which at
/// stage 3 has already reduced the blocks' gradients into the shards — is an error that leaves
/// nothing behind, under every sharding: the steps after it are the plain trainer's, to the bit.
#[test]
fn a_step_failing_in_its_second_micro_batch_leaves_nothing_behind() {
    use std::cell::Cell;
    use wick_nn::checkpoint::Checkpointing;
    use wick_nn::params::Params;
    use wick_nn::{Model, NnError};
    /// The model, refusing its `fail_at`-th loss.
    struct Failing {
        inner: Llama,
        fail_at: u64,
        calls: Cell<u64>,
    }
    impl Model for Failing {
        type Batch = Tensor;
        fn params(&self) -> &Params {
            self.inner.params()
        }
        fn loss_with(&self, batch: &Tensor, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
            self.calls.set(self.calls.get() + 1);
            if self.calls.get() == self.fail_at {
                return Err(NnError::invalid("test", "a refused micro-batch"));
            }
            self.inner.loss_with(batch, checkpoint)
        }
    }
    let build = |sharding: Option<Sharding>| {
        let inner = Llama::new(LlamaConfig::tiny(32), DType::F32, &Device::Cpu).unwrap();
        // Step 1 takes call 1, step 2 calls 2 and 3 (refused), step 3 calls 4 and 5.
        let model = Failing { inner, fail_at: 3, calls: Cell::new(0) };
        let t = Trainer::new(model, serde_json::json!({}), None, TrainOptions::default()).unwrap();
        match sharding {
            None => t,
            Some(sharding) => {
                let parallel = DataParallelOptions { sharding, ..Default::default() };
                t.data_parallel(ProcessGroup::single(), parallel).unwrap()
            }
        }
    };
    let a = Tensor::new(&[[1u32, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], &Device::Cpu).unwrap();
    let b = Tensor::new(&[[3u32, 1, 0, 9, 9, 2], [6, 5, 4, 3, 2, 1]], &Device::Cpu).unwrap();
    let steps = [vec![a.clone()], vec![a.clone(), b.clone()], vec![b.clone(), a.clone()], vec![a.clone()]];
    let mut plain = build(None);
    let shardings = [Sharding::None, Sharding::OptimizerState, Sharding::Gradients, Sharding::Parameters];
    let mut others = shardings.map(|s| (s, build(Some(s))));
    for (k, micro) in steps.iter().enumerate() {
        let want = plain.train_step(micro);
        assert_eq!(want.is_err(), k == 1, "step {k}: only the second fails");
        for (s, t) in &mut others {
            let got = t.train_step(micro);
            match (&want, got) {
                (Ok(w), Ok(g)) => assert_eq!(w.loss.to_bits(), g.loss.to_bits(), "{s:?} step {k}"),
                (Err(_), Err(e)) => assert!(e.to_string().contains("a refused micro-batch"), "{s:?}: {e}"),
                (w, g) => panic!("{s:?} step {k}: {:?} against {:?}", w.as_ref().map(|r| r.loss), g.map(|r| r.loss)),
            }
            assert!(weights(t) == weights(&plain), "{s:?}: the parameters after step {k} are not the plain run's");
        }
    }
}

/// The gradient buckets of every zoo family, made as the trainer makes them (reverse
/// registration order), complete in order during backward — each bucket's last gradient
/// arrives no later than the next bucket's — so each can start its reduction from inside
/// backward as soon as it is full. In name order (`layers.10` before `layers.2`) they do not:
/// the first bucket waited for the tenth-from-last layer, and almost nothing overlapped.
#[test]
fn every_zoo_familys_buckets_complete_in_the_order_they_are_reduced() {
    use std::collections::HashMap;
    use wick_nn::Model;
    use wick_train::dist::buckets::assign_buckets;
    use wick_zoo::registry::ModelSpec;
    use wick_zoo::resnet::ResNetDepth;
    let (bert, vit) = small_encoders(12);
    let decoder = LlamaConfig { num_layers: 12, ..LlamaConfig::tiny(32) };
    let specs = [
        (ModelSpec::Llama { config: decoder, seq: 8 }, true),
        (ModelSpec::Bert { config: bert, seq: 16 }, true),
        (ModelSpec::Vit(vit), true),
        (ModelSpec::ResNet { depth: ResNetDepth::R18, classes: 3, width: 8, image: 32 }, false),
        (ModelSpec::MobileNetV2 { classes: 3, width_mult: 0.25, image: 32 }, true),
    ];
    for (spec, numbered_past_ten) in specs {
        let model = spec.build(DType::F32, &Device::Cpu).unwrap();
        let vars: Vec<_> = model.params().iter().map(|(_, v)| v.clone()).collect();
        let loss = model.loss(&spec.batch(2, DType::F32, &Device::Cpu).unwrap()).unwrap();
        // When each parameter's gradient completes, as the trainer's hook sees it.
        let mut arrived = HashMap::new();
        loss.backward_with_hook(&mut |v, _| {
            let k = arrived.len();
            arrived.insert(v.id(), k);
            Ok(())
        })
        .unwrap();
        assert_eq!(arrived.len(), vars.len(), "{spec:?}: every parameter has a gradient");
        let elems: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
        // Caps that make about a dozen buckets of this small model.
        let cap = elems.iter().sum::<usize>() * 4 / 12;
        let in_order = |registered: &[usize]| {
            let plan = assign_buckets(&elems, registered, cap, cap);
            let last: Vec<usize> =
                plan.iter().map(|b| b.iter().map(|&i| arrived[&vars[i].id()]).max().unwrap()).collect();
            // The last bucket is started after backward in any case (ViT's is its stem, whose
            // gradient comes just before the class token's and position embedding's).
            (plan.len(), last[..last.len() - 1].windows(2).all(|w| w[0] <= w[1]))
        };
        let (buckets, ok) = in_order(&model.params().registration_order());
        assert!(buckets >= 8 && ok, "{spec:?}: {buckets} buckets out of the order backward fills them");
        let by_name: Vec<usize> = (0..vars.len()).collect();
        assert_eq!(in_order(&by_name).1, !numbered_past_ten, "{spec:?} in name order");
    }
}

/// The trainer makes its buckets that way: its plan is `assign_buckets` over the model's
/// registration order, at every stage.
#[test]
fn the_trainers_buckets_follow_the_registration_order() {
    use wick_nn::Model;
    use wick_train::dist::buckets::assign_buckets;
    for sharding in [Sharding::None, Sharding::OptimizerState, Sharding::Gradients, Sharding::Parameters] {
        let model = Llama::new(LlamaConfig { num_layers: 12, ..LlamaConfig::tiny(32) }, DType::F32, &Device::Cpu);
        let options =
            DataParallelOptions { sharding, bucket_bytes: 16 << 10, first_bucket_bytes: 4 << 10, ..Default::default() };
        let t = Trainer::new(model.unwrap(), serde_json::json!({}), None, TrainOptions::default())
            .unwrap()
            .data_parallel(ProcessGroup::single(), options)
            .unwrap();
        let params = t.model().params();
        let elems: Vec<usize> = params.iter().map(|(_, v)| v.elem_count()).collect();
        let want = assign_buckets(&elems, &params.registration_order(), 4 << 10, 16 << 10);
        let names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
        // The head and the last layer first, the embedding last.
        assert_eq!(names[want[0][0]], "lm_head.weight", "{sharding:?}");
        assert_eq!(names[*want.last().unwrap().last().unwrap()], "embed.weight", "{sharding:?}");
        assert_eq!(t.gradient_buckets(), Some(want.as_slice()), "{sharding:?}");
    }
    assert!(trainer(None).gradient_buckets().is_none());
}
