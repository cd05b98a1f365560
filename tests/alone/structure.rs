//! The crate's files import in layers: scripts/import-circles finds no
//! circle of `crate::`/`super::` paths between them (a file that reaches
//! back to a file that reaches it); and Cargo.toml compiles every proc
//! macro unoptimized. No broker: scripts/test runs it once,
//! not per broker (.config/nextest.toml leaves it out of alone43).

use std::path::Path;
use std::process::Command;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

#[test]
fn no_import_circles() {
    // Both crates' sources (the script's default: src and core/src).
    let out = Command::new(Path::new(DIR).join("scripts/import-circles"))
        .current_dir(DIR)
        .output()
        .expect("cannot run scripts/import-circles");
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    assert!(
        out.status.success(),
        "scripts/import-circles ({}):\n{report}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every proc-macro crate in Cargo.lock, and only those, is compiled at
/// opt-level 0 (Cargo.toml): the compiler cache cannot keep proc macros, so
/// at the dependencies' opt-level 2 a new one would be optimized again in
/// every fresh clone (the build step doubled when that was so).
#[test]
fn every_proc_macro_is_listed_at_opt_level_0() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .current_dir(DIR)
        .output()
        .expect("cannot run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let members = meta["workspace_members"].as_array().expect("workspace_members");
    let mut macros: Vec<String> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| !members.contains(&p["id"]))
        .filter(|p| {
            p["targets"].as_array().expect("targets").iter().any(|t| {
                t["kind"].as_array().expect("kind").iter().any(|k| k == "proc-macro")
            })
        })
        .map(|p| p["name"].as_str().expect("name").to_owned())
        .collect();
    macros.sort();
    macros.dedup();
    assert!(macros.contains(&"serde_derive".to_owned()), "{macros:?}");

    let manifest = std::fs::read_to_string(Path::new(DIR).join("Cargo.toml")).expect("Cargo.toml");
    let mut listed = Vec::new();
    let mut lines = manifest.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line
            .strip_prefix("[profile.dev.package.")
            .and_then(|rest| rest.strip_suffix(']'))
        else {
            continue;
        };
        if name != "\"*\"" {
            assert_eq!(lines.next(), Some("opt-level = 0"), "Cargo.toml, [profile.dev.package.{name}]");
            listed.push(name.to_owned());
        }
    }
    listed.sort();
    assert_eq!(
        listed, macros,
        "Cargo.toml's opt-level 0 list (left) against Cargo.lock's proc-macro crates (right)"
    );
}
