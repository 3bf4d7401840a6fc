//! Gradient buckets: which parameters are reduced together, and the data-parallel reduction
//! that sums every rank's gradients into them.
//!
//! Policy (PyTorch DDP's, `torch/nn/parallel/distributed.py` and `reducer.hpp`): parameters in
//! reverse registration order ([`wick_nn::params::Params::registration_order`], not the name
//! order a model's parameters are listed in) — roughly the order backward produces their
//! gradients — packed
//! into buckets of at most [`BUCKET_BYTES`] (25 MiB), the first one capped at
//! [`FIRST_BUCKET_BYTES`] (1 MiB) so the first-ready gradients do not wait in a large bucket —
//! and, unlike DDP, the last one capped at 1 MiB too (below). A parameter is never split; one
//! larger than the cap has a bucket of its own.
//!
//! Rationale for registration order: the model's parameter list is in name order, which puts
//! `layers.10` before `layers.2`. Buckets made from it waited for the tenth-from-last layer
//! before the first could start, and on ViT-S/16 2 of 55 started inside backward at stage 0, 1
//! of 5 at stage 2 (BENCHMARKS.md, "Buckets in the order backward fills them").
//!
//! Rationale for a small last bucket: the last bucket's gradients are the last backward makes,
//! so its reduction starts after backward and nothing hides it. DDP's plan leaves it whatever
//! the 25 MiB buckets before it did not take (ResNet-18: 21.7 MB, 1.5 % of the step exposed at
//! stage 2); taking it first, from the first-registered parameters (the stem) up to 1 MiB, lets
//! the rest start while backward still runs the first layers (0.1 % there).
//!
//! The reduction itself is a `flight` (see that module): each bucket's collective started from
//! inside backward as its last gradient is complete, in bucket order, or all of them after
//! backward ([`GradBuckets::reduce`], and `overlap: false`). The time it costs, and how much of
//! it backward hid, is measured and reported ([`ReduceStats`]).
//!
//! Rationale for reducing large gradients where they lie: a bucket is one contiguous buffer
//! for MPI, so its gradients are first copied into it — for the large ones that copy cost a
//! quarter of the all-reduce's own time here (BENCHMARKS.md, "More than one process"). An f32
//! gradient of at least [`DIRECT_BYTES`] is therefore all-reduced straight from its own storage
//! into its reduced tensor, in its bucket's turn; the small ones of the bucket are still packed
//! and reduced together (the latency saving buckets exist for). Which gradients go direct is
//! decided from what every rank knows alike (dtype, size, agreed presence), so all ranks make
//! the same calls in the same order.
//!
//! Rationale for f32 buckets: MPI has no bf16/f16 sum. A bucket holds f32; an f32 gradient
//! becomes a view into its bucket when the bucket is all f32 (no second copy: the bucket *is*
//! the gradient's storage, as with PyTorch's `gradient_as_bucket_view`; see `gradients_of`
//! for a mixed one), a low-precision gradient is rounded back to its
//! dtype (for two ranks that equals candle's own low-precision addition: see
//! [`super::ProcessGroup`]).

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::error::DistError;
pub use super::flight::ReduceStats;
use super::flight::{Flight, Unit};
use super::pending::Collective;
use super::{ProcessGroup, ReduceOp};

/// PyTorch DDP's default bucket cap (`bucket_cap_mb=25`).
pub const BUCKET_BYTES: usize = 25 << 20;
/// PyTorch DDP's first-bucket cap (`_DEFAULT_FIRST_BUCKET_BYTES`).
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;
/// f32 gradients this large are reduced from their own storage instead of being packed.
pub const DIRECT_BYTES: usize = 256 << 10;

/// The parameters (indices into the model's parameter list, of `elems` elements each) of each
/// bucket, in the order the buckets are reduced: `registered` (the indices in the order the
/// parameters were registered) reversed, the first and the last bucket at most `first` bytes,
/// the rest at most `cap` (f32 bytes; a parameter over its bucket's cap alone in it). An index
/// `registered` leaves out (or repeats, or that is out of range) is taken as registered after
/// every listed one, in index order.
pub fn assign_buckets(elems: &[usize], registered: &[usize], first: usize, cap: usize) -> Vec<Vec<usize>> {
    let mut listed = vec![false; elems.len()];
    let mut order: Vec<usize> =
        registered.iter().filter(|&&i| i < elems.len() && !std::mem::replace(&mut listed[i], true)).copied().collect();
    order.extend((0..elems.len()).filter(|&i| !listed[i]));
    let bytes_of = |i: usize| elems[i].saturating_mul(4);
    // The last bucket: the first-registered parameters, up to `first` bytes (at least one).
    let (mut tail, mut tail_bytes) = (0usize, 0usize);
    while tail < order.len() && (tail == 0 || tail_bytes.saturating_add(bytes_of(order[tail])) <= first) {
        tail_bytes = tail_bytes.saturating_add(bytes_of(order[tail]));
        tail += 1;
    }
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let (mut current, mut bytes) = (Vec::new(), 0usize);
    for &i in order[tail..].iter().rev() {
        let b = bytes_of(i);
        let limit = if buckets.is_empty() { first } else { cap };
        if !current.is_empty() && bytes.saturating_add(b) > limit {
            buckets.push(std::mem::take(&mut current));
            bytes = 0;
        }
        current.push(i);
        bytes = bytes.saturating_add(b);
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    if tail > 0 {
        buckets.push(order[..tail].iter().rev().copied().collect());
    }
    buckets
}

/// The gradients of `members` (of `vars`) cut out of their reduced f32 bucket, in order: views
/// of it when every member is f32 (the bucket is their storage), otherwise low-precision ones
/// rounded back to their dtype and f32 ones copied out — one f32 view would keep the whole
/// bucket alive beside the low-precision gradients (a bf16 model's f32 norm weights held every
/// such bucket in f32 until the update). The host's and the NCCL path's replicated reduction.
pub(crate) fn gradients_of(bucket: &Tensor, members: &[usize], vars: &[Var]) -> candle_core::Result<Vec<Tensor>> {
    let all_f32 = members.iter().all(|&i| vars[i].dtype() == DType::F32);
    let mut at = 0;
    let mut out = Vec::with_capacity(members.len());
    for &i in members {
        let v = &vars[i];
        let view = bucket.narrow(0, at, v.elem_count())?.reshape(v.dims())?;
        at += v.elem_count();
        out.push(match (v.dtype(), all_f32) {
            (DType::F32, true) => view,
            (DType::F32, false) => view.force_contiguous()?,
            (dtype, _) => view.to_dtype(dtype)?,
        });
    }
    Ok(out)
}

/// Elements of each rank's block of a sharded bucket of `elems` (ZeRO's equal blocks: the
/// bucket padded to a multiple of the world size, at least one element each).
pub(crate) fn block_of(elems: usize, world: usize) -> usize {
    elems.div_ceil(world.max(1)).max(1)
}

/// Which of `vars` have a gradient on any rank (all-reduce MAX of the local presence): a
/// parameter no rank computed stays without one, as in one process; one computed on some ranks
/// only counts zeros for the others.
#[cfg(feature = "nccl")]
pub(crate) fn agreed_presence(group: &ProcessGroup, grads: &GradStore, vars: &[Var]) -> Result<Vec<bool>, DistError> {
    let local: Vec<bool> = vars.iter().map(|v| grads.get(v.as_tensor()).is_some()).collect();
    agree_presence(group, &local)
}

/// Which parameters have a gradient on any rank, from this rank's `local` presence.
pub(crate) fn agree_presence(group: &ProcessGroup, local: &[bool]) -> Result<Vec<bool>, DistError> {
    let local: Vec<u8> = local.iter().map(|&p| p as u8).collect();
    let mut any = vec![0u8; local.len()];
    group.comm().all_reduce(&local, &mut any, ReduceOp::Max)?;
    Ok(any.into_iter().map(|p| p != 0).collect())
}

/// The data-parallel reduction: every rank's gradients summed, bucket by bucket, back into
/// `grads` (f32 ones as views of their bucket). [`crate::Trainer::data_parallel`] uses it; a
/// training loop of one's own can too.
pub struct GradBuckets {
    plan: Vec<Vec<usize>>,
    /// f32 bytes of all buckets (the reduced gradients' storage).
    bytes: usize,
}

impl GradBuckets {
    /// The buckets of `vars` (the model's parameters, in its list's order), given the order
    /// they were `registered` in (see [`assign_buckets`]), the first at most `first` bytes, the
    /// others at most `cap`.
    pub fn new(vars: &[Var], registered: &[usize], first: usize, cap: usize) -> Self {
        let elems: Vec<usize> = vars.iter().map(|v| v.elem_count()).collect();
        let bytes = elems.iter().fold(0usize, |a, &e| a.saturating_add(e.saturating_mul(4)));
        GradBuckets { plan: assign_buckets(&elems, registered, first, cap), bytes }
    }

    /// The parameters (indices into `vars`) of each bucket, in reduction order.
    pub fn plan(&self) -> &[Vec<usize>] {
        &self.plan
    }

    /// f32 bytes of every bucket together.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes of the largest buffer a reduction of `vars` (as given to [`GradBuckets::new`])
    /// fills, what the estimator's per-rank figure needs: replicated, a packed bucket or a large
    /// f32 gradient reduced on its own; `sharded`, a whole bucket padded to `world` ranks.
    pub fn largest_buffer(&self, vars: &[Var], sharded: bool, world: usize) -> usize {
        let direct = |i: usize| !sharded && vars[i].dtype() == DType::F32 && vars[i].elem_count() * 4 >= DIRECT_BYTES;
        self.plan
            .iter()
            .map(|bucket| {
                let packed: usize = bucket.iter().filter(|&&i| !direct(i)).map(|&i| vars[i].elem_count()).sum();
                let packed = if sharded { packed.div_ceil(world.max(1)) * world.max(1) } else { packed };
                let alone = bucket.iter().filter(|&&i| direct(i)).map(|&i| vars[i].elem_count()).max().unwrap_or(0);
                packed.max(alone) * 4
            })
            .max()
            .unwrap_or(0)
    }

    /// f32 bytes of the units a reduction of `vars` with overlap may start from inside backward
    /// (every unit but the last, see `flight`): (the largest, all of them) — what the estimator
    /// adds to backward's peak. Replicated, a bucket's packed gradients and each large f32
    /// gradient are units of their own; `sharded`, a bucket padded to a multiple of `world`.
    pub fn in_backward_bytes(&self, vars: &[Var], sharded: bool, world: usize) -> (usize, usize) {
        let mut units: Vec<usize> = if sharded {
            let elems = |b: &Vec<usize>| b.iter().map(|&i| vars[i].elem_count()).sum::<usize>();
            self.plan.iter().map(|b| block_of(elems(b), world) * world.max(1)).collect()
        } else {
            self.units(vars).iter().map(|u| u.len).collect()
        };
        units.pop();
        let bytes = units.iter().map(|&u| u.saturating_mul(4));
        (bytes.clone().max().unwrap_or(0), bytes.fold(0usize, |a, b| a.saturating_add(b)))
    }

    /// The collectives of the replicated reduction, in order: each bucket's gradients packed
    /// together, then each of its f32 gradients of [`DIRECT_BYTES`] or more on its own, from
    /// its own storage.
    pub(crate) fn units(&self, vars: &[Var]) -> Vec<Unit> {
        let mut units = Vec::new();
        for bucket in &self.plan {
            let direct = |i: usize| vars[i].dtype() == DType::F32 && vars[i].elem_count() * 4 >= DIRECT_BYTES;
            let (alone, packed): (Vec<usize>, Vec<usize>) = bucket.iter().partition(|&&i| direct(i));
            if !packed.is_empty() {
                let len = packed.iter().map(|&i| vars[i].elem_count()).sum();
                units.push(Unit { members: packed, len, direct: false });
            }
            units.extend(alone.into_iter().map(|i| Unit { members: vec![i], len: vars[i].elem_count(), direct: true }));
        }
        units
    }

    /// A reduction of `vars`' gradients (to start from inside backward, [`Flight::ready`]): each
    /// unit's sum cut into its members' gradients as it completes (`gradients_of`: so the f32
    /// values of a low-precision model go at once).
    pub(crate) fn flight(&self, vars: &[Var]) -> Result<Flight, DistError> {
        let owned = vars.to_vec();
        let finisher = Box::new(move |_: usize, unit: &Unit, values: Vec<f32>| -> Result<Vec<Tensor>, DistError> {
            let bucket = Tensor::from_vec(values, unit.len, &Device::Cpu)?;
            Ok(gradients_of(&bucket, &unit.members, &owned)?)
        });
        Flight::new(self.units(vars), Collective::AllReduce, vars, finisher)
    }

    /// Sums `grads` (of `vars`, as given to [`GradBuckets::new`]) over ranks in place: every
    /// rank calls it with its own gradients and gets the sum.
    pub fn reduce(&self, group: &ProcessGroup, grads: &mut GradStore, vars: &[Var]) -> Result<ReduceStats, DistError> {
        let mut flight = self.flight(vars)?;
        flight.close(group.comm(), Some(grads))?;
        self.finish(group, flight, grads, vars)
    }

    /// Completes `flight` (made by [`GradBuckets::flight`], closed or not) and puts the summed
    /// gradients of the parameters any rank has one of into `grads`: f32 ones as views of their
    /// bucket, others rounded back to their dtype.
    pub(crate) fn finish(
        &self,
        group: &ProcessGroup,
        flight: Flight,
        grads: &mut GradStore,
        vars: &[Var],
    ) -> Result<ReduceStats, DistError> {
        let (results, local, stats) = flight.finish(group.comm())?;
        let present = agree_presence(group, &local)?;
        for (unit, reduced) in results {
            for (&i, g) in unit.members.iter().zip(reduced) {
                if present[i] {
                    grads.insert(vars[i].as_tensor(), g);
                }
            }
        }
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_pytorchs_policy() {
        // 1 MiB = 262144 f32 elements. Reverse order; the first bucket closes before 1 MiB.
        let mib = 1 << 18;
        let elems = [mib * 30, 10, mib / 2, mib / 2, 100];
        let plan = assign_buckets(&elems, &[0, 1, 2, 3, 4], FIRST_BUCKET_BYTES, BUCKET_BYTES);
        assert_eq!(plan, vec![vec![4, 3], vec![2, 1], vec![0]]);
        // Every parameter exactly once.
        let mut all: Vec<usize> = plan.concat();
        all.sort();
        assert_eq!(all, (0..elems.len()).collect::<Vec<_>>());
        assert!(assign_buckets(&[], &[], 1, 1).is_empty());
    }

    #[test]
    fn buckets_reverse_the_registration_order_not_the_list_order() {
        // Listed by name (`l.0`, `l.1`, `l.10`, `l.11`, `l.2`), registered by layer; f32 bytes
        // 40, 80, 120, 160 and 200.
        let elems = [10, 20, 30, 40, 50];
        let plan = assign_buckets(&elems, &[0, 1, 4, 2, 3], 200, 320);
        // The last bucket first: the first-registered up to 200 bytes (0 and 1); then from the
        // last-registered, 200 bytes in the first bucket, 320 in the others.
        assert_eq!(plan, vec![vec![3], vec![2, 4], vec![1, 0]]);
        // Left out, repeated or out of range: the rest come as if registered last, in list order
        // (3, 1, then 0, 2, 4): the last bucket takes 3 alone (it is over the cap).
        let plan = assign_buckets(&elems, &[3, 3, 9, 1], 100, 1000);
        assert_eq!(plan, vec![vec![4], vec![2, 0, 1], vec![3]]);
    }

    #[test]
    fn the_last_bucket_is_as_small_as_the_first() {
        // ResNet-18-like: a small stem registered first, then 25 MiB of layers, then a head.
        let mib = 1 << 18;
        let elems = [mib / 8, 40 * mib, mib / 16];
        let plan = assign_buckets(&elems, &[0, 1, 2], FIRST_BUCKET_BYTES, BUCKET_BYTES);
        assert_eq!(plan, vec![vec![2], vec![1], vec![0]]);
        // Everything under the first cap: one bucket.
        assert_eq!(assign_buckets(&[10, 10], &[0, 1], FIRST_BUCKET_BYTES, BUCKET_BYTES), vec![vec![1, 0]]);
    }

    #[test]
    fn one_rank_reduction_keeps_gradients_and_makes_views() {
        let group = ProcessGroup::single();
        let a = Var::from_tensor(&Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::new(&[[4f32, 5.], [6., 7.]], &Device::Cpu).unwrap()).unwrap();
        let loss = ((a.as_tensor().sqr().unwrap().sum_all().unwrap() + b.as_tensor().sum_all().unwrap()).unwrap()
            * 3.0)
            .unwrap();
        let mut grads = loss.backward().unwrap();
        let vars = vec![a.clone(), b.clone()];
        let buckets = GradBuckets::new(&vars, &[0, 1], FIRST_BUCKET_BYTES, BUCKET_BYTES);
        let stats = buckets.reduce(&group, &mut grads, &vars).unwrap();
        assert_eq!((stats.buckets, stats.bytes), (1, 7 * 4));
        assert_eq!(grads.get(&a).unwrap().to_vec1::<f32>().unwrap(), vec![6., 12., 18.]);
        assert_eq!(grads.get(&b).unwrap().to_vec2::<f32>().unwrap(), vec![vec![3., 3.], vec![3., 3.]]);
        // Views of one bucket: the same storage.
        let (sa, _) = grads.get(&a).unwrap().storage_and_layout();
        let (sb, lb) = grads.get(&b).unwrap().storage_and_layout();
        assert!(std::ptr::eq(&*sa, &*sb), "both gradients live in the bucket");
        assert_eq!(lb.start_offset(), 0, "b is reduced first (reverse order), so it starts the bucket");
    }
}
