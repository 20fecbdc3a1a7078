//! Byte encoding shared by the sketches' `to_bytes`/`from_bytes`: LEB128
//! varints and a bounds-checked reader, so malformed input is an error and
//! never a panic.

use std::fmt;

/// A blob that could not be decoded (truncated, corrupt, or from an
/// incompatible version).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeError(pub(crate) &'static str);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed analytics blob: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

pub(crate) fn put_u64(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Appends `bytes` preceded by its length.
pub(crate) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    put_u64(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn u8(&mut self) -> Result<u8, DecodeError> {
        let b = *self.buf.get(self.pos).ok_or(DecodeError("truncated"))?;
        self.pos += 1;
        Ok(b)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            // The tenth byte may only carry the top bit of a u64.
            if shift == 63 && bits > 1 {
                return Err(DecodeError("varint overflow"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError("varint too long"))
    }

    /// A varint that must fit a `usize` no larger than `max` (lengths and
    /// counts, so that a corrupt length cannot make us allocate gigabytes).
    pub(crate) fn len(&mut self, max: usize) -> Result<usize, DecodeError> {
        let v = self.u64()?;
        if v > max as u64 {
            return Err(DecodeError("length out of range"));
        }
        Ok(v as usize)
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError("truncated"))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or(DecodeError("truncated"))?;
        self.pos = end;
        Ok(s)
    }

    /// A length-prefixed byte string written by [`put_bytes`].
    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.len(self.buf.len())?;
        self.take(n)
    }

    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(DecodeError("trailing bytes"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_reject_garbage() {
        let values = [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX];
        let mut buf = Vec::new();
        for v in values {
            put_u64(&mut buf, v);
        }
        let mut r = Reader::new(&buf);
        for v in values {
            assert_eq!(r.u64().unwrap(), v);
        }
        r.finish().unwrap();

        assert!(Reader::new(&[0x80]).u64().is_err());
        assert!(Reader::new(&[0xff; 11]).u64().is_err());
        assert!(
            Reader::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02])
                .u64()
                .is_err()
        );
        assert!(Reader::new(&[5, 1, 2]).bytes().is_err());
    }
}
