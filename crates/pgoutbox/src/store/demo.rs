//! `pgoutbox demo`'s own tables: the `pgoutbox_demo` schema and its `orders`, the business data
//! the demo commits with its events. Fixed names (the demo takes no configuration).

use sqlx::{PgConnection, PgPool};

use crate::error::Result;

/// DemoReset. Drops and recreates the demo's schema with an empty `orders` table (the outbox is
/// migrated into it afterwards). `DROP SCHEMA … CASCADE` locks everything in it: the demo's alone.
const DEMO_RESET: &str = "DROP SCHEMA IF EXISTS pgoutbox_demo CASCADE;
         CREATE SCHEMA pgoutbox_demo;
         CREATE TABLE pgoutbox_demo.orders (id bigint PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL);";

/// DemoReset: a fresh `pgoutbox_demo` schema holding an empty `orders` table.
pub async fn reset(pool: &PgPool) -> Result<()> {
    sqlx::raw_sql(DEMO_RESET).execute(pool).await?;
    Ok(())
}

/// DemoOrderInsert. One order, by its primary key.
const ORDER_INSERT: &str =
    "INSERT INTO pgoutbox_demo.orders (id, customer, total_cents) VALUES ($1, $2, $3)";

/// One order of the demo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// Its id.
    pub id: i64,
    /// Who ordered.
    pub customer: String,
    /// Its total, in cents.
    pub total_cents: i64,
}

/// DemoOrderInsert: writes `order` in the caller's transaction (with its event, in the demo).
pub async fn insert_order(conn: &mut PgConnection, order: &Order) -> Result<()> {
    sqlx::query(ORDER_INSERT)
        .bind(order.id)
        .bind(&order.customer)
        .bind(order.total_cents)
        .execute(conn)
        .await?;
    Ok(())
}
