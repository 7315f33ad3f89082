//! The console's replay calls: list and show replays, start one (or count what it would send),
//! pause, resume and cancel it — what `pgoutbox replay` does, through the same library functions
//! ([`crate::store::replays`], [`crate::route::dry_run`]). Every change is authorized like the
//! other changes and recorded in the audit log under the token's name.

use std::ops::ControlFlow;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::api::audit;
use super::input::{self, Body, Path, Query};
use super::{ApiError, Console};
use crate::config::DestinationConfig;
use crate::model::filter::Filter;
use crate::model::rate::RateLimit;
use crate::route::{self, DryRun};
use crate::store::replays::{self, Change, NewReplay, Replay, Selection};

type ApiResult<T> = Result<Json<T>, ApiError>;

/// A replay as the API shows it: its row, and how many of its events were delivered.
#[derive(Debug, Serialize)]
pub(super) struct ReplayView {
    #[serde(flatten)]
    replay: Replay,
    delivered: i64,
}

impl From<Replay> for ReplayView {
    fn from(replay: Replay) -> Self {
        Self {
            delivered: replay.delivered(),
            replay,
        }
    }
}

fn no_replay(id: Uuid) -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, format!("id: no replay {id}"))
}

/// The query string of `GET /api/v1/replays`.
#[derive(Debug, Deserialize)]
pub(super) struct ListParams {
    destination: Option<String>,
    limit: Option<String>,
}

#[derive(Debug, Serialize)]
pub(super) struct ReplayList {
    replays: Vec<ReplayView>,
}

/// `GET /api/v1/replays`: the latest replays (of `destination`), running and paused first, then
/// newest first; `limit` of them (default 20).
pub(super) async fn list(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(p): Query<ListParams>,
) -> ApiResult<ReplayList> {
    c.authorize(&headers, false)?;
    let destination = input::text("destination", p.destination)?;
    let limit = input::integer("limit", p.limit)?
        .unwrap_or(20)
        .clamp(1, 500);
    let list = replays::list(c.relay.store(), destination.as_deref(), limit).await?;
    Ok(Json(ReplayList {
        replays: list.into_iter().map(ReplayView::from).collect(),
    }))
}

/// `GET /api/v1/replays/{id}`: one replay.
pub(super) async fn one(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<ReplayView> {
    c.authorize(&headers, false)?;
    let id = input::replay_id("id", &id)?;
    match replays::get(c.relay.store(), id).await? {
        Some(replay) => Ok(Json(replay.into())),
        None => Err(no_replay(id)),
    }
}

/// The body of `POST /api/v1/replays`: which retained events go again to which destination, and
/// whether only to count them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StartBody {
    destination: Option<String>,
    since: Option<String>,
    until: Option<String>,
    topics: Option<Vec<String>>,
    keys: Option<Vec<String>>,
    filter: Option<String>,
    rate: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

/// A start request, checked: each parameter named when it is refused.
struct Start<'c> {
    dest: &'c DestinationConfig,
    selection: Selection,
    filter: Option<(String, Filter)>,
    rate: Option<String>,
}

/// The configured destination `name`, or a 400 naming `destination` (with those there are).
fn destination(c: &Console, name: Option<String>) -> Result<&DestinationConfig, ApiError> {
    let config = c.relay.config();
    let name = input::text("destination", name)?;
    if let Some(d) = config
        .destinations
        .iter()
        .find(|d| Some(&d.name) == name.as_ref())
    {
        return Ok(d);
    }
    let problem = match name {
        Some(name) => format!("no destination named {name:?} is configured"),
        None => "required: the name of a configured destination".into(),
    };
    Err(ApiError::bad_request(format!(
        "destination: {problem} (configured: {})",
        config
            .destination_names()
            .unwrap_or_else(|| "none".to_owned())
    )))
}

impl StartBody {
    /// Checks every parameter as `pgoutbox replay start` does.
    fn check(self, c: &Console) -> Result<Start<'_>, ApiError> {
        let dest = destination(c, self.destination)?;
        let filter = input::text("filter", self.filter)?
            .map(|source| match Filter::compile(&source) {
                Ok(f) => Ok((source, f)),
                Err(e) => Err(ApiError::bad_request(format!("filter: {e}"))),
            })
            .transpose()?;
        let rate = input::text("rate", self.rate)?;
        if let Some(rate) = &rate {
            RateLimit::parse(rate, None)
                .map_err(|e| ApiError::bad_request(format!("rate: {e}")))?;
        }
        let since = input::timestamp("since", self.since)?;
        let until = input::timestamp("until", self.until)?;
        if let (Some(since), Some(until)) = (since, until) {
            if until <= since {
                return Err(ApiError::bad_request(format!(
                    "until: {until} must be after since ({since})"
                )));
            }
        }
        Ok(Start {
            dest,
            selection: Selection {
                since,
                until,
                topics: input::texts("topics", self.topics)?,
                keys: input::texts("keys", self.keys)?,
            },
            filter,
            rate,
        })
    }
}

/// How long an API dry run counts: a long range is counted in part rather than holding the
/// request (and a connection) for minutes; the CLI's dry run counts all of it.
const DRY_RUN_BUDGET: Duration = Duration::from_secs(5);

/// What a dry run answers.
#[derive(Debug, Serialize)]
struct DryRunView {
    dry_run: bool,
    #[serde(flatten)]
    counted: DryRun,
}

/// `POST /api/v1/replays`: starts a replay (201 with it), or with `dry_run` walks its range and
/// counts what the destination would be sent (200).
pub(super) async fn start(
    State(c): State<Console>,
    headers: HeaderMap,
    Body(body): Body<StartBody>,
) -> Result<Response, ApiError> {
    let who = c.authorize(&headers, true)?;
    let dry_run = body.dry_run;
    let start = body.check(&c)?;
    let store = c.relay.store();
    let filter = start.filter.as_ref().map(|(_, f)| f);
    if dry_run {
        let started = Instant::now();
        let counted = route::dry_run(store, start.dest, &start.selection, filter, |_| {
            if started.elapsed() < DRY_RUN_BUDGET {
                ControlFlow::Continue(())
            } else {
                ControlFlow::Break(())
            }
        })
        .await?;
        return Ok(Json(DryRunView {
            dry_run: true,
            counted,
        })
        .into_response());
    }
    let new = NewReplay {
        destination: start.dest.name.clone(),
        selection: start.selection,
        filter: start.filter.map(|(source, _)| source),
        rate: start.rate,
        backfill: false,
        created_by: Some(who.clone()),
    };
    let Some(id) = replays::create(store, &new).await? else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "destination: the replay was not created",
        ));
    };
    let replay = replays::get(store, id)
        .await?
        .ok_or_else(|| no_replay(id))?;
    tracing::info!(%who, replay = %id, destination = %replay.destination, total = replay.total, "console: replay started");
    let filter = serde_json::json!({ "destination": replay.destination, "replay": id });
    audit(&c, &who, "replay", filter, replay.total.max(0) as u64).await?;
    Ok((StatusCode::CREATED, Json(ReplayView::from(replay))).into_response())
}

/// Applies `change` to the replay `id`: the replay after it, a 409 naming its state when that
/// does not allow the change, a 404 when there is no such replay.
async fn steer(
    c: &Console,
    headers: &HeaderMap,
    id: &str,
    change: Change,
) -> ApiResult<ReplayView> {
    let who = c.authorize(headers, true)?;
    let id = input::replay_id("id", id)?;
    let store = c.relay.store();
    let before = replays::get(store, id)
        .await?
        .ok_or_else(|| no_replay(id))?;
    let verb = change.verb();
    if !replays::change(store, id, change).await? {
        let state = replays::get(store, id)
            .await?
            .map_or(before.state, |now| now.state);
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!(
                "state: replay {id} is {state}; only a {} replay can be {}",
                change.states().1.join(" or "),
                change.done()
            ),
        ));
    }
    tracing::info!(%who, replay = %id, destination = %before.destination, action = verb, "console: replay changed");
    let filter = serde_json::json!({ "destination": before.destination, "replay": id });
    let action = format!("replay-{verb}");
    audit(c, &who, &action, filter, before.pending.max(0) as u64).await?;
    let after = replays::get(store, id)
        .await?
        .ok_or_else(|| no_replay(id))?;
    Ok(Json(after.into()))
}

/// `POST /api/v1/replays/{id}/pause`: stop queuing its events (those queued still go).
pub(super) async fn pause(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<ReplayView> {
    steer(&c, &headers, &id, Change::Pause).await
}

/// `POST /api/v1/replays/{id}/resume`: queue a paused replay's events again.
pub(super) async fn resume(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<ReplayView> {
    steer(&c, &headers, &id, Change::Resume).await
}

/// `POST /api/v1/replays/{id}/cancel`: stop for good; queued, undelivered events are dropped.
pub(super) async fn cancel(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<ReplayView> {
    steer(&c, &headers, &id, Change::Cancel).await
}
