//! A local webhook receiver: an HTTP server on 127.0.0.1 that answers every POST to `/events` at
//! once, and can report each request's `webhook-id` (when it arrived is the end of commit→publish
//! latency). Two more paths play failing endpoints: `/unavailable` answers 503, and `/hang`
//! accepts the request and never answers.

use std::sync::Arc;

/// A local HTTP receiver answering 200 to every POST, for the webhook sink.
pub struct Receiver {
    /// Its URL.
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Receiver {
    /// Starts the receiver on 127.0.0.1, on a free port.
    pub async fn start() -> anyhow::Result<Self> {
        Self::with_hook(|_| {}).await
    }

    /// Starts the receiver, calling `hook` with each request's `webhook-id`.
    pub async fn with_hook(hook: impl Fn(&str) + Send + Sync + 'static) -> anyhow::Result<Self> {
        let hook = Arc::new(hook);
        let app = axum::Router::new()
            .route(
                "/events",
                axum::routing::post(move |headers: axum::http::HeaderMap| {
                    let hook = hook.clone();
                    async move {
                        if let Some(id) = headers.get("webhook-id").and_then(|v| v.to_str().ok()) {
                            hook(id);
                        }
                        axum::http::StatusCode::NO_CONTENT
                    }
                }),
            )
            .route(
                "/unavailable",
                axum::routing::post(|| async { axum::http::StatusCode::SERVICE_UNAVAILABLE }),
            )
            .route(
                "/hang",
                axum::routing::post(std::future::pending::<axum::http::StatusCode>),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self {
            url: format!("http://{addr}/events"),
            task,
        })
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}
