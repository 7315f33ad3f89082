//! The console's JSON handlers: each checks the token, calls the library function the CLI uses,
//! and answers JSON. Mutations are logged (who cannot be known; what and how many can).

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::input::{self, Body, Path, Query};
use super::{redacted_target, ApiError, Console};
use crate::store::dead::DeadFilter;
use crate::store::inspect::{EventQuery, EventState};

type ApiResult<T> = Result<Json<T>, ApiError>;

/// One destination's line of the overview.
#[derive(Debug, Default, Serialize)]
pub struct DestinationView {
    name: String,
    kind: String,
    target: Option<String>,
    breaker: String,
    paused: bool,
    problem: Option<String>,
    /// How it is configured: routing, retry, breaker and the sink's settings, secrets masked.
    settings: serde_json::Value,
    #[serde(flatten)]
    counts: Counts,
    /// Events per second this relay delivered to it, at the last sample (`None` before one).
    rate_per_second: Option<f64>,
}

/// Backlog counts as the console shows them: `backoff` is only the events waiting for a retry
/// (held and leased ones have their own columns).
#[derive(Debug, Default, Serialize)]
struct Counts {
    due: i64,
    backoff: i64,
    held: i64,
    in_flight: i64,
    failing: i64,
    dead: i64,
    lag_seconds: Option<f64>,
}

impl Counts {
    fn add(&mut self, b: &crate::store::backlog::Backlog) {
        self.due += b.due;
        self.backoff += (b.backoff - b.held - b.in_flight).max(0);
        self.held += b.held;
        self.in_flight += b.in_flight;
        self.failing += b.failing;
        self.dead += b.dead;
        self.lag_seconds = lag(self.lag_seconds.unwrap_or(0.0).max(b.lag));
    }
}

#[derive(Debug, Serialize)]
pub(super) struct Overview {
    table: String,
    generated_at: DateTime<Utc>,
    admin: AdminView,
    totals: Counts,
    destinations: Vec<DestinationView>,
}

#[derive(Debug, Serialize)]
struct AdminView {
    mutations_enabled: bool,
    read_token_required: bool,
}

/// A destination's configuration as the overview shows it.
fn destination_settings(d: &crate::config::DestinationConfig) -> serde_json::Value {
    serde_json::json!({
        "topics": d.subscription.topics,
        "filter": d.subscription.filter.as_ref().map(|f| f.as_str()),
        "ordering": format!("{:?}", d.ordering).to_lowercase(),
        "max_attempts": d.retry.max_attempts,
        "max_age_seconds": d.retry.max_age.map(|a| a.as_secs_f64()),
        "retry_schedule_seconds": d.retry.schedule.iter().map(|s| s.as_secs_f64()).collect::<Vec<_>>(),
        "breaker": {
            "failures": d.breaker.failures,
            "probe_interval_seconds": d.breaker.probe_interval.as_secs_f64(),
            "max_probe_interval_seconds": d.breaker.max_probe_interval.as_secs_f64(),
        },
        "sink": super::masked_settings(&d.sink.settings.to_table()),
    })
}

fn lag(seconds: f64) -> Option<f64> {
    (seconds > 0.0).then_some(seconds)
}

/// `GET /api/v1/overview`: per destination, its breaker and pause state and its backlog (the
/// same query as the gauges: the pending and dead indexes, not the whole table).
pub(super) async fn overview(State(c): State<Console>, headers: HeaderMap) -> ApiResult<Overview> {
    c.authorize(&headers, false)?;
    let config = c.relay.config();
    let backlog = crate::server::gauges::backlog(&c.relay).await?;
    let states = crate::store::destinations::read(c.relay.store()).await?;
    let last = c.samples.last();
    let mut totals = Counts::default();
    // Summed per destination once: at 100,000 destinations, scanning the backlog for each was
    // ten billion comparisons.
    let mut per_destination: std::collections::HashMap<&str, Counts> = Default::default();
    for ((name, _), b) in &backlog {
        totals.add(b);
        per_destination.entry(name.as_str()).or_default().add(b);
    }
    let destinations = config
        .destinations
        .iter()
        .map(|d| {
            let mut view = DestinationView {
                name: d.name.clone(),
                kind: d.sink.kind.clone(),
                target: redacted_target(&d.sink.settings.to_table()),
                settings: destination_settings(d),
                breaker: "closed".into(),
                rate_per_second: last
                    .as_ref()
                    .map(|s| s.per_destination.get(&d.name).copied().unwrap_or(0.0)),
                ..DestinationView::default()
            };
            if let Some(counts) = per_destination.remove(d.name.as_str()) {
                view.counts = counts;
            }
            if let Some(s) = states.iter().find(|s| s.name == d.name) {
                view.paused = s.paused_at.is_some();
                view.breaker = s.breaker.clone();
                if s.breaker != "closed" {
                    view.problem = s.last_error.clone();
                }
            }
            view
        })
        .collect();
    Ok(Json(Overview {
        table: config.table.to_string(),
        generated_at: Utc::now(),
        admin: AdminView {
            mutations_enabled: c.mutations_enabled(),
            read_token_required: c.reads_need_token,
        },
        totals,
        destinations,
    }))
}

#[derive(Debug, Serialize)]
pub(super) struct SamplesView {
    interval_seconds: f64,
    samples: Vec<crate::server::Sample>,
}

/// `GET /api/v1/samples`: the last hour of lag, backlog and throughput, every relay's samples
/// (stored in the database) merged per interval.
pub(super) async fn samples(
    State(c): State<Console>,
    headers: HeaderMap,
) -> ApiResult<SamplesView> {
    c.authorize(&headers, false)?;
    let interval = c.relay.config().observability.gauge_interval;
    let stored =
        crate::store::operators::samples(c.relay.store(), crate::server::Samples::SPAN).await?;
    Ok(Json(SamplesView {
        interval_seconds: interval.as_secs_f64(),
        samples: crate::server::gauges::merge_samples(&stored, interval),
    }))
}

/// The query string of `GET /api/v1/events`: every value as text, each checked by name.
#[derive(Debug, Deserialize)]
pub(super) struct EventsParams {
    id: Option<String>,
    state: Option<String>,
    topic: Option<String>,
    topic_prefix: Option<String>,
    payload: Option<String>,
    key: Option<String>,
    destination: Option<String>,
    since: Option<String>,
    until: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
    total: Option<String>,
}

fn event_state(value: Option<String>) -> Result<EventState, ApiError> {
    Ok(
        match input::text("state", value)?.as_deref().map(str::trim) {
            None | Some("dead") => EventState::Dead,
            Some("pending") => EventState::Pending,
            Some("published") => EventState::Published,
            Some("all") => EventState::All,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "state: {other:?} is not one of dead, pending, published, all"
                )))
            }
        },
    )
}

#[derive(Debug, Serialize)]
pub(super) struct EventsPage {
    events: Vec<crate::store::inspect::EventRow>,
    next_cursor: Option<String>,
    /// With `total=true`: the matches over every page, at most `total_cap`.
    #[serde(skip_serializing_if = "Option::is_none")]
    total: Option<i64>,
    /// The most a count goes to: a `total` this large means at least that many.
    total_cap: i64,
}

/// `GET /api/v1/events`: search, newest first, `limit` per page (default 50), `cursor` from the
/// previous page.
pub(super) async fn events(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(p): Query<EventsParams>,
) -> ApiResult<EventsPage> {
    c.authorize(&headers, false)?;
    let query = EventQuery {
        id: input::text("id", p.id)?
            .map(|s| input::event_id("id", &s))
            .transpose()?,
        state: event_state(p.state)?,
        topic: input::text("topic", p.topic)?,
        topic_prefix: input::text("topic_prefix", p.topic_prefix)?,
        payload: input::json_filter("payload", p.payload)?,
        total: input::flag("total", p.total)?,
        key: input::text("key", p.key)?,
        destination: input::text("destination", p.destination)?,
        since: input::timestamp("since", p.since)?,
        until: input::timestamp("until", p.until)?,
        after: input::text("cursor", p.cursor)?
            .map(|s| {
                crate::store::inspect::Cursor::parse(&s).ok_or_else(|| {
                    ApiError::bad_request(
                        "cursor: not one this API gave out (use a page's next_cursor)",
                    )
                })
            })
            .transpose()?,
        limit: input::integer("limit", p.limit)?.unwrap_or(50),
    };
    if query.state == EventState::All && query.id.is_none() {
        return Err(ApiError::bad_request(
            "state=all is for a lookup by id: search dead, pending or published (each has its index; every state at once would read the whole table)",
        ));
    }
    let page = crate::store::inspect::search(c.relay.store(), &query).await?;
    Ok(Json(EventsPage {
        events: page.events,
        next_cursor: page.next_cursor.map(|s| s.to_string()),
        total: page.total,
        total_cap: crate::store::inspect::TOTAL_CAP,
    }))
}

/// `GET /api/v1/events/{id}`: the event whole, with its state at each destination.
pub(super) async fn event(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<crate::store::inspect::EventDetail> {
    c.authorize(&headers, false)?;
    let id = input::event_id("id", &id)?;
    match crate::store::inspect::show(c.relay.store(), id).await? {
        Some(detail) => Ok(Json(detail)),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no event {id} in the outbox (never written, or delivered and cleaned up)"),
        )),
    }
}

/// The body of the dead-letter calls: which dead events, and whether only to count them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DeadBody {
    #[serde(default)]
    ids: Option<Vec<Uuid>>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    destination: Option<String>,
    #[serde(default)]
    since_seconds: Option<f64>,
    #[serde(default)]
    dry_run: bool,
}

impl DeadBody {
    fn filter(&self) -> Result<DeadFilter, ApiError> {
        Ok(DeadFilter {
            ids: self.ids.clone(),
            topic: input::text("topic", self.topic.clone())?,
            destination: input::text("destination", self.destination.clone())?,
            since: input::since_seconds(self.since_seconds)?,
        })
    }
}

#[derive(Debug, Serialize)]
pub(super) struct Matched {
    matched: u64,
    dry_run: bool,
}

/// What a dead-letter call does to the events it matches.
#[derive(Debug, Clone, Copy)]
enum DeadAction {
    Retry,
    Discard,
}

/// Authorizes, runs `action` on the dead events `body` matches (or counts them), logs a real run.
async fn dead_action(
    c: &Console,
    headers: &HeaderMap,
    body: &DeadBody,
    action: DeadAction,
) -> ApiResult<Matched> {
    let who = c.authorize(headers, true)?;
    let filter = body.filter()?;
    let matched = match action {
        DeadAction::Retry => {
            crate::store::dead::retry(c.relay.store(), &filter, body.dry_run).await?
        }
        DeadAction::Discard => {
            crate::store::dead::discard(c.relay.store(), &filter, body.dry_run).await?
        }
    };
    if !body.dry_run {
        tracing::info!(%who, matched, ?filter, ?action, "console: dead events changed");
        let action = match action {
            DeadAction::Retry => "retry",
            DeadAction::Discard => "discard",
        };
        audit(c, &who, action, filter.to_json(), matched).await?;
    }
    Ok(Json(Matched {
        matched,
        dry_run: body.dry_run,
    }))
}

/// `POST /api/v1/dead/retry`: dead events matching the body are due again (or, with `dry_run`,
/// counted).
pub(super) async fn dead_retry(
    State(c): State<Console>,
    headers: HeaderMap,
    Body(body): Body<DeadBody>,
) -> ApiResult<Matched> {
    dead_action(&c, &headers, &body, DeadAction::Retry).await
}

/// `POST /api/v1/dead/discard`: dead events matching the body are deleted (or counted).
pub(super) async fn dead_discard(
    State(c): State<Console>,
    headers: HeaderMap,
    Body(body): Body<DeadBody>,
) -> ApiResult<Matched> {
    dead_action(&c, &headers, &body, DeadAction::Discard).await
}

#[derive(Debug, Serialize)]
pub(super) struct Paused {
    name: String,
    paused: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    released: Option<u64>,
}

fn known(c: &Console, name: &str) -> Result<(), ApiError> {
    if c.relay.has_destination(name) {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no destination is named {name:?}"),
        ))
    }
}

/// Records a change made through the console in the audit log.
pub(super) async fn audit(
    c: &Console,
    who: &str,
    action: &str,
    filter: serde_json::Value,
    matched: u64,
) -> Result<(), ApiError> {
    let change = crate::store::operators::Change {
        who,
        via: "console",
        action,
        filter,
        matched,
    };
    crate::store::operators::record(c.relay.store(), &change).await?;
    Ok(())
}

/// The query string of `GET /api/v1/audit`.
#[derive(Debug, Deserialize)]
pub(super) struct AuditParams {
    limit: Option<String>,
    before: Option<String>,
}

#[derive(Debug, Serialize)]
pub(super) struct AuditPage {
    changes: Vec<crate::store::operators::AuditRow>,
    /// Pass as `before` for the next (older) page.
    next_before: Option<i64>,
}

/// `GET /api/v1/audit`: the changes operators made, newest first, `limit` per page (default 50),
/// `before` from the previous page.
pub(super) async fn audit_log(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(p): Query<AuditParams>,
) -> ApiResult<AuditPage> {
    c.authorize(&headers, false)?;
    let limit = input::integer("limit", p.limit)?
        .unwrap_or(50)
        .clamp(1, 500);
    let before = input::integer("before", p.before)?;
    let mut changes = crate::store::operators::audit(c.relay.store(), limit + 1, before).await?;
    let next_before = if changes.len() as i64 > limit {
        changes.truncate(limit as usize);
        changes.last().map(|r| r.id)
    } else {
        None
    };
    Ok(Json(AuditPage {
        changes,
        next_before,
    }))
}

/// Pauses (`pause = true`) or resumes a destination for every relay; a resume reports how many
/// held events are due again.
async fn set_paused(
    c: &Console,
    headers: &HeaderMap,
    name: String,
    pause: bool,
) -> ApiResult<Paused> {
    let who = c.authorize(headers, true)?;
    known(c, &name)?;
    let store = c.relay.store();
    let released = if pause {
        crate::store::destinations::pause(store, &name).await?;
        None
    } else {
        Some(
            crate::store::destinations::resume(store, &name)
                .await?
                .unwrap_or(0),
        )
    };
    tracing::info!(%who, destination = %name, pause, ?released, "console: destination paused or resumed");
    let action = if pause { "pause" } else { "resume" };
    let filter = serde_json::json!({ "destination": name });
    audit(c, &who, action, filter, released.unwrap_or(0)).await?;
    Ok(Json(Paused {
        name,
        paused: pause,
        released,
    }))
}

/// `POST /api/v1/destinations/{name}/pause`: every relay holds the destination's events.
pub(super) async fn pause(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult<Paused> {
    set_paused(&c, &headers, name, true).await
}

/// `POST /api/v1/destinations/{name}/resume`: the held events are due again.
pub(super) async fn resume(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult<Paused> {
    set_paused(&c, &headers, name, false).await
}
