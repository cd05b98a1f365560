//! A valid frame described by its fields, for the structured round trip:
//! encode it, cut it out of a byte stream (whole and byte by byte), decode
//! it, and compare with what went in.
//!
//! The generator stays inside what the wire can carry both ways: short
//! strings are cut to 255 octets, floats are never NaN (NaN != NaN), and
//! field values never use the two types amq-protocol writes but cannot read
//! back as themselves (`ShortString`, written with tag `_`, and
//! `LongLongUInt`, written as `l` and read as `LongLongInt`).

use super::method_spec::MethodSpec;
use super::value::{short, table, TableSpec, Text};
use crate::protocol::content::ContentHeader;
use amq_protocol::protocol::basic;

/// One frame, or a whole publish, as nackd may send or receive it.
#[derive(Clone, Debug, arbitrary::Arbitrary)]
pub enum FrameSpec {
    /// A method nackd decodes.
    Method { channel: u16, method: MethodSpec },
    /// A content header frame (class 60).
    Header { channel: u16, header: HeaderSpec },
    /// A body frame.
    Body { channel: u16, body: Vec<u8> },
    /// A heartbeat (always channel 0).
    Heartbeat,
    /// `basic.publish`, header and body cut by `frame_max`, as nackd
    /// republishes a message.
    Publish {
        channel: u16,
        exchange: Text,
        routing_key: Text,
        mandatory: bool,
        header: HeaderSpec,
        body: Vec<u8>,
        frame_max: u16,
    },
}

/// A content header: body size and every basic property.
#[derive(Clone, Debug, arbitrary::Arbitrary)]
#[allow(missing_docs)]
pub struct HeaderSpec {
    pub body_size: u64,
    pub content_type: Option<Text>,
    pub content_encoding: Option<Text>,
    pub headers: Option<TableSpec>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<Text>,
    pub reply_to: Option<Text>,
    pub expiration: Option<Text>,
    pub message_id: Option<Text>,
    pub timestamp: Option<u64>,
    pub kind: Option<Text>,
    pub user_id: Option<Text>,
    pub app_id: Option<Text>,
    pub cluster_id: Option<Text>,
    /// The `x-retry-count` the round trip writes with `rewrite_headers`.
    pub retry: i64,
}

impl HeaderSpec {
    /// The properties this spec describes.
    pub fn properties(&self) -> basic::AMQPProperties {
        let mut p = basic::AMQPProperties::default();
        let text = |t: &Option<Text>| t.as_deref().map(short);
        if let Some(v) = text(&self.content_type) {
            p = p.with_content_type(v);
        }
        if let Some(v) = text(&self.content_encoding) {
            p = p.with_content_encoding(v);
        }
        if let Some(h) = &self.headers {
            p = p.with_headers(table(h));
        }
        if let Some(v) = self.delivery_mode {
            p = p.with_delivery_mode(v);
        }
        if let Some(v) = self.priority {
            p = p.with_priority(v);
        }
        if let Some(v) = text(&self.correlation_id) {
            p = p.with_correlation_id(v);
        }
        if let Some(v) = text(&self.reply_to) {
            p = p.with_reply_to(v);
        }
        if let Some(v) = text(&self.expiration) {
            p = p.with_expiration(v);
        }
        if let Some(v) = text(&self.message_id) {
            p = p.with_message_id(v);
        }
        if let Some(v) = self.timestamp {
            p = p.with_timestamp(v);
        }
        if let Some(v) = text(&self.kind) {
            p = p.with_type(v);
        }
        if let Some(v) = text(&self.user_id) {
            p = p.with_user_id(v);
        }
        if let Some(v) = text(&self.app_id) {
            p = p.with_app_id(v);
        }
        if let Some(v) = text(&self.cluster_id) {
            p = p.with_cluster_id(v);
        }
        p
    }

    /// The decoded header this spec describes, announcing `body_size`.
    pub fn content_header(&self, body_size: u64) -> ContentHeader {
        ContentHeader {
            class_id: 60,
            body_size,
            properties: self.properties(),
        }
    }
}
