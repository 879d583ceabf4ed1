//! Context-parallel attention: the attention layer (Q/K/V projection,
//! optional QK RMSNorm, RoPE, masked attention, output projection) with an
//! explicit backward, under five strategies. The mask is an [`AttnMask`]
//! value (defined in `backend/`, which the kernels read; re-exported here)
//! carried from the caller through every strategy to the kernels.
//!
//! `local` is the single-device reference ([`local`]). `ulysses`, `ring`,
//! `usp` and `upipe` are one staged engine ([`staged`]) with different
//! parameters: Ulysses degree `pu`, ring degree `pr` and heads per stage `U`:
//!
//! | strategy | pu | pr | U |
//! |---|---|---|---|
//! | ulysses | C | 1 | H |
//! | ring | 1 | C | H |
//! | usp | Pu | Pr | H |
//! | upipe | Pu | Pr | any valid multiple of Pu (default Pu) |
//!
//! Forward saves only the layer input (owned by the caller), the attention
//! output O in canonical head order and one LSE per stage; backward recomputes
//! each stage's projections and exchanges. Parameter gradients are partial
//! sums over this rank's tokens until the caller reduces them over the mesh.
//!
//! Which meshes each strategy runs, and the order in which a default mesh
//! prefers them, is the strategy's own rule ([`mesh_rule`]).

pub mod cp_plan;
pub mod dims;
pub mod layer;
pub mod layout;
pub mod local;
pub mod lora_delta;
pub mod mesh_rule;
pub mod projection;
pub mod ring;
pub mod ring_shift;
pub mod rope;
pub mod saved;
pub mod schedule;
pub mod settle;
pub mod shapes;
pub mod staged;
pub mod trial;
pub mod weights;

pub use crate::backend::AttnMask;
pub use cp_plan::{CpPlan, Strategy};
pub use dims::AttnDims;
pub use layer::CpAttention;
pub use mesh_rule::{ContextMesh, FittedMesh, NODE_GPUS};
pub use projection::output_projection;
pub(crate) use projection::{add_head_bias, head_bias_grad, norm_rope, norm_rope_bwd};
pub use saved::AttnSaved;
pub use settle::Settle;
pub use weights::{AttentionGrads, AttentionWeights, AttnTensors};
