//! A data loader that cannot leak: batches of an indexable [`Dataset`], shuffled by seed,
//! assembled by worker threads into a prefetch queue bounded **in bytes**, in the same order
//! whatever the number of workers, resumable from a [`Position`] saved with a checkpoint.
//!
//! What PyTorch's `DataLoader` users meet and this does not do: workers are threads of this
//! process joined when the epoch's iterator is dropped (after an error, a panic in a worker, or
//! an early `break` alike), so no worker outlives its epoch and no memory grows per epoch; a
//! failing sample reaches the training loop as an `Err` naming its index, never a hang; the
//! queue holds at most `prefetch_bytes` of batches (one batch when a single batch is larger).
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use wick_train::data::{Dataset, DataError, Loader, LoaderConfig, Position};
//!
//! struct Squares;
//! impl Dataset for Squares {
//!     fn len(&self) -> usize { 10 }
//!     fn get(&self, i: usize) -> Result<Vec<Tensor>, DataError> {
//!         let x = Tensor::new(&[i as f32], &Device::Cpu).map_err(|e| DataError::sample(i, e))?;
//!         let y = Tensor::new(&[(i * i) as f32], &Device::Cpu).map_err(|e| DataError::sample(i, e))?;
//!         Ok(vec![x, y])
//!     }
//! }
//!
//! let loader = Loader::new(Squares, LoaderConfig { batch_size: 4, workers: 2, ..LoaderConfig::default() });
//! let batches: Vec<_> = loader.epoch(Position::start(0)).collect::<Result<_, _>>()?;
//! assert_eq!(batches.len(), 3);                       // 4 + 4 + 2 (drop_last is off)
//! assert_eq!(batches[0].tensors[0].dims(), &[4, 1]);  // fields stacked on a new first axis
//! # Ok::<(), DataError>(())
//! ```

mod sources;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use candle_core::Tensor;
use rand_xoshiro::rand_core::{Rng, SeedableRng};
use rand_xoshiro::SplitMix64;

pub use sources::{ImageFolder, TensorFile, TokenFile};

/// Why a sample or a batch could not be had; names the sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DataError {
    /// Reading or decoding sample `index` failed.
    #[error("sample {index}: {message}")]
    Sample {
        /// The sample's index in the dataset.
        index: usize,
        /// What failed.
        message: String,
    },
    /// A worker panicked while reading sample `index` (the panic's message).
    #[error("sample {index}: the worker panicked: {message}")]
    Panicked {
        /// The sample being read.
        index: usize,
        /// The panic's message.
        message: String,
    },
    /// The samples of a batch could not be stacked (shapes or dtypes differ).
    #[error("batch of samples {first}..: {message}")]
    Collate {
        /// The batch's first sample.
        first: usize,
        /// What failed.
        message: String,
    },
    /// The worker that held batch `batch` exited without sending it (it panicked outside a
    /// sample).
    #[error("batch {batch}: its worker exited without sending it")]
    WorkerLost {
        /// The batch's place in its epoch.
        batch: usize,
    },
    /// A rank's share asked for is impossible (rank not below the world size, a world of 0).
    #[error("loader shard: rank {rank} of {world}")]
    Shard {
        /// The rank asked for.
        rank: usize,
        /// The world size asked for.
        world: usize,
    },
    /// A dataset could not be opened.
    #[error("{path}: {message}")]
    Source {
        /// The file or folder.
        path: String,
        /// What is wrong.
        message: String,
    },
}

impl DataError {
    /// A [`DataError::Sample`] for sample `index` from any error.
    pub fn sample(index: usize, e: impl std::fmt::Display) -> Self {
        DataError::Sample { index, message: e.to_string() }
    }
}

/// Samples read by index, from any thread. A sample is one tensor per field (an image and its
/// label, a token window...); every sample of a dataset has the same fields.
pub trait Dataset: Send + Sync + 'static {
    /// Samples in the dataset.
    fn len(&self) -> usize;
    /// True when there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sample `index` (below [`Dataset::len`]).
    fn get(&self, index: usize) -> Result<Vec<Tensor>, DataError>;
}

/// How batches are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderConfig {
    /// Samples per batch.
    pub batch_size: usize,
    /// Shuffle each epoch (by `seed` and the epoch number).
    pub shuffle: bool,
    /// The shuffling seed.
    pub seed: u64,
    /// Drop the last, short batch of an epoch.
    pub drop_last: bool,
    /// Worker threads; 0 reads inline on the caller's thread.
    pub workers: usize,
    /// Bytes of finished batches the queue may hold ahead of the consumer (at least one batch
    /// is always allowed).
    pub prefetch_bytes: usize,
}

impl Default for LoaderConfig {
    /// Batches of 32, shuffled with seed 0, the short last batch kept, 2 workers, 64 MiB ahead.
    fn default() -> Self {
        LoaderConfig { batch_size: 32, shuffle: true, seed: 0, drop_last: false, workers: 2, prefetch_bytes: 64 << 20 }
    }
}

/// Where a loader is: the epoch and the next batch in it (save it with a checkpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// The epoch.
    pub epoch: u64,
    /// The next batch of the epoch.
    pub batch: usize,
}

impl Position {
    /// The first batch of `epoch`.
    pub fn start(epoch: u64) -> Self {
        Position { epoch, batch: 0 }
    }
}

/// A batch: the samples' indices, and each field stacked on a new first axis.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Where it was in its epoch.
    pub position: Position,
    /// The dataset indices of its samples, in order.
    pub indices: Vec<usize>,
    /// One tensor per field, (batch, ...).
    pub tensors: Vec<Tensor>,
}

impl Batch {
    /// Bytes of its tensors.
    pub fn bytes(&self) -> usize {
        self.tensors.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

/// A loader over a dataset.
pub struct Loader<D: Dataset> {
    dataset: Arc<D>,
    config: LoaderConfig,
    /// (rank, world size) of a data-parallel run's share.
    shard: (usize, usize),
}

impl<D: Dataset> Loader<D> {
    /// A loader over `dataset` (a batch size of 0 counts as 1).
    pub fn new(dataset: D, config: LoaderConfig) -> Self {
        let config = LoaderConfig { batch_size: config.batch_size.max(1), ..config };
        Loader { dataset: Arc::new(dataset), config, shard: (0, 1) }
    }

    /// Rank `rank`'s share of every epoch in a data-parallel run of `world` ranks: the epoch's
    /// batches, as one process makes them, dealt in turn — rank `r` takes batches `r`,
    /// `r + world`, `r + 2·world`, … — so that `world` ranks with one batch each see what one
    /// process sees in one step of `world` accumulated batches. When the epoch's batches do not
    /// divide by `world`, the last turn is completed from the epoch's first batches (as PyTorch's
    /// `DistributedSampler` pads from the epoch's start), or dropped with `drop_last`; every
    /// rank has the same number of batches. [`Position::batch`] counts this rank's batches.
    pub fn sharded(self, rank: usize, world: usize) -> Result<Self, DataError> {
        if world == 0 || rank >= world {
            return Err(DataError::Shard { rank, world });
        }
        Ok(Loader { shard: (rank, world), ..self })
    }

    /// The dataset.
    pub fn dataset(&self) -> &D {
        &self.dataset
    }

    /// The sample order of `epoch`: a Fisher–Yates shuffle seeded by the seed and the epoch, or
    /// the dataset's order.
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.dataset.len()).collect();
        if self.config.shuffle {
            // SplitMix64: fixed, so an epoch's order never changes between versions or machines.
            let mut rng = SplitMix64::seed_from_u64(self.config.seed ^ epoch.wrapping_mul(0xD1B5_4A32_D192_ED03));
            for i in (1..order.len()).rev() {
                let j = (rng.next_u64() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
        }
        order
    }

    /// Batches in an epoch (this rank's, when sharded).
    pub fn batches_per_epoch(&self) -> usize {
        let (n, b) = (self.dataset.len(), self.config.batch_size);
        let all = if self.config.drop_last { n / b } else { n.div_ceil(b) };
        self.rank_turns(all)
    }

    /// This rank's batches of an epoch of `all`: whole turns, the last one padded unless
    /// `drop_last` (an empty epoch stays empty).
    fn rank_turns(&self, all: usize) -> usize {
        let world = self.shard.1;
        if self.config.drop_last || all == 0 {
            all / world
        } else {
            all.div_ceil(world)
        }
    }

    /// The batches of `from.epoch` from batch `from.batch` on. Its workers are joined when the
    /// iterator is dropped or exhausted.
    pub fn epoch(&self, from: Position) -> Epoch {
        let order = self.order(from.epoch);
        let b = self.config.batch_size;
        let batches: Vec<Vec<usize>> =
            order.chunks(b).filter(|c| !self.config.drop_last || c.len() == b).map(<[usize]>::to_vec).collect();
        let (rank, world) = self.shard;
        let batches: Vec<Vec<usize>> = if world == 1 {
            batches
        } else {
            let turns = self.rank_turns(batches.len());
            (0..turns).map(|j| batches[(rank + j * world) % batches.len()].clone()).collect()
        };
        let jobs: Vec<(Position, Vec<usize>)> = batches
            .into_iter()
            .enumerate()
            .skip(from.batch)
            .map(|(i, indices)| (Position { epoch: from.epoch, batch: i }, indices))
            .collect();
        Epoch::start(self.dataset.clone(), jobs, self.config)
    }
}

/// The bytes queued and whose turn it is to queue (batches reserve in epoch order, so a
/// batch the consumer waits for never waits behind a later one), and the stop flag.
#[derive(Default)]
struct Queue {
    bytes: usize,
    turn: usize,
    peak: usize,
}

/// What the workers and the consumer share.
struct Budget {
    queue: Mutex<Queue>,
    changed: Condvar,
    limit: usize,
    stop: AtomicBool,
}

impl Budget {
    /// Waits until it is batch `seq`'s turn and `bytes` more fit (or nothing is queued), then
    /// counts them; false when stopping.
    fn reserve(&self, seq: usize, bytes: usize) -> bool {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        while q.turn != seq || (q.bytes > 0 && q.bytes.saturating_add(bytes) > self.limit) {
            if self.stop.load(Ordering::SeqCst) {
                return false;
            }
            q = self.changed.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q.bytes += bytes;
        q.peak = q.peak.max(q.bytes);
        q.turn += 1;
        self.changed.notify_all();
        !self.stop.load(Ordering::SeqCst)
    }

    fn release(&self, bytes: usize) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.bytes = q.bytes.saturating_sub(bytes);
        self.changed.notify_all();
    }
}

type Sent = Result<Batch, DataError>;

/// Reads and stacks one batch, a panic in the dataset caught and named.
fn make_batch<D: Dataset>(dataset: &D, position: Position, indices: Vec<usize>) -> Sent {
    let mut fields: Vec<Vec<Tensor>> = Vec::new();
    for &index in &indices {
        let sample = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| dataset.get(index))).map_err(|p| {
            let message = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            DataError::Panicked { index, message }
        })??;
        if fields.is_empty() {
            fields = sample.iter().map(|_| Vec::with_capacity(indices.len())).collect();
        }
        if sample.len() != fields.len() {
            return Err(DataError::sample(
                index,
                format!("{} fields, the batch's first sample has {}", sample.len(), fields.len()),
            ));
        }
        for (field, t) in fields.iter_mut().zip(sample) {
            field.push(t);
        }
    }
    let first = indices.first().copied().unwrap_or(0);
    let tensors = fields
        .iter()
        .map(|f| Tensor::stack(f, 0).map_err(|e| DataError::Collate { first, message: e.to_string() }))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Batch { position, indices, tensors })
}

/// Reads one batch (inline reading).
type ReadFn = Arc<dyn Fn(Position, Vec<usize>) -> Sent + Send + Sync>;

/// The batches of an epoch still to read: their positions and sample indices.
type Jobs = std::vec::IntoIter<(Position, Vec<usize>)>;

/// The batches of one epoch, in order.
pub struct Epoch {
    /// Inline (no workers): the reader and the jobs left.
    inline: Option<(ReadFn, Jobs)>,
    /// One queue per worker; batch k comes from worker k mod n.
    queues: Vec<Receiver<Sent>>,
    workers: Vec<JoinHandle<()>>,
    budget: Arc<Budget>,
    next: usize,
    total: usize,
    failed: bool,
    /// A worker thread that could not be started: the epoch's only item.
    startup: Option<DataError>,
}

impl Epoch {
    fn start<D: Dataset>(dataset: Arc<D>, jobs: Vec<(Position, Vec<usize>)>, config: LoaderConfig) -> Epoch {
        let budget = Arc::new(Budget {
            queue: Mutex::new(Queue::default()),
            changed: Condvar::new(),
            limit: config.prefetch_bytes,
            stop: AtomicBool::new(false),
        });
        let total = jobs.len();
        let mut epoch = Epoch {
            inline: None,
            queues: Vec::new(),
            workers: Vec::new(),
            budget,
            next: 0,
            total,
            failed: false,
            startup: None,
        };
        if config.workers == 0 {
            let read: ReadFn = Arc::new(move |p, i| make_batch(&*dataset, p, i));
            epoch.inline = Some((read, jobs.into_iter()));
            return epoch;
        }
        let n = config.workers;
        let mut assigned: Vec<Vec<(usize, Position, Vec<usize>)>> = (0..n).map(|_| Vec::new()).collect();
        for (k, (position, indices)) in jobs.into_iter().enumerate() {
            assigned[k % n].push((k, position, indices));
        }
        for (w, mine) in assigned.into_iter().enumerate() {
            // One finished batch per worker may wait in its queue (counted in the budget).
            let (tx, rx) = sync_channel::<Sent>(1);
            let (dataset, budget) = (dataset.clone(), epoch.budget.clone());
            let spawned = std::thread::Builder::new().name(format!("wick-data-{w}")).spawn(move || {
                for (seq, position, indices) in mine {
                    if budget.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let batch = make_batch(&*dataset, position, indices);
                    let bytes = batch.as_ref().map_or(0, Batch::bytes);
                    if !budget.reserve(seq, bytes) {
                        return;
                    }
                    let failed = batch.is_err();
                    if tx.send(batch).is_err() || failed {
                        return;
                    }
                }
            });
            match spawned {
                Ok(handle) => {
                    epoch.workers.push(handle);
                    epoch.queues.push(rx);
                }
                Err(e) => {
                    epoch.stop();
                    epoch.startup = Some(DataError::Source {
                        path: "worker threads".into(),
                        message: format!("cannot start worker {w}: {e}"),
                    });
                    return epoch;
                }
            }
        }
        epoch
    }

    /// The largest number of bytes of finished batches that were queued at once.
    pub fn peak_queued_bytes(&self) -> usize {
        self.budget.queue.lock().unwrap_or_else(|p| p.into_inner()).peak
    }

    /// Stops and joins every worker (also done on drop).
    fn stop(&mut self) {
        {
            // Set under the queue's lock: a worker in `reserve` either sees the flag before it
            // waits or is already waiting when the notification comes. Set without the lock, it
            // could land between a worker's check and its wait, and the worker slept through
            // the notification (the data tests hung on `join` below once).
            let _queue = self.budget.queue.lock().unwrap_or_else(|p| p.into_inner());
            self.budget.stop.store(true, Ordering::SeqCst);
        }
        self.budget.changed.notify_all();
        // Dropping the receivers fails the workers' sends; then they can be joined.
        self.queues.clear();
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

impl Iterator for Epoch {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.startup.take() {
            self.failed = true;
            return Some(Err(e));
        }
        if self.failed || self.next >= self.total {
            self.stop();
            return None;
        }
        if let Some((read, jobs)) = self.inline.as_mut() {
            let (position, indices) = jobs.next()?;
            self.next += 1;
            let batch = read(position, indices);
            self.failed = batch.is_err();
            return Some(batch);
        }
        let n = self.queues.len();
        let received = self.queues.get(self.next % n)?.recv();
        let batch = received.unwrap_or(Err(DataError::WorkerLost { batch: self.next }));
        self.next += 1;
        self.budget.release(batch.as_ref().map_or(0, Batch::bytes));
        if batch.is_err() {
            self.failed = true;
            self.stop();
        }
        Some(batch)
    }
}

impl Drop for Epoch {
    fn drop(&mut self) {
        self.stop();
    }
}
