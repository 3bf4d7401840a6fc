//! Data-parallel training in a group of one process (no MPI needed): replicated and ZeRO-1/2
//! take the same steps, to the bit, as the plain trainer, and a sharded run saves a checkpoint
//! that a plain run resumes from.

use candle_core::{DType, Device, Tensor};
use wick_train::dist::{DataParallelOptions, ProcessGroup, Sharding};
use wick_train::trainer::{TrainOptions, Trainer};
use wick_train::CheckpointDir;
use wick_zoo::llama::{Llama, LlamaConfig};

fn trainer(sharding: Option<Sharding>) -> Trainer<Llama> {
    let model = Llama::new(LlamaConfig::tiny(32), DType::F32, &Device::Cpu).unwrap();
    let t = Trainer::new(model, serde_json::json!({"model": "tiny"}), None, TrainOptions::default()).unwrap();
    match sharding {
        None => t,
        Some(sharding) => {
            t.data_parallel(ProcessGroup::single(), DataParallelOptions { sharding, ..Default::default() }).unwrap()
        }
    }
}

fn weights(t: &Trainer<Llama>) -> Vec<u32> {
    use wick_nn::Model;
    let mut out = Vec::new();
    for (_, v) in t.model().params().iter() {
        out.extend(v.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits));
    }
    out
}

#[test]
fn one_process_groups_step_as_the_plain_trainer() {
    let ids = Tensor::new(&[[1u32, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]], &Device::Cpu).unwrap();
    let mut plain = trainer(None);
    let mut others: Vec<Trainer<Llama>> =
        [Sharding::None, Sharding::OptimizerState, Sharding::Gradients].map(|s| trainer(Some(s))).into();
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
    let _ = std::fs::remove_dir_all(&dir);
}
