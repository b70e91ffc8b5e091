//! Allocator settings, from code or from `VRAM_ALLOC_CONF` in PyTorch's syntax
//! (`max_split_size_mb:128,expandable_segments:True`).
//!
//! [`AllocatorConfig::parse`] accepts the keys and values PyTorch's parser accepts
//! (`AcceleratorAllocatorConfig::parseArgs` in `c10/core/AllocatorConfig.cpp` together with the
//! CUDA keys of `CUDAAllocatorConfig::parseArgs` in `c10/cuda/CUDAAllocatorConfig.cpp`) and
//! validates each value the way PyTorch does. It is stricter in a few places, each of which
//! PyTorch either silently misreads or only catches later:
//!
//! - a key given twice is an error (PyTorch keeps the last value);
//! - numbers must be whole tokens: PyTorch's `stoull`/`stod` read a prefix, so `128MB` is
//!   128 and `-1` wraps to 2^64 - 1 there;
//! - settings are `key:value` separated by commas (a trailing comma is fine, as in PyTorch);
//!   PyTorch's tokenizer does not check its separators, so `a:1:b:2` slips through there;
//! - sizes whose byte count overflows `usize` are rejected (PyTorch clamps them), as are
//!   `roundup_power2_divisions` above 2^54, for which `512 * divisions` overflows;
//! - `backend:cudaMallocAsync` is rejected: vram implements only the native allocator.
//!
//! Keys that configure parts of PyTorch vram does not have (the pinned host allocator, CUDA
//! graphs, ...) are accepted, validated, kept (printing a config shows them) and explained by
//! [`AllocatorConfig::notes`].

use crate::policy::{LARGE_BUFFER, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC};
use std::fmt;

/// Name of the environment variable [`AllocatorConfig::from_env`] reads.
pub const ENV_VAR: &str = "VRAM_ALLOC_CONF";

const MIB: usize = 1 << 20;

/// Number of power-of-two size intervals for `roundup_power2_divisions`, as in PyTorch:
/// interval `i` holds sizes in `[2^i MiB, 2^(i+1) MiB)`; sizes under 1 MiB fall in the first,
/// sizes of 32 GiB and more in the last.
const ROUNDUP_INTERVALS: usize = 16;

/// log2 of the start of the first interval (1 MiB).
const ROUNDUP_START_LOG2: usize = 20;

/// The largest accepted number of divisions: rounding computes `MIN_BLOCK_SIZE * divisions`,
/// which must not overflow (2^54 on 64-bit targets).
const MAX_DIVISIONS: usize = 1 << (usize::BITS - 1 - MIN_BLOCK_SIZE.trailing_zeros());

/// PyTorch's `pinned_max_register_threads()`.
const MAX_REGISTER_THREADS: usize = 128;

/// A setting that could not be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid allocator setting `{key}`{}: {reason}", value.as_ref().map(|v| format!(" = `{v}`")).unwrap_or_default())]
pub struct ConfigError {
    /// The key concerned.
    pub key: String,
    /// The offending value, if the key was valid.
    pub value: Option<String>,
    /// What is wrong and what is accepted.
    pub reason: String,
}

impl ConfigError {
    fn new(key: &str, value: Option<&str>, reason: impl Into<String>) -> Self {
        ConfigError { key: key.into(), value: value.map(Into::into), reason: reason.into() }
    }
}

/// The caching allocator's tunables, with PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    large_segment_size: Option<usize>,
    max_split_size: Option<usize>,
    max_non_split_rounding_size: Option<usize>,
    roundup_power2_divisions: [usize; ROUNDUP_INTERVALS],
    garbage_collection_threshold: Option<f64>,
    expandable_segments: bool,
    memory_fraction: Option<f64>,
    compat: Compat,
}

/// Settings PyTorch accepts that have no effect in vram, kept as given so that printing the
/// config shows them. `None`: not given.
#[derive(Clone, Debug, Default, PartialEq)]
struct Compat {
    backend_native: bool,
    release_lock_on_cudamalloc: Option<bool>,
    pinned_use_cuda_host_register: Option<bool>,
    pinned_num_register_threads: Option<usize>,
    pinned_use_background_threads: Option<bool>,
    pinned_reserve_segment_size_mb: Option<usize>,
    pinned_free_catch_all: Option<bool>,
    graph_capture_record_stream_reuse: Option<bool>,
    throw_on_cudamalloc_oom: Option<bool>,
    expandable_segments_reserve: Option<String>,
    expandable_segments_reserve_by_class: Option<Vec<(String, String)>>,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            large_segment_size: None,
            max_split_size: None,
            max_non_split_rounding_size: None,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: None,
            expandable_segments: false,
            memory_fraction: None,
            compat: Compat::default(),
        }
    }
}

/// The keys PyTorch knows, by the names it accepts (ROCm spellings included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Key {
    LargeSegmentSize,
    MaxSplitSize,
    MaxNonSplitRounding,
    GarbageCollectionThreshold,
    RoundupPower2Divisions,
    ExpandableSegments,
    PerProcessMemoryFraction,
    Backend,
    ReleaseLockOnMalloc,
    PinnedUseHostRegister,
    PinnedNumRegisterThreads,
    PinnedUseBackgroundThreads,
    PinnedReserveSegmentSize,
    PinnedFreeCatchAll,
    GraphCaptureRecordStreamReuse,
    ThrowOnMallocOom,
    ExpandableSegmentsReserve,
    ExpandableSegmentsReserveByClass,
}

/// Every accepted name; the first name of each key is the one printed.
const KEYS: &[(&str, Key)] = &[
    ("large_segment_size_mb", Key::LargeSegmentSize),
    ("max_split_size_mb", Key::MaxSplitSize),
    ("max_non_split_rounding_mb", Key::MaxNonSplitRounding),
    ("garbage_collection_threshold", Key::GarbageCollectionThreshold),
    ("roundup_power2_divisions", Key::RoundupPower2Divisions),
    ("expandable_segments", Key::ExpandableSegments),
    ("per_process_memory_fraction", Key::PerProcessMemoryFraction),
    ("backend", Key::Backend),
    ("release_lock_on_cudamalloc", Key::ReleaseLockOnMalloc),
    ("release_lock_on_hipmalloc", Key::ReleaseLockOnMalloc),
    ("pinned_use_cuda_host_register", Key::PinnedUseHostRegister),
    ("pinned_use_hip_host_register", Key::PinnedUseHostRegister),
    ("pinned_num_register_threads", Key::PinnedNumRegisterThreads),
    ("pinned_use_background_threads", Key::PinnedUseBackgroundThreads),
    ("pinned_reserve_segment_size_mb", Key::PinnedReserveSegmentSize),
    ("pinned_free_catch_all", Key::PinnedFreeCatchAll),
    ("graph_capture_record_stream_reuse", Key::GraphCaptureRecordStreamReuse),
    ("throw_on_cudamalloc_oom", Key::ThrowOnMallocOom),
    ("expandable_segments_reserve", Key::ExpandableSegmentsReserve),
    ("expandable_segments_reserve_by_class", Key::ExpandableSegmentsReserveByClass),
];

fn lookup(name: &str) -> Option<Key> {
    KEYS.iter().find(|(n, _)| *n == name).map(|&(_, k)| k)
}

fn known_keys() -> String {
    KEYS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

/// Why a key accepted for PyTorch compatibility changes nothing in vram.
const PINNED_NOTE: &str = "configures PyTorch's pinned host allocator; vram's pinned host \
                           buffers do not come from this allocator; ignored";

impl AllocatorConfig {
    /// Reads [`ENV_VAR`]; defaults when it is unset or empty.
    pub fn from_env() -> Result<Self, ConfigError> {
        match std::env::var(ENV_VAR) {
            Ok(s) => Self::parse(&s),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(ConfigError::new(ENV_VAR, None, "the variable is not valid UTF-8"))
            }
        }
    }

    /// Parses PyTorch's `key:value,key:value` syntax (whitespace anywhere is ignored, as in
    /// PyTorch). Applied keys: `max_split_size_mb`, `max_non_split_rounding_mb`,
    /// `roundup_power2_divisions` (`4` or `[256:1,512:2,>:8]`), `garbage_collection_threshold`,
    /// `expandable_segments` (`True`/`False`) and `per_process_memory_fraction`. PyTorch's other
    /// keys are validated and kept; [`notes`](Self::notes) says why each has no effect.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let compact: String = text.chars().filter(|&c| !is_c_space(c)).collect();
        let tokens = tokenize(&compact);
        let items = parse_items(&tokens)?;

        let mut settings: Vec<(Key, &str, &Value<'_>)> = Vec::with_capacity(items.len());
        for (name, value) in &items {
            let key = lookup(name).ok_or_else(|| {
                ConfigError::new(name, None, format!("unknown key; known keys: {}", known_keys()))
            })?;
            if let Some(&(_, first, _)) = settings.iter().find(|(k, _, _)| *k == key) {
                let reason = if first == *name {
                    "given twice; each setting may appear once".to_string()
                } else {
                    format!("given twice (also as `{first}`); each setting may appear once")
                };
                return Err(ConfigError::new(name, None, reason));
            }
            settings.push((key, name, value));
        }

        let mut config = Self::default();
        // As in PyTorch, the large segment size is read first: it bounds max_split_size_mb and
        // max_non_split_rounding_mb wherever they appear.
        if let Some(&(_, name, value)) =
            settings.iter().find(|(k, _, _)| *k == Key::LargeSegmentSize)
        {
            let bytes = parse_mib(name, word(name, value)?)?;
            if bytes <= MIN_LARGE_ALLOC {
                return Err(ConfigError::new(
                    name,
                    Some(&(bytes / MIB).to_string()),
                    format!("must be more than {} (MiB)", MIN_LARGE_ALLOC / MIB),
                ));
            }
            config.large_segment_size = Some(bytes);
        }
        for (key, name, value) in settings {
            config = config.apply(key, name, value)?;
        }
        Ok(config)
    }

    fn apply(mut self, key: Key, name: &str, value: &Value<'_>) -> Result<Self, ConfigError> {
        let compat = &mut self.compat;
        match key {
            Key::LargeSegmentSize => {} // read first, in `parse`
            Key::MaxSplitSize => {
                let bytes = parse_mib(name, word(name, value)?)?;
                return self.with_max_split_size(Some(bytes));
            }
            Key::MaxNonSplitRounding => {
                let mb = parse_uint(name, word(name, value)?)?;
                return self.with_max_non_split_rounding_mb(Some(mb));
            }
            Key::GarbageCollectionThreshold => {
                let t = parse_float(name, word(name, value)?)?;
                return self.with_garbage_collection_threshold(Some(t));
            }
            Key::RoundupPower2Divisions => {
                self.roundup_power2_divisions = parse_divisions(name, value)?;
            }
            Key::ExpandableSegments => {
                self.expandable_segments = parse_bool(name, word(name, value)?)?;
            }
            Key::PerProcessMemoryFraction => {
                let f = parse_float(name, word(name, value)?)?;
                return self.with_memory_fraction(Some(f));
            }
            Key::Backend => match word(name, value)? {
                "native" => compat.backend_native = true,
                v @ ("cudaMallocAsync" | "hipMallocAsync") => {
                    return Err(ConfigError::new(
                        name,
                        Some(v),
                        "vram implements only PyTorch's native caching allocator, not the \
                         driver's stream-ordered pool allocator; use `backend:native` or drop \
                         the key",
                    ));
                }
                v => {
                    return Err(ConfigError::new(
                        name,
                        Some(v),
                        "unknown allocator backend; PyTorch knows `native` and \
                         `cudaMallocAsync`, and vram implements only `native`",
                    ));
                }
            },
            Key::ReleaseLockOnMalloc => {
                compat.release_lock_on_cudamalloc = Some(parse_bool(name, word(name, value)?)?);
            }
            Key::PinnedUseHostRegister => {
                compat.pinned_use_cuda_host_register = Some(parse_bool(name, word(name, value)?)?);
            }
            Key::PinnedNumRegisterThreads => {
                let v = word(name, value)?;
                let n = parse_uint(name, v)?;
                if !n.is_power_of_two() || n > MAX_REGISTER_THREADS {
                    return Err(ConfigError::new(
                        name,
                        Some(v),
                        format!(
                            "the number of register threads must be a power of 2 from 1 to \
                             {MAX_REGISTER_THREADS}"
                        ),
                    ));
                }
                compat.pinned_num_register_threads = Some(n);
            }
            Key::PinnedUseBackgroundThreads => {
                compat.pinned_use_background_threads = Some(parse_bool(name, word(name, value)?)?);
            }
            Key::PinnedReserveSegmentSize => {
                let v = word(name, value)?;
                let bytes = parse_mib(name, v)?;
                if bytes == 0 {
                    return Err(ConfigError::new(name, Some(v), "must be more than 0 (MiB)"));
                }
                compat.pinned_reserve_segment_size_mb = Some(bytes / MIB);
            }
            Key::PinnedFreeCatchAll => {
                compat.pinned_free_catch_all = Some(parse_bool(name, word(name, value)?)?);
            }
            Key::GraphCaptureRecordStreamReuse => {
                compat.graph_capture_record_stream_reuse =
                    Some(parse_bool(name, word(name, value)?)?);
            }
            Key::ThrowOnMallocOom => {
                compat.throw_on_cudamalloc_oom = Some(parse_bool(name, word(name, value)?)?);
            }
            Key::ExpandableSegmentsReserve => {
                compat.expandable_segments_reserve = Some(word(name, value)?.to_string());
            }
            Key::ExpandableSegmentsReserveByClass => match value {
                Value::List(entries) => {
                    compat.expandable_segments_reserve_by_class =
                        Some(entries.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect());
                }
                Value::Word(v) => {
                    return Err(ConfigError::new(
                        name,
                        Some(v),
                        "expected a list `[<class>:<reserve>,...]`",
                    ));
                }
            },
        }
        Ok(self)
    }

    /// Blocks of at least this size are never split (PyTorch's `max_split_size_mb`). A whole
    /// number of MiB, at least the large segment size (20 MiB unless `large_segment_size_mb`
    /// says otherwise). `None`: no limit.
    pub fn with_max_split_size(mut self, bytes: Option<usize>) -> Result<Self, ConfigError> {
        const KEY: &str = "max_split_size_mb";
        if let Some(b) = bytes {
            if b % MIB != 0 {
                return Err(ConfigError::new(
                    KEY,
                    Some(&format!("{b} bytes")),
                    "must be a whole number of MiB",
                ));
            }
            let min = self.large_segment_size();
            if b < min {
                return Err(ConfigError::new(
                    KEY,
                    Some(&(b / MIB).to_string()),
                    format!(
                        "too small: must be at least {} (MiB, the large segment size)",
                        min / MIB
                    ),
                ));
            }
        }
        self.max_split_size = bytes;
        Ok(self)
    }

    /// How far a cached block may exceed a request of at least `max_split_size` and still
    /// serve it without splitting (PyTorch's `max_non_split_rounding_mb`), in MiB; at least the
    /// large segment size. `None`: the default, the large segment size (20 MiB).
    pub fn with_max_non_split_rounding_mb(
        mut self,
        mb: Option<usize>,
    ) -> Result<Self, ConfigError> {
        const KEY: &str = "max_non_split_rounding_mb";
        if let Some(mb) = mb {
            let bytes = mib_to_bytes(KEY, &mb.to_string(), mb)?;
            let min = self.large_segment_size();
            if bytes < min {
                return Err(ConfigError::new(
                    KEY,
                    Some(&mb.to_string()),
                    format!(
                        "too small: must be at least {} (MiB, the large segment size)",
                        min / MIB
                    ),
                ));
            }
            self.max_non_split_rounding_size = Some(bytes);
        } else {
            self.max_non_split_rounding_size = None;
        }
        Ok(self)
    }

    /// Round sizes up to one of `divisions` steps between powers of two (for all sizes); a
    /// power of two up to 2^54, or 0 to disable.
    pub fn with_roundup_power2_divisions(mut self, divisions: usize) -> Result<Self, ConfigError> {
        check_division("roundup_power2_divisions", &divisions.to_string(), divisions, true)?;
        self.roundup_power2_divisions = [divisions; ROUNDUP_INTERVALS];
        Ok(self)
    }

    /// Reclaim old cached blocks when reserved memory passes this fraction of the memory
    /// cap; only active with a memory fraction. Must be in (0, 1).
    pub fn with_garbage_collection_threshold(
        mut self,
        t: Option<f64>,
    ) -> Result<Self, ConfigError> {
        if let Some(t) = t
            && !(t > 0.0 && t < 1.0)
        {
            return Err(ConfigError::new(
                "garbage_collection_threshold",
                Some(&t.to_string()),
                "must be greater than 0 and less than 1",
            ));
        }
        self.garbage_collection_threshold = t;
        Ok(self)
    }

    /// Grow segments in place by mapping pages into a reserved address range instead of
    /// allocating new segments (less fragmentation).
    pub fn with_expandable_segments(mut self, on: bool) -> Self {
        self.expandable_segments = on;
        self
    }

    /// Cap reserved memory at this fraction of the device's total. Must be in [0, 1].
    pub fn with_memory_fraction(mut self, fraction: Option<f64>) -> Result<Self, ConfigError> {
        if let Some(f) = fraction
            && !(0.0..=1.0).contains(&f)
        {
            return Err(ConfigError::new(
                "per_process_memory_fraction",
                Some(&f.to_string()),
                "must be within [0, 1]",
            ));
        }
        self.memory_fraction = fraction;
        Ok(self)
    }

    /// The split limit in bytes (`usize::MAX` when unlimited).
    pub fn max_split_size(&self) -> usize {
        self.max_split_size.unwrap_or(usize::MAX)
    }

    /// How far, in bytes, a cached block may exceed a request of at least
    /// [`max_split_size`](Self::max_split_size) and still serve it: PyTorch's
    /// `max_non_split_rounding_mb`, by default the large segment size (20 MiB,
    /// [`crate::LARGE_BUFFER`]).
    pub fn max_non_split_rounding_size(&self) -> usize {
        self.max_non_split_rounding_size.unwrap_or_else(|| self.large_segment_size())
    }

    /// PyTorch's `large_segment_size_mb` in bytes (default 20 MiB, [`crate::LARGE_BUFFER`]).
    /// vram's segments stay [`crate::LARGE_BUFFER`] whatever this says (see
    /// [`notes`](Self::notes)); it bounds `max_split_size_mb` and `max_non_split_rounding_mb`
    /// and is the default of the latter, as in PyTorch.
    pub fn large_segment_size(&self) -> usize {
        self.large_segment_size.unwrap_or(LARGE_BUFFER)
    }

    /// Whether any size interval rounds to power-of-two divisions.
    #[inline]
    pub fn rounds_to_power2_divisions(&self) -> bool {
        self.roundup_power2_divisions.iter().any(|&d| d > 1)
    }

    /// Divisions for sizes in the power-of-two interval that holds `size`: interval `i` is
    /// `[2^i MiB, 2^(i+1) MiB)`, sizes under 1 MiB use the first and sizes of 32 GiB and more
    /// the last (PyTorch's `roundup_power2_divisions(size)`; like it, size 0 counts as huge).
    pub fn roundup_power2_divisions(&self, size: usize) -> usize {
        let index = match size.checked_ilog2() {
            Some(log) => (log as usize).saturating_sub(ROUNDUP_START_LOG2),
            None => ROUNDUP_INTERVALS - 1,
        };
        self.roundup_power2_divisions[index.min(ROUNDUP_INTERVALS - 1)]
    }

    /// The garbage-collection threshold, if set.
    pub fn garbage_collection_threshold(&self) -> Option<f64> {
        self.garbage_collection_threshold
    }

    /// Whether expandable segments are on.
    pub fn expandable_segments(&self) -> bool {
        self.expandable_segments
    }

    /// The memory fraction cap, if set.
    pub fn memory_fraction(&self) -> Option<f64> {
        self.memory_fraction
    }

    /// These settings with the keys `text` gives (PyTorch's syntax) set to its values, the
    /// others kept: a change tried on top of recorded settings.
    ///
    /// ```
    /// use vram_alloc::AllocatorConfig;
    ///
    /// let recorded = AllocatorConfig::parse("garbage_collection_threshold:0.6,max_split_size_mb:64")?;
    /// let tried = recorded.with_overrides("max_split_size_mb:256,expandable_segments:True")?;
    /// assert_eq!(
    ///     tried.to_string(),
    ///     "max_split_size_mb:256,garbage_collection_threshold:0.6,expandable_segments:True"
    /// );
    /// # Ok::<(), vram_alloc::ConfigError>(())
    /// ```
    pub fn with_overrides(&self, text: &str) -> Result<Self, ConfigError> {
        Self::parse(text)?;
        let over: String = text.chars().filter(|&c| !is_c_space(c)).collect();
        let over_tokens = tokenize(&over);
        let over_keys: Vec<Key> =
            parse_items(&over_tokens)?.iter().filter_map(|(n, _)| lookup(n)).collect();
        let mine = self.to_string();
        let mine_tokens = tokenize(&mine);
        let mut parts: Vec<String> = parse_items(&mine_tokens)?
            .iter()
            .filter(|(n, _)| lookup(n).is_none_or(|k| !over_keys.contains(&k)))
            .map(|(n, v)| format!("{n}:{v}"))
            .collect();
        if !over.is_empty() {
            parts.push(over);
        }
        Self::parse(&parts.join(","))
    }

    /// Settings given that change nothing in PyTorch itself (not only in vram), each with
    /// why: `garbage_collection_threshold` without a memory fraction (`malloc` calls
    /// `garbage_collect_cached_blocks` only when `set_fraction`), `max_non_split_rounding_mb`
    /// without `max_split_size_mb` (`get_free_block` applies it only to requests of at least
    /// `max_split_size`, unlimited by default).
    pub fn inert(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.garbage_collection_threshold.is_some() && self.memory_fraction.is_none() {
            out.push(
                "garbage_collection_threshold has no effect without a memory fraction: \
                 PyTorch's malloc collects garbage only when one is set \
                 (torch.cuda.set_per_process_memory_fraction, or per_process_memory_fraction)"
                    .to_string(),
            );
        }
        if self.max_non_split_rounding_size.is_some() && self.max_split_size.is_none() {
            out.push(
                "max_non_split_rounding_mb has no effect without max_split_size_mb: \
                 get_free_block applies it only to requests of at least max_split_size"
                    .to_string(),
            );
        }
        out
    }

    /// These settings without the ones [`inert`](Self::inert) lists: what actually
    /// decides the allocator's behaviour.
    pub fn effective(&self) -> Self {
        let mut c = self.clone();
        if c.memory_fraction.is_none() {
            c.garbage_collection_threshold = None;
        }
        if c.max_split_size.is_none() {
            c.max_non_split_rounding_size = None;
        }
        c.compat = Compat::default();
        c
    }

    /// `roundup_power2_divisions` twice as fine in every interval that rounds (a smaller
    /// round-up); `None` when nothing rounds or the divisions cannot double.
    pub fn finer_roundup(&self) -> Option<Self> {
        if !self.rounds_to_power2_divisions() {
            return None;
        }
        let mut c = self.clone();
        for d in &mut c.roundup_power2_divisions {
            if *d > 1 {
                *d = d.checked_mul(2).filter(|&x| x <= MAX_DIVISIONS)?;
            }
        }
        Some(c)
    }

    /// One line per key that was accepted (for compatibility with PyTorch's syntax) but has no
    /// effect in vram, saying why. Empty when every given key is applied.
    pub fn notes(&self) -> Vec<String> {
        let c = &self.compat;
        let mut notes = Vec::new();
        let mut note = |given: bool, key: &str, why: &str| {
            if given {
                notes.push(format!("{key}: {why}"));
            }
        };
        note(
            self.large_segment_size.is_some(),
            "large_segment_size_mb",
            "vram's large segments stay 20 MiB; the value only bounds max_split_size_mb and \
             max_non_split_rounding_mb and is the default of the latter, as in PyTorch",
        );
        note(
            c.backend_native,
            "backend",
            "vram implements only PyTorch's native caching allocator, which `native` selects; \
             no effect",
        );
        note(
            c.release_lock_on_cudamalloc.is_some(),
            "release_lock_on_cudamalloc",
            "vram asks the device for memory while holding its lock; ignored",
        );
        note(
            c.pinned_use_cuda_host_register.is_some(),
            "pinned_use_cuda_host_register",
            PINNED_NOTE,
        );
        note(c.pinned_num_register_threads.is_some(), "pinned_num_register_threads", PINNED_NOTE);
        note(
            c.pinned_use_background_threads.is_some(),
            "pinned_use_background_threads",
            PINNED_NOTE,
        );
        note(
            c.pinned_reserve_segment_size_mb.is_some(),
            "pinned_reserve_segment_size_mb",
            PINNED_NOTE,
        );
        note(c.pinned_free_catch_all.is_some(), "pinned_free_catch_all", PINNED_NOTE);
        note(
            c.graph_capture_record_stream_reuse.is_some(),
            "graph_capture_record_stream_reuse",
            "vram does not capture CUDA graphs; ignored",
        );
        note(
            c.throw_on_cudamalloc_oom.is_some(),
            "throw_on_cudamalloc_oom",
            "vram always releases cached blocks and retries before reporting out-of-memory \
             (PyTorch's default); ignored",
        );
        note(
            c.expandable_segments_reserve.is_some(),
            "expandable_segments_reserve",
            "vram reserves the device's whole capacity for each expandable segment; ignored",
        );
        note(
            c.expandable_segments_reserve_by_class.is_some(),
            "expandable_segments_reserve_by_class",
            "vram reserves the device's whole capacity for each expandable segment; ignored",
        );
        notes
    }
}

impl fmt::Display for AllocatorConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn flag(b: bool) -> &'static str {
            if b { "True" } else { "False" }
        }
        let mut parts = Vec::new();
        if let Some(b) = self.large_segment_size {
            parts.push(format!("large_segment_size_mb:{}", b / MIB));
        }
        if let Some(b) = self.max_split_size {
            parts.push(format!("max_split_size_mb:{}", b / MIB));
        }
        if let Some(b) = self.max_non_split_rounding_size {
            parts.push(format!("max_non_split_rounding_mb:{}", b / MIB));
        }
        if let Some(d) = divisions_text(&self.roundup_power2_divisions) {
            parts.push(format!("roundup_power2_divisions:{d}"));
        }
        if let Some(t) = self.garbage_collection_threshold {
            parts.push(format!("garbage_collection_threshold:{t}"));
        }
        if self.expandable_segments {
            parts.push("expandable_segments:True".into());
        }
        if let Some(x) = self.memory_fraction {
            parts.push(format!("per_process_memory_fraction:{x}"));
        }
        let c = &self.compat;
        if c.backend_native {
            parts.push("backend:native".into());
        }
        let flags = [
            ("release_lock_on_cudamalloc", c.release_lock_on_cudamalloc),
            ("pinned_use_cuda_host_register", c.pinned_use_cuda_host_register),
            ("pinned_use_background_threads", c.pinned_use_background_threads),
            ("pinned_free_catch_all", c.pinned_free_catch_all),
            ("graph_capture_record_stream_reuse", c.graph_capture_record_stream_reuse),
            ("throw_on_cudamalloc_oom", c.throw_on_cudamalloc_oom),
        ];
        for (key, value) in flags {
            if let Some(b) = value {
                parts.push(format!("{key}:{}", flag(b)));
            }
        }
        if let Some(n) = c.pinned_num_register_threads {
            parts.push(format!("pinned_num_register_threads:{n}"));
        }
        if let Some(n) = c.pinned_reserve_segment_size_mb {
            parts.push(format!("pinned_reserve_segment_size_mb:{n}"));
        }
        if let Some(r) = &c.expandable_segments_reserve {
            parts.push(format!("expandable_segments_reserve:{r}"));
        }
        if let Some(entries) = &c.expandable_segments_reserve_by_class {
            let items: Vec<String> = entries.iter().map(|(a, b)| format!("{a}:{b}")).collect();
            parts.push(format!("expandable_segments_reserve_by_class:[{}]", items.join(",")));
        }
        f.write_str(&parts.join(","))
    }
}

/// The shortest text `parse_divisions` reads back as `d`; `None` when nothing rounds.
fn divisions_text(d: &[usize; ROUNDUP_INTERVALS]) -> Option<String> {
    if d.iter().all(|&x| x == 0) {
        return None;
    }
    if d.iter().all(|&x| x == d[0]) {
        return Some(d[0].to_string());
    }
    // The first entry also fills every interval below it, and `>` every interval after the
    // last entry: print from the end of the leading run to the start of the trailing run.
    let lead_end = d.iter().position(|&x| x != d[0]).expect("not all equal") - 1;
    let last = d[ROUNDUP_INTERVALS - 1];
    let trail_start =
        ROUNDUP_INTERVALS - d.iter().rev().position(|&x| x != last).expect("not all equal");
    let mut items: Vec<String> =
        (lead_end..=trail_start).map(|i| format!("{}:{}", 1usize << i, d[i])).collect();
    if trail_start < ROUNDUP_INTERVALS - 1 {
        items.push(format!(">:{last}"));
    }
    Some(format!("[{}]", items.join(",")))
}

/// C's `isspace` in the "C" locale: what PyTorch's tokenizer drops.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Token<'a> {
    Word(&'a str),
    Colon,
    Comma,
    Open,
    Close,
}

impl fmt::Display for Token<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Token::Word(w) => w,
            Token::Colon => ":",
            Token::Comma => ",",
            Token::Open => "[",
            Token::Close => "]",
        })
    }
}

/// Splits on `,` `:` `[` `]`, which are tokens of their own (PyTorch's `ConfigTokenizer`).
fn tokenize(text: &str) -> Vec<Token<'_>> {
    let mut tokens = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        let special = match c {
            ':' => Token::Colon,
            ',' => Token::Comma,
            '[' => Token::Open,
            ']' => Token::Close,
            _ => continue,
        };
        if start < i {
            tokens.push(Token::Word(&text[start..i]));
        }
        tokens.push(special);
        start = i + 1;
    }
    if start < text.len() {
        tokens.push(Token::Word(&text[start..]));
    }
    tokens
}

/// A setting's value: one word, or a list of `a:b` pairs.
#[derive(Debug)]
enum Value<'a> {
    Word(&'a str),
    List(Vec<(&'a str, &'a str)>),
}

impl fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Word(w) => f.write_str(w),
            Value::List(entries) => {
                let items: Vec<String> = entries.iter().map(|(a, b)| format!("{a}:{b}")).collect();
                write!(f, "[{}]", items.join(","))
            }
        }
    }
}

/// `key:value` items separated by commas (a trailing comma is allowed, as in PyTorch); a
/// value is a word or `[a:b,...]`.
fn parse_items<'a>(tokens: &[Token<'a>]) -> Result<Vec<(&'a str, Value<'a>)>, ConfigError> {
    let mut items = Vec::new();
    let mut i = 0;
    while i < tokens.len() {
        let key = match tokens[i] {
            Token::Word(k) => k,
            t => {
                return Err(ConfigError::new(
                    &t.to_string(),
                    None,
                    "expected a setting `key:value` here (a leading comma, or two in a row?)",
                ));
            }
        };
        if tokens.get(i + 1) != Some(&Token::Colon) {
            return Err(ConfigError::new(key, None, "expected `key:value`"));
        }
        i += 2;
        let value = match tokens.get(i) {
            Some(Token::Word(v)) => {
                i += 1;
                Value::Word(v)
            }
            Some(Token::Open) => {
                let (entries, next) = parse_list(key, tokens, i + 1)?;
                i = next;
                Value::List(entries)
            }
            _ => return Err(ConfigError::new(key, None, "expected a value after `key:`")),
        };
        match tokens.get(i) {
            None => {}
            Some(Token::Comma) => i += 1,
            Some(t) => {
                return Err(ConfigError::new(
                    key,
                    Some(&value.to_string()),
                    format!("expected `,` after the value, found `{t}`"),
                ));
            }
        }
        items.push((key, value));
    }
    Ok(items)
}

/// The `a:b` pairs of a list value.
type Entries<'a> = Vec<(&'a str, &'a str)>;

/// The entries of a list whose `[` is just before `tokens[i]`; returns them and the index
/// after the closing `]`.
fn parse_list<'a>(
    key: &str,
    tokens: &[Token<'a>],
    mut i: usize,
) -> Result<(Entries<'a>, usize), ConfigError> {
    let mut entries = Vec::new();
    loop {
        match tokens.get(i) {
            Some(Token::Close) => return Ok((entries, i + 1)),
            Some(Token::Word(a)) => {
                let (Some(Token::Colon), Some(Token::Word(b))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                else {
                    return Err(ConfigError::new(
                        key,
                        Some(a),
                        "list entries are `<a>:<b>`, separated by commas",
                    ));
                };
                entries.push((*a, *b));
                i += 3;
                match tokens.get(i) {
                    Some(Token::Comma) => i += 1,
                    Some(Token::Close) => {}
                    None => {
                        return Err(ConfigError::new(key, None, "unterminated list: missing `]`"));
                    }
                    _ => {
                        return Err(ConfigError::new(
                            key,
                            Some(&format!("{a}:{b}")),
                            "expected `,` or `]` after a list entry",
                        ));
                    }
                }
            }
            None => return Err(ConfigError::new(key, None, "unterminated list: missing `]`")),
            Some(t) => {
                return Err(ConfigError::new(
                    key,
                    None,
                    format!("unexpected `{t}` in a list; entries are `<a>:<b>`"),
                ));
            }
        }
    }
}

fn word<'a>(key: &str, value: &Value<'a>) -> Result<&'a str, ConfigError> {
    match value {
        Value::Word(w) => Ok(w),
        Value::List(_) => Err(ConfigError::new(
            key,
            Some(&value.to_string()),
            "expected a single value, not a list",
        )),
    }
}

fn parse_uint(key: &str, value: &str) -> Result<usize, ConfigError> {
    value.parse().map_err(|_| {
        ConfigError::new(
            key,
            Some(value),
            format!("expected a whole number from 0 to {}", usize::MAX),
        )
    })
}

fn mib_to_bytes(key: &str, value: &str, mb: usize) -> Result<usize, ConfigError> {
    mb.checked_mul(MIB).ok_or_else(|| {
        ConfigError::new(
            key,
            Some(value),
            format!("too large: the size in bytes overflows; at most {} (MiB)", usize::MAX / MIB),
        )
    })
}

/// A whole number of MiB, in bytes.
fn parse_mib(key: &str, value: &str) -> Result<usize, ConfigError> {
    mib_to_bytes(key, value, parse_uint(key, value)?)
}

fn parse_float(key: &str, value: &str) -> Result<f64, ConfigError> {
    value.parse().map_err(|_| ConfigError::new(key, Some(value), "expected a number"))
}

fn parse_bool(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(ConfigError::new(
            key,
            Some(value),
            "expected True or False (PyTorch accepts only these spellings)",
        )),
    }
}

/// A number of divisions: a power of two up to [`MAX_DIVISIONS`], or 0 where `zero_ok` (inside
/// a list, or from code).
fn check_division(key: &str, text: &str, d: usize, zero_ok: bool) -> Result<(), ConfigError> {
    if d == 0 && zero_ok {
        return Ok(());
    }
    if !d.is_power_of_two() {
        let reason = if zero_ok {
            "divisions must be a power of 2, or 0 for no rounding"
        } else {
            "divisions must be a power of 2 (0 for no rounding is accepted only inside a \
             `[<MiB>:<divisions>,...]` list)"
        };
        return Err(ConfigError::new(key, Some(text), reason));
    }
    if d > MAX_DIVISIONS {
        return Err(ConfigError::new(
            key,
            Some(text),
            format!(
                "too many divisions: at most {MAX_DIVISIONS} (2^{}), so that {MIN_BLOCK_SIZE} \
                 bytes x divisions does not overflow",
                MAX_DIVISIONS.trailing_zeros()
            ),
        ));
    }
    Ok(())
}

/// `4` (every interval; a power of two) or `[64:8,256:4,>:1]`: interval starts in MiB, powers
/// of two; the first entry also sets every interval below it, `>` every interval after the
/// last entry; 0 disables rounding for an interval.
fn parse_divisions(
    key: &str,
    value: &Value<'_>,
) -> Result<[usize; ROUNDUP_INTERVALS], ConfigError> {
    let entries = match value {
        Value::Word(w) => {
            let d = parse_uint(key, w)?;
            check_division(key, w, d, false)?;
            return Ok([d; ROUNDUP_INTERVALS]);
        }
        Value::List(entries) => entries,
    };
    let mut out = [0; ROUNDUP_INTERVALS];
    let (mut first, mut last) = (true, 0);
    for &(interval, divisions) in entries {
        let entry = format!("{interval}:{divisions}");
        let d: usize = divisions.parse().map_err(|_| {
            ConfigError::new(
                key,
                Some(&entry),
                "expected `<MiB>:<divisions>` with a whole number of divisions",
            )
        })?;
        check_division(key, &entry, d, true)?;
        if interval == ">" {
            out[(last + 1).min(ROUNDUP_INTERVALS)..].fill(d);
            continue;
        }
        let mb: usize = interval.parse().map_err(|_| {
            ConfigError::new(
                key,
                Some(&entry),
                "expected `<MiB>:<divisions>` or `>:<divisions>`, with a whole number of MiB",
            )
        })?;
        if !mb.is_power_of_two() {
            return Err(ConfigError::new(
                key,
                Some(&entry),
                "interval starts must be powers of 2 (in MiB), e.g. 64 or 1024",
            ));
        }
        let index = (mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
        if first {
            out[..index].fill(d);
            first = false;
        }
        out[index] = d;
        last = index;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pytorch_syntax() {
        let c = AllocatorConfig::parse(
            "max_split_size_mb:128, expandable_segments:True,garbage_collection_threshold:0.6,\
             roundup_power2_divisions:[256:1,512:2,>:8],per_process_memory_fraction:0.5",
        )
        .unwrap();
        assert_eq!(c.max_split_size(), 128 << 20);
        assert!(c.expandable_segments());
        assert_eq!(c.garbage_collection_threshold(), Some(0.6));
        assert_eq!(c.memory_fraction(), Some(0.5));
        assert_eq!(c.roundup_power2_divisions(1 << 20), 1);
        assert_eq!(c.roundup_power2_divisions(300 << 20), 1);
        assert_eq!(c.roundup_power2_divisions(600 << 20), 2);
        assert_eq!(c.roundup_power2_divisions(2 << 30), 8);
        assert_eq!(AllocatorConfig::parse("").unwrap(), AllocatorConfig::default());
        assert_eq!(AllocatorConfig::parse(" \t\n").unwrap(), AllocatorConfig::default());
    }

    #[test]
    fn tokenizer_splits_on_separators_and_keeps_words() {
        assert_eq!(
            tokenize("a:[1:2,>:3],b"),
            [
                Token::Word("a"),
                Token::Colon,
                Token::Open,
                Token::Word("1"),
                Token::Colon,
                Token::Word("2"),
                Token::Comma,
                Token::Word(">"),
                Token::Colon,
                Token::Word("3"),
                Token::Close,
                Token::Comma,
                Token::Word("b"),
            ]
        );
    }

    #[test]
    fn divisions_text_is_shortest_and_reads_back() {
        let mut d = [0; ROUNDUP_INTERVALS];
        assert_eq!(divisions_text(&d), None);
        d[15] = 4;
        assert_eq!(divisions_text(&d).unwrap(), "[16384:0,32768:4]");
        d = [2; ROUNDUP_INTERVALS];
        assert_eq!(divisions_text(&d).unwrap(), "2");
        d[0] = 0;
        assert_eq!(divisions_text(&d).unwrap(), "[1:0,2:2,>:2]");
        for text in ["[1:0,2:2,>:2]", "[16384:0,32768:4]", "[64:8,128:2,256:4,512:2,1024:4,>:1]"] {
            let parsed = parse_divisions("k", &Value::List(list(text))).unwrap();
            let again = divisions_text(&parsed).unwrap();
            assert_eq!(parse_divisions("k", &Value::List(list(&again))).unwrap(), parsed);
        }
    }

    fn list(text: &str) -> Vec<(&str, &str)> {
        text.trim_matches(['[', ']']).split(',').map(|e| e.split_once(':').unwrap()).collect()
    }

    #[test]
    fn max_divisions_is_the_largest_that_does_not_overflow() {
        assert!(MAX_DIVISIONS.checked_mul(MIN_BLOCK_SIZE).is_some());
        assert!((MAX_DIVISIONS * 2).checked_mul(MIN_BLOCK_SIZE).is_none());
        #[cfg(target_pointer_width = "64")]
        assert_eq!(MAX_DIVISIONS, 1 << 54);
    }

    #[test]
    fn memory_fraction_is_validated_from_code() {
        assert!(AllocatorConfig::default().with_memory_fraction(Some(-0.1)).is_err());
        assert!(AllocatorConfig::default().with_memory_fraction(Some(f64::NAN)).is_err());
        assert!(AllocatorConfig::default().with_memory_fraction(Some(0.0)).is_ok());
        assert!(AllocatorConfig::default().with_memory_fraction(Some(1.0)).is_ok());
    }
}
