//! How a convolution's work is split into items and between threads.
//!
//! An item is either a group of whole images (layers with few positions per image) or a chunk of
//! one image's output rows, sized so that its column matrix stays in a core's L2 cache from the
//! moment im2col writes it to the moment the product packs it. Items run `workers` at a time,
//! each worker on its own thread with single-threaded products; a lone worker runs its products
//! in parallel instead.

use std::ops::Range;
use std::sync::Mutex;

use candle_core::Result;

use super::err;
use super::unfold::Geometry;

/// Columns per gemm below which images are grouped: deep layers have few positions per image
/// (ResNet's last stage at 112² has 16), and gemm runs a 16-column product far below its
/// speed. On ResNet-18 (112², batch 16) groups of up to 64 columns beat one image at a time,
/// and groups of 256 or 1024 columns were slower than either (their column matrices no longer
/// fit the caches): BENCHMARKS.md, "Kernel design measurements".
const GROUP_COLUMNS: usize = 64;

/// Bytes of f32 column matrix per item that a whole image's columns are cut into. One matrix per
/// image went through memory twice (written by im2col, read back by the product's packing): at
/// 224² ResNet's first stage unfolds 7.2 MB per image and its stem 7.4 MB, far past a core's L2
/// cache (1 MB here). Chunks of whole output rows of about this size are unfolded and multiplied
/// one after the other, and give a batch of one image work for every thread. 128 KB to 1 MB
/// were tried; 384–768 KB were the fastest at batch 8, within the machine's noise of each
/// other (BENCHMARKS.md, "Convolutional networks at every size (issue 30)"). bf16 columns are
/// cut too, into chunks of twice the columns, since their weights are packed once per call
/// rather than once per chunk.
pub(super) const CHUNK_BYTES: usize = 768 << 10;

/// The split of a convolution's work (see the module documentation).
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    /// Images per group (1: chunks of one image).
    pub(super) size: usize,
    /// Groups of images.
    pub(super) groups: usize,
    /// Output rows per chunk (all of them when an image is one chunk).
    pub(super) rows: usize,
    /// Chunks per image (1 when images are grouped).
    pub(super) chunks: usize,
    /// Items run at a time.
    pub(super) workers: usize,
    /// True when one worker takes all of an image's chunks (chunks whose results overlap, as
    /// col2im's input rows do, must not run at the same time).
    pub(super) whole_images: bool,
}

impl Plan {
    /// The plan for `g`, with columns of `elem` bytes each element, cutting an image's column
    /// matrix into chunks of about `chunk_bytes` (never for a 1×1 stride-1 convolution, whose
    /// columns are the image itself).
    pub(super) fn new(g: &Geometry, elem: usize, chunk_bytes: usize, whole_images: bool) -> Self {
        let size = GROUP_COLUMNS.div_ceil(g.cols().max(1)).clamp(1, g.n.max(1));
        let groups = g.n.div_ceil(size);
        let column_bytes = g.rows().saturating_mul(elem).max(1);
        let threads = rayon::current_num_threads().max(1);
        let (rows, chunks) = if size == 1 && !g.pointwise() && g.oh > 1 {
            let columns = (chunk_bytes / column_bytes).max(GROUP_COLUMNS);
            let rows = (columns / g.ow.max(1)).clamp(1, g.oh);
            let mut chunks = g.oh.div_ceil(rows);
            // Fewer images than threads: a whole number of chunks per thread, of even heights
            // (at batch 1, five bf16 chunks of ResNet's first stage ran as three against two,
            // and a 14-row plane as 12 rows against 2).
            if groups < threads && chunks > 1 {
                chunks = chunks.next_multiple_of(threads).min(g.oh);
            }
            let rows = g.oh.div_ceil(chunks);
            (rows, g.oh.div_ceil(rows))
        } else {
            (g.oh, 1)
        };
        let items = if whole_images { groups } else { groups * chunks };
        Plan { size, groups, rows, chunks, workers: items.min(threads).max(1), whole_images }
    }

    /// Columns of the largest item's matrix (images × rows × OW).
    pub(super) fn width(&self, g: &Geometry) -> usize {
        self.size * self.rows * g.ow
    }

    /// Runs `f(worker, item, parallel_gemm)` for every item, `workers` at a time (a worker's
    /// items are consecutive: an image's chunks in order); the first error is returned.
    pub(super) fn run(&self, g: &Geometry, f: impl Fn(usize, Item, bool) -> Result<()> + Send + Sync) -> Result<()> {
        let failure = Mutex::new(None);
        let parallel = self.workers == 1;
        let (items, per_item) =
            if self.whole_images { (self.groups, self.chunks) } else { (self.groups * self.chunks, 1) };
        let per = items.div_ceil(self.workers);
        use rayon::prelude::*;
        (0..self.workers).into_par_iter().for_each(|w| {
            for item in w * per..((w + 1) * per).min(items) {
                let (group, chunks) = if self.whole_images {
                    (item, 0..per_item)
                } else {
                    (item / self.chunks, item % self.chunks..item % self.chunks + 1)
                };
                for chunk in chunks {
                    let out_rows = (chunk * self.rows).min(g.oh)..((chunk + 1) * self.rows).min(g.oh);
                    let images = group * self.size..((group + 1) * self.size).min(g.n);
                    let item = Item { at: out_rows.start * g.ow, len: out_rows.len() * g.ow, images, out_rows };
                    if let Err(e) = f(w, item, parallel) {
                        *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        return;
                    }
                }
            }
        });
        match failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// One item of work: output rows `out_rows` of the images `images`, that is the `len`
/// positions from position `at` of each.
pub(super) struct Item {
    pub(super) images: Range<usize>,
    pub(super) out_rows: Range<usize>,
    pub(super) at: usize,
    pub(super) len: usize,
}

impl Item {
    /// Columns of the item's matrices (images × positions).
    pub(super) fn width(&self) -> usize {
        self.images.len() * self.len
    }
}

/// Per-worker scratch buffers, taken by one worker at a time.
pub(super) struct Scratch<T>(pub(super) Vec<Mutex<Vec<T>>>);

impl<T: Copy + Default> Scratch<T> {
    pub(super) fn new(workers: usize, len: usize) -> Self {
        Scratch((0..workers).map(|_| Mutex::new(vec![T::default(); len])).collect())
    }

    pub(super) fn get(&self, worker: usize) -> Result<std::sync::MutexGuard<'_, Vec<T>>> {
        let slot = self.0.get(worker).ok_or_else(|| err(format!("conv2d: no scratch for worker {worker}")))?;
        Ok(slot.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(n: usize, c_in: usize, side: usize, k: usize, stride: usize) -> Geometry {
        let pad = k / 2;
        let out = (side + 2 * pad - k) / stride + 1;
        Geometry { n, c_in, h: side, w: side, c_out: 8, k, stride, pad, oh: out, ow: out }
    }

    /// Chunks cover every output row once, in heights as even as whole rows allow (no other
    /// count of chunks has a lower tallest chunk); with fewer images than threads, each thread
    /// gets a whole number of chunks (or every row is a chunk). The plan before this test cut a
    /// 14-row plane into 12 + 2 rows and a 56-row one into five chunks for two threads.
    #[test]
    fn chunks_cover_the_rows_and_share_them_between_threads() {
        let threads = rayon::current_num_threads().max(1);
        for (g, elem, bytes) in [
            (geometry(1, 64, 56, 3, 1), 2, CHUNK_BYTES),
            (geometry(1, 64, 56, 3, 1), 4, CHUNK_BYTES),
            (geometry(1, 256, 14, 3, 1), 2, CHUNK_BYTES),
            (geometry(1, 3, 224, 7, 2), 2, CHUNK_BYTES),
            (geometry(2, 64, 56, 3, 1), 4, 1 << 14),
            (geometry(8, 64, 56, 3, 1), 4, CHUNK_BYTES),
            (geometry(1, 8, 9, 3, 1), 4, 1),
        ] {
            let plan = Plan::new(&g, elem, bytes, false);
            let at = format!("{g:?} {elem} bytes {bytes}: {plan:?}");
            assert!(plan.rows * plan.chunks >= g.oh && plan.rows * (plan.chunks - 1) < g.oh, "{at}");
            assert_eq!(plan.rows, g.oh.div_ceil(plan.chunks), "{at}");
            if plan.size == 1 && g.n < threads && plan.chunks > 1 {
                assert!(plan.chunks.is_multiple_of(threads) || plan.chunks == g.oh, "{at}");
            }
        }
    }
}
