//! The configuration's JSON Schema, derived from the structs serde reads
//! (their doc comments, the defaults serde fills in, the ranges their
//! checks enforce): what `nackd config-schema` prints and
//! `deploy/nackd.schema.json` holds, for editors (Taplo / Even Better
//! TOML) and for the reference page `docs/src/reference/configuration.md`.

use schemars::generate::SchemaSettings;
use serde_json::Value;

use super::Config;

/// The JSON Schema (draft 7, which TOML editors read) of the configuration
/// file.
pub fn json_schema() -> Value {
    let generator = SchemaSettings::draft07().into_generator();
    let mut schema = generator.into_root_schema_for::<Config>().to_value();
    drop_null(&mut schema);
    schema
}

/// TOML has no null: an optional key is one that may be left out, so the
/// `null` schemars adds to `Option` fields only misleads an editor.
fn drop_null(value: &mut Value) {
    match value {
        Value::Object(map) => {
            if let Some(Value::Array(types)) = map.get_mut("type") {
                types.retain(|t| t != "null");
                if let [single] = types.as_slice() {
                    let single = single.clone();
                    map.insert("type".into(), single);
                }
            }
            for key in ["anyOf", "oneOf"] {
                if let Some(Value::Array(options)) = map.get_mut(key) {
                    options.retain(|o| o.get("type").is_none_or(|t| t != "null"));
                    // `Option<Table>`: what is left is the table itself.
                    // A `$ref` keeps no siblings in draft 7: it goes in an `allOf`.
                    if let [Value::Object(only)] = options.as_slice() {
                        let only = only.clone();
                        map.remove(key);
                        match only.contains_key("$ref") {
                            true => _ = map.insert("allOf".into(), Value::Array(vec![only.into()])),
                            false => map.extend(only),
                        }
                    }
                }
            }
            if map.get("default").is_some_and(Value::is_null) {
                map.remove("default");
            }
            map.values_mut().for_each(drop_null);
        }
        Value::Array(items) => items.iter_mut().for_each(drop_null),
        _ => {}
    }
}

#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod walk;
