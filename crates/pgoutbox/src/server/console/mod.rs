//! The operator console: a JSON API and a web page on the relay's observability listener, for
//! "is anything stuck, where, why" and for fixing it without a shell on the box.
//!
//! The API is a thin layer over the library the CLI uses: [`crate::server::gauges`] and
//! [`crate::store::destinations`] for the overview and pause/resume, [`crate::store::dead`] for
//! retry and discard, [`crate::store::inspect`] for finding events, [`crate::store::operators`]
//! for the audit log and the shared chart, [`crate::store::replays`] and [`crate::route::dry_run`]
//! for replays (`replays.rs`), [`crate::definitions`] for the destinations managed at runtime
//! (`destinations.rs`). Every parameter is checked by name in `input.rs`, so bad input is
//! a 4xx naming it and never reaches a statement. The page (`page/`: HTML, CSS and plain
//! JavaScript: `app.js`, `dead.js` for the dead letters view, `replays.js` for the Replays view,
//! `destinations.js` for the Destinations view) is compiled into the binary, so nothing is
//! fetched from a network at run time.
//!
//! Security: the listener is wherever `observability.listen` says (the examples bind 127.0.0.1;
//! beyond loopback the relay needs a read token or `admin.open_reads`). Every mutating call needs
//! a token whose role is `operate` (`admin.token`, or `[[admin.tokens]]`) as a bearer token in
//! the `Authorization` header (a header, not a cookie, so another site cannot make the browser
//! send it); with none configured the mutating endpoints answer 403 and the page says changes are
//! off. With a token whose role is `read` (`admin.read_token`), reads need a token too. Tokens
//! are compared as SHA-256 digests in constant time; the audit log records changes under the
//! token's name. Requests naming another `Host` are refused (DNS rebinding), every answer says
//! `Cache-Control: no-store`. Settings and targets are shown without secrets, credentials,
//! paths or queries, and payloads are rendered by the page as text, never as HTML.

mod api;
mod destinations;
mod input;
mod replays;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{AdminConfig, Role};
use crate::engine::RelayView;
use crate::server::Samples;

/// What the console's handlers share.
#[derive(Clone)]
pub struct Console {
    relay: RelayView,
    samples: Arc<Samples>,
    /// Every token: its holder's name, its role and its SHA-256 digest.
    tokens: Arc<Vec<(String, Role, [u8; 32])>>,
    /// Whether reads need a token (some token may only read).
    reads_need_token: bool,
    /// Lower-case `Host` names answered (`None`: any).
    hosts: Option<Arc<Vec<String>>>,
    /// The destinations managed at runtime (`None`: the relay manages none; their routes 404).
    catalog: Option<Arc<crate::definitions::Catalog>>,
}

impl Console {
    /// A console over `relay`, charting `samples`, guarded by `config`'s tokens and `Host` names
    /// (by default the relay's listen address and the loopback names).
    pub fn new(relay: impl Into<RelayView>, samples: Arc<Samples>, config: &AdminConfig) -> Self {
        let relay = relay.into();
        let hosts = if config.allowed_hosts.iter().any(|h| h == "*") {
            None
        } else {
            let mut hosts: Vec<String> = if config.allowed_hosts.is_empty() {
                ["localhost", "127.0.0.1", "::1"].map(String::from).to_vec()
            } else {
                config.allowed_hosts.clone()
            };
            if let Some(addr) = relay.config().observability.listen {
                hosts.push(addr.ip().to_string());
            }
            Some(Arc::new(
                hosts
                    .iter()
                    .map(|h| h.trim_matches(['[', ']']).to_ascii_lowercase())
                    .collect(),
            ))
        };
        let tokens = config
            .all_tokens()
            .into_iter()
            .map(|t| (t.name, t.role, digest(t.token.expose())))
            .collect();
        Self {
            relay,
            samples,
            tokens: Arc::new(tokens),
            reads_need_token: config.reads_need_token(),
            hosts,
            catalog: None,
        }
    }

    /// This console with the destinations API over `catalog`.
    pub fn with_catalog(mut self, catalog: crate::definitions::Catalog) -> Self {
        self.catalog = Some(Arc::new(catalog));
        self
    }

    /// Whether a request's `Host` header names this console (any port). A request without one
    /// (HTTP/1.0) is not from a browser page and passes.
    fn host_allowed(&self, headers: &HeaderMap) -> bool {
        let Some(hosts) = &self.hosts else {
            return true;
        };
        let Some(host) = headers.get(header::HOST) else {
            return true;
        };
        let Ok(authority) = host.to_str().map(str::to_ascii_lowercase) else {
            return false;
        };
        let name = match authority.strip_prefix('[') {
            Some(v6) => v6.split(']').next().unwrap_or_default(),
            None => authority.split(':').next().unwrap_or_default(),
        };
        hosts.iter().any(|h| h == name)
    }

    /// Whether retry, discard, pause, resume and replays are on (a token may operate).
    pub fn mutations_enabled(&self) -> bool {
        self.tokens
            .iter()
            .any(|(_, role, _)| *role == Role::Operate)
    }

    /// Checks the request's bearer token for a read (`write = false`) or a change; returns who
    /// is calling (the token's name; `anonymous` for an open read).
    fn authorize(&self, headers: &HeaderMap, write: bool) -> Result<String, ApiError> {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        // Digests of equal length, compared in constant time, every token compared: neither a
        // token's bytes nor its length nor its place show in how long a wrong guess takes.
        let holder = given.and_then(|g| {
            let given = digest(g);
            self.tokens.iter().fold(None, |found, (name, role, d)| {
                if bool::from(d.ct_eq(&given)) {
                    Some((name, *role))
                } else {
                    found
                }
            })
        });
        if write {
            if !self.mutations_enabled() {
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "changes are off: this relay has no token that may operate (admin.token, or role = \"operate\" in [[admin.tokens]])",
                ));
            }
            return match holder {
                Some((name, Role::Operate)) => Ok(name.clone()),
                Some((name, Role::Read)) => Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!("the token of {name:?} may only read"),
                )),
                None => Err(unauthorized(given.is_some())),
            };
        }
        match holder {
            Some((name, _)) => Ok(name.clone()),
            None if !self.reads_need_token => Ok("anonymous".into()),
            None => Err(unauthorized(given.is_some())),
        }
    }
}

/// A token's SHA-256 digest.
fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
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

/// An API failure: its status and one sentence, sent as `{"error": "..."}`; a server fault also
/// carries the id under which the relay logged its cause.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    id: Option<String>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            id: None,
        }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

/// A fault of the server (the database unreachable, a bug): logged with an id, answered with the
/// id and no detail (the database's text says nothing useful to a caller and may say too much).
impl From<crate::Error> for ApiError {
    fn from(e: crate::Error) -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        tracing::error!(%id, error = %crate::error_chain(&e), "console: a call failed");
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("the relay could not answer (its log has the cause under id {id})"),
            id: Some(id),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = match self.id {
            Some(id) => serde_json::json!({ "error": self.message, "id": id }),
            None => serde_json::json!({ "error": self.message }),
        };
        (self.status, axum::Json(body)).into_response()
    }
}

/// Every answer of the console's routes: `Cache-Control: no-store` (events and tokens must not
/// stay in a browser's or a proxy's cache), and a refusal for a `Host` this console does not
/// answer to.
async fn guard(State(c): State<Console>, request: Request, next: Next) -> Response {
    let mut response = if c.host_allowed(request.headers()) {
        next.run(request).await
    } else {
        ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "host: this console does not answer to that name (admin.allowed_hosts)",
        )
        .into_response()
    };
    no_store(response.headers_mut());
    response
}

/// Unknown paths and methods: the API's JSON error, not an empty answer.
async fn not_found(uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("path: no such endpoint: {}", uri.path()),
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method: this endpoint does not take that method (see /api/openapi.json)",
    )
}

fn no_store(headers: &mut HeaderMap) {
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}

/// The page, its assets and the OpenAPI document, as compiled in.
const INDEX_HTML: &str = include_str!("page/index.html");
const APP_JS: &str = include_str!("page/app.js");
const DEAD_JS: &str = include_str!("page/dead.js");
const REPLAYS_JS: &str = include_str!("page/replays.js");
const DESTINATIONS_JS: &str = include_str!("page/destinations.js");
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
            "/console/dead.js",
            get(|| async { asset("text/javascript; charset=utf-8", DEAD_JS) }),
        )
        .route(
            "/console/replays.js",
            get(|| async { asset("text/javascript; charset=utf-8", REPLAYS_JS) }),
        )
        .route(
            "/console/destinations.js",
            get(|| async { asset("text/javascript; charset=utf-8", DESTINATIONS_JS) }),
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
        .route(
            "/api/v1/destinations",
            get(destinations::list).post(destinations::add),
        )
        .route(
            "/api/v1/destinations/:name",
            get(destinations::one)
                .patch(destinations::update)
                .delete(destinations::remove),
        )
        .route("/api/v1/destinations/:name/pause", post(api::pause))
        .route("/api/v1/destinations/:name/resume", post(api::resume))
        .route("/api/v1/audit", get(api::audit_log))
        .route("/api/v1/replays", get(replays::list).post(replays::start))
        .route("/api/v1/replays/:id", get(replays::one))
        .route("/api/v1/replays/:id/pause", post(replays::pause))
        .route("/api/v1/replays/:id/resume", post(replays::resume))
        .route("/api/v1/replays/:id/cancel", post(replays::cancel))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(console.clone(), guard))
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

/// Setting names whose values are secret whatever their form.
const SECRET_WORDS: [&str; 6] = [
    "secret",
    "password",
    "token",
    "credential",
    "private",
    "auth",
];

/// A destination's sink settings as the console shows them: secrets masked (`{ env = … }` and
/// `{ file = … }` values, keys that name a secret, header values, credentials in URLs), the rest
/// as written.
pub fn masked_settings(settings: &toml::Table) -> serde_json::Value {
    fn mask(key: &str, value: &toml::Value, in_headers: bool) -> serde_json::Value {
        let lower = key.to_ascii_lowercase();
        let secret_key = SECRET_WORDS.iter().any(|w| lower.contains(w))
            || lower == "key" && !in_headers
            || lower.ends_with("_key")
            || lower == "sasl_plain_password";
        match value {
            toml::Value::Table(t) if t.contains_key("env") || t.contains_key("file") => {
                "(secret)".into()
            }
            _ if secret_key || in_headers => "***".into(),
            toml::Value::Table(t) => serde_json::Value::Object(
                t.iter()
                    .map(|(k, v)| (k.clone(), mask(k, v, lower == "headers")))
                    .collect(),
            ),
            toml::Value::Array(a) => a.iter().map(|v| mask(key, v, false)).collect(),
            // URLs as the target column shows them: no credentials, and no path or query
            // (webhook paths and query strings often carry tokens).
            toml::Value::String(s) => match url::Url::parse(s) {
                Ok(url) if url.host_str().is_some() => {
                    let user = if url.password().is_some() || !url.username().is_empty() {
                        "***@"
                    } else {
                        ""
                    };
                    let host = url.host_str().unwrap_or_default();
                    let port = url.port().map(|p| format!(":{p}")).unwrap_or_default();
                    let more = if url.path().len() > 1 || url.query().is_some() {
                        "/…"
                    } else {
                        ""
                    };
                    format!("{}://{user}{host}{port}{more}", url.scheme()).into()
                }
                _ => s.clone().into(),
            },
            other => serde_json::to_value(other).unwrap_or(serde_json::Value::Null),
        }
    }
    serde_json::Value::Object(
        settings
            .iter()
            .map(|(k, v)| (k.clone(), mask(k, v, false)))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_shown_with_their_secrets_masked() {
        let settings: toml::Table = toml::from_str(
            r#"
url = "https://user:pw@hooks.example.com/in?token=q"
secret = "whsec_abc"
concurrency = 10
headers = { Authorization = "Bearer x", X-Team = "billing" }
password = { env = "PW" }
tls = { ca_file = "/etc/ca.pem", key_file = "/etc/key.pem" }
servers = ["nats://a:4222", "nats://u:p@b:4222"]
"#,
        )
        .expect("toml");
        let shown = masked_settings(&settings);
        let text = shown.to_string();
        for leak in ["whsec_abc", "Bearer x", ":pw@", "billing", "u:p@"] {
            assert!(!text.contains(leak), "{leak} shown: {text}");
        }
        assert_eq!(shown["concurrency"], 10);
        assert_eq!(shown["password"], "(secret)");
        assert_eq!(shown["tls"]["ca_file"], "/etc/ca.pem");
        assert_eq!(shown["servers"][0], "nats://a:4222");
        assert_eq!(shown["url"], "https://***@hooks.example.com/…");
        assert_eq!(shown["servers"][1], "nats://***@b:4222");
    }

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
