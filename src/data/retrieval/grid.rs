//! The grid a retrieval evaluation sweeps: context lengths × needle depths
//! × trials per cell, each trial with a seed of its own derived from the
//! run's seed and its place in the grid.

use crate::error::Result;
use crate::rng::Rng;

/// Lengths × depths × trials per cell.
#[derive(Debug, Clone, PartialEq)]
pub struct Grid {
    /// Context lengths in tokens, ascending as given.
    pub lengths: Vec<usize>,
    /// Needle depths, fractions of the haystack in `[0, 1]`.
    pub depths: Vec<f64>,
    /// Trials per (length, depth) cell.
    pub trials: usize,
    /// The run's seed.
    pub seed: u64,
}

/// Where one trial is in the grid, and its seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrialAt {
    pub length: usize,
    pub depth: f64,
    pub length_index: usize,
    pub depth_index: usize,
    /// The trial's index within its cell.
    pub index: usize,
    pub seed: u64,
}

impl Grid {
    /// `depths` evenly spaced depths from 0 to 100 % (one: 50 %).
    pub fn even_depths(depths: usize) -> Result<Vec<f64>> {
        match depths {
            0 => {
                crate::config_err!("--depths 0: give at least 1 depth (11: 0 %, 10 %, ..., 100 %)")
            }
            1 => Ok(vec![0.5]),
            n => Ok((0..n).map(|i| i as f64 / (n - 1) as f64).collect()),
        }
    }

    /// Trials of one length.
    pub fn per_length(&self) -> usize {
        self.depths.len() * self.trials
    }

    /// Every trial.
    pub fn count(&self) -> usize {
        self.lengths.len() * self.per_length()
    }

    /// Trial `i` of length `length_index` (depth-major within the length).
    pub fn at(&self, length_index: usize, i: usize) -> TrialAt {
        let (depth_index, index) = (i / self.trials, i % self.trials);
        let length = self.lengths[length_index];
        let mix = [length as u64, depth_index as u64, index as u64]
            .iter()
            .fold(self.seed, |s, &x| {
                Rng::new(s ^ x.wrapping_mul(0xA24B_AED4_963E_E407)).next_u64()
            });
        TrialAt {
            length,
            depth: self.depths[depth_index],
            length_index,
            depth_index,
            index,
            seed: mix,
        }
    }
}

/// `--lengths`: token counts separated by commas, each a whole number
/// with an optional `K` (×1024) or `M` (×1024²): `4K,32K,128K,1M`.
pub fn parse_lengths(s: &str) -> Result<Vec<usize>> {
    let bad = |part: &str| {
        crate::config_err!(
            "--lengths {s}: '{part}' is not a length; give token counts separated by commas, \
             each a whole number with an optional K (1024) or M (1024²) after it: 4K,32K,128K,1M"
        )
    };
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (digits, scale) = match part.char_indices().last() {
            Some((i, 'K' | 'k')) => (&part[..i], 1usize << 10),
            Some((i, 'M' | 'm')) => (&part[..i], 1 << 20),
            _ => (part, 1),
        };
        match digits
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_mul(scale))
        {
            Some(n) if n > 0 => out.push(n),
            _ => return bad(part),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_parse_with_binary_suffixes_and_refuse_the_rest() {
        assert_eq!(
            parse_lengths("4K,32K,128k,1M,300").unwrap(),
            vec![4096, 32768, 131072, 1 << 20, 300]
        );
        for bad in ["", "4K,", "4X", "1.5K", "0", "-4K", "K"] {
            let e = parse_lengths(bad).unwrap_err().to_string();
            assert!(e.contains("4K,32K,128K,1M"), "{bad}: {e}");
        }
    }

    #[test]
    fn depths_are_evenly_spaced() {
        assert_eq!(Grid::even_depths(1).unwrap(), vec![0.5]);
        assert_eq!(Grid::even_depths(3).unwrap(), vec![0.0, 0.5, 1.0]);
        assert_eq!(Grid::even_depths(11).unwrap()[3], 0.3);
        assert!(Grid::even_depths(0).is_err());
    }

    #[test]
    fn every_trial_has_its_own_reproducible_seed() {
        let g = Grid {
            lengths: vec![64, 128],
            depths: Grid::even_depths(3).unwrap(),
            trials: 2,
            seed: 9,
        };
        assert_eq!(g.count(), 12);
        let seeds: std::collections::HashSet<u64> = (0..2)
            .flat_map(|l| (0..g.per_length()).map(move |i| (l, i)))
            .map(|(l, i)| g.at(l, i).seed)
            .collect();
        assert_eq!(seeds.len(), 12);
        let at = g.at(1, 5);
        assert_eq!((at.length, at.depth, at.index), (128, 1.0, 1));
        assert_eq!(at, g.at(1, 5));
        let other = Grid {
            seed: 10,
            ..g.clone()
        };
        assert_ne!(other.at(1, 5).seed, at.seed);
    }
}
