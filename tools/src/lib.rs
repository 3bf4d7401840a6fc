//! # wick-tools
//!
//! The harnesses around wick's libraries, kept out of their public API (as candle keeps its
//! examples and kernels apart): the AMP-vs-f32 trial ([`trial`]) that the AMP test, the
//! `amp-trial` binary and the PyTorch comparison share, and the GPU checks that
//! `scripts/gpu-check.sh` runs (`gpu-check`, `amp-gpu-check`, with the `cuda` feature).

pub mod trial;
