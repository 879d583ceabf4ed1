//! [`CudnnSdpa`]'s calls on a backend: creating the handle on its stream,
//! running a plan with the kept execution workspace (the backend's
//! `cudnn_ws`, grown to the largest call; its lock serializes the
//! executions), the ragged tables, and the forward and backward. Every call
//! passes the backend the handle was created on.

use super::desc::check;
use super::plan::Plan;
use super::workspace::{align, bwd_layout};
use super::{
    CudnnSdpa, Entry, Handle, PlanPick, SdpaBwd, SdpaFp8, SdpaFwd, SdpaShape, bwd_scratch_elems,
    bwd_writes_in_place, fwd_workspace_bytes, kept_workspace_bytes, own_workspace, probe, ragged,
    sdpa_fp8, sdpa_graph, shape_supported,
};
use crate::backend::cuda::CudaBackend;
use crate::backend::cuda::tuning::fastest;
use crate::backend::{AttnGradWrites, Backend, Category, DType, GradWrite};
use crate::error::{Error, Result};
use cudarc::cudnn::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

impl CudnnSdpa {
    /// Loads cuDNN (see [`probe`]) and creates a handle on `be`'s stream.
    pub fn new(be: &CudaBackend) -> Result<CudnnSdpa> {
        let pick = PlanPick::from_env()?;
        let (version, lib) = probe()?;
        be.context()
            .bind_to_thread()
            .map_err(|e| Error::Backend(format!("bind context: {e}")))?;
        let mut h: sys::cudnnHandle_t = std::ptr::null_mut();
        // SAFETY: `h` is a valid out-pointer; the context is current.
        check(unsafe { sys::cudnnCreate(&mut h) }, "create handle")?;
        let handle = Handle(h);
        let stream = be.stream().cu_stream() as sys::cudaStream_t;
        // SAFETY: the stream belongs to the current context and outlives the handle
        // (the backend owns both; `CudnnSdpa` is dropped before it).
        check(unsafe { sys::cudnnSetStream(h, stream) }, "set stream")?;
        Ok(CudnnSdpa {
            handle,
            stream: stream as usize,
            version,
            lib,
            pick,
            plans: Mutex::new(HashMap::new()),
            builds: Mutex::new(Vec::new()),
        })
    }

    /// The plan a call of `s` runs. Under `PlanPick::Fastest` the shape's
    /// first call times every candidate through `exec` (the call itself, so
    /// on its real operands: one warm-up and one timed run each) and caches
    /// the fastest; candidates needing more workspace than the first are
    /// skipped, so tuning never raises the memory the planner predicts.
    fn plan_for_call(
        &self,
        be: &CudaBackend,
        s: &SdpaShape,
        bwd: bool,
        exec: &dyn Fn(&Plan) -> Result<()>,
    ) -> Result<Arc<Plan>> {
        let first = self.plan(s, bwd)?;
        if self.pick != PlanPick::Fastest {
            return Ok(first);
        }
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("cuDNN plan cache poisoned".into()))?;
        if let Some(Ok(e)) = plans.get(&(bwd, s.clone()))
            && e.tuned
        {
            return Ok(e.plan.clone());
        }
        let candidates = Plan::build_candidates(self.handle.0, Self::graph(s, bwd)?, usize::MAX)?;
        let candidates: Vec<Plan> = candidates
            .into_iter()
            .filter(|p| p.workspace <= first.workspace)
            .collect();
        // a candidate that fails to run is left out (the first one ran before)
        let time = |p: &Plan| -> Result<f64> {
            exec(p)?;
            be.synchronize()?;
            let t0 = std::time::Instant::now();
            exec(p)?;
            be.synchronize()?;
            Ok(t0.elapsed().as_secs_f64() * 1e3)
        };
        let mut timed: Vec<(Plan, f64)> = Vec::with_capacity(candidates.len());
        for p in candidates {
            match time(&p) {
                Ok(ms) => timed.push((p, ms)),
                Err(e) => tracing::debug!("cuDNN candidate #{} ({}): {e}", p.candidate.0, p.engine),
            }
        }
        let timings: Vec<(usize, String, f64)> = timed
            .iter()
            .map(|(p, ms)| (p.candidate.0, p.engine.clone(), *ms))
            .collect();
        let times: Vec<f64> = timed.iter().map(|t| t.1).collect();
        let best = match fastest(&times) {
            Some(i) => Arc::new(timed.swap_remove(i).0),
            None => first,
        };
        self.record(bwd, s, &best, timings);
        plans.insert(
            (bwd, s.clone()),
            Ok(Entry {
                plan: best.clone(),
                tuned: true,
            }),
        );
        Ok(best)
    }

    /// Returns `be`'s execution workspace to the pool (it is kept between
    /// calls and grows to the largest; the next call allocates what it needs).
    pub fn release_workspace(&self, be: &CudaBackend) -> Result<()> {
        let mut ws = be
            .cudnn_ws
            .lock()
            .map_err(|_| Error::Backend("cuDNN workspace lock poisoned".into()))?;
        *ws = None;
        Ok(())
    }

    /// Runs `plan` with a workspace of at least `bytes` (grown from the pool).
    fn run(
        &self,
        be: &CudaBackend,
        plan: &Plan,
        bytes: usize,
        bind: impl FnOnce(u64) -> Result<Vec<(i64, *mut c_void)>>,
    ) -> Result<()> {
        if be.stream().cu_stream() as usize != self.stream {
            return Err(Error::Backend(
                "cuDNN SDPA run with another backend than the one its handle was created on".into(),
            ));
        }
        let mut ws = be
            .cudnn_ws
            .lock()
            .map_err(|_| Error::Backend("cuDNN workspace lock poisoned".into()))?;
        let have = ws.as_ref().map(|t| t.bytes()).unwrap_or(0);
        if have < bytes.max(1) {
            // Drop the old one first (stream-ordered free), then take a larger one.
            *ws = None;
            *ws = Some(be.alloc(
                &[kept_workspace_bytes(bytes) / 4],
                DType::F32,
                Category::Workspace,
            )?);
        }
        let base = be.device_ptr(ws.as_ref().expect("allocated above"));
        let bindings = bind(base)?;
        // SAFETY: the plan was built with this handle; the callers bind the
        // operands of the graph they asked for (device buffers owned by the
        // caller on the backend's stream, host scalars living on their stack
        // until this returns) and the workspace holds `bytes` bytes.
        unsafe { plan.execute(self.handle.0, &bindings, base as *mut c_void) }
    }

    /// Uploads a ragged call's tables (`docs`: its documents' rows) to
    /// device address `at` inside the workspace, queued on the backend's
    /// stream before the execution that reads them, and returns their
    /// bindings; none for the other calls.
    fn ragged_tables(
        be: &CudaBackend,
        s: &SdpaShape,
        docs: &[usize],
        at: u64,
    ) -> Result<Vec<(i64, *mut c_void)>> {
        if s.ragged.is_none() {
            return Ok(Vec::new());
        }
        if s.ragged != Some(ragged::dims(docs)) || docs.iter().sum::<usize>() != s.sq {
            return Err(Error::Backend(format!(
                "cuDNN ragged SDPA: documents of {docs:?} rows do not form the call's {:?}                  over {} rows",
                s.ragged, s.sq
            )));
        }
        let t = ragged::Tables::new(docs, [s.q_rs, s.k_rs, s.lse_rs])?;
        // SAFETY: `at` starts the tables' region of the kept workspace
        // (`table_bytes(s)` bytes, at least the tables of documents that
        // tile `s.sq` rows); the pageable source is staged before the call
        // returns, and the stream orders the copy before the execution.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(at, &t.entries, be.stream().cu_stream())
        }
        .map_err(|e| Error::Backend(format!("cuDNN ragged SDPA: upload the tables: {e}")))?;
        use ragged::Table;
        let p = |table: Table| (at + t.byte_offset(table) as u64) as *mut c_void;
        use sdpa_graph::uid;
        Ok(vec![
            (uid::Q_OFFSETS, p(Table::QOffsets)),
            (uid::KV_OFFSETS, p(Table::KvOffsets)),
            (uid::STATS_OFFSETS, p(Table::StatsOffsets)),
            (uid::SEQ_LEN_Q, p(Table::SeqLen)),
            (uid::SEQ_LEN_KV, p(Table::SeqLen)),
        ])
    }

    /// Checks that cuDNN takes the call (`backward` or forward) and binds
    /// the backend's context to this thread.
    fn prepare(&self, be: &CudaBackend, s: &SdpaShape, backward: bool) -> Result<()> {
        shape_supported(self.version, s, backward).map_err(Error::Backend)?;
        be.context()
            .bind_to_thread()
            .map_err(|e| Error::Backend(format!("bind context: {e}")))?;
        Ok(())
    }

    /// Forward: writes `o` (bf16) and `lse` (f32, natural log).
    pub fn fwd(&self, be: &CudaBackend, a: &SdpaFwd) -> Result<()> {
        let s = &a.shape;
        self.prepare(be, s, false)?;
        let scale = a.scale;
        let neg_inf = f32::NEG_INFINITY;
        let window = s.window.unwrap_or(0) as f32;
        let p = |x: u64| x as *mut c_void;
        use sdpa_graph::uid;
        let exec = |plan: &Plan| {
            let own = own_workspace(s, plan.workspace)?;
            let need = fwd_workspace_bytes(s, own);
            self.run(be, plan, need, |base| {
                let at = base + align(own) as u64;
                let mut b = Self::ragged_tables(be, s, &a.docs, at)?;
                b.extend([
                    (uid::Q, p(a.q)),
                    (uid::K, p(a.k)),
                    (uid::V, p(a.v)),
                    (uid::O, p(a.o)),
                    (uid::STATS, p(a.lse)),
                    (uid::SCALE, (&scale as *const f32).cast_mut().cast()),
                ]);
                if sdpa_graph::reads_neg_inf(&s.mask) {
                    b.push((uid::NEG_INF, (&neg_inf as *const f32).cast_mut().cast()));
                }
                if s.window.is_some() {
                    b.push((uid::WINDOW, (&window as *const f32).cast_mut().cast()));
                    b.push((
                        uid::NEG_INF_WINDOW,
                        (&neg_inf as *const f32).cast_mut().cast(),
                    ));
                }
                if s.ragged.is_some() {
                    let neg = (&neg_inf as *const f32).cast_mut().cast();
                    b.push((uid::NEG_INF_PADDING, neg));
                }
                Ok(b)
            })
        };
        let plan = self.plan_for_call(be, s, false, &exec)?;
        exec(&plan)
    }

    /// Backward into bf16 buffers (overwritten): `dq [sq, hq·d]`, `dk, dv [sk, hkv·d]`.
    pub fn bwd_overwrite(
        &self,
        be: &CudaBackend,
        a: &SdpaBwd,
        dq: u64,
        dk: u64,
        dv: u64,
    ) -> Result<()> {
        let s = &a.shape;
        self.prepare(be, s, true)?;
        let scale = a.scale;
        let neg_inf = f32::NEG_INFINITY;
        let window = s.window.unwrap_or(0) as f32;
        let one = 1.0f32;
        let p = |x: u64| x as *mut c_void;
        use sdpa_graph::uid;
        let exec = |plan: &Plan| {
            let own = own_workspace(s, plan.workspace)?;
            let [acc_off, sum_off, dk_full, dv_full, tables, total] = bwd_layout(s, own);
            self.run(be, plan, total, |base| {
                let mut b = Self::ragged_tables(be, s, &a.docs, base + tables as u64)?;
                if sdpa_graph::backward_full_head_bytes(s) > 0 {
                    b.push((uid::DK_FULL, p(base + dk_full as u64)));
                    b.push((uid::DV_FULL, p(base + dv_full as u64)));
                }
                b.extend([
                    (uid::Q, p(a.q)),
                    (uid::K, p(a.k)),
                    (uid::V, p(a.v)),
                    (uid::O, p(a.o)),
                    (uid::D_O, p(a.d_o)),
                    (uid::STATS, p(a.lse)),
                    (uid::DQ, p(dq)),
                    (uid::DK, p(dk)),
                    (uid::DV, p(dv)),
                    (uid::SCALE, (&scale as *const f32).cast_mut().cast()),
                    (uid::ONE, (&one as *const f32).cast_mut().cast()),
                    (uid::DQ_ACCUM, p(base + acc_off as u64)),
                    (uid::SOFTMAX_SUM, p(base + sum_off as u64)),
                ]);
                if sdpa_graph::reads_neg_inf(&s.mask) {
                    b.push((uid::NEG_INF, (&neg_inf as *const f32).cast_mut().cast()));
                }
                if s.window.is_some() {
                    b.push((uid::WINDOW, (&window as *const f32).cast_mut().cast()));
                    b.push((
                        uid::NEG_INF_WINDOW,
                        (&neg_inf as *const f32).cast_mut().cast(),
                    ));
                }
                if s.ragged.is_some() {
                    let neg = (&neg_inf as *const f32).cast_mut().cast();
                    b.push((uid::NEG_INF_PADDING, neg));
                }
                Ok(b)
            })
        };
        let plan = self.plan_for_call(be, s, true, &exec)?;
        exec(&plan)
    }

    /// An FP8 forward (`a.bwd` false: writes O₈ and Stats) or backward
    /// (writes dQ₈, dK₈, dV₈) of `a.shape` (its `fp8` set), the scale cells
    /// read and the amax cells written in `a.scales`.
    pub fn run_fp8(&self, be: &CudaBackend, a: &SdpaFp8) -> Result<()> {
        let s = &a.shape;
        self.prepare(be, s, a.bwd)?;
        let scale = a.scale;
        let neg_inf = f32::NEG_INFINITY;
        let p = |x: u64| x as *mut c_void;
        use sdpa_graph::uid;
        let exec = |plan: &Plan| {
            let need = match a.bwd {
                true => plan.workspace,
                false => fwd_workspace_bytes(s, plan.workspace),
            };
            self.run(be, plan, need, |_| {
                let mut b = vec![
                    (uid::Q, p(a.q)),
                    (uid::K, p(a.k)),
                    (uid::V, p(a.v)),
                    (uid::O, p(a.o)),
                    (uid::STATS, p(a.lse)),
                    (uid::SCALE, (&scale as *const f32).cast_mut().cast()),
                ];
                if a.bwd {
                    b.extend([
                        (uid::D_O, p(a.d_o)),
                        (uid::DQ, p(a.dq)),
                        (uid::DK, p(a.dk)),
                        (uid::DV, p(a.dv)),
                    ]);
                }
                if sdpa_graph::reads_neg_inf(&s.mask) {
                    b.push((uid::NEG_INF, (&neg_inf as *const f32).cast_mut().cast()));
                }
                for &slot in sdpa_fp8::slots(a.bwd) {
                    b.push((slot.uid(), p(a.scales + 4 * slot as u64)));
                }
                Ok(b)
            })
        };
        let plan = self.plan_for_call(be, s, a.bwd, &exec)?;
        exec(&plan)
    }

    /// Backward with the backend's semantics. cuDNN overwrites bf16 buffers,
    /// so an overwritten bf16 gradient is written in place; every other one
    /// goes through bf16 scratch that is then added in (an overwritten F32
    /// gradient is zeroed first).
    pub fn bwd(&self, be: &CudaBackend, a: &SdpaBwd, writes: AttnGradWrites) -> Result<()> {
        let s = &a.shape;
        let (nq, nk) = bwd_scratch_elems(s);
        let grads = [
            (a.dq, a.dq_dt, writes.dq, nq),
            (a.dk, a.dkv_dt, writes.dkv, nk),
            (a.dv, a.dkv_dt, writes.dkv, nk),
        ];
        let scratch = grads
            .iter()
            .map(|&(_, dt, w, n)| {
                if bwd_writes_in_place(w, dt) {
                    Ok(None)
                } else {
                    be.alloc(&[n], DType::BF16, Category::Workspace).map(Some)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let target = |i: usize| match &scratch[i] {
            Some(t) => be.device_ptr(t),
            None => grads[i].0,
        };
        self.bwd_overwrite(be, a, target(0), target(1), target(2))?;
        for (&(dst, dt, w, n), s) in grads.iter().zip(&scratch) {
            if let Some(s) = s {
                if w == GradWrite::Overwrite {
                    be.zero_raw(dst, n * dt.size())?;
                }
                be.axpy_raw(dst, dt, be.device_ptr(s), DType::BF16, n, 1.0)?;
            }
        }
        Ok(())
    }
}
