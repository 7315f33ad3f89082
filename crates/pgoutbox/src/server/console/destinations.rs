//! The destinations API: destinations added, changed and removed at runtime through the
//! [`crate::definitions::Catalog`] the CLI uses, so that a definition is checked by the same code
//! as the configuration file's and every change reaches the audit log. A page of the list costs
//! the same at the first destination as at the hundred-thousandth (by name, after a cursor).
//!
//! Answers: 201 added, 200 changed or removed; 400 a field of the definition (named); 404 no such
//! destination; 409 the name is taken, is the file's, or still has undelivered events (with their
//! count); 422 the relay cannot seal or open secrets (its key). Never a secret: a definition is
//! shown without its sealed keys, only their names.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use serde::{Deserialize, Serialize};

use super::input::{self, Body, Path, Query};
use super::{ApiError, Console};
use crate::definitions::{Actor, DefinitionError, Shown};

/// The most destinations a page holds.
const MAX_PAGE: i64 = 500;

impl From<DefinitionError> for ApiError {
    fn from(e: DefinitionError) -> Self {
        let e = match e {
            DefinitionError::Store(fault) => return fault.into(),
            other => other,
        };
        let status = match &e {
            DefinitionError::Invalid { .. } => StatusCode::BAD_REQUEST,
            DefinitionError::NoSuch(_) => StatusCode::NOT_FOUND,
            DefinitionError::Exists(_)
            | DefinitionError::InFile(_)
            | DefinitionError::Both(_)
            | DefinitionError::Undelivered { .. } => StatusCode::CONFLICT,
            DefinitionError::NoKey
            | DefinitionError::BadKey
            | DefinitionError::WrongKey(_)
            | DefinitionError::Unsealable => StatusCode::UNPROCESSABLE_ENTITY,
            DefinitionError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

/// The query string of `GET /api/v1/destinations`.
#[derive(Debug, Deserialize)]
pub(super) struct ListParams {
    search: Option<String>,
    after: Option<String>,
    limit: Option<String>,
}

/// A page of destinations added at runtime.
#[derive(Debug, Serialize)]
pub(super) struct ListPage {
    /// The configuration file's destinations (first page only; changed in the file).
    file: Vec<String>,
    /// Destinations added at runtime, by name.
    destinations: Vec<Shown>,
    /// The `after` of the next page (`None`: this is the last).
    next_after: Option<String>,
}

/// `GET /api/v1/destinations`: a page of destinations, by name, searched by name or definition.
pub(super) async fn list(
    State(c): State<Console>,
    headers: HeaderMap,
    Query(p): Query<ListParams>,
) -> Result<Json<ListPage>, ApiError> {
    c.authorize(&headers, false)?;
    let catalog = catalog(&c)?;
    let search = input::text("search", p.search)?;
    let after = input::text("after", p.after)?;
    let limit = input::integer("limit", p.limit)?
        .unwrap_or(100)
        .clamp(1, MAX_PAGE);
    let mut destinations = catalog
        .page(&crate::store::definitions::Page {
            after: after.as_deref(),
            search: search.as_deref(),
            limit: limit + 1,
        })
        .await?;
    let next_after = if destinations.len() as i64 > limit {
        destinations.truncate(limit as usize);
        destinations.last().map(|d| d.name.clone())
    } else {
        None
    };
    let file = if after.is_none() {
        let needle = search.as_deref().map(str::to_lowercase);
        catalog
            .file_names()
            .filter(|n| {
                needle
                    .as_deref()
                    .is_none_or(|s| n.to_lowercase().contains(s))
            })
            .map(str::to_owned)
            .collect()
    } else {
        Vec::new()
    };
    Ok(Json(ListPage {
        file,
        destinations,
        next_after,
    }))
}

/// A destination as `GET /api/v1/destinations/{name}` shows it.
#[derive(Debug, Serialize)]
pub(super) struct One {
    #[serde(flatten)]
    shown: Shown,
    /// Events routed to it and not yet delivered.
    undelivered: i64,
}

/// `GET /api/v1/destinations/{name}`: one destination added at runtime, without its secrets.
pub(super) async fn one(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Json<One>, ApiError> {
    c.authorize(&headers, false)?;
    let catalog = catalog(&c)?;
    let name = path_name(name)?;
    let shown = catalog.show(&name).await?;
    let undelivered = catalog.undelivered(&name).await?;
    Ok(Json(One { shown, undelivered }))
}

/// What a change answers: the destination and the version every relay applies within a second.
#[derive(Debug, Serialize)]
pub(super) struct Changed {
    name: String,
    version: i64,
}

/// `POST /api/v1/destinations`: adds a destination (a `[[destinations]]` table as JSON).
pub(super) async fn add(
    State(c): State<Console>,
    headers: HeaderMap,
    Body(definition): Body<serde_json::Map<String, serde_json::Value>>,
) -> Result<(StatusCode, Json<Changed>), ApiError> {
    let who = c.authorize(&headers, true)?;
    let catalog = catalog(&c)?;
    let name = match definition.get("name") {
        Some(serde_json::Value::String(n)) => n.clone(),
        _ => String::new(),
    };
    let version = catalog.add(definition, actor(&who)).await?;
    tracing::info!(%who, destination = %name, version, "console: destination added");
    Ok((StatusCode::CREATED, Json(Changed { name, version })))
}

/// `PATCH /api/v1/destinations/{name}`: merges a JSON merge patch (RFC 7396) into a definition;
/// sealed keys not given are kept.
pub(super) async fn update(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Body(patch): Body<serde_json::Map<String, serde_json::Value>>,
) -> Result<Json<Changed>, ApiError> {
    let who = c.authorize(&headers, true)?;
    let catalog = catalog(&c)?;
    let name = path_name(name)?;
    let patch = serde_json::Value::Object(patch);
    let version = catalog.update(&name, &patch, actor(&who)).await?;
    tracing::info!(%who, destination = %name, version, "console: destination changed");
    Ok(Json(Changed { name, version }))
}

/// The query string of `DELETE /api/v1/destinations/{name}`.
#[derive(Debug, Deserialize)]
pub(super) struct RemoveParams {
    drop_events: Option<String>,
}

/// `DELETE /api/v1/destinations/{name}`: removes a destination added at runtime; refused with its
/// undelivered count unless `drop_events=true`.
pub(super) async fn remove(
    State(c): State<Console>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(p): Query<RemoveParams>,
) -> Result<Json<Changed>, ApiError> {
    let who = c.authorize(&headers, true)?;
    let catalog = catalog(&c)?;
    let name = path_name(name)?;
    let drop_events = input::flag("drop_events", p.drop_events)?;
    let version = catalog.remove(&name, drop_events, actor(&who)).await?;
    tracing::info!(%who, destination = %name, version, drop_events, "console: destination removed");
    Ok(Json(Changed { name, version }))
}

fn actor(who: &str) -> Actor<'_> {
    Actor {
        who,
        via: "console",
    }
}

/// The console's catalog, or a 404 when the relay serving it manages no destinations at runtime
/// (a library user's console).
fn catalog(c: &Console) -> Result<&crate::definitions::Catalog, ApiError> {
    c.catalog.as_deref().ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "path: this relay does not manage destinations at runtime",
        )
    })
}

/// A destination's name from the path: checked like any text (a 400 naming `name`).
fn path_name(name: String) -> Result<String, ApiError> {
    input::text("name", Some(name))?.ok_or_else(|| ApiError::bad_request("name: is required"))
}
