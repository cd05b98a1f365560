//! What a pass leaves on the dead-letter queue goes back to its tail:
//! the message is published again, exactly as it was read (properties,
//! headers, body; nothing added; only the delivery counts a quorum queue
//! writes on each delivery are left out: the copy is a new message), to the default exchange with the queue's
//! name as routing key, mandatory, on a confirm channel of its own, and the
//! original is acked only once the broker confirmed the copy.
//!
//! Never a requeue: on RabbitMQ 4.0–4.2 every `nack(requeue)` counts toward
//! a quorum queue's delivery-limit (default 20), so dry runs would wear the
//! queue out. A copy the broker does not confirm (a nack, a return, a
//! channel that died) leaves its original unacked, and the pass stops: the
//! broker takes it back when the pass's connection closes, as after a
//! consumer's crash (on RabbitMQ 4.x one delivery toward the limit, once,
//! not once per dry run). That is the fallback: the message stays, and no
//! `nack(requeue)` is sent.

use std::collections::VecDeque;

use bytes::Bytes;
use lapin::options::{BasicAckOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use lapin::{Confirmation, PublisherConfirm};
use nackd_core::protocol::headers::BROKER_COUNTS;
use nackd_core::protocol::screen::FOLDED;
use tracing::warn;

use super::WINDOW;

/// A message read and left: what its copy is made of.
pub(super) struct Left {
    pub(super) tag: u64,
    pub(super) properties: BasicProperties,
    pub(super) body: Bytes,
}

/// The copies of one pass not confirmed yet, in publish order.
#[derive(Default)]
pub(super) struct Rotation {
    /// The republish user, who publishes the copies.
    user: String,
    /// Originals kept unacked because their `user_id` names another user
    /// and the broker refused their copy from the republish user (it needs
    /// the `impersonator` tag).
    pub(super) foreign_user_id: u64,
    /// The confirm channel, opened at the first message left; `Err` once
    /// it cannot be had or died (every later original stays unacked).
    ch: Option<Result<Channel, String>>,
    pending: VecDeque<(u64, PublisherConfirm)>,
    /// Messages put back at the tail (copy confirmed, original acked).
    pub(super) rotated: u64,
    /// Originals left unacked for the broker to take back at the close.
    pub(super) unacked: u64,
    /// Why the broker did not take a copy, until the pass reads it.
    pub(super) refused: Option<String>,
}

impl Rotation {
    /// Copies published by `user` (the republish user).
    pub(super) fn new(user: &str) -> Self {
        Self {
            user: user.to_string(),
            ..Self::default()
        }
    }

    /// Puts `left` back at the tail of `dlq`: publishes its copy, and acks
    /// the original on `get` once confirmed (at most [`WINDOW`] copies wait
    /// for their confirm at a time).
    pub(super) async fn put_back(
        &mut self,
        conn: &Connection,
        get: &Channel,
        dlq: &str,
        left: Left,
    ) {
        let foreign = left
            .properties
            .user_id()
            .as_ref()
            .is_some_and(|u| u.as_str() != self.user);
        if foreign {
            return self.put_back_alone(conn, get, dlq, left).await;
        }
        while self.pending.len() >= WINDOW {
            self.settle_oldest(get).await;
        }
        let ch = match self.channel(conn).await {
            Ok(ch) => ch,
            Err(()) => return self.keep(),
        };
        let mandatory = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        match ch
            .basic_publish(
                "".into(),
                dlq.into(),
                mandatory,
                &left.body,
                copy(left.properties),
            )
            .await
        {
            Ok(confirm) => self.pending.push_back((left.tag, confirm)),
            Err(e) => {
                self.died(format!("publish: {e}"));
                self.keep();
            }
        }
    }

    /// A message whose `user_id` names another user: RabbitMQ takes its
    /// copy from the republish user only if that user has the
    /// `impersonator` tag, and refuses it by closing the channel. So its
    /// copy goes alone (the others confirmed first); a refusal keeps the
    /// original unacked (the broker takes it back at the close), opens a
    /// new channel for the next copies, and the pass goes on.
    async fn put_back_alone(&mut self, conn: &Connection, get: &Channel, dlq: &str, left: Left) {
        self.finish(get).await;
        let Ok(ch) = self.channel(conn).await else {
            return self.keep();
        };
        let mandatory = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let sent = ch
            .basic_publish(
                "".into(),
                dlq.into(),
                mandatory,
                &left.body,
                copy(left.properties),
            )
            .await;
        let confirmed = match sent {
            Ok(confirm) => confirm.await,
            Err(e) => Err(e),
        };
        match confirmed {
            Ok(Confirmation::Ack(None)) => {
                match get.basic_ack(left.tag, BasicAckOptions::default()).await {
                    Ok(()) => self.rotated += 1,
                    Err(e) => {
                        warn!(error = %e, "replay: ack of a message put back failed; it is there twice");
                        self.unacked += 1;
                    }
                }
            }
            Ok(_) => {
                self.refused.get_or_insert("refused by the broker".into());
                self.keep();
            }
            Err(e) => {
                warn!(error = %e, "replay: a message carrying another user's user_id cannot be put back by the republish user (it needs the impersonator tag); it stays unacked until the pass ends");
                self.ch = None;
                self.foreign_user_id += 1;
                self.keep();
            }
        }
    }

    /// Waits for every copy's confirm and acks their originals.
    pub(super) async fn finish(&mut self, get: &Channel) {
        while !self.pending.is_empty() {
            self.settle_oldest(get).await;
        }
    }

    async fn channel(&mut self, conn: &Connection) -> Result<Channel, ()> {
        if self.ch.is_none() {
            let opened = async {
                let ch = conn.create_channel().await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                Ok::<_, lapin::Error>(ch)
            };
            self.ch = Some(opened.await.map_err(|e| {
                warn!(error = %e, "replay: no channel to put messages back on; they stay unacked until the pass ends");
                self.refused.get_or_insert(format!("channel: {e}"));
                e.to_string()
            }));
        }
        match &self.ch {
            Some(Ok(ch)) => Ok(ch.clone()),
            _ => Err(()),
        }
    }

    async fn settle_oldest(&mut self, get: &Channel) {
        let Some((tag, confirm)) = self.pending.pop_front() else {
            return;
        };
        let refused = match confirm.await {
            Ok(Confirmation::Ack(None)) => None,
            Ok(Confirmation::Ack(Some(_))) => Some("returned (no such queue)".to_string()),
            Ok(Confirmation::Nack(_)) => Some("refused by the broker".to_string()),
            Ok(Confirmation::NotRequested) => Some("not confirmed".to_string()),
            Err(e) => {
                self.died(format!("confirm: {e}"));
                return self.keep();
            }
        };
        if let Some(why) = refused {
            warn!(why, "replay: a message's copy was not taken; the original stays unacked until the pass ends");
            self.refused.get_or_insert(why);
            return self.keep();
        }
        match get.basic_ack(tag, BasicAckOptions::default()).await {
            Ok(()) => self.rotated += 1,
            // Both copies stay: the original comes back at the close.
            Err(e) => {
                warn!(error = %e, "replay: ack of a message put back failed; it is there twice");
                self.unacked += 1;
            }
        }
    }

    fn died(&mut self, why: String) {
        self.refused.get_or_insert_with(|| why.clone());
        if matches!(self.ch, Some(Ok(_))) {
            warn!(error = why, "replay: the channel putting messages back died; the rest stay unacked until the pass ends");
            self.ch = Some(Err(why));
        }
    }

    /// An original stays unacked: the close hands it back.
    fn keep(&mut self) {
        self.unacked += 1;
    }
}

/// The properties of a copy: those read, without `x-delivery-count` and
/// `x-acquired-count`, which a quorum queue writes on every delivery (3.10
/// even a 0): kept, they would be a stale count on a new message. A table
/// that held nothing else goes too, as on the message published.
fn copy(p: BasicProperties) -> BasicProperties {
    let Some(h) = p.headers() else { return p };
    // A folded message goes back untouched: the screen restores its
    // original properties byte for byte, counts included.
    if h.contains_key(FOLDED) || !BROKER_COUNTS.iter().any(|k| h.contains_key(k)) {
        return p;
    }
    let mut kept = h.inner().clone();
    kept.retain(|k, _| !BROKER_COUNTS.contains(&k.as_str()));
    if !kept.is_empty() {
        return p.with_headers(FieldTable::from(kept));
    }
    let mut q = BasicProperties::default();
    macro_rules! keep {
        ($($get:ident => $with:ident),*) => {
            $(if let Some(v) = p.$get() { q = q.$with(v.clone()); })*
        };
    }
    keep!(content_type => with_content_type, content_encoding => with_content_encoding,
        delivery_mode => with_delivery_mode, priority => with_priority,
        correlation_id => with_correlation_id, reply_to => with_reply_to,
        expiration => with_expiration, message_id => with_message_id,
        timestamp => with_timestamp, kind => with_type, user_id => with_user_id,
        app_id => with_app_id, cluster_id => with_cluster_id);
    q
}
