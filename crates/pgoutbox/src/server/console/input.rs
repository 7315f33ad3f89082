//! What the API accepts: extractors that answer a malformed query, path or body with the API's
//! own `{"error": …}` (the framework's answers are plain text), and checks of each parameter that
//! name it, so that nothing the database would refuse (a NUL byte, a time out of its range, an
//! interval that overflows) reaches a statement and comes back as a 5xx.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use uuid::Uuid;

use super::ApiError;

/// The longest text filter accepted (topics, keys and destinations are short names).
const MAX_TEXT: usize = 4096;

/// The longest `since_seconds` accepted: a hundred years.
const MAX_SINCE_SECONDS: f64 = 100.0 * 365.25 * 86_400.0;

/// `axum::extract::Query` answering a malformed query string with a JSON 400.
pub(super) struct Query<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Self(q.0))
            .map_err(|e: QueryRejection| {
                ApiError::bad_request(format!("query string: {}", e.body_text()))
            })
    }
}

/// `axum::extract::Path` answering a malformed path parameter with a JSON 400.
pub(super) struct Path<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Self(p.0))
            .map_err(|e: PathRejection| ApiError::bad_request(format!("path: {}", e.body_text())))
    }
}

/// `axum::Json` answering a body that is not the expected JSON with a JSON 4xx (400 syntax, 415
/// content type, 422 a field of the wrong type, named).
pub(super) struct Body<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        axum::Json::<T>::from_request(req, state)
            .await
            .map(|j| Self(j.0))
            .map_err(|e: JsonRejection| {
                ApiError::new(e.status(), format!("request body: {}", e.body_text()))
            })
    }
}

/// A text filter: `None` when absent or blank; a 400 naming `name` when it holds a NUL byte
/// (PostgreSQL text cannot) or is longer than any name.
pub(super) fn text(name: &str, value: Option<String>) -> Result<Option<String>, ApiError> {
    let Some(value) = value.filter(|s| !s.trim().is_empty()) else {
        return Ok(None);
    };
    if value.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "{name}: contains a NUL byte"
        )));
    }
    if value.len() > MAX_TEXT {
        return Err(ApiError::bad_request(format!(
            "{name}: longer than {MAX_TEXT} bytes"
        )));
    }
    Ok(Some(value))
}

/// An RFC 3339 time, or a 400 naming `name`.
pub(super) fn timestamp(
    name: &str,
    value: Option<String>,
) -> Result<Option<DateTime<Utc>>, ApiError> {
    text(name, value)?
        .map(|s| {
            DateTime::parse_from_rfc3339(s.trim())
                .map(|t| t.with_timezone(&Utc))
                .map_err(|e| ApiError::bad_request(format!("{name}: not an RFC 3339 time: {e}")))
        })
        .transpose()
}

/// A whole number, or a 400 naming `name`.
pub(super) fn integer(name: &str, value: Option<String>) -> Result<Option<i64>, ApiError> {
    text(name, value)?
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|_| ApiError::bad_request(format!("{name}: not a whole number: {s:?}")))
        })
        .transpose()
}

/// `true` or `false` (also `1`/`0`), or a 400 naming `name`; absent is false.
pub(super) fn flag(name: &str, value: Option<String>) -> Result<bool, ApiError> {
    match text(name, value)?.as_deref().map(str::trim) {
        None | Some("false" | "0") => Ok(false),
        Some("true" | "1") => Ok(true),
        Some(other) => Err(ApiError::bad_request(format!(
            "{name}: true or false, not {other:?}"
        ))),
    }
}

/// A JSON object or array to match payloads against, or a 400 naming `name`.
pub(super) fn json_filter(
    name: &str,
    value: Option<String>,
) -> Result<Option<serde_json::Value>, ApiError> {
    text(name, value)?
        .map(|s| match serde_json::from_str::<serde_json::Value>(&s) {
            Ok(v @ (serde_json::Value::Object(_) | serde_json::Value::Array(_))) => {
                if v.to_string().contains("\\u0000") {
                    Err(ApiError::bad_request(format!("{name}: contains a NUL character")))
                } else {
                    Ok(v)
                }
            }
            Ok(_) => Err(ApiError::bad_request(format!(
                "{name}: a JSON object (or array) the payload contains, e.g. {{\"customer\": \"c-1\"}}"
            ))),
            Err(e) => Err(ApiError::bad_request(format!("{name}: not JSON: {e}"))),
        })
        .transpose()
}

/// An event id, or a 400 naming `name`.
pub(super) fn event_id(name: &str, value: &str) -> Result<Uuid, ApiError> {
    id(name, value, "an event id")
}

/// A replay id, or a 400 naming `name`.
pub(super) fn replay_id(name: &str, value: &str) -> Result<Uuid, ApiError> {
    id(name, value, "a replay id")
}

/// A UUID, or a 400 naming `name` and saying it is not `what`.
fn id(name: &str, value: &str, what: &str) -> Result<Uuid, ApiError> {
    Uuid::parse_str(value.trim())
        .map_err(|_| ApiError::bad_request(format!("{name}: {value:?} is not {what}")))
}

/// The most values a list parameter (topics, keys) takes.
const MAX_LIST: usize = 1000;

/// A list of names (topics, keys): each checked as [`text`] (blank ones dropped), at most
/// [`MAX_LIST`], or a 400 naming `name`.
pub(super) fn texts(name: &str, values: Option<Vec<String>>) -> Result<Vec<String>, ApiError> {
    let values = values.unwrap_or_default();
    if values.len() > MAX_LIST {
        return Err(ApiError::bad_request(format!(
            "{name}: more than {MAX_LIST} values"
        )));
    }
    let mut out = Vec::with_capacity(values.len());
    for v in values {
        if let Some(v) = text(name, Some(v))? {
            out.push(v);
        }
    }
    Ok(out)
}

/// `since_seconds` of a dead-letter call: a duration from zero to a hundred years.
pub(super) fn since_seconds(value: Option<f64>) -> Result<Option<std::time::Duration>, ApiError> {
    value
        .map(|s| {
            if !(0.0..=MAX_SINCE_SECONDS).contains(&s) {
                return Err(ApiError::bad_request(
                    "since_seconds: a number of seconds from 0 to 3155760000 (a hundred years)",
                ));
            }
            Ok(std::time::Duration::from_secs_f64(s))
        })
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_named_in_their_errors() {
        let message = |e: ApiError| e.message;
        assert!(message(text("topic", Some("a\0b".into())).unwrap_err()).starts_with("topic:"));
        assert!(message(text("key", Some("x".repeat(5000))).unwrap_err()).starts_with("key:"));
        assert_eq!(text("key", Some("  ".into())).ok(), Some(None));
        assert!(message(integer("limit", Some("abc".into())).unwrap_err()).starts_with("limit:"));
        assert_eq!(integer("limit", Some(" 7 ".into())).ok(), Some(Some(7)));
        assert!(
            message(timestamp("since", Some("2024-13-45T00:00:00Z".into())).unwrap_err())
                .starts_with("since:")
        );
        assert!(message(event_id("id", "nope").unwrap_err()).starts_with("id:"));
        assert!(message(replay_id("id", "nope").unwrap_err()).starts_with("id:"));
        assert!(
            message(texts("topics", Some(vec!["a\0".into()])).unwrap_err()).starts_with("topics:")
        );
        assert_eq!(
            texts("keys", Some(vec![" ".into(), "k".into()])).ok(),
            Some(vec!["k".to_owned()])
        );
        for bad in [-1.0, f64::NAN, f64::INFINITY, 1e15] {
            assert!(since_seconds(Some(bad)).is_err(), "{bad}");
        }
        assert_eq!(
            since_seconds(Some(1.5)).ok(),
            Some(Some(std::time::Duration::from_millis(1500)))
        );
    }
}
