//! The operator console: a JSON API and a web page on the relay's observability listener, for
//! "is anything stuck, where, why" and for fixing it without a shell on the box.
//!
//! The API is a thin layer over the library the CLI uses: [`crate::server::backlog`] and
//! [`crate::breaker`] for the overview and pause/resume, [`crate::store::dead`] for retry and
//! discard, [`crate::store::inspect`] for finding events. The page (`page/`: HTML, CSS and plain
//! JavaScript) is compiled into the binary, so nothing is fetched from a network at run time.
//!
//! Security: the listener is wherever `observability.listen` says (the examples bind 127.0.0.1).
//! Every mutating call needs `admin.token` as a bearer token in the `Authorization` header (a
//! header, not a cookie, so another site cannot make the browser send it); with no token
//! configured the mutating endpoints answer 403 and the page says changes are off. With
//! `admin.read_token` set, reads need it (or the admin token) too. Destination targets are shown
//! without credentials or paths, and payloads are rendered by the page as text, never as HTML.

mod api;

use std::sync::Arc;

use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use subtle::ConstantTimeEq;

use crate::config::{AdminConfig, Secret};
use crate::engine::Relay;
use crate::server::Samples;

/// What the console's handlers share.
#[derive(Clone)]
pub struct Console {
    relay: Arc<Relay>,
    samples: Arc<Samples>,
    token: Option<Secret>,
    read_token: Option<Secret>,
}

impl Console {
    /// A console over `relay`, charting `samples`, guarded by `config`'s tokens.
    pub fn new(relay: Arc<Relay>, samples: Arc<Samples>, config: &AdminConfig) -> Self {
        Self {
            relay,
            samples,
            token: config.token.clone(),
            read_token: config.read_token.clone(),
        }
    }

    /// Whether retry, discard, pause and resume are on (an admin token is configured).
    pub fn mutations_enabled(&self) -> bool {
        self.token.is_some()
    }

    /// Checks the request's bearer token for a read (`write = false`) or a change.
    fn authorize(&self, headers: &HeaderMap, write: bool) -> Result<(), ApiError> {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let matches = |secret: &Option<Secret>| match (secret, given) {
            (Some(s), Some(g)) => bool::from(s.expose().as_bytes().ct_eq(g.as_bytes())),
            _ => false,
        };
        if write {
            if self.token.is_none() {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "changes are off: this relay has no admin token configured (admin.token)",
                ));
            }
            if !matches(&self.token) {
                return Err(unauthorized(given.is_some()));
            }
            return Ok(());
        }
        if self.read_token.is_some() && !matches(&self.read_token) && !matches(&self.token) {
            return Err(unauthorized(given.is_some()));
        }
        Ok(())
    }
}

fn unauthorized(given: bool) -> ApiError {
    ApiError::new(
        StatusCode::UNAUTHORIZED,
        if given {
            "wrong token"
        } else {
            "a bearer token is required (Authorization: Bearer <token>)"
        },
    )
}

/// An API failure: its status and one sentence, sent as `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<crate::Error> for ApiError {
    fn from(e: crate::Error) -> Self {
        tracing::warn!(error = %crate::error_chain(&e), "console: a database call failed");
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("database error: {}", crate::error_chain(&e)),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            axum::Json(serde_json::json!({ "error": self.message })),
        )
            .into_response();
        no_store(response.headers_mut());
        response
    }
}

fn no_store(headers: &mut HeaderMap) {
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

/// The page, its assets and the OpenAPI document, as compiled in.
const INDEX_HTML: &str = include_str!("page/index.html");
const APP_JS: &str = include_str!("page/app.js");
const APP_CSS: &str = include_str!("page/app.css");
const OPENAPI: &str = include_str!("openapi.json");

/// Only our own scripts and styles run: data that slipped into markup could not execute.
const CSP: &str = "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// The console's routes: the page at `/` and `/console`, the API under `/api/v1`, the OpenAPI
/// document at `/api/openapi.json`.
pub fn router(console: Console) -> axum::Router {
    let page = || get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) });
    axum::Router::new()
        .route("/", page())
        .route("/console", page())
        .route(
            "/console/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/console/app.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
        .route(
            "/api/openapi.json",
            get(|| async { asset("application/json", OPENAPI) }),
        )
        .route("/api/v1/overview", get(api::overview))
        .route("/api/v1/samples", get(api::samples))
        .route("/api/v1/events", get(api::events))
        .route("/api/v1/events/:id", get(api::event))
        .route("/api/v1/dead/retry", post(api::dead_retry))
        .route("/api/v1/dead/discard", post(api::dead_discard))
        .route("/api/v1/destinations/:name/pause", post(api::pause))
        .route("/api/v1/destinations/:name/resume", post(api::resume))
        .with_state(console)
}

/// Where a destination sends, without anything secret: `scheme://host[:port]` of a URL (no
/// user, password, path or query: webhook paths often carry tokens), broker lists as written
/// unless they hold credentials, `(secret)` for a value read from the environment or a file.
pub fn redacted_target(settings: &toml::Table) -> Option<String> {
    let value = ["url", "brokers", "servers", "endpoint"]
        .iter()
        .find_map(|k| settings.get(*k))?;
    let text = match value {
        toml::Value::String(s) => s,
        _ => return Some("(secret)".into()),
    };
    if let Ok(url) = url::Url::parse(text) {
        if let Some(host) = url.host_str() {
            let port = url.port().map(|p| format!(":{p}")).unwrap_or_default();
            let more = if url.path().len() > 1 || url.query().is_some() {
                "/…"
            } else {
                ""
            };
            return Some(format!("{}://{host}{port}{more}", url.scheme()));
        }
    }
    if text.contains('@') || text.contains('?') {
        return Some("(redacted)".into());
    }
    Some(text.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(url: &str) -> Option<String> {
        let mut t = toml::Table::new();
        t.insert("url".into(), toml::Value::String(url.into()));
        redacted_target(&t)
    }

    #[test]
    fn targets_lose_credentials_paths_and_queries() {
        assert_eq!(
            target("https://user:pw@hooks.example.com/services/T0/B0/XYZ?k=1").as_deref(),
            Some("https://hooks.example.com/…")
        );
        assert_eq!(
            target("redis://:pw@127.0.0.1:6379").as_deref(),
            Some("redis://127.0.0.1:6379")
        );
        let mut t = toml::Table::new();
        t.insert(
            "brokers".into(),
            toml::Value::String("k1:9092,k2:9092".into()),
        );
        assert_eq!(redacted_target(&t).as_deref(), Some("k1:9092,k2:9092"));
        let mut env = toml::Table::new();
        env.insert("env".into(), toml::Value::String("URL".into()));
        let mut t = toml::Table::new();
        t.insert("url".into(), toml::Value::Table(env));
        assert_eq!(redacted_target(&t).as_deref(), Some("(secret)"));
    }
}
