//! guard: a host agent in front of a local inference server. It queues requests per class,
//! rejects early what cannot be served in time, reaps work whose client has gone, and makes
//! quiet failures visible as metrics.

#![forbid(unsafe_code)]

pub mod access;
pub mod classify;
pub mod cluster;
pub mod config;
pub mod daemon;
mod error_chain;
pub mod jsonscan;
pub mod memory;
pub mod metrics;
pub mod privileges;
pub mod procs;
pub mod proxy;
pub mod quantile;
pub mod queue;
pub mod quote;
pub mod reap;
pub mod route;
pub mod secret;
pub mod status;
pub mod throttle;
pub mod upstream;
pub mod watch;

pub use error_chain::error_chain;
