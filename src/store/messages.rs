//! Transcripts. The live transcript of a session is `WHERE session_ordinal=? AND active=1 ORDER BY
//! id`, through the key `messages_live`.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;

use super::epoch::check_epoch;
use super::schema::{messages, sessions};
use crate::error::StoreError;

#[derive(Debug, Clone, Queryable, Selectable, serde::Serialize)]
#[diesel(table_name = messages)]
pub struct MessageRow {
    pub id: i64,
    pub session_id: String,
    pub session_ordinal: i64,
    pub role: String,
    pub content: Option<String>,
    pub tool_call_id: Option<String>,
    pub tool_calls: Option<String>,
    pub tool_name: Option<String>,
    pub finish_reason: Option<String>,
    pub display_kind: Option<String>,
    pub admission_id: Option<String>,
    pub active: i32,
    pub compacted: i32,
    pub timestamp: f64,
    /// The model's reasoning that came with an assistant message.
    pub reasoning: Option<String>,
}

/// A message to append.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewMessage {
    pub session_id: String,
    pub role: String,
    pub content: Option<String>,
    pub tool_call_id: Option<String>,
    pub tool_calls: Option<String>,
    pub tool_name: Option<String>,
    pub finish_reason: Option<String>,
    pub display_kind: Option<String>,
    pub admission_id: Option<String>,
    /// The model's reasoning that came with an assistant message; sent back with it.
    pub reasoning: Option<String>,
}

impl NewMessage {
    pub fn text(role: &str, content: impl Into<String>) -> NewMessage {
        NewMessage {
            role: role.into(),
            content: Some(content.into()),
            ..Default::default()
        }
    }

    pub fn from_row(row: &MessageRow) -> NewMessage {
        NewMessage {
            session_id: row.session_id.clone(),
            role: row.role.clone(),
            content: row.content.clone(),
            tool_call_id: row.tool_call_id.clone(),
            tool_calls: row.tool_calls.clone(),
            tool_name: row.tool_name.clone(),
            finish_reason: row.finish_reason.clone(),
            display_kind: row.display_kind.clone(),
            admission_id: row.admission_id.clone(),
            reasoning: row.reasoning.clone(),
        }
    }
}

pub(crate) fn insert_messages(
    conn: &mut SqliteConnection,
    rows: &[NewMessage],
    now: f64,
) -> Result<(), StoreError> {
    insert_messages_knowing(conn, rows, None, now)
}

/// [`insert_messages`] for a caller that has read the ordinal of one session already, `known`
/// as `(session_id, ordinal)`: rows of that session need no lookup.
pub(crate) fn insert_messages_knowing(
    conn: &mut SqliteConnection,
    rows: &[NewMessage],
    known: Option<(&str, i64)>,
    now: f64,
) -> Result<(), StoreError> {
    // The rows of one call are almost always one session's: its ordinal is looked up once.
    let mut ordinal = known;
    for m in rows {
        let session_ordinal = match ordinal {
            Some((id, n)) if id == m.session_id => n,
            _ => {
                let n = super::sessions::ordinal(conn, &m.session_id)?;
                ordinal = Some((&m.session_id, n));
                n
            }
        };
        diesel::insert_into(messages::table)
            .values((
                messages::session_id.eq(&m.session_id),
                messages::session_ordinal.eq(session_ordinal),
                messages::role.eq(&m.role),
                messages::content.eq(&m.content),
                messages::tool_call_id.eq(&m.tool_call_id),
                messages::tool_calls.eq(&m.tool_calls),
                messages::tool_name.eq(&m.tool_name),
                messages::finish_reason.eq(&m.finish_reason),
                messages::display_kind.eq(&m.display_kind),
                messages::admission_id.eq(&m.admission_id),
                messages::timestamp.eq(now),
                messages::reasoning.eq(&m.reasoning),
            ))
            .execute(conn)?;
    }
    Ok(())
}

/// Append messages for the running attempt `generation` of root `root_id`, into the root's
/// current tip. Fenced: a stale attempt (older generation, or another epoch) writes nothing.
pub fn append_for_attempt(
    conn: &mut SqliteConnection,
    epoch: i64,
    root_id: &str,
    generation: i64,
    rows: &[NewMessage],
    now: f64,
) -> Result<String, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let (tip, current): (String, i64) = sessions::table
            .filter(sessions::id.eq(root_id))
            .select((sessions::tip_session_id, sessions::runtime_generation))
            .first(conn)?;
        if current != generation {
            return Err(StoreError::StaleGeneration(format!(
                "attempt {generation} is not the running one ({current})"
            )));
        }
        super::admissions::require_running(conn, epoch, root_id, generation)?;
        let rows: Vec<NewMessage> = rows
            .iter()
            .cloned()
            .map(|m| NewMessage {
                session_id: tip.clone(),
                ..m
            })
            .collect();
        insert_messages(conn, &rows, now)?;
        Ok(tip)
    })
}

/// The live transcript of one physical session (none for a session that does not exist).
pub fn live(conn: &mut SqliteConnection, session_id: &str) -> Result<Vec<MessageRow>, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session_id)? else {
        return Ok(Vec::new());
    };
    Ok(live_in_order(ordinal)
        .select(MessageRow::as_select())
        .load(conn)?)
}

/// The first `limit` messages of [`live`].
pub fn live_up_to(
    conn: &mut SqliteConnection,
    session_id: &str,
    limit: i64,
) -> Result<Vec<MessageRow>, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session_id)? else {
        return Ok(Vec::new());
    };
    Ok(live_in_order(ordinal)
        .limit(limit)
        .select(MessageRow::as_select())
        .load(conn)?)
}

/// A session's live messages, oldest first (through its key, led by the session's ordinal).
#[diesel::dsl::auto_type(no_type_alias)]
fn live_in_order(ordinal: i64) -> _ {
    messages::table
        .filter(messages::session_ordinal.eq(ordinal))
        .filter(messages::active.eq(1_i32))
        .order(messages::id.asc())
}

/// What is known of the tool calls a turn left without a stored result.
#[derive(Debug, Clone, Copy)]
pub enum OpenCalls<'a> {
    /// The turn ended in this process: such a call did not run, unless its result is here (it
    /// ran, and the write of its result failed).
    Ended(&'a [NewMessage]),
    /// The process stopped during the turn: such a call may have run, in part or in full.
    Lost,
}

/// What closes a transcript whose turn ended without a reply, so the next input is its own user
/// message: a result for every tool call that never got a stored one (what `open` knows of it:
/// the model must not be told a tool that ran did not), then an assistant note when the tail is
/// a user or tool message.
pub fn closing_messages(
    live: &[MessageRow],
    note: &str,
    admission_id: Option<&str>,
    open: OpenCalls<'_>,
) -> Vec<NewMessage> {
    let mut out = Vec::new();
    let Some(last_assistant) = live.iter().rposition(|m| m.role == "assistant") else {
        if live.last().is_some_and(|m| m.role == "user") {
            out.push(closing_note(note, admission_id));
        }
        return out;
    };
    let answered: std::collections::HashSet<&str> = live[last_assistant..]
        .iter()
        .filter_map(|m| m.tool_call_id.as_deref())
        .collect();
    if let Some(calls) = live[last_assistant].tool_calls.as_deref() {
        let calls: Vec<serde_json::Value> = serde_json::from_str(calls).unwrap_or_default();
        for call in calls {
            let id = call.get("id").and_then(|v| v.as_str()).unwrap_or_default();
            if !id.is_empty() && !answered.contains(id) {
                let ran = match open {
                    OpenCalls::Ended(results) => results
                        .iter()
                        .find(|m| m.tool_call_id.as_deref() == Some(id)),
                    OpenCalls::Lost => None,
                };
                if let Some(result) = ran {
                    out.push(NewMessage {
                        display_kind: Some("unrecorded_result".into()),
                        ..result.clone()
                    });
                    continue;
                }
                let name = call
                    .pointer("/function/name")
                    .and_then(|v| v.as_str())
                    .unwrap_or("tool");
                let content = match open {
                    OpenCalls::Ended(_) => {
                        format!(
                            "[Tool execution cancelled: {name} did not run because the turn ended]"
                        )
                    }
                    OpenCalls::Lost => format!(
                        "[Tool result lost: the gateway stopped while {name} was running or about \
                         to run. It may have run, in part or in full: check its effects before \
                         running it again]"
                    ),
                };
                out.push(NewMessage {
                    role: "tool".into(),
                    content: Some(content),
                    tool_call_id: Some(id.to_string()),
                    tool_name: Some(name.to_string()),
                    display_kind: Some("stub_result".into()),
                    admission_id: admission_id.map(str::to_string),
                    ..Default::default()
                });
            }
        }
    }
    let tail_role = if out.is_empty() {
        live.last().map(|m| m.role.as_str())
    } else {
        Some("tool")
    };
    if matches!(tail_role, Some("user") | Some("tool")) {
        out.push(closing_note(note, admission_id));
    }
    out
}

fn closing_note(note: &str, admission_id: Option<&str>) -> NewMessage {
    NewMessage {
        role: "assistant".into(),
        content: Some(note.to_string()),
        finish_reason: Some("interrupted".into()),
        display_kind: Some("failed_turn".into()),
        admission_id: admission_id.map(str::to_string),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: i64, role: &str, calls: Option<&str>, call_id: Option<&str>) -> MessageRow {
        MessageRow {
            id,
            session_id: "s".into(),
            session_ordinal: 1,
            role: role.into(),
            content: Some("x".into()),
            tool_call_id: call_id.map(str::to_string),
            tool_calls: calls.map(str::to_string),
            tool_name: None,
            finish_reason: None,
            display_kind: None,
            admission_id: None,
            active: 1,
            compacted: 0,
            timestamp: 0.0,
            reasoning: None,
        }
    }

    /// A settled attempt writes no more to its transcript, though its generation is still the
    /// session's last (it moves at the next claim only).
    #[test]
    fn a_settled_attempt_appends_nothing() {
        use crate::store::testing;
        let (_d, mut c, e, started) = testing::started_turn();
        let g = started.execution_generation.expect("generation");
        let reply = [NewMessage::text("assistant", "step".to_string())];
        append_for_attempt(&mut c, e, "s1", g, &reply, 3.0).expect("running: appended");
        testing::settle_bare(&mut c, e, &started, "interrupted", 4.0);
        let late = append_for_attempt(&mut c, e, "s1", g, &reply, 5.0);
        assert!(
            matches!(late, Err(StoreError::StaleGeneration(_))),
            "{late:?}"
        );
        let steps = live(&mut c, "s1")
            .expect("live")
            .iter()
            .filter(|m| m.content.as_deref() == Some("step"))
            .count();
        assert_eq!(steps, 1);
    }

    #[test]
    fn closing_a_bare_user_tail_adds_an_assistant_note() {
        let out = closing_messages(
            &[row(1, "user", None, None)],
            "interrupted",
            None,
            OpenCalls::Ended(&[]),
        );
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].role, "assistant");
    }

    #[test]
    fn closing_dangling_tool_calls_adds_stubs_then_a_note() {
        let calls = r#"[{"id":"a","function":{"name":"terminal"}},{"id":"b","function":{"name":"clarify"}}]"#;
        let live = [
            row(1, "user", None, None),
            row(2, "assistant", Some(calls), None),
            row(3, "tool", None, Some("a")),
        ];
        let out = closing_messages(&live, "interrupted", None, OpenCalls::Ended(&[]));
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["tool", "assistant"]);
        assert_eq!(out[0].tool_call_id.as_deref(), Some("b"));
        let said = |m: &NewMessage| m.content.clone().unwrap_or_default();
        assert!(said(&out[0]).contains("did not run"), "{}", said(&out[0]));
        // A result whose write failed stands for the call: it ran.
        let ran = NewMessage {
            role: "tool".into(),
            content: Some("the output".into()),
            tool_call_id: Some("b".into()),
            ..Default::default()
        };
        let out = closing_messages(&live, "failed", None, OpenCalls::Ended(&[ran]));
        assert_eq!(said(&out[0]), "the output");
        // After a crash nobody knows whether it ran: it is not said that it did not (the
        // model would run it again).
        let out = closing_messages(&live, "lost", None, OpenCalls::Lost);
        assert!(!said(&out[0]).contains("did not run"), "{}", said(&out[0]));
        assert!(said(&out[0]).contains("may have run"), "{}", said(&out[0]));
    }

    #[test]
    fn a_closed_transcript_needs_nothing() {
        let live = [row(1, "user", None, None), row(2, "assistant", None, None)];
        assert!(closing_messages(&live, "interrupted", None, OpenCalls::Ended(&[])).is_empty());
    }

    /// The messages as the lean-messages migration leaves them: every row with its id, a
    /// session's transcript in the same order, new ids going on from the largest, and no
    /// `sqlite_sequence` entry left.
    #[test]
    fn the_lean_messages_migration_keeps_every_message() {
        use crate::store::{epoch, testing};
        use diesel::connection::SimpleConnection;
        use diesel_migrations::MigrationHarness;
        let (_dir, mut c) = testing::conn_just_before("_lean_messages");
        let e = epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch");
        testing::session(&mut c, e, "s1");
        c.batch_execute(
            "INSERT INTO messages (id, session_id, role, content, active, timestamp) VALUES \
             (4, 's1', 'user', 'one', 1, 1.0), (9, 's1', 'assistant', 'two', 1, 2.0), \
             (11, 's1', 'user', 'old', 0, 0.5);",
        )
        .expect("old messages");
        c.run_pending_migrations(crate::store::MIGRATIONS)
            .expect("migrate");
        assert_eq!(testing::sequence_entries(&mut c, "messages"), 0);
        let next = NewMessage {
            session_id: "s1".into(),
            role: "user".into(),
            content: Some("three".into()),
            ..Default::default()
        };
        insert_messages(&mut c, &[next], 3.0).expect("insert");
        assert_eq!(
            live(&mut c, "s1")
                .expect("live")
                .iter()
                .map(|m| (m.id, m.content.clone().unwrap_or_default()))
                .collect::<Vec<_>>(),
            vec![
                (4, "one".to_string()),
                (9, "two".to_string()),
                (12, "three".to_string())
            ]
        );
    }
}
