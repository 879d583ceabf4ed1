//! The hyper-parameters of one AdamW update, as every device's update takes
//! them.

/// Hyper-parameters of one AdamW update.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    /// Learning rate of this step.
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// 1-based step number (for bias correction).
    pub step: u32,
    /// Multiplier applied to the gradient first (clipping).
    pub grad_scale: f32,
}

impl AdamWStep {
    /// The bias corrections `(1 - beta1^step, 1 - beta2^step)`, in f32 as
    /// every backend's update divides by them.
    pub fn bias_corrections(&self) -> (f32, f32) {
        (
            1.0 - self.beta1.powi(self.step as i32),
            1.0 - self.beta2.powi(self.step as i32),
        )
    }
}
