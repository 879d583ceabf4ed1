//! Frozen parameters (`--freeze`): which of a model's parameters a run
//! does not train. A frozen parameter keeps no gradient and no optimizer
//! state, and its weight gradient is never computed: the backward still
//! runs through it for the input gradient.
//!
//! The spec is a comma list: `embeddings`, `head` (the LM head matrix),
//! `norms` (every RMSNorm: the blocks' `input_layernorm`,
//! `post_attention_layernorm`, q/k norms, Gemma's post-norms, and the final
//! `model.norm`),
//! `attn` (every block's attention projections, biases and q/k norms),
//! `mlp` (every block's gate/up/down) and `blocks:A-B` (every parameter of
//! blocks A to B inclusive; `blocks:A` one block). With tied embeddings the
//! embedding is the LM head: freezing either freezes that one matrix.
//!
//! Parsed once ([`Freeze::parse`]), checked against a model once
//! ([`Freeze::check`]); then [`Freeze::is_frozen`] answers per parameter.

use super::config::ModelConfig;
use super::families::{BlockParam, Param};
use super::unit::Unit;
use crate::error::Result;
use std::ops::RangeInclusive;

/// The words of a `--freeze` spec, for messages.
pub const FREEZE_WORDS: &str = "embeddings, head, norms, attn, mlp, blocks:A-B";

/// One item of a `--freeze` spec.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Item {
    Embeddings,
    Head,
    Norms,
    Attn,
    Mlp,
    Blocks(RangeInclusive<usize>),
}

/// The parameters a run freezes (empty: it trains every parameter).
#[derive(Debug, Clone, Default)]
pub struct Freeze {
    items: Vec<Item>,
    /// Runs the backward through every block even below the lowest
    /// trained one ([`Freeze::backward_floor`] 0): the same gradients with
    /// more work and memory, for tests that compare the two. False unless
    /// a test sets it; not part of the spec (equality, `Display`).
    pub full_backward: bool,
}

impl PartialEq for Freeze {
    fn eq(&self, other: &Self) -> bool {
        self.items == other.items
    }
}

impl Eq for Freeze {}

impl std::fmt::Display for Freeze {
    /// The spec as `--freeze` takes it (`embeddings,blocks:0-3`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let words: Vec<String> = self.items.iter().map(item_word).collect();
        write!(f, "{}", words.join(","))
    }
}

fn item_word(item: &Item) -> String {
    match item {
        Item::Embeddings => "embeddings".into(),
        Item::Head => "head".into(),
        Item::Norms => "norms".into(),
        Item::Attn => "attn".into(),
        Item::Mlp => "mlp".into(),
        Item::Blocks(r) if r.start() == r.end() => format!("blocks:{}", r.start()),
        Item::Blocks(r) => format!("blocks:{}-{}", r.start(), r.end()),
    }
}

impl Freeze {
    /// Freezes nothing.
    pub fn none() -> Self {
        Freeze::default()
    }

    /// Freezes every parameter of a model (embeddings, head, norms,
    /// attention, MLP): what a LoRA run trains none of. [`Freeze::check`]
    /// refuses it (nothing left to train) unless adapters train.
    pub fn whole_base() -> Self {
        let items = vec![
            Item::Embeddings,
            Item::Head,
            Item::Norms,
            Item::Attn,
            Item::Mlp,
        ];
        Freeze {
            items,
            full_backward: false,
        }
    }

    /// Parses a `--freeze` spec (`none` or empty: nothing frozen); an
    /// unknown word lists the known ones.
    pub fn parse(spec: &str) -> Result<Self> {
        let spec = spec.trim();
        if spec.is_empty() || spec == "none" {
            return Ok(Freeze::none());
        }
        let mut items = Vec::new();
        for word in spec.split(',').map(str::trim) {
            let item = parse_item(word)?;
            if !items.contains(&item) {
                items.push(item);
            }
        }
        Ok(Freeze {
            items,
            full_backward: false,
        })
    }

    /// Whether it freezes nothing.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Checks the spec against `cfg`: its blocks exist, and something is
    /// left to train.
    pub fn check(&self, cfg: &ModelConfig) -> Result<()> {
        self.check_with_adapters(cfg, false)
    }

    /// [`Freeze::check`] for a run whose LoRA adapters train when
    /// `adapters` is set: then freezing every base parameter is what the
    /// run means ([`Freeze::whole_base`]), not an error.
    pub fn check_with_adapters(&self, cfg: &ModelConfig, adapters: bool) -> Result<()> {
        for item in &self.items {
            if let Item::Blocks(r) = item
                && *r.end() >= cfg.layers
            {
                return crate::config_err!(
                    "--freeze {}: the model has {} blocks (0-{}); name blocks within them",
                    item_word(item),
                    cfg.layers,
                    cfg.layers.saturating_sub(1)
                );
            }
        }
        if !adapters
            && !self.is_empty()
            && cfg.params().iter().all(|(p, _)| self.is_frozen(cfg, *p))
        {
            return crate::config_err!(
                "--freeze {self} freezes every parameter of the model: nothing to train; \
                 freeze less (or drop --freeze)"
            );
        }
        Ok(())
    }

    /// Whether parameter `p` of `cfg`'s model is frozen. With tied
    /// embeddings the embedding is also the LM head: `head` freezes it too.
    pub fn is_frozen(&self, cfg: &ModelConfig, p: Param) -> bool {
        self.items.iter().any(|item| match (item, p) {
            (Item::Embeddings, Param::Embed) => true,
            (Item::Head, Param::LmHead) => true,
            (Item::Head, Param::Embed) => cfg.tie_embeddings,
            (Item::Norms, Param::FinalNorm) => true,
            (Item::Norms, Param::Block(_, bp)) => is_norm(bp),
            (Item::Attn, Param::Block(_, bp)) => is_attention(bp),
            (Item::Mlp, Param::Block(_, bp)) => {
                matches!(bp, BlockParam::Gate | BlockParam::Up | BlockParam::Down)
            }
            (Item::Blocks(r), Param::Block(l, _)) => r.contains(&l),
            _ => false,
        })
    }

    /// Whether every parameter of `unit` is frozen.
    pub fn unit_frozen(&self, cfg: &ModelConfig, unit: Unit) -> bool {
        let mut params = cfg.params().into_iter().filter(|(p, _)| p.unit() == unit);
        params.all(|(p, _)| self.is_frozen(cfg, p))
    }

    /// The first unit of `cfg` that has both frozen and trainable
    /// parameters, if any.
    pub fn split_unit(&self, cfg: &ModelConfig) -> Option<Unit> {
        Unit::all(cfg.layers).into_iter().find(|&u| {
            let mut params = cfg.params().into_iter().filter(|(p, _)| p.unit() == u);
            let frozen: Vec<bool> = params
                .by_ref()
                .map(|(p, _)| self.is_frozen(cfg, p))
                .collect();
            frozen.iter().any(|&f| f) && !frozen.iter().all(|&f| f)
        })
    }

    /// The lowest block whose backward runs: the lowest block with a
    /// trained parameter (`adapters`: LoRA adapters train in every block,
    /// so 0), or `cfg.layers` when no block trains. Nothing below it needs
    /// a gradient, so the step's backward stops after it and the forward
    /// keeps nothing for the blocks below. A trained embedding (or a tied
    /// head that trains it) needs the gradient of block 0's input: 0.
    pub fn backward_floor(&self, cfg: &ModelConfig, adapters: bool) -> usize {
        if self.full_backward || adapters || !self.is_frozen(cfg, Param::Embed) {
            return 0;
        }
        let trains = |l: usize| !self.unit_frozen(cfg, Unit::Block(l));
        (0..cfg.layers).find(|&l| trains(l)).unwrap_or(cfg.layers)
    }

    /// Elements of `cfg`'s model that are frozen, and all of them.
    pub fn frozen_elements(&self, cfg: &ModelConfig) -> (usize, usize) {
        let numel = |s: &Vec<usize>| s.iter().product::<usize>();
        let params = cfg.params();
        let all = params.iter().map(|(_, s)| numel(s)).sum();
        let frozen = params
            .iter()
            .filter(|(p, _)| self.is_frozen(cfg, *p))
            .map(|(_, s)| numel(s))
            .sum();
        (frozen, all)
    }
}

impl std::str::FromStr for Freeze {
    type Err = crate::error::Error;
    fn from_str(s: &str) -> Result<Self> {
        Freeze::parse(s)
    }
}

/// RMSNorm weights of a block.
fn is_norm(bp: BlockParam) -> bool {
    use BlockParam::*;
    matches!(
        bp,
        AttnNorm | MlpNorm | QNorm | KNorm | PostAttnNorm | PostMlpNorm
    )
}

/// The attention's parameters of a block (its input norm is the block's).
fn is_attention(bp: BlockParam) -> bool {
    use BlockParam::*;
    matches!(bp, Wq | Wk | Wv | Wo | Bq | Bk | Bv | QNorm | KNorm)
}

fn parse_item(word: &str) -> Result<Item> {
    Ok(match word {
        "embeddings" | "embed" => Item::Embeddings,
        "head" | "lm_head" => Item::Head,
        "norms" => Item::Norms,
        "attn" => Item::Attn,
        "mlp" => Item::Mlp,
        _ => match word.strip_prefix("blocks:") {
            Some(range) => Item::Blocks(parse_blocks(word, range)?),
            None => {
                return crate::config_err!(
                    "--freeze: unknown part '{word}'; use a comma list of {FREEZE_WORDS} \
                     (or none)"
                );
            }
        },
    })
}

/// `A-B` (inclusive) or `A`.
fn parse_blocks(word: &str, range: &str) -> Result<RangeInclusive<usize>> {
    let num = |s: &str| s.trim().parse::<usize>().ok();
    let (a, b) = match range.split_once('-') {
        Some((a, b)) => (num(a), num(b)),
        None => (num(range), num(range)),
    };
    match (a, b) {
        (Some(a), Some(b)) if a <= b => Ok(a..=b),
        _ => crate::config_err!(
            "--freeze {word}: give blocks as blocks:A-B with A <= B (block numbers from 0), \
             or blocks:A"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(tied: bool) -> ModelConfig {
        let mut c = ModelConfig::resolve("tiny").unwrap();
        c.tie_embeddings = tied;
        c
    }

    #[test]
    fn parses_and_prints_the_spec() {
        let f = Freeze::parse("embeddings, blocks:0-1,norms,blocks:1").unwrap();
        assert_eq!(f.to_string(), "embeddings,blocks:0-1,norms,blocks:1");
        assert!(Freeze::parse("none").unwrap().is_empty());
        assert!(Freeze::parse("").unwrap().is_empty());
        let e = Freeze::parse("embeddings,lora").unwrap_err().to_string();
        assert!(
            e.contains("unknown part 'lora'") && e.contains(FREEZE_WORDS),
            "{e}"
        );
        let e = Freeze::parse("blocks:3-1").unwrap_err().to_string();
        assert!(e.contains("A <= B"), "{e}");
        assert!(Freeze::parse("blocks:x").is_err());
    }

    #[test]
    fn answers_per_parameter() {
        let c = tiny(false);
        let f = Freeze::parse("norms,blocks:1").unwrap();
        assert!(f.is_frozen(&c, Param::FinalNorm));
        assert!(f.is_frozen(&c, Param::Block(0, BlockParam::MlpNorm)));
        assert!(!f.is_frozen(&c, Param::Block(0, BlockParam::Wq)));
        assert!(f.is_frozen(&c, Param::Block(1, BlockParam::Wq)));
        assert!(!f.is_frozen(&c, Param::LmHead) && !f.is_frozen(&c, Param::Embed));
        assert!(f.unit_frozen(&c, Unit::Block(1)) && !f.unit_frozen(&c, Unit::Block(0)));
        assert_eq!(f.split_unit(&c), Some(Unit::Block(0)));
        let attn = Freeze::parse("attn").unwrap();
        assert!(attn.is_frozen(&c, Param::Block(0, BlockParam::Wo)));
        assert!(!attn.is_frozen(&c, Param::Block(0, BlockParam::AttnNorm)));
        assert!(!attn.is_frozen(&c, Param::Block(0, BlockParam::Up)));
    }

    #[test]
    fn a_tied_head_is_the_embedding() {
        let c = tiny(true);
        let f = Freeze::parse("head").unwrap();
        assert!(f.is_frozen(&c, Param::Embed));
        assert!(
            !Freeze::parse("head")
                .unwrap()
                .is_frozen(&tiny(false), Param::Embed)
        );
    }

    #[test]
    fn the_backward_stops_at_the_lowest_trained_block() {
        let c = tiny(false);
        let floor =
            |spec: &str, adapters| Freeze::parse(spec).unwrap().backward_floor(&c, adapters);
        assert_eq!(c.layers, 2);
        assert_eq!(floor("none", false), 0);
        // a trained embedding needs block 0's input gradient
        assert_eq!(floor("blocks:0", false), 0);
        assert_eq!(floor("embeddings,blocks:0", false), 1);
        assert_eq!(floor("embeddings", false), 0);
        // a block with any trained parameter runs its backward
        assert_eq!(floor("embeddings,attn", false), 0);
        assert_eq!(floor("embeddings,blocks:0-1", false), 2);
        // LoRA adapters train in every block
        assert_eq!(floor("embeddings,blocks:0-1", true), 0);
        let mut full = Freeze::parse("embeddings,blocks:0").unwrap();
        full.full_backward = true;
        assert_eq!(full.backward_floor(&c, false), 0);
        assert_eq!(full, Freeze::parse("embeddings,blocks:0").unwrap());
        // a tied head trains the embedding unless `head` or `embeddings` freezes it
        let t = tiny(true);
        let tied = |spec: &str| Freeze::parse(spec).unwrap().backward_floor(&t, false);
        assert_eq!(tied("blocks:0"), 0);
        assert_eq!(tied("head,blocks:0"), 1);
        assert_eq!(tied("embeddings,blocks:0"), 1);
    }

    #[test]
    fn checks_against_the_model() {
        let c = tiny(false);
        let e = Freeze::parse("blocks:0-9").unwrap().check(&c).unwrap_err();
        let want = format!("the model has {} blocks", c.layers);
        assert!(e.to_string().contains(&want), "{e}");
        let all = format!("embeddings,head,norms,blocks:0-{}", c.layers - 1);
        let e = Freeze::parse(&all).unwrap().check(&c).unwrap_err();
        assert!(e.to_string().contains("nothing to train"), "{e}");
        Freeze::parse("embeddings,head").unwrap().check(&c).unwrap();
        let (frozen, total) = Freeze::parse("embeddings").unwrap().frozen_elements(&c);
        assert_eq!(frozen, c.vocab * c.hidden);
        assert!(total > frozen);
    }
}
