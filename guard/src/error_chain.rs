//! An error and its causes on one line, the way guard shows every error: each message says
//! only its own part, and the chain joins them.

use std::error::Error;

/// `err`'s message and each cause's, joined with ": ". An OS error reads as the system's words
/// in lowercase, without "(os error N)". A cause the link before it already said is said once:
/// hyper and hyper-util wrap I/O errors in errors that read the same, and some libraries'
/// messages end with their source's (aya's, NVML's).
pub fn error_chain(err: &(dyn Error + 'static)) -> String {
    let mut text = link(err);
    let mut previous = (err.to_string(), text.clone());
    let mut source = err.source();
    while let Some(cause) = source {
        let (own, said) = (cause.to_string(), link(cause));
        let repeated =
            said == previous.1 || own == previous.0 || previous.0.ends_with(&format!(": {own}"));
        if !repeated {
            text.push_str(": ");
            text.push_str(&said);
        }
        previous = (own, said);
        source = cause.source();
    }
    text
}

/// One link's own message.
fn link(err: &(dyn Error + 'static)) -> String {
    if let Some(io) = err.downcast_ref::<std::io::Error>() {
        if let Some(code) = io.raw_os_error() {
            return os_error(io, code);
        }
        // An I/O error made around another error reads as that error.
        if let Some(inner) = io.get_ref() {
            return link(inner);
        }
    }
    err.to_string()
}

/// "Connection refused (os error 111)" as "connection refused". The system's words are kept
/// rather than `io::ErrorKind`'s: many errors (EMFILE, say) have no kind of their own, and
/// would read as "uncategorized error".
fn os_error(io: &std::io::Error, code: i32) -> String {
    let text = io.to_string();
    let words = text
        .strip_suffix(&format!(" (os error {code})"))
        .unwrap_or(&text);
    let mut chars = words.chars();
    match (chars.next(), chars.next()) {
        // A capital that starts a sentence, not an acronym.
        (Some(first), Some(second)) if first.is_ascii_uppercase() && second.is_lowercase() => {
            format!("{}{}", first.to_ascii_lowercase(), &words[1..])
        }
        _ => words.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot connect to {authority}")]
    struct Connect {
        authority: &'static str,
        #[source]
        source: io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("upstream unreachable")]
    struct Outer(#[source] Connect);

    fn refused() -> io::Error {
        io::Error::from_raw_os_error(libc::ECONNREFUSED)
    }

    #[test]
    fn an_os_error_reads_as_the_system_words_in_lowercase() {
        let err = Outer(Connect {
            authority: "127.0.0.1:54681",
            source: refused(),
        });
        assert_eq!(
            error_chain(&err),
            "upstream unreachable: cannot connect to 127.0.0.1:54681: connection refused"
        );
        let enoent = io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(error_chain(&enoent), "no such file or directory");
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(error_chain(&emfile), "too many open files");
    }

    #[test]
    fn a_wrapped_io_error_is_said_once() {
        // What hyper-util does: an io::Error made around the OS error, under a message that
        // repeats it.
        #[derive(Debug, thiserror::Error)]
        #[error("connection refused")]
        struct Repeats(#[source] io::Error);
        let wrapped = io::Error::new(io::ErrorKind::ConnectionRefused, refused());
        let err = Connect {
            authority: "127.0.0.1:1",
            source: io::Error::other(Repeats(wrapped)),
        };
        assert_eq!(
            error_chain(&err),
            "cannot connect to 127.0.0.1:1: connection refused"
        );
    }

    #[test]
    fn a_message_that_ends_with_its_source_is_not_followed_by_it_again() {
        #[derive(Debug, thiserror::Error)]
        #[error("a libloading error occurred: {0}")]
        struct Library(#[source] io::Error);
        let err = Library(io::Error::other(
            "libnvidia-ml.so.1: cannot open shared object file",
        ));
        assert_eq!(
            error_chain(&err),
            "a libloading error occurred: libnvidia-ml.so.1: cannot open shared object file"
        );
    }

    #[test]
    fn other_messages_are_kept_as_they_are() {
        let err = io::Error::other("EOF while reading the head");
        assert_eq!(error_chain(&err), "EOF while reading the head");
        let err = Outer(Connect {
            authority: "upstream",
            source: io::Error::new(io::ErrorKind::InvalidData, "Bad frame"),
        });
        assert_eq!(
            error_chain(&err),
            "upstream unreachable: cannot connect to upstream: Bad frame"
        );
    }
}
