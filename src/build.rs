//! Records the source revision the binary is built from (`shoal_build_info`, `shoal
//! --version`'s companion in `GET /v1/node`): `SHOAL_REVISION` when the builder sets it (an
//! image built without `.git`), else `git rev-parse --short=12 HEAD`, else `unknown`.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SHOAL_REVISION");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    let revision = std::env::var("SHOAL_REVISION").ok().filter(|r| !r.is_empty()).or_else(|| {
        let out = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
    });
    println!("cargo:rustc-env=SHOAL_REVISION={}", revision.as_deref().unwrap_or("unknown"));
}
