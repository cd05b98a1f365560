//! What the broker would refuse with a channel or connection error, found
//! before a message is sent: a content header that cannot fit in one frame,
//! names longer than a short string, and whose `user_id` it is.

use super::{Publish, SetAside};
use crate::metrics::BlockReason;
use nackd_core::protocol::frame::FRAME_OVERHEAD;

/// Flag bit of the `user-id` property.
const USER_ID_FLAG: u16 = 1 << 4;

/// What the broker would refuse with a channel or connection error, found
/// before sending.
pub(super) fn precheck(p: &Publish, frame_max: u32) -> Result<(), SetAside> {
    let aside = |reason, reply: String| {
        Err(SetAside {
            reason,
            reply,
            exchange_wide: false,
        })
    };
    let frame = p.header.len() + FRAME_OVERHEAD;
    if frame > frame_max as usize {
        return aside(
            BlockReason::FrameMax,
            format!(
                "its content header frame of {frame} bytes exceeds the negotiated frame_max {}: it cannot be published",
                frame_max
            ),
        );
    }
    if p.exchange().len() > 255 || p.routing_key().len() > 255 {
        return aside(
            BlockReason::ChannelError,
            "exchange or routing key longer than 255 bytes".into(),
        );
    }
    Ok(())
}

/// The message's `user_id` property, if it is not `username`.
pub(super) fn foreign_user_id(p: &Publish, username: &str) -> Option<String> {
    let flags = p
        .header
        .get(12..14)
        .map(|f| u16::from_be_bytes([f[0], f[1]]))?;
    if flags & USER_ID_FLAG == 0 {
        return None;
    }
    let header = nackd_core::protocol::content::decode_header(&p.header).ok()?;
    let user = header.properties.user_id().clone()?;
    (user.as_str() != username).then(|| user.as_str().to_string())
}
