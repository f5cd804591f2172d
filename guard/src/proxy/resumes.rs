//! How each preemptible class's requests go on after a preemption, as last seen: exactly from
//! token ids, from text, from scratch, or not stopped at all (`/status`, `guard status`).

use std::{collections::BTreeMap, sync::Mutex};

use crate::upstream::resume::ResumeKind;

/// One entry per class that has had a preemptible request (class names come from the config).
#[derive(Debug, Default)]
pub struct ResumeKinds {
    seen: Mutex<BTreeMap<String, ResumeKind>>,
}

impl ResumeKinds {
    /// A request of `class` was planned to go on this way.
    pub fn saw(&self, class: &str, kind: ResumeKind) {
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match seen.get_mut(class) {
            Some(last) => *last = kind,
            None => {
                seen.insert(class.to_owned(), kind);
            }
        }
    }

    pub fn snapshot(&self) -> BTreeMap<String, ResumeKind> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}
