//! Prefill time: a per-worker-key model of how fast the key prefills, fitted online from
//! the first tokens the front door observes (`--router-cost ttft`).
//!
//! ```text
//! service(r) = base + b * per_step_batch
//!              + n * per_token + n * (c + n / 2) * per_pair + n * b * per_batch
//!   n = the request's tokens the key does not cache                  [thousands]
//!   c = its prefix the key caches (attended to, not computed)        [thousands of tokens]
//!   b = blocks the key's active requests hold, r's included          [thousands]
//! ```
//!
//! The terms follow what a forward pass costs: every computed token its weights
//! (`per_token`); causal attention, where the k-th new token attends to `c + k` earlier
//! ones, `n * c + n^2 / 2` pairs (`per_pair`: a 50k-token prompt costs far more than ten
//! 5k ones); and chunked prefill sharing each pass with the running decodes, whose cost
//! grows with the KV they read (`per_batch`). So the key's prefill throughput is a
//! function of the prompt's context length and of its batch. `base` is what every request
//! pays (network, tokenisation), and `b * per_step_batch` the forward passes its first
//! token waits for even when it computes little: each pass reads the KV of every running
//! request, so a short or cached prompt on a worker with a big batch still waits longer. A request's *service* time is its
//! time to first token minus the time it queued behind earlier prefills on the key
//! ([`crate::sched::drain`] measures both); its predicted TTFT is the queue's predicted
//! wait plus its service.
//!
//! # The fit
//! Exponentially weighted least squares over the features
//! `x = [1, b, n, n (c + n/2), n b]`,
//! each observation counting [`FORGET`] times less than the next (a memory of about
//! `1 / (1 - FORGET)` requests, so the model follows a worker that slows down), with a
//! ridge pull of strength [`RIDGE`] towards [`TtftFit::PRIOR`]: a key with no observation
//! predicts the prior (an 8B model on one H100: about 25k prefill tokens/s), and the
//! normal equations are never singular.
//!
//! # Invariants
//! 1. Every coefficient is finite and non-negative, so a prediction never falls when the
//!    request, its context or the batch grows, and never is NaN (inputs are counts).
//! 2. An observation with a non-finite or negative time changes nothing.
//! 3. Pure arithmetic: no clock, no allocation.

/// Weight of an observation relative to the next one's.
pub const FORGET: f64 = 0.98;

/// Strength of the pull towards the prior, in observations' worth of evidence.
pub const RIDGE: f64 = 2.0;

/// Features of the model.
const K: usize = 5;

/// One prefill, as the model sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prefill {
    /// Tokens to compute (not cached).
    pub tokens: u64,
    /// Prefix tokens cached on the key, attended to but not computed.
    pub cached: u64,
    /// Blocks the key's active requests hold, this one's included.
    pub batch_blocks: u64,
}

impl Prefill {
    fn features(&self) -> [f64; K] {
        let n = self.tokens as f64 / 1000.0;
        let c = self.cached as f64 / 1000.0;
        let b = self.batch_blocks as f64 / 1000.0;
        [1.0, b, n, n * (c + n / 2.0), n * b]
    }
}

/// The model's coefficients, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Coefficients {
    /// Milliseconds every request pays.
    pub base_ms: f64,
    /// Milliseconds every request pays per thousand blocks of running batch.
    pub ms_per_k_blocks: f64,
    /// Per thousand computed tokens.
    pub ms_per_k_tokens: f64,
    /// Per million attention pairs (thousand new tokens x thousand tokens attended).
    pub ms_per_m_pairs: f64,
    /// Per thousand computed tokens per thousand blocks of running batch.
    pub ms_per_k_tokens_per_k_blocks: f64,
}

impl Coefficients {
    fn as_array(self) -> [f64; K] {
        [
            self.base_ms,
            self.ms_per_k_blocks,
            self.ms_per_k_tokens,
            self.ms_per_m_pairs,
            self.ms_per_k_tokens_per_k_blocks,
        ]
    }

    fn from_array(c: [f64; K]) -> Self {
        Self {
            base_ms: c[0],
            ms_per_k_blocks: c[1],
            ms_per_k_tokens: c[2],
            ms_per_m_pairs: c[3],
            ms_per_k_tokens_per_k_blocks: c[4],
        }
    }
}

/// A key's fitted model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftFit {
    /// Decayed sums of `x xᵀ` (symmetric, row-major).
    xx: [[f64; K]; K],
    /// Decayed sums of `x * service`.
    xy: [f64; K],
    /// Observations taken.
    observed: u64,
    /// The coefficients solved after the last observation.
    coef: Coefficients,
}

impl Default for TtftFit {
    fn default() -> Self {
        Self::PRIOR_FIT
    }
}

impl TtftFit {
    /// What a key predicts before its first observation: 5 ms base, 2 ms per thousand
    /// blocks of running batch (two passes reading 16k tokens of KV at 50 ns each), 40 ms
    /// per thousand computed tokens (25k tokens/s), 1.5 ms per million attention pairs (an
    /// 8k prompt pays ~15% more per token than a short one), 5 ms more per thousand tokens
    /// for every thousand blocks of running batch.
    pub const PRIOR: Coefficients = Coefficients {
        base_ms: 5.0,
        ms_per_k_blocks: 2.0,
        ms_per_k_tokens: 40.0,
        ms_per_m_pairs: 1.5,
        ms_per_k_tokens_per_k_blocks: 5.0,
    };

    /// A fit with no observation: it predicts [`Self::PRIOR`].
    pub const PRIOR_FIT: TtftFit = TtftFit {
        xx: [[0.0; K]; K],
        xy: [0.0; K],
        observed: 0,
        coef: Self::PRIOR,
    };

    /// The current coefficients.
    pub fn coefficients(&self) -> Coefficients {
        self.coef
    }

    /// Observations taken.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Predicted service milliseconds of `p`: [`Self::fixed_ms`] plus
    /// [`Self::prefill_ms`].
    #[inline]
    pub fn predict_ms(&self, p: &Prefill) -> f64 {
        self.fixed_ms(p.batch_blocks) + self.prefill_ms(p)
    }

    /// What any request pays on a key with `batch_blocks` active, whatever it computes.
    #[inline]
    pub fn fixed_ms(&self, batch_blocks: u64) -> f64 {
        self.coef.base_ms + self.coef.ms_per_k_blocks * batch_blocks as f64 / 1000.0
    }

    /// Predicted milliseconds of the compute `p` adds to the key's queue (no fixed part).
    #[inline]
    pub fn prefill_ms(&self, p: &Prefill) -> f64 {
        let x = p.features();
        let c = self.coef.as_array();
        (2..K).map(|i| x[i] * c[i]).sum()
    }

    /// Takes one observed service time of `p`.
    pub fn observe(&mut self, p: &Prefill, service_ms: f64) {
        if !(service_ms.is_finite() && service_ms >= 0.0) {
            return;
        }
        let x = p.features();
        for (i, row) in self.xx.iter_mut().enumerate() {
            for (j, cell) in row.iter_mut().enumerate() {
                *cell = FORGET * *cell + x[i] * x[j];
            }
        }
        for (i, s) in self.xy.iter_mut().enumerate() {
            *s = FORGET * *s + x[i] * service_ms;
        }
        self.observed = self.observed.saturating_add(1);
        if let Some(coef) = self.solve() {
            self.coef = coef;
        }
    }

    /// The ridge solution `(XX + R I) c = XY + R prior` with every coefficient
    /// non-negative (invariant 1): a coefficient the unconstrained solution drives below 0
    /// is pinned at 0 and the rest solved again (an active-set pass, at most `K` rounds).
    /// `None` if a system is degenerate (it cannot be with `RIDGE > 0`).
    fn solve(&self) -> Option<Coefficients> {
        let prior = Self::PRIOR.as_array();
        let mut a = self.xx;
        let mut b = self.xy;
        for i in 0..K {
            a[i][i] += RIDGE;
            b[i] += RIDGE * prior[i];
        }
        let mut pinned = [false; K];
        for _ in 0..K {
            let (mut a2, mut b2) = (a, b);
            for (i, &p) in pinned.iter().enumerate() {
                if p {
                    // Row i becomes `c_i = 0`; column i no longer feeds the others.
                    a2[i] = [0.0; K];
                    a2[i][i] = 1.0;
                    b2[i] = 0.0;
                    for row in a2.iter_mut() {
                        row[i] = 0.0;
                    }
                    a2[i][i] = 1.0;
                }
            }
            let c = solve(a2, b2)?;
            let negative: Vec<usize> = (0..K).filter(|&i| !pinned[i] && c[i] < 0.0).collect();
            if negative.is_empty() {
                return Some(Coefficients::from_array(
                    c.map(|v| if v.is_finite() { v.max(0.0) } else { 0.0 }),
                ));
            }
            for i in negative {
                pinned[i] = true;
            }
        }
        None
    }
}

/// Solves a KxK system by Gaussian elimination with partial pivoting.
// Elimination reads one row while writing another: indices say it more plainly than
// iterators over split borrows.
#[allow(clippy::needless_range_loop)]
fn solve(mut a: [[f64; K]; K], mut b: [f64; K]) -> Option<[f64; K]> {
    for col in 0..K {
        let pivot = (col..K).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..K {
            let f = a[row][col] / a[col][col];
            for k in col..K {
                a[row][k] -= f * a[col][k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; K];
    for row in (0..K).rev() {
        let tail: f64 = (row + 1..K).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - tail) / a[row][row];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(tokens: u64, cached: u64, batch_blocks: u64) -> Prefill {
        Prefill {
            tokens,
            cached,
            batch_blocks,
        }
    }

    #[test]
    fn an_unobserved_key_predicts_the_prior() {
        let fit = TtftFit::default();
        // 2,000 tokens after 1,000 cached on an idle key: 5 + 2 * 40 + 2 * (1 + 1) * 1.5.
        assert!((fit.predict_ms(&p(2000, 1000, 0)) - 91.0).abs() < 1e-9);
        // With 1,000 active blocks: 2 ms more for everyone, 2 * 5 more for the prefill.
        assert!((fit.predict_ms(&p(2000, 1000, 1000)) - 103.0).abs() < 1e-9);
        assert!((fit.fixed_ms(1000) - 7.0).abs() < 1e-9);
    }

    #[test]
    fn the_fit_learns_a_slower_worker_and_quadratic_attention() {
        // A worker at a quarter of the prior's speed with heavier attention, 20 ms base.
        let truth = |q: &Prefill| {
            let n = q.tokens as f64 / 1000.0;
            let c = q.cached as f64 / 1000.0;
            let b = q.batch_blocks as f64 / 1000.0;
            20.0 + 8.0 * b + 160.0 * n + 6.0 * n * (c + n / 2.0)
        };
        let mut fit = TtftFit::default();
        for i in 0..400u64 {
            let q = p(
                500 + (i * 977) % 30_000,
                (i * 7919) % 20_000,
                (i * 313) % 3000,
            );
            fit.observe(&q, truth(&q));
        }
        let c = fit.coefficients();
        assert!((c.ms_per_k_tokens - 160.0).abs() < 5.0, "{c:?}");
        assert!((c.ms_per_m_pairs - 6.0).abs() < 0.5, "{c:?}");
        assert!((c.ms_per_k_blocks - 8.0).abs() < 1.5, "{c:?}");
        for q in [p(40_000, 0, 1000), p(1000, 8000, 100)] {
            let got = fit.predict_ms(&q);
            assert!((got - truth(&q)).abs() / truth(&q) < 0.03, "{q:?}: {got}");
        }
    }

    #[test]
    fn bad_observations_change_nothing() {
        let mut fit = TtftFit::default();
        for bad in [f64::NAN, f64::INFINITY, -1.0] {
            fit.observe(&p(1000, 0, 10), bad);
        }
        assert_eq!(fit, TtftFit::default());
    }

    proptest! {
        /// Whatever it observed, the fit stays within invariant 1: finite, non-negative
        /// coefficients, predictions that never fall as the request, its context or the
        /// batch grows.
        #[test]
        fn predictions_stay_finite_and_monotone(
            obs in prop::collection::vec(
                (0u64..200_000, 0u64..100_000, 0u64..100_000, 0.0f64..1e6), 0..60),
            n in 0u64..100_000, c in 0u64..100_000, b in 0u64..50_000,
        ) {
            let mut fit = TtftFit::default();
            for (on, oc, ob, t) in obs {
                fit.observe(&p(on, oc, ob), t);
            }
            let k = fit.coefficients();
            for v in k.as_array() {
                prop_assert!(v.is_finite() && v >= 0.0, "{k:?}");
            }
            let base = fit.predict_ms(&p(n, c, b));
            prop_assert!(base.is_finite());
            prop_assert!(fit.predict_ms(&p(n + 1000, c, b)) >= base);
            prop_assert!(fit.predict_ms(&p(n, c + 1000, b)) >= base);
            prop_assert!(fit.predict_ms(&p(n, c, b + 1000)) >= base);
        }
    }
}
