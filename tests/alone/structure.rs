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

/// Every proc-macro crate this machine builds, and only proc-macro crates
/// of Cargo.lock, is compiled at opt-level 0 (Cargo.toml): the compiler
/// cache cannot keep proc macros, so at the dependencies' opt-level 2 a new
/// one would be optimized again in every fresh clone (the build step
/// doubled when that was so). Asked of `cargo metadata` for the host only:
/// for every platform it needs crates the build never downloads (a fresh
/// machine's registry has no Windows crates, and the suite runs offline),
/// so the list's entries for other platforms (jni, wasm-bindgen) are only
/// checked to be in Cargo.lock.
#[test]
fn every_proc_macro_is_listed_at_opt_level_0() {
    let meta = host_metadata();
    let members = meta["workspace_members"].as_array().expect("workspace_members");
    let packages: Vec<&serde_json::Value> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| !members.contains(&p["id"]))
        .collect();
    let is_macro = |p: &serde_json::Value| {
        p["targets"].as_array().expect("targets").iter().any(|t| {
            t["kind"].as_array().expect("kind").iter().any(|k| k == "proc-macro")
        })
    };
    let name = |p: &serde_json::Value| p["name"].as_str().expect("name").to_owned();
    let mut macros: Vec<String> = packages.iter().filter(|p| is_macro(p)).map(|p| name(p)).collect();
    macros.sort();
    macros.dedup();
    assert!(macros.contains(&"serde_derive".to_owned()), "{macros:?}");
    let built: Vec<String> = packages.iter().map(|p| name(p)).collect();

    let listed = opt_level_0_list();
    let missing: Vec<&String> = macros.iter().filter(|m| !listed.contains(m)).collect();
    assert!(
        missing.is_empty(),
        "proc macros built here and not at opt-level 0 in Cargo.toml: {missing:?}"
    );
    let lock = std::fs::read_to_string(Path::new(DIR).join("Cargo.lock")).expect("Cargo.lock");
    for entry in &listed {
        assert!(
            lock.contains(&format!("name = \"{entry}\"\n")),
            "Cargo.toml lists {entry} at opt-level 0; Cargo.lock has no such crate"
        );
        assert!(
            !built.contains(entry) || macros.contains(entry),
            "Cargo.toml lists {entry} at opt-level 0; it is not a proc macro"
        );
    }
}

/// `cargo metadata` of the workspace, resolved for this machine's target.
fn host_metadata() -> serde_json::Value {
    let rustc = Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
        .arg("-vV")
        .output()
        .expect("cannot run rustc -vV");
    let version = String::from_utf8_lossy(&rustc.stdout);
    let host = version
        .lines()
        .find_map(|l| l.strip_prefix("host: "))
        .expect("rustc -vV names the host");
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", host])
        .current_dir(DIR)
        .output()
        .expect("cannot run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON")
}

/// The crates Cargo.toml compiles at opt-level 0 in the dev profile (every
/// `[profile.dev.package.X]` but `"*"`), sorted.
fn opt_level_0_list() -> Vec<String> {
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
    listed
}
