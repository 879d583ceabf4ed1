use super::*;
use crate::data::Tokens;

fn grid(lengths: &[usize], depths: usize, trials: usize) -> Grid {
    Grid {
        lengths: lengths.to_vec(),
        depths: Grid::even_depths(depths).unwrap(),
        trials,
        seed: 7,
    }
}

fn text(ids: &[u32]) -> String {
    Tokenizer::byte().decode(ids).unwrap()
}

#[test]
fn a_passkey_trial_is_exactly_its_length_with_the_needle_at_its_depth() {
    let tok = Tokenizer::byte();
    let hay = Haystack::filler(&tok).unwrap();
    let spec = TaskSpec::new(RetrievalTask::Passkey);
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let g = grid(&[600, 2000], 5, 2);
    for l in 0..2 {
        for i in 0..g.per_length() {
            let at = g.at(l, i);
            let t = maker.trial(&at).unwrap();
            assert_eq!(t.ids.len(), at.length);
            assert_eq!(t.answer.end, t.ids.len());
            let all = text(&t.ids);
            assert_eq!(text(&t.ids[t.answer.clone()]), format!(" {}", t.expected));
            assert!(all.contains(&format!("The pass key is {}. Remember it.", t.expected)));
            assert!(text(&t.ids[t.needle_at..]).starts_with(" The pass key is"));
            // within one filler sentence (about 70 bytes) of the depth asked
            let hay_len = at.length - 150;
            let err = (t.placed_depth - at.depth).abs() * hay_len as f64;
            assert!(
                err <= 80.0,
                "depth {} placed at {}",
                at.depth,
                t.placed_depth
            );
            // the same seed, the same trial
            assert_eq!(maker.trial(&at).unwrap(), t);
        }
    }
    let (a, b) = (
        maker.trial(&g.at(0, 0)).unwrap(),
        maker.trial(&g.at(0, 1)).unwrap(),
    );
    assert_ne!(a.expected, b.expected);
}

#[test]
fn multikey_asks_one_key_among_several_and_multivalue_all_values_in_order() {
    let tok = Tokenizer::byte();
    let hay = Haystack::filler(&tok).unwrap();
    let spec = TaskSpec::new(RetrievalTask::MultiKey);
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let t = maker.trial(&grid(&[1500], 3, 1).at(0, 1)).unwrap();
    let all = text(&t.ids);
    assert_eq!(all.matches("The special number for ").count(), 4 + 1);
    assert!(all.contains(&format!(
        "The special number for {} is {}.",
        t.key, t.expected
    )));
    assert!(all.ends_with(&format!("for {} is {}", t.key, t.expected)));
    let spec = TaskSpec::new(RetrievalTask::MultiValue);
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let t = maker.trial(&grid(&[1500], 3, 1).at(0, 2)).unwrap();
    let all = text(&t.ids);
    let values: Vec<&str> = t.expected.split(", ").collect();
    assert_eq!(values.len(), 4);
    let at: Vec<usize> = values
        .iter()
        .map(|v| all.find(&format!("for {} is {v}.", t.key)).unwrap())
        .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
    assert_eq!(t.ids.len(), 1500);
}

#[test]
fn a_kv_trial_is_a_list_with_the_asked_line_at_its_depth() {
    let tok = Tokenizer::byte();
    let spec = TaskSpec::new(RetrievalTask::Kv);
    let maker = TrialMaker::new(&spec, None, &tok).unwrap();
    for (i, depth) in [0.0, 0.5, 1.0].into_iter().enumerate() {
        let t = maker.trial(&grid(&[1000], 3, 1).at(0, i)).unwrap();
        assert!(t.ids.len() <= 1000 && t.ids.len() > 1000 - 20);
        let all = text(&t.ids);
        let lines: Vec<&str> = all.lines().skip(1).filter(|l| l.contains(": ")).collect();
        let asked = format!("{}: {}", t.key, t.expected);
        let k = lines.iter().position(|l| *l == asked).unwrap();
        assert!((k as f64 / (lines.len() - 1) as f64 - depth).abs() < 0.05);
        assert_eq!(
            all.matches(&t.key).count(),
            3,
            "the key: its line and the question"
        );
        assert_eq!(
            all.matches(&t.expected).count(),
            2,
            "the value: its line and the answer"
        );
    }
}

#[test]
fn needles_are_redrawn_until_the_haystack_does_not_hold_them() {
    let tok = Tokenizer::byte();
    let spec = TaskSpec {
        digits: 1,
        ..TaskSpec::new(RetrievalTask::Passkey)
    };
    // a haystack of every digit but 7: only a needle of 7 can be drawn
    let hay_text = "Count 1 2 3. Then 4 5 6. Then 8 9 0. ".repeat(20);
    let hay = Haystack::from_text("digits", &hay_text, &tok).unwrap();
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let g = grid(&[400], 3, 4);
    for i in 0..g.per_length() {
        assert_eq!(maker.trial(&g.at(0, i)).unwrap().expected, "7");
    }
    // every digit: nothing can be drawn, and the error says what to change
    let full = Haystack::from_text("all", &"0 1 2 3 4 5 6 7 8 9. ".repeat(40), &tok).unwrap();
    let maker = TrialMaker::new(&spec, Some(&full), &tok).unwrap();
    let e = maker.trial(&g.at(0, 0)).unwrap_err().to_string();
    assert!(e.contains("--digits"), "{e}");
}

#[test]
fn a_token_file_haystack_takes_a_stretch_of_it() {
    let tok = Tokenizer::byte();
    let ids: Vec<u32> = (0..5000u32).map(|i| 65 + i % 26).collect();
    let hay = Haystack::from_ids(Tokens::from_ids(ids, "letters.u32"));
    let spec = TaskSpec::new(RetrievalTask::Passkey);
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let t = maker.trial(&grid(&[1000], 1, 1).at(0, 0)).unwrap();
    assert_eq!(t.ids.len(), 1000);
    let e = maker
        .trial(&grid(&[8000], 1, 1).at(0, 0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("letters.u32") && e.contains("--haystack"), "{e}");
}

#[test]
fn a_length_too_short_for_the_pieces_names_the_shortest() {
    let tok = Tokenizer::byte();
    let hay = Haystack::filler(&tok).unwrap();
    let spec = TaskSpec::new(RetrievalTask::Passkey);
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let e = maker
        .trial(&grid(&[50], 1, 1).at(0, 0))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--lengths 50") && e.contains("give lengths above"),
        "{e}"
    );
}

#[test]
fn the_corpus_counts_only_the_answers() {
    let dir = std::env::temp_dir().join(format!("upipe-retrieval-corpus-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pk.u32");
    let tok = Tokenizer::byte();
    let hay = Haystack::filler(&tok).unwrap();
    let spec = TaskSpec::new(RetrievalTask::Passkey);
    let maker = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
    let cs = corpus::CorpusSpec {
        lengths: vec![200, 300],
        documents: 10,
        seed: 1,
    };
    let w = corpus::write_corpus(&path, &maker, &cs).unwrap();
    assert_eq!((w.documents, w.counted), (10, 80));
    let data =
        crate::data::Dataset::with_files_beside(Tokens::open(&path).unwrap(), &path).unwrap();
    assert_eq!(data.len() as u64, w.tokens);
    assert_eq!(data.docs.as_ref().unwrap().len(), 10);
    let mask = data.mask.as_ref().unwrap();
    let counted = (0..w.tokens).filter(|&i| mask.counts(i)).count() as u64;
    assert_eq!(counted, 80);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A chat template frames a trial: its context and question are the
/// user's message, the generation prompt follows, then the answer; the
/// trial keeps its length, and the answer's positions are its last ids.
#[test]
fn a_chat_template_makes_the_trial_the_users_turn_with_the_answer_after_it() {
    let tok = Tokenizer::byte();
    let source = "{{ bos_token }}{% for m in messages %}<|user|>{{ m.content }}<|end|>\
                  {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";
    let mut specials = serde_json::Map::new();
    specials.insert("bos_token".into(), "<s>".into());
    let path = std::path::PathBuf::from("chat.jinja");
    let template = ChatTemplate::new(source, specials, path).unwrap();
    let frame = ChatFrame::of(&template, &tok).unwrap();
    assert_eq!(text(&frame.before), "<s><|user|>");
    assert_eq!(text(&frame.after), "<|end|><|assistant|>");
    let hay = Haystack::filler(&tok).unwrap();
    for task in [RetrievalTask::Passkey, RetrievalTask::Kv] {
        let mut spec = TaskSpec::new(task);
        spec.templates.answer = "{value}".into();
        let plain = TrialMaker::new(&spec, Some(&hay), &tok).unwrap();
        let chat = TrialMaker::new(&spec, Some(&hay), &tok)
            .unwrap()
            .with_chat(&frame);
        let at = grid(&[700], 3, 1).at(0, 1);
        let t = chat.trial(&at).unwrap();
        assert!(t.ids.len() <= at.length && t.ids.len() + 20 > at.length);
        assert_eq!(t.answer.end, t.ids.len());
        let all = text(&t.ids);
        assert!(all.starts_with("<s><|user|>"), "{all}");
        let prompt = text(&t.ids[..t.answer.start]);
        assert!(prompt.ends_with("<|end|><|assistant|>"), "{prompt}");
        assert_eq!(text(&t.ids[t.answer.clone()]), t.expected);
        // the same needles as the plain trial of the same place
        assert_eq!(plain.trial(&at).unwrap().expected, t.expected);
    }
    let broken = ChatTemplate::new("hello", Default::default(), "x.jinja".into()).unwrap();
    let e = ChatFrame::of(&broken, &tok).unwrap_err().to_string();
    assert!(e.contains("--chat-template none"), "{e}");
}
