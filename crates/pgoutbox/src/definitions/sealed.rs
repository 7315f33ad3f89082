//! Sealed secrets: a definition's secret keys encrypted with XChaCha20-Poly1305 under a key every
//! relay gets from its environment (`PGOUTBOX_SECRETS_KEY`, 32 bytes in base64). The destination's
//! table and name are the associated data, so a sealed value copied to another row does not open.

use base64::Engine as _;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::XChaCha20Poly1305;

use super::DefinitionError;

/// The environment variable that holds the key.
pub const KEY_VAR: &str = "PGOUTBOX_SECRETS_KEY";

/// The first byte of a sealed value: how it was sealed (a later scheme gets another).
const SCHEME: u8 = 1;

/// A nonce's length (XChaCha20: 24 bytes, random per seal).
const NONCE_LEN: usize = 24;

/// The key secrets are sealed with.
#[derive(Clone)]
pub struct Key(chacha20poly1305::Key);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(***)")
    }
}

impl Key {
    /// The key in `text`: 32 bytes in standard base64.
    pub fn parse(text: &str) -> Result<Self, DefinitionError> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(text.trim())
            .map_err(|_| DefinitionError::BadKey)?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| DefinitionError::BadKey)?;
        Ok(Self(bytes.into()))
    }

    /// The key in the environment, if it is set (a set but malformed key is an error).
    pub fn from_env() -> Result<Option<Self>, DefinitionError> {
        match std::env::var(KEY_VAR) {
            Ok(text) if !text.trim().is_empty() => Self::parse(&text).map(Some),
            _ => Ok(None),
        }
    }

    /// A new random key, in base64: what `pgoutbox destinations key` prints.
    pub fn generate() -> String {
        let key = XChaCha20Poly1305::generate_key(&mut OsRng);
        base64::engine::general_purpose::STANDARD.encode(key)
    }

    /// `secrets` sealed for the destination `name` of `table`.
    pub fn seal(
        &self,
        table: &str,
        name: &str,
        secrets: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u8>, DefinitionError> {
        let plain = serde_json::to_vec(secrets).map_err(|_| DefinitionError::Unsealable)?;
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = associated(table, name);
        let sealed = XChaCha20Poly1305::new(&self.0)
            .encrypt(
                &nonce,
                Payload {
                    msg: &plain,
                    aad: &aad,
                },
            )
            .map_err(|_| DefinitionError::Unsealable)?;
        let mut out = Vec::with_capacity(1 + NONCE_LEN + sealed.len());
        out.push(SCHEME);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(out)
    }

    /// The secrets sealed in `sealed` for the destination `name` of `table`.
    pub fn open(
        &self,
        table: &str,
        name: &str,
        sealed: &[u8],
    ) -> Result<serde_json::Map<String, serde_json::Value>, DefinitionError> {
        let wrong = || DefinitionError::WrongKey(name.to_owned());
        let (&scheme, rest) = sealed.split_first().ok_or_else(wrong)?;
        if scheme != SCHEME || rest.len() < NONCE_LEN {
            return Err(wrong());
        }
        let (nonce, ciphertext) = rest.split_at(NONCE_LEN);
        let aad = associated(table, name);
        let plain = XChaCha20Poly1305::new(&self.0)
            .decrypt(
                chacha20poly1305::XNonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad: &aad,
                },
            )
            .map_err(|_| wrong())?;
        serde_json::from_slice(&plain).map_err(|_| wrong())
    }
}

/// What binds a sealed value to its row.
fn associated(table: &str, name: &str) -> Vec<u8> {
    format!("pgoutbox-definition\0{table}\0{name}").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> Key {
        Key::parse(&Key::generate()).expect("a generated key parses")
    }

    #[test]
    fn sealed_secrets_open_only_with_their_key_and_row() {
        let k = key();
        let mut secrets = serde_json::Map::new();
        secrets.insert("secret".into(), "whsec_abc".into());
        let sealed = k.seal("public.outbox", "a", &secrets).expect("sealed");
        assert!(!String::from_utf8_lossy(&sealed).contains("whsec_abc"));
        assert_eq!(
            k.open("public.outbox", "a", &sealed).expect("opens"),
            secrets
        );
        for (table, name, key) in [
            ("public.outbox", "b", k.clone()),
            ("public.other", "a", k.clone()),
            ("public.outbox", "a", key()),
        ] {
            assert!(matches!(
                key.open(table, name, &sealed),
                Err(DefinitionError::WrongKey(_))
            ));
        }
        assert!(k.open("public.outbox", "a", &[]).is_err());
        assert!(k.open("public.outbox", "a", &sealed[..10]).is_err());
    }

    #[test]
    fn a_key_is_32_bytes_in_base64() {
        assert!(Key::parse("c2hvcnQ=").is_err());
        assert!(Key::parse("not base64 at all!").is_err());
        assert!(Key::parse(&Key::generate()).is_ok());
        assert_eq!(format!("{:?}", key()), "Key(***)");
    }
}
