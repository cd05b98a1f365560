//! Ending a pair: protocol faults, dead sockets, shutdown, timers.

use std::time::Instant;

use tracing::{debug, info, warn};

use super::close::Origin;
use super::machine::Session;
use super::peer::{Fault, Peer};
use crate::protocol::method;
use crate::protocol::reply::ReplyCode;

impl Session {
    pub(super) fn on_client_fault(&mut self, fault: Fault) {
        let code = fault.reply_code();
        warn!(code = code.code(), error = %fault, "closing the client connection: protocol error");
        self.close.on_client_failed();
        let text = format!("{} - {fault}", code.name());
        self.to_client
            .extend_from_slice(&method::connection_close(code, &text, None));
        self.close.expect_client_close_ok(Origin::Nackd, self.now);
        if self.must_wait() {
            self.close_upstream_after_acks("client connection failed");
        } else {
            self.close_upstream("client connection failed");
        }
    }

    pub(super) fn on_upstream_fault(&mut self, fault: Fault) {
        warn!(error = %fault, "the broker sent a malformed frame; closing both sides");
        self.close.on_upstream_gone();
        self.close_client(
            ReplyCode::InternalError,
            &format!("nackd: broker sent a malformed frame: {fault}"),
        );
    }

    pub(super) fn on_client_gone(&mut self, error: Option<std::io::Error>) {
        if self.close.client_gone() {
            return;
        }
        match (&error, self.close.started()) {
            (_, true) => debug!(?error, "client socket closed"),
            (Some(e), false) => info!(error = %e, "client socket failed"),
            (None, false) => info!("client closed the socket without connection.close"),
        }
        self.close.on_client_gone();
        // Nothing more is written to the client: what waited for it goes.
        self.to_client.clear();
        self.close.begin(self.now);
        if self.close.awaiting_client() == Some(Origin::Broker) {
            // The broker waits for a close-ok the client will never send.
            self.to_upstream
                .extend_from_slice(&method::connection_close_ok());
            self.close.client_close_ok();
        } else if self.must_wait() {
            // Ack what nackd holds before the broker sees the client go.
            self.close_upstream_after_acks("client socket closed");
        } else {
            self.close_upstream("client socket closed");
        }
    }

    pub(super) fn on_upstream_gone(&mut self, error: Option<std::io::Error>) {
        if self.close.upstream_gone() {
            return;
        }
        if !self.close.started() {
            warn!(error = ?error.map(|e| e.to_string()), "upstream connection lost");
        }
        self.close.on_upstream_gone();
        self.close.begin(self.now);
        // The broker requeued every unacked delivery.
        self.forget_all_deferred();
        if self.close.upstream_close_ok() == Some(Origin::Client) {
            // The client asked to close: it gets its close-ok.
            self.to_client
                .extend_from_slice(&method::connection_close_ok());
        } else if self.close.awaiting_client().is_none() {
            self.close_client(
                ReplyCode::ConnectionForced,
                "CONNECTION_FORCED - nackd: upstream connection lost",
            );
        }
    }

    /// Sends `connection.close` to the client (or drops it mid-handshake).
    pub(super) fn close_client(&mut self, code: ReplyCode, text: &str) {
        self.close.begin(self.now);
        if self.close.client_gone() || self.close.awaiting_client().is_some() {
            return;
        }
        if !self.open {
            self.close.on_client_gone();
            return;
        }
        self.to_client
            .extend_from_slice(&method::connection_close(code, text, None));
        self.close.expect_client_close_ok(Origin::Nackd, self.now);
    }

    /// Sends `connection.close` to the broker (or drops it mid-handshake).
    pub(super) fn close_upstream(&mut self, why: &'static str) {
        self.close.begin(self.now);
        if self.close.upstream_gone() || self.close.awaiting_upstream().is_some() {
            return;
        }
        if !self.open {
            self.close.on_upstream_gone();
            return;
        }
        // The broker requeues every unacked delivery with the connection.
        self.forget_all_deferred();
        let text = format!("nackd: {why}");
        self.to_upstream
            .extend_from_slice(&method::connection_close(ReplyCode::Success, &text, None));
        self.close.expect_upstream_close_ok(Origin::Nackd, self.now);
    }

    pub(super) fn on_force(&mut self) {
        self.close.on_forced();
        info!("closing: nackd is shutting down");
        // Deferred nacks go now, ahead of the close (see the function).
        self.requeue_all_deferred_now();
        self.close_client(
            ReplyCode::ConnectionForced,
            "CONNECTION_FORCED - nackd is shutting down",
        );
        if self.must_wait() {
            // Ack what nackd holds before the broker sees the session end.
            self.close_upstream_after_acks("shutting down");
        } else {
            self.close_upstream("shutting down");
        }
    }

    pub(super) fn on_tick(&mut self) {
        let now: Instant = self.now;
        // Claims have a deadline even if the store never answers, whether
        // a close waits for them or not; so have held-back frames.
        self.give_up_overdue(self.claims.last());
        self.release_if_settled();
        self.fire_deferred();
        if !self.open && now >= self.handshake_deadline && !self.close.started() {
            warn!(timeout = ?self.limits.handshake_timeout, "handshake timed out");
            self.close.begin(self.now);
            self.close.on_client_gone();
            self.close.on_upstream_gone();
            return;
        }
        if self.heartbeat.is_zero() || self.close.started() {
            return;
        }
        let limit = self.heartbeat * 2;
        if !self.may_read(Peer::Client) {
            self.client_rx = now;
        }
        if !self.may_read(Peer::Upstream) {
            self.upstream_rx = now;
        }
        let client_spoke = now.duration_since(self.client_rx) < self.heartbeat;
        if self.open && client_spoke && now.duration_since(self.upstream_tx) >= self.heartbeat / 2 {
            // The client speaks but nackd took what it sent (delayed
            // publishes): the broker gets a heartbeat in its name, as a
            // client library sends one when it has nothing else to send
            // (a silent client sends its own, or is closed below).
            self.upstream_tx = now;
            self.to_upstream
                .extend_from_slice(&crate::protocol::method::heartbeat());
        }
        if now.duration_since(self.client_rx) > limit {
            warn!(heartbeat = ?self.heartbeat, "client missed two heartbeats; closing");
            self.on_client_gone(None);
        } else if now.duration_since(self.upstream_rx) > limit {
            warn!(heartbeat = ?self.heartbeat, "broker missed two heartbeats; closing");
            self.on_upstream_gone(None);
        }
    }
}
