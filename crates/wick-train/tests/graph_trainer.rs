//! A trainer asked for CUDA graphs where it cannot have them says why before anything is made:
//! a model on the CPU (or a build without CUDA), ZeRO's sharded stages (their step agrees on
//! the host). The device runs of the graph path are
//! scripts/graph-train-check.sh's (through `wick train --cuda-graph`, in scripts/gpu-check.sh) and
//! the one-rank NCCL check's (`examples/nccl_check.rs`: a data-parallel graph step).

use candle_core::{DType, Device, Tensor};
use wick_nn::checkpoint::Checkpointing;
use wick_nn::params::{Init, Params};
use wick_nn::{Model, NnError};
use wick_train::dist::{DataParallelOptions, ProcessGroup, Sharding};
use wick_train::trainer::{GraphOptions, TrainOptions, Trainer};
use wick_zoo::llama::{Llama, LlamaConfig};

fn graph_options() -> TrainOptions {
    TrainOptions { cuda_graph: Some(GraphOptions::default()), ..TrainOptions::default() }
}

fn describe() -> serde_json::Value {
    serde_json::json!({"kind": "llama", "config": LlamaConfig::tiny(16)})
}

#[test]
fn cuda_graphs_for_a_model_on_the_cpu_are_refused_with_the_reason() {
    let model = Llama::new(LlamaConfig::tiny(16), DType::F32, &Device::Cpu).unwrap();
    let e = Trainer::new(model, describe(), None, graph_options()).err().expect("refused").to_string();
    // Without the `cuda` feature the build is named; with it, the model's device.
    let why = if cfg!(feature = "cuda") { "need a model on a CUDA device" } else { "has no CUDA" };
    assert!(e.contains("CUDA graph") && e.contains(why), "{e}");
    // Eager steps of the same model are unaffected.
    let model = Llama::new(LlamaConfig::tiny(16), DType::F32, &Device::Cpu).unwrap();
    let mut eager = Trainer::new(model, describe(), None, TrainOptions::default()).unwrap();
    let ids = Tensor::new(&[[1u32, 2, 3, 4]], &Device::Cpu).unwrap();
    assert!(eager.train_step(&[ids]).unwrap().loss.is_finite());
}

#[test]
fn sharded_data_parallel_training_with_cuda_graphs_is_refused_with_the_reason() {
    for sharding in [Sharding::None, Sharding::OptimizerState, Sharding::Gradients, Sharding::Parameters] {
        let model = Llama::new(LlamaConfig::tiny(16), DType::F32, &Device::Cpu).unwrap();
        let parallel = DataParallelOptions { sharding, ..DataParallelOptions::default() };
        let group = ProcessGroup::single();
        let e = Trainer::new_data_parallel(model, describe(), None, graph_options(), group, parallel)
            .err()
            .expect("refused")
            .to_string();
        // Replicated, the CPU model is what is refused; sharded, the stage, before the model.
        let why = match sharding {
            Sharding::None => "CUDA device|has no CUDA",
            _ => "refused for ZeRO's sharded stages",
        };
        assert!(why.split('|').any(|w| e.contains(w)), "{sharding:?}: {e}");
    }
}

/// A model of one's own that does not say how its batch is made of tensors.
struct Opaque {
    params: Params,
}

impl Model for Opaque {
    type Batch = Vec<f32>;
    fn params(&self) -> &Params {
        &self.params
    }
    fn loss_with(&self, batch: &Vec<f32>, _: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let x = Tensor::new(batch.as_slice(), &Device::Cpu)?;
        Ok(self.params.tensor("w")?.broadcast_mul(&x)?.sum_all()?)
    }
}

#[test]
fn a_batch_that_is_not_tensors_alone_says_so() {
    let mut params = Params::default();
    params.create("w", &[2], Init::Normal(0.1), DType::F32, &Device::Cpu).unwrap();
    let model = Opaque { params };
    let batch = vec![1.0f32, 2.0];
    assert!(Opaque::batch_tensors(&batch).is_none());
    let e = Opaque::batch_with(&batch, &[]).expect_err("no tensors to take").to_string();
    assert!(e.contains("not tensors alone"), "{e}");
    assert!(model.loss(&batch).unwrap().to_scalar::<f32>().unwrap().is_finite());
}
