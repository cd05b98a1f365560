//! The Kubernetes kit in `deploy/kubernetes/` (docs/src/deployment/kubernetes.md):
//! the base and both overlays render with `kubectl kustomize`, every
//! resource validates against Kubernetes 1.30's schemas (prometheus-operator's
//! PodMonitor and PrometheusRule against its CRD models), and what the
//! manifests say agrees with nackd: the ConfigMap's `nackd.toml` passes the
//! real `nackd --check-config` with the Secret's files (and with its
//! `[replica]` lines turned on), the grace period covers `shutdown_grace`,
//! the probes reach `/healthz` and `/readyz` on the metrics port, the pods
//! run as deploy/Dockerfile's user, the store is on a volume claim big
//! enough for `store.max_bytes`, memory covers what the config lets nackd
//! hold, and the PrometheusRule is deploy/prometheus/nackd.rules.yml.
//!
//! No cluster: nothing is applied to an API server, no pod runs. The tools
//! come from scripts/ensure-kube-tools.sh (pip, into a venv of their own;
//! run here, so a missing tool installs or fails the test, never skips). No
//! broker: scripts/test runs these once, with the 3.10 binary.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use base64::Engine;
use serde_json::Value;

const DIR: &str = env!("CARGO_MANIFEST_DIR");
const NACKD: &str = env!("CARGO_BIN_EXE_nackd");

/// The Kubernetes version the manifests are validated against.
const KUBERNETES: &str = "1.30";

/// The kits, as directories under deploy/kubernetes.
const KITS: [&str; 3] = ["base", "overlays/pool", "overlays/sidecar"];

/// What the test writes as the overlays' secret files (they are not in git).
const SECRETS: [(&str, &str); 2] = [
    ("republish-password", "kube-test-password"),
    ("admin-token", "kube-test-admin-token-0123456789"),
];

/// RSS of a nackd holding nothing, rounded up (README, "Benchmark results":
/// 50.4-72.0 MiB before anything was held, `nackd-bench delayed`, 2026-11-27).
const FIXED_RSS: u64 = 96 << 20;
/// RAM per held message, rounded up (84 B at 1 M held, 71 B at 10 M:
/// `nackd-bench hold --count 1000000` and `nackd-bench restart --count
/// 10000000 --restarts 1 --prefill`, 2026-11-25).
const RAM_PER_HELD: u64 = 100;

/// The smallest record a held message takes in the store: vhost "/", a queue
/// name of one character, an AMQP content header without properties (14
/// bytes) and an empty body. `store.max_bytes` over this is the most
/// messages a store can hold, whatever they are.
fn smallest_record() -> u64 {
    use nackd::store::{record, Held, Route};
    let held = Held {
        id: 1,
        vhost: "/".into(),
        queue: "q".into(),
        due_ms: 0,
        retry: 1,
        route: Route::Queue,
        on_return: None,
        header: bytes::Bytes::from(vec![0; 14]),
        body: bytes::Bytes::new(),
    };
    (record::SALTED_PREFIX + record::put_len(&held)) as u64
}

/// The bin directory of the tools' venv (installed on first use).
fn tools() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = Command::new(Path::new(DIR).join("scripts/ensure-kube-tools.sh"))
            .output()
            .expect("scripts/ensure-kube-tools.sh");
        assert!(
            out.status.success(),
            "scripts/ensure-kube-tools.sh failed (the test needs its tools and does not skip):\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
    })
}

/// Runs a command; panics with its output unless it succeeds. Returns stdout.
fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{command:?} failed ({}):\n{stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// One kit rendered: the YAML `kubectl kustomize` printed, and its documents.
struct Rendered {
    kit: &'static str,
    yaml: String,
    docs: Vec<Value>,
}

/// Renders a kit from a copy of deploy/kubernetes whose overlays have their
/// secret files (as an operator writes them before `kubectl apply -k`).
fn render(kit: &'static str) -> Rendered {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("kubernetes");
    copy_tree(&Path::new(DIR).join("deploy/kubernetes"), &root);
    for overlay in ["pool", "sidecar"] {
        for (name, value) in SECRETS {
            let secrets = root.join("overlays").join(overlay).join("secrets");
            std::fs::write(secrets.join(name), value).unwrap();
        }
    }
    let yaml = run(Command::new(tools().join("kubectl"))
        .arg("kustomize")
        .arg(root.join(kit)));
    let docs = yaml_docs(&yaml);
    assert!(!docs.is_empty(), "{kit}: nothing rendered");
    Rendered { kit, yaml, docs }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn yaml_docs(text: &str) -> Vec<Value> {
    use serde::Deserialize;
    serde_yaml_ng::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).unwrap())
        .filter(|doc| !doc.is_null())
        .collect()
}

impl Rendered {
    fn all(&self, kind: &str) -> Vec<&Value> {
        self.docs.iter().filter(|d| d["kind"] == kind).collect()
    }

    /// The one resource of a kind whose name starts with `name` (generated
    /// ConfigMaps and Secrets carry a hash suffix).
    fn one(&self, kind: &str, name: &str) -> &Value {
        let found: Vec<_> = self
            .all(kind)
            .into_iter()
            .filter(|d| str_at(d, "/metadata/name").starts_with(name))
            .collect();
        assert_eq!(found.len(), 1, "{}: one {kind} {name}*", self.kit);
        found[0]
    }

    /// Every StatefulSet with its nackd container (a container or, in the
    /// sidecar overlay, an init container that keeps running).
    fn nackd_pods(&self) -> Vec<(&Value, &Value)> {
        let pods: Vec<_> = self
            .all("StatefulSet")
            .into_iter()
            .filter_map(|sts| {
                let spec = &sts["spec"]["template"]["spec"];
                let containers = spec["containers"].as_array().into_iter().flatten();
                let init = spec["initContainers"].as_array().into_iter().flatten();
                containers
                    .chain(init)
                    .find(|c| c["name"] == "nackd")
                    .map(|c| (sts, c))
            })
            .collect();
        assert!(!pods.is_empty(), "{}: no StatefulSet runs nackd", self.kit);
        pods
    }

    /// The ConfigMap's nackd.toml, as the pod reads it.
    fn config_text(&self) -> String {
        let (sts, nackd) = self.nackd_pods()[0];
        let args: Vec<&str> = nackd["args"]
            .as_array()
            .expect("nackd's args")
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        let at = args.iter().position(|a| *a == "--config").expect("--config");
        let path = Path::new(args[at + 1]);
        let (volume, key) = mounted_at(sts, nackd, path);
        let map = volume["configMap"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("{}: {path:?} is not from a ConfigMap", self.kit));
        let map = self.one("ConfigMap", map);
        map["data"][&key]
            .as_str()
            .unwrap_or_else(|| panic!("{}: the ConfigMap has no {key}", self.kit))
            .to_owned()
    }

    /// The config, parsed by nackd's own parser.
    fn config(&self) -> nackd::config::Config {
        let text = self.config_text();
        nackd::config::Config::parse(&text, Path::new("nackd.toml"))
            .unwrap_or_else(|e| panic!("{}: the ConfigMap's nackd.toml: {e}", self.kit))
    }
}

fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

fn u64_at(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no number at {pointer} in {v}"))
}

/// The volume (a pod volume, or a claim template) a file or directory of the
/// container comes from, and its path inside that volume.
fn mounted_at<'a>(sts: &'a Value, container: &Value, path: &Path) -> (&'a Value, String) {
    let mounts = container["volumeMounts"].as_array().expect("volumeMounts");
    let mount = mounts
        .iter()
        .filter(|m| path.starts_with(str_at(m, "/mountPath")))
        .max_by_key(|m| str_at(m, "/mountPath").len())
        .unwrap_or_else(|| panic!("nothing is mounted at {path:?}"));
    let rest = path
        .strip_prefix(str_at(mount, "/mountPath"))
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let name = str_at(mount, "/name");
    let spec = &sts["spec"];
    let volumes = spec["template"]["spec"]["volumes"].as_array();
    let claims = spec["volumeClaimTemplates"].as_array();
    let volume = volumes
        .into_iter()
        .flatten()
        .find(|v| v["name"] == name)
        .or_else(|| {
            claims
                .into_iter()
                .flatten()
                .find(|c| c["metadata"]["name"] == name)
        })
        .unwrap_or_else(|| panic!("no volume {name}"));
    (volume, rest)
}

/// Bytes in a Kubernetes quantity ("2Gi", "512Mi", "1073741824").
fn bytes(quantity: &str) -> u64 {
    let units = [("Ki", 10), ("Mi", 20), ("Gi", 30), ("Ti", 40)];
    for (suffix, shift) in units {
        if let Some(n) = quantity.strip_suffix(suffix) {
            return n.parse::<u64>().expect(quantity) << shift;
        }
    }
    quantity
        .parse()
        .unwrap_or_else(|_| panic!("a quantity this test does not read: {quantity}"))
}

/// The port a probe or a rule names: a number, or a container port's name.
fn port_number(container: &Value, port: &Value) -> u64 {
    if let Some(n) = port.as_u64() {
        return n;
    }
    let name = port.as_str().expect("a port");
    let ports = container["ports"].as_array().expect("ports");
    let found = ports
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port named {name}"));
    u64_at(found, "/containerPort")
}

fn socket_port(address: &str) -> u64 {
    address.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn each_kit_validates_against_the_kubernetes_schemas() {
    for kit in KITS {
        let rendered = render(kit);
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), &rendered.yaml).unwrap();
        let out = run(Command::new(tools().join("python"))
            .arg(Path::new(DIR).join("scripts/kube-validate"))
            .arg(KUBERNETES)
            .arg(file.path()));
        eprintln!("{kit}:\n{out}");
        let kinds: BTreeSet<&str> = rendered
            .docs
            .iter()
            .map(|d| str_at(d, "/kind"))
            .collect();
        for kind in [
            "StatefulSet",
            "ConfigMap",
            "Service",
            "PodDisruptionBudget",
            "PodMonitor",
            "PrometheusRule",
        ] {
            assert!(kinds.contains(kind), "{kit}: no {kind} in {kinds:?}");
        }
        if kit != "overlays/sidecar" {
            assert!(kinds.contains("NetworkPolicy"), "{kit}: no NetworkPolicy");
        }
        if kit != "base" {
            assert!(kinds.contains("Secret"), "{kit}: no Secret");
        }
    }
}

/// The ConfigMap's nackd.toml with the paths of the Secret's mount moved to
/// `dir`, where the Secret's files are written: what the pod sees, here.
fn config_with_secrets(rendered: &Rendered, dir: &Path) -> String {
    let (sts, nackd) = rendered.nackd_pods()[0];
    let text = rendered.config_text();
    let mounts = nackd["volumeMounts"].as_array().unwrap();
    let mut out = text.clone();
    let mut secret_mounts = 0;
    for mount in mounts {
        let path = Path::new(str_at(mount, "/mountPath"));
        let (volume, _) = mounted_at(sts, nackd, path);
        let Some(name) = volume["secret"]["secretName"].as_str() else {
            continue;
        };
        secret_mounts += 1;
        let secret = rendered.one("Secret", name);
        let keys: BTreeSet<String> = secret["data"]
            .as_object()
            .expect("the Secret's data")
            .keys()
            .cloned()
            .collect();
        // Every file of the mount the config names is a key of the Secret.
        let prefix = format!("{}/", path.display());
        for (at, _) in text.match_indices(&prefix) {
            let file: String = text[at + prefix.len()..]
                .chars()
                .take_while(|c| *c != '"')
                .collect();
            assert!(
                keys.contains(&file),
                "{}: nackd.toml names {prefix}{file}, which the Secret {name} does not have ({keys:?})",
                rendered.kit
            );
        }
        let files = dir.join(name);
        std::fs::create_dir_all(&files).unwrap();
        for (key, value) in secret["data"].as_object().unwrap() {
            let value = base64::engine::general_purpose::STANDARD
                .decode(value.as_str().unwrap())
                .unwrap();
            std::fs::write(files.join(key), value).unwrap();
        }
        out = out.replace(&prefix, &format!("{}/", files.display()));
    }
    assert_eq!(secret_mounts, 1, "{}: one Secret mounted", rendered.kit);
    assert_ne!(out, text, "{}: nackd.toml reads no secret file", rendered.kit);
    out
}

/// nackd.toml with its `[replica]` lines turned on, as the file says to.
fn with_replica(text: &str) -> String {
    let on: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("(without [replica])"))
        .map(|l| {
            l.strip_prefix("#replica ")
                .or_else(|| l.strip_prefix("#replica"))
                .unwrap_or(l)
        })
        .collect();
    on.join("\n")
}

fn check_config(text: &str, dir: &Path, what: &str) {
    let path = dir.join(format!("{what}.toml"));
    std::fs::write(&path, text).unwrap();
    let out = Command::new(NACKD)
        .arg("--check-config")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{what}: nackd --check-config refused the ConfigMap's nackd.toml:\n{}{}\n--- the file:\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_config_map_passes_check_config_with_the_secret_files() {
    for kit in ["overlays/pool", "overlays/sidecar"] {
        let rendered = render(kit);
        let dir = tempfile::tempdir().unwrap();
        let text = config_with_secrets(&rendered, dir.path());
        check_config(&text, dir.path(), "as-shipped");

        // [replica] on: the instance id is the host name, which in a
        // StatefulSet's pod is the pod's name; the nodes are the cluster
        // operator's pods, by their stable names, one register each.
        let replica = with_replica(&text);
        check_config(&replica, dir.path(), "with-replica");
        let config = nackd::config::Config::parse(&replica, Path::new("with-replica.toml"))
            .unwrap_or_else(|e| panic!("{kit}: {e}"));
        let section = config.replica.as_ref().expect("[replica] turned on");
        assert!(
            section.instance.is_none(),
            "{kit}: replica.instance must stay unset (the pod's name is the id)"
        );
        let nodes = config.upstream.nodes();
        assert!(nodes.len() >= 3, "{kit}: {nodes:?}");
        for (i, node) in nodes.iter().enumerate() {
            assert!(
                node.contains(&format!("-server-{i}.")) && node.contains("-nodes."),
                "{kit}: {node} is not the operator's pod {i} behind its headless Service"
            );
        }
        for (sts, _) in rendered.nackd_pods() {
            let pod = &sts["spec"]["template"]["spec"];
            assert!(
                pod.get("hostname").is_none() && pod.get("setHostnameAsFQDN").is_none(),
                "{kit}: the pod's host name must be its name (the replica's instance id)"
            );
        }
    }
}

#[test]
fn termination_grace_covers_shutdown_grace_and_30_s() {
    for kit in KITS {
        let rendered = render(kit);
        let grace = rendered.config().limits.shutdown_grace.as_secs();
        for (sts, _) in rendered.nackd_pods() {
            let pod_grace = u64_at(sts, "/spec/template/spec/terminationGracePeriodSeconds");
            assert!(
                pod_grace >= grace + 30,
                "{kit}: terminationGracePeriodSeconds {pod_grace} < limits.shutdown_grace {grace} s + 30 s"
            );
        }
    }
}

#[test]
fn probes_and_ports_are_nackds_listeners() {
    for kit in KITS {
        let rendered = render(kit);
        let config = rendered.config();
        let metrics = config.metrics.address.to_string();
        assert!(
            metrics.starts_with("0.0.0.0:") || metrics.starts_with("[::]:"),
            "{kit}: metrics.address {metrics} is not reachable from the kubelet or Prometheus"
        );
        for (_, nackd) in rendered.nackd_pods() {
            let probes = [
                ("livenessProbe", "/healthz"),
                ("readinessProbe", "/readyz"),
                ("startupProbe", "/healthz"),
            ];
            for (probe, path) in probes {
                if probe == "startupProbe" && nackd.get(probe).is_none() {
                    continue;
                }
                let get = &nackd[probe]["httpGet"];
                assert_eq!(get["path"], path, "{kit}: {probe}");
                assert_eq!(
                    port_number(nackd, &get["port"]),
                    socket_port(&metrics),
                    "{kit}: {probe} is not on metrics.address {metrics}"
                );
            }
            let args: Vec<&str> = nackd["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            let listen = match args.iter().position(|a| *a == "--listen") {
                Some(at) => args[at + 1].to_owned(),
                None => config.listen.address.to_string(),
            };
            if kit == "overlays/sidecar" {
                assert!(
                    listen.starts_with("127.0.0.1:"),
                    "{kit}: a sidecar listens on loopback, not {listen}"
                );
            } else {
                assert_eq!(
                    port_number(nackd, &Value::from("amqp")),
                    socket_port(&listen),
                    "{kit}: the port `amqp` is not listen.address {listen}"
                );
            }
        }
        for monitor in rendered.all("PodMonitor") {
            let (_, nackd) = rendered.nackd_pods()[0];
            let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
            assert_eq!(endpoint["path"], "/metrics", "{kit}");
            assert_eq!(
                port_number(nackd, &endpoint["port"]),
                socket_port(&metrics),
                "{kit}: the PodMonitor scrapes another port"
            );
        }
    }
}

#[test]
fn the_pods_run_as_the_images_numeric_user() {
    let dockerfile = std::fs::read_to_string(Path::new(DIR).join("deploy/Dockerfile")).unwrap();
    let user = dockerfile
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("USER "))
        .expect("deploy/Dockerfile has a USER");
    let (uid, gid) = user.trim().split_once(':').expect("USER uid:gid");
    let parse = |id: &str| {
        id.parse::<u64>().unwrap_or_else(|_| {
            panic!("deploy/Dockerfile's USER {user} must be numeric (runAsNonRoot checks a number)")
        })
    };
    let (uid, gid) = (parse(uid), parse(gid));
    assert_ne!(uid, 0, "the image runs as root");
    for kit in KITS {
        let rendered = render(kit);
        for (sts, nackd) in rendered.nackd_pods() {
            let pod = &sts["spec"]["template"]["spec"]["securityContext"];
            assert_eq!(pod["runAsNonRoot"], true, "{kit}");
            assert_eq!(u64_at(pod, "/runAsUser"), uid, "{kit}: runAsUser");
            assert_eq!(u64_at(pod, "/runAsGroup"), gid, "{kit}: runAsGroup");
            assert_eq!(u64_at(pod, "/fsGroup"), gid, "{kit}: fsGroup");
            let own = &nackd["securityContext"];
            assert_eq!(own["readOnlyRootFilesystem"], true, "{kit}");
            assert_eq!(own["allowPrivilegeEscalation"], false, "{kit}");
            assert_eq!(own["capabilities"]["drop"], serde_json::json!(["ALL"]), "{kit}");
            assert!(
                own.get("runAsUser").is_none() && own.get("runAsGroup").is_none(),
                "{kit}: the container overrides the pod's user"
            );
            let image = str_at(nackd, "/image");
            assert_eq!(
                image,
                format!("nackd:{}", env!("CARGO_PKG_VERSION")),
                "{kit}: the image deploy/Dockerfile builds, at this version"
            );
        }
    }
}

#[test]
fn the_store_has_a_claim_of_its_own_and_memory_covers_what_it_can_hold() {
    for kit in KITS {
        let rendered = render(kit);
        let config = rendered.config();
        let max_bytes = config
            .store
            .max_bytes
            .unwrap_or_else(|| panic!("{kit}: store.max_bytes bounds the disk and the RAM: set it"))
            as u64;
        for (sts, nackd) in rendered.nackd_pods() {
            // The store is a volume claim of the StatefulSet's, one per pod.
            let (volume, _) = mounted_at(sts, nackd, &config.store.path);
            let claim = volume
                .pointer("/spec/resources/requests/storage")
                .and_then(Value::as_str)
                .unwrap_or_else(|| {
                    panic!("{kit}: store.path is not on a volume claim template: {volume}")
                });
            let disk = bytes(claim);
            let room = 2 * config.store.segment_bytes + nackd::store::RESERVE_BYTES;
            assert!(
                disk >= max_bytes + room,
                "{kit}: a claim of {claim} cannot take store.max_bytes {max_bytes}, two segments and the reserve"
            );

            // RAM: nackd's own, the capture budget, each vhost's due backlog
            // and every message the store can hold.
            let mut vhosts: BTreeSet<&str> =
                config.policies.iter().map(|p| p.vhost.as_str()).collect();
            vhosts.extend(config.delayed_exchanges.iter().map(|d| d.vhost.as_str()));
            let need = FIXED_RSS
                + config.limits.capture_budget as u64
                + config.republish.max_pending_bytes * vhosts.len().max(1) as u64
                + max_bytes / smallest_record() * RAM_PER_HELD;
            let limit = bytes(str_at(nackd, "/resources/limits/memory"));
            let request = bytes(str_at(nackd, "/resources/requests/memory"));
            assert!(
                limit >= need,
                "{kit}: memory limit {limit} B < {need} B, what the config lets nackd use"
            );
            assert_eq!(request, limit, "{kit}: memory request and limit differ");
        }
    }
}

#[test]
fn the_prometheus_rule_is_the_alert_rules_file() {
    let committed =
        std::fs::read_to_string(Path::new(DIR).join("deploy/kubernetes/base/prometheusrule.yaml"))
            .unwrap();
    let made = run(Command::new(Path::new(DIR).join("scripts/kube-rules")).arg("--stdout"));
    assert!(
        committed == made,
        "deploy/kubernetes/base/prometheusrule.yaml is not what scripts/kube-rules writes: run it"
    );
    let rules = std::fs::read_to_string(Path::new(DIR).join("deploy/prometheus/nackd.rules.yml"))
        .unwrap();
    let rules = &yaml_docs(&rules)[0];
    for kit in KITS {
        let rendered = render(kit);
        let rule = rendered.one("PrometheusRule", "nackd");
        assert_eq!(
            rule["spec"]["groups"], rules["groups"],
            "{kit}: the PrometheusRule's groups are not deploy/prometheus/nackd.rules.yml's"
        );
    }
}
