//! The fuzz targets of `nackd::fuzzing` as property tests: random bytes,
//! mutations of the corpus captured from a real RabbitMQ session
//! (`fuzz/corpus`), and random `FrameSpec`s for the round trip.

use std::path::Path;
use std::sync::LazyLock;

use arbitrary::{Arbitrary, Unstructured};
use nackd::fuzzing::{self, FrameSpec};
use proptest::prelude::*;

/// Every file of `fuzz/corpus/<target>`, sorted by name.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("dir entry").path())
        .collect();
    paths.sort();
    paths.iter().map(|p| std::fs::read(p).expect("corpus file")).collect()
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
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, b)| Mutation::Insert(at, b)),
        (any::<usize>(), 1usize..64).prop_map(|(at, n)| Mutation::Remove(at, n)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<usize>(), any::<usize>()).prop_map(|(at, f, from)| Mutation::Splice(at, f, from)),
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

#[test]
fn captured_corpus_passes_unchanged() {
    assert!(
        FRAMES.len() >= 50 && PAYLOADS.len() >= 30,
        "corpus missing: see fuzz/capture"
    );
    // The whole capture, back to back, is one valid stream.
    let stream: Vec<u8> = FRAMES.iter().filter(|f| f.len() > 8).flatten().copied().collect();
    fuzzing::frames(&stream);
    for data in FRAMES.iter() {
        fuzzing::frames(data);
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn frames_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::frames(&data);
    }

    #[test]
    fn frames_mutated_corpus(file in any::<usize>(), edits in proptest::collection::vec(mutation(), 1..6)) {
        fuzzing::frames(&mutated(&FRAMES, file, &edits));
    }

    #[test]
    fn method_and_header_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::method_and_header(&data);
    }

    #[test]
    fn method_and_header_mutated_corpus(file in any::<usize>(), edits in proptest::collection::vec(mutation(), 1..6)) {
        fuzzing::method_and_header(&mutated(&PAYLOADS, file, &edits));
    }

    #[test]
    fn roundtrip_random_specs(seed in proptest::collection::vec(any::<u8>(), 0..2048)) {
        if let Ok(spec) = FrameSpec::arbitrary_take_rest(Unstructured::new(&seed)) {
            fuzzing::roundtrip(&spec);
        }
    }
}
