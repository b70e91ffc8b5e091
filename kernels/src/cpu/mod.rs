//! The CPU reference implementation of every op: plain functions over slices.
//!
//! Storage is in the element type `T`; arithmetic and accumulation are in f32. Shapes are
//! checked by the caller (the tensor layer); these functions assume consistent lengths and
//! document the layout they expect.

pub mod activation;
pub mod conv;
pub mod elementwise;
pub mod embedding;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod optim;
pub mod pool;
pub mod random;
pub mod reduce;
pub mod softmax;
