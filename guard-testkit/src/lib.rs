//! What guard's own tests and its integration tests share, with no dependency on guard: a
//! scripted upstream that counts what guard has in flight, waiting for a state by polling,
//! and a client that trickles its bytes.

pub mod trickle;
pub mod upstream;
pub mod wait;

pub use trickle::trickle;
pub use upstream::{Exchange, Mode, Pipe, Script, Upstream};
pub use wait::{Polling, STATE_BOUND, try_until_with, until, until_with};
