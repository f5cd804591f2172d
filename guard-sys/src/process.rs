//! Child processes started in a known state.

use std::process::Command;

use nix::sys::{signal::SigSet, signal::Signal};

/// Makes `command`'s child start with every signal unblocked (a child inherits the blocked
/// mask) and die with the process that starts it.
pub fn unblocked_and_tied(command: &mut Command) {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: between fork and exec the closure calls only async-signal-safe functions
    // (pthread_sigmask and prctl) and allocates nothing.
    unsafe {
        command.pre_exec(|| {
            SigSet::empty().thread_set_mask()?;
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            Ok(())
        });
    }
}
