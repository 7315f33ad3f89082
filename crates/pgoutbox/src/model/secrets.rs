//! Secrets in URLs (the database's, the destinations'): what of a URL may reach a message a user
//! sees (`last_error`, logs, `/readyz`, `status`, errors), and how credentials are read from one.
//!
//! A URL goes into a message only through [`redact_url`], which masks the userinfo password (or a
//! lone user name: NATS reads it as a token), every query value and the fragment. A client
//! library's error may quote the URL it was given, so its text goes through [`scrub`], which masks
//! those same secrets wherever they appear. Sinks read credentials percent-decoded, never
//! form-decoded, so a `+` in a password stays a `+`.

use std::borrow::Cow;

use percent_encoding::percent_decode_str;

/// What a secret is replaced with.
const MASK: &str = "***";

/// Query values shorter than this are not masked in free text by [`scrub`]: `v=1` is no secret,
/// and masking every `1` of a message would garble it. [`redact_url`] masks every value.
const MIN_SCRUBBED_QUERY_VALUE: usize = 6;

/// `url` with its userinfo password, every query value and the fragment replaced by `***`; the
/// scheme, host, port, path, user name and query keys stay. A user name given without a password
/// is masked too (NATS, and HTTP services such as GitHub's, read it as a token), except in a
/// `postgres://` URL, where it is a role name.
///
/// Text that does not parse as a URL with a host (`user:pass@host:4222`) is split by hand, and
/// then everything before the last `@` is treated as userinfo: in doubt, more is masked.
///
/// ```
/// use pgoutbox::model::secrets::redact_url;
/// assert_eq!(
///     redact_url("https://bob:hunter2@example.com/hook?token=abc&v=1"),
///     "https://bob:***@example.com/hook?token=***&v=***"
/// );
/// ```
pub fn redact_url(url: &str) -> String {
    match parse(url) {
        Some(mut parsed) => {
            if parsed.password().is_some() {
                let _ = parsed.set_password(Some(MASK));
            } else if !parsed.username().is_empty() && lone_user_is_secret(parsed.scheme()) {
                let _ = parsed.set_username(MASK);
            }
            if let Some(query) = parsed.query().map(mask_query) {
                parsed.set_query(Some(&query));
            }
            if parsed.fragment().is_some() {
                parsed.set_fragment(Some(MASK));
            }
            parsed.into()
        }
        None => {
            let parts = Parts::split(url);
            let mut out = String::from(parts.scheme);
            if let Some(userinfo) = parts.userinfo {
                match userinfo.split_once(':') {
                    Some((user, _)) => out.push_str(&format!("{user}:{MASK}")),
                    None => out.push_str(MASK),
                }
                out.push('@');
            }
            out.push_str(parts.rest);
            if let Some(query) = parts.query {
                out.push('?');
                out.push_str(&mask_query(query));
            }
            if parts.fragment.is_some() {
                out.push('#');
                out.push_str(MASK);
            }
            out
        }
    }
}

/// `message` with every secret of `url` (see [`redact_url`]) replaced by `***`, in the raw and in
/// the percent-decoded spelling: for the text of a client error that may quote its URL.
///
/// ```
/// use pgoutbox::model::secrets::scrub;
/// let url = "amqp://guest:p%40ss-word@127.0.0.1:5672/%2f";
/// assert_eq!(
///     scrub("login as guest with p@ss-word refused", url),
///     "login as guest with *** refused"
/// );
/// ```
pub fn scrub(message: &str, url: &str) -> String {
    let mut out = message.to_owned();
    let mut secrets = secrets_of(url);
    // Longest first, so a secret that contains another is masked whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    for secret in secrets {
        if !secret.is_empty() && out.contains(secret.as_str()) {
            out = out.replace(secret.as_str(), MASK);
        }
    }
    out
}

/// A user name and password read from a URL, percent-decoded.
// The sinks that read credentials from their URL (NATS, MQTT) are features of their own.
#[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Credentials {
    /// The user name (a token, to NATS, when there is no password).
    pub user: String,
    /// The password, when the URL has one.
    pub password: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Credentials(***)")
    }
}

/// The userinfo of `url`, percent-decoded (`%2B` → `+`, `%40` → `@`, `%3A` → `:`, and `+` stays
/// `+`: userinfo is not a form); `None` when the URL has no user name. The error names the part
/// that is not UTF-8 once decoded, never its value.
#[cfg_attr(not(any(feature = "nats", feature = "mqtt")), allow(dead_code))]
pub(crate) fn credentials(url: &url::Url) -> Result<Option<Credentials>, String> {
    if url.username().is_empty() {
        return Ok(None);
    }
    let decode = |raw: &str, what: &str| {
        percent_decode_str(raw)
            .decode_utf8()
            .map(Cow::into_owned)
            .map_err(|_| format!("the {what} in the URL is not UTF-8 once percent-decoded"))
    };
    Ok(Some(Credentials {
        user: decode(url.username(), "user name")?,
        password: url.password().map(|p| decode(p, "password")).transpose()?,
    }))
}

/// `url` parsed, when it is a URL with a host (not `user:pass@host`, which parses as scheme
/// `user`).
fn parse(url: &str) -> Option<url::Url> {
    url::Url::parse(url)
        .ok()
        .filter(|u| !u.cannot_be_a_base() && u.host().is_some())
}

/// Whether a user name given without a password may be a token: everywhere but in PostgreSQL
/// URLs.
fn lone_user_is_secret(scheme: &str) -> bool {
    !matches!(scheme, "postgres" | "postgresql")
}

/// Every `key=value` pair of a raw query with its value masked; a bare item (no `=`) is masked
/// whole, as it may be a token.
fn mask_query(query: &str) -> String {
    query
        .split('&')
        .map(|item| match item.split_once('=') {
            Some((key, _)) => format!("{key}={MASK}"),
            None if item.is_empty() => String::new(),
            None => MASK.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// The secret substrings of `url`, raw and percent-decoded.
fn secrets_of(url: &str) -> Vec<String> {
    let mut raw: Vec<&str> = Vec::new();
    let mut query_values: Vec<&str> = Vec::new();
    let parsed = parse(url);
    let fragment = match &parsed {
        Some(parsed) => {
            match parsed.password() {
                Some(password) => raw.push(password),
                None if !parsed.username().is_empty() && lone_user_is_secret(parsed.scheme()) => {
                    raw.push(parsed.username())
                }
                None => {}
            }
            query_values.extend(parsed.query().into_iter().flat_map(query_items));
            parsed.fragment()
        }
        None => {
            let parts = Parts::split(url);
            if let Some(userinfo) = parts.userinfo {
                raw.push(userinfo.split_once(':').map_or(userinfo, |(_, p)| p));
            }
            query_values.extend(parts.query.into_iter().flat_map(query_items));
            parts.fragment
        }
    };
    raw.extend(
        query_values
            .into_iter()
            .filter(|v| v.len() >= MIN_SCRUBBED_QUERY_VALUE),
    );
    raw.extend(fragment.filter(|f| f.len() >= MIN_SCRUBBED_QUERY_VALUE));
    let mut secrets = Vec::new();
    for secret in raw.into_iter().filter(|s| !s.is_empty()) {
        secrets.push(secret.to_owned());
        // Libraries quote a decoded value as often as the raw one; a form decoder makes `+` a space.
        let decoded = percent_decode_str(secret).decode_utf8_lossy().into_owned();
        let form_decoded = percent_decode_str(&secret.replace('+', " "))
            .decode_utf8_lossy()
            .into_owned();
        for other in [decoded, form_decoded] {
            if other != secret && !other.trim().is_empty() {
                secrets.push(other);
            }
        }
    }
    secrets
}

/// The values (or bare items) of a raw query.
fn query_items(query: &str) -> impl Iterator<Item = &str> {
    query
        .split('&')
        .map(|item| item.split_once('=').map_or(item, |(_, value)| value))
}

/// A URL-like text split by hand, for text [`parse`] rejects.
struct Parts<'a> {
    /// `scheme://`, or empty.
    scheme: &'a str,
    /// Everything between the scheme and the last `@` before the query, when there is an `@`.
    userinfo: Option<&'a str>,
    /// Host, port and path.
    rest: &'a str,
    /// After the first `?`, up to the fragment.
    query: Option<&'a str>,
    /// After the first `#`.
    fragment: Option<&'a str>,
}

impl<'a> Parts<'a> {
    fn split(text: &'a str) -> Self {
        let (text, fragment) = match text.split_once('#') {
            Some((before, fragment)) => (before, Some(fragment)),
            None => (text, None),
        };
        let (text, query) = match text.split_once('?') {
            Some((before, query)) => (before, Some(query)),
            None => (text, None),
        };
        let (scheme, text) = match text.find("://") {
            Some(i) => text.split_at(i + 3),
            None => ("", text),
        };
        let (userinfo, rest) = match text.rsplit_once('@') {
            Some((userinfo, rest)) => (Some(userinfo), rest),
            None => (None, text),
        };
        Self {
            scheme,
            userinfo,
            rest,
            query,
            fragment,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_tokens_and_query_values_are_masked() {
        for (url, want) in [
            (
                "amqp://guest:s3cr3t@127.0.0.1:5672/%2f",
                "amqp://guest:***@127.0.0.1:5672/%2f",
            ),
            (
                "redis://:hunter22@127.0.0.1:6379/0",
                "redis://:***@127.0.0.1:6379/0",
            ),
            ("nats://tok3n@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
            (
                "https://u:p%40ss@example.com/hook?token=abc&v=1&flag#frag",
                "https://u:***@example.com/hook?token=***&v=***&***#***",
            ),
            ("http://127.0.0.1:9/events", "http://127.0.0.1:9/events"),
            (
                "postgres://app@db:5432/app?sslmode=require&password=pw",
                "postgres://app@db:5432/app?sslmode=***&password=***",
            ),
            // Not URLs a parser takes: split by hand, masking from the start to the last `@`.
            ("user:pa@ss@127.0.0.1:4222", "user:***@127.0.0.1:4222"),
            (
                "nats://u:p@ss@host:port?x=1",
                "nats://u:***@host:port?x=***",
            ),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
        }
    }

    #[test]
    fn scrub_masks_secrets_in_any_spelling() {
        let url = "https://bob:p+ss%40w0rd@example.com/hook?token=sekrit-123&v=1";
        let message = "error sending request for url (https://bob:p+ss%40w0rd@example.com/hook?token=sekrit-123&v=1): auth p+ss@w0rd failed; form-decoded p ss@w0rd";
        let scrubbed = scrub(message, url);
        for secret in ["p+ss%40w0rd", "p+ss@w0rd", "p ss@w0rd", "sekrit-123"] {
            assert!(!scrubbed.contains(secret), "{secret} in {scrubbed}");
        }
        assert!(
            scrubbed.contains("bob:***@example.com/hook?token=***&v=1"),
            "{scrubbed}"
        );
        // Short query values are left alone in free text.
        assert_eq!(scrub("HTTP 500", "http://h/?v=0"), "HTTP 500");
    }

    #[test]
    fn credentials_are_percent_decoded_not_form_decoded() {
        let url = url::Url::parse("mqtt://us%3Aer+a%2Bb%40:pa:ss+w%2Bd%40%25@127.0.0.1:1883")
            .expect("url");
        let got = credentials(&url).expect("utf-8").expect("has credentials");
        assert_eq!(got.user, "us:er+a+b@");
        assert_eq!(got.password.as_deref(), Some("pa:ss+w+d@%"));

        let url = url::Url::parse("nats://tok+en@127.0.0.1").expect("url");
        let got = credentials(&url).expect("utf-8").expect("has a token");
        assert_eq!((got.user.as_str(), got.password), ("tok+en", None));

        let url = url::Url::parse("mqtt://127.0.0.1").expect("url");
        assert_eq!(credentials(&url).expect("utf-8"), None);

        let url = url::Url::parse("mqtt://u:%FF@127.0.0.1").expect("url");
        let err = credentials(&url).expect_err("not UTF-8");
        assert!(err.contains("password") && !err.contains("FF"), "{err}");
    }
}
