//! A Llama-family model from a Hugging Face config through the twin's vram side: exported
//! with HF's parameter names, trained on the host (the loss falls), and predicted to the
//! byte by the virtual device.

use vram_harness::models::{Arch, HfModel};
use vram_harness::twin::{self, TwinSettings};
use vram_kernels::Device;

#[test]
fn a_tiny_qwen2_config_trains_exports_and_is_predicted_to_the_byte() {
    let dir = std::env::temp_dir().join(format!("vram-llama-twin-{}", std::process::id()));
    let m = HfModel::from_json_str(
        "tiny-qwen2",
        r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 128, "max_position_embeddings": 32, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let arch = m.arch.clone().with_seq(16).unwrap();
    let settings = TwinSettings { batch: 2, steps: 3, ..TwinSettings::default() };
    let run =
        twin::run_vram_arch(&Device::host(256 << 20), &m.name, arch, &settings, &dir).unwrap();
    assert_eq!(run.param_count, m.param_count());
    assert!(run.losses[2] < run.losses[0], "training lowers the loss: {:?}", run.losses);
    assert_eq!(run.predicted_peak_allocated, Some(run.peak_allocated));
    assert_eq!(run.predicted_peak_reserved, Some(run.peak_reserved));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("twin.json")).unwrap()).unwrap();
    let a = &json["arch"];
    assert_eq!((a["kind"].as_str(), a["kv_heads"].as_u64()), (Some("llama"), Some(2)));
    assert_eq!((a["eps"].as_f64(), a["qkv_bias"].as_bool()), (Some(1e-6), Some(true)));
    assert_eq!(json["input"]["shape"], serde_json::json!([2, 16]));
    let names: Vec<&str> =
        json["params"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(
        names[..3],
        [
            "embed_tokens.weight",
            "layers.0.input_layernorm.weight",
            "layers.0.self_attn.q_proj.weight"
        ]
    );
    assert_eq!(names.last(), Some(&"norm.weight"), "tied: no lm_head");
    assert!(matches!(m.arch, Arch::Llama(_)));
    std::fs::remove_dir_all(&dir).unwrap();
}
