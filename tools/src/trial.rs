//! AMP against f32 on the same task: every zoo model on a fixed synthetic task, trained the same
//! number of steps from the same initial values, with the activations the graph keeps, the
//! step's peak heap and the losses recorded. The AMP test and the benchmark table both run it.

use candle_core::{DType, Device, Result, Tensor, Var};

use wick_nn::graph::graph_bytes;
use wick_nn::params::normal_tensor;
use wick_nn::Autocast;
use wick_nn::NnError;
use wick_nn::{Labelled, Model};
use wick_train::amp::{master_step, scaled_backward, GradScaler, MasterWeights, StepOutcome};
use wick_train::optim::{AdamW, Optimizer};
use wick_zoo::bert::{BertConfig, SentenceBatch};
use wick_zoo::llama::LlamaConfig;
use wick_zoo::registry::{ModelSpec, ZooBatch, ZooModel};
use wick_zoo::resnet::ResNetDepth;
use wick_zoo::vit::VitConfig;
use wick_zoo::ZooError;

/// A model with its loss on a fixed batch.
pub struct Task {
    /// The model's name.
    pub name: &'static str,
    /// Its trainable parameters (the low-precision compute copies under AMP).
    pub vars: Vec<Var>,
    /// The parameters' names, in the order of `vars` (torchvision's for the vision models,
    /// Hugging Face's for BERT).
    pub names: Vec<String>,
    /// The f32 initial values of `vars` (the same model built in f32), to start the f32 masters
    /// from (see [`MasterWeights::with_masters`]).
    pub masters: Vec<Tensor>,
    /// Builds the loss of the fixed batch.
    pub loss: Box<dyn Fn() -> Result<Tensor>>,
}

/// Images per batch in the vision tasks (sequences: half as many).
const BATCH: usize = 16;

/// Classes in the vision tasks.
const CLASSES: usize = 10;

/// `n` seeded labels in `0..classes`.
fn labels(n: usize, classes: usize, device: &Device) -> Result<Tensor> {
    let u = normal_tensor(&[n], 1.0, 23, DType::F32, device)?.to_vec1::<f32>()?;
    let v: Vec<u32> = u.iter().map(|x| ((x.abs() * 1000.0) as u32) % classes as u32).collect();
    Tensor::new(v, device)
}

/// `n` seeded 32×32 RGB images and their labels. Each image is noise with its own contrast and
/// per-channel brightness, and its label is the bucket of its red brightness: a learnable rule,
/// and images that stay distinguishable deep into a network (pure noise images look alike to a
/// deep random network, so batch norm there would normalise away differences smaller than
/// bf16's resolution).
pub fn synthetic_images(n: usize, size: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let noise = normal_tensor(&[n, 3, size, size], 1.0, 11, DType::F32, device)?;
    let brightness = normal_tensor(&[n, 3, 1, 1], 1.0, 12, DType::F32, device)?;
    let contrast = normal_tensor(&[n, 1, 1, 1], 0.5, 13, DType::F32, device)?.exp()?;
    let x = noise.broadcast_mul(&contrast)?.broadcast_add(&brightness)?;
    let red: Vec<f32> = brightness.narrow(1, 0, 1)?.flatten_all()?.to_vec1()?;
    let labels: Vec<u32> =
        red.iter().map(|b| ((b + 2.5) * CLASSES as f32 / 5.0).clamp(0.0, CLASSES as f32 - 1.0) as u32).collect();
    Ok((x, Tensor::new(labels, device)?))
}

/// The vision tasks' fixed batch: [`synthetic_images`], 16 images of 32×32, in f32.
pub fn vision_batch(device: &Device) -> Result<(Tensor, Tensor)> {
    synthetic_images(BATCH, 32, device)
}

/// The LLaMA-style decoder of the trial: 2 layers 64 wide, a vocabulary of 48.
pub fn llama_config() -> LlamaConfig {
    LlamaConfig { num_layers: 2, hidden_size: 64, intermediate_size: 128, ..LlamaConfig::tiny(48) }
}

/// The LLaMA trial's fixed batch: 8 seeded sequences of 33 tokens (u32), predicted next-token.
pub fn llama_batch(device: &Device) -> Result<Tensor> {
    let ids = normal_tensor(&[8 * 33], 1.0, 31, DType::F32, device)?.to_vec1::<f32>()?;
    let ids: Vec<u32> = ids.iter().map(|x| ((x.abs() * 1000.0) as u32) % 48).collect();
    Tensor::from_vec(ids, (8, 33), device)
}

/// The BERT of the trial: 2 layers 64 wide with 4 heads, a vocabulary of 64.
pub const BERT: BertConfig = BertConfig::tiny(64);

/// The BERT trial's fixed batch: token ids (8, 32), the attention mask (the last 8 positions of
/// the second half of the batch are padding), a fixed untrained readout (64, 2) of the
/// mean-pooled states, and the labels.
pub fn bert_batch(device: &Device) -> Result<SentenceBatch> {
    let ids: Vec<u32> = (0..8 * 32).map(|i| ((i * 7 + i / 5) % 64) as u32).collect();
    let mask: Vec<u32> = (0..8 * 32).map(|i| u32::from(i / 32 < 4 || i % 32 < 24)).collect();
    Ok(SentenceBatch {
        ids: Tensor::from_vec(ids, (8, 32), device)?,
        mask: Tensor::from_vec(mask, (8, 32), device)?,
        readout: normal_tensor(&[64, 2], 0.5, 5, DType::F32, device)?,
        labels: labels(8, 2, device)?,
    })
}

/// The ViT of the trial: 32×32 images in 8×8 patches, 2 layers 64 wide with 4 heads.
pub const VIT: VitConfig = VitConfig::tiny(CLASSES);

/// Names of the models [`task`] builds.
pub const MODELS: [&str; 6] = ["llama", "bert", "vit", "resnet18", "resnet50", "mobilenet_v2"];

/// The model `name` (one of [`MODELS`]) at the trial's size, as the zoo's registry builds it.
pub fn spec(name: &str) -> Option<ModelSpec> {
    let cnn = |depth| ModelSpec::ResNet { depth, classes: CLASSES, width: 16, image: 32 };
    Some(match name {
        "llama" => ModelSpec::Llama { config: llama_config(), seq: 33 },
        "bert" => ModelSpec::Bert { config: BERT, seq: 32 },
        "vit" => ModelSpec::Vit(VIT),
        "resnet18" => cnn(ResNetDepth::R18),
        "resnet50" => cnn(ResNetDepth::R50),
        "mobilenet_v2" => ModelSpec::MobileNetV2 { classes: CLASSES, width_mult: 0.5, image: 32 },
        _ => return None,
    })
}

/// The model `name` (one of [`MODELS`]) built in `dtype` by the registry, with its CNNs'
/// residual branches zeroed, and the trial's fixed batch for it (see [`task`]).
pub fn model_and_batch(
    name: &str,
    dtype: DType,
    device: &Device,
) -> std::result::Result<(&'static str, ZooModel, ZooBatch), ZooError> {
    let Some((name, spec)) = MODELS.into_iter().find(|m| *m == name).zip(spec(name)) else {
        return Err(
            NnError::invalid("amp trial", format!("unknown model `{name}` (expected one of {MODELS:?})")).into()
        );
    };
    let model = spec.build(dtype, device)?;
    model.zero_init_residual()?;
    let batch = match spec {
        ModelSpec::Llama { .. } => ZooBatch::Tokens(llama_batch(device)?),
        ModelSpec::Bert { .. } => ZooBatch::Sentences(bert_batch(device)?),
        _ => {
            let (x, labels) = vision_batch(device)?;
            ZooBatch::Images(Labelled { inputs: x.to_dtype(dtype)?, labels })
        }
    };
    Ok((name, model, batch))
}

/// The model `name` (one of [`MODELS`]), built in `autocast`'s model dtype from the same seeded
/// initial values whatever the dtype, with its loss on a fixed synthetic batch: next-token
/// prediction of a seeded random sequence (LLaMA), classification of token sequences with
/// padding into seeded labels through a fixed readout (BERT), and [`synthetic_images`] (the
/// vision models). The CNNs use `zero_init_residual` (see [`ZooModel::zero_init_residual`](wick_zoo::registry::ZooModel::zero_init_residual)).
pub fn task(name: &str, autocast: Autocast, device: &Device) -> std::result::Result<Task, ZooError> {
    let dtype = autocast.model_dtype();
    let (name, model, batch) = model_and_batch(name, dtype, device)?;
    let (vars, names): (Vec<Var>, Vec<String>) = model.params().iter().map(|(n, v)| (v.clone(), n.clone())).unzip();
    let loss = Box::new(move || model.loss(&batch).map_err(candle_core::Error::wrap));
    // The f32 values the parameters start from: the same model built in f32 (the same seed),
    // so that the masters of a low-precision model are not its rounded values.
    let masters = if dtype == DType::F32 {
        vars.iter().map(|v| v.as_tensor().copy()).collect::<Result<Vec<_>>>()?
    } else {
        let originals = task(name, Autocast::off(), device)?;
        if originals.names != names {
            return Err(NnError::invalid(
                "amp trial",
                format!("{name}: the f32 build has other parameters than the {dtype:?} build"),
            )
            .into());
        }
        originals.vars.iter().map(|v| v.as_tensor().clone()).collect()
    };
    Ok(Task { name, vars, names, masters, loss })
}

/// What one training run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TrialReport {
    /// Model name.
    pub model: &'static str,
    /// The model's (compute) dtype.
    pub dtype: String,
    /// Loss before each applied step, then the loss after the last one.
    pub losses: Vec<f32>,
    /// Bytes of the tensors the graph keeps for backward after the first forward pass
    /// (parameters excluded).
    pub activation_bytes: usize,
    /// Peak heap of the first forward + backward above what was live before it, when wick's
    /// counting allocator is installed.
    pub step_peak_bytes: Option<usize>,
    /// Bytes of the f32 master weights and of the f32 optimizer state.
    pub master_bytes: (usize, usize),
    /// Steps skipped by the loss scaler (non-finite gradients).
    pub skipped_steps: usize,
}

/// Trains `task` for `steps` optimizer steps with `optimizer` on f32 masters, scaling the loss
/// when `autocast` needs it (f16). Steps the scaler skips (non-finite gradients while the scale
/// is still too high) are not training steps: they are counted, and more are run, up to
/// `steps` more attempts.
pub fn train(task: &Task, autocast: Autocast, steps: usize, optimizer: Optimizer) -> Result<TrialReport> {
    let mut masters = MasterWeights::with_masters(&task.vars, Some(&task.masters), optimizer)?;
    let mut scaler = autocast.needs_loss_scaling().then(GradScaler::new);
    let refs: Vec<&Var> = task.vars.iter().collect();
    let (mut losses, mut activation_bytes, mut step_peak_bytes, mut skipped) = (Vec::new(), 0, None, 0);
    let mut applied = 0;
    for step in 0..2 * steps {
        if applied == steps {
            break;
        }
        let before = wick::host_memory::counted_heap();
        wick::host_memory::reset_counted_peak();
        let loss = (task.loss)()?;
        if step == 0 {
            activation_bytes = graph_bytes(&loss).total;
        }
        // Losses before each applied step (a skipped step leaves the model as it was).
        losses.push(loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
        let mut grads = scaled_backward(&loss, scaler.as_ref()).map_err(candle_core::Error::wrap)?;
        drop(loss);
        // The second step is measured: the first also creates what lives for the whole process
        // (thread pools, caches).
        if step == 1 {
            step_peak_bytes = match (before, wick::host_memory::counted_peak()) {
                (Some(b), Some(p)) => Some(p.saturating_sub(b)),
                _ => None,
            };
        }
        match master_step(&mut grads, &mut masters, scaler.as_mut(), &refs).map_err(candle_core::Error::wrap)? {
            StepOutcome::Skipped => {
                skipped += 1;
                losses.pop();
            }
            StepOutcome::Applied => applied += 1,
        }
    }
    // The loss after the last step.
    losses.push((task.loss)()?.to_dtype(DType::F32)?.to_scalar::<f32>()?);
    Ok(TrialReport {
        model: task.name,
        dtype: format!("{:?}", autocast.model_dtype()).to_lowercase(),
        losses,
        activation_bytes,
        step_peak_bytes,
        master_bytes: masters.memory_bytes(),
        skipped_steps: skipped,
    })
}

/// The AdamW settings the trials use.
pub fn trial_optimizer() -> Optimizer {
    Optimizer::AdamW(AdamW { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 })
}
