//! # wick-zoo
//!
//! Models that train: built from differentiable building blocks ([`ops`]) so no gradient is lost
//! silently, with real weights where a package ships them.

pub mod bert;
pub mod error;
pub mod llama;
pub mod ops;
pub mod params;
pub mod weights;

pub use error::ZooError;
