//! Webhook verification for receivers, through the `axum` extractor on a real local server:
//! the Standard Webhooks test vector, tampered body, wrong secret, expired timestamp, rotation.
#![cfg(feature = "axum")]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::routing::post;
use axum::{Extension, Router};
use pgoutbox::webhook::axum::{VerifiedWebhook, WebhookVerifier};
use pgoutbox::webhook::{decode_secret, sign};

const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const OTHER: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
// The Standard Webhooks test vector.
const ID: &str = "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk";
const TS: i64 = 1649367553;
const BODY: &str = r#"{"email":"test@example.com","username":"test_user"}"#;
const EXPECTED: &str = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=";

async fn echo(hook: VerifiedWebhook) -> String {
    format!(
        "{} {} {}",
        hook.id,
        hook.timestamp,
        String::from_utf8_lossy(&hook.body)
    )
}

/// A receiver on 127.0.0.1 that accepts what `verifier` accepts; returns its URL.
async fn receiver(verifier: WebhookVerifier) -> String {
    let app = Router::new()
        .route("/hook", post(echo))
        .layer(Extension(verifier));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}/hook")
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// Posts `body` with the three headers; returns (status, text).
async fn post_signed(url: &str, id: &str, ts: i64, sig: Option<&str>, body: &str) -> (u16, String) {
    let mut req = reqwest::Client::new()
        .post(url)
        .header("webhook-id", id)
        .header("webhook-timestamp", ts.to_string())
        .body(body.to_owned());
    if let Some(sig) = sig {
        req = req.header("webhook-signature", sig);
    }
    let res = req.send().await.expect("request");
    let status = res.status().as_u16();
    (status, res.text().await.expect("body"))
}

fn signed(secret: &str, id: &str, ts: i64, body: &str) -> String {
    sign(
        &decode_secret(secret).expect("secret"),
        id,
        ts,
        body.as_bytes(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standard_webhooks_vector_verifies_through_the_extractor() {
    // The vector's timestamp is from 2022: accept it with a tolerance that reaches back that far.
    let age = Duration::from_secs((now() - TS + 3600) as u64);
    let url = receiver(
        WebhookVerifier::new([SECRET])
            .expect("secret")
            .tolerance(age),
    )
    .await;
    let (status, text) = post_signed(&url, ID, TS, Some(EXPECTED), BODY).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text, format!("{ID} {TS} {BODY}"));

    // With the default tolerance the same message is a replay.
    let url = receiver(WebhookVerifier::new([SECRET]).expect("secret")).await;
    let (status, text) = post_signed(&url, ID, TS, Some(EXPECTED), BODY).await;
    assert_eq!(status, 401);
    assert_eq!(
        text,
        "webhook verification failed: webhook-timestamp is outside the allowed tolerance"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_401_with_a_clear_reason() {
    let url = receiver(WebhookVerifier::new([SECRET]).expect("secret")).await;
    let ts = now();
    let good = signed(SECRET, "evt_1", ts, BODY);
    let (status, _) = post_signed(&url, "evt_1", ts, Some(&good), BODY).await;
    assert_eq!(status, 200);

    let tampered = BODY.replace("test@", "evil@");
    let (status, text) = post_signed(&url, "evt_1", ts, Some(&good), &tampered).await;
    assert_eq!(
        (status, text.as_str()),
        (401, "webhook verification failed: no matching signature")
    );

    let wrong = signed(OTHER, "evt_1", ts, BODY);
    let (status, text) = post_signed(&url, "evt_1", ts, Some(&wrong), BODY).await;
    assert_eq!(
        (status, text.as_str()),
        (401, "webhook verification failed: no matching signature")
    );

    // A different id under the same signature is a forgery too.
    let (status, _) = post_signed(&url, "evt_2", ts, Some(&good), BODY).await;
    assert_eq!(status, 401);

    let old = ts - 600;
    let expired = signed(SECRET, "evt_1", old, BODY);
    let (status, text) = post_signed(&url, "evt_1", old, Some(&expired), BODY).await;
    assert_eq!(
        (status, text.as_str()),
        (
            401,
            "webhook verification failed: webhook-timestamp is outside the allowed tolerance"
        )
    );

    let (status, text) = post_signed(&url, "evt_1", ts, None, BODY).await;
    assert_eq!(
        (status, text.as_str()),
        (
            401,
            "webhook verification failed: missing or unreadable header webhook-signature"
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_secrets_are_all_accepted() {
    // During rotation the receiver knows both secrets; senders may sign with either or both.
    let url = receiver(WebhookVerifier::new([OTHER, SECRET]).expect("secrets")).await;
    let ts = now();
    for secret in [SECRET, OTHER] {
        let sig = signed(secret, "evt_r", ts, BODY);
        let (status, text) = post_signed(&url, "evt_r", ts, Some(&sig), BODY).await;
        assert_eq!(status, 200, "{text}");
    }
    let both = format!(
        "{} {}",
        signed("whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "evt_r", ts, BODY),
        signed(SECRET, "evt_r", ts, BODY)
    );
    let (status, _) = post_signed(&url, "evt_r", ts, Some(&both), BODY).await;
    assert_eq!(status, 200);

    // After rotation the old secret's signatures are refused.
    let url = receiver(WebhookVerifier::new([OTHER]).expect("secret")).await;
    let sig = signed(SECRET, "evt_r", ts, BODY);
    let (status, _) = post_signed(&url, "evt_r", ts, Some(&sig), BODY).await;
    assert_eq!(status, 401);

    assert!(
        WebhookVerifier::new(["whsec_!!"]).is_err(),
        "a bad secret fails at start-up"
    );
    assert!(WebhookVerifier::new(Vec::<String>::new()).is_err());
}
