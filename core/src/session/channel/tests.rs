use super::*;
use amq_protocol::types::FieldTable;

fn consume(queue: &str, tag: &str, no_ack: bool, nowait: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Consume(basic::Consume {
        queue: queue.into(),
        consumer_tag: tag.into(),
        no_local: false,
        no_ack,
        exclusive: false,
        nowait,
        arguments: FieldTable::default(),
    }))
}

fn consume_ok(tag: &str) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(basic::ConsumeOk {
        consumer_tag: tag.into(),
    }))
}

fn deliver(tag: &str, delivery_tag: u64) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
        consumer_tag: tag.into(),
        delivery_tag,
        redelivered: false,
        exchange: "".into(),
        routing_key: "r".into(),
    }))
}

fn ack(tag: u64, multiple: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Ack(basic::Ack {
        delivery_tag: tag,
        multiple,
    }))
}

fn tags(ch: &Channel) -> Vec<(u64, String)> {
    ch.outstanding()
        .map(|(t, d)| (t, d.queue.to_string()))
        .collect()
}

#[test]
fn consumer_tag_from_consume_ok_maps_to_queue() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("email-queue", "", false, false));
    ch.on_client_method(&consume("webhook-queue", "mine", false, false));
    ch.on_broker_method(&consume_ok("amq.ctag-1"));
    ch.on_broker_method(&consume_ok("mine"));
    assert_eq!(&*ch.consumer("amq.ctag-1").unwrap().queue, "email-queue");
    assert_eq!(&*ch.consumer("mine").unwrap().queue, "webhook-queue");
    ch.on_broker_method(&deliver("amq.ctag-1", 1));
    ch.on_broker_method(&deliver("mine", 2));
    assert_eq!(
        tags(&ch),
        vec![(1, "email-queue".into()), (2, "webhook-queue".into())]
    );
}

#[test]
fn nowait_consume_and_no_ack_deliveries() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("q", "t", true, true));
    assert!(ch.consumer("t").unwrap().no_ack);
    ch.on_broker_method(&deliver("t", 1));
    assert!(
        tags(&ch).is_empty(),
        "no-ack deliveries are never outstanding"
    );
}

#[test]
fn empty_queue_name_means_last_declared_server_named_queue() {
    let mut ch = Channel::default();
    ch.on_broker_method(&AMQPClass::Queue(queue::AMQPMethod::DeclareOk(
        queue::DeclareOk {
            queue: "amq.gen-XYZ".into(),
            message_count: 0,
            consumer_count: 0,
        },
    )));
    ch.on_client_method(&consume("", "c", false, true));
    assert_eq!(&*ch.consumer("c").unwrap().queue, "amq.gen-XYZ");
    ch.on_client_method(&AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
        queue: "".into(),
        no_ack: false,
    })));
    ch.on_broker_method(&AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
        delivery_tag: 4,
        redelivered: false,
        exchange: "".into(),
        routing_key: "amq.gen-XYZ".into(),
        message_count: 0,
    })));
    assert_eq!(tags(&ch), vec![(4, "amq.gen-XYZ".into())]);
}

#[test]
fn get_empty_consumes_the_pending_get() {
    let mut ch = Channel::default();
    let get = |q: &str| {
        AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get {
            queue: q.into(),
            no_ack: false,
        }))
    };
    ch.on_client_method(&get("a"));
    ch.on_client_method(&get("b"));
    ch.on_broker_method(&AMQPClass::Basic(basic::AMQPMethod::GetEmpty(
        basic::GetEmpty {},
    )));
    ch.on_broker_method(&AMQPClass::Basic(basic::AMQPMethod::GetOk(basic::GetOk {
        delivery_tag: 1,
        redelivered: false,
        exchange: "".into(),
        routing_key: "b".into(),
        message_count: 0,
    })));
    assert_eq!(tags(&ch), vec![(1, "b".into())]);
}

#[test]
fn acks_nacks_rejects_and_recover_settle_the_right_tags() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("q", "t", false, true));
    for tag in 1..=8 {
        ch.on_broker_method(&deliver("t", tag));
    }
    ch.on_client_method(&ack(3, true));
    assert_eq!(
        tags(&ch).iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![4, 5, 6, 7, 8]
    );
    ch.on_client_method(&AMQPClass::Basic(basic::AMQPMethod::Reject(
        basic::Reject {
            delivery_tag: 6,
            requeue: true,
        },
    )));
    ch.on_client_method(&AMQPClass::Basic(basic::AMQPMethod::Nack(basic::Nack {
        delivery_tag: 7,
        multiple: false,
        requeue: false,
    })));
    assert_eq!(
        tags(&ch).iter().map(|t| t.0).collect::<Vec<_>>(),
        vec![4, 5, 8]
    );
    ch.on_client_method(&ack(0, true));
    assert!(tags(&ch).is_empty(), "ack(0, multiple) covers everything");
    ch.on_broker_method(&deliver("t", 9));
    ch.on_client_method(&AMQPClass::Basic(basic::AMQPMethod::Recover(
        basic::Recover { requeue: true },
    )));
    assert!(tags(&ch).is_empty());
}

#[test]
fn cancel_from_either_side_removes_the_consumer() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("q", "a", false, true));
    ch.on_client_method(&consume("q", "b", false, true));
    ch.on_broker_method(&AMQPClass::Basic(basic::AMQPMethod::Cancel(
        basic::Cancel {
            consumer_tag: "a".into(),
            nowait: true,
        },
    )));
    ch.on_client_method(&AMQPClass::Basic(basic::AMQPMethod::Cancel(
        basic::Cancel {
            consumer_tag: "b".into(),
            nowait: false,
        },
    )));
    assert!(ch.consumer("a").is_none());
    assert!(ch.consumer("b").is_some(), "until cancel-ok");
    ch.on_broker_method(&AMQPClass::Basic(basic::AMQPMethod::CancelOk(
        basic::CancelOk {
            consumer_tag: "b".into(),
        },
    )));
    assert_eq!(ch.consumer_count(), 0);
}

#[test]
fn tx_and_confirm_modes() {
    let mut ch = Channel::default();
    ch.on_client_method(&AMQPClass::Tx(tx::AMQPMethod::Select(tx::Select {})));
    ch.on_client_method(&AMQPClass::Confirm(confirm::AMQPMethod::Select(
        confirm::Select { nowait: false },
    )));
    assert!(ch.tx() && ch.confirm());
}

fn header(body: u64) -> Frame {
    let mut p = vec![0, 60, 0, 0];
    p.extend_from_slice(&body.to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    Frame::new(FrameType::Header, 1, &p)
}

#[test]
fn content_state_follows_method_header_bodies() {
    let publish = Frame::new(FrameType::Method, 1, &[0, 60, 0, 40]);
    let id = Some(MethodId {
        class: 60,
        method: 40,
    });
    let mut s = ContentState::default();
    s.advance(&publish, id).unwrap();
    assert_eq!(s, ContentState::Header);
    s.advance(&header(10), None).unwrap();
    assert_eq!(s, ContentState::Body(10));
    assert!(s.in_flight());
    s.advance(&Frame::new(FrameType::Body, 1, &[0; 6]), None)
        .unwrap();
    s.advance(&Frame::new(FrameType::Body, 1, &[0; 4]), None)
        .unwrap();
    assert_eq!(s, ContentState::Idle);
    s.advance(&publish, id).unwrap();
    s.advance(&header(0), None).unwrap();
    assert_eq!(s, ContentState::Idle, "empty body: no body frame");
}

#[test]
fn content_out_of_order_is_unexpected_frame() {
    use crate::protocol::reply::ReplyCode;
    let mut s = ContentState::default();
    let e = s.advance(&header(1), None).unwrap_err();
    assert_eq!(e.reply_code(), ReplyCode::UnexpectedFrame);
    let mut s = ContentState::default();
    assert!(s
        .advance(&Frame::new(FrameType::Body, 1, &[1]), None)
        .is_err());
    let mut s = ContentState::Body(3);
    assert!(s
        .advance(&Frame::new(FrameType::Method, 1, &[0, 60, 0, 80]), None)
        .is_err());
    let mut s = ContentState::Body(3);
    assert!(s
        .advance(&Frame::new(FrameType::Body, 1, &[0; 4]), None)
        .is_err());
}

fn declare(queue: &str, nowait: bool) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::Declare(queue::Declare {
        queue: queue.into(),
        passive: false,
        durable: false,
        exclusive: false,
        auto_delete: false,
        nowait,
        arguments: FieldTable::default(),
    }))
}

fn declare_ok(queue: &str) -> AMQPClass {
    AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
        queue: queue.into(),
        message_count: 0,
        consumer_count: 0,
    }))
}

/// Issue 12, item 5: `queue.declare("")` and `basic.consume("")` sent
/// back to back: the consumer's queue is the new server-named one, not
/// the one declared before.
#[test]
fn pipelined_declare_and_consume_resolve_as_the_broker_does() {
    let mut ch = Channel::default();
    ch.on_client_method(&declare("", false));
    ch.on_broker_method(&declare_ok("amq.gen-first"));
    ch.on_client_method(&declare("", false));
    ch.on_client_method(&consume("", "c", false, false));
    ch.on_client_method(&consume("", "n", false, true));
    ch.on_broker_method(&declare_ok("amq.gen-second"));
    ch.on_broker_method(&consume_ok("c"));
    assert_eq!(&*ch.consumer("c").unwrap().queue, "amq.gen-second");
    assert_eq!(&*ch.consumer("n").unwrap().queue, "amq.gen-second");
    // Not pipelined: the last declared queue, as before.
    ch.on_client_method(&consume("", "later", false, false));
    ch.on_broker_method(&consume_ok("later"));
    assert_eq!(&*ch.consumer("later").unwrap().queue, "amq.gen-second");
}

#[test]
fn a_nowait_declare_after_a_pending_one_is_the_last_declared() {
    let mut ch = Channel::default();
    ch.on_client_method(&declare("", false));
    ch.on_client_method(&declare("named", true));
    ch.on_client_method(&consume("", "c", false, false));
    ch.on_broker_method(&declare_ok("amq.gen-x"));
    ch.on_broker_method(&consume_ok("c"));
    assert_eq!(&*ch.consumer("c").unwrap().queue, "named");
    // A declare named in the frame, answered later, resolves to its name.
    ch.on_client_method(&declare("orders", false));
    ch.on_client_method(&consume("", "d", false, false));
    ch.on_broker_method(&declare_ok("orders"));
    ch.on_broker_method(&consume_ok("d"));
    assert_eq!(&*ch.consumer("d").unwrap().queue, "orders");
}

fn cancel(tag: &str, nowait: bool) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
        consumer_tag: tag.into(),
        nowait,
    }))
}

fn cancel_ok(tag: &str) -> AMQPClass {
    AMQPClass::Basic(basic::AMQPMethod::CancelOk(basic::CancelOk {
        consumer_tag: tag.into(),
    }))
}

/// A nowait consume of a tag whose cancels wait for their `cancel-ok`
/// (two of them here: RabbitMQ answers a cancel of an unknown tag too) is
/// the broker's consumer of that tag only once the last is answered; the
/// deliveries before it are the cancelled consumer's.
#[test]
fn a_tag_reused_with_nowait_is_the_new_consumers_after_every_cancel_ok() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("a", "t", false, false));
    ch.on_broker_method(&consume_ok("t"));
    ch.on_client_method(&cancel("t", false));
    ch.on_client_method(&cancel("t", false));
    ch.on_client_method(&consume("b", "t", false, true));
    ch.on_broker_method(&deliver("t", 1));
    ch.on_broker_method(&cancel_ok("t"));
    ch.on_broker_method(&deliver("t", 2));
    ch.on_broker_method(&cancel_ok("t"));
    ch.on_broker_method(&deliver("t", 3));
    assert_eq!(tags(&ch), vec![(1, "a".into()), (3, "b".into())]);
    assert_eq!(&*ch.consumer("t").unwrap().queue, "b");
}

/// A nowait cancel right after such a consume cancels the new consumer:
/// the cancel-ok of the first cancel leaves no consumer of the tag.
#[test]
fn a_nowait_cancel_cancels_the_newest_consumer_of_its_tag() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("a", "t", false, true));
    ch.on_client_method(&cancel("t", false));
    ch.on_client_method(&consume("b", "t", false, true));
    ch.on_client_method(&cancel("t", true));
    assert_eq!(
        &*ch.consumer("t").unwrap().queue,
        "a",
        "until its cancel-ok"
    );
    ch.on_broker_method(&cancel_ok("t"));
    assert_eq!(ch.consumer_count(), 0);
}

fn claimed(seq: u64) -> Claimed {
    Claimed {
        settle: Settle::Nack(false),
        seq,
        delay: None,
        from: None,
    }
}

#[test]
fn a_claim_is_answered_unless_settled_again_and_the_barrier_waits_for_the_last() {
    let mut ch = Channel::default();
    ch.claim(5, claimed(1));
    ch.claim(3, claimed(2));
    ch.took_publish(3);
    assert!(ch.is_claimed(5) && ch.is_claimed(3) && !ch.is_claimed(4));
    assert_eq!(ch.lowest_claimed(), Some(3));
    assert!(!ch.barrier_raised());
    assert_eq!(ch.raise_barrier(), 3, "the last claim here is the publish");
    assert!(ch.barrier_raised());
    ch.settle_again(5);
    assert!(
        ch.take_claim(5).is_none(),
        "settled again: nackd steps back"
    );
    assert!(!ch.is_claimed(5));
    assert_eq!(ch.take_claim(3).map(|c| c.seq), Some(2));
    ch.claim(7, claimed(4));
    ch.settle_again(7);
    ch.drop_claim(7);
    ch.claim(7, claimed(5));
    assert!(
        ch.take_claim(7).is_some(),
        "a dropped claim forgets its second settle"
    );
}

#[test]
fn frames_wait_for_the_publish_and_the_close_keeps_its_place_behind_the_barrier() {
    let mut chs = Channels::default();
    let ch = chs.get(1);
    assert!(!ch.waits_for_publish());
    ch.wait_for_publish(Bytes::from_static(b"ack"), Some(9));
    ch.wait_for_publish(Bytes::from_static(b"nack"), None);
    assert!(ch.waits_for_publish());
    ch.publish_begins(true);
    ch.end_behind_at(10);
    ch.end_behind_at(20);
    assert_eq!(ch.end_behind(), Some(10), "the first close's place is kept");
    chs.shift_end_behind(5, 3);
    assert_eq!(chs.get(1).end_behind(), Some(13));
    assert_eq!(
        chs.take_all_after_publish(),
        vec![9],
        "the held ids acks stood for"
    );
    assert!(!chs.get(1).waits_for_publish());
    let ch = chs.get(1);
    ch.raise_barrier();
    assert!(ch.publish_behind_barrier());
    chs.lower_barriers();
    let ch = chs.get(1);
    assert!(!ch.publish_behind_barrier() && !ch.barrier_raised());
    assert_eq!(ch.end_behind(), None);
    ch.wait_for_publish(Bytes::from_static(b"ack"), Some(1));
    assert_eq!(ch.take_after_publish().len(), 1);
}

#[test]
fn a_channel_remembers_its_close_refusal_publishes_and_exchange_changes() {
    use std::sync::Arc;
    let mut ch = Channel::default();
    assert!(!ch.closing() && !ch.client_closed() && !ch.refused());
    ch.on_broker_close();
    ch.on_client_close();
    ch.on_refused_publish();
    assert!(ch.closing() && ch.client_closed() && ch.refused());
    ch.count_publish();
    assert_eq!(ch.published(), 0, "counted on a confirm channel only");
    ch.confirm = true;
    ch.count_publish();
    ch.count_publish();
    assert_eq!(ch.published(), 2);
    assert!(!ch.has_handed_over());
    ch.publishing = ContentState::Header;
    assert_eq!(
        ch.hand_back(None, Bytes::from_static(b"p1"), false),
        HandBack::Kept
    );
    assert_eq!(
        ch.hand_back(None, Bytes::from_static(b"p2"), true),
        HandBack::Kept
    );
    assert!(ch.has_handed_over());
    assert_eq!(
        ch.take_handed_over(),
        vec![Bytes::from_static(b"p1"), Bytes::from_static(b"p2")]
    );
    ch.wait_for_delivery(Bytes::from_static(b"ack"));
    assert!(ch.waits_for_delivery());
    assert_eq!(ch.take_to_client_after().len(), 1);
    assert!(!ch.waits_for_delivery());
    ch.expect_declare_ok(None);
    ch.expect_declare_ok(Some(Declared::new(Arc::from("x"), "direct".into(), false)));
    ch.expect_delete_ok(Some(Deleted::new(Arc::from("x"), true)));
    assert!(
        matches!(ch.declare_ok(), Some(None)),
        "answers come in order"
    );
    let (declares, deletes) = ch.take_exchange_changes();
    assert_eq!((declares.len(), deletes.len()), (1, 1));
    assert!(ch.declare_ok().is_none() && ch.delete_ok().is_none());
}

#[test]
fn a_channel_numbers_confirms_two_ways_only_once_nackd_takes_a_publish() {
    let mut ch = Channel::default();
    ch.forward_publish();
    assert!(ch.renumber_mut().is_none(), "nothing to renumber yet");
    assert!(!ch.is_taking());
    ch.start_taking(Box::new(Taking::new(
        "x",
        Some("k"),
        Bytes::from_static(b"M"),
    )));
    assert!(ch.is_taking() && ch.taking_mut().is_some());
    assert_eq!(
        ch.renumber_from(3).take(),
        3,
        "the publisher's number 3 is nackd's"
    );
    assert_eq!(ch.renumber_from(99).take(), 4, "begun once");
    ch.forward_publish();
    assert!(ch.renumber_mut().is_some());
    assert!(ch.take_taking().is_some());
    assert!(!ch.is_taking() && ch.take_taking().is_none());
}

/// A policy for captures (what it says does not matter here).
fn any_policy() -> Arc<crate::policy::Policy> {
    let config: crate::policy::PolicyConfig =
        toml::from_str("queues = [\"q\"]\ndelays = [\"1s\"]\n").unwrap();
    Arc::new(crate::policy::Policy::new(&config).unwrap())
}

/// The broker's content of a delivery: header (body of `body.len()`) and body.
fn content(body: &[u8]) -> (Frame, Frame) {
    let props = amq_protocol::protocol::BasicProperties::default();
    let header = crate::protocol::content::encode_header(60, body.len() as u64, &props);
    (
        Frame::new(FrameType::Header, 1, &header),
        Frame::new(FrameType::Body, 1, body),
    )
}

#[test]
fn a_capture_keeps_a_whole_delivery_or_marks_it_over_the_budget() {
    let mut ch = Channel::default();
    ch.on_client_method(&consume("q", "c", false, true));
    let budget = crate::session::capture::Budget::new(1000);
    for (tag, body) in [(1, &b"abc"[..]), (2, &[0u8; 2000][..])] {
        let (header, body_frame) = content(body);
        ch.on_deliver("c", tag);
        ch.delivering
            .advance(
                &Frame::new(FrameType::Method, 1, &[0, 60, 0, 60]),
                Some(MethodId::peek(&[0, 60, 0, 60]).unwrap()),
            )
            .unwrap();
        ch.start_capture(Capturing::new(tag, "", "q", any_policy()));
        ch.delivering.advance(&header, None).unwrap();
        ch.capture_content(&header, &budget);
        ch.delivering.advance(&body_frame, None).unwrap();
        ch.capture_content(&body_frame, &budget);
    }
    let d1 = ch.delivery_mut(1).unwrap();
    assert!(d1.capture.is_some() && !d1.over_budget, "whole: captured");
    let d2 = ch.delivery_mut(2).unwrap();
    assert!(
        d2.capture.is_none() && d2.over_budget,
        "over the budget: marked"
    );
    assert_eq!(budget.refused(), 1);
}

#[test]
fn a_publish_given_back_goes_where_the_client_sent_it_and_is_numbered_by_the_broker() {
    let raw = Bytes::from_static(b"p");
    let mut ch = Channel::default();
    assert!(ch.takes_hand_back(false));
    assert_eq!(
        ch.hand_back(None, raw.clone(), false),
        HandBack::Send(raw.clone())
    );
    ch.end_behind_at(7);
    assert_eq!(
        ch.hand_back(None, raw.clone(), true),
        HandBack::Before(7, raw.clone())
    );
    assert_eq!(
        ch.hand_back(None, raw.clone(), false),
        HandBack::Send(raw.clone()),
        "no barrier: now"
    );
    ch.on_client_close();
    assert!(
        ch.takes_hand_back(true),
        "the close waits behind the barrier"
    );
    assert!(!ch.takes_hand_back(false), "the close went upstream");
    ch.on_broker_close();
    assert!(!ch.takes_hand_back(true));

    let mut ch = Channel::default();
    ch.on_client_method(&AMQPClass::Confirm(confirm::AMQPMethod::Select(
        confirm::Select { nowait: false },
    )));
    ch.count_publish();
    ch.count_publish();
    ch.hand_back(None, raw.clone(), false);
    let r = ch
        .renumber_mut()
        .expect("the broker numbers one more than the publisher");
    assert_eq!(
        r.take(),
        3,
        "the publisher's next publish is still its third"
    );
}
