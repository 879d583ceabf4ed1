//! A backend's profile phase held for a scope.

use super::ops::Backend;
use super::profile::Phase;

/// Sets a backend's phase for as long as it lives, then back to [`Phase::Step`].
pub struct PhaseGuard<'a, B: Backend>(&'a B);

impl<'a, B: Backend> PhaseGuard<'a, B> {
    pub fn enter(b: &'a B, phase: Phase) -> Self {
        b.set_phase(phase);
        PhaseGuard(b)
    }
}

impl<B: Backend> Drop for PhaseGuard<'_, B> {
    fn drop(&mut self) {
        self.0.set_phase(Phase::Step);
    }
}
