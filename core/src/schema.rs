//! How values that serde reads through a function look in the
//! configuration's JSON Schema (`nackd config-schema`): types used only in
//! `#[schemars(with = ...)]`, never built.

use std::borrow::Cow;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};

/// A duration as the configuration writes it (`humantime`): numbers with
/// units, such as `"500ms"`, `"10s"`, `"5m"`, `"1h 30m"`.
pub struct Duration;

/// What [`Duration`] accepts, loosely (humantime decides): one or more
/// numbers, each followed by a unit, spaces allowed between. A bare number
/// (no unit) is refused, as humantime refuses it.
pub const DURATION_PATTERN: &str = r"^\s*([0-9]+\s*[A-Za-zµ]+\s*)+$";

impl JsonSchema for Duration {
    fn schema_name() -> Cow<'static, str> {
        "Duration".into()
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "string",
            "pattern": DURATION_PATTERN,
            "description": "A duration: numbers with units (ns, us, ms, s, m, h, d, w; `1h 30m` adds up), as the humantime crate reads them. A bare number without a unit is refused.",
            "examples": ["500ms", "10s", "5m", "1h 30m"]
        })
    }
}
