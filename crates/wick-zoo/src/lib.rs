//! # wick-zoo
//!
//! Models that train: built from differentiable building blocks ([`ops`]) so no gradient is lost
//! silently, with real weights where a package ships them.

pub mod amp;
mod autocast;
pub mod bert;
pub mod checkpoint;
pub mod cnn;
pub mod error;
pub mod estimate;
pub mod fused;
pub mod kernels;
pub mod llama;
pub mod mobilenet;
pub mod model;
pub mod ops;
pub mod params;
pub mod pth;
pub mod resnet;
pub mod train;
pub mod vit;
pub mod weights;

pub use error::ZooError;
pub use kernels::{grad_enabled, no_grad};
pub use model::{Labelled, Model};
