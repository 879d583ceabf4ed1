//! The decoder's step on one rank, walked as `model::decoder` allocates it
//! ([`DecoderWalk`]: embedding, blocks with their checkpoints, offload and
//! kept attention, tiled MLP, the chunked loss), over an attention walk and a
//! parameter store's walk.

use super::attention::{AttnFwd, AttnWalk};
use crate::backend::Category::{self, Activations, Grads, Offload, Workspace};
use crate::model::lora::LoraTarget::{Down, Gate, O, Up};
use crate::model::{MemoryPolicy, ModelConfig, Unit};
use crate::plan::shapes::{distinct_lengths, loss_chunks, mlp_tiles};
use crate::plan::sim::{Buf, Sim};
use crate::plan::store_walk::StoreWalk;

const F32: usize = 4;

/// One rank's decoder step (`Decoder::forward_backward`).
pub struct DecoderWalk<'a> {
    pub cfg: &'a ModelConfig,
    pub policy: MemoryPolicy,
    pub attn: AttnWalk,
    /// The backend uploads token ids into a device buffer (CUDA: `upload_ids`).
    pub uploads_ids: bool,
    /// `Decoder::backward_floor`: the lowest block whose backward runs.
    pub backward_floor: usize,
}

/// What one block keeps (`BlockSaved`).
struct BlockSaved {
    a: Buf,
    o: Buf,
    lse: Vec<Buf>,
    h1: Buf,
    mlp: Option<[Buf; 4]>,
}

/// What the forward keeps of a block besides its input (`decoder::Kept`).
enum Kept {
    Block(BlockSaved),
    Attention(Buf, Vec<Buf>),
    Input,
}

impl DecoderWalk<'_> {
    fn ab(&self) -> usize {
        self.attn.ab
    }
    fn s(&self) -> usize {
        self.attn.sh.s
    }
    fn hidden_buf(&self, sim: &mut Sim, cat: Category) -> Buf {
        sim.alloc(cat, self.s() * self.cfg.hidden * self.ab())
    }

    /// `Decoder::mlp_fwd` of a tile of `r` rows: (m, gate, up, act), gate
    /// and up each with its adapter's delta.
    fn mlp_fwd(&self, sim: &mut Sim, r: usize) -> [Buf; 4] {
        let (ab, lora) = (self.ab(), self.attn.lora);
        let m = sim.alloc(Activations, r * self.cfg.hidden * ab);
        let f = r * self.cfg.ffn * ab;
        let gate = sim.alloc(Activations, f);
        lora.fwd(sim, Gate, r, ab);
        let up = sim.alloc(Activations, f);
        lora.fwd(sim, Up, r, ab);
        [m, gate, up, sim.alloc(Activations, f)]
    }

    /// `Decoder::tile_copy`: a tile's copy of its rows, none for all rows.
    fn tile_copy(&self, sim: &mut Sim, r: usize) -> Option<Buf> {
        (r != self.s()).then(|| sim.alloc(Workspace, r * self.cfg.hidden * self.ab()))
    }

    fn tile_lengths(&self) -> Vec<usize> {
        distinct_lengths(&mlp_tiles(self.s(), self.cfg.hidden, self.policy.tiled_mlp))
    }

    /// `Decoder::block_fwd` on input `h`: (output, saved).
    fn block_fwd(&self, sim: &mut Sim) -> (Buf, BlockSaved) {
        let (a, o, lse, h1) = self.attn_fwd(sim, None);
        let out = self.hidden_buf(sim, Activations);
        let mut mlp = None;
        for r in self.tile_lengths() {
            let x_t = self.tile_copy(sim, r);
            let saved = self.mlp_fwd(sim, r);
            self.attn.lora.fwd(sim, Down, r, self.ab());
            if self.policy.tiled_mlp {
                saved.into_iter().for_each(|b| sim.free(b));
            } else {
                mlp = Some(saved);
            }
            x_t.into_iter().for_each(|b| sim.free(b));
        }
        (out, BlockSaved { a, o, lse, h1, mlp })
    }

    /// `Decoder::attn_fwd`: (a, O, LSEs, h1), the attention run or its kept
    /// O and LSEs projected.
    fn attn_fwd(&self, sim: &mut Sim, kept: Option<(Buf, Vec<Buf>)>) -> (Buf, Buf, Vec<Buf>, Buf) {
        sim.label("forward: attention");
        let a = self.hidden_buf(sim, Activations);
        let (o, lse, y) = match kept {
            // `attention::output_projection`
            Some((o, lse)) => {
                let y = self.hidden_buf(sim, Activations);
                self.attn.lora.fwd(sim, O, self.s(), self.ab());
                (o, lse, y)
            }
            None => {
                let AttnFwd { o, lse, y } = self.attn.forward(sim);
                (o, lse, y)
            }
        };
        sim.label("forward: mlp");
        let h1 = self.hidden_buf(sim, Activations);
        sim.free(y);
        (a, o, lse, h1)
    }

    /// `Decoder::recompute`: a checkpointed block's forward up to what its
    /// backward reads.
    fn recompute(&self, sim: &mut Sim, kept: Option<(Buf, Vec<Buf>)>) -> BlockSaved {
        let (a, o, lse, h1) = self.attn_fwd(sim, kept);
        let mlp = (!self.policy.tiled_mlp).then(|| self.mlp_fwd(sim, self.s()));
        BlockSaved { a, o, lse, h1, mlp }
    }

    /// `Decoder::block_bwd`: consumes `saved` and `d_out`, returns dh.
    fn block_bwd(&self, sim: &mut Sim, saved: BlockSaved, d_out: Buf) -> Buf {
        let BlockSaved {
            a,
            o,
            lse,
            h1,
            mut mlp,
        } = saved;
        let (hid, ab) = (self.cfg.hidden, self.ab());
        sim.label("backward: mlp");
        let dh1 = self.hidden_buf(sim, Grads);
        for r in self.tile_lengths() {
            let x_t = self.tile_copy(sim, r);
            let s = match mlp.take() {
                Some(s) => s,
                None => self.mlp_fwd(sim, r),
            };
            let f = r * self.cfg.ffn * ab;
            let dact = sim.alloc(Workspace, f);
            self.attn.lora.bwd(sim, Down, r, ab);
            let dgate = sim.alloc(Workspace, f);
            let dup = sim.alloc(Workspace, f);
            sim.free(dact);
            let dm = sim.alloc(Workspace, r * hid * ab);
            self.attn.lora.bwd(sim, Gate, r, ab);
            self.attn.lora.bwd(sim, Up, r, ab);
            sim.free(dgate);
            sim.free(dup);
            s.into_iter().for_each(|b| sim.free(b));
            // `norm_bwd_add_rows`: the norm's backward adds into dh1 (through
            // a copy of the tile's rows of it)
            if r != self.s() {
                let tile = sim.alloc(Workspace, r * hid * ab);
                sim.free(tile);
            }
            sim.free(dm);
            x_t.into_iter().for_each(|b| sim.free(b));
        }
        sim.free(h1);
        sim.free(d_out);
        sim.label("backward: attention");
        let da = self.attn.backward(sim, o, lse);
        sim.free(a);
        // the norm's backward adds into dh1, which becomes dh
        sim.free(da);
        dh1
    }

    /// A transient device copy of `n` token ids (embedding, cross-entropy).
    fn ids(&self, sim: &mut Sim, n: usize) {
        if self.uploads_ids {
            let b = sim.alloc(Workspace, n * F32);
            sim.free(b);
        }
    }

    /// `Decoder::fused_loss`: returns dhn.
    fn fused_loss(&self, sim: &mut Sim) -> Buf {
        sim.label("loss");
        let dhn = self.hidden_buf(sim, Grads);
        let loss_sum = sim.alloc(Workspace, F32);
        let chunks = loss_chunks(self.s(), self.policy.loss_chunk);
        for r in distinct_lengths(&chunks) {
            // the logits, overwritten by their gradient
            let logits = sim.alloc(Workspace, r * self.cfg.vocab * self.ab());
            self.ids(sim, r);
            sim.free(logits);
        }
        sim.free(loss_sum);
        dhn
    }

    /// `Decoder::keep_checkpointed`.
    fn keep_checkpointed(&self, sim: &mut Sim, l: usize, saved: BlockSaved) -> Kept {
        let BlockSaved { a, o, lse, h1, mlp } = saved;
        for b in [a, h1].into_iter().chain(mlp.into_iter().flatten()) {
            sim.free(b);
        }
        if self.policy.keeps_attention(l, self.cfg.layers) {
            Kept::Attention(o, lse)
        } else {
            std::iter::once(o).chain(lse).for_each(|b| sim.free(b));
            Kept::Input
        }
    }

    /// `Decoder::forward_backward` after the decoder and parameters exist,
    /// with the parameter store's allocations from `store`.
    pub fn step(&self, sim: &mut Sim, store: &mut dyn StoreWalk) {
        sim.label("forward: embedding");
        let mut x = self.hidden_buf(sim, Activations);
        store.acquire(sim, Unit::Embed);
        self.ids(sim, self.s());
        store.release(sim, Unit::Embed);
        let floor = self.backward_floor.min(self.cfg.layers);
        let mut kept: Vec<(Buf, Kept)> = Vec::new();
        // an offloaded input's device copy, released after the next block
        let mut leaving: Option<Buf> = None;
        for l in 0..self.cfg.layers {
            store.acquire(sim, Unit::Block(l));
            let (next, saved) = self.block_fwd(sim);
            store.release(sim, Unit::Block(l));
            if l < floor {
                // below the backward's floor: nothing kept, the input dropped
                let BlockSaved { a, o, lse, h1, mlp } = saved;
                let bufs = [a, o].into_iter().chain(lse).chain([h1]);
                bufs.chain(mlp.into_iter().flatten())
                    .for_each(|b| sim.free(b));
                sim.free(x);
                x = next;
                continue;
            }
            if self.policy.checkpoint {
                let keep = self.keep_checkpointed(sim, l, saved);
                if self.policy.offloads(l) {
                    let host = sim.alloc(Offload, x.bytes);
                    kept.push((host, keep));
                    sim.free_opt(leaving.replace(x));
                } else {
                    kept.push((x, keep));
                }
            } else {
                kept.push((x, Kept::Block(saved)));
            }
            x = next;
        }
        sim.free_opt(leaving.take());
        // the last block's offloaded input comes back beside the loss
        let reload = |sim: &mut Sim, k: Option<&(Buf, Kept)>| {
            k.filter(|k| k.0.cat == Offload)
                .map(|k| sim.alloc(Activations, k.0.bytes))
        };
        let mut coming = reload(sim, kept.last());
        let mut dx = self.head(sim, store, x);
        while let Some((kept_input, keep)) = kept.pop() {
            let l = floor + kept.len();
            sim.label("backward: reload");
            let (input, host) = match coming.take() {
                Some(dev) => (dev, Some(kept_input)),
                None => (kept_input, None),
            };
            coming = reload(sim, kept.last());
            store.acquire(sim, Unit::Block(l));
            let saved = match keep {
                Kept::Block(s) => s,
                Kept::Attention(o, lse) => self.recompute(sim, Some((o, lse))),
                Kept::Input => self.recompute(sim, None),
            };
            store.block_grads(sim, l);
            dx = self.block_bwd(sim, saved, dx);
            store.release(sim, Unit::Block(l));
            store.grads_done(sim, Unit::Block(l));
            sim.free(input);
            sim.free_opt(host);
        }
        for l in (0..floor).rev() {
            store.grads_done(sim, Unit::Block(l));
        }
        // a frozen embedding's backward (and its ids upload) is skipped
        if store.embed_grads(sim) {
            self.ids(sim, self.s());
        }
        store.grads_done(sim, Unit::Embed);
        store.finish(sim);
        sim.free(dx);
    }

    /// `Decoder::head_fwd_bwd` on the last block's output `x`: returns dx.
    fn head(&self, sim: &mut Sim, store: &mut dyn StoreWalk, x: Buf) -> Buf {
        let tied = self.cfg.tie_embeddings;
        sim.label("loss");
        store.acquire(sim, Unit::Head);
        if tied {
            store.acquire(sim, Unit::Embed);
        }
        let hn = self.hidden_buf(sim, Workspace);
        store.head_grads(sim);
        let dhn = self.fused_loss(sim);
        sim.free(hn);
        let dx = self.hidden_buf(sim, Grads);
        sim.free(dhn);
        sim.free(x);
        if tied {
            store.release(sim, Unit::Embed);
        }
        store.release(sim, Unit::Head);
        store.grads_done(sim, Unit::Head);
        if tied {
            store.grads_done(sim, Unit::Embed);
        }
        dx
    }
}
