//! The two sides of a pair, and what either side's protocol fault is.

use crate::protocol::frame::FrameError;

/// A side of the pair, by who sent the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// The application's connection.
    Client,
    /// nackd's connection to the broker, on the client's behalf.
    Upstream,
}

/// A protocol fault of either side (closes the connection with its reply code).
pub(super) type Fault = FrameError;
