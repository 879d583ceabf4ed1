//! Process groups and collectives; see DESIGN.md §3 (Comm).

pub mod env;
pub mod rendezvous;
