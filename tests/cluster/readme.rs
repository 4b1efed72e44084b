//! The README's curl examples, run against a fresh node: every `$ curl ...` line between the
//! `<!-- readme-test:begin -->` and `<!-- readme-test:end -->` markers is run with `sh`, its
//! address replaced by the test node's, and its output compared with the lines that follow.

use std::process::Command;

use crate::harness::TestCluster;

/// The examples: (command, expected output).
fn examples() -> Vec<(String, String)> {
    let readme = include_str!("../../README.md");
    let start = readme.find("<!-- readme-test:begin -->").expect("begin marker");
    let end = readme.find("<!-- readme-test:end -->").expect("end marker");
    let mut examples: Vec<(String, String)> = Vec::new();
    for line in readme[start..end].lines() {
        if let Some(command) = line.strip_prefix("$ ") {
            examples.push((command.to_string(), String::new()));
        } else if line.starts_with("```") {
            continue;
        } else if let Some((_, out)) = examples.last_mut() {
            if !line.trim().is_empty() {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    examples
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_curl_examples_answer_as_documented() {
    let examples = examples();
    assert!(examples.len() >= 6, "the README shows examples");
    let c = TestCluster::start(1).await;
    c.wait_for_counts(&[1000]).await;
    let addr = c.api(0);
    for (command, expected) in examples {
        let command = command.replace("localhost:7000", &addr);
        let expected = expected.replace("127.0.0.1:7000", &addr);
        let out = tokio::task::spawn_blocking(move || {
            Command::new("sh").arg("-c").arg(&command).output().map(|o| (command, o))
        })
        .await
        .expect("join")
        .expect("run sh");
        let (command, out) = out;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let got: String = stdout.lines().filter(|l| !l.trim().is_empty()).map(|l| format!("{l}\n")).collect();
        assert_eq!(got, expected, "`{command}` printed something else than the README says");
    }
    c.shutdown().await;
}
