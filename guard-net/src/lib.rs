//! guard's connection machinery, apart from what requests mean: listeners bounded by a
//! connection cap, idle connections parked outside hyper, one serving thread per CPU, the
//! lingering close after an early answer, and the channel a response body is fed through.

#![forbid(unsafe_code)]

pub mod client_body;
pub mod linger;
pub mod listen;
pub mod park;
pub mod workers;
