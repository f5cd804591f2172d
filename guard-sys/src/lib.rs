//! The few calls guard makes that the compiler cannot check: each `unsafe` block is a small
//! wrapper with the reason it holds. Every other crate of guard forbids `unsafe`.

pub mod alloc;
pub mod cache;
pub mod fd;
pub mod process;
