//! One pass of a replay over its dead-letter queue: `basic.get` up to the
//! count it began with, a park per taken message, the ack once it is
//! durable, and what it left put back at the queue's tail (`rotate`).

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection};
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::rotate::{Left, Rotation};
use super::select::{self, Filter, Verdict};
use super::{reply_code, Report, Request, WINDOW};
use crate::retry::{ClaimKey, Park, ParkReply, Parked, RetryHandle};
use nackd_core::held::Route;
use nackd_core::protocol::content;
use nackd_core::session::ACK_GRACE;

/// One pass over the dead-letter queue.
pub(super) struct Pass<'a> {
    pub(super) request: &'a Request,
    pub(super) filter: Filter,
    pub(super) vhost: Arc<str>,
    pub(super) ch: &'a Channel,
    pub(super) conn: &'a Connection,
    /// Whether each destination met so far exists.
    pub(super) exists: HashMap<String, bool>,
    pub(super) retry: &'a RetryHandle,
    pub(super) run: u64,
    pub(super) reply: ParkReply,
    pub(super) answers: mpsc::UnboundedReceiver<Parked>,
    /// Delivery tag → destination and the message, of parks not answered
    /// yet (a refused park puts the message back).
    pub(super) in_flight: HashMap<u64, (String, Left)>,
    /// What the pass leaves, put back at the tail of the dead-letter queue.
    pub(super) rotation: Rotation,
    /// Messages the spread is planned for.
    pub(super) planned: u64,
    /// Parks asked for so far.
    pub(super) parks: u64,
    pub(super) report: Report,
}

impl Pass<'_> {
    /// Reads at most `count` messages, stopping at the limit or an error,
    /// then settles every park and hands back what it left.
    pub(super) async fn run(&mut self, count: u64) {
        while self.report.examined < count && self.report.error.is_none() && !self.full() {
            while self.in_flight.len() >= WINDOW {
                self.answer().await;
            }
            while let Ok(parked) = self.answers.try_recv() {
                self.settle(parked).await;
            }
            let got = self
                .ch
                .basic_get(self.request.dlq.as_str().into(), BasicGetOptions::default())
                .await;
            match got {
                // The count bound keeps the pass off the copies it put back:
                // they are behind every message the queue held at the start.
                Ok(Some(message)) => self.take(message.delivery).await,
                Ok(None) => break,
                Err(e) => self.fail(format!("broker: {e}")),
            }
        }
        while !self.in_flight.is_empty() {
            self.answer().await;
        }
        self.rotation.finish(self.ch).await;
        self.stop_if_refused();
        self.barrier().await;
        self.report.foreign_user_id = self.rotation.foreign_user_id;
        let (rotated, unacked) = (self.rotation.rotated, self.rotation.unacked);
        if rotated + unacked > 0 {
            info!(
                rotated,
                unacked, "replay: messages left put back at the tail of the dead-letter queue"
            );
        }
    }

    /// Waits until the broker's channel applied every ack of the pass
    /// before the connection closes: an ack not applied by then leaves its
    /// message both put back and handed back by the broker (twice on the
    /// queue, redelivered). A passive declare on the same channel is
    /// answered only after what came before it.
    async fn barrier(&mut self) {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let dlq = self.request.dlq.as_str();
        if let Err(e) = self
            .ch
            .queue_declare(dlq.into(), passive, FieldTable::default())
            .await
        {
            warn!(error = %e, "replay: could not check that its acks arrived");
        }
        // A quorum queue applies acks after its channel answered: the
        // grace sessions give the broker before a close (ACK_GRACE).
        tokio::time::sleep(ACK_GRACE).await;
    }

    /// Stops the pass once the broker refused a copy of a message it left:
    /// the next would be refused too, and each original left unacked goes
    /// back at the close (on RabbitMQ 4.x, one delivery toward the limit).
    fn stop_if_refused(&mut self) {
        if let Some(why) = self.rotation.refused.take() {
            self.fail(format!(
                "the dead-letter queue did not take back a message left there ({why}); \
                 the broker takes it back when the replay ends"
            ));
        }
    }

    /// Whether the limit is reached (moved, or counted in a dry run).
    fn full(&self) -> bool {
        let taken = self.report.destinations.values().sum::<u64>() + self.in_flight.len() as u64;
        self.request.limit.is_some_and(|l| taken >= l)
    }

    fn fail(&mut self, why: String) {
        warn!(error = why, "replay stops");
        self.report.error.get_or_insert(why);
    }

    /// Decides what becomes of one message: parks it or leaves it.
    async fn take(&mut self, d: lapin::message::Delivery) {
        self.report.examined += 1;
        let folded = select::folded(d.properties.headers().as_ref());
        let origin = select::origin(d.properties.headers().as_ref());
        let verdict = self.filter.verdict(origin.as_ref());
        let d = Left {
            tag: d.delivery_tag,
            properties: d.properties,
            body: Bytes::from(d.data),
        };
        if folded {
            // Put back as read: the screen unfolds it on the way out.
            return self.leave(d, |r| r.set_aside += 1).await;
        }
        let destination = match verdict {
            Verdict::Move(q) => q,
            Verdict::Skip => return self.leave(d, |r| r.skipped += 1).await,
            Verdict::NoDestination => return self.leave(d, |r| r.no_destination += 1).await,
        };
        match self.exists(&destination).await {
            Ok(true) => {}
            Ok(false) => {
                let missing = &mut self.report.missing_destinations;
                *missing.entry(destination).or_default() += 1;
                return self.leave(d, |_| {}).await;
            }
            Err(e) => {
                self.fail(format!("broker: {e}"));
                return self.leave(d, |_| {}).await;
            }
        }
        if self.report.dry_run {
            *self.report.destinations.entry(destination).or_default() += 1;
            return self.leave(d, |_| {}).await;
        }
        let payload = content::encode_header(60, d.body.len() as u64, &d.properties);
        let reset = self.request.reset_count.unwrap_or(true);
        let (header, retry) = match select::park_header(&payload, reset) {
            Ok(parked) => parked,
            Err(e) => {
                // Headers nackd cannot rewrite: left where they are.
                warn!(error = %e, "replay: a message's headers cannot be rewritten; left");
                return self.leave(d, |r| r.skipped += 1).await;
            }
        };
        let park = self.park_of(&d, &destination, header, retry);
        if !self.retry.park(park, &self.reply) {
            self.fail("the retry engine is gone".into());
            return self.leave(d, |_| {}).await;
        }
        self.in_flight.insert(d.tag, (destination, d));
    }

    /// The next park of this replay: `d` to `destination`, with its
    /// rewritten `header` and `retry` count, at its place in the spread.
    fn park_of(&mut self, d: &Left, destination: &str, header: Vec<u8>, retry: u32) -> Park {
        let spread = self.request.spread.unwrap_or_default();
        let park = Park {
            key: ClaimKey {
                channel: 0,
                epoch: self.run,
                tag: d.tag,
                seq: self.report.examined,
            },
            vhost: self.vhost.clone(),
            queue: destination.into(),
            delay: select::spread_delay(spread, self.parks, self.planned),
            retry,
            route: Route::Queue,
            on_return: None,
            header: Bytes::from(header),
            body: d.body.clone(),
            // A replay never gives its parks up.
            ticket: Default::default(),
        };
        self.parks += 1;
        park
    }

    /// Whether queue `name` exists (a passive declare on a channel of its
    /// own: a 404 closes the channel), asked once per replay.
    async fn exists(&mut self, name: &str) -> Result<bool, lapin::Error> {
        if let Some(known) = self.exists.get(name) {
            return Ok(*known);
        }
        let ch = self.conn.create_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let known = match ch
            .queue_declare(name.into(), passive, FieldTable::default())
            .await
        {
            Ok(_) => {
                let _ = ch.close(200, "".into()).await;
                true
            }
            Err(e) if reply_code(&e) == Some(404) => false,
            // Someone's exclusive queue: it exists (the broker refuses the
            // publish if nackd may not use it, and nackd keeps it).
            Err(e) if reply_code(&e) == Some(405) => true,
            Err(e) => return Err(e),
        };
        self.exists.insert(name.to_string(), known);
        Ok(known)
    }

    /// Leaves a message on the dead-letter queue: put back at its tail.
    async fn leave(&mut self, d: Left, count: impl FnOnce(&mut Report)) {
        count(&mut self.report);
        let dlq = self.request.dlq.as_str();
        self.rotation.put_back(self.conn, self.ch, dlq, d).await;
        self.stop_if_refused();
    }

    /// Waits for the engine's next answer and settles it.
    async fn answer(&mut self) {
        match self.answers.recv().await {
            Some(parked) => self.settle(parked).await,
            // Cannot happen: `self.reply` keeps the channel open.
            None => self.in_flight.clear(),
        }
    }

    /// Acks a durable park on the dead-letter queue, or puts a refused
    /// one back at its tail.
    async fn settle(&mut self, parked: Parked) {
        let tag = parked.key.tag;
        let Some((destination, d)) = self.in_flight.remove(&tag) else {
            return;
        };
        match parked.result {
            Ok(_) => match self.ch.basic_ack(tag, BasicAckOptions::default()).await {
                Ok(()) => {
                    self.report.moved += 1;
                    *self.report.destinations.entry(destination).or_default() += 1;
                }
                // Parked and back on the queue: a second replay moves it again.
                Err(e) => self.fail(format!("broker: ack of a parked message: {e}")),
            },
            Err(e) => {
                self.fail(format!("the store refused a park: {e}"));
                self.leave(d, |_| {}).await;
            }
        }
    }
}
