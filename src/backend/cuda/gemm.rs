//! GEMM through cuBLASLt.
//!
//! Our views are row-major ([`MatLayout`]: element `(i, j)` at
//! `offset + i*ld + j`, or `offset + j*ld + i` when `trans`); cuBLASLt is
//! column-major. A row-major `X` is the column-major `X^T` in the same bytes,
//! so `C = A·B` is computed as `C^T = B^T·A^T` with cuBLASLt's A := our B and
//! cuBLASLt's B := our A, each stored operand flagged `T` exactly when our view
//! is a transposed one. No copies. Descriptors, layouts and the heuristic's
//! algorithm are cached per problem (shapes, leading dims, dtypes, alignment);
//! under `UPIPE_GEMM_ALGO=fastest` a problem's first call that overwrites its
//! output times the heuristic's first algorithms and keeps the fastest
//! ([`GemmPick`]). The workspace is allocated once by the backend;
//! `CudaBackend::gemm`'s body (checks, the `k == 0` scaling, the workspace)
//! is in `gemm_ops.rs`.

use super::device::drv;
use super::libs::{self, Lib};
use super::tuning::{GEMM_CANDIDATES, GemmPick, fastest};
use crate::backend::{DType, MatLayout};
use crate::error::{Error, Result};
use cudarc::cublaslt::sys as lt;
use cudarc::driver::CudaStream;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// Workspace handed to cuBLASLt (Hopper kernels want up to 32 MiB).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// One operand in cuBLASLt's column-major terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtOperand {
    /// Rows of the stored column-major matrix.
    pub rows: u64,
    /// Columns of the stored column-major matrix.
    pub cols: u64,
    pub ld: i64,
    /// Apply `T` to the stored matrix.
    pub trans: bool,
}

/// The column-major problem `D(n x m) = op(A) · op(B)` for a row-major `C(m x n) = A·B`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LtProblem {
    /// cuBLASLt's A: our `b`.
    pub a: LtOperand,
    /// cuBLASLt's B: our `a`.
    pub b: LtOperand,
    /// C and D: our `c`.
    pub c: LtOperand,
    /// cuBLASLt's (m, n, k) = our (n, m, k).
    pub mnk: (u64, u64, u64),
}

/// The stored column-major matrix of a row-major view.
pub fn stored(v: &MatLayout) -> LtOperand {
    let (rows, cols) = if v.trans {
        (v.rows, v.cols)
    } else {
        (v.cols, v.rows)
    };
    LtOperand {
        rows: rows as u64,
        cols: cols as u64,
        ld: v.ld.max(1) as i64,
        trans: v.trans,
    }
}

/// Maps `c = a @ b` (row-major views) to cuBLASLt's column-major problem.
pub fn map_problem(c: &MatLayout, a: &MatLayout, b: &MatLayout) -> Result<LtProblem> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || c.rows != m || c.cols != n || c.trans {
        return Err(Error::Backend(format!(
            "gemm shapes: c {c:?} = a {a:?} @ b {b:?}"
        )));
    }
    Ok(LtProblem {
        a: stored(b),
        b: stored(a),
        c: stored(c),
        mnk: (n as u64, m as u64, k as u64),
    })
}

/// Largest power of two (<= 256) dividing a device address.
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        (1u64 << ptr.trailing_zeros().min(8)) as u32
    }
}

fn lt_type(d: DType) -> lt::cudaDataType {
    match d {
        DType::F32 => lt::cudaDataType::CUDA_R_32F,
        DType::BF16 => lt::cudaDataType::CUDA_R_16BF,
        DType::U8 => lt::cudaDataType::CUDA_R_8U,
        DType::F8E4M3 => lt::cudaDataType::CUDA_R_8F_E4M3,
        DType::F8E5M2 => lt::cudaDataType::CUDA_R_8F_E5M2,
    }
}

fn ok(s: lt::cublasStatus_t, what: &str) -> Result<()> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Backend(format!("cuBLASLt {what}: {s:?}")))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    p: LtProblem,
    /// Dtypes of a/b and c as `DType::size()` (F32 = 4, BF16 = 2).
    ab: usize,
    c: usize,
    align: (u32, u32, u32),
    /// An FP8 GEMM's operand dtypes, in cuBLASLt's order (its A: our `b`;
    /// its B: our `a`); `None` for every other GEMM.
    fp8: Option<(DType, DType)>,
}

struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    la: lt::cublasLtMatrixLayout_t,
    lb: lt::cublasLtMatrixLayout_t,
    lc: lt::cublasLtMatrixLayout_t,
    /// The heuristic's algorithms, best first (one unless tuning).
    algos: Vec<lt::cublasLtMatmulAlgo_t>,
    /// The one calls run: an index into `algos`.
    chosen: usize,
    /// Whether `GemmPick::Fastest` has timed `algos`.
    tuned: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once for this plan and is destroyed once.
        unsafe {
            lt::cublasLtMatrixLayoutDestroy(self.la);
            lt::cublasLtMatrixLayoutDestroy(self.lb);
            lt::cublasLtMatrixLayoutDestroy(self.lc);
            lt::cublasLtMatmulDescDestroy(self.desc);
        }
    }
}

/// A matrix layout of `o`'s extents in dtype `d`.
///
/// # Safety
/// The caller owns (and destroys) the returned layout.
unsafe fn layout(o: &LtOperand, d: DType) -> Result<lt::cublasLtMatrixLayout_t> {
    let mut l = std::ptr::null_mut();
    // SAFETY: a valid out pointer.
    ok(
        unsafe { lt::cublasLtMatrixLayoutCreate(&mut l, lt_type(d), o.rows, o.cols, o.ld) },
        "layout",
    )?;
    Ok(l)
}

/// Sets the descriptor's transposes of A and B from `p`.
///
/// # Safety
/// `desc` is a live matmul descriptor.
unsafe fn set_transposes(desc: lt::cublasLtMatmulDesc_t, p: &LtProblem) -> Result<()> {
    use lt::cublasLtMatmulDescAttributes_t as D;
    for (attr, t) in [
        (D::CUBLASLT_MATMUL_DESC_TRANSA, p.a.trans),
        (D::CUBLASLT_MATMUL_DESC_TRANSB, p.b.trans),
    ] {
        let op: i32 = t as i32; // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
        // SAFETY: `desc` is live; the value is 4 bytes that outlive the call.
        ok(
            unsafe {
                lt::cublasLtMatmulDescSetAttribute(desc, attr, (&op as *const i32).cast(), 4)
            },
            "desc trans",
        )?;
    }
    Ok(())
}

/// A heuristic preference: the workspace the plans may use and the
/// operands' alignments (bytes of A, B, and C/D), destroyed on drop.
struct Preference(lt::cublasLtMatmulPreference_t);

impl Preference {
    fn new((aa, ab, ac): (u32, u32, u32)) -> Result<Preference> {
        use lt::cublasLtMatmulPreferenceAttributes_t as P;
        let mut pref = std::ptr::null_mut();
        // SAFETY: a valid out pointer; the preference is owned by the value returned.
        ok(
            unsafe { lt::cublasLtMatmulPreferenceCreate(&mut pref) },
            "preference",
        )?;
        let pref = Preference(pref);
        let ws: u64 = WORKSPACE_BYTES as u64;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws.to_ne_bytes(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            &aa.to_ne_bytes(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            &ab.to_ne_bytes(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &ac.to_ne_bytes(),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &ac.to_ne_bytes(),
        )?;
        Ok(pref)
    }

    fn set(&self, attr: lt::cublasLtMatmulPreferenceAttributes_t, value: &[u8]) -> Result<()> {
        // SAFETY: the preference is live; `value` outlives the call.
        ok(
            unsafe {
                lt::cublasLtMatmulPreferenceSetAttribute(
                    self.0,
                    attr,
                    value.as_ptr().cast(),
                    value.len(),
                )
            },
            "pref",
        )
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created once by `Preference::new`, destroyed once here.
        unsafe {
            lt::cublasLtMatmulPreferenceDestroy(self.0);
        }
    }
}

/// A cuBLASLt handle with its plan cache.
pub struct Gemm {
    handle: lt::cublasLtHandle_t,
    plans: Mutex<HashMap<Key, Plan>>,
    pick: GemmPick,
}

// SAFETY: the handle is thread-safe for use with distinct streams per cuBLASLt's
// docs; plans are only touched under the mutex and are immutable once built.
unsafe impl Send for Gemm {}
// SAFETY: as above.
unsafe impl Sync for Gemm {}

/// Device operands of one call.
pub struct GemmPtrs {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub workspace: u64,
}

impl Gemm {
    pub fn new() -> Result<Gemm> {
        libs::load(Lib::CublasLt)?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        ok(unsafe { lt::cublasLtCreate(&mut handle) }, "create")?;
        Ok(Gemm {
            handle,
            plans: Mutex::new(HashMap::new()),
            pick: GemmPick::from_env()?,
        })
    }

    /// How algorithms are picked.
    pub fn pick(&self) -> GemmPick {
        self.pick
    }

    /// Picks algorithms by `pick` from now on (`UPIPE_GEMM_ALGO` otherwise).
    pub fn set_pick(&mut self, pick: GemmPick) {
        self.pick = pick;
    }

    /// How many cached problems have timed their candidates.
    pub fn tuned_plans(&self) -> usize {
        self.plans
            .lock()
            .map(|p| p.values().filter(|p| p.tuned).count())
            .unwrap_or(0)
    }

    /// Number of cached plans (one per distinct problem).
    pub fn cached_plans(&self) -> usize {
        self.plans.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// The plan of a problem: its descriptor and layouts, and the
    /// heuristic's algorithms (the first, or the first
    /// [`GEMM_CANDIDATES`] to time under `GemmPick::Fastest`).
    fn build(&self, key: &Key, ab: DType, cd: DType) -> Result<Plan> {
        let (ta, tb) = key.fp8.unwrap_or((ab, ab));
        let p = &key.p;
        // SAFETY: every handle is created here and owned by the returned plan (or
        // destroyed by its Drop if a later step fails).
        let mut plan = unsafe {
            let mut desc = std::ptr::null_mut();
            ok(
                lt::cublasLtMatmulDescCreate(
                    &mut desc,
                    lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    lt::cudaDataType::CUDA_R_32F,
                ),
                "matmul desc",
            )?;
            let mut plan = Plan {
                desc,
                la: std::ptr::null_mut(),
                lb: std::ptr::null_mut(),
                lc: std::ptr::null_mut(),
                algos: Vec::new(),
                chosen: 0,
                tuned: false,
            };
            plan.la = layout(&p.a, ta)?;
            plan.lb = layout(&p.b, tb)?;
            plan.lc = layout(&p.c, cd)?;
            if key.fp8.is_some() {
                fp8_desc(desc)?;
            }
            set_transposes(desc, p)?;
            plan
        };
        let want = match self.pick {
            GemmPick::First => 1,
            GemmPick::Fastest => GEMM_CANDIDATES,
        };
        plan.algos = self.algorithms(&plan, &Preference::new(key.align)?, want)?;
        if plan.algos.is_empty() {
            return Err(Error::Backend(format!(
                "cuBLASLt has no usable algorithm for {ab:?} x {ab:?} -> {cd:?} with {p:?}"
            )));
        }
        Ok(plan)
    }

    /// Up to `want` of the heuristic's algorithms for `plan`, in its order.
    fn algorithms(
        &self,
        plan: &Plan,
        pref: &Preference,
        want: usize,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>> {
        // SAFETY: zeroed results are plain data the call overwrites; every
        // handle is live (the plan's and the preference's own).
        unsafe {
            let mut heur: Vec<lt::cublasLtMatmulHeuristicResult_t> =
                (0..want).map(|_| std::mem::zeroed()).collect();
            let mut found = 0;
            ok(
                lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.la,
                    plan.lb,
                    plan.lc,
                    plan.lc,
                    pref.0,
                    want as i32,
                    heur.as_mut_ptr(),
                    &mut found,
                ),
                "heuristic",
            )?;
            Ok(heur
                .iter()
                .take(found.max(0) as usize)
                .filter(|h| h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
                .map(|h| h.algo)
                .collect())
        }
    }

    /// `C = alpha·A·B + beta·C` on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        stream: &CudaStream,
        p: &LtProblem,
        ab: DType,
        c: DType,
        ptrs: &GemmPtrs,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        // cuBLASLt's A is our b and its B our a.
        let key = Key {
            p: *p,
            ab: ab.size(),
            c: c.size(),
            align: (alignment(ptrs.b), alignment(ptrs.a), alignment(ptrs.c)),
            fp8: None,
        };
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("gemm plan cache poisoned".into()))?;
        if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(key) {
            let plan = self.build(&key, ab, c)?;
            e.insert(plan);
        }
        let plan = plans.get_mut(&key).expect("inserted above");
        drv(stream.context().bind_to_thread(), "bind context")?;
        if !plan.tuned && self.pick.tunes(beta, plan.algos.len()) {
            self.tune(stream, p, plan, ptrs, alpha)?;
        }
        ok(
            self.matmul(stream, plan, plan.chosen, ptrs, alpha, beta),
            "matmul",
        )
    }

    /// `C = alpha·(inv_a·inv_b)·A·B + beta·C` of FP8 operands on `stream`
    /// (cuBLASLt's "TN" layout: our `a` row-major `[m, k]`, our `b` the
    /// transposed view of a row-major `[n, k]`, both K-major), the inverse
    /// scales read from device memory at `scales` (ours of `a`, of `b`).
    #[allow(clippy::too_many_arguments)]
    pub fn run_fp8(
        &self,
        stream: &CudaStream,
        p: &LtProblem,
        (a, b, c): (DType, DType, DType),
        ptrs: &GemmPtrs,
        scales: (u64, u64),
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        if !p.a.trans || p.b.trans {
            return Err(Error::Backend(format!(
                "an FP8 GEMM needs both operands K-major (cuBLASLt's TN layout), got {p:?}"
            )));
        }
        let key = Key {
            p: *p,
            ab: 1,
            c: c.size(),
            align: (alignment(ptrs.b), alignment(ptrs.a), alignment(ptrs.c)),
            fp8: Some((b, a)),
        };
        let mut plans = self
            .plans
            .lock()
            .map_err(|_| Error::Backend("gemm plan cache poisoned".into()))?;
        if let std::collections::hash_map::Entry::Vacant(e) = plans.entry(key) {
            let plan = self.build(&key, b, c)?;
            e.insert(plan);
        }
        let plan = plans.get_mut(&key).expect("inserted above");
        drv(stream.context().bind_to_thread(), "bind context")?;
        // cuBLASLt's A is our b: its scale is b's
        use lt::cublasLtMatmulDescAttributes_t as D;
        for (attr, ptr) in [
            (D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scales.1),
            (D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scales.0),
        ] {
            let v = ptr as *const c_void;
            let size = std::mem::size_of::<*const c_void>();
            // SAFETY: the descriptor is this plan's, held under the cache's
            // lock until the matmul below is queued.
            let s = unsafe {
                lt::cublasLtMatmulDescSetAttribute(
                    plan.desc,
                    attr,
                    (&v as *const *const c_void).cast(),
                    size,
                )
            };
            ok(s, "desc scale pointer")?;
        }
        ok(
            self.matmul(stream, plan, plan.chosen, ptrs, alpha, beta),
            "fp8 matmul",
        )
    }

    /// Times each of `plan`'s algorithms on this call's operands (a call
    /// with `beta = 0`, so every run writes the same output) and keeps the
    /// fastest; an algorithm that fails to run is left out.
    fn tune(
        &self,
        stream: &CudaStream,
        p: &LtProblem,
        plan: &mut Plan,
        ptrs: &GemmPtrs,
        alpha: f32,
    ) -> Result<()> {
        let sync = || drv(stream.synchronize(), "gemm tuning sync");
        let mut times = vec![f64::INFINITY; plan.algos.len()];
        for (i, t) in times.iter_mut().enumerate() {
            if self.matmul(stream, plan, i, ptrs, alpha, 0.0)
                != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            {
                continue;
            }
            sync()?;
            let t0 = std::time::Instant::now();
            for _ in 0..2 {
                ok(self.matmul(stream, plan, i, ptrs, alpha, 0.0), "matmul")?;
            }
            sync()?;
            *t = t0.elapsed().as_secs_f64() * 1e3 / 2.0;
        }
        plan.chosen = fastest(&times).unwrap_or(0);
        plan.tuned = true;
        tracing::debug!(
            "cuBLASLt {p:?}: algorithm {} of {} (ms {times:.3?})",
            plan.chosen,
            times.len()
        );
        Ok(())
    }

    /// One `cublasLtMatmul` of `plan` with its algorithm `algo`.
    fn matmul(
        &self,
        stream: &CudaStream,
        plan: &Plan,
        algo: usize,
        ptrs: &GemmPtrs,
        alpha: f32,
        beta: f32,
    ) -> lt::cublasStatus_t {
        // SAFETY: the plan matches these operands' shapes, dtypes and alignment;
        // all pointers are live device allocations ordered on `stream`.
        unsafe {
            lt::cublasLtMatmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                ptrs.b as *const c_void,
                plan.la,
                ptrs.a as *const c_void,
                plan.lb,
                (&beta as *const f32).cast(),
                ptrs.c as *const c_void,
                plan.lc,
                ptrs.c as *mut c_void,
                plan.lc,
                &plan.algos[algo],
                ptrs.workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as lt::cudaStream_t,
            )
        }
    }
}

/// An FP8 matmul's descriptor: accumulation in f32 without the fast
/// (reduced-precision) accumulation mode, for gradients as for the forward.
fn fp8_desc(desc: lt::cublasLtMatmulDesc_t) -> Result<()> {
    let fast: i8 = 0;
    // SAFETY: `desc` is a live descriptor; the attribute is one int8.
    let s = unsafe {
        lt::cublasLtMatmulDescSetAttribute(
            desc,
            lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_FAST_ACCUM,
            (&fast as *const i8).cast(),
            1,
        )
    };
    ok(s, "desc fast accumulation")
}

impl Drop for Gemm {
    fn drop(&mut self) {
        if let Ok(mut p) = self.plans.lock() {
            p.clear();
        }
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            lt::cublasLtDestroy(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, Category};

    /// Column-major reference of the mapped problem on host buffers.
    fn run_mapped(
        p: &LtProblem,
        a_buf: &[f32],
        a_off: usize,
        b_buf: &[f32],
        b_off: usize,
        c_buf: &mut [f32],
        c_off: usize,
    ) {
        let (m, n, k) = (p.mnk.0 as usize, p.mnk.1 as usize, p.mnk.2 as usize);
        let at = |o: &LtOperand, buf: &[f32], off: usize, i: usize, j: usize| {
            let (r, c) = if o.trans { (j, i) } else { (i, j) };
            buf[off + r + c * o.ld as usize]
        };
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for q in 0..k {
                    // cuBLASLt's A is our b, its B is our a.
                    s += at(&p.a, b_buf, b_off, i, q) * at(&p.b, a_buf, a_off, q, j);
                }
                c_buf[c_off + i + j * p.c.ld as usize] = s;
            }
        }
    }

    #[test]
    fn row_major_views_map_onto_column_major_problem() {
        let cpu = CpuBackend::new();
        let (m, k, n) = (5, 7, 3);
        let host: Vec<f32> = (0..200).map(|i| ((i * 37 % 23) as f32) - 11.0).collect();
        // a: plain block with padding; b: a transposed view; c: a block inside a wider buffer.
        let la = MatLayout::block(3, m, k, 9);
        let lb = MatLayout::block(2, n, k, 8).t();
        let lc = MatLayout::block(1, m, n, 6);
        let ta = cpu
            .from_host(&host[..60], &[60], DType::F32, Category::Workspace)
            .unwrap();
        let tb = cpu
            .from_host(&host[60..100], &[40], DType::F32, Category::Workspace)
            .unwrap();
        let mut tc = cpu.zeros(&[40], DType::F32, Category::Workspace).unwrap();
        cpu.gemm(tc.view_mut(lc), ta.view(la), tb.view(lb), 1.0, 0.0)
            .unwrap();
        let want = cpu.to_host(&tc).unwrap();
        let p = map_problem(&lc, &la, &lb).unwrap();
        assert!(
            p.b.rows <= p.b.ld as u64 && p.a.rows <= p.a.ld as u64 && p.c.rows <= p.c.ld as u64
        );
        let mut got = vec![0.0; 40];
        run_mapped(
            &p,
            &host[..60],
            la.offset,
            &host[60..100],
            lb.offset,
            &mut got,
            lc.offset,
        );
        for i in 0..m {
            for j in 0..n {
                let e = lc.offset + i * lc.ld + j;
                assert_eq!(got[e], want[e], "({i},{j})");
            }
        }
        assert!(map_problem(&lc, &la, &la).is_err());
    }

    #[test]
    fn pointer_alignment() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1010), 16);
    }
}
