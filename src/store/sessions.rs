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
    /// The session's place in creation order (1, 2, 3, …): it leads the keys of the session's
    /// rows in the ledger, the messages and the event log, so that sessions created together
    /// share index leaves (see `migrations/2026-12-02-000010_sessions_in_creation_order`).
    pub ordinal: i64,
}

impl SessionRow {
    /// The session's frozen toolsets; a stored value that is not a list of names is refused
    /// (fail closed: it is not read as "no tools", nor as anything else).
    pub fn toolsets(&self) -> Result<Vec<String>, StoreError> {
        parse_toolsets(&self.id, &self.toolsets_json)
    }
}

/// A session's stored toolsets (`toolsets_json`), or [`StoreError::CorruptPolicy`].
pub fn parse_toolsets(session: &str, stored: &str) -> Result<Vec<String>, StoreError> {
    serde_json::from_str(stored).map_err(|e| {
        StoreError::CorruptPolicy(format!(
            "session {session}: its stored toolsets are not a list of names ({e})"
        ))
    })
}

/// The session's ordinal, once its launch policy is found intact: what a claim checks before
/// it starts anything of the session (one read of the row either way).
pub fn ordinal_of_intact(conn: &mut SqliteConnection, id: &str) -> Result<i64, StoreError> {
    let (ordinal, toolsets): (i64, String) = hot_sql!(
        "SELECT ordinal, toolsets_json FROM sessions WHERE id = ?",
        &[Bind::Text(id)]
    )
    .returning::<(diesel::sql_types::BigInt, diesel::sql_types::Text)>()
    .get_result(conn)
    .optional()?
    .ok_or_else(|| StoreError::NotFound(format!("no session {id}")))?;
    parse_toolsets(id, &toolsets)?;
    Ok(ordinal)
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
    /// A history the session starts with (a chat-completions conversation that arrives with
    /// earlier turns), written with the session in its transaction.
    pub seed: Vec<super::messages::NewMessage>,
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
                sessions::ordinal.eq(next_ordinal(conn)?),
            ))
            .execute(conn)?;
        let row =
            find(conn, &new.id)?.ok_or_else(|| StoreError::Other("session vanished".into()))?;
        if !new.seed.is_empty() {
            let seed: Vec<super::messages::NewMessage> = new
                .seed
                .iter()
                .cloned()
                .map(|m| super::messages::NewMessage {
                    session_id: row.id.clone(),
                    ..m
                })
                .collect();
            super::messages::insert_messages_knowing(
                conn,
                &seed,
                Some((&row.id, row.ordinal)),
                now,
            )?;
        }
        Ok((row, true))
    })
}

/// The ordinal a new session takes: one more than the largest (a seek on its unique index). Only
/// the writer inserts sessions, one transaction at a time, so two never take the same one (and
/// the unique index would refuse the second).
fn next_ordinal(conn: &mut SqliteConnection) -> Result<i64, StoreError> {
    Ok(
        hot_sql!("SELECT coalesce(max(ordinal), 0) + 1 FROM sessions", &[])
            .returning::<diesel::sql_types::BigInt>()
            .get_result(conn)?,
    )
}

/// The creation ordinal of session `id` ([`SessionRow::ordinal`]); `not_found` when there is no
/// such session.
pub fn ordinal(conn: &mut SqliteConnection, id: &str) -> Result<i64, StoreError> {
    find_ordinal(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("no session {id}")))
}

/// [`ordinal`], with `None` when there is no such session.
pub fn find_ordinal(conn: &mut SqliteConnection, id: &str) -> Result<Option<i64>, StoreError> {
    Ok(hot_sql!(
        "SELECT ordinal FROM sessions WHERE id = ?",
        &[Bind::Text(id)]
    )
    .returning::<diesel::sql_types::BigInt>()
    .get_result(conn)
    .optional()?)
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
    find_root(conn, id)?.ok_or_else(|| StoreError::NotFound(format!("no session {id}")))
}

/// [`root_of`], or none when `id` is no session.
pub fn find_root(conn: &mut SqliteConnection, id: &str) -> Result<Option<SessionRow>, StoreError> {
    let Some(row) = find(conn, id)? else {
        return Ok(None);
    };
    if row.root_id == row.id {
        return Ok(Some(row));
    }
    find(conn, &row.root_id)?
        .map(Some)
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

/// The title of the session after `old` in its lineage: "T" → "T #2" → "T #3" (not "T #2 #3"; a
/// user's own "Issue #42" stays whole).
fn next_title(title: Option<&str>, compression_count: i32) -> Option<String> {
    let number = compression_count + 1;
    title.map(|t| {
        let own = format!(" #{number}");
        let base = match t.strip_suffix(&own) {
            Some(base) if compression_count > 0 => base,
            _ => t,
        };
        format!("{base} #{}", number + 1)
    })
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
        super::admissions::require_running(conn, epoch, &root.id, generation)?;
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
                let title = next_title(old.title.as_deref(), old.compression_count);
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
                        sessions::ordinal.eq(next_ordinal(conn)?),
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
                        .filter(messages::session_ordinal.eq(ordinal(conn, &c.old_tip)?))
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

/// Store the system prompt built for a session on its first turn. Fenced by the epoch, as
/// every write is.
pub fn set_system_prompt(
    conn: &mut SqliteConnection,
    epoch: i64,
    id: &str,
    prompt: &str,
) -> Result<(), StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        diesel::update(
            sessions::table
                .filter(sessions::id.eq(id))
                .filter(sessions::system_prompt.is_null()),
        )
        .set(sessions::system_prompt.eq(prompt))
        .execute(conn)?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::{self, Count, Detail};
    use crate::store::{admissions, epoch, events, messages};
    use diesel::connection::SimpleConnection;
    use diesel_migrations::MigrationHarness;

    /// The system prompt of a session made before prompts were built at creation is written
    /// under the epoch: a process whose authority another took writes nothing.
    #[test]
    fn a_system_prompt_is_written_under_the_epoch() {
        let (_dir, mut c) = testing::conn();
        let old = epoch::begin_epoch(&mut c, "old", 1.0).expect("epoch");
        testing::session(&mut c, old, "s");
        let new = epoch::begin_epoch(&mut c, "new", 2.0).expect("epoch");
        assert!(matches!(
            set_system_prompt(&mut c, old, "s", "stale"),
            Err(StoreError::StaleEpoch)
        ));
        assert_eq!(
            find(&mut c, "s")
                .expect("read")
                .and_then(|r| r.system_prompt),
            None
        );
        set_system_prompt(&mut c, new, "s", "current").expect("written");
        let prompt = find(&mut c, "s")
            .expect("read")
            .and_then(|r| r.system_prompt);
        assert_eq!(prompt.as_deref(), Some("current"));
    }

    #[test]
    fn a_lineage_numbers_its_titles_once() {
        assert_eq!(next_title(Some("T"), 0).as_deref(), Some("T #2"));
        assert_eq!(next_title(Some("T #2"), 1).as_deref(), Some("T #3"));
        assert_eq!(next_title(Some("T #3"), 2).as_deref(), Some("T #4"));
        // A user's own number is part of the title.
        assert_eq!(
            next_title(Some("Issue #1"), 0).as_deref(),
            Some("Issue #1 #2")
        );
        assert_eq!(
            next_title(Some("Issue #2"), 0).as_deref(),
            Some("Issue #2 #2")
        );
        assert_eq!(next_title(None, 3), None);
    }

    fn texts(c: &mut SqliteConnection, sql: &str) -> Vec<String> {
        diesel::sql_query(sql)
            .load::<Detail>(c)
            .expect(sql)
            .into_iter()
            .map(|d| d.detail)
            .collect()
    }

    fn count(c: &mut SqliteConnection, sql: &str) -> i64 {
        diesel::sql_query(sql).get_result::<Count>(c).expect(sql).n
    }

    /// Rows of three sessions, created in an order their ids do not sort in, as the schema before
    /// ordinals held them (with rowids and a pruning walk's mark to keep).
    fn old_store() -> (testing::tempfile_dir::TempDir, SqliteConnection, i64) {
        let (dir, mut c) = testing::conn_just_before("_sessions_in_creation_order");
        let e = epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch");
        for id in ["s-b", "s-a", "s-c"] {
            testing::session(&mut c, e, id);
        }
        // The replayed input must match its digest.
        let two = serde_json::json!({"text": "two"}).to_string();
        c.batch_execute(&format!(
            r#"INSERT INTO session_admissions (seq, admission_id, request_id, principal_id,
                 target_session_id, payload_json, payload_digest, status, outcome, owner_epoch,
                 execution_generation, created_at, updated_at) VALUES
               (3, 'a3', 'r3', 'p', 's-a', '{{"text":"one"}}', 'd3', 'terminal', 'completed', 1, 1, 1.0, 1.0),
               (7, 'a7', 'r7', 'p', 's-a', '{two}', '{two_digest}', 'queued', NULL, 1, NULL, 2.0, 2.0),
               (8, 'a8', 'r8', 'p', 's-b', '{{"text":"three"}}', 'd8', 'queued', NULL, 1, NULL, 3.0, 3.0);
               INSERT INTO messages (id, session_id, role, content, active, timestamp) VALUES
               (4, 's-b', 'user', 'b one', 1, 1.0), (9, 's-a', 'user', 'a one', 1, 2.0),
               (11, 's-b', 'assistant', 'b two', 1, 3.0), (12, 's-b', 'user', 'b old', 0, 0.5);
               INSERT INTO session_event_batches (rowid, session_id, last_seq, first_seq,
                 events_json, created_at) VALUES
               (5, 's-a', 2, 1, '[["a",1],["a",2]]', 1.0), (6, 's-b', 1, 1, '[["b",1]]', 2.0),
               (9, 's-a', 3, 3, '[["a",3]]', 3.0);
               INSERT INTO state_meta (key, value) VALUES ('session_events.count_rule_seen', '6');"#,
            two_digest = admissions::digest("s-a", &two),
        ))
        .expect("old rows");
        (dir, c, e)
    }

    /// The migration to session ordinals numbers the sessions in the order they were created and
    /// copies every row of the ledger, the messages and the event log with its session's ordinal
    /// and its own rowid; everything reads back the same through the new keys, new sessions and
    /// rows go on from there, and the down migration gives the old tables back.
    #[test]
    fn the_ordinals_migration_keeps_every_row_in_creation_order() {
        let (_dir, mut c, e) = old_store();
        c.run_pending_migrations(crate::store::MIGRATIONS)
            .expect("migrate");
        let ordinals = |c: &mut SqliteConnection| {
            ["s-b", "s-a", "s-c"].map(|id| ordinal(c, id).expect("ordinal"))
        };
        assert_eq!(ordinals(&mut c), [1, 2, 3]);
        assert_eq!(
            texts(
                &mut c,
                "SELECT seq || ' ' || target_session_id || ' ' || session_ordinal AS detail \
                 FROM session_admissions ORDER BY seq"
            ),
            ["3 s-a 2", "7 s-a 2", "8 s-b 1"]
        );
        assert_eq!(
            texts(
                &mut c,
                "SELECT id || ' ' || session_id || ' ' || session_ordinal AS detail \
                 FROM messages ORDER BY id"
            ),
            ["4 s-b 1", "9 s-a 2", "11 s-b 1", "12 s-b 1"]
        );
        assert_eq!(
            texts(
                &mut c,
                "SELECT rowid || ' ' || session_id || ' ' || session_ordinal || ' ' || last_seq \
                 AS detail FROM session_event_batches ORDER BY rowid"
            ),
            ["5 s-a 2 2", "6 s-b 1 1", "9 s-a 2 3"]
        );
        // Read back through the new keys.
        let live = |c: &mut SqliteConnection, id: &str| -> Vec<String> {
            messages::live(c, id)
                .expect("live")
                .into_iter()
                .filter_map(|m| m.content)
                .collect()
        };
        assert_eq!(live(&mut c, "s-b"), ["b one", "b two"]);
        assert_eq!(live(&mut c, "s-a"), ["a one"]);
        let pending = |c: &mut SqliteConnection, id: &str| -> Vec<i64> {
            admissions::pending(c, id)
                .expect("pending")
                .iter()
                .map(|(r, _)| r.seq)
                .collect()
        };
        assert_eq!(pending(&mut c, "s-a"), [7]);
        assert_eq!(pending(&mut c, "s-b"), [8]);
        assert_eq!(events::head(&mut c, "s-a").expect("head").last_seq, 3);
        assert_eq!(
            events::since(&mut c, "s-a", 1, 10)
                .expect("since")
                .events
                .iter()
                .map(|e| e.seq)
                .collect::<Vec<_>>(),
            [2, 3]
        );
        // An input replayed is found again; a new one goes on from the largest seq.
        let replay =
            admissions::admit(&mut c, e, "p", "s-a", "r7", "two", 100, 4.0).expect("replay");
        assert_eq!((replay.value.0.seq, replay.value.1), (7, false));
        let next = admissions::admit(&mut c, e, "p", "s-c", "r9", "four", 100, 4.0).expect("admit");
        assert_eq!((next.value.0.seq, next.value.0.session_ordinal), (9, 3));
        assert_eq!(
            next.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            [1],
            "s-c's log starts at 1"
        );
        // A new session takes the next ordinal.
        testing::session(&mut c, e, "s-0");
        assert_eq!(ordinal(&mut c, "s-0").expect("ordinal"), 4);
        assert!(matches!(
            ordinal(&mut c, "nobody"),
            Err(StoreError::NotFound(_))
        ));
        // Back to the old tables, every row still there.
        testing::revert_through(&mut c, "_sessions_in_creation_order");
        for (table, rows) in [
            ("session_admissions", 4),
            ("messages", 4),
            ("session_event_batches", 4),
        ] {
            assert_eq!(
                count(
                    &mut c,
                    &format!(
                        "SELECT count(*) AS n FROM pragma_table_info('{table}') \
                         WHERE name = 'session_ordinal'"
                    )
                ),
                0,
                "{table} has no ordinal"
            );
            assert_eq!(
                count(&mut c, &format!("SELECT count(*) AS n FROM {table}")),
                rows,
                "{table}"
            );
        }
    }

    /// A row whose session is missing (possible only with foreign keys turned off) stops the
    /// migration instead of being left behind.
    #[test]
    fn the_ordinals_migration_never_drops_a_row() {
        let (_dir, mut c, _) = old_store();
        c.batch_execute(
            "PRAGMA foreign_keys = OFF; INSERT INTO messages (id, session_id, role, content, \
             active, timestamp) VALUES (20, 'gone', 'user', 'orphan', 1, 4.0);",
        )
        .expect("orphan");
        assert!(c.run_pending_migrations(crate::store::MIGRATIONS).is_err());
        assert_eq!(
            count(&mut c, "SELECT count(*) AS n FROM messages WHERE id = 20"),
            1
        );
    }

    /// The session-keyed statements of a turn seek the new keys.
    #[test]
    fn session_keyed_reads_seek_the_ordinal_keys() {
        let (_dir, mut c) = testing::conn();
        for (sql, index) in [
            (
                "SELECT id FROM messages WHERE session_ordinal = 1 AND active = 1 ORDER BY id",
                "messages_live",
            ),
            (
                "SELECT seq FROM session_admissions WHERE session_ordinal = 1 \
                 AND principal_id = 'p' AND request_id = 'r'",
                "sqlite_autoindex_session_admissions_2",
            ),
            (
                "SELECT coalesce(max(ordinal), 0) + 1 FROM sessions",
                "sessions_ordinal",
            ),
        ] {
            let plan = testing::query_plan(&mut c, sql);
            assert!(plan.iter().any(|d| d.contains(index)), "{sql}: {plan:?}");
        }
    }
}
