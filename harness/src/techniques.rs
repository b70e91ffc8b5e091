//! The catalogue of techniques (ids fixed by the project's TECHNIQUES.md).

/// One memory-saving technique and the claim found for it in the source material.
#[derive(Clone, Copy, Debug)]
pub struct Technique {
    /// Fixed experiment id: results files, reports and checks use it.
    pub id: &'static str,
    /// Short human name.
    pub name: &'static str,
    /// The claim as found in the source material.
    pub claim: &'static str,
}

/// Every technique vram reproduces, in the order of the report.
pub const TECHNIQUES: &[Technique] = &[
    Technique {
        id: "batch-size",
        name: "smaller batch size",
        claim: "32 -> 8 often relieves memory pressure noticeably; memory falls with batch size",
    },
    Technique {
        id: "max-batch-search",
        name: "largest batch that fits",
        claim: "the search (start at 2, add 2 until OOM) works without restarting the process",
    },
    Technique {
        id: "grad-accumulation",
        name: "gradient accumulation",
        claim: "same effective batch, lower memory",
    },
    Technique {
        id: "mixed-precision",
        name: "mixed precision (fp16 + loss scaling, bf16)",
        claim: "about 50% less memory; 30%+ less memory and 20%+ faster",
    },
    Technique {
        id: "no-grad-inference",
        name: "evaluation without saved activations",
        claim: "saves memory in evaluation",
    },
    Technique {
        id: "empty-cache",
        name: "empty_cache",
        claim: "helps with fragmentation; every batch costs 5-10% speed; lets a second task fit",
    },
    Technique {
        id: "release-references",
        name: "dropping references (del)",
        claim: "one del can save you; leaks show as steadily growing memory",
    },
    Technique {
        id: "pinned-memory",
        name: "pinned host memory",
        claim: "faster transfers, fewer stalls",
    },
    Technique {
        id: "lighter-model",
        name: "lighter architecture",
        claim: "e.g. ResNet50 -> MobileNetV3 to fit",
    },
    Technique {
        id: "input-size",
        name: "smaller input resolution",
        claim: "memory grows with resolution",
    },
    Technique {
        id: "memory-fraction",
        name: "per-process memory fraction cap",
        claim: "limits usage",
    },
    Technique {
        id: "checkpointing",
        name: "activation checkpointing",
        claim: "needed for large models; trades compute for memory",
    },
    Technique {
        id: "fragmentation",
        name: "fragmentation watch",
        claim: "fragmentation can cause OOM although enough memory is free in total",
    },
    Technique {
        id: "monitoring",
        name: "memory monitoring",
        claim: "memory_allocated / memory_reserved / memory_summary find the bottleneck",
    },
    Technique {
        id: "multi-task",
        name: "two models in one process",
        claim: "emptying the cache between tasks lets B get the memory",
    },
    Technique {
        id: "oom-recovery",
        name: "OOM recovery",
        claim: "catch OOM, empty the cache, retry with half the batch: recovery success +50%",
    },
    Technique {
        id: "data-parallel",
        name: "data parallel over several GPUs",
        claim: "spreads memory and work",
    },
    Technique { id: "cpu-fallback", name: "CPU fallback for inference", claim: "keeps working" },
];

/// Looks a technique up by its id.
pub fn technique(id: &str) -> Option<&'static Technique> {
    TECHNIQUES.iter().find(|t| t.id == id)
}
