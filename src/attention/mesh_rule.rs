//! Each strategy's mesh rule: the context meshes (Ulysses degree Pu x ring
//! degree Pr) it runs, the order in which a default mesh of `n` ranks
//! prefers them ([`Strategy::fit_mesh`]), and the degrees given resolved to
//! the context mesh it runs ([`Strategy::given_mesh`]). Every mesh of
//! `train`, `plan` and `eval` derives from it (`plan::mesh`).

use super::cp_plan::{CpPlan, Strategy};
use super::dims::AttnDims;
use crate::error::Result;

/// GPUs of one node (an 8-GPU board). A default Ulysses group stays inside
/// one, since its all-to-alls are the heaviest exchange of a step; the ring,
/// whose transfers hide behind attention, crosses nodes.
pub const NODE_GPUS: usize = 8;

/// One context group: Ulysses degree x ring degree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextMesh {
    pub ulysses: usize,
    pub ring: usize,
}

impl ContextMesh {
    /// Ranks of the group (saturating: a product too large to count is
    /// refused by the plan, not wrapped).
    pub fn ranks(&self) -> usize {
        self.ulysses.saturating_mul(self.ring)
    }

    /// Data replicas of this group on `gpus` GPUs; the error names the fix
    /// when the group's ranks do not divide them.
    pub fn replicas_on(&self, gpus: usize) -> Result<usize> {
        let c = self.ranks();
        if c == 0 || !gpus.is_multiple_of(c) {
            let (pu, pr) = (self.ulysses, self.ring);
            return crate::config_err!(
                "{gpus} GPUs are not a multiple of the context mesh {pu} (ulysses) x {pr} (ring) = {c}; \
                 use --gpus {} or a mesh whose product divides {gpus}",
                c.max(1) * (gpus / c.max(1)).max(1)
            );
        }
        Ok(gpus / c)
    }
}

/// A mesh of `n` ranks: `data` replicas of one context group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FittedMesh {
    pub data: usize,
    pub context: ContextMesh,
}

/// Divisors of `n`, ascending (trial division up to √n).
pub fn divisors(n: usize) -> Vec<usize> {
    let (mut low, mut high) = (Vec::new(), Vec::new());
    let mut d = 1usize;
    while d.checked_mul(d).is_some_and(|dd| dd <= n) {
        if n.is_multiple_of(d) {
            low.push(d);
            if d != n / d {
                high.push(n / d);
            }
        }
        d += 1;
    }
    low.extend(high.into_iter().rev());
    low
}

impl Strategy {
    /// Whether the strategy splits a sequence over ranks (all but `local`).
    pub fn is_context_parallel(self) -> bool {
        self != Strategy::Local
    }

    /// Whether the strategy runs its layer in stages of `--chunk-heads`
    /// query heads (UPipe only).
    pub fn has_head_stages(self) -> bool {
        self == Strategy::Upipe
    }

    /// The context mesh the strategy runs with the degrees given (`None`:
    /// 1): `local` runs on one rank whatever they are; `ulysses` and `ring`
    /// put the product of both in their one group ([`CpPlan::new`]).
    pub fn given_mesh(self, ulysses: Option<usize>, ring: Option<usize>) -> ContextMesh {
        if !self.is_context_parallel() {
            return ContextMesh {
                ulysses: 1,
                ring: 1,
            };
        }
        ContextMesh {
            ulysses: ulysses.unwrap_or(1),
            ring: ring.unwrap_or(1),
        }
    }

    /// The context meshes of `c` ranks the strategy may run, the one a
    /// default mesh prefers first. `local`: none but 1 x 1 (`c` = 1);
    /// `ulysses`: Pu = `c`; `ring`: Pr = `c`; `usp` and `upipe`: Ulysses
    /// over a divisor Pu of `c`, the ring taking the rest, the largest Pu
    /// that is at most the kv heads (no K/V replication) and at most
    /// [`NODE_GPUS`] (the Ulysses group inside a node) first, then the
    /// other degrees, largest first. Which of them a model and length
    /// accept is [`Self::plan_on`]'s answer.
    pub fn context_meshes(self, kv_heads: usize, c: usize) -> Vec<ContextMesh> {
        let mesh = |ulysses, ring| ContextMesh { ulysses, ring };
        match self {
            Strategy::Local if c == 1 => vec![mesh(1, 1)],
            Strategy::Local => Vec::new(),
            Strategy::Ulysses => vec![mesh(c, 1)],
            Strategy::Ring => vec![mesh(1, c)],
            Strategy::Usp | Strategy::Upipe => {
                let mut pus = divisors(c);
                let apart = |pu: usize| pu > kv_heads || pu > NODE_GPUS;
                pus.sort_by_key(|&pu| (apart(pu), std::cmp::Reverse(pu)));
                pus.into_iter().map(|pu| mesh(pu, c / pu)).collect()
            }
        }
    }

    /// The strategy's plan on `mesh` at `seq` tokens (`chunk`: UPipe's
    /// stage width, taken by UPipe only); the error names the strategy.
    pub fn plan_on(
        self,
        dims: &AttnDims,
        seq: usize,
        mesh: ContextMesh,
        chunk: Option<usize>,
    ) -> Result<CpPlan> {
        let chunk = chunk.filter(|_| self.has_head_stages());
        CpPlan::new(self, dims, seq, mesh.ulysses, mesh.ring, chunk)
            .map_err(|e| crate::Error::Config(format!("{self}: {}", strip(&e))))
    }

    /// The default mesh of exactly `n` ranks among those `accepts` (the
    /// mesh flags given): the fewest data replicas first, then, for the
    /// context group of the ranks they leave, [`Self::context_meshes`]'
    /// order; the first whose plan at `seq` is valid. `None` when none is.
    pub fn fit_mesh(
        self,
        dims: &AttnDims,
        seq: usize,
        chunk: Option<usize>,
        n: usize,
        accepts: impl Fn(FittedMesh) -> bool,
    ) -> Option<FittedMesh> {
        if n == 0 {
            return None;
        }
        for data in divisors(n) {
            for context in self.context_meshes(dims.kv_heads, n / data) {
                let m = FittedMesh { data, context };
                if accepts(m) && self.plan_on(dims, seq, context, chunk).is_ok() {
                    return Some(m);
                }
            }
        }
        None
    }
}

/// The message of a configuration error without its prefix.
fn strip(e: &crate::Error) -> String {
    let s = e.to_string();
    s.strip_prefix("invalid configuration: ")
        .map(str::to_string)
        .unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divisors_ascend_and_divide() {
        assert_eq!(divisors(1), [1]);
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(16), [1, 2, 4, 8, 16]);
        for n in 1..200 {
            let all: Vec<usize> = (1..=n).filter(|d| n % d == 0).collect();
            assert_eq!(divisors(n), all, "{n}");
        }
    }

    #[test]
    fn hybrids_keep_ulysses_within_the_kv_heads_and_a_node() {
        let order = |s: Strategy, kv, c| -> Vec<(usize, usize)> {
            let v = s.context_meshes(kv, c);
            v.iter().map(|m| (m.ulysses, m.ring)).collect()
        };
        assert_eq!(order(Strategy::Upipe, 2, 4), [(2, 2), (1, 4), (4, 1)]);
        assert_eq!(order(Strategy::Usp, 8, 8)[0], (8, 1));
        // 32 kv heads on 16 GPUs: Ulysses inside a node, the ring across two
        assert_eq!(order(Strategy::Usp, 32, 16)[0], (8, 2));
        assert_eq!(order(Strategy::Upipe, 32, 16).last(), Some(&(16, 1)));
        assert_eq!(order(Strategy::Ulysses, 2, 4), [(4, 1)]);
        assert_eq!(order(Strategy::Ring, 2, 4), [(1, 4)]);
        assert_eq!(order(Strategy::Local, 2, 1), [(1, 1)]);
        assert!(order(Strategy::Local, 2, 2).is_empty());
    }
}
