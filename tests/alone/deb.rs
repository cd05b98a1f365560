//! The Debian package (`cargo deb`, `[package.metadata.deb]` in Cargo.toml)
//! as an operator meets it: installed with apt on a clean Debian 13
//! (trixie) root, the dependencies coming from the registry, the service
//! user able to read its config and nobody else, the unit accepted by
//! trixie's systemd, and an upgrade that keeps the operator's edit of the
//! conffile. The root is a fresh copy of `scripts/debian-root`'s cached
//! pristine one (debootstrap minbase + systemd; the first run builds it).
//! Needs root (chroot) and cargo-deb (installed here by
//! scripts/ensure-cargo-deb.sh when missing); without them it fails, it
//! does not skip. No broker: scripts/test runs it once, not per broker.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::process::host;

const DIR: &str = env!("CARGO_MANIFEST_DIR");

fn script(name: &str) -> PathBuf {
    Path::new(DIR).join("scripts").join(name)
}

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(DIR).join(path)).unwrap()
}

/// A fresh copy of the pristine trixie root, deleted on drop.
struct Root {
    dir: tempfile::TempDir,
}

impl Root {
    fn new() -> Root {
        let dir = tempfile::Builder::new()
            .prefix("nackd-deb-test-")
            .tempdir()
            .unwrap();
        let root = Root { dir };
        host(
            Command::new(script("debian-root"))
                .arg("copy")
                .arg(root.path()),
            "scripts/debian-root copy (needs root; the first run builds the pristine root)",
        );
        root
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    /// Runs `sh -c SCRIPT` chrooted in the root: whether it succeeded, and
    /// its stdout and stderr together.
    fn sh(&self, script: &str) -> (bool, String) {
        let out = Command::new(self::script("debian-root"))
            .arg("run")
            .arg(self.path())
            .args(["sh", "-c", script])
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    /// Like `sh`, panicking unless the script succeeds; returns its output.
    fn ok(&self, script: &str) -> String {
        let (ok, text) = self.sh(script);
        assert!(ok, "in the trixie root, `{script}` failed:\n{text}");
        text
    }

    /// A file in the root, read from the host.
    fn read(&self, path: &str) -> String {
        std::fs::read_to_string(self.path().join(path.trim_start_matches('/')))
            .unwrap_or_else(|e| panic!("{path} in the root: {e}"))
    }

    fn installed_version(&self, package: &str) -> String {
        self.ok(&format!(
            "dpkg-query -W -f '${{Status}} ${{Version}}' {package} 2>/dev/null || true"
        ))
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let out = Command::new(script("debian-root"))
            .arg("remove")
            .arg(self.path())
            .output();
        if !out.as_ref().is_ok_and(|o| o.status.success()) {
            eprintln!(
                "scripts/debian-root remove {}: {out:?}",
                self.path().display()
            );
        }
    }
}

/// Builds the package with `cargo deb` into the root's /tmp: the package
/// as `cargo deb` makes it, and the same binary as revision 2 (an upgrade;
/// `--fast` compression, to spend seconds less). Returns both paths inside
/// the root and their versions.
fn build_packages(root: &Root) -> [(String, String); 2] {
    host(
        &mut Command::new(script("ensure-cargo-deb.sh")),
        "scripts/ensure-cargo-deb.sh",
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let build = |name: &str, extra: &[&str]| {
        let file = root.path().join("tmp").join(name);
        host(
            Command::new(&cargo)
                .current_dir(DIR)
                // The dev profile: the binary `cargo test` built already.
                // What is checked here is the packaging (paths, user,
                // modes, unit, conffiles), the same with `cargo deb`'s
                // default release profile, whose optimised build would add
                // minutes to every CI run from a fresh clone.
                .args(["deb", "--locked", "--profile", "dev", "--output"])
                .arg(&file)
                .args(extra),
            "cargo deb",
        );
        let version = host(
            Command::new("dpkg-deb")
                .arg("--field")
                .arg(&file)
                .arg("Version"),
            "dpkg-deb --field",
        );
        (format!("/tmp/{name}"), version.trim().to_string())
    };
    let first = build("nackd-first.deb", &[]);
    let second = build(
        "nackd-second.deb",
        &["--no-build", "--deb-revision", "2", "--fast"],
    );
    [first, second]
}

/// `apt-get install ./PACKAGE` in the root, as docs/src/getting-started/debian.md says.
fn apt_install(root: &Root, package: &str) -> String {
    root.ok(&format!("apt-get install -y -q {package} </dev/null"))
}

/// The service user, the config's owner and mode, and that the service
/// user (and only it) can read the config as `--check-config` does.
fn assert_the_service_user_reads_the_config(root: &Root) {
    let user = root.ok("getent passwd nackd");
    let fields: Vec<&str> = user.trim().split(':').collect();
    let uid: u32 = fields[2].parse().unwrap();
    assert!(uid < 1000, "nackd is a system user: {user}");
    assert_eq!(fields[5], "/var/lib/nackd", "its home is the store: {user}");
    assert_eq!(fields[6], "/usr/sbin/nologin", "{user}");
    let group = root.ok("getent group nackd");
    assert_eq!(
        group.trim().split(':').nth(2),
        Some(fields[3]),
        "nackd's primary group is nackd: {user} / {group}"
    );
    assert_eq!(
        root.ok("stat -c '%U:%G %a' /etc/nackd/nackd.toml").trim(),
        "root:nackd 640"
    );
    let checked = root.ok("runuser -u nackd -- nackd --check-config /etc/nackd/nackd.toml");
    assert!(checked.contains("/etc/nackd/nackd.toml: ok"), "{checked}");
    let (ok, text) = root.sh("runuser -u nobody -- nackd --check-config /etc/nackd/nackd.toml");
    assert!(
        !ok && text.contains("Permission denied"),
        "other users cannot read the config: {text}"
    );
}

#[test]
fn the_package_installs_on_a_clean_debian_13_and_an_upgrade_keeps_the_config_edit() {
    // Not `common::alone()`: apt in a root of its own measures nothing and
    // touches no broker; it runs beside the image's build.
    let root = Root::new();
    let [(first, first_version), (second, second_version)] = build_packages(&root);
    assert!(
        !root
            .installed_version("adduser")
            .starts_with("install ok installed"),
        "the pristine root has no adduser: apt must bring it"
    );

    root.ok("apt-get -q update");
    apt_install(&root, &first);
    assert_eq!(
        root.installed_version("nackd"),
        format!("install ok installed {first_version}")
    );
    for dependency in ["adduser", "procps"] {
        assert!(
            root.installed_version(dependency)
                .starts_with("install ok installed"),
            "apt installed the dependency {dependency}"
        );
    }
    // One unit file for the package and a manual install; the config is
    // the packaged variant; the README is where the unit says.
    assert_eq!(
        root.read("/usr/lib/systemd/system/nackd.service"),
        repo_file("deploy/nackd.service")
    );
    assert_eq!(
        root.read("/etc/nackd/nackd.toml"),
        repo_file("deploy/nackd.system.toml")
    );
    assert_eq!(
        root.read("/usr/share/doc/nackd/README.md"),
        repo_file("README.md")
    );
    let conffiles = root.ok("dpkg-query -W -f '${Conffiles}' nackd");
    assert!(conffiles.contains("/etc/nackd/nackd.toml"), "{conffiles}");
    assert_the_service_user_reads_the_config(&root);
    let verify = root.ok("systemd-analyze verify /usr/lib/systemd/system/nackd.service 2>&1");
    assert!(
        verify.trim().is_empty(),
        "systemd-analyze verify has no complaint: {verify}"
    );

    // The operator edits the config; the upgrade keeps the edit.
    let uid = root.ok("id -u nackd");
    root.ok("sed -i 's/^max_connections = 10000$/max_connections = 4321/' /etc/nackd/nackd.toml");
    assert!(root
        .read("/etc/nackd/nackd.toml")
        .contains("\nmax_connections = 4321\n"));
    assert_ne!(first_version, second_version);
    let upgrade = apt_install(&root, &second);
    assert!(
        upgrade.contains(&format!("over ({first_version})")),
        "an upgrade from {first_version}: {upgrade}"
    );
    assert_eq!(
        root.installed_version("nackd"),
        format!("install ok installed {second_version}")
    );
    let config = root.read("/etc/nackd/nackd.toml");
    assert!(
        config.contains("\nmax_connections = 4321\n"),
        "the upgrade kept the operator's edit:\n{config}"
    );
    assert_eq!(root.ok("id -u nackd"), uid, "the same service user");
    assert_the_service_user_reads_the_config(&root);
}
