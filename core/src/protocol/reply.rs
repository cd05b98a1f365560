//! AMQP 0-9-1 reply codes nackd sends or maps its errors to.

/// The reply codes of the AMQP 0-9-1 spec that nackd uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ReplyCode {
    /// 200: normal close.
    Success = 200,
    /// 320: the server (here: nackd or its upstream) forced the close.
    ConnectionForced = 320,
    /// 501: a frame that could not be decoded.
    FrameError = 501,
    /// 502: illegal values in a method's fields.
    SyntaxError = 502,
    /// 503: a method that is invalid in the current state.
    CommandInvalid = 503,
    /// 504: a channel that is not open, or beyond `channel_max`.
    ChannelError = 504,
    /// 505: a frame that was not expected where it came.
    UnexpectedFrame = 505,
    /// 506: the server ran out of a resource.
    ResourceError = 506,
    /// 530: not allowed.
    NotAllowed = 530,
    /// 540: a method the server (here: nackd) does not implement.
    NotImplemented = 540,
    /// 541: the server hit an internal error.
    InternalError = 541,
}

impl ReplyCode {
    /// The numeric code carried in `connection.close`.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The spec's name of the code, as RabbitMQ puts it in front of reply texts.
    pub fn name(self) -> &'static str {
        match self {
            Self::Success => "NORMAL",
            Self::ConnectionForced => "CONNECTION_FORCED",
            Self::FrameError => "FRAME_ERROR",
            Self::SyntaxError => "SYNTAX_ERROR",
            Self::CommandInvalid => "COMMAND_INVALID",
            Self::ChannelError => "CHANNEL_ERROR",
            Self::UnexpectedFrame => "UNEXPECTED_FRAME",
            Self::ResourceError => "RESOURCE_ERROR",
            Self::NotAllowed => "NOT_ALLOWED",
            Self::NotImplemented => "NOT_IMPLEMENTED",
            Self::InternalError => "INTERNAL_ERROR",
        }
    }
}
