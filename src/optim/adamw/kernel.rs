//! AdamW's arithmetic as the devices run it: the [`UpdateKernel`]s of
//! [`AdamWOps`](super::ops::AdamWOps). On the host, the CPU reference's
//! per-element update (`host_adamw.rs`, `compact_adamw.rs`); on a GPU, the
//! program [`PROGRAM`] (`optim/kernels/`) and its launches
//! (`cuda_multi.rs`, `cuda_compact.rs`).

use super::adamw_multi::scale_offsets;
use super::adamw_step::AdamWStep;
use super::compact_adamw::{
    MomentCodec, MomentsMut, PieceUpdate, WeightRounding, q8_blocks, update_piece,
};
use super::host_adamw::adamw_serial;
use super::slot_layout::{SlotAddrs, SlotCells, SlotPlan};
use super::{cuda_compact, cuda_multi};
use crate::backend::cpu::stored;
use crate::backend::cuda::attention::dt_flag;
use crate::backend::fused_update::{DeviceProgram, DeviceSlot, HostSlot, Launch};
use crate::backend::{DType, UpdateKernel};
use crate::error::{Error, Result};
use std::ops::Range;

/// AdamW's CUDA C program: F32 state (`adamw`, `adamw_multi`) and compact
/// state (`adamw_compact`).
pub const PROGRAM: DeviceProgram = DeviceProgram {
    name: "adamw",
    sources: &[
        ("adamw.cu", include_str!("../kernels/adamw.cu")),
        (
            "adamw_compact.cu",
            include_str!("../kernels/adamw_compact.cu"),
        ),
    ],
};

/// Every piece of a step's slots in one op (`adamw_multi`), each slot laid
/// out as its plan says ([`SlotPlan`]).
pub struct MultiKernel<'p> {
    pub slots: Vec<SlotPlan<'p>>,
}

/// One piece of F32 state: elements `elems` of `[param, m, v]` written,
/// `[grad]` read (`adamw`).
pub struct PieceKernel {
    pub elems: Range<usize>,
    pub hp: AdamWStep,
}

impl UpdateKernel for MultiKernel<'_> {
    fn name(&self) -> &'static str {
        "adamw_multi"
    }

    fn host(&self, k: usize, slot: HostSlot<'_>) -> Result<()> {
        let plan = &self.slots[k];
        let cells = SlotCells::lay_out(plan, slot)?;
        if cells.is_plain() {
            plain_slot(plan, cells)
        } else {
            compact_slot(plan, cells)
        }
    }

    fn device_program(&self) -> DeviceProgram {
        PROGRAM
    }

    /// The compact slots' launches, then the plain slots'.
    fn launches(&self, slots: &[DeviceSlot]) -> Result<Vec<Launch>> {
        let (mut plain, mut compact) = (Vec::new(), Vec::new());
        for (plan, slot) in self.slots.iter().zip(slots) {
            let t = SlotAddrs::lay_out(plan, slot)?;
            if t.is_plain() {
                plain.extend(cuda_multi::slot_pieces(plan, &t));
            } else {
                compact.extend(cuda_compact::slot_pieces(plan, &t));
            }
        }
        let mut launches = cuda_compact::launches(&compact);
        launches.extend(cuda_multi::launches(&plain));
        Ok(launches)
    }
}

/// One plain slot on the host, piece by piece, the narrow copy written as
/// `copy` rounds (F32 cells: a copy).
fn plain_slot(plan: &SlotPlan<'_>, t: SlotCells<'_>) -> Result<()> {
    let (target, grad) = (t.target.cells, t.grad.cells);
    let (m, v) = (t.m.cells, t.v.cells);
    let mut narrow = t.narrow;
    for (elems, hp) in plan.pieces {
        let r = elems.clone();
        let p = &mut target[r.clone()];
        let (g, m, v) = (&grad[r.clone()], &mut m[r.clone()], &mut v[r.clone()]);
        adamw_serial(p, g, m, v, *hp);
        match narrow.as_mut() {
            Some(n) if n.dtype == DType::F32 => n.cells[r].copy_from_slice(p),
            Some(n) => n.cells[r].copy_from_slice(&stored(n.dtype, p)?),
            None => {}
        }
    }
    Ok(())
}

/// One slot of compact state (BF16 or 8-bit moments, or BF16 weights with
/// no master) on the host, piece by piece ([`update_piece`]), the narrow
/// copy written as `copy` rounds.
fn compact_slot(plan: &SlotPlan<'_>, t: SlotCells<'_>) -> Result<()> {
    let codec = match t.m.dtype {
        DType::F32 => MomentCodec::F32,
        DType::BF16 => MomentCodec::Bf16,
        DType::U8 => MomentCodec::Q8,
        DType::F8E4M3 | DType::F8E5M2 => {
            return Err(crate::Error::Backend(
                "AdamW keeps no FP8 moments (F32, BF16 or 8-bit state)".into(),
            ));
        }
    };
    let rounding = match t.target.dtype {
        DType::BF16 => WeightRounding::Stochastic(plan.rounding_key),
        _ => WeightRounding::F32,
    };
    let (starts, blocks) = scale_offsets(plan.pieces);
    let (mut no_m, mut no_v) = (Vec::new(), Vec::new());
    let (ms, vs) = match t.scales {
        Some((ms, vs)) => (ms.cells, vs.cells),
        None => (&mut no_m[..], &mut no_v[..]),
    };
    let (target, grad) = (t.target.cells, t.grad.cells);
    let (m, v) = (t.m.cells, t.v.cells);
    let mut narrow = t.narrow;
    for ((elems, hp), &at) in plan.pieces.iter().zip(&starts) {
        let r = elems.clone();
        let sb = if codec == MomentCodec::Q8 {
            at..at + q8_blocks(r.len())
        } else {
            0..0
        };
        update_piece(PieceUpdate {
            w: &mut target[r.clone()],
            rounding,
            first: r.start,
            g: &grad[r.clone()],
            m: MomentsMut {
                codec,
                values: &mut m[r.clone()],
                scales: &mut ms[sb.clone()],
            },
            v: MomentsMut {
                codec,
                values: &mut v[r],
                scales: &mut vs[sb],
            },
            hp: *hp,
        });
        if let Some(narrow) = narrow.as_mut() {
            let rounded = stored(narrow.dtype, &target[elems.clone()])?;
            narrow.cells[elems.clone()].copy_from_slice(&rounded);
        }
    }
    debug_assert!(codec != MomentCodec::Q8 || blocks == ms.len());
    Ok(())
}

impl UpdateKernel for PieceKernel {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn host(&self, _k: usize, slot: HostSlot<'_>) -> Result<()> {
        let r = self.elems.clone();
        let [p, m, v]: [_; 3] = (slot.written.try_into())
            .map_err(|_| Error::Backend("adamw: a slot of other than 3 written tensors".into()))?;
        let g = &slot.read[0].cells[r.clone()];
        let (m, v) = (&mut m.cells[r.clone()], &mut v.cells[r.clone()]);
        adamw_serial(&mut p.cells[r], g, m, v, self.hp);
        Ok(())
    }

    fn device_program(&self) -> DeviceProgram {
        PROGRAM
    }

    /// One `adamw` launch over the piece, its F32 state and gradient
    /// addressed at the piece's first element.
    fn launches(&self, slots: &[DeviceSlot]) -> Result<Vec<Launch>> {
        let [slot] = slots else {
            return Err(Error::Backend("adamw: one slot a call".into()));
        };
        let (w, grad) = (&slot.written, &slot.read[0]);
        for (t, what) in w.iter().zip(["param", "m", "v"]) {
            if t.dtype != DType::F32 {
                return Err(Error::Backend(format!(
                    "adamw: {what} must be F32, got {:?}",
                    t.dtype
                )));
            }
        }
        let (hp, n) = (&self.hp, self.elems.len());
        let (bc1, bc2) = hp.bias_corrections();
        // byte offsets of the range: f32 state, grad in its own dtype
        let f32_off = (self.elems.start * 4) as u64;
        let g_off = (self.elems.start * grad.dtype.size()) as u64;
        let word = |x: f32| vec![x.to_bits() as u64];
        let mut params = vec![
            vec![w[0].addr + f32_off],
            vec![grad.addr + g_off],
            vec![dt_flag(grad.dtype) as u32 as u64],
            vec![w[1].addr + f32_off],
            vec![w[2].addr + f32_off],
            vec![n as u64],
        ];
        let scalars = [hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay];
        params.extend(
            scalars
                .into_iter()
                .chain([bc1, bc2, hp.grad_scale])
                .map(word),
        );
        Ok(vec![Launch {
            function: "adamw",
            threads: n,
            block: cuda_multi::BLOCK,
            params,
        }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::{kernels::program_source, nvrtc};

    fn hp() -> AdamWStep {
        AdamWStep {
            lr: 0.5,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 1,
            grad_scale: 1.0,
        }
    }

    /// A plain slot (F32 target, moments and BF16 narrow copy) and a
    /// compact one (BF16 target, 8-bit moments with scales): the compact
    /// launch first, each with its pieces' count and threads.
    #[test]
    fn launches_run_compact_slots_then_plain_ones() {
        use crate::backend::fused_update::DeviceTensor;
        let t = |addr, dtype| DeviceTensor { addr, dtype };
        let (f32_, bf16, u8_) = (DType::F32, DType::BF16, DType::U8);
        let pieces = [(0..300, hp()), (300..301, hp())];
        let plans = vec![
            SlotPlan {
                pieces: &pieces,
                rounding_key: 0,
                scales: false,
                narrow: true,
            },
            SlotPlan {
                pieces: &pieces[..1],
                rounding_key: 7,
                scales: true,
                narrow: false,
            },
        ];
        let slots = [
            DeviceSlot {
                written: vec![
                    t(0x1000, f32_),
                    t(0x2000, f32_),
                    t(0x3000, f32_),
                    t(0x4000, bf16),
                ],
                read: vec![t(0x5000, f32_)],
            },
            DeviceSlot {
                written: vec![
                    t(0x6000, bf16),
                    t(0x7000, u8_),
                    t(0x8000, u8_),
                    t(0x9000, f32_),
                    t(0xa000, f32_),
                ],
                read: vec![t(0xb000, bf16)],
            },
        ];
        let launches = MultiKernel { slots: plans }.launches(&slots).unwrap();
        let names: Vec<_> = launches.iter().map(|l| l.function).collect();
        assert_eq!(names, ["adamw_compact", "adamw_multi"]);
        assert_eq!(launches[0].params[0], [1]);
        // a block of 128 threads per virtual block, 2 elements a thread
        assert_eq!(launches[0].threads, 2 * 128);
        assert_eq!(launches[1].params[0], [2]);
        // a virtual block of 4 elements a thread per piece
        assert_eq!(launches[1].threads, 2 * 256);
        // a slot of the wrong tensor count is an error, not a misread
        let short = [
            slots[0].clone(),
            DeviceSlot {
                written: vec![],
                read: vec![],
            },
        ];
        let plans = vec![
            SlotPlan {
                pieces: &pieces,
                rounding_key: 0,
                scales: false,
                narrow: true,
            };
            2
        ];
        assert!(MultiKernel { slots: plans }.launches(&short).is_err());
    }

    /// Compiles AdamW's program whenever NVRTC can be found (no GPU
    /// needed), as the backend's own kernels are.
    #[test]
    fn the_program_compiles_with_nvrtc_when_available() {
        match nvrtc::version() {
            Err(Error::LibraryMissing(m)) => eprintln!("SKIP: NVRTC not available ({m})"),
            Err(e) => panic!("{e}"),
            Ok(_) => {
                let src = program_source(PROGRAM);
                let (cubin, _) =
                    nvrtc::compile_uncached_for_test(&src, "sm_90", nvrtc::OPTIONS).unwrap();
                for name in ["adamw", "adamw_multi", "adamw_compact"] {
                    assert!(
                        cubin.windows(name.len()).any(|w| w == name.as_bytes()),
                        "{name} missing from the cubin"
                    );
                }
            }
        }
    }
}
