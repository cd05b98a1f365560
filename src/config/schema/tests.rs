//! The schema against the parser: every key serde accepts is documented,
//! every documented key is accepted, unknown keys are refused by name, and
//! the shipped files pass both.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::walk::{table_of, tables};
use crate::config::Config;

fn schema() -> Value {
    super::json_schema()
}

fn validator(schema: &Value) -> jsonschema::Validator {
    jsonschema::draft7::new(schema).expect("a valid draft 7 schema")
}

/// The schema's complaints about `doc`, one line each.
fn complaints(validator: &jsonschema::Validator, doc: &Value) -> Vec<String> {
    validator
        .iter_errors(doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect()
}

/// `text` checked as `nackd --check-config` reads a file: from disk, by
/// [`Config::load`].
fn load(text: &str) -> Result<Config, String> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nackd.toml");
    std::fs::write(&path, text).unwrap();
    Config::load(&path).map_err(|e| e.to_string())
}

#[test]
fn every_key_serde_accepts_is_documented_with_its_default() {
    let root = schema();
    let mut documented = 0;
    for table in tables(&root) {
        let properties = table.schema["properties"].as_object().unwrap();
        let in_schema: BTreeSet<&str> = properties.keys().map(String::as_str).collect();
        let in_serde: BTreeSet<&str> = table.keys.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            in_schema, in_serde,
            "[{}]: the keys serde accepts and the schema's differ",
            table.path
        );
        let required: Vec<&Value> = table.schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .collect();
        for (key, resolved) in &table.keys {
            let own = &properties[*key];
            let path = format!("{}.{key}", table.path);
            let description = own.get("description").or(resolved.get("description"));
            assert!(
                description
                    .and_then(Value::as_str)
                    .is_some_and(|d| !d.trim().is_empty()),
                "{path}: no description (a doc comment on the field)"
            );
            let is_table = table_of(&root, own).is_some();
            let has_value = own.get("default").is_some() || own.get("examples").is_some();
            let required = required.iter().any(|r| *r == key);
            assert!(
                is_table || has_value,
                "{path}: neither a default nor an example (#[schemars(example = ...)]); required: {required}"
            );
            documented += 1;
        }
    }
    // The file has some 90 keys: a walk that found few lost its way.
    assert!(documented > 60, "only {documented} keys walked");
}

#[test]
fn a_documented_default_is_the_parsers_default() {
    // An empty file, and one with every table of the defaults written out,
    // parse to the same configuration.
    let root = schema();
    let mut defaults = Map::new();
    for key in [
        "listen",
        "upstream",
        "republish",
        "store",
        "metrics",
        "limits",
        "runtime",
    ] {
        let (_, table, _) = table_of(&root, &root["properties"][key]).unwrap();
        defaults.insert(key.into(), Value::Object(defaults_of(&root, table)));
    }
    let text = toml::to_string(&defaults).unwrap();
    let written = load(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let empty = load("").unwrap();
    assert_eq!(format!("{written:?}"), format!("{empty:?}"), "\n{text}");
}

/// The keys of a table that have a default, with it; its sub-tables'
/// likewise (left out when none of their keys has one).
fn defaults_of(root: &Value, table: &Value) -> Map<String, Value> {
    let mut out = Map::new();
    for (key, own) in table["properties"].as_object().unwrap() {
        if let Some(default) = own.get("default") {
            out.insert(key.clone(), default.clone());
        } else if let Some((_, inner, false)) = table_of(root, own) {
            let inner = defaults_of(root, inner);
            if !inner.is_empty() {
                out.insert(key.clone(), Value::Object(inner));
            }
        }
    }
    out
}

#[test]
fn every_documented_key_is_accepted() {
    let root = schema();
    let validator = validator(&root);
    let mut covered = BTreeSet::new();
    for choice in choices() {
        let doc = document(&root, choice);
        let problems = complaints(&validator, &doc);
        let text = toml::to_string(&doc).unwrap();
        assert!(problems.is_empty(), "{choice:?}: {problems:#?}\n{text}");
        load(&text).unwrap_or_else(|e| panic!("{choice:?}: {e}\n{text}"));
        paths(&doc, "", &mut covered);
    }
    let documented: BTreeSet<String> = tables(&root)
        .iter()
        .flat_map(|t| {
            t.keys.iter().map(move |(k, _)| match t.path.as_str() {
                "" => k.to_string(),
                p => format!("{p}.{k}"),
            })
        })
        .collect();
    let missed: Vec<_> = documented.difference(&covered).collect();
    assert!(
        missed.is_empty(),
        "documented keys no test document set: {missed:?}"
    );
}

#[test]
fn an_unknown_key_stops_startup_naming_it() {
    let root = schema();
    let docs: Vec<_> = choices().map(|c| document(&root, c)).collect();
    let mut tested = 0;
    for table in tables(&root) {
        // The first document that has the table.
        let Some(mut typo) = docs
            .iter()
            .find(|d| table_mut(&mut (*d).clone(), &table.path).is_some())
            .cloned()
        else {
            panic!("[{}]: in no test document", table.path);
        };
        let target = table_mut(&mut typo, &table.path).unwrap();
        target.insert("typo_key".into(), Value::from(1));
        let text = toml::to_string(&typo).unwrap();
        let e = load(&text).expect_err(&text);
        assert!(e.contains("typo_key"), "[{}]: {e}", table.path);
        let first = table.path.split('.').next().unwrap_or_default();
        assert!(e.contains(first), "[{}]: {e}", table.path);
        tested += 1;
    }
    assert!(tested >= 17, "only {tested} tables tried");
}

/// The table at a dotted path of `doc` (the first of an array).
fn table_mut<'a>(doc: &'a mut Value, path: &str) -> Option<&'a mut Map<String, Value>> {
    let mut at = doc;
    for key in path.split('.').filter(|k| !k.is_empty()) {
        at = at.get_mut(key)?;
        if at.is_array() {
            at = at.get_mut(0)?;
        }
    }
    at.as_object_mut()
}

#[test]
fn the_schema_refuses_what_the_parser_refuses() {
    let root = schema();
    let validator = validator(&root);
    for text in [
        "[listen]\nadress = \"127.0.0.1:1\"\n",
        "[republish]\nconfirm_window = 0\n",
        "[republish]\npassword = \"a\"\npassword_env = \"B\"\n",
        "[limits]\nhandshake_timeout = \"soon\"\n",
        "[limits]\nmax_frame = 4096\n",
        "[runtime]\nscheduling = \"fifo\"\n",
        "[metrics]\nadmin_token = \"short\"\n",
        "[republish.queue_gone]\naction = \"dead-letter\"\n",
        "[[policy]]\nqueues = [\"q\"]\n",
        "[[policy]]\nqueues = [\"q\"]\ndelays = [\"1s\"]\nmax_retries = 3\n",
        "[[policy]]\nqueues = [\"q\"]\ndelays = [\"1s\"]\non_exhausted = { exchange = \"x\", routng_key = \"y\" }\n",
    ] {
        let doc: Value = serde_json::to_value(toml::from_str::<toml::Table>(text).unwrap()).unwrap();
        assert!(load(text).is_err(), "the parser takes {text}");
        assert!(!complaints(&validator, &doc).is_empty(), "the schema takes {text}");
    }
}

#[test]
fn shipped_configs_pass_the_schema_and_the_parser() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<PathBuf> = vec![
        root.join("deploy/nackd.system.toml"),
        root.join("deploy/nackd.container.toml"),
    ];
    for entry in std::fs::read_dir(root.join("config")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            files.push(path);
        }
    }
    let schema = schema();
    let validator = validator(&schema);
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let doc = serde_json::to_value(toml::from_str::<toml::Table>(&text).unwrap()).unwrap();
        let problems = complaints(&validator, &doc);
        assert!(problems.is_empty(), "{}: {problems:#?}", file.display());
        Config::load(&file).unwrap_or_else(|e| panic!("{e}"));
    }
}

#[test]
fn the_schema_is_a_valid_draft_7_schema() {
    let schema = schema();
    assert_eq!(schema["$schema"], "http://json-schema.org/draft-07/schema#");
    jsonschema::meta::validate(&schema).unwrap();
}

/// Test document number n. Even ones give each key its default (its
/// example where it has none) and let a condition decide what it forbids;
/// odd ones prefer examples and make conditions forbid nothing. Of keys
/// that exclude each other (`not: {required: [a, b]}` rules, grouped), the
/// n-th of each group is kept: [`DOCUMENTS`] documents set every key of a
/// group of up to that many.
#[derive(Clone, Copy, Debug)]
struct Choice(usize);

impl Choice {
    fn defaults(self) -> bool {
        self.0.is_multiple_of(2)
    }
}

/// Five: `[upstream]` has five keys that exclude each other (`address`,
/// `addresses`, `uri`, `uri_env`, `uri_file`).
const DOCUMENTS: usize = 5;

fn choices() -> impl Iterator<Item = Choice> {
    (0..DOCUMENTS).map(Choice)
}

/// A configuration that sets every key the schema documents that `choice`
/// allows together, built from the schema alone.
fn document(root: &Value, choice: Choice) -> Value {
    table(root, root, choice, "")
}

fn table(root: &Value, schema: &Value, choice: Choice, path: &str) -> Value {
    let mut out = Map::new();
    for (key, own) in schema["properties"].as_object().unwrap() {
        let path = format!("{path}{key}");
        out.insert(key.clone(), value(root, own, choice, &path));
    }
    constrain(schema, &mut out, choice);
    Value::Object(out)
}

fn value(root: &Value, own: &Value, choice: Choice, path: &str) -> Value {
    let default = own.get("default");
    let example = own.get("examples").and_then(|e| e.get(0));
    let picked = match choice.defaults() {
        true => default.or(example),
        false => example.or(default),
    };
    match table_of(root, own) {
        // `on_exhausted`: its default ("reject"), or the table.
        Some(_) if choice.defaults() && picked.is_some() => picked.unwrap().clone(),
        Some((_, inner, array)) => {
            let t = table(root, inner, choice, &format!("{path}."));
            match array {
                true => Value::Array(vec![t]),
                false => t,
            }
        }
        None => picked
            .unwrap_or_else(|| panic!("{path}: neither a default nor an example"))
            .clone(),
    }
}

/// Applies the object's rules to `out`: of keys that exclude each other
/// one stays; an `if` either decides (even documents) or is made to forbid
/// nothing (odd ones).
fn constrain(schema: &Value, out: &mut Map<String, Value>, choice: Choice) {
    let mut rules = vec![schema];
    rules.extend(
        schema
            .get("allOf")
            .and_then(Value::as_array)
            .into_iter()
            .flatten(),
    );
    exclusions(&rules, out, choice);
    for rule in rules {
        if let Some(cond) = rule.get("if") {
            conditional(cond, &rule["then"], &rule["else"], out, choice);
        }
    }
}

/// The `not: {required: [a, b]}` rules: in each group of keys they link,
/// the `choice`-th stays and the keys excluded with it go; a pair still
/// both present loses its second.
fn exclusions(rules: &[&Value], out: &mut Map<String, Value>, choice: Choice) {
    let pairs: Vec<[&str; 2]> = rules
        .iter()
        .filter_map(|r| r.pointer("/not/required").and_then(Value::as_array))
        .map(|p| [p[0].as_str().unwrap(), p[1].as_str().unwrap()])
        .collect();
    let mut groups: Vec<Vec<&str>> = Vec::new();
    for pair in &pairs {
        let linked: Vec<usize> = (0..groups.len())
            .filter(|&g| pair.iter().any(|k| groups[g].contains(k)))
            .collect();
        let mut group: Vec<&str> = Vec::new();
        for g in linked.into_iter().rev() {
            group.splice(0..0, groups.remove(g));
        }
        for k in pair {
            if !group.contains(k) {
                group.push(k);
            }
        }
        groups.push(group);
    }
    for group in groups {
        let keep = group[choice.0 % group.len()];
        for [a, b] in &pairs {
            match (*a == keep, *b == keep) {
                (true, _) => _ = out.remove(*b),
                (_, true) => _ = out.remove(*a),
                _ => {}
            }
        }
    }
    for [a, b] in &pairs {
        if out.contains_key(*a) {
            out.remove(*b);
        }
    }
}

fn conditional(
    cond: &Value,
    then: &Value,
    otherwise: &Value,
    out: &mut Map<String, Value>,
    choice: Choice,
) {
    let holds = |out: &Map<String, Value>| {
        let present = cond["required"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|k| out.contains_key(k.as_str().unwrap()));
        let equal = cond["properties"]
            .as_object()
            .into_iter()
            .flatten()
            .all(|(k, v)| out.get(k) == Some(&v["const"]));
        present && equal
    };
    if !choice.defaults() {
        // Make the branch that forbids nothing apply.
        let then_forbids = then.get("not").is_some() || then.get("properties").is_some();
        match then_forbids {
            true => cond["required"]
                .as_array()
                .into_iter()
                .flatten()
                .for_each(|k| {
                    out.remove(k.as_str().unwrap());
                }),
            false => {
                for (k, v) in cond["properties"].as_object().into_iter().flatten() {
                    out.insert(k.clone(), v["const"].clone());
                }
            }
        }
    }
    let branch = match holds(out) {
        true => then,
        false => otherwise,
    };
    forbid(branch, out);
}

/// Removes what a `then`/`else` branch forbids (`not.required`, also in
/// nested `properties`).
fn forbid(branch: &Value, out: &mut Map<String, Value>) {
    for k in branch
        .pointer("/not/required")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out.remove(k.as_str().unwrap());
    }
    for (key, sub) in branch
        .get("properties")
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
    {
        if let Some(Value::Object(inner)) = out.get_mut(key) {
            forbid(sub, inner);
        }
    }
}

/// Every dotted key path set in `doc` (arrays: their first table).
fn paths(doc: &Value, prefix: &str, into: &mut BTreeSet<String>) {
    for (key, v) in doc.as_object().into_iter().flatten() {
        let path = format!("{prefix}{key}");
        into.insert(path.clone());
        let inner = match v {
            Value::Array(items) => items.first(),
            other => Some(other),
        };
        if let Some(inner @ Value::Object(_)) = inner {
            paths(inner, &format!("{path}."), into);
        }
    }
}

#[test]
fn keys_that_exclude_each_other_are_each_kept_by_some_document() {
    // Three ways to give one secret (inline, variable, file): each
    // document keeps one, and the first three keep each once.
    let rules: Vec<Value> = [["a", "b"], ["a", "c"], ["b", "c"]]
        .iter()
        .map(|pair| serde_json::json!({ "not": { "required": pair } }))
        .collect();
    let rules: Vec<&Value> = rules.iter().collect();
    let kept: Vec<Vec<String>> = (0..3)
        .map(|n| {
            let mut out: Map<String, Value> = ["a", "b", "c"]
                .iter()
                .map(|k| (k.to_string(), Value::from(1)))
                .collect();
            exclusions(&rules, &mut out, Choice(n));
            out.keys().cloned().collect()
        })
        .collect();
    assert_eq!(kept, [["a"], ["b"], ["c"]]);
}
