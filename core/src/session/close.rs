//! The closing handshake of a client/broker pair.

use std::time::Instant;

use super::{CLOSE_TIMEOUT, SETTLE_TIMEOUT};

/// Who sent the `connection.close` a side has to answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Origin {
    /// The client: the broker's close-ok is relayed to it.
    Client,
    /// The broker: the client's close-ok is relayed to it.
    Broker,
    /// nackd itself: the close-ok is swallowed.
    Nackd,
}

/// Where the pair is in closing.
#[derive(Debug, Default)]
pub(super) struct Close {
    since: Option<Instant>,
    await_client: Option<Origin>,
    await_upstream: Option<Origin>,
    /// The client socket is closed (nothing is read from or written to it).
    client_gone: bool,
    /// The upstream socket is closed.
    upstream_gone: bool,
    /// The client broke the protocol: its frames are no longer forwarded.
    client_failed: bool,
    /// Shutdown asked this session to close.
    forced: bool,
    /// Claimed messages are still being stored: their acks must go out first.
    settling: bool,
    /// The broker sent `connection.close`: it applies nothing more.
    broker_closed: bool,
    /// A close-ok went to a client that had broken the protocol: its
    /// further `connection.close` frames get no reply (one is the
    /// handshake; more would queue replies for a client that may not read).
    answered_failed_client: bool,
}

impl Close {
    /// The client socket is closed (nothing is read from or written to it).
    pub(super) fn client_gone(&self) -> bool {
        self.client_gone
    }

    /// The upstream socket is closed.
    pub(super) fn upstream_gone(&self) -> bool {
        self.upstream_gone
    }

    /// The client broke the protocol: its frames are no longer forwarded.
    pub(super) fn client_failed(&self) -> bool {
        self.client_failed
    }

    /// Shutdown asked this session to close.
    pub(super) fn forced(&self) -> bool {
        self.forced
    }

    /// The broker sent `connection.close`: it applies nothing more.
    pub(super) fn broker_closed(&self) -> bool {
        self.broker_closed
    }

    /// The client socket closed.
    pub(super) fn on_client_gone(&mut self) {
        self.client_gone = true;
    }

    /// The upstream socket closed.
    pub(super) fn on_upstream_gone(&mut self) {
        self.upstream_gone = true;
    }

    /// The client broke the protocol.
    pub(super) fn on_client_failed(&mut self) {
        self.client_failed = true;
    }

    /// Shutdown asks this session to close.
    pub(super) fn on_forced(&mut self) {
        self.forced = true;
    }

    /// The broker sent `connection.close`.
    pub(super) fn on_broker_close(&mut self) {
        self.broker_closed = true;
    }

    /// Claimed messages are being stored (`true`) or no longer waited for:
    /// while they are, the close waits (see [`Close::finished`]).
    pub(super) fn set_settling(&mut self, settling: bool) {
        self.settling = settling;
    }

    /// A client that broke the protocol sent `connection.close`: `true`
    /// the first time (it gets a close-ok), `false` after.
    pub(super) fn answer_failed_client(&mut self) -> bool {
        !std::mem::replace(&mut self.answered_failed_client, true)
    }

    /// Marks the start of closing (the close timeout runs from here).
    pub(super) fn begin(&mut self, now: Instant) {
        self.since.get_or_insert(now);
    }

    /// Restarts the close timeout, if closing has begun (a close that was
    /// held back goes on now).
    pub(super) fn restart(&mut self, now: Instant) {
        if self.since.is_some() {
            self.since = Some(now);
        }
    }

    /// Whether closing has begun.
    pub(super) fn started(&self) -> bool {
        self.since.is_some()
    }

    /// A `connection.close` went to the client; its close-ok is awaited.
    pub(super) fn expect_client_close_ok(&mut self, origin: Origin, now: Instant) {
        self.begin(now);
        self.await_client = Some(origin);
    }

    /// A `connection.close` went to the broker; its close-ok is awaited.
    pub(super) fn expect_upstream_close_ok(&mut self, origin: Origin, now: Instant) {
        self.begin(now);
        self.await_upstream = Some(origin);
    }

    /// The client answered; returns whose close it answered.
    pub(super) fn client_close_ok(&mut self) -> Option<Origin> {
        self.await_client.take()
    }

    /// The broker answered; returns whose close it answered.
    pub(super) fn upstream_close_ok(&mut self) -> Option<Origin> {
        self.await_upstream.take()
    }

    /// The close the client still has to answer, if any.
    pub(super) fn awaiting_client(&self) -> Option<Origin> {
        self.await_client
    }

    /// The close the broker still has to answer, if any.
    pub(super) fn awaiting_upstream(&self) -> Option<Origin> {
        self.await_upstream
    }

    /// Whether the session can end: both sockets gone, or closing begun and
    /// no live side owes a close-ok, or the close timeout passed.
    pub(super) fn finished(&self, now: Instant) -> bool {
        if self.client_gone && self.upstream_gone {
            return true;
        }
        let Some(since) = self.since else {
            return false;
        };
        // The session gives unanswered claims up after SETTLE_TIMEOUT (and
        // clears `settling`); this bound only backs that up.
        if self.settling && !self.upstream_gone && now.duration_since(since) < SETTLE_TIMEOUT * 2 {
            return false;
        }
        let client_owes = self.await_client.is_some() && !self.client_gone;
        let upstream_owes = self.await_upstream.is_some() && !self.upstream_gone;
        (!client_owes && !upstream_owes) || now.duration_since(since) > CLOSE_TIMEOUT
    }

    /// A short word for the log line at the end.
    pub(super) fn reason(&self) -> &'static str {
        match (
            self.forced,
            self.client_failed,
            self.client_gone,
            self.upstream_gone,
        ) {
            (true, ..) => "shutdown",
            (_, true, ..) => "client protocol error",
            (_, _, true, false) => "client socket closed",
            (_, _, false, true) => "upstream lost",
            _ => "closed",
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // tests time with the real clock
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn client_initiated_close_waits_for_the_broker() {
        let mut c = Close::default();
        let now = Instant::now();
        assert!(!c.finished(now));
        c.expect_upstream_close_ok(Origin::Client, now);
        assert!(!c.finished(now));
        assert_eq!(c.upstream_close_ok(), Some(Origin::Client));
        assert!(c.finished(now));
    }

    #[test]
    fn a_gone_side_owes_nothing_and_timeouts_end_everything() {
        let mut c = Close::default();
        let now = Instant::now();
        c.expect_client_close_ok(Origin::Nackd, now);
        c.expect_upstream_close_ok(Origin::Nackd, now);
        assert!(!c.finished(now));
        c.client_gone = true;
        assert!(!c.finished(now));
        assert!(c.finished(now + CLOSE_TIMEOUT + Duration::from_millis(1)));
        c.upstream_gone = true;
        assert!(c.finished(now));
    }

    #[test]
    fn a_close_waits_for_settling_claims_up_to_twice_the_settle_timeout() {
        let mut c = Close::default();
        let now = Instant::now();
        c.expect_upstream_close_ok(Origin::Nackd, now);
        assert_eq!(c.upstream_close_ok(), Some(Origin::Nackd));
        c.set_settling(true);
        assert!(!c.finished(now), "claims are being stored");
        assert!(c.finished(now + SETTLE_TIMEOUT * 2));
        c.set_settling(false);
        assert!(c.finished(now));
    }

    #[test]
    fn events_set_what_the_reason_says() {
        let mut c = Close::default();
        assert_eq!(c.reason(), "closed");
        c.on_upstream_gone();
        assert!(c.upstream_gone() && !c.client_gone());
        assert_eq!(c.reason(), "upstream lost");
        c.on_client_failed();
        assert!(c.client_failed());
        assert_eq!(c.reason(), "client protocol error");
        c.on_forced();
        assert!(c.forced());
        assert_eq!(c.reason(), "shutdown");
        c.on_client_gone();
        c.on_broker_close();
        assert!(c.client_gone() && c.broker_closed());
        assert!(c.answer_failed_client(), "the first close is answered");
        assert!(!c.answer_failed_client(), "later ones are not");
    }
}
