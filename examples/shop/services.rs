//! The shop's two services, shared by the example (`main.rs`) and its end-to-end test
//! (`tests/shop.rs`, which includes this file with `#[path]`).
//!
//! - **orders** (`POST /orders`): writes the order row and its `order.created` event in one
//!   transaction, so the event exists exactly when the order does.
//! - **balances** (`POST /events`): a webhook consumer. The extractor verifies the Standard
//!   Webhooks signature; the inbox makes the effect (adding the order's amount to the customer's
//!   balance) happen once per event, however often the relay delivers it.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use pgoutbox::inbox::{Inbox, InboxTable};
use pgoutbox::webhook::axum::{VerifiedWebhook, WebhookVerifier};
use pgoutbox::{Outbox, OutboxTable, TypedEvent};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use uuid::Uuid;

/// The inbox consumer name of the balances service.
pub const CONSUMER: &str = "balances";

/// The shop's own tables. The outbox and the inbox come from `pgoutbox migrate` (here, the
/// library calls behind it).
const APP_TABLES: &str = "
CREATE TABLE IF NOT EXISTS orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   text NOT NULL,
    amount     bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS balances (
    customer text PRIMARY KEY,
    total    bigint NOT NULL
);";

/// Creates the outbox, the inbox and the shop's tables (idempotent).
pub async fn setup(pool: &PgPool) -> pgoutbox::Result<()> {
    pgoutbox::schema::migrate(pool, &OutboxTable::default_table()).await?;
    pgoutbox::inbox::migrate(pool, &InboxTable::default_table()).await?;
    sqlx::raw_sql(APP_TABLES).execute(pool).await?;
    Ok(())
}

/// `POST /orders` body.
#[derive(Debug, Serialize, Deserialize)]
pub struct NewOrder {
    /// Who pays.
    pub customer: String,
    /// In cents.
    pub amount: i64,
}

/// The `order.created` event: a typed event, so its topic and key live with the type.
#[derive(Debug, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The order's id.
    pub order_id: i64,
    /// Who pays.
    pub customer: String,
    /// In cents.
    pub amount: i64,
}

impl TypedEvent for OrderCreated {
    const TOPIC: &'static str = "order.created";
    fn key(&self) -> Option<String> {
        Some(self.customer.clone())
    }
}

/// `POST /orders` answer.
#[derive(Debug, Serialize, Deserialize)]
pub struct Created {
    /// The order's id.
    pub order_id: i64,
    /// The id of its `order.created` event.
    pub event_id: Uuid,
}

/// A 500 with the error chain as text (an example: real services would log and hide it).
struct Failure(String);

impl<E: std::error::Error + 'static> From<E> for Failure {
    fn from(e: E) -> Self {
        Self(pgoutbox::error_chain(&e))
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.0).into_response()
    }
}

/// The orders service.
pub fn orders_app(pool: PgPool) -> Router {
    Router::new()
        .route("/orders", post(create_order))
        .with_state(pool)
}

async fn create_order(
    State(pool): State<PgPool>,
    Json(order): Json<NewOrder>,
) -> Result<(StatusCode, Json<Created>), Failure> {
    let outbox = Outbox::default();
    let mut tx = pool.begin().await?;
    let order_id: i64 =
        sqlx::query_scalar("INSERT INTO orders (customer, amount) VALUES ($1, $2) RETURNING id")
            .bind(&order.customer)
            .bind(order.amount)
            .fetch_one(&mut *tx)
            .await?;
    let event = OrderCreated {
        order_id,
        customer: order.customer,
        amount: order.amount,
    };
    let event_id = outbox.enqueue_typed(&mut tx, &event).await?;
    // The order and its event become visible together, or (on any error above) neither does.
    tx.commit().await?;
    Ok((StatusCode::CREATED, Json(Created { order_id, event_id })))
}

/// How often the balances service applied an event, and how many duplicates it absorbed.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Events applied (first deliveries).
    pub applied: AtomicU64,
    /// Deliveries of events already applied.
    pub duplicates: AtomicU64,
}

impl ConsumerStats {
    /// (applied, duplicates) now.
    pub fn get(&self) -> (u64, u64) {
        (
            self.applied.load(Ordering::Relaxed),
            self.duplicates.load(Ordering::Relaxed),
        )
    }
}

/// The envelope pgoutbox's webhook and NATS sinks send: `{"id","type","timestamp","key","data"}`.
#[derive(Debug, Deserialize)]
pub struct Envelope<T> {
    /// The event id (also `webhook-id` / `Nats-Msg-Id`).
    pub id: Uuid,
    /// The topic.
    #[serde(rename = "type")]
    pub kind: String,
    /// The payload.
    pub data: T,
}

/// Applies one `order.created` exactly once: the inbox row and the balance change commit
/// together. Returns whether this delivery applied it (false: a duplicate). Shared by the
/// webhook and the NATS consumers.
pub async fn apply_order_created(
    pool: &PgPool,
    event_id: Uuid,
    order: &OrderCreated,
    stats: &ConsumerStats,
) -> pgoutbox::Result<bool> {
    let inbox = Inbox::default();
    let mut tx = pool.begin().await?;
    let first = inbox.process_once(&mut tx, CONSUMER, event_id).await?;
    if first {
        sqlx::query(
            "INSERT INTO balances (customer, total) VALUES ($1, $2)
             ON CONFLICT (customer) DO UPDATE SET total = balances.total + EXCLUDED.total",
        )
        .bind(&order.customer)
        .bind(order.amount)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    let counter = if first {
        &stats.applied
    } else {
        &stats.duplicates
    };
    counter.fetch_add(1, Ordering::Relaxed);
    Ok(first)
}

#[derive(Clone)]
struct ConsumerState {
    pool: PgPool,
    stats: Arc<ConsumerStats>,
}

/// The balances service: verified webhooks in, balances updated once per event.
pub fn balances_app(pool: PgPool, verifier: WebhookVerifier, stats: Arc<ConsumerStats>) -> Router {
    Router::new()
        .route("/events", post(receive))
        .layer(Extension(verifier))
        .with_state(ConsumerState { pool, stats })
}

async fn receive(
    State(state): State<ConsumerState>,
    hook: VerifiedWebhook,
) -> Result<StatusCode, Response> {
    let envelope: Envelope<OrderCreated> = serde_json::from_slice(&hook.body).map_err(|e| {
        // A permanent failure: pgoutbox dead-letters on a 4xx instead of retrying.
        (StatusCode::UNPROCESSABLE_ENTITY, e.to_string()).into_response()
    })?;
    if envelope.id.to_string() != hook.id || envelope.kind != OrderCreated::TOPIC {
        return Err((StatusCode::UNPROCESSABLE_ENTITY, "unexpected event").into_response());
    }
    // Run to completion in a task of its own: hyper drops a handler whose client disconnected
    // (a relay killed mid-request), and the effect should not stop halfway through its commit.
    let work = tokio::spawn(async move {
        apply_order_created(&state.pool, envelope.id, &envelope.data, &state.stats).await
    });
    match work.await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(Failure::from(e).into_response()),
        Err(e) => return Err(Failure::from(e).into_response()),
    }
    // Only now, after the commit, is the delivery acknowledged: a crash before this point means
    // the relay delivers again and the inbox sorts it out.
    Ok(StatusCode::OK)
}

/// Sum of all orders and sum of all balances: equal once every event is applied exactly once.
pub async fn totals(pool: &PgPool) -> sqlx::Result<(i64, i64)> {
    sqlx::query_as(
        "SELECT (SELECT coalesce(sum(amount), 0)::bigint FROM orders),
                (SELECT coalesce(sum(total), 0)::bigint FROM balances)",
    )
    .fetch_one(pool)
    .await
}

/// Serves `app` on an ephemeral port of 127.0.0.1; returns its base URL.
pub async fn serve(app: Router) -> std::io::Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(format!("http://{addr}"))
}
