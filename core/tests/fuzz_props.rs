//! The fuzz targets of `nackd_core::fuzzing` as property tests: random bytes,
//! mutations of the corpus captured from a real RabbitMQ session
//! (`fuzz/corpus`), and random `FrameSpec`s for the round trip.

// Tests time what nackd does with the real clock (clippy.toml asks the
// product to read it only through nackd_core::clock).
#![allow(clippy::disallowed_methods)]

use std::path::Path;
use std::sync::LazyLock;

use arbitrary::{Arbitrary, Unstructured};
use bytes::BytesMut;
use nackd_core::fuzzing::{self, FrameSpec};
use nackd_core::protocol::content;
use nackd_core::protocol::frame::{FrameDecoder, FrameType, HANDSHAKE_FRAME_MAX};
use nackd_core::protocol::method::{self, MethodId};
use proptest::prelude::*;

/// Every file of `fuzz/corpus/<target>` as (name, bytes), sorted by name.
fn corpus_files(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("dir entry").path())
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let name = p
                .file_name()
                .expect("file name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(p).expect("corpus file"))
        })
        .collect()
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    corpus_files(target)
        .into_iter()
        .map(|(_, bytes)| bytes)
        .collect()
}

/// Files cut from the captured RabbitMQ session (not fuzzer finds or crafted).
fn captured(target: &str) -> Vec<Vec<u8>> {
    corpus_files(target)
        .into_iter()
        .filter(|(name, _)| name.starts_with("c2s-") || name.starts_with("s2c-"))
        .map(|(_, bytes)| bytes)
        .collect()
}

static FRAMES: LazyLock<Vec<Vec<u8>>> = LazyLock::new(|| corpus("frames"));
static PAYLOADS: LazyLock<Vec<Vec<u8>>> = LazyLock::new(|| corpus("method_header"));

/// One edit of a corpus file.
#[derive(Clone, Debug)]
enum Mutation {
    Set(usize, u8),
    /// Big-endian u32 over four octets: where sizes and lengths live.
    SetU32(usize, u32),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
    /// The tail of another corpus file from some point.
    Splice(usize, usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let len = prop_oneof![
        Just(0u32),
        Just(1),
        Just(8),
        0u32..300,
        Just(0x7fff_ffff),
        Just(u32::MAX),
        any::<u32>()
    ];
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Set(at, b)),
        (any::<usize>(), len).prop_map(|(at, v)| Mutation::SetU32(at, v)),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..16)
        )
            .prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), 1usize..64).prop_map(|(at, n)| Mutation::Remove(at, n)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(at, f, from)| Mutation::Splice(at, f, from)),
    ]
}

fn apply(data: &mut Vec<u8>, m: &Mutation, corpus: &[Vec<u8>]) {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % len };
    match m {
        Mutation::Set(i, b) if !data.is_empty() => {
            let i = at(*i, data.len());
            data[i] = *b;
        }
        Mutation::SetU32(i, v) if data.len() >= 4 => {
            let i = at(*i, data.len() - 3);
            data[i..i + 4].copy_from_slice(&v.to_be_bytes());
        }
        Mutation::Insert(i, bytes) => {
            let i = at(*i, data.len() + 1);
            data.splice(i..i, bytes.iter().copied());
        }
        Mutation::Remove(i, n) if !data.is_empty() => {
            let i = at(*i, data.len());
            data.drain(i..(i + n).min(data.len()));
        }
        Mutation::Truncate(n) => data.truncate(at(*n, data.len() + 1)),
        Mutation::Splice(i, file, from) => {
            let other = &corpus[file % corpus.len()];
            data.truncate(at(*i, data.len() + 1));
            data.extend_from_slice(&other[at(*from, other.len() + 1)..]);
        }
        _ => {}
    }
}

fn mutated(corpus: &[Vec<u8>], file: usize, edits: &[Mutation]) -> Vec<u8> {
    let mut data = corpus[file % corpus.len()].clone();
    for m in edits {
        apply(&mut data, m, corpus);
    }
    data
}

/// Real traffic is understood: every captured frame is cut cleanly and every
/// method and content header in it decodes.
#[test]
fn captured_traffic_decodes() {
    let frames: Vec<Vec<u8>> = captured("frames")
        .into_iter()
        .filter(|f| !f.starts_with(b"AMQP"))
        .collect();
    assert!(frames.len() >= 100, "capture missing: see fuzz/capture");
    let mut buf = BytesMut::from(&frames.concat()[..]);
    let decoder = FrameDecoder::new(HANDSHAKE_FRAME_MAX);
    let (mut methods, mut headers) = (0, 0);
    while let Some(frame) = decoder.decode(&mut buf).expect("captured frames are valid") {
        match frame.kind {
            FrameType::Method => {
                let payload = frame.payload();
                let id = MethodId::peek(&payload).expect("ids");
                let class = method::decode_any(&payload).unwrap_or_else(|e| panic!("{id:?}: {e}"));
                assert_eq!(
                    method::decode(&payload).expect("decodes").is_some(),
                    id.is_decoded()
                );
                // Same value, not always the same bytes: amq-protocol drops
                // reserved fields (pika sets connection.open's `insist` bit).
                // That is why nackd forwards the original frame.
                let again = method::encode(frame.channel, &class);
                assert_eq!(
                    method::decode_any(&again[7..again.len() - 1]).as_ref(),
                    Ok(&class)
                );
                methods += 1;
            }
            FrameType::Header => {
                content::decode_header(&frame.payload()).expect("captured header decodes");
                headers += 1;
            }
            FrameType::Body | FrameType::Heartbeat => {}
        }
    }
    assert!(buf.is_empty(), "nothing left over");
    assert!(
        methods >= 100 && headers >= 10,
        "{methods} methods, {headers} headers"
    );
    for payload in captured("method_header") {
        assert!(method::decode_any(&payload).is_ok() || content::decode_header(&payload).is_ok());
    }
}

/// Everything in the corpus (capture, fuzzer finds, crafted) passes the
/// targets as it is.
#[test]
fn whole_corpus_passes_unchanged() {
    let captured_stream = captured("frames").concat();
    fuzzing::frames(&captured_stream);
    fuzzing::screen(&captured_stream);
    for data in FRAMES.iter() {
        fuzzing::frames(data);
        fuzzing::screen(data);
    }
    for data in PAYLOADS.iter() {
        fuzzing::method_and_header(data);
    }
    for data in corpus("roundtrip") {
        if let Ok(spec) = FrameSpec::arbitrary_take_rest(Unstructured::new(&data)) {
            fuzzing::roundtrip(&spec);
        }
    }
}

/// Short-string bytes: mostly a name as applications use them, sometimes
/// any bytes at all (not UTF-8, or not ASCII).
fn short_text() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => "[a-z0-9._-]{0,30}".prop_map(String::into_bytes),
        1 => "\\PC{0,10}".prop_map(String::into_bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..40),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn frames_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::frames(&data);
    }

    #[test]
    fn frames_mutated_corpus(file in any::<usize>(), edits in proptest::collection::vec(mutation(), 1..6)) {
        fuzzing::frames(&mutated(&FRAMES, file, &edits));
    }

    #[test]
    fn screen_mutated_corpus(file in any::<usize>(), edits in proptest::collection::vec(mutation(), 1..6)) {
        fuzzing::screen(&mutated(&FRAMES, file, &edits));
    }

    #[test]
    fn method_and_header_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::method_and_header(&data);
    }

    #[test]
    fn method_and_header_mutated_corpus(file in any::<usize>(), edits in proptest::collection::vec(mutation(), 1..6)) {
        fuzzing::method_and_header(&mutated(&PAYLOADS, file, &edits));
    }

    /// `basic.deliver` payloads with short strings of any bytes (UTF-8 or
    /// not, any length byte), cut short or followed by more: the session's
    /// in-place reader says what amq-protocol says.
    #[test]
    fn deliver_read_in_place_matches_the_decoder(
        strings in proptest::collection::vec(short_text(), 3),
        lengths in proptest::collection::vec(
            proptest::option::weighted(0.1, any::<u8>()), 3),
        tag in any::<u64>(),
        bits in any::<u8>(),
        cut in proptest::option::weighted(0.1, 0usize..80),
        tail in proptest::collection::vec(any::<u8>(), 0..3),
    ) {
        let mut payload = vec![0, 60, 0, 60];
        let short = |payload: &mut Vec<u8>, i: usize| {
            let text: &[u8] = &strings[i];
            payload.push(lengths[i].unwrap_or(text.len() as u8));
            payload.extend_from_slice(text);
        };
        short(&mut payload, 0);
        payload.extend_from_slice(&tag.to_be_bytes());
        payload.push(bits);
        short(&mut payload, 1);
        short(&mut payload, 2);
        payload.extend_from_slice(&tail);
        if let Some(cut) = cut {
            payload.truncate(cut);
        }
        fuzzing::deliver(&payload);
    }

    #[test]
    fn roundtrip_random_specs(seed in proptest::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(spec) = FrameSpec::arbitrary_take_rest(Unstructured::new(&seed)) {
            fuzzing::roundtrip(&spec);
        }
    }
}
