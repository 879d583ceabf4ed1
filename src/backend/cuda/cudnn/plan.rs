//! Execution plans: heuristics over an operation graph, the engine
//! configurations that finalize (the first, or all of them for tuning), each
//! one's workspace size, engine and knobs, and execution with a variant pack.

use super::desc::{Attr, Desc, Kind, check};
use super::graph::Graph;
use crate::error::{Error, Result};
use cudarc::cudnn::sys;
use std::ffi::c_void;
use std::sync::Arc;

/// A finalized plan and everything it was built from (kept alive with it;
/// the candidates of one graph share the graph).
pub struct Plan {
    plan: Desc,
    _cfg: Desc,
    _graph: Arc<(Desc, Graph)>,
    /// Bytes of workspace the plan itself needs.
    pub workspace: usize,
    /// Wall time of graph finalize + heuristics + plan finalize, in ms.
    pub build_ms: f64,
    /// Which heuristic candidate (0-based) this is, of how many.
    pub candidate: (usize, usize),
    /// cuDNN's engine (global index) and knob choices (type number, value),
    /// e.g. `engine 8 knobs 17=1 20=0`.
    pub engine: String,
}

/// `engine N knobs t=v ...` of an engine configuration (for reports; a
/// configuration cuDNN does not describe reads `engine ?`).
fn describe_config(cfg: &Desc) -> String {
    let engine = (|| {
        let e = Desc::new(Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
        cfg.get_descs(Attr::CUDNN_ATTR_ENGINECFG_ENGINE, std::slice::from_ref(&e))?;
        e.get_i64(Attr::CUDNN_ATTR_ENGINE_GLOBAL_INDEX)
    })();
    let knobs = (|| {
        let n = cfg.count(Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, true)?;
        let choices = (0..n)
            .map(|_| Desc::new(Kind::CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR))
            .collect::<Result<Vec<_>>>()?;
        let got = cfg.get_descs(Attr::CUDNN_ATTR_ENGINECFG_KNOB_CHOICES, &choices)?;
        choices[..got]
            .iter()
            .map(|c| {
                let t = c.get_knob_type(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE)?;
                let v = c.get_i64(Attr::CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE)?;
                Ok(format!("{t}={v}"))
            })
            .collect::<Result<Vec<_>>>()
    })();
    format!(
        "engine {} knobs {}",
        engine.map_or("?".into(), |e| e.to_string()),
        knobs.map_or("?".into(), |k| k.join(" "))
    )
}

impl Plan {
    /// The first engine configuration of the heuristics that finalizes.
    pub fn build(handle: sys::cudnnHandle_t, graph: Graph) -> Result<Plan> {
        let mut plans = Self::build_candidates(handle, graph, 1)?;
        Ok(plans.remove(0))
    }

    /// Up to `limit` plans, one per engine configuration that finalizes, in
    /// the heuristics' order (mode A; the fallback mode only when A yields
    /// none). Errors when none finalizes, with every configuration's reason.
    pub fn build_candidates(
        handle: sys::cudnnHandle_t,
        graph: Graph,
        limit: usize,
    ) -> Result<Vec<Plan>> {
        let t0 = std::time::Instant::now();
        let og = graph.finalize(handle)?;
        let shared = Arc::new((og, graph));
        let og = &shared.0;
        let mut errors = Vec::new();
        let mut plans = Vec::new();
        for mode in [
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let heur = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
            heur.desc(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, og)?
                .heur_mode(Attr::CUDNN_ATTR_ENGINEHEUR_MODE, mode)?;
            if let Err(e) = heur.finalize() {
                errors.push(format!("{mode:?}: {e}"));
                continue;
            }
            let n = heur.count(Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS, true)?;
            let cfgs = (0..n)
                .map(|_| Desc::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
                .collect::<Result<Vec<_>>>()?;
            let got = heur.get_descs(Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS, &cfgs)?;
            if got == 0 {
                errors.push(format!("{mode:?}: no engine configurations"));
            }
            for (idx, cfg) in cfgs.into_iter().take(got).enumerate() {
                let plan = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                let r = plan
                    .handle(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)
                    .and_then(|p| p.desc(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &cfg))
                    .and_then(|p| p.finalize());
                match r {
                    Ok(_) => {
                        let ws = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE)?;
                        plans.push(Plan {
                            engine: describe_config(&cfg),
                            plan,
                            _cfg: cfg,
                            _graph: shared.clone(),
                            workspace: ws.max(0) as usize,
                            build_ms: t0.elapsed().as_secs_f64() * 1e3,
                            candidate: (idx, got),
                        });
                        if plans.len() == limit {
                            return Ok(plans);
                        }
                    }
                    Err(e) => errors.push(format!("{mode:?} #{idx}: {e}")),
                }
            }
            if !plans.is_empty() {
                return Ok(plans);
            }
        }
        Err(Error::Backend(format!(
            "cuDNN: no engine runs this graph ({})",
            errors.join("; ")
        )))
    }

    /// Runs the plan. `bindings` pairs unique ids with device (or, for
    /// by-value scalars, host) addresses; `workspace` holds `self.workspace` bytes.
    ///
    /// # Safety
    /// `handle` is the live handle the plan was built with; every address in
    /// `bindings` and `workspace` is valid for the tensor the graph declares
    /// under that id (device memory stream-ordered before the handle's stream,
    /// host scalars alive until this returns).
    pub unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        bindings: &[(i64, *mut c_void)],
        workspace: *mut c_void,
    ) -> Result<()> {
        let ids: Vec<i64> = bindings.iter().map(|b| b.0).collect();
        let ptrs: Vec<*mut c_void> = bindings.iter().map(|b| b.1).collect();
        let vp = Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        vp.i64s(Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &ids)?
            .ptrs(Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &ptrs)?
            .ptrs(Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, &[workspace])?
            .finalize()?;
        // SAFETY: the plan and variant pack are finalized; the caller guarantees
        // the handle and every address (see `# Safety`).
        check(
            unsafe { sys::cudnnBackendExecute(handle, self.plan.raw(), vp.raw()) },
            "execute",
        )
    }
}
