//! Labels from `tracing` spans: a model wick did not build is labelled by the spans its own
//! layers enter.
//!
//! candle-transformers' models enter a `tracing` span in every layer's `forward` (`model`,
//! `encoder`, `layer`, `attn`, `self-attn`, `linear`, …). [`SpanLabels`] is a
//! `tracing-subscriber` layer that pushes each entered span's name onto the thread's label stack
//! ([`wick_memory::push_label`]) and pops it on exit, so what a layer allocates is recorded
//! under it in the memory history ([`crate::Engine::memory_history`]) and the held-at-peak table
//! names the model's layers — with no change to the model's code.
//!
//! Names: a span whose call site has more than one live span (every layer of an encoder is made at
//! the same line) is numbered by the order in which it was entered among its siblings of that
//! call site under the same parent entry: `model/encoder/layer.3/attn.0/self-attn.0/linear.2` is
//! the third `linear` entered by the self-attention of the fourth layer. Spans entered with none
//! around them (LLaMA's blocks: `block.2/attn.0/…`) are numbered among the live ones of their
//! call site. The numbers come from the run, not from the order the spans were made, so a model
//! dropped and loaded again is numbered the same.
//!
//! Install it once, before the model is built (a span made while no subscriber listens is off
//! for good): [`install`] makes it the process's only subscriber; a program that has its own
//! adds `SpanLabels::default()` to its registry as one more layer. Labels belong to the thread
//! that entered the span, as every label does.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Mutex;

use tracing::callsite::Identifier;
use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use wick_memory::{push_label, LabelGuard};

/// The `tracing-subscriber` layer that labels allocations by entered spans (see the
/// [module](self)).
#[derive(Default)]
pub struct SpanLabels {
    /// Live spans per call site, to know which names need a number.
    live: Mutex<HashMap<Identifier, usize>>,
    /// Spans entered with no span around them (LLaMA's blocks), in order of first entry, until
    /// they are closed: a model dropped and built again is numbered from 0 again.
    roots: Mutex<Vec<(Identifier, Id)>>,
}

/// One entered span on this thread: its label is pushed until it is exited.
struct Frame {
    id: Id,
    /// The spans entered under this entry, in order, with their call sites (the number of a
    /// child is its place among those of its call site).
    children: Vec<(Identifier, Id)>,
    _label: LabelGuard,
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

impl SpanLabels {
    fn live(&self, callsite: &Identifier) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).get(callsite).copied().unwrap_or(0)
    }

    /// The number of an outermost span: its place among the live outermost spans of its call
    /// site, in order of first entry.
    fn root_number(&self, callsite: &Identifier, id: &Id) -> usize {
        let mut roots = self.roots.lock().unwrap_or_else(|p| p.into_inner());
        number_among(&mut roots, callsite, id)
    }
}

/// The place of `id` among the spans of `callsite` in `seen` (appended when new).
fn number_among(seen: &mut Vec<(Identifier, Id)>, callsite: &Identifier, id: &Id) -> usize {
    let mut count = 0;
    for (c, child) in seen.iter() {
        if c == callsite {
            if child == id {
                return count;
            }
            count += 1;
        }
    }
    seen.push((callsite.clone(), id.clone()));
    count
}

impl<S> Layer<S> for SpanLabels
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        *live.entry(attrs.metadata().callsite()).or_insert(0) += 1;
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let metadata = span.metadata();
        let callsite = metadata.callsite();
        let numbered = self.live(&callsite) > 1;
        let _ = FRAMES.try_with(|frames| {
            let Ok(mut frames) = frames.try_borrow_mut() else { return };
            let number = match frames.last_mut() {
                Some(parent) => number_among(&mut parent.children, &callsite, id),
                None => self.root_number(&callsite, id),
            };
            let label = if numbered {
                push_label(&format!("{}.{number}", metadata.name()))
            } else {
                push_label(metadata.name())
            };
            frames.push(Frame { id: id.clone(), children: Vec::new(), _label: label });
        });
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = live.get_mut(&span.metadata().callsite()) {
                *n = n.saturating_sub(1);
            }
        }
        self.roots.lock().unwrap_or_else(|p| p.into_inner()).retain(|(_, root)| *root != id);
    }

    fn on_exit(&self, id: &Id, _ctx: Context<'_, S>) {
        let _ = FRAMES.try_with(|frames| {
            let Ok(mut frames) = frames.try_borrow_mut() else { return };
            // Spans are exited in the reverse order of entry; one exited out of order takes the
            // ones above it with it, each restoring the stack it found.
            if let Some(at) = frames.iter().rposition(|f| f.id == *id) {
                while frames.len() > at {
                    frames.pop();
                }
            }
        });
    }
}

/// Makes a registry with [`SpanLabels`] the process's `tracing` subscriber. Call it before the
/// model is built. `Err` when the process already has a subscriber (add `SpanLabels::default()`
/// to that one instead).
pub fn install() -> Result<(), wick_memory::MemoryError> {
    use tracing_subscriber::layer::SubscriberExt;
    tracing_subscriber::registry().with(SpanLabels::default()).try_init().map_err(|e| {
        wick_memory::MemoryError::Unsupported(format!(
            "span labels: the process already has a tracing subscriber ({e}); add \
             `wick::span_labels::SpanLabels::default()` to it as a layer"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;
    use wick_memory::{current_label, label_path};

    /// The labels seen inside a model-like nest of spans: a model with two layers made at one
    /// call site, each with a `linear` made at one call site and entered twice per layer.
    #[test]
    fn entered_spans_are_the_label_stack_and_repeated_ones_are_numbered() {
        let subscriber = tracing_subscriber::registry().with(SpanLabels::default());
        tracing::subscriber::with_default(subscriber, || {
            let linear = || tracing::span!(tracing::Level::TRACE, "linear");
            let layer = || tracing::span!(tracing::Level::TRACE, "layer");
            let model = tracing::span!(tracing::Level::TRACE, "model");
            let layers = [(layer(), [linear(), linear()]), (layer(), [linear(), linear()])];
            let mut seen = Vec::new();
            for _pass in 0..2 {
                let _m = model.enter();
                for (layer, linears) in &layers {
                    let _l = layer.enter();
                    for l in linears {
                        let _e = l.enter();
                        seen.push(label_path(current_label()).join("/"));
                    }
                    // The same span entered again keeps its number.
                    let _again = linears[0].enter();
                    seen.push(label_path(current_label()).join("/"));
                }
                assert_eq!(label_path(current_label()), ["model"]);
            }
            assert!(label_path(current_label()).is_empty(), "every label popped");
            let one_pass = [
                "model/layer.0/linear.0",
                "model/layer.0/linear.1",
                "model/layer.0/linear.0",
                "model/layer.1/linear.0",
                "model/layer.1/linear.1",
                "model/layer.1/linear.0",
            ];
            assert_eq!(seen, [one_pass, one_pass].concat());
        });
    }

    /// LLaMA's blocks are entered with no span around them: numbered among the live ones, and
    /// from 0 again once the model is dropped and built again.
    #[test]
    fn outermost_spans_are_numbered_among_the_live_ones() {
        let subscriber = tracing_subscriber::registry().with(SpanLabels::default());
        tracing::subscriber::with_default(subscriber, || {
            let block = || tracing::span!(tracing::Level::TRACE, "block");
            let labels = |blocks: &[tracing::Span]| -> Vec<String> {
                blocks
                    .iter()
                    .map(|b| {
                        let _e = b.enter();
                        label_path(current_label()).join("/")
                    })
                    .collect()
            };
            let model = [block(), block(), block()];
            assert_eq!(labels(&model), ["block.0", "block.1", "block.2"]);
            assert_eq!(labels(&model[1..]), ["block.1", "block.2"]);
            drop(model);
            let again = [block(), block()];
            assert_eq!(labels(&again), ["block.0", "block.1"]);
            drop(again);
            let alone = [block()];
            assert_eq!(labels(&alone), ["block"], "a call site with one live span is not numbered");
        });
    }

    #[test]
    fn a_span_exited_out_of_order_takes_the_ones_above_it() {
        let subscriber = tracing_subscriber::registry().with(SpanLabels::default());
        tracing::subscriber::with_default(subscriber, || {
            let outer = tracing::span!(tracing::Level::TRACE, "outer");
            let inner = tracing::span!(tracing::Level::TRACE, "inner");
            let o = outer.enter();
            let i = inner.enter();
            assert_eq!(label_path(current_label()), ["outer", "inner"]);
            drop(o);
            assert!(label_path(current_label()).is_empty());
            drop(i);
            assert!(label_path(current_label()).is_empty());
        });
    }
}
