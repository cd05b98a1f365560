//! The generator of `deploy/nackd.schema.json` and
//! `docs/src/reference/configuration.md`, and the test that they are
//! current.
//!
//! # Changing the configuration
//!
//! The structs in `src/config.rs`, `src/config/*.rs` and the `[[policy]]`
//! table in `core/src/policy.rs` are the one source: their doc comments
//! are the descriptions, serde's `default` functions the defaults, and
//! `#[schemars(...)]` adds examples, ranges and patterns. After changing a
//! key (or merging a branch that did), regenerate both files:
//!
//! ```sh
//! NACKD_REGENERATE=1 cargo test -p nackd --lib config::schema
//! ```
//!
//! then commit them. Without `NACKD_REGENERATE`, `generated_files_are_current`
//! fails while either file differs from what the structs say. A new table
//! type needs a line in `walk.rs` (`serde_keys`); the tests say so.

use std::fmt::Write;
use std::path::Path;

use serde_json::Value;

use super::walk::{definition, table_of, tables, text, Table};

/// The JSON Schema file, as `nackd config-schema` prints it.
pub(super) fn schema_file() -> String {
    format!("{:#}\n", super::json_schema())
}

/// The reference page.
pub(super) fn reference_page() -> String {
    let root = super::json_schema();
    let mut page = String::from(INTRO);
    for table in tables(&root) {
        section(&mut page, &root, &table);
    }
    durations(&mut page, &root);
    page
}

const INTRO: &str = r#"# Configuration reference

<!-- Generated from the configuration structs (src/config.rs, src/config/,
core/src/policy.rs) by src/config/schema/reference.rs: do not edit. To
regenerate: NACKD_REGENERATE=1 cargo test -p nackd --lib config::schema -->

nackd reads one TOML file: the one `--config FILE` names, else the one the
environment variable `NACKD_CONFIG` names, else `/etc/nackd/nackd.toml`
(where the Debian package and the container image keep it). Every key is
optional except inside `[[policy]]` and `[[delayed_exchange]]` tables; an
absent key has the default listed below. A key nackd does not know stops
startup with its name and the table it is in, like a bad value does.

**Relative paths** in the file (`store.path`, the TLS files) are taken from
nackd's working directory, not from the file's: `/var/lib/nackd` under the
systemd unit (`deploy/nackd.service`) and in the container image.

**Checking a file.** `nackd --check-config FILE` runs startup's checks
without the network and exits 0 (`FILE: ok`), or 2 with
`invalid configuration: ` and the key at fault. Besides the values below it
loads the TLS files, checks that the variables named by `*_env` keys are
set and that the files named by `*_file` keys can be read, resolves
`[replica]` and checks that an existing `store.path` is a
directory; run it as the service's user, with its environment. The systemd
unit runs it before every start. SIGHUP reloads the `[[policy]]` tables;
other keys take effect at the next start.

**In an editor.** `deploy/nackd.schema.json` is the file's JSON Schema
(`nackd config-schema` prints the same): with Even Better TOML (Taplo) in VS
Code, put `#:schema ./nackd.schema.json` (a path or URL to it) on the first
line of the file, or map the file to it in a `.taplo.toml` or in the
`evenBetterToml.schema.associations` setting, and the editor completes keys, shows these descriptions and flags
unknown keys, wrong types and out-of-range values. A `"$schema"` key inside
the file would be refused as unknown.

Durations are strings such as `"500ms"`, `"10s"`, `"5m"`, `"1h 30m"` (see
[Durations](#durations)); sizes are integers in bytes.
"#;

fn section(page: &mut String, root: &Value, table: &Table) {
    let heading = match (table.path.as_str(), table.array) {
        ("", _) => "Top level".to_string(),
        (path, true) => format!("`[[{path}]]`"),
        (path, false) => format!("`[{path}]`"),
    };
    let _ = write!(page, "\n## {heading}\n\n");
    if !table.path.is_empty() && !table.description.is_empty() {
        let _ = write!(page, "{}\n\n", one_paragraph(&table.description));
    }
    page.push_str("| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n");
    let required = table.schema["required"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let properties = &table.schema["properties"];
    for (key, resolved) in &table.keys {
        let own = &properties[*key];
        let is_required = required.iter().any(|r| r == key);
        let default = match table_of(root, own) {
            Some(_) if own.get("default").is_none() => "—".to_string(),
            _ => default_of(own, resolved, is_required),
        };
        let _ = writeln!(
            page,
            "| `{key}` | {} | {} | {} |",
            cell(&type_of(root, table, key, own, resolved)),
            cell(&default),
            cell(&description_of(own, resolved)),
        );
    }
    let rules = rules(table.schema);
    if !rules.is_empty() {
        let _ = write!(page, "\n{rules}");
    }
}

/// "string", "integer, 1 .. 65535", "duration", "table, see ...".
fn type_of(root: &Value, table: &Table, key: &str, own: &Value, resolved: &Value) -> String {
    let child = match table.path.as_str() {
        "" => key.to_string(),
        path => format!("{path}.{key}"),
    };
    if let Some((_, _, array)) = table_of(root, own) {
        let shape = match (array, resolved.get("anyOf").is_some()) {
            (true, _) => format!(
                "array of tables, see [`[[{child}]]`](#{})",
                anchor(&child, true)
            ),
            (false, true) => format!(
                "`\"reject\"` or a table, see [`[{child}]`](#{})",
                anchor(&child, false)
            ),
            (false, false) => format!("table, see [`[{child}]`](#{})", anchor(&child, false)),
        };
        return shape;
    }
    scalar_type(own, resolved)
}

fn scalar_type(own: &Value, resolved: &Value) -> String {
    if definition(own).as_deref() == Some("Duration") {
        return "duration".into();
    }
    if let Some(values) = enum_values(resolved) {
        let list: Vec<_> = values.iter().map(|(v, _)| format!("`\"{v}\"`")).collect();
        return format!("string: {}", list.join(" or "));
    }
    let base = match resolved.get("type").and_then(Value::as_str) {
        Some("array") => {
            let items = &resolved["items"];
            match definition(items).as_deref() {
                Some("Duration") => "array of durations".to_string(),
                _ => format!("array of {}s", text(items, "type")),
            }
        }
        Some(t) => t.to_string(),
        None => "value".to_string(),
    };
    let mut facts = Vec::new();
    let (min, max) = (&resolved["minimum"], &resolved["maximum"]);
    match (min.as_f64(), max.as_f64()) {
        (Some(lo), Some(hi)) => facts.push(format!("{lo} .. {hi}")),
        (Some(lo), None) if lo > 0.0 => facts.push(format!("at least {min}")),
        (None, Some(_)) => facts.push(format!("at most {max}")),
        _ => {}
    }
    match (resolved.get("minLength"), resolved.get("maxLength")) {
        (Some(lo), Some(hi)) => facts.push(format!("{lo} to {hi} characters")),
        (Some(lo), None) => facts.push(format!("at least {lo} characters")),
        (None, Some(hi)) => facts.push(format!("at most {hi} characters")),
        (None, None) => {}
    }
    if resolved.get("minItems").is_some_and(|n| n == 1) {
        facts.push("not empty".into());
    }
    if let Some(p) = resolved.get("pattern").and_then(Value::as_str) {
        facts.push(format!("matching `{p}`"));
    }
    match facts.is_empty() {
        true => base,
        false => format!("{base}, {}", facts.join(", ")),
    }
}

/// The values of a string enum and what each means.
fn enum_values(schema: &Value) -> Option<Vec<(String, String)>> {
    let choices = schema.get("oneOf").or(schema.get("anyOf"))?.as_array()?;
    choices
        .iter()
        .map(|c| {
            let value = c
                .get("const")
                .or(c.get("enum").and_then(|e| e.get(0)))?
                .as_str()?;
            Some((value.to_string(), text(c, "description")))
        })
        .collect()
}

fn default_of(own: &Value, resolved: &Value, required: bool) -> String {
    if let Some(default) = own.get("default").or(resolved.get("default")) {
        return format!("`{}`", toml_literal(default));
    }
    let example = own
        .get("examples")
        .and_then(|e| e.get(0))
        .map(|e| format!(" (example: `{}`)", toml_literal(e)))
        .unwrap_or_default();
    match required {
        true => format!("required{example}"),
        false => format!("not set{example}"),
    }
}

fn description_of(own: &Value, resolved: &Value) -> String {
    let mut text = one_paragraph(&text(own, "description"));
    if let Some(values) = enum_values(resolved) {
        for (value, meaning) in values {
            let _ = write!(text, " `\"{value}\"`: {}", one_paragraph(&meaning));
        }
    }
    text
}

/// The object's machine-readable rules, in words.
fn rules(schema: &Value) -> String {
    let mut out = String::new();
    let mut constraints = vec![schema];
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        constraints.extend(all);
    }
    for c in constraints {
        if let Some(pair) = c.pointer("/not/required").and_then(Value::as_array) {
            let names: Vec<_> = pair
                .iter()
                .map(|k| format!("`{}`", k.as_str().unwrap_or_default()))
                .collect();
            let _ = writeln!(out, "- Set at most one of {}.", names.join(", "));
        }
        if let Some(any) = c.get("anyOf").and_then(Value::as_array) {
            let names: Vec<_> = any
                .iter()
                .filter_map(|a| a.pointer("/required/0").and_then(Value::as_str))
                .map(|k| format!("`{k}`"))
                .collect();
            let _ = writeln!(out, "- Set one of {}.", names.join(", "));
        }
        if let Some(cond) = c.get("if") {
            let _ = writeln!(out, "- {}", condition(cond, &c["then"], &c["else"]));
        }
    }
    if let Some(deps) = schema.get("dependencies").and_then(Value::as_object) {
        for (key, needs) in deps {
            let needs: Vec<_> = needs
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            let _ = writeln!(out, "- `{key}` needs `{}`.", needs.join("`, `"));
        }
    }
    out
}

/// An `if`/`then`/`else` rule in words.
fn condition(cond: &Value, then: &Value, otherwise: &Value) -> String {
    let when = match cond.get("properties").and_then(Value::as_object) {
        Some(props) => props
            .iter()
            .map(|(k, v)| format!("`{k} = {}`", toml_literal(&v["const"])))
            .collect::<Vec<_>>()
            .join(" and "),
        None => {
            let keys = cond["required"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            format!("{} set", names(keys))
        }
    };
    let mut parts = Vec::new();
    if let Some(keys) = then.get("required").and_then(Value::as_array) {
        parts.push(format!("{} is required with {when}", names(keys)));
    }
    if otherwise.pointer("/not/required").is_some() {
        parts.push("refused otherwise".to_string());
    }
    if let Some(props) = then.get("properties").and_then(Value::as_object) {
        let forbidden = forbidden_paths(props, "");
        parts.push(format!("With {when}, {forbidden} is refused"));
    }
    format!("{}.", parts.join(", "))
}

fn names(keys: &[Value]) -> String {
    keys.iter()
        .filter_map(Value::as_str)
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `upstream.tls.server_name` from `{upstream: {properties: {tls: {not: ...}}}}`.
fn forbidden_paths(props: &serde_json::Map<String, Value>, prefix: &str) -> String {
    let mut out = Vec::new();
    for (key, sub) in props {
        let path = format!("{prefix}{key}");
        if let Some(keys) = sub.pointer("/not/required").and_then(Value::as_array) {
            for k in keys.iter().filter_map(Value::as_str) {
                out.push(format!("`{path}.{k}`"));
            }
        }
        if let Some(inner) = sub.get("properties").and_then(Value::as_object) {
            out.push(forbidden_paths(inner, &format!("{path}.")));
        }
    }
    out.join(", ")
}

fn durations(page: &mut String, root: &Value) {
    let d = &root["definitions"]["Duration"];
    let examples: Vec<_> = d["examples"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| format!("`{}`", toml_literal(e)))
        .collect();
    let _ = write!(
        page,
        "\n## Durations\n\n{} Examples: {}. The schema checks the shape with the \
         pattern `{}`; nackd's own check decides.\n",
        one_paragraph(&text(d, "description")),
        examples.join(", "),
        text(d, "pattern"),
    );
}

/// A JSON value as TOML writes it.
fn toml_literal(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        Value::Array(items) => {
            let items: Vec<_> = items.iter().map(toml_literal).collect();
            format!("[{}]", items.join(", "))
        }
        Value::Object(map) => {
            let items: Vec<_> = map
                .iter()
                .map(|(k, v)| format!("{k} = {}", toml_literal(v)))
                .collect();
            format!("{{ {} }}", items.join(", "))
        }
        Value::Number(n) if n.is_f64() => format!("{:?}", n.as_f64().unwrap_or_default()),
        other => other.to_string(),
    }
}

/// mdBook's heading anchor of a section.
fn anchor(path: &str, array: bool) -> String {
    let heading = match array {
        true => format!("[[{path}]]"),
        false => format!("[{path}]"),
    };
    heading
        .chars()
        .filter_map(|c| match c {
            'a'..='z' | '0'..='9' | '_' | '-' => Some(c),
            'A'..='Z' => Some(c.to_ascii_lowercase()),
            ' ' => Some('-'),
            _ => None,
        })
        .collect()
}

/// A doc comment's lines joined into one paragraph (table cells are one line).
fn one_paragraph(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

/// The generated files, by path from the crate root.
fn generated() -> [(&'static str, String); 2] {
    [
        ("deploy/nackd.schema.json", schema_file()),
        ("docs/src/reference/configuration.md", reference_page()),
    ]
}

#[test]
fn generated_files_are_current() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let regenerate = std::env::var_os("NACKD_REGENERATE").is_some();
    for (path, want) in generated() {
        let file = root.join(path);
        if regenerate {
            std::fs::create_dir_all(file.parent().expect("a directory")).unwrap();
            std::fs::write(&file, &want).unwrap();
            continue;
        }
        let have = std::fs::read_to_string(&file).unwrap_or_default();
        assert!(
            have == want,
            "{path} is not what the configuration structs say; regenerate it with\n  \
             NACKD_REGENERATE=1 cargo test -p nackd --lib config::schema\nand commit it"
        );
    }
}
