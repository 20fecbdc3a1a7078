//! DDSketch (Masson, Rim and Lee, VLDB 2019) for request durations in
//! microseconds: any quantile within 1% relative error, mergeable exactly
//! (bucket counts add), bounded memory.
//!
//! A value `x >= 1` goes to bucket `i = ceil(log_gamma(x))` with
//! `gamma = (1 + a) / (1 - a)`, `a = 0.01`, so bucket `i` holds
//! `(gamma^(i-1), gamma^i]` and reporting `2 gamma^i / (gamma + 1)` is within
//! `a` of every value in it. 0 has its own bucket. Buckets cover 1 µs to 1e10
//! µs (2.8 hours) in 1153 buckets; longer durations count in the last one.
//!
//! In memory the buckets are a dense `Vec<u64>` over only the index range
//! seen so far (a minute of 1–100 ms requests spans ~230 buckets), allocated
//! on the first insert. Serialized, only nonzero buckets are written.

use crate::codec::{put_u64, DecodeError, Reader};

/// Relative accuracy of [`Latency::quantile`].
pub const RELATIVE_ACCURACY: f64 = 0.01;
/// `ln(gamma)` with `gamma = 1.01 / 0.99` (checked in the tests).
const LN_GAMMA: f64 = 0.020_000_666_706_669_435;
/// Largest value with its own bucket: 1e10 µs.
pub const MAX_US: u64 = 10_000_000_000;
/// Number of nonzero-value buckets: indices `0..=ceil(log_gamma(MAX_US))`.
pub const NUM_BUCKETS: usize = 1153;
const FORMAT: u8 = 1;

/// A latency distribution sketch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    zero: u64,
    /// Bucket index of `counts[0]`.
    offset: usize,
    counts: Vec<u64>,
    count: u64,
}

fn bucket_of(us: u64) -> usize {
    // Latencies below 16 ms (most of them) take their bucket from a table
    // made once with the same formula: a `ln` per insert was the largest
    // cost of an analytics event.
    static SMALL: std::sync::OnceLock<Box<[u16]>> = std::sync::OnceLock::new();
    if us < SMALL_TABLE as u64 {
        let t = SMALL.get_or_init(|| {
            (0..SMALL_TABLE as u64)
                .map(|v| bucket_ln(v.max(1)) as u16)
                .collect()
        });
        return t[us as usize] as usize;
    }
    bucket_ln(us)
}

/// Entries of the small-value table (32 KB).
const SMALL_TABLE: usize = 1 << 14;

fn bucket_ln(us: u64) -> usize {
    let i = ((us as f64).ln() / LN_GAMMA).ceil();
    // us >= 1 so i >= 0; the clamp also covers values above MAX_US.
    (i.max(0.0) as usize).min(NUM_BUCKETS - 1)
}

fn value_of(bucket: usize) -> u64 {
    let gamma = LN_GAMMA.exp();
    ((bucket as f64 * LN_GAMMA).exp() * 2.0 / (gamma + 1.0)).round() as u64
}

impl Latency {
    /// An empty sketch; allocates nothing until the first insert.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one duration.
    pub fn add(&mut self, us: u64) {
        self.add_n(us, 1);
    }

    fn add_n(&mut self, us: u64, n: u64) {
        self.count = self.count.saturating_add(n);
        if us == 0 {
            self.zero = self.zero.saturating_add(n);
            return;
        }
        let i = bucket_of(us);
        self.grow_to(i);
        let c = &mut self.counts[i - self.offset];
        *c = c.saturating_add(n);
    }

    /// Makes bucket `i` addressable.
    fn grow_to(&mut self, i: usize) {
        if self.counts.is_empty() {
            self.offset = i;
            self.counts.push(0);
        } else if i < self.offset {
            let extra = self.offset - i;
            self.counts.splice(0..0, std::iter::repeat_n(0, extra));
            self.offset = i;
        } else if i >= self.offset + self.counts.len() {
            self.counts.resize(i - self.offset + 1, 0);
        }
    }

    /// Adds `other`'s counts to this sketch.
    pub fn merge(&mut self, other: &Latency) {
        self.zero = self.zero.saturating_add(other.zero);
        self.count = self.count.saturating_add(other.count);
        if other.counts.is_empty() {
            return;
        }
        self.grow_to(other.offset);
        self.grow_to(other.offset + other.counts.len() - 1);
        let base = other.offset - self.offset;
        for (j, &c) in other.counts.iter().enumerate() {
            let s = &mut self.counts[base + j];
            *s = s.saturating_add(c);
        }
    }

    /// Number of durations recorded.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The `q`-quantile (`q` in [0, 1], clamped) in µs, within 1% of the
    /// recorded value of rank `floor(q * (count - 1))`, plus rounding to a
    /// whole µs. 0 if empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let q = if q.is_nan() { 0.0 } else { q.clamp(0.0, 1.0) };
        let rank = (q * (self.count - 1) as f64).floor() as u64;
        let mut seen = self.zero;
        if seen > rank {
            return 0;
        }
        for (j, &c) in self.counts.iter().enumerate() {
            seen = seen.saturating_add(c);
            if seen > rank {
                return value_of(self.offset + j);
            }
        }
        // Only reachable if counts saturated; report the largest bucket.
        self.counts
            .iter()
            .rposition(|&c| c > 0)
            .map_or(0, |j| value_of(self.offset + j))
    }

    /// `[format, zero count, nonzero bucket count, (index delta, count)...]`,
    /// all varints.
    pub fn to_bytes(&self) -> Vec<u8> {
        let nonzero = self.counts.iter().filter(|&&c| c > 0).count();
        let mut out = Vec::with_capacity(3 + nonzero * 3);
        out.push(FORMAT);
        put_u64(&mut out, self.zero);
        put_u64(&mut out, nonzero as u64);
        let mut prev = 0usize;
        for (j, &c) in self.counts.iter().enumerate() {
            if c > 0 {
                let i = self.offset + j;
                put_u64(&mut out, (i - prev) as u64);
                put_u64(&mut out, c);
                prev = i;
            }
        }
        out
    }

    /// Parses [`Latency::to_bytes`] output; rejects anything malformed.
    pub fn from_bytes(bytes: &[u8]) -> Result<Latency, DecodeError> {
        let mut r = Reader::new(bytes);
        if r.u8()? != FORMAT {
            return Err(DecodeError("latency: unknown format"));
        }
        let mut s = Latency::new();
        let zero = r.u64()?;
        s.add_n(0, zero);
        let n = r.len(NUM_BUCKETS)?;
        let mut index = 0usize;
        for k in 0..n {
            let delta = r.len(NUM_BUCKETS)?;
            if k > 0 && delta == 0 {
                return Err(DecodeError("latency: bucket order"));
            }
            index += delta;
            let c = r.u64()?;
            if index >= NUM_BUCKETS || c == 0 {
                return Err(DecodeError("latency: bad bucket"));
            }
            s.grow_to(index);
            s.counts[index - s.offset] = c;
            s.count = s
                .count
                .checked_add(c)
                .ok_or(DecodeError("latency: overflow"))?;
        }
        r.finish()?;
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_small_value_table_matches_the_formula() {
        assert!(NUM_BUCKETS <= u16::MAX as usize);
        for us in (1..SMALL_TABLE as u64 + 10).chain([1 << 20, u64::MAX]) {
            assert_eq!(bucket_of(us), bucket_ln(us), "{us}");
        }
    }

    #[test]
    fn constants_match_their_definitions() {
        let gamma = (1.0 + RELATIVE_ACCURACY) / (1.0 - RELATIVE_ACCURACY);
        assert!((LN_GAMMA - gamma.ln()).abs() < 1e-15);
        let last = ((MAX_US as f64).ln() / gamma.ln()).ceil() as usize;
        assert_eq!(NUM_BUCKETS, last + 1);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(bucket_of(u64::MAX), NUM_BUCKETS - 1);
    }

    /// xorshift64*: a fixed generator so the tests are deterministic.
    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            s.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    fn skewed(n: usize) -> Vec<u64> {
        // Pareto (alpha 1.2) from 200 µs: a long tail up to seconds, plus a
        // few zeros and values beyond the bucket range.
        let mut next = rng(7);
        let mut v: Vec<u64> = (0..n)
            .map(|_| {
                let u = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
                (200.0 / u.powf(1.0 / 1.2)) as u64
            })
            .collect();
        v[0] = 0;
        v[1] = 0;
        v[2] = 5;
        v
    }

    #[test]
    fn quantiles_within_one_percent_of_exact() {
        let data = skewed(100_000);
        let mut s = Latency::new();
        for &x in &data {
            s.add(x);
        }
        assert_eq!(s.count(), data.len() as u64);
        let mut sorted = data.clone();
        sorted.sort_unstable();
        for q in [0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0] {
            let exact = sorted[(q * (sorted.len() - 1) as f64).floor() as usize];
            let got = s.quantile(q);
            let exact_f = exact.min(MAX_US) as f64;
            // 1% from the sketch, plus at most 0.5 µs from rounding.
            let tol = exact_f * RELATIVE_ACCURACY + 0.5;
            assert!(
                (got as f64 - exact_f).abs() <= tol,
                "q={q}: got {got}, exact {exact}"
            );
        }
        // Memory stays bounded by the bucket range.
        assert!(s.counts.len() <= NUM_BUCKETS);
    }

    #[test]
    fn merge_equals_one_sketch_and_round_trips() {
        let data = skewed(20_000);
        let mut whole = Latency::new();
        let mut a = Latency::new();
        let mut b = Latency::new();
        for (i, &x) in data.iter().enumerate() {
            whole.add(x);
            if i % 3 == 0 {
                a.add(x)
            } else {
                b.add(x)
            }
        }
        let mut m = Latency::new();
        m.merge(&b);
        m.merge(&a);
        for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
            assert_eq!(m.quantile(q), whole.quantile(q));
        }
        assert_eq!(m.count(), whole.count());
        let back = Latency::from_bytes(&whole.to_bytes()).unwrap();
        assert_eq!(back.to_bytes(), whole.to_bytes());
        assert_eq!(back.quantile(0.99), whole.quantile(0.99));
        assert_eq!(back.count(), whole.count());
    }

    #[test]
    fn empty_and_small() {
        let s = Latency::new();
        assert_eq!(s.quantile(0.5), 0);
        assert_eq!(Latency::from_bytes(&s.to_bytes()).unwrap(), s);
        assert_eq!(s.to_bytes(), [1, 0, 0]);
        let mut s = Latency::new();
        s.add(1000);
        assert!((s.quantile(0.5) as f64 - 1000.0).abs() <= 10.0);
        assert_eq!(s.quantile(f64::NAN), s.quantile(0.0));
        s.add(0);
        assert_eq!(s.quantile(0.0), 0);
        // One bucket a short blob.
        assert!(s.to_bytes().len() <= 8);
    }

    #[test]
    fn malformed_input_is_an_error() {
        let mut s = Latency::new();
        for x in [0, 3, 900, 900, 70_000] {
            s.add(x);
        }
        let good = s.to_bytes();
        for bad in [
            &[][..],
            &[2, 0, 0],                // unknown format
            &[1, 0, 1, 0xff, 0x7f, 1], // index out of range
            &[1, 0, 2, 5, 1, 0, 1],    // repeated index
            &[1, 0, 1, 5, 0],          // zero count
            &[1, 0, 1, 5, 1, 9],       // trailing byte
            &[1, 0, 0xff, 0xff, 0x03], // too many buckets
            &good[..good.len() - 1],
        ] {
            assert!(Latency::from_bytes(bad).is_err(), "{bad:?}");
        }
        for i in 0..good.len() {
            let mut c = good.clone();
            c[i] ^= 0x5a;
            let _ = Latency::from_bytes(&c);
        }
    }
}
