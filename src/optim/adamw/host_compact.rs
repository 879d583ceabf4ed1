//! AdamW's compact update (`compact_adamw.rs`: BF16 or 8-bit moments, or
//! BF16 weights with no master) over host memory, for `--offload-optimizer`
//! beside a compact `--optim-state` or `--master-weights none`. Each piece
//! is cut into chunks of whole 8-bit blocks, spread over the host's
//! threads; a chunk's values are widened into the f32 cells the CPU
//! reference updates ([`update_piece`]) and stored back in their format.
//! Every element's arithmetic, and every block, is the reference's, so the
//! result is the device's update bit for bit, whatever the split.

use super::adamw_step::AdamWStep;
use super::compact_adamw::{
    MomentCodec, MomentsMut, PieceUpdate, Q8_BLOCK, WeightRounding, q8_blocks, update_piece,
};
use crate::backend::{HostValues, HostValuesMut};
use rayon::prelude::*;
use std::ops::Range;

/// Elements per task: whole 8-bit blocks, large enough to amortise the
/// scheduling, small enough to spread one tensor over every core.
const CHUNK: usize = 256 * Q8_BLOCK;

/// One slot's weights, gradient and moments in host memory, as they are
/// kept: what [`update_slot`] updates.
pub struct HostState<'a> {
    /// The weights updated: an F32 master, or the parameter's own values
    /// (F32, or BF16 rounded stochastically: `rounding`).
    pub w: HostValuesMut<'a>,
    pub rounding: WeightRounding,
    pub g: HostValues<'a>,
    pub codec: MomentCodec,
    /// Moments: values or 8-bit codes, and with [`MomentCodec::Q8`] the
    /// scales of each piece's blocks in turn (else empty).
    pub m: HostValuesMut<'a>,
    pub m_scales: &'a mut [f32],
    pub v: HostValuesMut<'a>,
    pub v_scales: &'a mut [f32],
}

/// Updates each piece `(elements, hyper-parameters)` of one slot.
pub fn update_slot(s: HostState<'_>, pieces: &[(Range<usize>, AdamWStep)]) {
    let HostState {
        mut w,
        rounding,
        g,
        codec,
        mut m,
        m_scales,
        mut v,
        v_scales,
    } = s;
    let mut at = 0;
    for (elems, hp) in pieces {
        let r = elems.clone();
        let blocks = if codec == MomentCodec::Q8 {
            at..at + q8_blocks(r.len())
        } else {
            0..0
        };
        at = blocks.end.max(at);
        let piece = Piece {
            w: chunks(sub(&mut w, r.clone())),
            g: (values(g, r.clone()).chunks(CHUNK)).collect(),
            m: chunks(sub(&mut m, r.clone())),
            v: chunks(sub(&mut v, r.clone())),
            m_scales: scale_chunks(&mut m_scales[blocks.clone()]),
            v_scales: scale_chunks(&mut v_scales[blocks]),
        };
        piece.update(PieceRule {
            rounding,
            codec,
            first: r.start,
            hp: *hp,
        });
    }
}

/// What every chunk of a piece shares.
#[derive(Clone, Copy)]
struct PieceRule {
    rounding: WeightRounding,
    codec: MomentCodec,
    /// The piece's first element in the slot (stochastic rounding's counter).
    first: usize,
    hp: AdamWStep,
}

/// A piece's state, cut into chunks of [`CHUNK`] elements.
struct Piece<'a> {
    w: Vec<HostValuesMut<'a>>,
    g: Vec<Grad<'a>>,
    m: Vec<HostValuesMut<'a>>,
    v: Vec<HostValuesMut<'a>>,
    /// Empty unless the moments are 8-bit.
    m_scales: Vec<&'a mut [f32]>,
    v_scales: Vec<&'a mut [f32]>,
}

impl Piece<'_> {
    fn update(self, rule: PieceRule) {
        let n = self.w.len();
        let mut ms = self.m_scales.into_iter().map(Some).collect::<Vec<_>>();
        let mut vs = self.v_scales.into_iter().map(Some).collect::<Vec<_>>();
        ms.resize_with(n, || None);
        vs.resize_with(n, || None);
        let chunks = (self.w.into_iter().zip(self.g).zip(self.m).zip(self.v))
            .zip(ms.into_iter().zip(vs))
            .enumerate();
        chunks
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(|(k, ((((w, g), m), v), (ms, vs)))| {
                let first = rule.first + k * CHUNK;
                update_chunk(rule, first, (w, g, m, v), (ms, vs));
            });
    }
}

/// One chunk's update: widened, updated by the reference, stored back.
fn update_chunk(
    rule: PieceRule,
    first: usize,
    (mut w, g, mut m, mut v): (
        HostValuesMut<'_>,
        Grad<'_>,
        HostValuesMut<'_>,
        HostValuesMut<'_>,
    ),
    (ms, vs): (Option<&mut [f32]>, Option<&mut [f32]>),
) {
    let (mut wc, mut mc, mut vc) = (widen(&w), widen(&m), widen(&v));
    let gc = g.widen();
    let (mut no_m, mut no_v) = ([0f32; 0], [0f32; 0]);
    update_piece(PieceUpdate {
        w: &mut wc,
        rounding: rule.rounding,
        first,
        g: &gc,
        m: MomentsMut {
            codec: rule.codec,
            values: &mut mc,
            scales: ms.unwrap_or(&mut no_m),
        },
        v: MomentsMut {
            codec: rule.codec,
            values: &mut vc,
            scales: vs.unwrap_or(&mut no_v),
        },
        hp: rule.hp,
    });
    store(&mut w, &wc);
    store(&mut m, &mc);
    store(&mut v, &vc);
}

/// Elements `r` of `t`.
fn sub<'t>(t: &'t mut HostValuesMut<'_>, r: Range<usize>) -> HostValuesMut<'t> {
    match t {
        HostValuesMut::F32(x) => HostValuesMut::F32(&mut x[r]),
        HostValuesMut::Bf16(x) => HostValuesMut::Bf16(&mut x[r]),
        HostValuesMut::U8(x) => HostValuesMut::U8(&mut x[r]),
    }
}

/// `t` in chunks of [`CHUNK`] elements.
fn chunks(t: HostValuesMut<'_>) -> Vec<HostValuesMut<'_>> {
    match t {
        HostValuesMut::F32(x) => x.chunks_mut(CHUNK).map(HostValuesMut::F32).collect(),
        HostValuesMut::Bf16(x) => x.chunks_mut(CHUNK).map(HostValuesMut::Bf16).collect(),
        HostValuesMut::U8(x) => x.chunks_mut(CHUNK).map(HostValuesMut::U8).collect(),
    }
}

/// A piece's block scales, one run of blocks per chunk.
fn scale_chunks(s: &mut [f32]) -> Vec<&mut [f32]> {
    s.chunks_mut(CHUNK / Q8_BLOCK).collect()
}

/// A chunk of the gradient, as it came from the device.
enum Grad<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// Elements `r` of a gradient.
fn values(g: HostValues<'_>, r: Range<usize>) -> Grad<'_> {
    match g {
        HostValues::F32(x) => Grad::F32(&x[r]),
        HostValues::Bf16(x) => Grad::Bf16(&x[r]),
    }
}

impl<'a> Grad<'a> {
    fn chunks(self, n: usize) -> Box<dyn Iterator<Item = Grad<'a>> + 'a> {
        match self {
            Grad::F32(x) => Box::new(x.chunks(n).map(Grad::F32)),
            Grad::Bf16(x) => Box::new(x.chunks(n).map(Grad::Bf16)),
        }
    }

    /// Its values (BF16 widened exactly).
    fn widen(&self) -> Vec<f32> {
        match self {
            Grad::F32(x) => x.to_vec(),
            Grad::Bf16(x) => x.iter().map(|&b| bf16_to_f32(b)).collect(),
        }
    }
}

/// The f32 cells the reference updates: F32 values, BF16 values, or 8-bit
/// codes as integers.
fn widen(t: &HostValuesMut<'_>) -> Vec<f32> {
    match t {
        HostValuesMut::F32(x) => x.to_vec(),
        HostValuesMut::Bf16(x) => x.iter().map(|&b| bf16_to_f32(b)).collect(),
        HostValuesMut::U8(x) => x.iter().map(|&c| f32::from(c)).collect(),
    }
}

/// Stores cells the reference wrote: values of the tensor's format already
/// (BF16 values, codes), so narrowing them is exact.
fn store(t: &mut HostValuesMut<'_>, cells: &[f32]) {
    match t {
        HostValuesMut::F32(x) => x.copy_from_slice(cells),
        HostValuesMut::Bf16(x) => {
            for (d, &c) in x.iter_mut().zip(cells) {
                *d = half::bf16::from_f32(c).to_bits();
            }
        }
        HostValuesMut::U8(x) => {
            for (d, &c) in x.iter_mut().zip(cells) {
                *d = c as u8;
            }
        }
    }
}

fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::adamw::compact_adamw::{rounding_key, test_hp as hp};

    /// Values in `[-1, 1)` from a counter.
    fn wave(n: usize, k: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 2654435761 + k * 97) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    fn narrow_bf16(x: &[f32]) -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    }

    /// The host update of BF16 weights (stochastic rounding), a BF16
    /// gradient and 8-bit or BF16 moments, over pieces several chunks long
    /// (one not a whole number of blocks, one starting past a gap), equals
    /// the reference's [`update_piece`] on f32 cells of each whole piece,
    /// bit for bit, over three steps.
    #[test]
    fn chunks_over_threads_update_as_the_reference_does() {
        let n = 3 * CHUNK + 700;
        let pieces = [0..CHUNK + 300, CHUNK + 400..n];
        for codec in [MomentCodec::Q8, MomentCodec::Bf16] {
            let blocks: usize = pieces.iter().map(|p| q8_blocks(p.len())).sum();
            // the reference: f32 cells
            let w0: Vec<f32> = narrow_bf16(&wave(n, 1))
                .into_iter()
                .map(bf16_to_f32)
                .collect();
            let (mut rw, mut rm, mut rv) = (w0.clone(), vec![0f32; n], vec![0f32; n]);
            let (mut rms, mut rvs) = (vec![0f32; blocks], vec![0f32; blocks]);
            // the host's: BF16 bits, 8-bit codes or BF16 moments
            let mut hw = narrow_bf16(&w0);
            let (mut hm8, mut hv8) = (vec![0u8; n], vec![0u8; n]);
            let (mut hm16, mut hv16) = (vec![0u16; n], vec![0u16; n]);
            let (mut hms, mut hvs) = (vec![0f32; blocks], vec![0f32; blocks]);
            for step in 1..=3 {
                let g = narrow_bf16(&wave(n, step as usize + 5));
                let gf: Vec<f32> = g.iter().map(|&b| bf16_to_f32(b)).collect();
                let key = rounding_key(7, step, 3);
                let rounding = WeightRounding::Stochastic(key);
                let mut at = 0;
                for p in &pieces {
                    let sb = at..at + q8_blocks(p.len());
                    at = sb.end;
                    let sb = if codec == MomentCodec::Q8 { sb } else { 0..0 };
                    update_piece(PieceUpdate {
                        w: &mut rw[p.clone()],
                        rounding,
                        first: p.start,
                        g: &gf[p.clone()],
                        m: MomentsMut {
                            codec,
                            values: &mut rm[p.clone()],
                            scales: &mut rms[sb.clone()],
                        },
                        v: MomentsMut {
                            codec,
                            values: &mut rv[p.clone()],
                            scales: &mut rvs[sb],
                        },
                        hp: hp(step),
                    });
                }
                let (m, v) = match codec {
                    MomentCodec::Q8 => (HostValuesMut::U8(&mut hm8), HostValuesMut::U8(&mut hv8)),
                    _ => (
                        HostValuesMut::Bf16(&mut hm16),
                        HostValuesMut::Bf16(&mut hv16),
                    ),
                };
                let (ms, vs): (&mut [f32], &mut [f32]) = match codec {
                    MomentCodec::Q8 => (&mut hms, &mut hvs),
                    _ => (&mut [], &mut []),
                };
                let state = HostState {
                    w: HostValuesMut::Bf16(&mut hw),
                    rounding,
                    g: HostValues::Bf16(&g),
                    codec,
                    m,
                    m_scales: ms,
                    v,
                    v_scales: vs,
                };
                let with_hp: Vec<_> = pieces.iter().map(|p| (p.clone(), hp(step))).collect();
                update_slot(state, &with_hp);
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let host_w: Vec<f32> = hw.iter().map(|&b| bf16_to_f32(b)).collect();
            assert_eq!(bits(&host_w), bits(&rw), "{codec:?}: weights");
            let (host_m, host_v): (Vec<f32>, Vec<f32>) = match codec {
                MomentCodec::Q8 => (
                    hm8.iter().map(|&c| f32::from(c)).collect(),
                    hv8.iter().map(|&c| f32::from(c)).collect(),
                ),
                _ => (
                    hm16.iter().map(|&b| bf16_to_f32(b)).collect(),
                    hv16.iter().map(|&b| bf16_to_f32(b)).collect(),
                ),
            };
            assert_eq!(bits(&host_m), bits(&rm), "{codec:?}: first moment");
            assert_eq!(bits(&host_v), bits(&rv), "{codec:?}: second moment");
            assert_eq!(bits(&hms), bits(&rms), "{codec:?}: scales");
            assert_eq!(bits(&hvs), bits(&rvs), "{codec:?}: scales");
            // the gap between the pieces is untouched, the rest moved
            assert_eq!(
                bits(&host_w[CHUNK + 300..CHUNK + 400]),
                bits(&w0[CHUNK + 300..CHUNK + 400])
            );
            assert!(host_w.iter().zip(&w0).filter(|(a, b)| a != b).count() > n / 2);
        }
    }
}
