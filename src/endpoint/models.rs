//! The models a node says it serves: the ids of its own `GET /v1/models`, read alongside its
//! heartbeats (see `health`), for tongs' `/v1/models`. What a node says is only listed, never
//! routed on: which pool serves a model is the configuration's say.

use std::sync::{Arc, Mutex};

/// Most model ids kept per node, and the longest one: a node's answer is outside input.
pub const MAX_MODELS: usize = 1024;
pub const MAX_MODEL_ID: usize = 256;

/// The model ids a node's own `/v1/models` gave when last asked.
#[derive(Debug, Default)]
pub struct ServedModels(Mutex<Arc<[String]>>);

impl ServedModels {
    /// Keeps what the node said it serves last: the first [`MAX_MODELS`] ids that are no longer than
    /// [`MAX_MODEL_ID`] and printable, each once.
    pub fn set(&self, ids: impl IntoIterator<Item = String>) {
        let mut kept: Vec<String> = Vec::new();
        for id in ids {
            let fits =
                !id.is_empty() && id.len() <= MAX_MODEL_ID && id.chars().all(|c| !c.is_control());
            if fits && !kept.contains(&id) {
                kept.push(id);
                if kept.len() == MAX_MODELS {
                    break;
                }
            }
        }
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = kept.into();
    }

    /// What the node said it serves when last asked (empty before, or when it would not say).
    pub fn get(&self) -> Arc<[String]> {
        Arc::clone(
            &self
                .0
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodes_list_is_kept_bounded_printable_and_once_each() {
        let models = ServedModels::default();
        assert!(models.get().is_empty());
        models.set(
            [
                "beta-1",
                "beta-1",
                "",
                "bad\nid",
                &"x".repeat(MAX_MODEL_ID + 1),
                "beta-2",
            ]
            .map(str::to_owned),
        );
        assert_eq!(&*models.get(), ["beta-1", "beta-2"]);
        models.set((0..5000).map(|i| format!("m{i}")));
        assert_eq!(models.get().len(), MAX_MODELS);
    }
}
