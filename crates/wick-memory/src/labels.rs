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

/// Bytes of label names the tree holds; a name that no longer fits stays on its parent's node,
/// as when the tree is full. Names longer than [`MAX_LABEL_LEN`] are cut at a char boundary.
const NAME_BYTES: usize = 1 << 20;

/// The longest label name kept, in bytes.
pub const MAX_LABEL_LEN: usize = 256;

/// Slots of the (parent, name) → node index: twice the nodes, so probes stay short.
const SLOTS: usize = 2 * MAX_LABEL_NODES;

/// The tree lives in fixed, zero-initialised statics rather than on the heap.
///
/// Why: the tree is bookkeeping of the recorder that sits inside the global allocator. Were it
/// heap-allocated, the first push of each new label would leave bytes behind in the process's
/// counted figures (a step's `after` one name above its `before`), it would allocate while the
/// allocator is recording, and every push would allocate a lookup key. Untouched pages of the
/// statics cost no memory; the tables hold 64 Ki nodes and 1 MiB of names.
struct Tree {
    /// (parent, start of name in `names`, name length) of node `i + 1`; `len` nodes are used.
    nodes: [(u32, u32, u32); MAX_LABEL_NODES],
    len: usize,
    /// Name bytes, `used` of them taken.
    names: [u8; NAME_BYTES],
    used: usize,
    /// Open-addressed index: node id, or 0 for an empty slot.
    slots: [u32; SLOTS],
}

static TREE: Mutex<Tree> = Mutex::new(Tree {
    nodes: [(0, 0, 0); MAX_LABEL_NODES],
    len: 0,
    names: [0; NAME_BYTES],
    used: 0,
    slots: [0; SLOTS],
});

thread_local! {
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

fn tree() -> std::sync::MutexGuard<'static, Tree> {
    // The tree is consistent after every statement that changes it; a panic elsewhere while it
    // was held leaves nothing half-done.
    TREE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Tree {
    fn name(&self, id: u32) -> Option<(u32, &str)> {
        let &(parent, start, len) = self.nodes.get((id as usize).checked_sub(1)?)?;
        let bytes = self.names.get(start as usize..start as usize + len as usize)?;
        // Names are copied in whole from `&str`s cut at char boundaries.
        Some((parent, std::str::from_utf8(bytes).ok()?))
    }

    /// The node for `name` under `parent`, made on first use; `None` when the tree is full.
    fn child(&mut self, parent: u32, name: &str) -> Option<u32> {
        let mut slot = hash(parent, name) % SLOTS;
        loop {
            let id = self.slots[slot];
            if id == 0 {
                break;
            }
            if self.name(id) == Some((parent, name)) {
                return Some(id);
            }
            slot = (slot + 1) % SLOTS;
        }
        let start = self.used;
        let end = start.checked_add(name.len()).filter(|&end| end <= NAME_BYTES)?;
        if self.len + 1 >= MAX_LABEL_NODES {
            return None;
        }
        self.names[start..end].copy_from_slice(name.as_bytes());
        self.used = end;
        // Both fit in u32: the arena and the node count are far below 2^32.
        self.nodes[self.len] = (parent, start as u32, name.len() as u32);
        self.len += 1;
        let id = self.len as u32;
        // At most half the slots are taken, so the probe above ended on an empty one.
        self.slots[slot] = id;
        Some(id)
    }
}

/// FNV-1a over the parent id and the name.
fn hash(parent: u32, name: &str) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parent.to_le_bytes().iter().chain(name.as_bytes()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h as usize
}

/// `name` cut to at most [`MAX_LABEL_LEN`] bytes at a char boundary.
fn clip(name: &str) -> &str {
    if name.len() <= MAX_LABEL_LEN {
        return name;
    }
    let mut end = MAX_LABEL_LEN;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
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
    tree().child(parent.0, clip(name)).map_or(parent, LabelId)
}

/// The stack a [`LabelId`] stands for, outermost first (empty for the root or an unknown id).
pub fn label_path(id: LabelId) -> Vec<String> {
    let tree = tree();
    let mut path = Vec::new();
    let mut node = id.0;
    // Parents are always made before their children (smaller ids), so this walk ends.
    while let Some((parent, name)) = tree.name(node) {
        path.push(name.to_string());
        if parent >= node {
            break;
        }
        node = parent;
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
    fn long_names_are_cut_at_a_char_boundary() {
        let long = "é".repeat(MAX_LABEL_LEN);
        let _guard = push_label(&long);
        let path = label_path(current_label());
        let name = path.last().unwrap();
        assert!(name.len() <= MAX_LABEL_LEN && name.len() >= MAX_LABEL_LEN - 1);
        assert!(long.starts_with(name.as_str()));
    }

    #[test]
    fn many_siblings_stay_distinct() {
        let parent = push_label("t-many");
        let ids: Vec<LabelId> = (0..2000)
            .map(|i| {
                let _g = push_label(&format!("child {i}"));
                current_label()
            })
            .collect();
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(label_path(*id), ["t-many".to_string(), format!("child {i}")]);
        }
        drop(parent);
    }

    #[test]
    fn unknown_ids_resolve_to_nothing() {
        assert!(label_path(LabelId(u32::MAX)).is_empty());
        assert!(label_path(LabelId::ROOT).is_empty());
    }
}
