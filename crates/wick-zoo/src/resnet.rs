//! ResNet-18/34/50 with torchvision's parameter names, trainable: batch-norm in train mode with
//! running statistics, and a max-pool whose backward handles overlapping windows.

use candle_core::{DType, Device, Tensor};
use wick::memory::push_label;

use wick_nn::checkpoint::{run_stateful, Checkpointing};
use wick_nn::cnn::{global_avg_pool, max_pool2d, Activation, BatchNorm, RunningStats};
use wick_nn::params::{Init, Params};
use wick_nn::NnError;

/// Which ResNet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResNetDepth {
    /// Basic blocks [2, 2, 2, 2].
    R18,
    /// Basic blocks [3, 4, 6, 3].
    R34,
    /// Bottleneck blocks [3, 4, 6, 3].
    R50,
}

impl ResNetDepth {
    fn blocks(self) -> [usize; 4] {
        match self {
            ResNetDepth::R18 => [2, 2, 2, 2],
            ResNetDepth::R34 | ResNetDepth::R50 => [3, 4, 6, 3],
        }
    }
    fn bottleneck(self) -> bool {
        self == ResNetDepth::R50
    }
}

pub(crate) struct Conv {
    pub weight: Tensor,
    pub stride: usize,
    pub pad: usize,
}

impl Conv {
    pub(crate) fn new(
        params: &mut Params,
        name: &str,
        shape: [usize; 4],
        stride: usize,
        pad: usize,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        // torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu").
        let fan_out = shape[0] * shape[2] * shape[3];
        let std = (2.0 / fan_out as f64).sqrt();
        let weight = params.create(&format!("{name}.weight"), &shape, Init::Normal(std), dtype, device)?;
        Ok(Conv { weight, stride, pad })
    }
}

/// The fixed part of a residual block: strides, paddings and batch-norm statistics. Its
/// weights are passed in, so the same code runs plainly or as a checkpointed segment.
#[derive(Clone)]
struct BlockSpec {
    /// (stride, padding) of each main-path convolution.
    convs: Vec<(usize, usize)>,
    norms: Vec<RunningStats>,
    /// Stride and statistics of the projection shortcut.
    downsample: Option<(usize, RunningStats)>,
}

impl BlockSpec {
    /// `w`: each main convolution's weight, then each main norm's (weight, bias), then the
    /// shortcut's convolution weight, norm weight and bias.
    fn apply(&self, x: &Tensor, w: &[Tensor], train: bool, update: bool) -> candle_core::Result<Tensor> {
        let k = self.convs.len();
        let mode = (train, update);
        let identity = match &self.downsample {
            Some((stride, stats)) => {
                let (base, act) = (3 * k, Activation::Identity);
                stats.conv_normalize_act(x, (&w[base], 0, *stride), (&w[base + 1], &w[base + 2]), mode, None, act)?
            }
            None => x.clone(),
        };
        let mut h = x.clone();
        for (i, ((stride, pad), stats)) in self.convs.iter().zip(&self.norms).enumerate() {
            // Every norm is followed by a ReLU, the last one's after the residual is added
            // (one pass in inference on the CPU; norm and ReLU one op in training).
            let residual = (i + 1 == k).then_some(&identity);
            let norm = (&w[k + 2 * i], &w[k + 2 * i + 1]);
            h = stats.conv_normalize_act(&h, (&w[i], *pad, *stride), norm, mode, residual, Activation::Relu)?;
        }
        Ok(h)
    }
}

struct Block {
    /// torchvision's module name (`layer3.1`), the label its allocations are recorded under.
    name: String,
    spec: BlockSpec,
    weights: Vec<Tensor>,
}

/// A ResNet classifier.
pub struct ResNet {
    /// Which depth.
    pub depth: ResNetDepth,
    /// Every parameter, by torchvision name.
    pub params: Params,
    stem: (Conv, BatchNorm),
    blocks: Vec<Block>,
    fc: (Tensor, Tensor),
}

impl ResNet {
    /// A fresh ResNet with `num_classes` outputs; `width` is the first stage's width (64 in the
    /// standard models; smaller for tests).
    pub fn new(
        depth: ResNetDepth,
        num_classes: usize,
        width: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, NnError> {
        let mut params = Params::default();
        let p = &mut params;
        let stem = (
            Conv::new(p, "conv1", [width, 3, 7, 7], 2, 3, dtype, device)?,
            BatchNorm::new(p, "bn1", width, dtype, device)?,
        );
        let expansion = if depth.bottleneck() { 4 } else { 1 };
        let mut inplanes = width;
        let mut blocks = Vec::new();
        for (stage, &count) in depth.blocks().iter().enumerate() {
            let planes = width << stage;
            for b in 0..count {
                let stride = if stage > 0 && b == 0 { 2 } else { 1 };
                let name = format!("layer{}.{b}", stage + 1);
                let shapes: Vec<([usize; 4], usize, usize)> = if depth.bottleneck() {
                    vec![
                        ([planes, inplanes, 1, 1], 1, 0),
                        ([planes, planes, 3, 3], stride, 1),
                        ([planes * 4, planes, 1, 1], 1, 0),
                    ]
                } else {
                    vec![([planes, inplanes, 3, 3], stride, 1), ([planes, planes, 3, 3], 1, 1)]
                };
                let (mut conv_w, mut norm_w, mut spec) =
                    (Vec::new(), Vec::new(), BlockSpec { convs: Vec::new(), norms: Vec::new(), downsample: None });
                for (i, (shape, s, pad)) in shapes.into_iter().enumerate() {
                    conv_w.push(Conv::new(p, &format!("{name}.conv{}", i + 1), shape, s, pad, dtype, device)?.weight);
                    let bn = BatchNorm::new(p, &format!("{name}.bn{}", i + 1), shape[0], dtype, device)?;
                    norm_w.extend([bn.weight, bn.bias]);
                    spec.convs.push((s, pad));
                    spec.norms.push(bn.running);
                }
                let mut weights = [conv_w, norm_w].concat();
                if stride != 1 || inplanes != planes * expansion {
                    let conv = Conv::new(
                        p,
                        &format!("{name}.downsample.0"),
                        [planes * expansion, inplanes, 1, 1],
                        stride,
                        0,
                        dtype,
                        device,
                    )?;
                    let bn = BatchNorm::new(p, &format!("{name}.downsample.1"), planes * expansion, dtype, device)?;
                    weights.extend([conv.weight, bn.weight, bn.bias]);
                    spec.downsample = Some((stride, bn.running));
                }
                blocks.push(Block { name, spec, weights });
                inplanes = planes * expansion;
            }
        }
        let fc_w = p.create("fc.weight", &[num_classes, inplanes], Init::Normal(0.01), dtype, device)?;
        let fc_b = p.create("fc.bias", &[num_classes], Init::Zeros, dtype, device)?;
        Ok(ResNet { depth, params, stem, blocks, fc: (fc_w, fc_b) })
    }

    /// torchvision's `zero_init_residual=True`: the last norm's scale in every residual block
    /// starts at zero, so each block starts as the identity (Goyal et al., 2017). Without it a
    /// freshly initialised deep ResNet amplifies small perturbations on the way back (at the
    /// test sizes here, bf16's rounding alone turns ResNet-50's parameter gradient by more than
    /// 80° from the f32 one); with it the two agree to a cosine of 0.998.
    pub fn zero_init_residual(&self) -> Result<(), NnError> {
        let last = if self.depth.bottleneck() { "bn3.weight" } else { "bn2.weight" };
        for (name, var) in self.params.iter() {
            if name.starts_with("layer") && name.ends_with(last) {
                var.set(&var.zeros_like()?)?;
            }
        }
        Ok(())
    }

    /// Logits (N, classes) for images (N, 3, H, W).
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor, NnError> {
        self.forward_with(x, train, None)
    }

    /// As [`ResNet::forward`], with each residual block checkpointed when `checkpoint` is given
    /// (its batch-norm statistics move once, in the forward pass, not again when recomputed).
    pub fn forward_with(&self, x: &Tensor, train: bool, checkpoint: Option<&Checkpointing>) -> Result<Tensor, NnError> {
        let stem = push_label("stem");
        let conv = &self.stem.0;
        // The stem's output is dropped once pooled (a shadowed binding would hold it, a quarter of
        // ResNet-18's inference peak, to the end of the forward pass).
        let mut x = max_pool2d(
            &self.stem.1.conv_forward_act(x, (&conv.weight, conv.pad, conv.stride), train, Activation::Relu)?,
            3,
            2,
            1,
        )?;
        drop(stem);
        for block in &self.blocks {
            let _block = push_label(&block.name);
            x = run_stateful(checkpoint, &x, &block.weights, &block.spec, move |spec, x, w, update| {
                spec.apply(x, w, train, update)
            })?;
        }
        let _head = push_label("fc");
        let pooled = global_avg_pool(&x)?;
        Ok(wick_nn::ops::linear(&pooled, &self.fc.0, Some(&self.fc.1))?)
    }
}

crate::classifier::cnn_classifier!(ResNet);
