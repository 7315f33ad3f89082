//! Standard Webhooks signatures: signing for the webhook sink, verification for receivers.
//!
//! The signed content is `"{id}.{timestamp}.{body}"`, HMAC-SHA256 with the secret's base64-decoded
//! bytes (after the `whsec_` prefix); the header carries `v1,<base64 signature>`, several separated
//! by spaces during secret rotation.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

#[cfg(feature = "axum")]
pub mod axum;

/// Default tolerance between a message's timestamp and the receiver's clock.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// Why a secret or a signature was not accepted.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WebhookError {
    /// The secret is not base64 (after an optional `whsec_` prefix).
    #[error("the signing secret is not valid base64 after its `whsec_` prefix")]
    InvalidSecret,
    /// A required header is missing or not text.
    #[error("missing or unreadable header {0}")]
    MissingHeader(&'static str),
    /// The timestamp header is not a number.
    #[error("webhook-timestamp is not a Unix timestamp")]
    InvalidTimestamp,
    /// The timestamp is outside the tolerance (replay protection).
    #[error("webhook-timestamp is outside the allowed tolerance")]
    TimestampOutOfTolerance,
    /// No signature matched any secret.
    #[error("no matching signature")]
    NoMatchingSignature,
}

/// Decodes a `whsec_…` (or bare base64) secret into its key bytes.
pub fn decode_secret(secret: &str) -> Result<Vec<u8>, WebhookError> {
    let b64 = secret.strip_prefix("whsec_").unwrap_or(secret);
    match BASE64.decode(b64) {
        Ok(key) if !key.is_empty() => Ok(key),
        _ => Err(WebhookError::InvalidSecret),
    }
}

/// The `webhook-signature` value (`v1,<base64>`) for one message, from the decoded key.
pub fn sign(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> String {
    format!("v1,{}", BASE64.encode(mac(key, id, timestamp, body)))
}

fn mac(key: &[u8], id: &str, timestamp: i64, body: &[u8]) -> Vec<u8> {
    // HMAC accepts keys of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("hmac takes any key length"));
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac.finalize().into_bytes().to_vec()
}

/// The three Standard Webhooks headers of a received request.
#[derive(Debug, Clone, Copy)]
pub struct SignedHeaders<'a> {
    /// `webhook-id`.
    pub id: &'a str,
    /// `webhook-timestamp`.
    pub timestamp: &'a str,
    /// `webhook-signature`.
    pub signature: &'a str,
}

impl<'a> SignedHeaders<'a> {
    /// Reads the three headers through a lookup function (any HTTP library's header map).
    pub fn from_lookup(
        get: impl Fn(&'static str) -> Option<&'a str>,
    ) -> Result<Self, WebhookError> {
        Ok(Self {
            id: get("webhook-id").ok_or(WebhookError::MissingHeader("webhook-id"))?,
            timestamp: get("webhook-timestamp")
                .ok_or(WebhookError::MissingHeader("webhook-timestamp"))?,
            signature: get("webhook-signature")
                .ok_or(WebhookError::MissingHeader("webhook-signature"))?,
        })
    }
}

/// Verifies a received webhook against one or more secrets (rotation), with replay tolerance.
pub fn verify(
    secrets: &[&str],
    headers: &SignedHeaders<'_>,
    body: &[u8],
    tolerance: Duration,
) -> Result<(), WebhookError> {
    verify_at(secrets, headers, body, tolerance, SystemTime::now())
}

/// [`verify`] with an explicit clock.
pub fn verify_at(
    secrets: &[&str],
    headers: &SignedHeaders<'_>,
    body: &[u8],
    tolerance: Duration,
    now: SystemTime,
) -> Result<(), WebhookError> {
    let ts: i64 = headers
        .timestamp
        .trim()
        .parse()
        .map_err(|_| WebhookError::InvalidTimestamp)?;
    let now_secs = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    if (now_secs - ts).unsigned_abs() > tolerance.as_secs() {
        return Err(WebhookError::TimestampOutOfTolerance);
    }
    let candidates: Vec<Vec<u8>> = headers
        .signature
        .split_whitespace()
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|b64| BASE64.decode(b64).ok())
        .collect();
    for secret in secrets {
        let key = decode_secret(secret)?;
        let expected = mac(&key, headers.id, ts, body);
        if candidates
            .iter()
            .any(|c| bool::from(c.as_slice().ct_eq(&expected)))
        {
            return Ok(());
        }
    }
    Err(WebhookError::NoMatchingSignature)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    const ID: &str = "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk";
    const TS: i64 = 1649367553;
    const BODY: &[u8] = br#"{"email":"test@example.com","username":"test_user"}"#;
    const EXPECTED: &str = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=";

    fn at_ts() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(TS as u64 + 10)
    }

    fn headers(sig: &str) -> SignedHeaders<'_> {
        SignedHeaders {
            id: ID,
            timestamp: "1649367553",
            signature: sig,
        }
    }

    #[test]
    fn standard_webhooks_test_vector() {
        let key = decode_secret(SECRET).expect("valid secret");
        assert_eq!(sign(&key, ID, TS, BODY), EXPECTED);
        assert_eq!(
            verify_at(
                &[SECRET],
                &headers(EXPECTED),
                BODY,
                DEFAULT_TOLERANCE,
                at_ts()
            ),
            Ok(())
        );
    }

    #[test]
    fn tampered_wrong_secret_expired_and_rotation() {
        let tampered = br#"{"email":"evil@example.com","username":"test_user"}"#;
        assert_eq!(
            verify_at(
                &[SECRET],
                &headers(EXPECTED),
                tampered,
                DEFAULT_TOLERANCE,
                at_ts()
            ),
            Err(WebhookError::NoMatchingSignature)
        );
        let other = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        assert_eq!(
            verify_at(
                &[other],
                &headers(EXPECTED),
                BODY,
                DEFAULT_TOLERANCE,
                at_ts()
            ),
            Err(WebhookError::NoMatchingSignature)
        );
        let late = UNIX_EPOCH + Duration::from_secs(TS as u64 + 301);
        assert_eq!(
            verify_at(&[SECRET], &headers(EXPECTED), BODY, DEFAULT_TOLERANCE, late),
            Err(WebhookError::TimestampOutOfTolerance)
        );
        // Rotation: the new secret is tried too, and several signatures may be sent.
        assert_eq!(
            verify_at(
                &[other, SECRET],
                &headers(EXPECTED),
                BODY,
                DEFAULT_TOLERANCE,
                at_ts()
            ),
            Ok(())
        );
        let both = format!("v1,AAAA {EXPECTED}");
        assert_eq!(
            verify_at(&[SECRET], &headers(&both), BODY, DEFAULT_TOLERANCE, at_ts()),
            Ok(())
        );
        assert_eq!(decode_secret("whsec_!!"), Err(WebhookError::InvalidSecret));
    }
}
