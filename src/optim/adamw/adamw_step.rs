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

    /// The update's scalars as the CUDA kernels' piece tables hold them:
    /// `lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale`.
    pub fn kernel_scalars(&self) -> [f32; 8] {
        let (bc1, bc2) = self.bias_corrections();
        [
            self.lr,
            self.beta1,
            self.beta2,
            self.eps,
            self.weight_decay,
            bc1,
            bc2,
            self.grad_scale,
        ]
    }
}
