//! Allocator settings, from code or from `VRAM_ALLOC_CONF` in PyTorch's syntax
//! (`max_split_size_mb:128,expandable_segments:True`).

use std::fmt;

/// Name of the environment variable [`AllocatorConfig::from_env`] reads.
pub const ENV_VAR: &str = "VRAM_ALLOC_CONF";

/// Number of power-of-two size intervals for `roundup_power2_divisions`: 1 MiB ... 64 GiB.
const ROUNDUP_INTERVALS: usize = 17;

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
    max_split_size: Option<usize>,
    roundup_power2_divisions: [usize; ROUNDUP_INTERVALS],
    garbage_collection_threshold: Option<f64>,
    expandable_segments: bool,
    memory_fraction: Option<f64>,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            max_split_size: None,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: None,
            expandable_segments: false,
            memory_fraction: None,
        }
    }
}

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

    /// Parses PyTorch's `key:value,key:value` syntax. Keys: `max_split_size_mb`,
    /// `roundup_power2_divisions` (`4` or `[256:1,512:2,>:8]`), `garbage_collection_threshold`,
    /// `expandable_segments` (`True`/`False`) and `per_process_memory_fraction`.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let mut config = Self::default();
        for item in split_top_level(text) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| ConfigError::new(item, None, "expected `key:value`"))?;
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => {
                    let mb: usize = parse_num(key, value)?;
                    config = config.with_max_split_size(Some(mb.saturating_mul(1 << 20)))?;
                }
                "roundup_power2_divisions" => {
                    config.roundup_power2_divisions = parse_divisions(value)?;
                }
                "garbage_collection_threshold" => {
                    config =
                        config.with_garbage_collection_threshold(Some(parse_num(key, value)?))?;
                }
                "expandable_segments" => {
                    config.expandable_segments = match value {
                        "True" | "true" | "1" => true,
                        "False" | "false" | "0" => false,
                        _ => {
                            return Err(ConfigError::new(
                                key,
                                Some(value),
                                "expected True or False",
                            ));
                        }
                    };
                }
                "per_process_memory_fraction" => {
                    config = config.with_memory_fraction(Some(parse_num(key, value)?))?;
                }
                _ => {
                    return Err(ConfigError::new(
                        key,
                        None,
                        "unknown key; known keys: max_split_size_mb, roundup_power2_divisions, \
                         garbage_collection_threshold, expandable_segments, per_process_memory_fraction",
                    ));
                }
            }
        }
        Ok(config)
    }

    /// Blocks of at least this size are never split (PyTorch's `max_split_size_mb`); must be
    /// over 20 MiB. `None`: no limit.
    pub fn with_max_split_size(mut self, bytes: Option<usize>) -> Result<Self, ConfigError> {
        if let Some(b) = bytes
            && b <= crate::policy::LARGE_BUFFER
        {
            return Err(ConfigError::new(
                "max_split_size_mb",
                Some(&(b >> 20).to_string()),
                "must be more than 20 (MiB)",
            ));
        }
        self.max_split_size = bytes;
        Ok(self)
    }

    /// Round sizes up to one of `divisions` steps between powers of two (for all sizes);
    /// a power of two, or 0 to disable.
    pub fn with_roundup_power2_divisions(mut self, divisions: usize) -> Result<Self, ConfigError> {
        check_division("roundup_power2_divisions", divisions)?;
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

    /// Whether any size interval rounds to power-of-two divisions.
    #[inline]
    pub fn rounds_to_power2_divisions(&self) -> bool {
        self.roundup_power2_divisions.iter().any(|&d| d > 1)
    }

    /// Divisions for sizes in the power-of-two interval that holds `size`.
    pub fn roundup_power2_divisions(&self, size: usize) -> usize {
        let log = usize::BITS as usize - 1 - size.max(1).leading_zeros() as usize;
        let index = log.saturating_sub(20).min(ROUNDUP_INTERVALS - 1);
        self.roundup_power2_divisions[index]
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
}

impl fmt::Display for AllocatorConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(b) = self.max_split_size {
            parts.push(format!("max_split_size_mb:{}", b >> 20));
        }
        if self.roundup_power2_divisions.iter().any(|&d| d != 0) {
            let d = &self.roundup_power2_divisions;
            if d.iter().all(|&x| x == d[0]) {
                parts.push(format!("roundup_power2_divisions:{}", d[0]));
            } else {
                let items: Vec<String> =
                    d.iter().enumerate().map(|(i, v)| format!("{}:{v}", 1usize << i)).collect();
                parts.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
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
        f.write_str(&parts.join(","))
    }
}

/// Splits on commas outside brackets.
fn split_top_level(text: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in text.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

fn parse_num<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, ConfigError> {
    value.parse().map_err(|_| ConfigError::new(key, Some(value), "not a number"))
}

fn check_division(key: &str, d: usize) -> Result<(), ConfigError> {
    if d != 0 && !d.is_power_of_two() {
        return Err(ConfigError::new(
            key,
            Some(&d.to_string()),
            "divisions must be a power of 2 or 0",
        ));
    }
    Ok(())
}

/// `4` or `[256:1,512:2,>:8]` (interval starts in MiB, powers of two; `>` for the rest).
fn parse_divisions(value: &str) -> Result<[usize; ROUNDUP_INTERVALS], ConfigError> {
    const KEY: &str = "roundup_power2_divisions";
    let Some(inner) = value.strip_prefix('[').and_then(|v| v.strip_suffix(']')) else {
        let d: usize = parse_num(KEY, value)?;
        check_division(KEY, d)?;
        return Ok([d; ROUNDUP_INTERVALS]);
    };
    let mut out = [0; ROUNDUP_INTERVALS];
    let (mut first, mut last) = (true, 0);
    for entry in inner.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (interval, d) = entry
            .split_once(':')
            .ok_or_else(|| ConfigError::new(KEY, Some(entry), "expected `<MiB>:<divisions>`"))?;
        let d: usize = parse_num(KEY, d.trim())?;
        check_division(KEY, d)?;
        if interval.trim() == ">" {
            out[(last + 1).min(ROUNDUP_INTERVALS)..].fill(d);
            continue;
        }
        let mb: usize = parse_num(KEY, interval.trim())?;
        if !mb.is_power_of_two() {
            return Err(ConfigError::new(
                KEY,
                Some(entry),
                "interval starts must be powers of 2 (MiB)",
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
    }

    #[test]
    fn display_round_trips() {
        let c = AllocatorConfig::parse(
            "max_split_size_mb:64,roundup_power2_divisions:4,expandable_segments:True",
        )
        .unwrap();
        assert_eq!(AllocatorConfig::parse(&c.to_string()).unwrap(), c);
    }

    #[test]
    fn invalid_settings_name_the_key_or_value() {
        let cases = [
            ("colour:blue", "colour"),
            ("max_split_size_mb:ten", "ten"),
            ("max_split_size_mb:16", "more than 20"),
            ("expandable_segments:yes", "True or False"),
            ("garbage_collection_threshold:1.5", "less than 1"),
            ("roundup_power2_divisions:3", "power of 2"),
            ("roundup_power2_divisions:[300:2]", "powers of 2"),
            ("per_process_memory_fraction:1.2", "[0, 1]"),
            ("expandable_segments", "key:value"),
        ];
        for (text, needle) in cases {
            let err = AllocatorConfig::parse(text).unwrap_err().to_string();
            assert!(
                err.contains(needle),
                "{text:?} gave {err:?}, expected it to mention {needle:?}"
            );
        }
    }

    #[test]
    fn memory_fraction_is_validated_from_code() {
        assert!(AllocatorConfig::default().with_memory_fraction(Some(-0.1)).is_err());
        assert!(AllocatorConfig::default().with_memory_fraction(Some(f64::NAN)).is_err());
        assert!(AllocatorConfig::default().with_memory_fraction(Some(0.0)).is_ok());
        assert!(AllocatorConfig::default().with_memory_fraction(Some(1.0)).is_ok());
    }
}
