//! `cargo xtask` as a user runs it: exit codes and messages of the built binary.

use std::process::{Command, Output};

fn xtask(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xtask")).args(args).output().expect("xtask runs")
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

#[test]
fn version_and_list_models_answer_and_exit_0() {
    for args in [&["--version"][..], &["plan", "--version"]] {
        let o = xtask(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", text(&o));
        assert!(text(&o).contains(env!("CARGO_PKG_VERSION")), "{}", text(&o));
    }
    let o = xtask(&["plan", "--list-models"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    for name in ["gpt2-small", "gpt2-medium", "resnet50", "gpt", "mlp"] {
        assert!(text(&o).contains(name), "{name}: {}", text(&o));
    }
}

#[test]
fn bad_input_exits_2_with_one_message_per_problem() {
    let plan = |extra: &[&str]| {
        let mut v = vec!["plan", "--model", "gpt", "--batch", "8"];
        v.extend(extra);
        xtask(&v)
    };
    for (o, needle) in [
        (plan(&["--device-memory", "0"]), "a size must be at least 1 byte"),
        (xtask(&["replay", "x.pickle", "--capacity", "0"]), "a size must be at least 1 byte"),
        (plan(&["--device-memory", "1000000TiB"]), "is not a GPU"),
        (plan(&["--device-memory", "18446744073709551615"]), "is not a GPU"),
        (plan(&["--device-memory", "16777216TiB"]), "more than"),
        (plan(&["--device-memory", "8XB"]), "unknown unit"),
        (plan(&["--device-memory", "64MiB", "--gpus", "3"]), "split evenly over --gpus 3"),
        (
            xtask(&[
                "plan",
                "--model",
                "gpt2-medium",
                "--batch",
                "8",
                "--device-memory",
                "1GiB",
                "--reserve",
                "512MiB",
            ]),
            "the model's parameters alone (",
        ),
    ] {
        assert_eq!(o.status.code(), Some(2), "{needle}: {}", text(&o));
        assert!(text(&o).contains(needle), "{needle}: {}", text(&o));
    }
}
