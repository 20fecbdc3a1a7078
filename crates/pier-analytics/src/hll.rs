//! HyperLogLog for counting unique client IPs, compatible bit for bit with
//! PostgreSQL's `postgresql-hll` extension (`hll(14, 5)`).
//!
//! - Hash: MurmurHash3 x64_128 with seed 0, first 64-bit half — what
//!   `hll_hash_bytea(bytea, 0)` / `hll_hash_text(text, 0)` return.
//! - Register index: the low 14 bits of the hash; register value: one plus
//!   the number of trailing zeros of the remaining 50 bits (0 if they are all
//!   zero), capped at 31 (5-bit registers). This is postgresql-hll's
//!   `compressed_add`, so the same inputs set the same registers.
//! - Estimate: postgresql-hll's `multiset_card` for its FULL type (raw
//!   HyperLogLog with linear counting below 2.5 m, and its large-range
//!   correction), so [`Hll::estimate`] equals `hll_cardinality` of
//!   [`Hll::to_pg_hll`].
//!
//! Memory: a set with at most [`SPARSE_MAX`] nonzero registers is a sorted
//! `Vec<u32>` (4 bytes a register), else 16 KiB of `u8` registers. Most
//! per-minute rollups see a handful of clients, so they stay small.
//!
//! Serialized form ([`Hll::to_bytes`]) is itself a valid postgresql-hll
//! value: EMPTY, SPARSE (19-bit index/value words, about 2.4 bytes a
//! register) or FULL (10 KiB of packed registers), whichever is smallest,
//! as postgresql-hll chooses. [`Hll::to_pg_hll`] always writes FULL.

use crate::codec::DecodeError;
use std::fmt;

/// log2 of the number of registers.
pub const LOG2M: u32 = 14;
/// Number of registers (16384): standard error 1.04 / sqrt(m) = 0.81%.
pub const M: usize = 1 << LOG2M;
/// Bits per register.
pub const REGWIDTH: u32 = 5;
const MAX_REG: u8 = (1 << REGWIDTH) - 1;
/// Past this many nonzero registers the in-memory form turns dense (a sorted
/// u32 list of 2048 entries is 8 KiB; the dense array is 16 KiB).
pub const SPARSE_MAX: usize = 2048;

// postgresql-hll storage header (schema version 1).
const PG_VERSION: u8 = 1;
const PG_EMPTY: u8 = 1;
const PG_EXPLICIT: u8 = 2;
const PG_SPARSE: u8 = 3;
const PG_FULL: u8 = 4;
/// Parameter byte: (regwidth - 1) in the top 3 bits, log2m in the low 5.
const PG_PARAMS: u8 = (((REGWIDTH - 1) as u8) << 5) | LOG2M as u8;
/// Cutoff byte: sparse enabled, explicit threshold "auto" (63): the defaults
/// of `hll(14, 5)`, so our values union with such a column.
const PG_CUTOFF: u8 = (1 << 6) | 63;
const FULL_DATA_BYTES: usize = (M * REGWIDTH as usize).div_ceil(8);
const SPARSE_WORD_BITS: usize = (LOG2M + REGWIDTH) as usize;

#[derive(Clone)]
enum Repr {
    /// Nonzero registers as `index << 5 | value`, sorted by index, one entry
    /// per index.
    Sparse(Vec<u32>),
    Dense(Box<[u8]>),
}

/// A HyperLogLog sketch with 2^14 5-bit registers.
#[derive(Clone)]
pub struct Hll {
    repr: Repr,
}

impl Default for Hll {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Hll {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.repr {
            Repr::Sparse(_) => "sparse",
            Repr::Dense(_) => "dense",
        };
        f.debug_struct("Hll")
            .field("repr", &kind)
            .field("nonzero", &self.nonzero())
            .field("estimate", &self.estimate())
            .finish()
    }
}

/// Two sketches are equal when all their registers are, whatever their form.
impl PartialEq for Hll {
    fn eq(&self, other: &Self) -> bool {
        self.nonzero() == other.nonzero() && self.registers().eq(other.registers())
    }
}

impl Eq for Hll {}

impl Hll {
    /// An empty sketch; allocates nothing until the first insert.
    pub fn new() -> Self {
        Self {
            repr: Repr::Sparse(Vec::new()),
        }
    }

    /// Hashes `bytes` as `hll_hash_bytea(bytes, 0)` does and inserts it.
    pub fn add_bytes(&mut self, bytes: &[u8]) {
        self.add_hash(hash_bytes(bytes));
    }

    /// Inserts an already hashed value (an `hll_hashval`).
    pub fn add_hash(&mut self, hash: u64) {
        let index = (hash & (M as u64 - 1)) as u32;
        let rest = hash >> LOG2M;
        if rest == 0 {
            // postgresql-hll leaves the register at 0 in this case.
            return;
        }
        let value = (rest.trailing_zeros() + 1).min(u32::from(MAX_REG)) as u8;
        self.set_max(index, value);
    }

    fn set_max(&mut self, index: u32, value: u8) {
        match &mut self.repr {
            Repr::Dense(regs) => {
                let r = &mut regs[index as usize];
                *r = (*r).max(value);
            }
            Repr::Sparse(list) => match list.binary_search_by_key(&index, |e| e >> REGWIDTH) {
                Ok(pos) => {
                    if (list[pos] & u32::from(MAX_REG)) < u32::from(value) {
                        list[pos] = (index << REGWIDTH) | u32::from(value);
                    }
                }
                Err(pos) => {
                    list.insert(pos, (index << REGWIDTH) | u32::from(value));
                    if list.len() > SPARSE_MAX {
                        self.densify();
                    }
                }
            },
        }
    }

    fn densify(&mut self) {
        if let Repr::Sparse(list) = &self.repr {
            let mut regs = vec![0u8; M].into_boxed_slice();
            for &e in list {
                regs[(e >> REGWIDTH) as usize] = (e & u32::from(MAX_REG)) as u8;
            }
            self.repr = Repr::Dense(regs);
        }
    }

    /// Union: each register becomes the max of the two.
    pub fn merge(&mut self, other: &Hll) {
        match (&mut self.repr, &other.repr) {
            (_, Repr::Sparse(b)) if b.is_empty() => {}
            (Repr::Dense(a), Repr::Dense(b)) => {
                for (x, &y) in a.iter_mut().zip(b.iter()) {
                    *x = (*x).max(y);
                }
            }
            (Repr::Dense(a), Repr::Sparse(b)) => {
                for &e in b {
                    let r = &mut a[(e >> REGWIDTH) as usize];
                    *r = (*r).max((e & u32::from(MAX_REG)) as u8);
                }
            }
            (Repr::Sparse(a), Repr::Dense(b)) => {
                let mut regs = b.clone();
                for &e in a.iter() {
                    let r = &mut regs[(e >> REGWIDTH) as usize];
                    *r = (*r).max((e & u32::from(MAX_REG)) as u8);
                }
                self.repr = Repr::Dense(regs);
            }
            (Repr::Sparse(a), Repr::Sparse(b)) => {
                let merged = merge_sorted(a, b);
                let too_big = merged.len() > SPARSE_MAX;
                *a = merged;
                if too_big {
                    self.densify();
                }
            }
        }
    }

    /// Estimated number of distinct values added, by postgresql-hll's
    /// estimator for FULL sets.
    pub fn estimate(&self) -> u64 {
        let m = M as f64;
        let (sum, zeros) = match &self.repr {
            Repr::Sparse(list) => {
                if list.is_empty() {
                    return 0;
                }
                let zeros = M - list.len();
                let sum = zeros as f64
                    + list
                        .iter()
                        .map(|&e| inv_pow2((e & u32::from(MAX_REG)) as u8))
                        .sum::<f64>();
                (sum, zeros)
            }
            Repr::Dense(regs) => {
                let zeros = regs.iter().filter(|&&r| r == 0).count();
                (regs.iter().map(|&r| inv_pow2(r)).sum::<f64>(), zeros)
            }
        };
        let alpha_m2 = (0.7213 / (1.0 + 1.079 / m)) * m * m;
        let raw = alpha_m2 / sum;
        // 2^L with L = (2^regwidth - 2) + log2m bits of hash "seen".
        let two_to_l = (1u64 << ((u32::from(MAX_REG) - 1) + LOG2M)) as f64;
        let est = if zeros != 0 && raw < 5.0 * m / 2.0 {
            m * (m / zeros as f64).ln()
        } else if raw <= two_to_l / 30.0 {
            raw
        } else {
            -two_to_l * (1.0 - raw / two_to_l).ln()
        };
        est.round() as u64
    }

    /// Number of nonzero registers.
    pub fn nonzero(&self) -> usize {
        match &self.repr {
            Repr::Sparse(list) => list.len(),
            Repr::Dense(regs) => regs.iter().filter(|&&r| r != 0).count(),
        }
    }

    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.nonzero() == 0
    }

    /// `(index, value)` of every nonzero register, by ascending index.
    fn registers(&self) -> Box<dyn Iterator<Item = (u32, u8)> + '_> {
        match &self.repr {
            Repr::Sparse(list) => Box::new(
                list.iter()
                    .map(|&e| (e >> REGWIDTH, (e & u32::from(MAX_REG)) as u8)),
            ),
            Repr::Dense(regs) => Box::new(
                regs.iter()
                    .enumerate()
                    .filter(|(_, &r)| r != 0)
                    .map(|(i, &r)| (i as u32, r)),
            ),
        }
    }

    /// Compact serialized form: a postgresql-hll value of type EMPTY, SPARSE
    /// or FULL, whichever postgresql-hll itself would pick (SPARSE while it
    /// is smaller than FULL, i.e. below about 4300 nonzero registers).
    pub fn to_bytes(&self) -> Vec<u8> {
        let n = self.nonzero();
        if n == 0 {
            return vec![(PG_VERSION << 4) | PG_EMPTY, PG_PARAMS, PG_CUTOFF];
        }
        if n * SPARSE_WORD_BITS < M * REGWIDTH as usize {
            let mut w = BitWriter::with_capacity(3 + (n * SPARSE_WORD_BITS).div_ceil(8));
            w.out
                .extend_from_slice(&[(PG_VERSION << 4) | PG_SPARSE, PG_PARAMS, PG_CUTOFF]);
            for (i, v) in self.registers() {
                w.write((i << REGWIDTH) | u32::from(v), SPARSE_WORD_BITS as u32);
            }
            w.finish()
        } else {
            self.to_pg_hll()
        }
    }

    /// The sketch in postgresql-hll's storage format, FULL type: header
    /// `0x14 0x8e 0x7f` (schema 1, FULL; regwidth 5, log2m 14; sparse on,
    /// auto explicit threshold) then the 16384 registers as big-endian 5-bit
    /// words (10240 bytes). Insert it as a `bytea` cast to `hll`.
    pub fn to_pg_hll(&self) -> Vec<u8> {
        let mut w = BitWriter::with_capacity(3 + FULL_DATA_BYTES);
        w.out
            .extend_from_slice(&[(PG_VERSION << 4) | PG_FULL, PG_PARAMS, PG_CUTOFF]);
        let mut regs = self.registers().peekable();
        for i in 0..M as u32 {
            let v = match regs.peek() {
                Some(&(j, v)) if j == i => {
                    regs.next();
                    v
                }
                _ => 0,
            };
            w.write(u32::from(v), REGWIDTH);
        }
        w.finish()
    }

    /// Parses [`Hll::to_bytes`] / [`Hll::to_pg_hll`] output, or any
    /// postgresql-hll value with log2m 14 and regwidth 5 (EMPTY, EXPLICIT,
    /// SPARSE or FULL). Anything else is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Hll, DecodeError> {
        let [v, params, _cutoff, data @ ..] = bytes else {
            return Err(DecodeError("hll: too short"));
        };
        if v >> 4 != PG_VERSION {
            return Err(DecodeError("hll: unknown schema version"));
        }
        if *params != PG_PARAMS {
            return Err(DecodeError("hll: not log2m=14 regwidth=5"));
        }
        let mut hll = Hll::new();
        match v & 0x0f {
            PG_EMPTY => {
                if !data.is_empty() {
                    return Err(DecodeError("hll: data after EMPTY"));
                }
            }
            PG_EXPLICIT => {
                if data.len() % 8 != 0 {
                    return Err(DecodeError("hll: EXPLICIT length"));
                }
                for c in data.chunks_exact(8) {
                    let mut b = [0u8; 8];
                    b.copy_from_slice(c);
                    hll.add_hash(u64::from_be_bytes(b));
                }
            }
            PG_SPARSE => {
                let bits = data.len() * 8;
                let n = bits / SPARSE_WORD_BITS;
                if n == 0 || bits - n * SPARSE_WORD_BITS >= 8 {
                    return Err(DecodeError("hll: SPARSE padding"));
                }
                let mut r = BitReader::new(data);
                for _ in 0..n {
                    let word = r.read(SPARSE_WORD_BITS as u32);
                    let value = (word & u32::from(MAX_REG)) as u8;
                    hll.set_max(word >> REGWIDTH, value);
                }
                // A zero value is legal in the format but is no register.
                if let Repr::Sparse(list) = &mut hll.repr {
                    list.retain(|&e| e & u32::from(MAX_REG) != 0);
                }
            }
            PG_FULL => {
                if data.len() != FULL_DATA_BYTES {
                    return Err(DecodeError("hll: FULL length"));
                }
                let mut r = BitReader::new(data);
                let mut regs = vec![0u8; M].into_boxed_slice();
                for reg in regs.iter_mut() {
                    *reg = r.read(REGWIDTH) as u8;
                }
                hll.repr = Repr::Dense(regs);
                let n = hll.nonzero();
                if n <= SPARSE_MAX {
                    let list = hll.registers().map(|(i, v)| (i << REGWIDTH) | u32::from(v));
                    hll.repr = Repr::Sparse(list.collect());
                }
            }
            _ => return Err(DecodeError("hll: unsupported type")),
        }
        Ok(hll)
    }
}

fn inv_pow2(r: u8) -> f64 {
    1.0 / (1u64 << r) as f64
}

/// Union of two sparse lists (sorted by index): max value per index.
fn merge_sorted(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (ia, ib) = (a[i] >> REGWIDTH, b[j] >> REGWIDTH);
        if ia < ib {
            out.push(a[i]);
            i += 1;
        } else if ib < ia {
            out.push(b[j]);
            j += 1;
        } else {
            // Same index: the packed word with the larger value is larger.
            out.push(a[i].max(b[j]));
            i += 1;
            j += 1;
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// Writes words of up to 32 bits, high bits first, into bytes filled from
/// their high bits (postgresql-hll's bit packing); the last byte is padded
/// with zeros at the bottom.
struct BitWriter {
    out: Vec<u8>,
    acc: u64,
    nbits: u32,
}

impl BitWriter {
    fn with_capacity(n: usize) -> Self {
        Self {
            out: Vec::with_capacity(n),
            acc: 0,
            nbits: 0,
        }
    }

    fn write(&mut self, value: u32, width: u32) {
        self.acc = (self.acc << width) | u64::from(value & ((1u32 << width) - 1));
        self.nbits += width;
        while self.nbits >= 8 {
            self.nbits -= 8;
            self.out.push((self.acc >> self.nbits) as u8);
        }
        self.acc &= (1u64 << self.nbits) - 1;
    }

    fn finish(mut self) -> Vec<u8> {
        if self.nbits > 0 {
            self.out.push((self.acc << (8 - self.nbits)) as u8);
        }
        self.out
    }
}

/// The reader for [`BitWriter`]'s layout. Callers check the length first;
/// reading past the end yields zero bits rather than panicking.
struct BitReader<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    nbits: u32,
}

impl<'a> BitReader<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            pos: 0,
            acc: 0,
            nbits: 0,
        }
    }

    fn read(&mut self, width: u32) -> u32 {
        while self.nbits < width {
            let b = self.data.get(self.pos).copied().unwrap_or(0);
            self.pos += 1;
            self.acc = (self.acc << 8) | u64::from(b);
            self.nbits += 8;
        }
        self.nbits -= width;
        let v = (self.acc >> self.nbits) as u32 & ((1u32 << width) - 1);
        self.acc &= (1u64 << self.nbits) - 1;
        v
    }
}

/// `hll_hash_bytea(bytes, 0)`: the first half of MurmurHash3 x64_128.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    murmur3_x64_128(bytes, 0).0
}

/// MurmurHash3 x64_128 (Austin Appleby's reference `MurmurHash3_x64_128`),
/// returning the two 64-bit halves in output order.
pub fn murmur3_x64_128(data: &[u8], seed: u32) -> (u64, u64) {
    const C1: u64 = 0x87c3_7b91_1142_53d5;
    const C2: u64 = 0x4cf5_ad43_2745_937f;
    let mut h1 = u64::from(seed);
    let mut h2 = u64::from(seed);

    let mut blocks = data.chunks_exact(16);
    for block in &mut blocks {
        let (a, b) = block.split_at(8);
        let mut k1 = u64::from_le_bytes(a.try_into().unwrap_or([0; 8]));
        let mut k2 = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        k1 = k1.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2);
        h1 ^= k1;
        h1 = h1
            .rotate_left(27)
            .wrapping_add(h2)
            .wrapping_mul(5)
            .wrapping_add(0x52dc_e729);
        k2 = k2.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1);
        h2 ^= k2;
        h2 = h2
            .rotate_left(31)
            .wrapping_add(h1)
            .wrapping_mul(5)
            .wrapping_add(0x3849_5ab5);
    }

    let tail = blocks.remainder();
    let mut k1 = 0u64;
    let mut k2 = 0u64;
    for (i, &b) in tail.iter().enumerate() {
        if i < 8 {
            k1 ^= u64::from(b) << (8 * i);
        } else {
            k2 ^= u64::from(b) << (8 * (i - 8));
        }
    }
    if tail.len() > 8 {
        h2 ^= k2.wrapping_mul(C2).rotate_left(33).wrapping_mul(C1);
    }
    if !tail.is_empty() {
        h1 ^= k1.wrapping_mul(C1).rotate_left(31).wrapping_mul(C2);
    }

    let len = data.len() as u64;
    h1 ^= len;
    h2 ^= len;
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    h1 = fmix64(h1);
    h2 = fmix64(h2);
    h1 = h1.wrapping_add(h2);
    h2 = h2.wrapping_add(h1);
    (h1, h2)
}

fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn murmur3_matches_postgresql_hll_regression_outputs() {
        // postgresql-hll expected/hash_1.out (hll_hash_bytea / hll_hash_*).
        let cases: &[(&[u8], u32, i64)] = &[
            (b"", 0, 0),
            (b"\x41", 0, 243126998722523514),
            (b"\x42", 0, -4837624800923759386),
            (b"\x41\x42", 0, 5365230931951287672),
            (b"\x00", 0, 5048724184180415669),
            (b"\x01", 0, 8849112093580131862),
            (b"\x00\x00", 0, 3478107235931676136),
            (b"\x00\x00\x00\x00", 0, -3485513579396041028),
            (&[0; 8], 0, 2945182322382062539),
            (&[0; 8], 1, 8297479994805284640),
            (&[0; 8], 2147483647, -4042198036618575253),
        ];
        for &(data, seed, want) in cases {
            assert_eq!(
                murmur3_x64_128(data, seed).0 as i64,
                want,
                "{data:?} seed {seed}"
            );
        }
        assert_eq!(hash_bytes(b"AB") as i64, 5365230931951287672);
    }

    #[test]
    fn murmur3_smhasher_verification_value() {
        // SMHasher's VerificationTest: hash keys [0], [0,1], ..., [0..255)
        // with seed 256 - len, hash the concatenated outputs with seed 0; the
        // first 4 bytes (LE) must be 0x6384BA69 for MurmurHash3_x64_128.
        // Covers the 16-byte block loop and every tail length.
        let key: Vec<u8> = (0..=255u8).collect();
        let mut hashes = Vec::with_capacity(256 * 16);
        for i in 0..256usize {
            let (h1, h2) = murmur3_x64_128(&key[..i], 256 - i as u32);
            hashes.extend_from_slice(&h1.to_le_bytes());
            hashes.extend_from_slice(&h2.to_le_bytes());
        }
        let (h1, _) = murmur3_x64_128(&hashes, 0);
        assert_eq!(h1 as u32, 0x6384_BA69);
    }

    #[test]
    fn bit_packing_matches_storage_spec_examples() {
        // STORAGE.markdown, FULL: regwidth 5, registers [0, 1, 2, 3].
        let mut w = BitWriter::with_capacity(3);
        for v in 0..4 {
            w.write(v, 5);
        }
        assert_eq!(w.finish(), [0x00, 0x44, 0x30]);
        // SPARSE: log2m 11, regwidth 6, pairs (11, 6), (1099, 19). The spec
        // lists the octets as 0b00000001, 0b01100011, 0b01000100,
        // 0b10110100, 0b11000000 (its hex line says 0x5B for the fourth,
        // a typo: 0b10110100 is 0xB4).
        let mut w = BitWriter::with_capacity(5);
        w.write((11 << 6) | 6, 17);
        w.write((1099 << 6) | 19, 17);
        let bytes = w.finish();
        assert_eq!(
            bytes,
            [
                0b0000_0001,
                0b0110_0011,
                0b0100_0100,
                0b1011_0100,
                0b1100_0000
            ]
        );
        let mut r = BitReader::new(&bytes);
        assert_eq!(r.read(17), (11 << 6) | 6);
        assert_eq!(r.read(17), (1099 << 6) | 19);
    }

    #[test]
    fn registers_follow_postgresql_hll_compressed_add() {
        let mut h = Hll::new();
        // Index 5, remaining bits ...1000 -> 3 trailing zeros -> value 4.
        h.add_hash((0b1000 << LOG2M) | 5);
        // Index 7 with all-zero high bits: postgresql-hll sets nothing.
        h.add_hash(7);
        // Index 9 with only the top bit set: 49 trailing zeros, capped at 31.
        h.add_hash((1 << 63) | 9);
        assert_eq!(h.registers().collect::<Vec<_>>(), [(5, 4), (9, 31)]);

        let pg = h.to_pg_hll();
        assert_eq!(pg.len(), 3 + 10240);
        assert_eq!(&pg[..3], &[0x14, 0x8e, 0x7f]);
        // Register 5 (value 4 = 00100) occupies bits 25..30 of the data.
        // Register 9 (31 = 11111) occupies bits 45..50.
        let mut expect = vec![0u8; 10240];
        // bits 25..30 = 00100 -> bit 27 set -> byte 3, mask 0x10
        expect[3] = 0x10;
        // bits 45..50 all ones -> byte 5 bits 5..7 (0x07), byte 6 bits 0..1 (0xC0)
        expect[5] = 0x07;
        expect[6] = 0xC0;
        assert_eq!(&pg[3..], &expect[..]);
        assert_eq!(Hll::from_bytes(&pg).unwrap(), h);
    }

    fn ipv4(i: u32) -> [u8; 4] {
        // A fixed bijection spreading consecutive i over the address space.
        (i.wrapping_mul(2_654_435_761) ^ 0x5bd1_e995).to_be_bytes()
    }

    #[test]
    fn million_distinct_ipv4_within_two_percent() {
        let n = 1_000_000u32;
        let mut whole = Hll::new();
        let mut a = Hll::new();
        let mut b = Hll::new();
        for i in 0..n {
            let ip = ipv4(i);
            whole.add_bytes(&ip);
            if i % 2 == 0 {
                a.add_bytes(&ip);
            } else {
                b.add_bytes(&ip);
            }
        }
        let est = whole.estimate();
        let err = (est as f64 - f64::from(n)).abs() / f64::from(n);
        assert!(err < 0.02, "estimate {est} off by {:.3}%", err * 100.0);
        a.merge(&b);
        assert_eq!(a, whole);
        assert_eq!(a.estimate(), est);
        // Round trip through both encodings.
        assert_eq!(Hll::from_bytes(&whole.to_bytes()).unwrap(), whole);
        assert_eq!(Hll::from_bytes(&whole.to_pg_hll()).unwrap(), whole);
    }

    #[test]
    fn small_sets_are_near_exact_and_stay_sparse() {
        for n in [1u32, 2, 10, 100, 1000, 2000, 3000, 5000, 20000] {
            let mut h = Hll::new();
            for i in 0..n {
                h.add_bytes(&ipv4(i));
                h.add_bytes(&ipv4(i)); // duplicates change nothing
            }
            let est = h.estimate();
            let tol = (f64::from(n) * 0.03).max(1.0);
            assert!((est as f64 - f64::from(n)).abs() <= tol, "n={n} est={est}");
            let bytes = h.to_bytes();
            let back = Hll::from_bytes(&bytes).unwrap();
            assert_eq!(back, h);
            assert_eq!(back.estimate(), est);
            if n <= 1000 {
                assert!(matches!(h.repr, Repr::Sparse(_)));
                assert_eq!(bytes[0], 0x13, "n={n}: SPARSE");
                assert!(bytes.len() <= 3 + (n as usize * 19).div_ceil(8));
            }
        }
        assert_eq!(Hll::new().estimate(), 0);
        assert_eq!(Hll::new().to_bytes(), [0x11, 0x8e, 0x7f]);
        assert_eq!(Hll::from_bytes(&[0x11, 0x8e, 0x7f]).unwrap(), Hll::new());
    }

    #[test]
    fn merge_mixes_forms() {
        let mut small = Hll::new();
        let mut big = Hll::new();
        let mut all = Hll::new();
        for i in 0..100 {
            small.add_bytes(&ipv4(i));
            all.add_bytes(&ipv4(i));
        }
        for i in 50..10_000 {
            big.add_bytes(&ipv4(i));
            all.add_bytes(&ipv4(i));
        }
        let mut x = small.clone();
        x.merge(&big);
        let mut y = big.clone();
        y.merge(&small);
        assert_eq!(x, all);
        assert_eq!(y, all);
        let mut e = Hll::new();
        e.merge(&Hll::new());
        assert!(e.is_empty());
    }

    #[test]
    fn explicit_values_from_postgresql_are_read() {
        // `hll_empty() || 42::hll_hashval` in the header of hll(14,5).
        let mut bytes = vec![0x12, 0x8e, 0x7f];
        bytes.extend_from_slice(&((1u64 << 20) | 3).to_be_bytes());
        let h = Hll::from_bytes(&bytes).unwrap();
        let mut want = Hll::new();
        want.add_hash((1 << 20) | 3);
        assert_eq!(h, want);
    }

    #[test]
    fn malformed_input_is_an_error() {
        let good = {
            let mut h = Hll::new();
            for i in 0..10 {
                h.add_bytes(&ipv4(i));
            }
            h.to_bytes()
        };
        let bad: Vec<Vec<u8>> = vec![
            vec![],
            vec![0x14],
            vec![0x14, 0x8e],
            vec![0x24, 0x8e, 0x7f],             // schema 2
            vec![0x14, 0x8b, 0x7f],             // log2m 11
            vec![0x14, 0x8e, 0x7f, 0, 0],       // FULL, short
            vec![0x11, 0x8e, 0x7f, 0],          // EMPTY with data
            vec![0x12, 0x8e, 0x7f, 1, 2, 3],    // EXPLICIT, not 8-byte words
            vec![0x13, 0x8e, 0x7f, 0xff],       // SPARSE, not one word
            vec![0x13, 0x8e, 0x7f, 1, 2, 3, 4], // SPARSE, 13 bits of padding
            vec![0x15, 0x8e, 0x7f],             // unknown type
            good[..good.len() - 1].to_vec(),
        ];
        for b in bad {
            assert!(Hll::from_bytes(&b).is_err(), "{b:x?}");
        }
        // Every prefix and every single-byte corruption either parses or
        // errors; none panics.
        for i in 0..good.len() {
            let _ = Hll::from_bytes(&good[..i]);
            let mut c = good.clone();
            c[i] ^= 0xa5;
            let _ = Hll::from_bytes(&c);
        }
    }
}
