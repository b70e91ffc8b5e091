//! The catalogue of techniques (ids fixed by the project's TECHNIQUES.md). Each technique is
//! written once, in its experiment's descriptor; this module lists them.

use crate::experiments::EXPERIMENTS;

/// One memory-saving technique and the claim found for it in the source material.
#[derive(Clone, Copy, Debug)]
pub struct Technique {
    /// Fixed experiment id: results files, reports and checks use it.
    pub id: &'static str,
    /// Short human name.
    pub name: &'static str,
    /// The claim as found in the source material.
    pub claim: &'static str,
    /// The source post(s) the claim comes from: file names in `../shared/sources/`.
    pub source: &'static str,
}

/// Every technique vram reproduces, in the order of the report.
pub fn techniques() -> impl Iterator<Item = &'static Technique> {
    EXPERIMENTS.iter().map(|e| e.technique())
}

/// Looks a technique up by its id.
pub fn technique(id: &str) -> Option<&'static Technique> {
    techniques().find(|t| t.id == id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The ids of the catalogue's table in the project's TECHNIQUES.md (in `../shared/` next
    /// to the checkout, or `shared/` in it), in order; `None` where neither is there.
    fn catalogue_ids() -> Option<Vec<String>> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text = ["../shared/TECHNIQUES.md", "shared/TECHNIQUES.md"]
            .iter()
            .find_map(|p| std::fs::read_to_string(root.join(p)).ok())?;
        let rows = text.lines().filter_map(|l| l.strip_prefix("| `"));
        Some(rows.filter_map(|r| r.split_once('`')).map(|(id, _)| id.to_string()).collect())
    }

    #[test]
    fn ids_are_unique_and_every_experiment_has_its_technique() {
        let ids: Vec<&str> = techniques().map(|t| t.id).collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), ids.len(), "duplicate ids in {ids:?}");
        for id in &ids {
            let found = crate::experiments::find(id).map(|e| e.technique().id);
            assert_eq!(found, Some(*id), "the experiment registered for `{id}`");
        }
        assert_eq!(technique("checkpointing").map(|t| t.name), Some("activation checkpointing"));
        // The registry is the catalogue: the same ids, in its order.
        match catalogue_ids() {
            Some(catalogue) => assert_eq!(ids, catalogue, "EXPERIMENTS against TECHNIQUES.md"),
            None => eprintln!("skipped: no ../shared/TECHNIQUES.md to compare the ids with"),
        }
    }
}
