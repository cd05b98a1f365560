//! The crate's files import in layers: scripts/import-circles finds no
//! circle of `crate::`/`super::` paths between them (a file that reaches
//! back to a file that reaches it). No broker: scripts/test runs it once,
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
