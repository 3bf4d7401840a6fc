//! Label stacks: what the program is doing when it allocates (`step 3/forward/layer3.1.attn`).
//!
//! A thread's current label stack is one node of a process-wide tree, named by a [`LabelId`]:
//! pushing a label moves the thread to a child node, dropping the [`LabelGuard`] moves it back.
//! A recorder inside a global allocator reads the thread's current id (one thread-local load,
//! no lock, no allocation) and resolves it to the whole stack only when the history is read.
//!
//! Nodes are interned by (parent, name): the same stack pushed every step is the same node, so
//! the tree grows with the distinct stacks of a program, not with its steps.
//!
//! Labels belong to the thread that pushed them: work that rayon runs on its pool's threads is
//! allocated under those threads' own (empty) stacks. candle and wick's kernels allocate their
//! outputs on the calling thread, so tensors carry the caller's labels.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// A node of the label tree: the label stack a thread had when it allocated. [`LabelId::ROOT`]
/// is the empty stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct LabelId(pub u32);

impl LabelId {
    /// The empty stack.
    pub const ROOT: LabelId = LabelId(0);
}

/// The most nodes the tree holds; pushes beyond it stay on their parent's node (a program whose
/// labels carry counters, e.g. a step number per step, would otherwise grow it without bound).
pub const MAX_LABEL_NODES: usize = 1 << 16;

struct Tree {
    /// (parent, name) of every node but the root; node `i + 1` is `nodes[i]`.
    nodes: Vec<(u32, Box<str>)>,
    index: BTreeMap<(u32, Box<str>), u32>,
}

static TREE: Mutex<Tree> = Mutex::new(Tree { nodes: Vec::new(), index: BTreeMap::new() });

thread_local! {
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

fn tree() -> std::sync::MutexGuard<'static, Tree> {
    // The tree is consistent after every statement that changes it; a panic elsewhere while it
    // was held leaves nothing half-done.
    TREE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The calling thread's current label stack ([`LabelId::ROOT`] when nothing was pushed, or
/// while the thread is being torn down).
pub fn current_label() -> LabelId {
    LabelId(CURRENT.try_with(Cell::get).unwrap_or(0))
}

/// Pushes `name` onto the calling thread's label stack until the guard is dropped.
///
/// ```
/// let _step = wick_memory::push_label("step");
/// {
///     let _forward = wick_memory::push_label("forward");
///     assert_eq!(wick_memory::label_path(wick_memory::current_label()), ["step", "forward"]);
/// }
/// assert_eq!(wick_memory::label_path(wick_memory::current_label()), ["step"]);
/// ```
pub fn push_label(name: &str) -> LabelGuard {
    let previous = current_label();
    let child = child_of(previous, name);
    let _ = CURRENT.try_with(|c| c.set(child.0));
    LabelGuard { previous, _not_send: std::marker::PhantomData }
}

/// The node for `name` under `parent` (made on first use); `parent` itself when the tree is full.
fn child_of(parent: LabelId, name: &str) -> LabelId {
    let mut tree = tree();
    let key = (parent.0, Box::<str>::from(name));
    if let Some(&id) = tree.index.get(&key) {
        return LabelId(id);
    }
    if tree.nodes.len() + 1 >= MAX_LABEL_NODES {
        return parent;
    }
    tree.nodes.push(key.clone());
    let id = tree.nodes.len() as u32;
    tree.index.insert(key, id);
    LabelId(id)
}

/// The stack a [`LabelId`] stands for, outermost first (empty for the root or an unknown id).
pub fn label_path(id: LabelId) -> Vec<String> {
    let tree = tree();
    let mut path = Vec::new();
    let mut node = id.0;
    while node != 0 {
        let Some((parent, name)) = tree.nodes.get(node as usize - 1) else { break };
        path.push(name.to_string());
        // Parents are always made before their children, so this walk ends.
        node = *parent;
    }
    path.reverse();
    path
}

/// Restores the thread's previous label stack when dropped (see [`push_label`]). Not `Send`: it
/// restores the thread it was made on.
#[must_use = "the label is popped when the guard is dropped"]
pub struct LabelGuard {
    previous: LabelId,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for LabelGuard {
    fn drop(&mut self) {
        let _ = CURRENT.try_with(|c| c.set(self.previous.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_nest_intern_and_unwind() {
        let outer = push_label("t-step");
        let a = current_label();
        {
            let _inner = push_label("t-forward");
            assert_eq!(label_path(current_label()), ["t-step", "t-forward"]);
        }
        assert_eq!(current_label(), a);
        drop(outer);
        assert_eq!(current_label(), LabelId::ROOT);
        // The same stack again is the same node.
        let _again = push_label("t-step");
        assert_eq!(current_label(), a);
        // Another thread starts empty.
        std::thread::spawn(|| assert_eq!(current_label(), LabelId::ROOT)).join().unwrap();
    }

    #[test]
    fn unknown_ids_resolve_to_nothing() {
        assert!(label_path(LabelId(u32::MAX)).is_empty());
        assert!(label_path(LabelId::ROOT).is_empty());
    }
}
