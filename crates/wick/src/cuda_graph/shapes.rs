//! What a step or a function run as CUDA graphs keeps for each shape of its inputs
//! ([`Shapes`]): the caller's own tensors for the shape (the graph's inputs, and outputs), the
//! eager runs so far, the graph once captured or why its capture was refused; and why the last
//! run was eager. `wick-train`'s training step (`amp::graph_step`) and [`super::GraphForward`]
//! both keep theirs here.

use std::fmt::Debug;

use super::StepGraph;

/// One input shape's entry.
pub struct Shaped<K, T> {
    /// The shape (the inputs' dimensions and dtypes, as the caller keys them).
    pub key: K,
    /// What the caller keeps for the shape: the graph's own inputs (and outputs).
    pub own: T,
    /// Eager runs of the shape so far.
    pub eager: usize,
    /// The shape's graph, once captured.
    pub graph: Option<StepGraph>,
    /// Why the shape's capture was refused (its runs are eager from then on).
    pub refused: Option<String>,
}

/// Where inputs of a shape go ([`Shapes::place`]).
pub enum Place {
    /// The entry of their shape.
    Known(usize),
    /// A new entry of their own (the first shape, or any with recapture per shape).
    New,
    /// No entry: they run eagerly, for this reason.
    Eager(String),
}

/// The entries, in the order their shapes were first seen.
pub struct Shapes<K, T> {
    entries: Vec<Shaped<K, T>>,
    recapture: bool,
    eager_reason: Option<String>,
}

impl<K: PartialEq + Debug, T> Default for Shapes<K, T> {
    fn default() -> Self {
        Shapes { entries: Vec::new(), recapture: false, eager_reason: None }
    }
}

impl<K: PartialEq + Debug, T> Shapes<K, T> {
    /// With `true`, every new shape gets an entry (and a graph of its own after its warm-up);
    /// without, only the first does and other shapes run eagerly.
    pub fn recapture_per_shape(&mut self, yes: bool) {
        self.recapture = yes;
    }

    /// Where inputs of `key` go.
    pub fn place(&self, key: &K) -> Place {
        match self.entries.iter().position(|s| s.key == *key) {
            Some(i) => Place::Known(i),
            None if self.entries.is_empty() || self.recapture => Place::New,
            None => Place::Eager(format!(
                "the inputs' shapes {key:?} are not the captured ones {:?} (recapture per shape gives each shape a \
                 graph)",
                self.entries[0].key
            )),
        }
    }

    /// A new entry for `key`, keeping `own`; its index.
    pub fn push(&mut self, key: K, own: T) -> usize {
        self.entries.push(Shaped { key, own, eager: 0, graph: None, refused: None });
        self.entries.len() - 1
    }

    /// Entry `i` (from [`Shapes::place`] or [`Shapes::push`]), and the last run's eager reason
    /// to set.
    pub fn entry_mut(&mut self, i: usize) -> Option<(&mut Shaped<K, T>, &mut Option<String>)> {
        self.entries.get_mut(i).map(|e| (e, &mut self.eager_reason))
    }

    /// Sets why the last run was eager (`None`: it was not, or it was a warm-up run).
    pub fn set_eager_reason(&mut self, reason: Option<String>) {
        self.eager_reason = reason;
    }

    /// Drops every entry and its graph.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The first shape's graph, once there is one.
    pub fn graph(&self) -> Option<&StepGraph> {
        self.entries.first().and_then(|s| s.graph.as_ref())
    }

    /// Every graph captured (one a shape).
    pub fn graphs(&self) -> impl Iterator<Item = &StepGraph> {
        self.entries.iter().filter_map(|s| s.graph.as_ref())
    }

    /// Why the first shape's capture was refused, when it was.
    pub fn refused(&self) -> Option<&str> {
        self.entries.first().and_then(|s| s.refused.as_deref())
    }

    /// Why the last run was eager after its shape's warm-up (a refused capture, or a shape
    /// without an entry); `None` after a replay or a warm-up run.
    pub fn eager_reason(&self) -> Option<&str> {
        self.eager_reason.as_deref()
    }
}
