//! Rank <-> mesh coordinate math (pure functions).

use crate::error::Result;

/// Sizes of the `data x ring x ulysses` mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshShape {
    pub data: usize,
    pub ring: usize,
    pub ulysses: usize,
    /// FSDP replicas (HSDP): parameters are sharded inside groups of
    /// `world / fsdp_replicas` consecutive ranks and replicated across the
    /// groups (1: sharded over the whole world).
    pub fsdp_replicas: usize,
}

/// The kinds of group a rank belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupKind {
    World,
    Ulysses,
    Ring,
    Context,
    Data,
    /// The ranks sharing one FSDP shard set (consecutive global ranks).
    Shard,
    /// The ranks holding the same FSDP shard in different replicas.
    Replica,
}

/// A rank's coordinates in the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub data: usize,
    pub ring: usize,
    pub ulysses: usize,
}

impl MeshShape {
    /// A mesh; every size must be at least 1.
    pub fn new(data: usize, ring: usize, ulysses: usize) -> Result<Self> {
        if data == 0 || ring == 0 || ulysses == 0 {
            return crate::config_err!(
                "mesh sizes must be at least 1 (got data={data}, ring={ring}, ulysses={ulysses})"
            );
        }
        Ok(MeshShape {
            data,
            ring,
            ulysses,
            fsdp_replicas: 1,
        })
    }
    /// The same mesh with FSDP replicated over `r` groups (HSDP); `r` must
    /// divide the world size.
    pub fn with_fsdp_replicas(self, r: usize) -> crate::error::Result<Self> {
        let w = self.world_size();
        if r == 0 || !w.is_multiple_of(r) {
            let divisors: Vec<usize> = (1..=w).filter(|d| w.is_multiple_of(*d)).collect();
            return crate::config_err!(
                "--fsdp-replicate {r} must divide the {w} ranks of the mesh (shard groups of equal size); use one of {divisors:?}"
            );
        }
        Ok(MeshShape {
            fsdp_replicas: r,
            ..self
        })
    }
    /// Ranks in one FSDP shard group.
    pub fn shard_size(&self) -> usize {
        self.world_size() / self.fsdp_replicas.max(1)
    }
    /// Ranks in the whole mesh.
    pub fn world_size(&self) -> usize {
        self.data * self.ring * self.ulysses
    }
    /// Ranks in one context-parallel group (C = Pu * Pr).
    pub fn context_size(&self) -> usize {
        self.ring * self.ulysses
    }
    /// Coordinates of a global rank (Ulysses index fastest).
    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            ulysses: rank % self.ulysses,
            ring: (rank / self.ulysses) % self.ring,
            data: rank / (self.ulysses * self.ring),
        }
    }
    /// Global rank of coordinates.
    pub fn rank_of(&self, c: Coords) -> usize {
        (c.data * self.ring + c.ring) * self.ulysses + c.ulysses
    }
    /// Global ranks of the group of `kind` containing `rank`, in group-rank order.
    pub fn members(&self, kind: GroupKind, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        let all = 0..self.world_size();
        all.filter(|&r| {
            let o = self.coords(r);
            match kind {
                GroupKind::World => true,
                GroupKind::Ulysses => o.data == c.data && o.ring == c.ring,
                GroupKind::Ring => o.data == c.data && o.ulysses == c.ulysses,
                GroupKind::Context => o.data == c.data,
                GroupKind::Data => o.ring == c.ring && o.ulysses == c.ulysses,
                GroupKind::Shard => r / self.shard_size() == rank / self.shard_size(),
                GroupKind::Replica => r % self.shard_size() == rank % self.shard_size(),
            }
        })
        .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn coords_round_trip_and_groups_partition(d in 1usize..4, r in 1usize..4, u in 1usize..5) {
            let m = MeshShape::new(d, r, u).unwrap();
            for rank in 0..m.world_size() {
                prop_assert_eq!(m.rank_of(m.coords(rank)), rank);
                for (kind, size) in [(GroupKind::Ulysses, u), (GroupKind::Ring, r), (GroupKind::Context, r * u), (GroupKind::Data, d)] {
                    let g = m.members(kind, rank);
                    prop_assert_eq!(g.len(), size);
                    prop_assert!(g.contains(&rank));
                    for &o in &g {
                        prop_assert_eq!(m.members(kind, o), g.clone());
                    }
                }
            }
        }
    }

    #[test]
    fn ulysses_groups_are_consecutive_ranks() {
        let m = MeshShape::new(1, 2, 4).unwrap();
        assert_eq!(m.members(GroupKind::Ulysses, 5), vec![4, 5, 6, 7]);
        assert_eq!(m.members(GroupKind::Ring, 5), vec![1, 5]);
    }
}
