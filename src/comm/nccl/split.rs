//! How the groups of a mesh are split from the world communicator: each
//! group's colour and each rank's key for `ncclCommSplit`.

use crate::comm::{GroupKind, MeshShape};
use crate::error::{Error, Result};

/// The split of one group out of the world: which colour and key each rank passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSpec {
    pub kind: GroupKind,
    /// Global ranks of the group, in group-rank order.
    pub members: Vec<usize>,
    /// `ncclCommSplit` colour: the group's lowest global rank (unique per group of a kind).
    pub color: i32,
    /// `ncclCommSplit` key: this rank's position in `members`.
    pub key: i32,
}

/// The splits `rank` performs, in the order every rank performs them.
pub fn split_specs(shape: MeshShape, rank: usize) -> Result<Vec<SplitSpec>> {
    if rank >= shape.world_size() {
        return Err(Error::Config(format!(
            "rank {rank} is outside a mesh of {} ranks",
            shape.world_size()
        )));
    }
    [
        GroupKind::Ulysses,
        GroupKind::Ring,
        GroupKind::Context,
        GroupKind::Data,
        GroupKind::Shard,
        GroupKind::Replica,
    ]
    .into_iter()
    .map(|kind| {
        let members = shape.members(kind, rank);
        let pos = members
            .iter()
            .position(|&r| r == rank)
            .ok_or_else(|| Error::Comm(format!("rank {rank} missing from its {kind:?} group")))?;
        let int = |x: usize| {
            i32::try_from(x).map_err(|_| Error::Config(format!("rank {x} exceeds NCCL's int")))
        };
        Ok(SplitSpec {
            kind,
            color: int(members[0])?,
            key: int(pos)?,
            members,
        })
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_match_mesh_membership() {
        for (d, r, u, replicas) in [
            (1, 1, 2, 1),
            (1, 2, 1, 2),
            (1, 2, 2, 2),
            (2, 2, 2, 4),
            (2, 1, 4, 1),
        ] {
            let shape = MeshShape::new(d, r, u)
                .unwrap()
                .with_fsdp_replicas(replicas)
                .unwrap();
            for rank in 0..shape.world_size() {
                let specs = split_specs(shape, rank).unwrap();
                assert_eq!(specs.len(), 6);
                for s in &specs {
                    assert_eq!(s.members, shape.members(s.kind, rank));
                    assert_eq!(s.members[s.key as usize], rank);
                    // every member of the group passes the same colour and
                    // keys 0..size in member order
                    for (pos, &o) in s.members.iter().enumerate() {
                        let theirs = split_specs(shape, o)
                            .unwrap()
                            .into_iter()
                            .find(|x| x.kind == s.kind)
                            .unwrap();
                        assert_eq!(theirs.color, s.color);
                        assert_eq!(theirs.key as usize, pos);
                    }
                    // ranks outside the group use other colours
                    for o in 0..shape.world_size() {
                        if !s.members.contains(&o) {
                            let theirs = split_specs(shape, o)
                                .unwrap()
                                .into_iter()
                                .find(|x| x.kind == s.kind)
                                .unwrap();
                            assert_ne!(theirs.color, s.color);
                        }
                    }
                }
            }
        }
        assert!(split_specs(MeshShape::new(1, 1, 2).unwrap(), 2).is_err());
    }
}
