//! An `axum` extractor that verifies Standard Webhooks signatures (feature `axum`).
//!
//! Handlers take a [`VerifiedWebhook`]; the secrets and the tolerance come from a
//! [`WebhookVerifier`] installed as a request extension, so the extractor works with any router
//! state. A request that does not verify never reaches the handler: it is answered `401` with a
//! one-line reason (`webhook verification failed: no matching signature`).
//!
//! ```no_run
//! use axum::{routing::post, Extension, Router};
//! use pgoutbox_core::webhook::axum::{VerifiedWebhook, WebhookVerifier};
//!
//! async fn events(hook: VerifiedWebhook) -> &'static str {
//!     // hook.id is the event id: dedupe on it (see pgoutbox_core::inbox).
//!     let _envelope: serde_json::Value = serde_json::from_slice(&hook.body).unwrap_or_default();
//!     "ok"
//! }
//!
//! # fn f() -> Result<(), pgoutbox_core::webhook::WebhookError> {
//! let verifier = WebhookVerifier::new(["whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"])?;
//! let app: Router = Router::new().route("/events", post(events)).layer(Extension(verifier));
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::async_trait;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{decode_secret, verify, SignedHeaders, WebhookError, DEFAULT_TOLERANCE};

/// The secrets (several during rotation) and the timestamp tolerance a receiver accepts.
#[derive(Clone, Debug)]
pub struct WebhookVerifier {
    secrets: Arc<[String]>,
    tolerance: Duration,
}

impl WebhookVerifier {
    /// A verifier accepting a signature by any of `secrets` (`whsec_…`), with the default
    /// tolerance of 5 minutes. Fails if a secret is not valid, so a typo shows at start-up.
    pub fn new<I, S>(secrets: I) -> Result<Self, WebhookError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let secrets: Vec<String> = secrets.into_iter().map(Into::into).collect();
        if secrets.is_empty() {
            return Err(WebhookError::InvalidSecret);
        }
        for s in &secrets {
            decode_secret(s)?;
        }
        Ok(Self {
            secrets: secrets.into(),
            tolerance: DEFAULT_TOLERANCE,
        })
    }

    /// Sets the largest accepted difference between the message's timestamp and the clock.
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Verifies one request's headers and body.
    pub fn verify(&self, headers: &SignedHeaders<'_>, body: &[u8]) -> Result<(), WebhookError> {
        let secrets: Vec<&str> = self.secrets.iter().map(String::as_str).collect();
        verify(&secrets, headers, body, self.tolerance)
    }
}

/// A webhook request whose signature verified: its id, timestamp and raw body.
#[derive(Clone, Debug)]
pub struct VerifiedWebhook {
    /// `webhook-id`: the event id, stable across retries (dedupe on it).
    pub id: String,
    /// `webhook-timestamp`, Unix seconds.
    pub timestamp: i64,
    /// The body exactly as signed.
    pub body: Bytes,
}

/// Why a request was refused by [`VerifiedWebhook`].
#[derive(Debug)]
pub enum WebhookRejection {
    /// The signature, a header or the timestamp did not verify: `401`.
    Unverified(WebhookError),
    /// The body could not be read (too large, connection error): its own status.
    Body(Response),
    /// No [`WebhookVerifier`] extension is installed on the route: `500`, a set-up mistake.
    NotConfigured,
}

impl IntoResponse for WebhookRejection {
    fn into_response(self) -> Response {
        match self {
            Self::Unverified(e) => (
                StatusCode::UNAUTHORIZED,
                format!("webhook verification failed: {e}"),
            )
                .into_response(),
            Self::Body(r) => r,
            Self::NotConfigured => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "webhook verification is not configured: add .layer(Extension(WebhookVerifier))",
            )
                .into_response(),
        }
    }
}

#[async_trait]
impl<S: Send + Sync> FromRequest<S> for VerifiedWebhook {
    type Rejection = WebhookRejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let verifier = req
            .extensions()
            .get::<WebhookVerifier>()
            .cloned()
            .ok_or(WebhookRejection::NotConfigured)?;
        let headers = req.headers().clone();
        let body = Bytes::from_request(req, state)
            .await
            .map_err(|e| WebhookRejection::Body(e.into_response()))?;
        let signed = SignedHeaders::from_lookup(|name| headers.get(name)?.to_str().ok())
            .map_err(WebhookRejection::Unverified)?;
        verifier
            .verify(&signed, &body)
            .map_err(WebhookRejection::Unverified)?;
        let timestamp = signed
            .timestamp
            .trim()
            .parse()
            .map_err(|_| WebhookRejection::Unverified(WebhookError::InvalidTimestamp))?;
        Ok(Self {
            id: signed.id.to_owned(),
            timestamp,
            body,
        })
    }
}
