//! Sessions: creation with a frozen launch policy, lineage (compression children) and the tip.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;

use super::epoch::check_epoch;
use super::messages::{insert_messages, NewMessage};
use super::schema::{messages, sessions};
use super::{hot_sql, Bind};
use crate::error::StoreError;

#[derive(Debug, Clone, Queryable, Selectable, serde::Serialize)]
#[diesel(table_name = sessions)]
pub struct SessionRow {
    pub id: String,
    pub root_id: String,
    pub parent_session_id: Option<String>,
    pub tip_session_id: String,
    pub principal_id: String,
    pub request_id: String,
    pub request_digest: String,
    pub source: String,
    pub model: String,
    pub provider: String,
    pub base_url: Option<String>,
    pub cwd: String,
    pub toolsets_json: String,
    pub profile: String,
    pub title: Option<String>,
    pub system_prompt: Option<String>,
    pub runtime_generation: i64,
    pub runtime_revision: i64,
    pub compression_count: i32,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub started_at: f64,
    pub ended_at: Option<f64>,
    pub end_reason: Option<String>,
}

impl SessionRow {
    pub fn toolsets(&self) -> Vec<String> {
        serde_json::from_str(&self.toolsets_json).unwrap_or_default()
    }
}

/// The frozen launch policy of a new session.
#[derive(Debug, Clone)]
pub struct NewSession {
    pub id: String,
    pub principal_id: String,
    pub request_id: String,
    pub request_digest: String,
    pub source: String,
    pub model: String,
    pub provider: String,
    pub base_url: Option<String>,
    pub cwd: String,
    pub toolsets_json: String,
    pub profile: String,
    pub title: Option<String>,
    pub system_prompt: Option<String>,
}

/// Create the session, or return the existing one for an identical request (`created == false`).
/// The same id with another digest is `invalid_params`.
pub fn create_or_get(
    conn: &mut SqliteConnection,
    epoch: i64,
    new: &NewSession,
    now: f64,
) -> Result<(SessionRow, bool), StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        if let Some(existing) = find(conn, &new.id)? {
            if existing.request_digest != new.request_digest {
                return Err(StoreError::InvalidParams(
                    "request_id was already used with different parameters".into(),
                ));
            }
            return Ok((existing, false));
        }
        diesel::insert_into(sessions::table)
            .values((
                sessions::id.eq(&new.id),
                sessions::root_id.eq(&new.id),
                sessions::tip_session_id.eq(&new.id),
                sessions::principal_id.eq(&new.principal_id),
                sessions::request_id.eq(&new.request_id),
                sessions::request_digest.eq(&new.request_digest),
                sessions::source.eq(&new.source),
                sessions::model.eq(&new.model),
                sessions::provider.eq(&new.provider),
                sessions::base_url.eq(&new.base_url),
                sessions::cwd.eq(&new.cwd),
                sessions::toolsets_json.eq(&new.toolsets_json),
                sessions::profile.eq(&new.profile),
                sessions::title.eq(&new.title),
                sessions::system_prompt.eq(&new.system_prompt),
                sessions::started_at.eq(now),
            ))
            .execute(conn)?;
        let row =
            find(conn, &new.id)?.ok_or_else(|| StoreError::Other("session vanished".into()))?;
        Ok((row, true))
    })
}

pub fn find(conn: &mut SqliteConnection, id: &str) -> Result<Option<SessionRow>, StoreError> {
    Ok(sessions::table
        .filter(sessions::id.eq(id))
        .select(SessionRow::as_select())
        .first(conn)
        .optional()?)
}

/// The logical root of `id` (a child id resolves to its root).
pub fn root_of(conn: &mut SqliteConnection, id: &str) -> Result<SessionRow, StoreError> {
    let row = find(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("no session {id}")))?;
    if row.root_id == row.id {
        return Ok(row);
    }
    find(conn, &row.root_id)?
        .ok_or_else(|| StoreError::NotFound(format!("no session {}", row.root_id)))
}

/// Every root session (for the operator view).
pub fn list_roots(conn: &mut SqliteConnection, limit: i64) -> Result<Vec<SessionRow>, StoreError> {
    Ok(sessions::table
        .filter(sessions::parent_session_id.is_null())
        .order(sessions::started_at.desc())
        .limit(limit)
        .select(SessionRow::as_select())
        .load(conn)?)
}

/// The result of a compaction, to commit atomically.
pub struct Compaction {
    pub root_id: String,
    pub old_tip: String,
    pub child_id: Option<String>,
    pub system_prompt: Option<String>,
    pub messages: Vec<NewMessage>,
}

/// Commit a compaction: with a child id, rotate (child row, old tip ended by compression, compacted
/// transcript in the child, root's tip moved); without, in place (old rows inactive, compacted
/// rows added). One transaction, fenced by epoch, the running generation and the current tip.
pub fn commit_compaction(
    conn: &mut SqliteConnection,
    epoch: i64,
    generation: i64,
    c: &Compaction,
    now: f64,
) -> Result<String, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let root =
            find(conn, &c.root_id)?.ok_or_else(|| StoreError::NotFound(c.root_id.clone()))?;
        if root.tip_session_id != c.old_tip || root.runtime_generation != generation {
            return Err(StoreError::StaleGeneration(
                "the session moved on during compaction".into(),
            ));
        }
        let target = match &c.child_id {
            Some(child) => {
                let old = find(conn, &c.old_tip)?
                    .ok_or_else(|| StoreError::NotFound(c.old_tip.clone()))?;
                diesel::update(sessions::table.filter(sessions::id.eq(&c.old_tip)))
                    .set((
                        sessions::ended_at.eq(now),
                        sessions::end_reason.eq("compression"),
                    ))
                    .execute(conn)?;
                let lineage = old.compression_count + 1;
                let title = old.title.as_ref().map(|t| format!("{t} #{}", lineage + 1));
                diesel::insert_into(sessions::table)
                    .values((
                        sessions::id.eq(child),
                        sessions::root_id.eq(&root.id),
                        sessions::parent_session_id.eq(&c.old_tip),
                        sessions::tip_session_id.eq(child),
                        sessions::principal_id.eq(&old.principal_id),
                        sessions::request_id.eq(&old.request_id),
                        sessions::request_digest.eq(&old.request_digest),
                        sessions::source.eq(&old.source),
                        sessions::model.eq(&old.model),
                        sessions::provider.eq(&old.provider),
                        sessions::base_url.eq(&old.base_url),
                        sessions::cwd.eq(&old.cwd),
                        sessions::toolsets_json.eq(&old.toolsets_json),
                        sessions::profile.eq(&old.profile),
                        sessions::title.eq(title),
                        sessions::system_prompt.eq(&c.system_prompt),
                        sessions::compression_count.eq(lineage),
                        sessions::started_at.eq(now),
                    ))
                    .execute(conn)?;
                diesel::update(sessions::table.filter(sessions::id.eq(&root.id)))
                    .set(sessions::tip_session_id.eq(child))
                    .execute(conn)?;
                child.clone()
            }
            None => {
                diesel::update(
                    messages::table
                        .filter(messages::session_id.eq(&c.old_tip))
                        .filter(messages::active.eq(1)),
                )
                .set((messages::active.eq(0), messages::compacted.eq(1)))
                .execute(conn)?;
                diesel::update(sessions::table.filter(sessions::id.eq(&c.old_tip)))
                    .set((
                        sessions::system_prompt.eq(&c.system_prompt),
                        sessions::compression_count.eq(sessions::compression_count + 1),
                    ))
                    .execute(conn)?;
                c.old_tip.clone()
            }
        };
        let rows: Vec<NewMessage> = c
            .messages
            .iter()
            .cloned()
            .map(|m| NewMessage {
                session_id: target.clone(),
                ..m
            })
            .collect();
        insert_messages(conn, &rows, now)?;
        Ok(target)
    })
}

/// Add token usage to the root's totals.
pub fn add_usage(
    conn: &mut SqliteConnection,
    root_id: &str,
    prompt: i64,
    completion: i64,
) -> Result<(), StoreError> {
    super::write_tx(conn, |conn| {
        hot_sql!(
            "UPDATE sessions SET prompt_tokens = prompt_tokens + ?, \
             completion_tokens = completion_tokens + ? WHERE id = ?",
            &[
                Bind::Int(prompt),
                Bind::Int(completion),
                Bind::Text(root_id),
            ],
        )
        .execute(conn)?;
        Ok(())
    })
}

/// Store the system prompt built for a session on its first turn.
pub fn set_system_prompt(
    conn: &mut SqliteConnection,
    id: &str,
    prompt: &str,
) -> Result<(), StoreError> {
    diesel::update(
        sessions::table
            .filter(sessions::id.eq(id))
            .filter(sessions::system_prompt.is_null()),
    )
    .set(sessions::system_prompt.eq(prompt))
    .execute(conn)?;
    Ok(())
}
