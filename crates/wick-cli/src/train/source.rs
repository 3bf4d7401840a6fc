//! Where `wick train`'s batches come from: the seeded synthetic language, or a token file through
//! the data loader (whose position the checkpoints keep).

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use wick_train::data::{Dataset, Epoch, Loader, LoaderConfig, Position, TokenFile};

use super::{TrainArgs, VOCAB};

/// The seeded language: each sequence repeats a short motif chosen by the seed, the step and the
/// sequence, with one token in eight replaced — learnable, and a pure function of (seed, step,
/// micro-batch), which is the data position a checkpoint records.
fn batch(args: &TrainArgs, step: u64, micro: usize) -> Result<Tensor> {
    let mut state =
        args.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (micro as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (state >> 33) as usize
    };
    let mut ids = Vec::with_capacity(args.batch * args.seq);
    for _ in 0..args.batch {
        let motif: Vec<usize> = (0..3 + next() % 4).map(|_| next() % VOCAB).collect();
        for t in 0..args.seq {
            let noise = next();
            ids.push(if noise % 8 == 0 { noise / 8 % VOCAB } else { motif[t % motif.len()] } as u32);
        }
    }
    Ok(Tensor::from_vec(ids, (args.batch, args.seq), &Device::Cpu)?)
}

/// Where batches come from: the seeded synthetic language (a pure function of the step), or a
/// token file through the data loader (whose position the checkpoints keep).
pub(super) enum Source {
    Synthetic,
    Tokens { loader: Box<Loader<TokenFile>>, position: Position, epoch: Option<Epoch> },
}

impl Source {
    /// The run's data; with several ranks, this rank's share of each epoch (ranks hold the same
    /// position, so rank 0's, saved with a checkpoint, is every rank's).
    pub(super) fn open(args: &TrainArgs, rank: usize, world: usize) -> Result<Source> {
        let Some(path) = &args.data else { return Ok(Source::Synthetic) };
        let tokens = TokenFile::open(path, 2, args.seq - 1)?;
        if let Some((at, t)) = tokens.tokens().iter().enumerate().find(|(_, t)| **t as usize >= VOCAB) {
            bail!("{}: token {at} is {t}, the model's vocabulary is {VOCAB}", path.display());
        }
        let config = LoaderConfig {
            batch_size: args.batch,
            shuffle: true,
            seed: args.seed,
            drop_last: true,
            workers: 1,
            prefetch_bytes: 16 << 20,
        };
        let loader = Box::new(Loader::new(tokens, config).sharded(rank, world)?);
        if loader.batches_per_epoch() == 0 {
            bail!("{}: fewer than {} windows of {} tokens", path.display(), args.batch, args.seq);
        }
        Ok(Source::Tokens { loader, position: Position::start(0), epoch: None })
    }

    /// The position to save with a checkpoint.
    pub(super) fn position(&self) -> serde_json::Value {
        match self {
            Source::Synthetic => serde_json::Value::Null,
            Source::Tokens { position, .. } => serde_json::json!(position),
        }
    }

    /// Continues from a saved position.
    pub(super) fn seek(&mut self, saved: &serde_json::Value) -> Result<()> {
        if let Source::Tokens { position, epoch, .. } = self {
            *position = serde_json::from_value(saved.clone()).context("the checkpoint's data-loader position")?;
            *epoch = None;
        }
        Ok(())
    }

    /// The next micro-batch (the synthetic one of `step`).
    pub(super) fn next(&mut self, args: &TrainArgs, step: u64, micro: usize) -> Result<Tensor> {
        let Source::Tokens { loader, position, epoch } = self else { return batch(args, step, micro) };
        loop {
            let current = epoch.get_or_insert_with(|| loader.epoch(*position));
            match current.next() {
                Some(b) => {
                    let b = b?;
                    *position = Position { epoch: b.position.epoch, batch: b.position.batch + 1 };
                    return b.tensors.into_iter().next().context("a batch without its tokens");
                }
                None => {
                    *position = Position::start(position.epoch + 1);
                    *epoch = None;
                }
            }
        }
    }

    /// A fixed held-out batch: the synthetic language past any step, or the file's first
    /// windows in order.
    pub(super) fn held_out(&self, args: &TrainArgs) -> Result<Tensor> {
        match self {
            Source::Synthetic => batch(args, u64::MAX, 0),
            Source::Tokens { loader, .. } => {
                let rows = (0..args.batch.min(loader.dataset().len()))
                    .map(|i| Ok(loader.dataset().get(i)?.remove(0)))
                    .collect::<Result<Vec<_>>>()?;
                Ok(Tensor::stack(&rows, 0)?)
            }
        }
    }
}
