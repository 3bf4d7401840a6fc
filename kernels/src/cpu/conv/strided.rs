//! The input gradient of a strided convolution, computed directly ([`input_grad_strided`]).
//!
//! Why: a stride-1 convolution's input gradient is a convolution of its own (the output
//! gradient with the weights flipped and transposed), which [`super::conv_direct`] computes;
//! a stride-s one is not. Through the product it was `Wᵀ · dY` into an f32 column matrix k²
//! times the image's size, folded back onto the image (col2im): the three stride-2 layers of a
//! ResNet took about twice their multiply-adds' time in the backward pass (BENCHMARKS.md,
//! "Stride-2 input gradients direct").
//!
//! How: split the input positions into the s² phases `(s·i + a, s·j + b)`. Output position
//! `(y, x)` reaches input row `s·y + u − pad` through tap row u, so phase a's rows meet only the
//! taps with `u ≡ a + pad (mod s)`, each at output row `i + δ`, `δ = (a + pad − u) / s`. Each
//! phase is therefore a stride-1 convolution of the output gradient (padded by the largest |δ|)
//! with its own taps — ResNet's 3 × 3 stride-2 kernels split into phases of 1, 2, 2 and 4 taps,
//! 9 in all, so no multiply-add is wasted on the zeros a dilated output gradient would hold.
//! Every phase runs on the direct micro-kernel with its block's taps, into a buffer of phase
//! planes that one pass then interleaves into the input gradient.

use super::forward::{block_items, plane_tiles};
use super::{error, expect_len, ChannelsLast, ConvDims, Element, Weights, NB};
use crate::cpu::{par_ranges, KernelError, SharedMut};

/// True when [`input_grad_strided`] computes the input gradient of `d`: a stride above 1 that
/// divides the image's height and width into the output's (so every phase plane is the output
/// plane), and at most 16 taps (one register of them per channel when packing).
pub fn strided_applies(d: &ConvDims) -> bool {
    d.stride > 1
        && d.k * d.k <= 16
        && d.h.is_multiple_of(d.stride)
        && d.w.is_multiple_of(d.stride)
        && d.out_hw().is_ok_and(|hw| hw == (d.h / d.stride, d.w / d.stride))
}

/// Phase a's taps along one axis: `(u, δ)` for each tap row u with `u ≡ a + pad (mod s)`, and
/// its output offset `δ = (a + pad − u) / s`.
fn axis_taps(d: &ConvDims, a: usize) -> Vec<(usize, isize)> {
    let (s, top) = (d.stride as isize, (a + d.pad) as isize);
    (0..d.k).filter(|&u| (top - u as isize).rem_euclid(s) == 0).map(|u| (u, (top - u as isize) / s)).collect()
}

/// `dx` (n, c_in, h, w), every element written: the input gradient of the convolution `d`
/// (weights `w`, (c_out, c_in, k, k)) from its output gradient `dy` (n, c_out, oh, ow), each sum
/// stored once (bf16: rounded once; zero in phases without taps); parallel over (phase, block of
/// 32 input channels) and groups of images. An error unless [`strided_applies`] to `d`, the
/// lengths fit `d`, and the CPU has E's features.
pub fn input_grad_strided<E: Element>(dx: &mut [E], dy: &[E], w: &[E], d: ConvDims) -> Result<(), KernelError> {
    if !strided_applies(&d) {
        return Err(error(format!("no strided input gradient for {d:?}")));
    }
    if !E::available() {
        return Err(error(format!("this CPU lacks the AVX-512 features of {:?} convolutions", E::ZERO)));
    }
    let (s, (oh, ow)) = (d.stride, d.out_hw()?);
    let plane = oh * ow;
    expect_len(dx.len(), &[d.n, d.c_in, d.h, d.w], "input-gradient elements", &d)?;
    expect_len(dy.len(), &[d.n, d.c_out, plane], "output-gradient elements", &d)?;
    if d.n == 0 || d.c_in == 0 {
        return Ok(());
    }
    let axes: Vec<Vec<(usize, isize)>> = (0..s).map(|a| axis_taps(&d, a)).collect();
    let pad = axes.iter().flatten().map(|t| t.1.unsigned_abs()).max().unwrap_or(0);
    // The output gradient as the images of a stride-1 convolution (its channels: c_out).
    let back = ConvDims { n: d.n, c_in: d.c_out, h: oh, w: ow, c_out: d.c_in, k: 2 * pad + 1, stride: 1, pad };
    let images = ChannelsLast::new(dy, back)?;
    let (hp, wp) = back.padded();
    let cl = back.lanes::<E>();
    // Per phase (a, b): its weights (stored taps u·k + v) and the taps' offsets in lanes.
    let mut phases = Vec::with_capacity(s * s);
    for a in 0..s {
        for b in 0..s {
            let taps: Vec<((usize, isize), (usize, isize))> =
                axes[a].iter().flat_map(|&r| axes[b].iter().map(move |&c| (r, c))).collect();
            let order = taps.iter().map(|((u, _), (v, _))| u * d.k + v).collect();
            let at = |(dr, dc): (isize, isize)| ((dr + pad as isize) as usize * wp + (dc + pad as isize) as usize) * cl;
            let tap_at: Vec<usize> = taps.iter().map(|((_, dr), (_, dc))| at((*dr, *dc))).collect();
            let weights = Weights::taps(ConvDims { k: d.k, ..back }, w, true, order)?;
            phases.push((weights, tap_at));
        }
    }
    // Every tap of every window lies inside the padded images (δ + pad ≤ 2·pad).
    let last = (((d.n - 1) * hp + oh - 1) * wp + ow - 1) * cl;
    let reach = phases.iter().flat_map(|p| p.1.iter()).max().copied().unwrap_or(0);
    assert!(last + reach + cl <= images.data.len(), "input_grad_strided: a window outside the images");
    // The phases with taps (a 1×1 kernel's input gradient is zero outside phase (0, 0)), and
    // their planes: (n, live phases, c_in, plane).
    let live: Vec<usize> = (0..s * s).filter(|&f| !phases[f].1.is_empty()).collect();
    // At most dx's length (live.len() · plane ≤ s² · plane = h · w): no overflow.
    let mut planes = vec![E::ZERO; d.n * live.len() * d.c_in * plane];
    let blocks = d.c_in.div_ceil(NB);
    let out = SharedMut::new(&mut planes);
    let lanes = phases.iter().map(|p| p.0.block).max().unwrap_or(0);
    let pack = |unit: usize, packed: &mut [u32]| phases[live[unit / blocks]].0.pack(unit % blocks, packed);
    block_items((live.len() * blocks, d.n), lanes, pack, |unit, b, packed| {
        let (l, cb) = (unit / blocks, unit % blocks);
        let couts = NB.min(d.c_in - cb * NB);
        // SAFETY: image b's planes of live phase l, block cb are this item's only.
        let dst = unsafe { out.range(((b * live.len() + l) * d.c_in + cb * NB) * plane, couts * plane) };
        // SAFETY: the CPU has E's features (checked above); every window lies inside the images
        // (`last`, `reach`); `packed` holds the block's taps.
        unsafe { plane_tiles(&images, (b, plane, ow), (&phases[live[l]].1, cl), packed, dst, couts) };
    });
    // Interleaved: input row s·i + a, column s·j + b is phase (a, b)'s position (i, j); a phase
    // without taps reads a row of zeros.
    let zeros = vec![E::ZERO; ow];
    let sdx = SharedMut::new(dx);
    par_ranges(d.n * d.c_in, 16, |range| {
        for bc in range {
            let (b, c) = (bc / d.c_in, bc % d.c_in);
            // SAFETY: plane (b, c) of dx is this range's only.
            let dst = unsafe { sdx.range(bc * d.h * d.w, d.h * d.w) };
            let row = |f: usize, i: usize| match live.iter().position(|&g| g == f) {
                Some(l) => &planes[((b * live.len() + l) * d.c_in + c) * plane + i * ow..][..ow],
                None => &zeros[..],
            };
            for a in 0..s {
                for i in 0..oh {
                    let line = &mut dst[(s * i + a) * d.w..][..d.w];
                    if s == 2 {
                        // Both columns' phases in one pass (a pattern the compiler vectorises).
                        let (even, odd) = (row(2 * a, i), row(2 * a + 1, i));
                        for (pair, (e, o)) in line.chunks_exact_mut(2).zip(even.iter().zip(odd)) {
                            pair[0] = *e;
                            pair[1] = *o;
                        }
                        continue;
                    }
                    for col in 0..s {
                        for (j, v) in row(a * s + col, i).iter().enumerate() {
                            line[s * j + col] = *v;
                        }
                    }
                }
            }
        }
    });
    Ok(())
}
