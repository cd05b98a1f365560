//! Field values for the frame specs: the leaves that both the frame and
//! the method specs are made of (kept below both, so neither imports the
//! other).

use amq_protocol::types::{
    AMQPValue, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
};

/// Text of a short string; cut to 255 octets when encoded.
pub type Text = String;
/// A field table as (key, value) pairs; a later duplicate key wins.
pub type TableSpec = Vec<(Text, ValueSpec)>;

/// Containers nested deeper than this become `Void`: the round trip checks
/// values, the byte-level targets check hostile nesting.
const MAX_DEPTH: usize = 8;

/// A field value of every type RabbitMQ and amq-protocol agree on.
#[derive(Clone, Debug, arbitrary::Arbitrary)]
#[allow(missing_docs)]
pub enum ValueSpec {
    Bool(bool),
    I8(i8),
    U8(u8),
    I16(i16),
    U16(u16),
    I32(i32),
    U32(u32),
    I64(i64),
    /// IEEE bits; NaN becomes 0.
    F32(u32),
    /// IEEE bits; NaN becomes 0.
    F64(u64),
    Decimal(u8, u32),
    LongString(Vec<u8>),
    Array(Vec<ValueSpec>),
    Timestamp(u64),
    Table(TableSpec),
    Bytes(Vec<u8>),
    Void,
}

/// `text` cut to at most 255 octets on a char boundary.
pub fn short(text: &str) -> ShortString {
    let mut end = text.len().min(255);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].into()
}

/// The field table a [`TableSpec`] describes.
pub fn table(spec: &TableSpec) -> FieldTable {
    table_at(spec, 0)
}

fn table_at(spec: &TableSpec, depth: usize) -> FieldTable {
    let mut out = FieldTable::default();
    for (key, value) in spec {
        out.insert(short(key), value.value(depth + 1));
    }
    out
}

impl ValueSpec {
    fn value(&self, depth: usize) -> AMQPValue {
        use AMQPValue as V;
        match self {
            Self::Bool(b) => V::Boolean(*b),
            Self::I8(v) => V::ShortShortInt(*v),
            Self::U8(v) => V::ShortShortUInt(*v),
            Self::I16(v) => V::ShortInt(*v),
            Self::U16(v) => V::ShortUInt(*v),
            Self::I32(v) => V::LongInt(*v),
            Self::U32(v) => V::LongUInt(*v),
            Self::I64(v) => V::LongLongInt(*v),
            Self::F32(bits) => V::Float(
                Some(f32::from_bits(*bits))
                    .filter(|f| !f.is_nan())
                    .unwrap_or(0.0),
            ),
            Self::F64(bits) => V::Double(
                Some(f64::from_bits(*bits))
                    .filter(|f| !f.is_nan())
                    .unwrap_or(0.0),
            ),
            Self::Decimal(scale, value) => V::DecimalValue(DecimalValue {
                scale: *scale,
                value: *value,
            }),
            Self::LongString(bytes) => V::LongString(LongString::from(bytes.clone())),
            Self::Timestamp(t) => V::Timestamp(*t),
            Self::Bytes(bytes) => V::ByteArray(bytes.clone().into()),
            Self::Void => V::Void,
            _ if depth >= MAX_DEPTH => V::Void,
            Self::Array(items) => V::FieldArray(FieldArray::from(
                items.iter().map(|v| v.value(depth + 1)).collect::<Vec<_>>(),
            )),
            Self::Table(spec) => V::FieldTable(table_at(spec, depth)),
        }
    }
}
