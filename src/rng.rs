//! A small, seeded, platform-independent random number generator
//! (SplitMix64), so that initialisation and sampling are reproducible
//! everywhere without a dependency.

/// SplitMix64 generator.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// The generator whose counter is `state` as given, without the seed's
    /// mixing of [`new`](Self::new) (the corpus sampler's orders are drawn
    /// so, and a resumed run redraws them).
    pub fn at_state(state: u64) -> Self {
        Rng(state)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Skips the next `n` values of [`next_u64`](Self::next_u64) (SplitMix64
    /// is a counter: O(1)).
    pub fn skip(&mut self, n: u64) {
        self.0 = self.0.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }
    /// Skips the next `n` values of [`normal`](Self::normal) (two draws each).
    pub fn skip_normals(&mut self, n: u64) {
        self.skip(2 * n);
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform integer in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// `n` normal values scaled by `std`.
    pub fn normal_vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() as f32 * std).collect()
    }
}

/// `n` normal values scaled by `std`, generated in parallel blocks of
/// [`PAR_BLOCK`] values, block `i` from its own generator seeded by
/// `(seed, i)`: the same values on any number of threads. For inputs of
/// long-sequence benchmarks (billions of values), where one generator would
/// take minutes.
pub fn normal_vec_par(seed: u64, n: usize, std: f32) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0.0f32; n];
    out.par_chunks_mut(PAR_BLOCK)
        .enumerate()
        .for_each(|(i, block)| {
            let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
            for v in block {
                *v = rng.normal() as f32 * std;
            }
        });
    out
}

#[cfg(test)]
mod skip_tests {
    use super::Rng;

    #[test]
    fn skipping_normals_lands_where_drawing_them_would() {
        let mut a = Rng::new(7);
        let all = a.normal_vec(50, 1.0);
        for k in [0usize, 1, 17, 49] {
            let mut b = Rng::new(7);
            b.skip_normals(k as u64);
            assert_eq!(b.normal_vec(50 - k, 1.0), all[k..].to_vec());
        }
    }
}

/// Values per independently seeded block of [`normal_vec_par`].
pub const PAR_BLOCK: usize = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_normals_are_seeded_blockwise() {
        let n = 3 * PAR_BLOCK + 17;
        let a = normal_vec_par(5, n, 2.0);
        assert_eq!(a, normal_vec_par(5, n, 2.0));
        assert_ne!(a, normal_vec_par(6, n, 2.0));
        // blocks differ from each other (not one block repeated)
        assert_ne!(a[..PAR_BLOCK], a[PAR_BLOCK..2 * PAR_BLOCK]);
        let var = a.iter().map(|x| x * x).sum::<f32>() / n as f32;
        assert!((var - 4.0).abs() < 0.1, "{var}");
    }

    #[test]
    fn seeded_and_roughly_standard() {
        let a = Rng::new(7).normal_vec(20000, 1.0);
        assert_eq!(a, Rng::new(7).normal_vec(20000, 1.0));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let var = a.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / a.len() as f32;
        assert!(
            mean.abs() < 0.03 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
    }
}
