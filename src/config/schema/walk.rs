//! The JSON Schema as a list of TOML tables, in the order the structs
//! declare their keys: what the reference page and the tests walk.

use serde::de::{Deserialize, Deserializer, Visitor};
use serde_json::Value;

use crate::config::*;
use nackd_core::policy::DeadLetterTable;

/// One table of the file: `listen.tls`, `[[policy]]`, `policy.backoff`.
pub(super) struct Table<'a> {
    /// Dotted path (`republish.queue_gone`; `policy` for `[[policy]]`).
    pub path: String,
    /// An array of tables (`[[policy]]`).
    pub array: bool,
    /// Description of the table (its key's, else its type's).
    pub description: String,
    /// Its object schema (`properties`, `required`, constraints).
    pub schema: &'a Value,
    /// Its keys in declaration order, with their schemas (refs resolved).
    pub keys: Vec<(&'static str, &'a Value)>,
}

/// The keys serde accepts in each table type, in declaration order, by the
/// schema's name for the type. A struct added to the configuration needs a
/// line here; [`tables`] says so when one is missing.
pub(super) fn serde_keys(name: &str) -> &'static [&'static str] {
    match name {
        "Config" => keys::<Config>(),
        "Listen" => keys::<Listen>(),
        "ServerTls" => keys::<ServerTls>(),
        "Upstream" => keys::<Upstream>(),
        "ClientTls" => keys::<ClientTls>(),
        "Republish" => keys::<Republish>(),
        "QueueGone" => keys::<QueueGone>(),
        "Store" => keys::<Store>(),
        "Metrics" => keys::<Metrics>(),
        "Limits" => keys::<Limits>(),
        "Runtime" => keys::<Runtime>(),
        "Replica" => keys::<Replica>(),
        "Delayed" => keys::<Delayed>(),
        "DelayedExchange" => keys::<DelayedExchange>(),
        "PolicyConfig" => keys::<PolicyConfig>(),
        "BackoffConfig" => keys::<BackoffConfig>(),
        "DeadLetterTable" => keys::<DeadLetterTable>(),
        other => panic!(
            "the schema has a table type {other:?} that src/config/schema/walk.rs \
             (serde_keys) does not list: add it"
        ),
    }
}

/// Every table reachable from the root, depth first, in declaration order.
pub(super) fn tables(root: &Value) -> Vec<Table<'_>> {
    let mut out = Vec::new();
    let description = text(root, "description");
    visit(
        root,
        root,
        "Config",
        String::new(),
        false,
        description,
        &mut out,
    );
    out
}

fn visit<'a>(
    root: &'a Value,
    schema: &'a Value,
    name: &str,
    path: String,
    array: bool,
    description: String,
    out: &mut Vec<Table<'a>>,
) {
    let properties = schema["properties"]
        .as_object()
        .unwrap_or_else(|| panic!("{path}: a table without properties"));
    let keys: Vec<_> = serde_keys(name)
        .iter()
        .filter_map(|k| properties.get(*k).map(|s| (*k, resolve(root, s))))
        .collect();
    let names: Vec<_> = keys.iter().map(|(k, _)| *k).collect();
    out.push(Table {
        path: path.clone(),
        array,
        description,
        schema,
        keys,
    });
    for key in names {
        let Some((ty, inner, array)) = table_of(root, &properties[key]) else {
            continue;
        };
        let child = match path.as_str() {
            "" => key.to_string(),
            _ => format!("{path}.{key}"),
        };
        let description = match text(&properties[key], "description") {
            d if d.is_empty() => text(inner, "description"),
            d => d,
        };
        visit(root, inner, &ty, child, array, description, out);
    }
}

/// The table type a key holds, directly, as an array of tables, or as one
/// choice of several (`on_exhausted`): (type name, its schema, array).
pub(super) fn table_of<'a>(root: &'a Value, key: &'a Value) -> Option<(String, &'a Value, bool)> {
    if let Some(name) = ref_name(key) {
        let def = resolve(root, key);
        return match def.get("properties") {
            Some(_) => Some((name, def, false)),
            None => table_of(root, def),
        };
    }
    if let Some(items) = key.get("items") {
        return table_of(root, items).map(|(n, s, _)| (n, s, true));
    }
    let choices = key.get("anyOf").and_then(Value::as_array)?;
    choices.iter().find_map(|c| table_of(root, c))
}

/// The definition a `$ref` (or a lone `allOf: [{$ref}]`) names.
fn ref_name(schema: &Value) -> Option<String> {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        return r.strip_prefix("#/definitions/").map(str::to_string);
    }
    match schema
        .get("allOf")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
    {
        Some([only]) => ref_name(only),
        _ => None,
    }
}

/// A key's schema with its `$ref` followed; the key's own description,
/// default and examples win over the definition's.
pub(super) fn resolve<'a>(root: &'a Value, schema: &'a Value) -> &'a Value {
    match ref_name(schema) {
        Some(name) => &root["definitions"][name.as_str()],
        None => schema,
    }
}

/// The name of the definition a key refers to (`Duration`), if any.
pub(super) fn definition(schema: &Value) -> Option<String> {
    ref_name(schema)
}

/// A string member, or "".
pub(super) fn text(schema: &Value, member: &str) -> String {
    schema
        .get(member)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

/// The keys serde accepts for `T`: the field list its derived
/// `Deserialize` hands `deserialize_struct` (serde's own, so renames and
/// skips are as the parser sees them).
fn keys<'de, T: Deserialize<'de>>() -> &'static [&'static str] {
    let mut fields = None;
    let _ = T::deserialize(FieldProbe(&mut fields));
    fields.expect("a struct with named fields")
}

/// A deserializer that only records the field list of the struct asked
/// for, then stops.
struct FieldProbe<'a>(&'a mut Option<&'static [&'static str]>);

#[derive(Debug)]
struct Stop;

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("field list recorded")
    }
}

impl std::error::Error for Stop {}

impl serde::de::Error for Stop {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Stop
    }
}

impl<'de> Deserializer<'de> for FieldProbe<'_> {
    type Error = Stop;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Stop> {
        Err(Stop)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Stop> {
        *self.0 = Some(fields);
        Err(Stop)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct newtype_struct seq tuple
        tuple_struct map enum identifier ignored_any
    }
}
