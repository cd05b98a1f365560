use super::*;
use crate::protocol::frame::Frame;

/// A content header payload (class 60, body size 5) whose `headers` table
/// holds one key, `deep`, nesting `depth` arrays.
fn nested(depth: usize) -> Vec<u8> {
    let mut value = vec![b'A', 0, 0, 0, 0];
    for _ in 1..depth {
        let inner = value;
        value = vec![b'A'];
        value.extend_from_slice(&(inner.len() as u32).to_be_bytes());
        value.extend_from_slice(&inner);
    }
    let mut table = vec![4];
    table.extend_from_slice(b"deep");
    table.extend_from_slice(&value);
    let mut payload = vec![0, 60, 0, 0];
    payload.extend_from_slice(&5u64.to_be_bytes());
    payload.extend_from_slice(&HEADERS_FLAG.to_be_bytes());
    payload.extend_from_slice(&(table.len() as u32).to_be_bytes());
    payload.extend_from_slice(&table);
    payload
}

fn wire(kind: FrameType, channel: u16, payload: &[u8]) -> Vec<u8> {
    Frame::new(kind, channel, payload).raw.to_vec()
}

fn screen() -> Screen {
    Screen::new(*b"secret!!", 1 << 20)
}

/// What the client receives for `bytes` from the broker.
fn down(s: &mut Screen, bytes: &[u8]) -> (Vec<Frame>, Vec<Fold>) {
    let mut buf = BytesMut::from(bytes);
    let mut out = BytesMut::new();
    let mut folds = Vec::new();
    s.from_broker(&mut buf, &mut out, &mut folds).unwrap();
    assert!(buf.is_empty());
    (frames(out), folds)
}

/// What the broker receives for `bytes` from the client (after its
/// protocol header).
fn up(s: &mut Screen, bytes: &[u8]) -> (Vec<Frame>, usize) {
    let first = !s.started;
    let mut buf = BytesMut::new();
    if first {
        buf.extend_from_slice(PROTOCOL_HEADER);
    }
    buf.extend_from_slice(bytes);
    let mut out = BytesMut::new();
    let restored = s.from_client(&mut buf, &mut out).unwrap();
    if first {
        assert_eq!(&out.split_to(8)[..], PROTOCOL_HEADER);
    }
    (frames(out), restored)
}

fn frames(mut out: BytesMut) -> Vec<Frame> {
    let decoder = FrameDecoder::new(0);
    let mut frames = Vec::new();
    while let Some(f) = decoder.decode(&mut out).unwrap() {
        frames.push(f);
    }
    assert!(out.is_empty());
    frames
}

#[test]
fn headers_within_the_limits_pass_untouched() {
    let mut s = screen();
    let header = wire(FrameType::Header, 1, &nested(3));
    let body = wire(FrameType::Body, 1, b"hello");
    let (got, folds) = down(&mut s, &[header.clone(), body.clone()].concat());
    assert!(folds.is_empty());
    assert_eq!(got[0].raw.to_vec(), header);
    assert_eq!(got[1].raw.to_vec(), body);
}

#[test]
fn a_deep_header_is_folded_flat_and_restored_byte_for_byte() {
    let deep = nested(20_000);
    assert!(content::decode_header(&deep).is_err());
    let mut s = screen();
    let (got, folds) = down(&mut s, &wire(FrameType::Header, 3, &deep));
    assert_eq!(folds.len(), 1);
    assert_eq!(folds[0].channel, 3);
    let folded = got[0].payload();
    let header = content::decode_header(&folded).expect("the fold decodes");
    assert_eq!(header.body_size, 5);
    let table = header.properties.headers().clone().unwrap();
    assert!(table.inner().contains_key(FOLDED));
    assert_eq!(s.held(), deep.len());
    // The client publishes it again: the original goes out.
    let (sent, restored) = up(&mut s, &wire(FrameType::Header, 7, &folded));
    assert_eq!(restored, 1);
    assert_eq!(sent[0].channel, 7);
    assert_eq!(sent[0].payload().to_vec(), deep);
    assert_eq!(s.held(), 0);
    // Once only: see a_fold_published_a_second_time_ends_the_connection.
}

#[test]
fn a_fold_name_this_screen_did_not_make_is_not_restored() {
    let mut s = screen();
    let (got, _) = down(&mut s, &wire(FrameType::Header, 1, &nested(100)));
    let folded = got[0].payload().to_vec();
    // Another screen (another key) and a guessed counter: passed as written.
    let mut other = Screen::new(*b"another!", 1 << 20);
    down(&mut other, &wire(FrameType::Header, 1, &nested(100)));
    let (sent, restored) = up(&mut other, &wire(FrameType::Header, 1, &folded));
    assert_eq!((restored, sent[0].payload().to_vec()), (0, folded));
}

#[test]
fn a_deep_method_table_ends_the_connection() {
    // connection.start whose server properties nest 1000 arrays.
    let deep = nested(1000);
    let table = &deep[14..];
    let mut payload = vec![0, 10, 0, 10, 0, 9];
    payload.extend_from_slice(table);
    payload.extend_from_slice(&[0, 0, 0, 5]);
    payload.extend_from_slice(b"PLAIN");
    payload.extend_from_slice(&[0, 0, 0, 5]);
    payload.extend_from_slice(b"en_US");
    let mut s = screen();
    let mut buf = BytesMut::from(&wire(FrameType::Method, 0, &payload)[..]);
    let err = s
        .from_broker(&mut buf, &mut BytesMut::new(), &mut Vec::new())
        .unwrap_err();
    assert!(matches!(err, ScreenError::Method(_)), "{err}");
}

#[test]
fn folds_beyond_the_budget_end_the_connection() {
    let deep = nested(100);
    let mut s = Screen::new(*b"secret!!", deep.len() * 2);
    let frame = wire(FrameType::Header, 1, &deep);
    down(&mut s, &[frame.clone(), frame.clone()].concat());
    let mut buf = BytesMut::from(&frame[..]);
    let err = s
        .from_broker(&mut buf, &mut BytesMut::new(), &mut Vec::new())
        .unwrap_err();
    assert!(matches!(err, ScreenError::Budget(_)), "{err}");
}

#[test]
fn frames_beyond_the_tuned_frame_max_end_the_connection() {
    let mut s = screen();
    let tune_ok = method::encode(
        0,
        &AMQPClass::Connection(connection::AMQPMethod::TuneOk(connection::TuneOk {
            channel_max: 16,
            frame_max: 4096,
            heartbeat: 0,
        })),
    );
    up(&mut s, &tune_ok);
    let mut buf = BytesMut::from(&wire(FrameType::Body, 1, &[0; 5000])[..]);
    let err = s
        .from_broker(&mut buf, &mut BytesMut::new(), &mut Vec::new())
        .unwrap_err();
    assert!(
        matches!(err, ScreenError::Frame(FrameError::TooLarge { .. })),
        "{err}"
    );
}

#[test]
fn a_fold_lapin_decoded_and_encoded_again_is_restored() {
    // What lapin does with a folded message it publishes again: it parses
    // the properties and encodes them with amq-protocol.
    let deep = nested(20_000);
    let mut s = screen();
    let (got, _) = down(&mut s, &wire(FrameType::Header, 1, &deep));
    let parsed = content::decode_header(got[0].payload_slice()).unwrap();
    let again = content::encode_header(60, parsed.body_size, &parsed.properties);
    let (sent, restored) = up(&mut s, &wire(FrameType::Header, 1, &again));
    assert_eq!((restored, sent[0].payload().to_vec()), (1, deep));
}

/// A fold is restored once (its original is freed then): the same folded
/// message published a second time ends the connection rather than reach
/// the broker without its properties.
#[test]
fn a_fold_published_a_second_time_ends_the_connection() {
    let mut s = screen();
    let deep = nested(200);
    let (got, _) = down(&mut s, &wire(FrameType::Header, 1, &deep));
    let folded = got[0].payload_slice().to_vec();
    let (first, restored) = up(&mut s, &wire(FrameType::Header, 1, &folded));
    assert_eq!(restored, 1);
    assert_eq!(first[0].payload_slice(), &deep[..]);
    let mut buf = BytesMut::from(&wire(FrameType::Header, 1, &folded)[..]);
    let mut out = BytesMut::new();
    assert!(s.from_client(&mut buf, &mut out).is_err());
    assert!(out.is_empty(), "nothing folded reaches the broker");
}
