//! Minimal WebSocket (RFC 6455) pieces shared by the origin and the test clients:
//! the handshake accept key and frame encode/decode.

use base64::Engine as _;
use sha1::{Digest, Sha1};

/// The GUID every server appends to the client's key (RFC 6455 section 1.3).
const WS_GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

pub const OP_CONTINUATION: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xA;

/// `Sec-WebSocket-Accept` for a given `Sec-WebSocket-Key`.
pub fn accept_key(key: &str) -> String {
    let mut h = Sha1::new();
    h.update(key.trim().as_bytes());
    h.update(WS_GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.finalize())
}

/// One decoded frame (payload already unmasked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub fin: bool,
    pub opcode: u8,
    pub masked: bool,
    pub payload: Vec<u8>,
}

/// Encodes a frame; clients must pass a mask, servers must not.
pub fn encode_frame(fin: bool, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(payload.len() + 14);
    out.push(if fin { 0x80 } else { 0 } | (opcode & 0x0f));
    let mask_bit = if mask.is_some() { 0x80 } else { 0 };
    let len = payload.len();
    if len < 126 {
        out.push(mask_bit | len as u8);
    } else if len <= u16::MAX as usize {
        out.push(mask_bit | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(mask_bit | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    match mask {
        Some(m) => {
            out.extend_from_slice(&m);
            out.extend(payload.iter().enumerate().map(|(i, b)| b ^ m[i % 4]));
        }
        None => out.extend_from_slice(payload),
    }
    out
}

/// Decodes one frame from the front of `buf`: `Ok(None)` when more bytes are needed,
/// otherwise the frame and how many bytes it used.
pub fn decode_frame(buf: &[u8], max_payload: usize) -> Result<Option<(Frame, usize)>, String> {
    if buf.len() < 2 {
        return Ok(None);
    }
    let fin = buf[0] & 0x80 != 0;
    if buf[0] & 0x70 != 0 {
        return Err("reserved bits set".into());
    }
    let opcode = buf[0] & 0x0f;
    let masked = buf[1] & 0x80 != 0;
    let mut pos = 2;
    let len = match buf[1] & 0x7f {
        126 => {
            if buf.len() < 4 {
                return Ok(None);
            }
            pos = 4;
            u16::from_be_bytes([buf[2], buf[3]]) as u64
        }
        127 => {
            if buf.len() < 10 {
                return Ok(None);
            }
            pos = 10;
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[2..10]);
            u64::from_be_bytes(b)
        }
        n => n as u64,
    };
    if len > max_payload as u64 {
        return Err(format!("frame payload of {len} bytes is over the limit"));
    }
    let mut mask = [0u8; 4];
    if masked {
        if buf.len() < pos + 4 {
            return Ok(None);
        }
        mask.copy_from_slice(&buf[pos..pos + 4]);
        pos += 4;
    }
    let end = pos + len as usize;
    if buf.len() < end {
        return Ok(None);
    }
    let payload = if masked {
        buf[pos..end]
            .iter()
            .enumerate()
            .map(|(i, b)| b ^ mask[i % 4])
            .collect()
    } else {
        buf[pos..end].to_vec()
    };
    Ok(Some((
        Frame {
            fin,
            opcode,
            masked,
            payload,
        },
        end,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_example_accept_key() {
        // RFC 6455 section 1.3.
        assert_eq!(
            accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn frames_round_trip_all_length_forms() {
        for len in [0usize, 5, 125, 126, 300, 65535, 65536, 70000] {
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            for mask in [None, Some([1, 2, 3, 4])] {
                let enc = encode_frame(true, OP_BINARY, &payload, mask);
                assert_eq!(decode_frame(&enc[..enc.len() - 1], 1 << 20).unwrap(), None);
                let (f, used) = decode_frame(&enc, 1 << 20).unwrap().unwrap();
                assert_eq!(used, enc.len());
                assert_eq!(f.payload, payload);
                assert_eq!(f.masked, mask.is_some());
                assert!(f.fin);
            }
        }
    }

    #[test]
    fn rfc_masked_hello() {
        // RFC 6455 section 5.7: a single-frame masked text message "Hello".
        let wire = [
            0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58,
        ];
        let (f, _) = decode_frame(&wire, 100).unwrap().unwrap();
        assert_eq!(f.payload, b"Hello");
        assert_eq!(
            encode_frame(true, OP_TEXT, b"Hello", Some([0x37, 0xfa, 0x21, 0x3d])),
            wire
        );
    }
}
