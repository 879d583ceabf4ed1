use super::*;
use crate::data::doc_index::DocIndex;

/// A corpus of `docs` documents of `len` ids each, every id `base + i`
/// (so a window tells its corpus), each document ending with `eos`.
fn corpus(base: u32, docs: usize, len: usize, eos: u32) -> Dataset {
    let mut ids: Vec<u32> = (0..docs * len).map(|i| base + i as u32).collect();
    for d in 0..docs {
        ids[d * len + len - 1] = eos;
    }
    let starts = (0..docs).map(|d| (d * len) as u64).collect();
    let mut data = Dataset::from(ids);
    data.docs = Some(Arc::new(
        DocIndex::new(starts, (docs * len) as u64, "test").unwrap(),
    ));
    data
}

fn mixture(weights: &[f64]) -> Mixture {
    let parts = weights
        .iter()
        .enumerate()
        .map(|(j, &w)| (corpus(1000 * (j as u32 + 1), 30, 11, 7), w))
        .collect();
    Mixture::new(parts).unwrap()
}

/// The corpus a window was cut from (ids `1000 (j + 1) + i`, EOS 7).
fn corpus_of(w: &PackedWindow) -> usize {
    let id = *w.inputs.iter().find(|&&i| i != 7 && i != 0).unwrap();
    (id / 1000 - 1) as usize
}

/// After every `n` windows each corpus has had its share within one
/// window (the stated tolerance, `|taken_j − w_j n| < 1`), and the windows
/// come from the corpus the sequence names.
#[test]
fn every_prefix_of_draws_is_within_one_window_of_the_weights() {
    for weights in [
        vec![0.7, 0.3],
        vec![0.5, 0.25, 0.15, 0.1],
        vec![1.0, 3.0, 0.0, 7.0],
        vec![0.999, 0.001],
    ] {
        let mix = mixture(&weights);
        let w = mix.weights.clone();
        let mut s = MixtureSampler::sharded(mix, PackMode::Documents, 8, 5, 0, 1).unwrap();
        let order = s.corpus_sequence(10_000);
        let mut taken = vec![0f64; w.len()];
        for (n, &j) in order.iter().enumerate() {
            taken[j] += 1.0;
            for (k, &t) in taken.iter().enumerate() {
                let dev = t - w[k] * (n + 1) as f64;
                assert!(
                    dev.abs() < 1.0,
                    "{weights:?} after {} draws: corpus {k} off by {dev}",
                    n + 1
                );
            }
        }
        for &j in &order[..500] {
            assert_eq!(corpus_of(&s.next_packed()), j);
        }
        let shares = s.shares().unwrap();
        for (sh, &wk) in shares.iter().zip(&w) {
            assert!((sh.share - wk).abs() < 1.0 / 500.0, "{shares:?}");
        }
    }
}

#[test]
fn a_mixture_is_reproducible_for_a_seed_and_resumes_exactly() {
    for mode in [PackMode::Stream, PackMode::Documents, PackMode::Bfd] {
        let make =
            |seed| MixtureSampler::sharded(mixture(&[0.6, 0.4]), mode, 8, seed, 1, 2).unwrap();
        let (mut a, mut b, mut c) = (make(3), make(3), make(4));
        let wa: Vec<PackedWindow> = (0..120).map(|_| a.next_packed()).collect();
        let wb: Vec<PackedWindow> = (0..120).map(|_| b.next_packed()).collect();
        let wc: Vec<PackedWindow> = (0..120).map(|_| c.next_packed()).collect();
        assert_eq!(wa, wb, "{mode}");
        assert_ne!(wa, wc, "{mode}: another seed, other windows");
        // through the checkpoint's JSON, in a fresh sampler
        let saved = serde_json::to_string(&a.state()).unwrap();
        let mut r = make(3);
        r.restore(&serde_json::from_str(&saved).unwrap()).unwrap();
        for _ in 0..200 {
            assert_eq!(a.next_packed(), r.next_packed(), "{mode}");
        }
        assert_eq!(a.shares(), r.shares());
    }
}

/// One corpus: the plain sampler's windows and saved state, bit for bit.
#[test]
fn one_corpus_is_the_plain_sampler() {
    let data = corpus(1000, 30, 11, 7);
    let mut plain = PackedSampler::sharded(data.clone(), PackMode::Documents, 8, 9, 0, 1).unwrap();
    let mut one = MixtureSampler::sharded(data, PackMode::Documents, 8, 9, 0, 1).unwrap();
    for _ in 0..100 {
        assert_eq!(plain.next_packed(), one.next_packed());
    }
    assert_eq!(one.state(), serde_json::to_value(plain.state()).unwrap());
    assert!(one.shares().is_none());
    // a mixture's checkpoint does not resume a one-corpus run, nor the reverse
    let mut mix =
        MixtureSampler::sharded(mixture(&[1.0, 1.0]), PackMode::Documents, 8, 9, 0, 1).unwrap();
    let e = one.restore(&mix.state()).unwrap_err().to_string();
    assert!(e.contains("mixture") && e.contains("--data"), "{e}");
    let e = mix.restore(&one.state()).unwrap_err().to_string();
    assert!(e.contains("mixes 2 corpora") && e.contains("--data"), "{e}");
    let other =
        MixtureSampler::sharded(mixture(&[1.0, 2.0]), PackMode::Documents, 8, 9, 0, 1).unwrap();
    let e = mix.restore(&other.state()).unwrap_err().to_string();
    assert!(e.contains("weights"), "{e}");
}

#[test]
fn bad_weights_are_refused_naming_the_flag() {
    let parts = |w: [f64; 2]| vec![(corpus(1000, 3, 5, 7), w[0]), (corpus(2000, 3, 5, 7), w[1])];
    let e = Mixture::new(parts([0.5, -0.5])).unwrap_err().to_string();
    assert!(
        e.contains("--data") && e.contains("-0.5") && e.contains("non-negative"),
        "{e}"
    );
    let e = Mixture::new(parts([0.0, 0.0])).unwrap_err().to_string();
    assert!(
        e.contains("--data") && e.contains("weight 0") && e.contains("above 0"),
        "{e}"
    );
    let e = Mixture::new(parts([f64::NAN, 1.0]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--data"), "{e}");
    let e = Mixture::new(vec![
        (corpus(1000, 3, 5, 7), 1.0),
        (corpus(2000, 3, 5, 8), 1.0),
    ])
    .unwrap()
    .check_same_tokenizer()
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("different tokenizers") && e.contains("id 7") && e.contains("id 8"),
        "{e}"
    );
    assert!(mixture(&[1.0, 2.0]).check_same_tokenizer().is_ok());
}

#[test]
fn data_specs_parse_or_say_how_to_write_them() {
    let spec = |s: &str| parse_data_spec(Path::new(s));
    assert_eq!(spec("plain.u32").unwrap(), None);
    assert_eq!(
        spec("a.u32:0.7,dir/b.u32:0.3").unwrap().unwrap(),
        [
            (PathBuf::from("a.u32"), 0.7),
            (PathBuf::from("dir/b.u32"), 0.3)
        ]
    );
    assert_eq!(
        spec("a.u32:2").unwrap().unwrap(),
        [(PathBuf::from("a.u32"), 2.0)]
    );
    let e = spec("a.u32:0.7,b.u32:lots").unwrap_err().to_string();
    assert!(
        e.contains("--data") && e.contains("'lots'") && e.contains("a.u32:0.7,b.u32:0.3"),
        "{e}"
    );
    let e = spec("a.u32:0.7,b.u32").unwrap_err().to_string();
    assert!(e.contains("'b.u32' has no weight"), "{e}");
    let dir = std::env::temp_dir().join(format!("upipe-mix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = dir.join("a.u32");
    crate::data::write_u32_tokens(&a, &[1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
    let missing = dir.join("missing.u32");
    let arg = format!("{}:1,{}:1", a.display(), missing.display());
    let e = load_mixture(Some(Path::new(&arg)), None, 256)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--data") && e.contains("missing.u32") && e.contains("does not exist"),
        "{e}"
    );
    let arg = format!("{}:1,{}:3", a.display(), a.display());
    let mix = load_mixture(Some(Path::new(&arg)), None, 256).unwrap();
    assert_eq!(mix.weights, [0.25, 0.75]);
    let e = load_mixture(Some(Path::new(&arg)), None, 5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("vocab") || e.contains("vocabulary"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
