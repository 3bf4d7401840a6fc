//! Generators of realistic allocation traces, so the allocator can be measured on the shapes of
//! real workloads without a GPU. Each models the tensors a framework allocates, in order, with
//! their byte sizes computed from layer shapes.

use rand_xoshiro::rand_core::{Rng, SeedableRng};
use rand_xoshiro::SplitMix64;

use crate::{Trace, TraceOp};

/// `lo..=hi`, from the seeded generator (SplitMix64, so traces are reproducible).
fn uniform(rng: &mut SplitMix64, lo: u64, hi: u64) -> u64 {
    lo + rng.next_u64() % (hi - lo + 1)
}

/// Builds a trace while tracking ids.
#[derive(Debug, Default)]
struct Builder {
    ops: Vec<TraceOp>,
    next_id: u64,
}

impl Builder {
    fn alloc(&mut self, bytes: usize) -> u64 {
        self.alloc_on(bytes, 0)
    }
    fn alloc_on(&mut self, bytes: usize, stream: u64) -> u64 {
        self.next_id += 1;
        self.ops.push(TraceOp::Alloc { id: self.next_id, size: bytes.max(1), stream });
        self.next_id
    }
    fn free(&mut self, id: u64) {
        self.ops.push(TraceOp::Free { id });
    }
    fn finish(self, name: &str, description: &str) -> Trace {
        Trace { name: name.into(), description: description.into(), ops: self.ops }
    }
}

/// Shape of a decoder-only transformer training run.
#[derive(Debug, Clone, Copy)]
pub struct TransformerShape {
    /// Layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Sequence length.
    pub seq: usize,
    /// Batch size.
    pub batch: usize,
    /// Bytes per activation element (2 for bf16).
    pub act_bytes: usize,
    /// Training steps.
    pub steps: usize,
}

impl Default for TransformerShape {
    /// A GPT-2-medium-sized model (24 layers, 1024 wide) at batch 8, sequence 1024, bf16.
    fn default() -> Self {
        TransformerShape {
            layers: 24,
            hidden: 1024,
            heads: 16,
            vocab: 50_257,
            seq: 1024,
            batch: 8,
            act_bytes: 2,
            steps: 3,
        }
    }
}

/// A transformer training step repeated: fp32 weights, activations saved layer by layer and freed
/// in reverse during backward, temporaries, gradients and AdamW state created on the first step.
pub fn transformer_training(shape: TransformerShape) -> Trace {
    let TransformerShape { layers, hidden: d, heads, vocab, seq, batch, act_bytes, steps } = shape;
    let tokens = batch * seq;
    let mut b = Builder::default();
    let layer_params = [3 * d * d, 3 * d, d * d, d, 4 * d * d, 4 * d, 4 * d * d, d, d, d, d, d];
    let mut params = vec![vocab * d, seq * d];
    for _ in 0..layers {
        params.extend_from_slice(&layer_params);
    }
    params.extend_from_slice(&[d, d]);
    let weights: Vec<u64> = params.iter().map(|p| b.alloc(p * 4)).collect();
    let mut grads: Vec<u64> = Vec::new();
    let mut adam: Vec<u64> = Vec::new();
    for _ in 0..steps {
        let input = b.alloc(tokens * 8);
        let mut saved = vec![b.alloc(tokens * d * act_bytes)];
        for _ in 0..layers {
            // Low-precision copies of the layer's weights (autocast), freed after use.
            let casts: Vec<u64> = layer_params.iter().take(5).map(|p| b.alloc(p * act_bytes)).collect();
            saved.push(b.alloc(tokens * d * act_bytes)); // ln1 out
            saved.push(b.alloc(tokens * 3 * d * act_bytes)); // qkv
            saved.push(b.alloc(batch * heads * seq * seq * act_bytes)); // attention probs
            let scores = b.alloc(batch * heads * seq * seq * 4); // fp32 softmax input
            b.free(scores);
            saved.push(b.alloc(tokens * d * act_bytes)); // attention out
            saved.push(b.alloc(tokens * d * act_bytes)); // ln2 out
            saved.push(b.alloc(tokens * 4 * d * act_bytes)); // mlp up
            saved.push(b.alloc(tokens * 4 * d * act_bytes)); // gelu
            saved.push(b.alloc(tokens * d * act_bytes)); // residual
            for c in casts {
                b.free(c);
            }
        }
        let logits = b.alloc(tokens * vocab * 4);
        let loss = b.alloc(4);
        let dlogits = b.alloc(tokens * vocab * 4);
        b.free(logits);
        if grads.is_empty() {
            grads = params.iter().map(|p| b.alloc(p * 4)).collect();
        }
        let mut dx = b.alloc(tokens * d * act_bytes);
        b.free(dlogits);
        while let Some(act) = saved.pop() {
            // Each saved activation yields a gradient of its size, then both go.
            let tmp = b.alloc(tokens * 4 * d * act_bytes / 2);
            let next = b.alloc(tokens * d * act_bytes);
            b.free(tmp);
            b.free(act);
            b.free(dx);
            dx = next;
        }
        b.free(dx);
        b.free(loss);
        b.free(input);
        if adam.is_empty() {
            for p in &params {
                adam.push(b.alloc(p * 4));
                adam.push(b.alloc(p * 4));
            }
        }
        // AdamW's per-tensor temporaries (foreach implementation: one per parameter).
        for p in params.iter().filter(|p| **p >= d * d) {
            let t = b.alloc(p * 4);
            b.free(t);
        }
    }
    for id in grads.into_iter().chain(adam).chain(weights) {
        b.free(id);
    }
    b.finish(
        "transformer-train",
        "GPT-2-medium-sized decoder training (24x1024, batch 8, seq 1024, bf16 activations, fp32 weights, AdamW), 3 steps",
    )
}

/// A ResNet-50-like CNN training run at batch 64, 224x224, fp32.
pub fn cnn_training(steps: usize) -> Trace {
    let mut b = Builder::default();
    let batch = 64;
    // (channels, spatial size, blocks) per stage, with bottleneck width = channels / 4.
    let stages = [(256usize, 56usize, 3usize), (512, 28, 4), (1024, 14, 6), (2048, 7, 3)];
    let mut params = vec![64 * 3 * 7 * 7, 64, 64];
    let mut in_ch = 64;
    for &(ch, _, blocks) in &stages {
        let w = ch / 4;
        for i in 0..blocks {
            let cin = if i == 0 { in_ch } else { ch };
            params.extend_from_slice(&[w * cin, w, w, w * w * 9, w, w, ch * w, ch, ch]);
            if i == 0 {
                params.extend_from_slice(&[ch * cin, ch, ch]);
            }
        }
        in_ch = ch;
    }
    params.extend_from_slice(&[1000 * 2048, 1000]);
    let weights: Vec<u64> = params.iter().map(|p| b.alloc(p * 4)).collect();
    let mut momentum: Vec<u64> = Vec::new();
    for _ in 0..steps {
        let input = b.alloc(batch * 3 * 224 * 224 * 4);
        let stem = [batch * 64 * 112 * 112 * 4, batch * 64 * 56 * 56 * 4];
        let mut saved: Vec<(u64, usize)> = stem.iter().map(|&n| (b.alloc(n), n)).collect();
        for &(ch, hw, blocks) in &stages {
            let w = ch / 4;
            for _ in 0..blocks {
                let plane = batch * hw * hw * 4;
                // conv1/bn1/relu1 (w), conv2/relu2 (w), conv3/bn3 (ch), residual sum (ch).
                for c in [w, w, w, w, ch, ch, ch] {
                    saved.push((b.alloc(c * plane), c * plane));
                }
            }
        }
        let pooled = b.alloc(batch * 2048 * 4);
        let logits = b.alloc(batch * 1000 * 4);
        let grads: Vec<u64> = params.iter().map(|p| b.alloc(p * 4)).collect();
        let mut dx = b.alloc(batch * 1000 * 4);
        b.free(logits);
        b.free(pooled);
        while let Some((act, bytes)) = saved.pop() {
            // The gradient flowing to a layer's input has the size of that input.
            let next = b.alloc(bytes);
            b.free(act);
            b.free(dx);
            dx = next;
        }
        b.free(dx);
        b.free(input);
        if momentum.is_empty() {
            momentum = params.iter().map(|p| b.alloc(p * 4)).collect();
        }
        for g in grads {
            b.free(g);
        }
    }
    for id in momentum.into_iter().chain(weights) {
        b.free(id);
    }
    b.finish("cnn-train", "ResNet-50-like training (batch 64, 224x224, fp32, SGD with momentum)")
}

/// An inference server: bf16 weights of a 1.3B model stay resident while requests with random
/// batch sizes and prompt lengths allocate a KV cache and activations, then free them. Two
/// streams serve requests alternately.
pub fn inference_server(requests: usize, seed: u64) -> Trace {
    let (layers, d, vocab) = (24usize, 2048usize, 50_257usize);
    let mut rng = SplitMix64::seed_from_u64(seed);
    let mut b = Builder::default();
    let mut weights = vec![b.alloc(vocab * d * 2)];
    for _ in 0..layers {
        for p in [3 * d * d, d * d, 4 * d * d, 4 * d * d, d, d] {
            weights.push(b.alloc(p * 2));
        }
    }
    for r in 0..requests {
        let stream = (r % 2) as u64;
        let batch = uniform(&mut rng, 1, 32) as usize;
        let prompt = uniform(&mut rng, 16, 1024) as usize;
        let new_tokens = uniform(&mut rng, 1, 8) as usize;
        let kv: Vec<u64> = (0..layers).map(|_| b.alloc_on(2 * batch * (prompt + new_tokens) * d * 2, stream)).collect();
        for step in 0..=new_tokens {
            let tokens = if step == 0 { batch * prompt } else { batch };
            let h = b.alloc_on(tokens * d * 2, stream);
            for _ in 0..layers {
                let mlp = b.alloc_on(tokens * 4 * d * 2, stream);
                b.free(mlp);
            }
            let logits = b.alloc_on(batch * vocab * 4, stream);
            b.free(logits);
            b.free(h);
        }
        for id in kv {
            b.free(id);
        }
    }
    for id in weights {
        b.free(id);
    }
    b.finish(
        "inference-server",
        "1.3B decoder in bf16 serving requests of random batch (1-32) and prompt (16-1024) on two streams",
    )
}

/// The standard trace suite.
pub fn standard_suite() -> Vec<Trace> {
    vec![transformer_training(TransformerShape::default()), cnn_training(3), inference_server(200, 7)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suite_traces_are_valid_and_balanced() {
        for trace in standard_suite() {
            trace.validate().unwrap();
            let allocs = trace.ops.iter().filter(|o| matches!(o, TraceOp::Alloc { .. })).count();
            let frees = trace.ops.len() - allocs;
            assert_eq!(allocs, frees, "{} frees everything it allocates", trace.name);
            assert!(trace.peak_live_bytes() > 1 << 30, "{} is GPU-scale", trace.name);
        }
    }

    #[test]
    fn generator_is_splitmix64_and_traces_are_reproducible() {
        // SplitMix64 from state 0: the first output of the reference implementation
        // (Vigna's splitmix64.c), which the traces committed under traces/ were made with.
        assert_eq!(SplitMix64::seed_from_u64(0).next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(inference_server(5, 3), inference_server(5, 3));
    }
}
