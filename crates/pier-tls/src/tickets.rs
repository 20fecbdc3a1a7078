//! Session ticket keys from files (`[listener.tls] session_ticket_keys`),
//! so that every Pier of a fleet issues tickets the others accept: a
//! session made on one node resumes on any other (nginx's
//! `ssl_session_ticket_key`). Without them each process makes its own
//! random keys (`server::ticketer`), which no other process knows.
//!
//! A key file holds 48 or 80 random bytes, as nginx's do (made by
//! `openssl rand 80`): the first 16 name the key, a ticket's first 16 bytes,
//! and the AES-256-GCM key is SHA-256 of the rest. The first file encrypts;
//! all of them decrypt, so an operator rotates by putting the new file
//! first, the old one second, and reloading every node, then dropping the
//! old one a ticket lifetime later.
//!
//! A ticket: name (16) ‖ nonce (12, random) ‖ AES-256-GCM(state) ‖ tag
//! (16), the name as associated data. rustls's own ticketer makes its keys
//! itself and cannot take them, hence this one.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::digest::{digest, SHA256};
use rustls::server::ProducesTickets;
use std::path::PathBuf;

const NAME_LEN: usize = 16;
const TAG_LEN: usize = 16;
/// Tickets are accepted this long after issue, as rustls's own (6 hours).
const LIFETIME_S: u32 = 6 * 3600;
/// Keys per listener at most: one encrypting and a few old ones.
pub const MAX_KEYS: usize = 16;

struct Key {
    name: [u8; NAME_LEN],
    aead: LessSafeKey,
}

pub struct FileTicketer {
    /// `keys[0]` encrypts; every key decrypts.
    keys: Vec<Key>,
}

impl std::fmt::Debug for FileTicketer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Key names only: never the keys.
        f.debug_struct("FileTicketer")
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl FileTicketer {
    /// The keys of `files`, in order; an unreadable file or one of another
    /// size than 48 or 80 bytes is an error naming it.
    pub fn from_files(files: &[PathBuf]) -> Result<FileTicketer, String> {
        if files.is_empty() || files.len() > MAX_KEYS {
            return Err(format!(
                "session_ticket_keys: 1 to {MAX_KEYS} files, not {}",
                files.len()
            ));
        }
        let mut keys = Vec::with_capacity(files.len());
        for f in files {
            let bytes =
                std::fs::read(f).map_err(|e| format!("session ticket key {}: {e}", f.display()))?;
            keys.push(
                Self::key(&bytes)
                    .map_err(|e| format!("session ticket key {}: {e}", f.display()))?,
            );
        }
        Ok(FileTicketer { keys })
    }

    /// Keys from the bytes of key files (tests, and `from_files`).
    pub fn from_bytes(files: &[&[u8]]) -> Result<FileTicketer, String> {
        let keys = files
            .iter()
            .map(|b| Self::key(b))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err("no session ticket key".into());
        }
        Ok(FileTicketer { keys })
    }

    fn key(bytes: &[u8]) -> Result<Key, String> {
        if bytes.len() != 48 && bytes.len() != 80 {
            return Err(format!(
                "{} bytes; expected 48 or 80 random bytes (openssl rand 80 > FILE)",
                bytes.len()
            ));
        }
        let (name, secret) = bytes.split_at(NAME_LEN);
        let k = digest(&SHA256, secret);
        let unbound = UnboundKey::new(&AES_256_GCM, k.as_ref()).map_err(|e| e.to_string())?;
        let mut n = [0u8; NAME_LEN];
        n.copy_from_slice(name);
        Ok(Key {
            name: n,
            aead: LessSafeKey::new(unbound),
        })
    }
}

impl ProducesTickets for FileTicketer {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        LIFETIME_S
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        let k = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        aws_lc_rs::rand::fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(NAME_LEN + NONCE_LEN + plain.len() + TAG_LEN);
        out.extend_from_slice(&k.name);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plain);
        let mut body = out.split_off(NAME_LEN + NONCE_LEN);
        k.aead
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&k.name),
                &mut body,
            )
            .ok()?;
        out.extend_from_slice(&body);
        Some(out)
    }

    /// Anything a client sends: a ticket of another key, another fleet or
    /// garbage is None (a full handshake), never an error.
    fn decrypt(&self, ticket: &[u8]) -> Option<Vec<u8>> {
        if ticket.len() < NAME_LEN + NONCE_LEN + TAG_LEN {
            return None;
        }
        let (name, rest) = ticket.split_at(NAME_LEN);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let k = self.keys.iter().find(|k| k.name == name)?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = sealed.to_vec();
        let plain_len = k
            .aead
            .open_in_place(nonce, Aad::from(&k.name), &mut buf)
            .ok()?
            .len();
        buf.truncate(plain_len);
        Some(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(seed: u8) -> Vec<u8> {
        (0..80)
            .map(|i| seed.wrapping_mul(31).wrapping_add(i))
            .collect()
    }

    #[test]
    fn nodes_with_one_key_read_each_others_tickets() {
        let (a, b) = (key(1), key(1));
        let node1 = FileTicketer::from_bytes(&[&a]).unwrap();
        let node2 = FileTicketer::from_bytes(&[&b]).unwrap();
        let t = node1.encrypt(b"session state").unwrap();
        assert_eq!(node2.decrypt(&t).as_deref(), Some(&b"session state"[..]));
        // Random nonces: the same state never makes the same ticket.
        assert_ne!(node1.encrypt(b"session state").unwrap(), t);
    }

    #[test]
    fn rotation_old_keys_decrypt_only_the_first_encrypts() {
        let (old, new) = (key(1), key(2));
        let before = FileTicketer::from_bytes(&[&old]).unwrap();
        let during = FileTicketer::from_bytes(&[&new, &old]).unwrap();
        let after = FileTicketer::from_bytes(&[&new]).unwrap();
        let t_old = before.encrypt(b"s").unwrap();
        assert_eq!(during.decrypt(&t_old).as_deref(), Some(&b"s"[..]));
        let t_new = during.encrypt(b"s").unwrap();
        assert_eq!(&t_new[..16], &new[..16], "named by the first key");
        assert_eq!(after.decrypt(&t_new).as_deref(), Some(&b"s"[..]));
        assert_eq!(after.decrypt(&t_old), None, "the old key is gone");
    }

    #[test]
    fn hostile_tickets_are_refused_quietly() {
        let k = key(3);
        let t = FileTicketer::from_bytes(&[&k]).unwrap();
        let good = t.encrypt(b"state").unwrap();
        for n in 0..good.len() {
            assert_eq!(t.decrypt(&good[..n]), None, "truncated to {n}");
        }
        let mut flipped = good.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(t.decrypt(&flipped), None);
        let mut renamed = good.clone();
        renamed[0] ^= 1;
        assert_eq!(t.decrypt(&renamed), None);
        assert_eq!(t.decrypt(&[0u8; 4096]), None);
    }

    #[test]
    fn key_files_of_the_wrong_size_are_refused() {
        assert!(FileTicketer::from_bytes(&[&[0u8; 32]]).is_err());
        assert!(FileTicketer::from_bytes(&[&[0u8; 48]]).is_ok());
        assert!(FileTicketer::from_bytes(&[]).is_err());
        let e = FileTicketer::from_files(&["/nonexistent/ticket.key".into()]).unwrap_err();
        assert!(e.contains("/nonexistent/ticket.key"), "{e}");
    }
}
