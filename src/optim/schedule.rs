//! Learning-rate schedules: a linear warm-up to the peak rate, then one of
//! four shapes down to the final rate (`--schedule`):
//!
//! - `cosine`: half a cosine from `lr` at the end of the warm-up to `min_lr`
//!   at the last step;
//! - `linear`: a straight line over the same span;
//! - `constant`: `lr` after the warm-up (`min_lr` unused);
//! - `wsd` (warm-up, stable, decay): `lr` until the last `fraction` of the
//!   run's steps (`--decay-fraction`), then a straight line to `min_lr` at
//!   the last step.
//!
//! Steps are 1-based; step `s` of a warm-up of `W` steps runs at
//! `lr * s / W`. Past the last step the rate stays where the schedule ended.

use crate::error::Result;
use std::fmt;

/// The shape after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decay {
    Cosine,
    Linear,
    Constant,
    /// Stable at `lr`, then linear to `min_lr` over the last `fraction` of
    /// the run's steps (rounded to whole steps).
    Wsd {
        fraction: f32,
    },
}

/// The names `--schedule` takes.
pub const SCHEDULE_NAMES: &str = "cosine, linear, constant or wsd";

/// The WSD decay fraction `--decay-fraction` defaults to.
pub const DEFAULT_DECAY_FRACTION: f32 = 0.2;

impl Decay {
    /// The schedule named `name` (`--schedule`), WSD decaying over
    /// `fraction` of the run (`--decay-fraction`, only for `wsd`).
    pub fn parse(name: &str, fraction: Option<f32>) -> Result<Decay> {
        let decay = match name {
            "cosine" => Decay::Cosine,
            "linear" => Decay::Linear,
            "constant" => Decay::Constant,
            "wsd" => Decay::Wsd {
                fraction: fraction.unwrap_or(DEFAULT_DECAY_FRACTION),
            },
            other => {
                return crate::config_err!(
                    "--schedule {other}: unknown schedule; use {SCHEDULE_NAMES}"
                );
            }
        };
        if fraction.is_some() && !matches!(decay, Decay::Wsd { .. }) {
            return crate::config_err!(
                "--decay-fraction applies to --schedule wsd only, not {name}: \
                 add --schedule wsd, or leave --decay-fraction out"
            );
        }
        Ok(decay)
    }

    /// The `--schedule` name.
    pub fn name(&self) -> &'static str {
        match self {
            Decay::Cosine => "cosine",
            Decay::Linear => "linear",
            Decay::Constant => "constant",
            Decay::Wsd { .. } => "wsd",
        }
    }
}

impl fmt::Display for Decay {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Decay::Wsd { fraction } => write!(f, "wsd (decay over the last {fraction})"),
            other => f.write_str(other.name()),
        }
    }
}

/// A learning-rate schedule of a run of `total_steps` steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub decay: Decay,
    /// The peak rate, reached at the end of the warm-up.
    pub lr: f32,
    /// The rate at the last step (cosine, linear, wsd).
    pub min_lr: f32,
    /// Warm-up steps (0: none).
    pub warmup: u32,
    pub total_steps: u32,
}

impl Schedule {
    /// WSD's decay steps: `fraction` of the run, rounded (0 for the others).
    pub fn decay_steps(&self) -> u32 {
        match self.decay {
            Decay::Wsd { fraction } => (fraction as f64 * self.total_steps as f64).round() as u32,
            _ => 0,
        }
    }

    /// Checks the WSD phases: a fraction in [0, 1], and warm-up plus decay
    /// within the run. Errors name the flags and the fix.
    pub fn validate(&self) -> Result<()> {
        let Decay::Wsd { fraction } = self.decay else {
            return Ok(());
        };
        if !(0.0..=1.0).contains(&fraction) {
            return crate::config_err!(
                "--decay-fraction {fraction} is outside [0, 1]: it is the share of --steps \
                 the WSD schedule decays over (e.g. 0.2 for the last fifth)"
            );
        }
        let decay = self.decay_steps();
        if self.warmup.saturating_add(decay) > self.total_steps {
            return crate::config_err!(
                "--warmup {} and --decay-fraction {fraction} ({decay} steps) sum past --steps {}: \
                 the WSD phases (warm-up, stable, decay) must fit the run; lower --warmup or \
                 --decay-fraction, or raise --steps",
                self.warmup,
                self.total_steps
            );
        }
        Ok(())
    }

    /// The learning rate of 1-based `step`.
    pub fn lr_at(&self, step: u32) -> f32 {
        if self.warmup > 0 && step <= self.warmup {
            return self.lr * step as f32 / self.warmup as f32;
        }
        let (lr, min) = (self.lr, self.min_lr);
        let after_warmup = |span: u32| {
            let done = step.saturating_sub(self.warmup) as f32;
            (done / span.max(1) as f32).min(1.0)
        };
        match self.decay {
            Decay::Constant => lr,
            Decay::Cosine => {
                let t = after_warmup(self.total_steps.saturating_sub(self.warmup));
                min + 0.5 * (lr - min) * (1.0 + (std::f32::consts::PI * t).cos())
            }
            Decay::Linear => {
                let t = after_warmup(self.total_steps.saturating_sub(self.warmup));
                min + (lr - min) * (1.0 - t)
            }
            Decay::Wsd { .. } => {
                let decay = self.decay_steps();
                let stable_end = self.total_steps.saturating_sub(decay);
                if decay == 0 || step <= stable_end {
                    return lr;
                }
                let t = ((step - stable_end) as f32 / decay as f32).min(1.0);
                min + (lr - min) * (1.0 - t)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(decay: Decay, warmup: u32, total: u32) -> Schedule {
        Schedule {
            decay,
            lr: 1.0,
            min_lr: 0.1,
            warmup,
            total_steps: total,
        }
    }

    fn close(a: f32, b: f64) -> bool {
        (a as f64 - b).abs() < 1e-6
    }

    /// Every step of every schedule against its formula, written out here
    /// in f64 from the definitions above.
    #[test]
    fn each_schedule_follows_its_formula_step_by_step() {
        let (w, total) = (10u32, 110u32);
        let pi = std::f64::consts::PI;
        for decay in [
            Decay::Cosine,
            Decay::Linear,
            Decay::Constant,
            Decay::Wsd { fraction: 0.25 },
        ] {
            let s = sched(decay, w, total);
            s.validate().unwrap();
            for step in 1..=total + 5 {
                let want = if step <= w {
                    step as f64 / w as f64
                } else {
                    let t = (((step - w) as f64) / 100.0).min(1.0);
                    match decay {
                        Decay::Cosine => 0.1 + 0.45 * (1.0 + (pi * t).cos()),
                        Decay::Linear => 0.1 + 0.9 * (1.0 - t),
                        Decay::Constant => 1.0,
                        // 28 decay steps (0.25 x 110 rounded): stable to step 82
                        Decay::Wsd { .. } if step <= 82 => 1.0,
                        Decay::Wsd { .. } => {
                            0.1 + 0.9 * (1.0 - (((step - 82) as f64) / 28.0).min(1.0))
                        }
                    }
                };
                assert!(
                    close(s.lr_at(step), want),
                    "{decay} step {step}: {}",
                    s.lr_at(step)
                );
            }
        }
    }

    #[test]
    fn wsd_edge_cases() {
        // no stable phase: the decay starts right after the warm-up
        let s = sched(Decay::Wsd { fraction: 0.5 }, 5, 10);
        s.validate().unwrap();
        assert_eq!(s.decay_steps(), 5);
        assert!(close(s.lr_at(5), 1.0));
        assert!(close(s.lr_at(6), 0.1 + 0.9 * 0.8));
        assert!(close(s.lr_at(10), 0.1));
        // no decay: the peak rate to the end
        let s = sched(Decay::Wsd { fraction: 0.0 }, 2, 10);
        s.validate().unwrap();
        assert!(close(s.lr_at(2), 1.0) && close(s.lr_at(10), 1.0));
        // all decay, no warm-up: linear from the first step
        let s = sched(Decay::Wsd { fraction: 1.0 }, 0, 4);
        s.validate().unwrap();
        let lrs: Vec<f32> = (1..=4).map(|k| s.lr_at(k)).collect();
        for (got, want) in lrs.iter().zip([0.775, 0.55, 0.325, 0.1]) {
            assert!(close(*got, want), "{lrs:?}");
        }
    }

    #[test]
    fn bad_schedules_name_the_flag_and_the_fix() {
        let e = sched(Decay::Wsd { fraction: 1.5 }, 0, 10)
            .validate()
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("--decay-fraction 1.5 is outside [0, 1]"),
            "{e}"
        );
        let e = sched(Decay::Wsd { fraction: -0.1 }, 0, 10)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("outside [0, 1]"), "{e}");
        let e = sched(Decay::Wsd { fraction: 0.5 }, 6, 10)
            .validate()
            .unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("--warmup 6") && e.contains("sum past --steps 10"),
            "{e}"
        );
        let e = Decay::parse("step", None).unwrap_err().to_string();
        assert!(
            e.contains("--schedule step") && e.contains(SCHEDULE_NAMES),
            "{e}"
        );
        let e = Decay::parse("cosine", Some(0.2)).unwrap_err().to_string();
        assert!(e.contains("add --schedule wsd"), "{e}");
        assert_eq!(
            Decay::parse("wsd", None).unwrap(),
            Decay::Wsd {
                fraction: DEFAULT_DECAY_FRACTION
            }
        );
    }
}
