//! Hugging Face `config.json` files, read into an [`Arch`]: `model_type` `gpt2` (GPT-2's
//! layout, [`Arch::Gpt`]) and `llama`, `mistral`, `qwen2` ([`Arch::Llama`]), built with
//! Hugging Face's parameter count to the parameter.
//!
//! Only the hyperparameters that shape the network and its memory are read; every other key
//! is listed in [`HfModel::ignored`] (token ids, dtype, dropout probabilities HF leaves at 0,
//! initialization, ...), and settings the model cannot follow are errors naming the key
//! (a `rope_scaling` type other than `linear` and `llama3`, a GPT-2 `n_inner` other than
//! `4 * n_embd`). A missing or ill-typed key is an error naming the key and the file.
//!
//! ```
//! use vram_harness::models::{Arch, HfModel};
//!
//! let text = r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
//!     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//!     "vocab_size": 100, "max_position_embeddings": 256, "bos_token_id": 1}"#;
//! let m = HfModel::from_json_str("tiny", text)?;
//! assert!(matches!(&m.arch, Arch::Llama(l) if l.kv_heads == 2 && l.head_dim == 16));
//! assert_eq!(m.ignored, ["bos_token_id"]);
//! # Ok::<(), vram_harness::models::HfError>(())
//! ```

use super::zoo::{Arch, LlamaArch};
use serde_json::{Map, Value};
use std::path::Path;
use vram_kernels::ops::RopeScaling;

/// The `model_type`s [`HfModel`] reads.
pub const KNOWN_MODEL_TYPES: &[&str] = &["gpt2", "llama", "mistral", "qwen2"];

/// Default sequence length of a run when the config allows longer (its
/// `max_position_embeddings`): set another with [`Arch::with_seq`] (`--seq`).
pub const DEFAULT_SEQ: usize = 4096;

/// What is wrong with a `config.json`.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// The file cannot be read.
    #[error("cannot read {path}: {reason}")]
    Io {
        /// The file.
        path: String,
        /// The system's message.
        reason: String,
    },
    /// Not JSON, or not an object.
    #[error("{path} is not a JSON object: {reason}")]
    Json {
        /// The file.
        path: String,
        /// The parser's message.
        reason: String,
    },
    /// A `model_type` this reader does not know.
    #[error(
        "{path}: unknown model_type `{model_type}`; the known model types are: gpt2, llama, \
         mistral, qwen2"
    )]
    UnknownModelType {
        /// The file.
        path: String,
        /// Its `model_type`.
        model_type: String,
    },
    /// A key that must be there is missing.
    #[error("{path}: missing key `{key}` ({what})")]
    Missing {
        /// The file.
        path: String,
        /// The key.
        key: String,
        /// What it should be.
        what: &'static str,
    },
    /// A key of the wrong type or out of range.
    #[error("{path}: key `{key}` {reason}")]
    Bad {
        /// The file.
        path: String,
        /// The key.
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// A model read from a Hugging Face `config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct HfModel {
    /// The model's name: the file's stem (its folder's name for a `config.json`).
    pub name: String,
    /// The config's `model_type`.
    pub model_type: String,
    /// The architecture (sequence length [`DEFAULT_SEQ`] or the config's maximum, whichever
    /// is smaller; GPT-2: `n_positions`).
    pub arch: Arch,
    /// The keys of the file that were not read, sorted.
    pub ignored: Vec<String>,
    /// How keys that were read are used, where it is not plain (one line each).
    pub notes: Vec<String>,
}

/// Reads keys of one config, recording which it used.
struct Reader<'a> {
    path: &'a str,
    map: &'a Map<String, Value>,
    used: Vec<&'static str>,
}

impl<'a> Reader<'a> {
    fn missing(&self, key: &str, what: &'static str) -> HfError {
        HfError::Missing { path: self.path.into(), key: key.into(), what }
    }

    fn bad(&self, key: &str, reason: impl Into<String>) -> HfError {
        HfError::Bad { path: self.path.into(), key: key.into(), reason: reason.into() }
    }

    /// The value of `key` unless absent or null.
    fn get(&mut self, key: &'static str) -> Option<&'a Value> {
        self.used.push(key);
        self.map.get(key).filter(|v| !v.is_null())
    }

    /// A positive integer.
    fn size(&mut self, key: &'static str) -> Result<usize, HfError> {
        match self.get(key) {
            None => Err(self.missing(key, "a positive integer")),
            Some(v) => self.as_size(key, v),
        }
    }

    fn opt_size(&mut self, key: &'static str) -> Result<Option<usize>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => self.as_size(key, v).map(Some),
        }
    }

    fn as_size(&self, key: &str, v: &Value) -> Result<usize, HfError> {
        match v.as_u64() {
            Some(n) if n > 0 => Ok(n as usize),
            _ => Err(self.bad(key, format!("must be a positive integer, got {v}"))),
        }
    }

    /// A positive finite number, `default` when absent.
    fn number(&mut self, key: &'static str, default: f64) -> Result<f64, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => self.as_number(key, v),
        }
    }

    fn as_number(&self, key: &str, v: &Value) -> Result<f64, HfError> {
        match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            _ => Err(self.bad(key, format!("must be a positive number, got {v}"))),
        }
    }

    /// A boolean, `default` when absent.
    fn flag(&mut self, key: &'static str, default: bool) -> Result<bool, HfError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.bad(key, format!("must be true or false, got {v}"))),
        }
    }

    /// A string, if present.
    fn text(&mut self, key: &'static str) -> Result<Option<&'a str>, HfError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.bad(key, format!("must be a string, got {v}"))),
        }
    }

    /// The keys not read, sorted.
    fn ignored(&self) -> Vec<String> {
        let mut v: Vec<String> =
            self.map.keys().filter(|k| !self.used.contains(&k.as_str())).cloned().collect();
        v.sort();
        v
    }
}

impl HfModel {
    /// Reads the `config.json` at `path`; the model's name is the file's stem.
    ///
    /// # Errors
    ///
    /// [`HfError`]: unreadable, not JSON, unknown `model_type`, a missing or bad key.
    pub fn from_path(path: &Path) -> Result<HfModel, HfError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| HfError::Io { path: path.display().to_string(), reason: e.to_string() })?;
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("hf-model");
        // `config.json` names no model: use its folder's name.
        let name = if name == "config" {
            path.parent().and_then(|p| p.file_name()).and_then(|s| s.to_str()).unwrap_or(name)
        } else {
            name
        };
        Self::parse(name, &path.display().to_string(), &text)
    }

    /// Reads a config from its text; `name` names the model (and the file in errors).
    ///
    /// # Errors
    ///
    /// As [`HfModel::from_path`].
    pub fn from_json_str(name: &str, text: &str) -> Result<HfModel, HfError> {
        Self::parse(name, name, text)
    }

    fn parse(name: &str, path: &str, text: &str) -> Result<HfModel, HfError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| HfError::Json { path: path.into(), reason: e.to_string() })?;
        let Value::Object(map) = &value else {
            return Err(HfError::Json { path: path.into(), reason: "not an object".into() });
        };
        let mut r = Reader { path, map, used: Vec::new() };
        let model_type = r
            .text("model_type")?
            .ok_or_else(|| r.missing("model_type", "one of gpt2, llama, mistral, qwen2"))?;
        let mut notes = Vec::new();
        let arch = match model_type {
            "gpt2" => gpt2(&mut r, &mut notes)?,
            "llama" | "mistral" | "qwen2" => llama(&mut r, name, model_type, &mut notes)?,
            other => {
                return Err(HfError::UnknownModelType {
                    path: path.into(),
                    model_type: other.into(),
                });
            }
        };
        Ok(HfModel {
            name: name.into(),
            model_type: model_type.into(),
            arch,
            ignored: r.ignored(),
            notes,
        })
    }

    /// Parameters as Hugging Face counts them (a tied head once).
    pub fn param_count(&self) -> u64 {
        match &self.arch {
            Arch::Llama(l) => l.param_count(),
            Arch::Gpt { vocab, d, layers, seq, tied, .. } => {
                let (v, d, l, s) = (*vocab as u64, *d as u64, *layers as u64, *seq as u64);
                let head = if *tied { 0 } else { v * d };
                v * d + s * d + l * (12 * d * d + 13 * d) + 2 * d + head
            }
            _ => 0,
        }
    }

    /// One line for reports: the ignored keys, or that there are none.
    pub fn ignored_line(&self) -> String {
        if self.ignored.is_empty() {
            "every key of the config was read".into()
        } else {
            format!("keys not read (no effect on the model's shape): {}", self.ignored.join(", "))
        }
    }
}

fn gpt2(r: &mut Reader<'_>, notes: &mut Vec<String>) -> Result<Arch, HfError> {
    let d = r.size("n_embd")?;
    let layers = r.size("n_layer")?;
    let heads = r.size("n_head")?;
    let vocab = r.size("vocab_size")?;
    let seq = r.size("n_positions")?;
    if !d.is_multiple_of(heads) {
        return Err(r.bad("n_head", format!("{heads} does not divide n_embd {d}")));
    }
    if let Some(inner) = r.opt_size("n_inner")?
        && inner != 4 * d
    {
        return Err(r.bad("n_inner", format!("{inner} is not supported: the MLP is 4 * n_embd")));
    }
    if let Some(act) = r.text("activation_function")?
        && !matches!(act, "gelu_new" | "gelu_pytorch_tanh")
    {
        return Err(r.bad(
            "activation_function",
            format!("`{act}` is not supported: GELU with the tanh approximation (gelu_new)"),
        ));
    }
    let eps = r.number("layer_norm_epsilon", 1e-5)?;
    if (eps - 1e-5).abs() > 1e-12 {
        return Err(r.bad("layer_norm_epsilon", format!("{eps} is not supported (1e-5)")));
    }
    let tied = r.flag("tie_word_embeddings", true)?;
    let dropout = match r.get("resid_pdrop") {
        None => 0.1,
        Some(v) => match v.as_f64() {
            Some(p) if (0.0..1.0).contains(&p) => p,
            _ => return Err(r.bad("resid_pdrop", format!("must be in [0, 1), got {v}"))),
        },
    };
    r.used.extend(["attn_pdrop", "embd_pdrop"]);
    notes.push(format!(
        "GPT-2 layout: dropout {dropout} (resid_pdrop) on attention probabilities and residual \
         branches; attn_pdrop and embd_pdrop are taken to be the same"
    ));
    Ok(Arch::Gpt { vocab, d, layers, heads, seq, dropout: dropout as f32, tied })
}

fn llama(
    r: &mut Reader<'_>,
    name: &str,
    model_type: &str,
    notes: &mut Vec<String>,
) -> Result<Arch, HfError> {
    let d = r.size("hidden_size")?;
    let hidden = r.size("intermediate_size")?;
    let layers = r.size("num_hidden_layers")?;
    let heads = r.size("num_attention_heads")?;
    let kv_heads = r.opt_size("num_key_value_heads")?.unwrap_or(heads);
    let vocab = r.size("vocab_size")?;
    let max_positions = r.size("max_position_embeddings")?;
    let head_dim = match r.opt_size("head_dim")? {
        Some(h) => h,
        None if d.is_multiple_of(heads) => d / heads,
        None => {
            return Err(r.bad(
                "num_attention_heads",
                format!("{heads} does not divide hidden_size {d} (and there is no head_dim)"),
            ));
        }
    };
    if !heads.is_multiple_of(kv_heads) {
        return Err(r.bad(
            "num_key_value_heads",
            format!("{kv_heads} does not divide num_attention_heads {heads}"),
        ));
    }
    if !head_dim.is_multiple_of(2) {
        return Err(
            r.bad("head_dim", format!("{head_dim} is odd: rotary embeddings pair features"))
        );
    }
    let eps = r.number("rms_norm_eps", 1e-6)? as f32;
    let theta = r.number("rope_theta", 10_000.0)? as f32;
    let scaling = rope_scaling(r)?;
    // Qwen2 always has q/k/v biases (its config has no `attention_bias`); Llama and Mistral
    // have them when `attention_bias` says so.
    let qkv_bias = match model_type {
        "qwen2" => true,
        _ => r.flag("attention_bias", false)?,
    };
    if r.flag("mlp_bias", false)? {
        return Err(r.bad("mlp_bias", "true is not supported: the MLP has no biases"));
    }
    if let Some(act) = r.text("hidden_act")?
        && act != "silu"
    {
        return Err(r.bad("hidden_act", format!("`{act}` is not supported (silu)")));
    }
    let tied = r.flag("tie_word_embeddings", false)?;
    if let Some(w) = r.get("sliding_window") {
        let used = model_type == "mistral" || r.flag("use_sliding_window", false)?;
        notes.push(format!(
            "sliding_window {w}{}: attention is full causal (the same as a window at least the \
             sequence length; longer sequences would attend further than the model does)",
            if used { "" } else { " (not in use)" }
        ));
    }
    r.used.extend(["use_sliding_window", "max_window_layers", "attention_dropout"]);
    let seq = max_positions.min(DEFAULT_SEQ);
    if seq < max_positions {
        notes.push(format!(
            "sequence length {seq} by default (max_position_embeddings {max_positions}): set \
             --seq"
        ));
    }
    Ok(Arch::Llama(LlamaArch {
        name: name.into(),
        vocab,
        d,
        layers,
        heads,
        kv_heads,
        head_dim,
        hidden,
        seq,
        max_positions,
        eps,
        rope_theta: theta,
        rope_scaling: scaling,
        qkv_bias,
        tied,
    }))
}

/// `rope_scaling`: absent or null (none), or an object whose `rope_type` (or older `type`)
/// is `default`, `linear` (with `factor`) or `llama3` (with `factor`, `low_freq_factor`,
/// `high_freq_factor`, `original_max_position_embeddings`).
fn rope_scaling(r: &mut Reader<'_>) -> Result<RopeScaling, HfError> {
    const KEY: &str = "rope_scaling";
    let Some(v) = r.get(KEY) else { return Ok(RopeScaling::Default) };
    let Value::Object(m) = v else {
        return Err(r.bad(KEY, format!("must be an object or null, got {v}")));
    };
    let kind = m.get("rope_type").or_else(|| m.get("type"));
    let kind = match kind {
        None => return Err(r.missing("rope_scaling.rope_type", "default, linear or llama3")),
        Some(Value::String(s)) => s.as_str(),
        Some(v) => {
            return Err(r.bad("rope_scaling.rope_type", format!("must be a string, got {v}")));
        }
    };
    let num = |key: &str| -> Result<f32, HfError> {
        let full = format!("rope_scaling.{key}");
        match m.get(key) {
            None => {
                Err(HfError::Missing { path: r.path.into(), key: full, what: "a positive number" })
            }
            Some(v) => r.as_number(&full, v).map(|x| x as f32),
        }
    };
    match kind {
        "default" => Ok(RopeScaling::Default),
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => {
            let low = num("low_freq_factor")?;
            let high = num("high_freq_factor")?;
            if high <= low {
                return Err(r.bad(
                    "rope_scaling.high_freq_factor",
                    format!("{high} must be above low_freq_factor {low}"),
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            })
        }
        other => Err(r.bad(
            "rope_scaling.rope_type",
            format!("`{other}` is not supported (default, linear, llama3)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Input;
    use crate::models::Model;
    use vram_kernels::{DType, Device};

    fn shipped(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hf").join(name)
    }

    /// Hugging Face's `num_parameters()` of each shipped config, checked against the
    /// architecture formulas (embedding, blocks, final norm, untied head):
    /// GPT-2 `V d + P d + L (12 d^2 + 13 d) + 2 d`; Llama family
    /// `V d + L (2 d + d dh (H + 2 KV) [+ dh (H + 2 KV)] + H dh d + 3 d I) + d [+ V d]`.
    const COUNTS: &[(&str, &str, u64)] = &[
        ("gpt2.json", "gpt2", 124_439_808),
        ("gpt2-medium.json", "gpt2", 354_823_168),
        ("llama-3.2-1b.json", "llama", 1_235_814_400),
        ("tinyllama-1.1b.json", "llama", 1_100_048_384),
        ("qwen2.5-0.5b.json", "qwen2", 494_032_768),
        ("mistral-7b.json", "mistral", 7_241_732_096),
    ];

    #[test]
    fn shipped_configs_build_hugging_faces_parameter_count_to_the_parameter() {
        for &(file, kind, want) in COUNTS {
            let m = HfModel::from_path(&shipped(file)).unwrap();
            assert_eq!(m.model_type, kind, "{file}");
            assert_eq!(m.param_count(), want, "{file}: formula");
            // The model as built on the virtual device (allocated, never filled).
            let dev = Device::virtual_device(64 << 30);
            let model = Model::new(&dev, m.arch.clone(), 0, DType::BF16).unwrap();
            assert_eq!(model.param_count(), want, "{file}: built");
            // bf16 parameters (and the rotary tables): no more.
            let bytes = dev.memory_stats().requested_bytes.all.current as u64;
            assert!(bytes >= 2 * want && bytes < 2 * want + (64 << 20), "{file}: {bytes} B");
        }
        let gpt = HfModel::from_path(&shipped("gpt2.json")).unwrap();
        assert_eq!(gpt.name, "gpt2");
        assert!(matches!(gpt.arch, Arch::Gpt { d: 768, layers: 12, seq: 1024, tied: true, .. }));
        let qwen = HfModel::from_path(&shipped("qwen2.5-0.5b.json")).unwrap();
        let Arch::Llama(l) = &qwen.arch else { panic!("qwen2 is a Llama") };
        assert!(l.qkv_bias && l.tied && l.kv_heads == 2 && l.head_dim == 64);
        assert!(qwen.ignored.contains(&"use_mrope".to_string()), "{:?}", qwen.ignored);
        let llama = HfModel::from_path(&shipped("llama-3.2-1b.json")).unwrap();
        let Arch::Llama(l) = &llama.arch else { panic!("llama") };
        assert!(matches!(l.rope_scaling, RopeScaling::Llama3 { factor: 32.0, .. }));
        assert_eq!((l.seq, l.max_positions, l.eps, l.rope_theta), (4096, 131072, 1e-5, 500_000.0));
        let mistral = HfModel::from_path(&shipped("mistral-7b.json")).unwrap();
        assert!(mistral.notes.iter().any(|n| n.contains("sliding_window 4096")));
    }

    fn err(text: &str) -> String {
        HfModel::from_json_str("bad.json", text).unwrap_err().to_string()
    }

    const LLAMA: &str = r#""hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 64"#;

    #[test]
    fn bad_files_are_errors_naming_the_key() {
        let e = err(r#"{"model_type": "gptj", "n_embd": 4}"#);
        assert!(
            e.contains("unknown model_type `gptj`") && e.contains("gpt2, llama, mistral, qwen2"),
            "{e}"
        );
        let e = err(r#"{"n_embd": 4}"#);
        assert!(e.contains("missing key `model_type`"), "{e}");
        let e = err(r#"{"model_type": "llama", "hidden_size": 64}"#);
        assert!(e.contains("missing key `intermediate_size`") && e.contains("bad.json"), "{e}");
        let e = err(&format!(r#"{{"model_type": "llama", {LLAMA}, "num_key_value_heads": 3}}"#));
        assert!(e.contains("`num_key_value_heads`") && e.contains("does not divide"), "{e}");
        let e = err(&format!(r#"{{"model_type": "mistral", {LLAMA}, "rms_norm_eps": "small"}}"#));
        assert!(e.contains("key `rms_norm_eps` must be a positive number"), "{e}");
        let text = LLAMA.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 2.5");
        let e = err(&format!(r#"{{"model_type": "llama", {text}}}"#));
        assert!(e.contains("key `num_hidden_layers` must be a positive integer, got 2.5"), "{e}");
        let e = err(&format!(
            r#"{{"model_type": "llama", {LLAMA}, "rope_scaling": {{"rope_type": "yarn", "factor": 4}}}}"#
        ));
        assert!(e.contains("rope_scaling.rope_type") && e.contains("yarn"), "{e}");
        let e = err(&format!(
            r#"{{"model_type": "llama", {LLAMA}, "rope_scaling": {{"type": "llama3", "factor": 8}}}}"#
        ));
        assert!(e.contains("missing key `rope_scaling.low_freq_factor`"), "{e}");
        let e = err(&format!(r#"{{"model_type": "llama", {LLAMA}, "tie_word_embeddings": 1}}"#));
        assert!(e.contains("key `tie_word_embeddings` must be true or false"), "{e}");
        let e = err(r#"{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
            "vocab_size": 10, "n_positions": 16, "n_inner": 100}"#);
        assert!(e.contains("key `n_inner`"), "{e}");
        let e = err("[1, 2]");
        assert!(e.contains("not a JSON object"), "{e}");
        let e = HfModel::from_path(Path::new("/nonexistent/config.json")).unwrap_err().to_string();
        assert!(e.contains("cannot read /nonexistent/config.json"), "{e}");
        // Linear scaling and an explicit head width are read.
        let m = HfModel::from_json_str(
            "ok",
            &format!(
                r#"{{"model_type": "llama", {LLAMA}, "head_dim": 32, "rope_scaling": {{"type": "linear", "factor": 2.0}}}}"#
            ),
        )
        .unwrap();
        let Arch::Llama(l) = &m.arch else { panic!() };
        assert_eq!(
            (l.head_dim, l.kv_heads, l.rope_scaling),
            (32, 4, RopeScaling::Linear { factor: 2.0 })
        );
        assert!(m.ignored.is_empty(), "{:?}", m.ignored);
    }

    #[test]
    fn llama_3_2_1b_steps_on_the_virtual_device_without_host_memory_for_data() {
        let m = HfModel::from_path(&shipped("llama-3.2-1b.json")).unwrap();
        let arch = m.arch.with_seq(2048).unwrap();
        let dev = Device::virtual_device(80 << 30);
        let mut model = Model::new(&dev, arch.clone(), 0, DType::BF16).unwrap();
        let batch = arch.dataset().batch_without_values(0, 0, 1);
        assert!(matches!(batch.input, Input::Tokens(_)));
        let mut ctx = vram_accum::ForwardCtx::new(vram_accum::Mode::Train, 0);
        model.train_step(&batch, &mut ctx, 1.0).unwrap();
        let peak = dev.memory_stats().allocated_bytes.all.peak as u64;
        let params = 2 * 1_235_814_400u64;
        // Parameters, their gradients, and a step's activations (beyond both).
        assert!(peak > 2 * params, "peak {peak}");
        // The scores of one block, [32 heads, 2048, 2048] f32 (the softmax's), were live.
        assert!(peak > 2 * params + (32 << 22) * 4, "peak {peak}");
    }
}
