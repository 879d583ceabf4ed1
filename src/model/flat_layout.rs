//! Flat layouts of FSDP units and the index math of their shards.
//!
//! A unit's parameters lie end to end in HF order in one flat buffer,
//! padded to a multiple of the world size `W`; rank `r` owns the contiguous
//! elements `[r·shard, (r+1)·shard)`. The layout depends on `W` only through
//! the padding, so a checkpoint saved on one world size re-shards onto
//! another by intersecting ranges ([`pieces`]).
//!
//! A LoRA run's adapters (`--lora-rank`) form a unit of their own per block
//! (an adapter unit, [`UnitLayout::adapters`]): the block's `lora_A`/`lora_B`
//! factors end to end under PEFT's names, sharded, gathered with the block
//! and trained while the block's base unit stays frozen.

use crate::model::lora::{Factor, LoraConfig, tensor_name};
use crate::model::{ModelConfig, Unit};
use std::ops::Range;

/// One parameter's place in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// HF name.
    pub name: String,
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
}

impl ParamSlot {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Its elements in the flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// The part of one parameter inside one rank's shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Index into [`UnitLayout::params`].
    pub param: usize,
    /// Elements of the (flattened) parameter.
    pub elems: Range<usize>,
    /// Where they start in the shard.
    pub at: usize,
}

/// The flat layout of one unit over `world` ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayout {
    pub unit: Unit,
    /// Whether this is a block's adapter unit (its LoRA factors) rather
    /// than the unit's base parameters.
    pub adapters: bool,
    pub params: Vec<ParamSlot>,
    /// Elements without padding.
    pub numel: usize,
    pub world: usize,
    /// Elements every rank owns (`ceil(numel / world)`).
    pub shard: usize,
}

impl UnitLayout {
    /// `unit` of `cfg`, sharded over `world` ranks.
    pub fn new(cfg: &ModelConfig, unit: Unit, world: usize) -> Self {
        Self::of_params(unit, false, unit_params(cfg, unit), world)
    }

    /// Block `layer`'s adapter unit of `lora` over `world` ranks: `lora_A`
    /// then `lora_B` of each target, in target order (the order of
    /// `BlockWeights::adapter_tensors`), under PEFT's names.
    pub fn adapters(cfg: &ModelConfig, lora: &LoraConfig, layer: usize, world: usize) -> Self {
        let params = lora.targets.iter().flat_map(|&t| {
            let [a, b] = lora.factor_shapes(cfg, t);
            [
                (tensor_name(layer, t, Factor::A), a.to_vec()),
                (tensor_name(layer, t, Factor::B), b.to_vec()),
            ]
        });
        Self::of_params(Unit::Block(layer), true, params.collect(), world)
    }

    fn of_params(
        unit: Unit,
        adapters: bool,
        named: Vec<(String, Vec<usize>)>,
        world: usize,
    ) -> Self {
        let mut params = Vec::new();
        let mut offset = 0;
        for (name, shape) in named {
            let slot = ParamSlot {
                name,
                shape,
                offset,
            };
            offset += slot.numel();
            params.push(slot);
        }
        let world = world.max(1);
        UnitLayout {
            unit,
            adapters,
            params,
            numel: offset,
            world,
            shard: offset.div_ceil(world),
        }
    }

    /// A short, file-name-safe name (`layers.3`; `layers.3.lora` for its
    /// adapter unit).
    pub fn key(&self) -> String {
        match self.adapters {
            true => format!("{}.lora", unit_key(self.unit)),
            false => unit_key(self.unit),
        }
    }

    /// Length of the padded flat buffer (`world · shard`).
    pub fn padded(&self) -> usize {
        self.shard * self.world
    }

    /// The flat elements rank `rank` owns (may reach into the padding).
    pub fn owned(&self, rank: usize) -> Range<usize> {
        rank * self.shard..(rank + 1) * self.shard
    }

    /// The pieces of parameters inside rank `rank`'s shard, in order.
    pub fn segments(&self, rank: usize) -> Vec<Segment> {
        let own = self.owned(rank);
        self.params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let r = overlap(&p.range(), &own)?;
                Some(Segment {
                    param: i,
                    elems: r.start - p.offset..r.end - p.offset,
                    at: r.start - own.start,
                })
            })
            .collect()
    }
}

/// The parameters of `unit`, with HF names and shapes, in HF order.
pub fn unit_params(cfg: &ModelConfig, unit: Unit) -> Vec<(String, Vec<usize>)> {
    cfg.params()
        .into_iter()
        .filter(|(p, _)| p.unit() == unit)
        .map(|(p, shape)| (cfg.hf_name(p), shape))
        .collect()
}

/// The layouts of every unit of `cfg` over `world` ranks, in [`Unit::all`] order.
pub fn model_layouts(cfg: &ModelConfig, world: usize) -> Vec<UnitLayout> {
    Unit::all(cfg.layers)
        .into_iter()
        .map(|u| UnitLayout::new(cfg, u, world))
        .collect()
}

/// [`model_layouts`] followed, with `lora`, by every block's adapter unit
/// (block `l`'s at index `layers + 2 + l`).
pub fn layouts_with_adapters(
    cfg: &ModelConfig,
    lora: Option<&LoraConfig>,
    world: usize,
) -> Vec<UnitLayout> {
    let mut v = model_layouts(cfg, world);
    if let Some(lora) = lora {
        v.extend((0..cfg.layers).map(|l| UnitLayout::adapters(cfg, lora, l, world)));
    }
    v
}

/// The common part of two ranges, if any.
pub fn overlap(a: &Range<usize>, b: &Range<usize>) -> Option<Range<usize>> {
    let r = a.start.max(b.start)..a.end.min(b.end);
    (r.start < r.end).then_some(r)
}

/// Which ranks of a sharding with `shard` elements per rank hold the flat
/// elements `range`: `(rank, the part of range it holds)`, in order.
pub fn pieces(range: &Range<usize>, shard: usize) -> Vec<(usize, Range<usize>)> {
    if range.is_empty() || shard == 0 {
        return Vec::new();
    }
    (range.start / shard..=(range.end - 1) / shard)
        .filter_map(|r| Some((r, overlap(range, &(r * shard..(r + 1) * shard))?)))
        .collect()
}

/// A short, file-name-safe name of a unit (`embed`, `layers.3`, `head`).
pub fn unit_key(unit: Unit) -> String {
    match unit {
        Unit::Embed => "embed".into(),
        Unit::Block(l) => format!("layers.{l}"),
        Unit::Head => "head".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(tied: bool) -> ModelConfig {
        let mut c = ModelConfig::resolve("tiny").unwrap();
        c.tie_embeddings = tied;
        c
    }

    #[test]
    fn units_cover_every_parameter_once() {
        for tied in [false, true] {
            let c = cfg(tied);
            let mut names: Vec<String> = model_layouts(&c, 3)
                .iter()
                .flat_map(|u| u.params.iter().map(|p| p.name.clone()))
                .collect();
            let mut want: Vec<String> = c.hf_param_shapes().into_iter().map(|p| p.0).collect();
            names.sort();
            want.sort();
            assert_eq!(names, want);
        }
        let head = UnitLayout::new(&cfg(true), Unit::Head, 2);
        assert_eq!(head.params.len(), 1, "a tied head is the final norm only");
    }

    #[test]
    fn adapter_units_follow_the_base_units_in_peft_order() {
        use crate::model::lora::LoraTarget;
        let c = cfg(false);
        let lora = LoraConfig::new(2, 4.0, false, vec![LoraTarget::Q, LoraTarget::Down]).unwrap();
        let all = layouts_with_adapters(&c, Some(&lora), 3);
        assert_eq!(all.len(), 2 * c.layers + 2);
        let a = &all[c.layers + 3];
        assert!(a.adapters && a.unit == Unit::Block(1) && a.key() == "layers.1.lora");
        let names: Vec<&str> = a.params.iter().map(|p| p.name.as_str()).collect();
        let want = [
            tensor_name(1, LoraTarget::Q, Factor::A),
            tensor_name(1, LoraTarget::Q, Factor::B),
            tensor_name(1, LoraTarget::Down, Factor::A),
            tensor_name(1, LoraTarget::Down, Factor::B),
        ];
        assert_eq!(names, want.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(a.numel, lora.params_per_block(&c));
        assert_eq!(a.shard, a.numel.div_ceil(3));
        assert_eq!(layouts_with_adapters(&c, None, 3), model_layouts(&c, 3));
    }

    proptest! {
        /// The ranks' segments tile every parameter exactly, in order, inside
        /// their shards; padding is less than one element per rank.
        #[test]
        fn segments_tile_the_unit(world in 1usize..9, l in 0usize..2, which in 0usize..3) {
            let c = cfg(false);
            let unit = [Unit::Embed, Unit::Block(l), Unit::Head][which];
            let u = UnitLayout::new(&c, unit, world);
            prop_assert!(u.padded() >= u.numel && u.padded() < u.numel + world);
            let mut next_flat = 0;
            for r in 0..world {
                for s in u.segments(r) {
                    let p = &u.params[s.param];
                    prop_assert_eq!(p.offset + s.elems.start, next_flat);
                    prop_assert_eq!(r * u.shard + s.at, next_flat);
                    prop_assert!(s.at + s.elems.len() <= u.shard);
                    next_flat += s.elems.len();
                }
            }
            prop_assert_eq!(next_flat, u.numel);
        }

        /// `pieces` splits any range over the ranks that own it, in order.
        #[test]
        fn pieces_partition_a_range(start in 0usize..200, len in 0usize..200, shard in 1usize..50) {
            let range = start..start + len;
            let got = pieces(&range, shard);
            let mut at = start;
            for (r, p) in &got {
                prop_assert_eq!(p.start, at);
                prop_assert!(p.start >= r * shard && p.end <= (r + 1) * shard);
                at = p.end;
            }
            prop_assert_eq!(at, range.end);
        }
    }
}
