//! The durable per-session event log.
//!
//! Every notification that reports a committed state change (an admission, a claim, a settlement,
//! a prompt opened or settled, tool activity) is appended here by the transition that makes the
//! change, in the same transaction, with the session's next sequence number (`+1`, never reused).
//! Streaming deltas are not stored. Old events are pruned by age and count
//! ([`prune`]); a reader asking for events that were pruned is told `truncated`.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Double};
use diesel::sqlite::SqliteConnection;
use serde_json::{json, Value};

use super::{Bind, HotSql};
use crate::error::StoreError;

/// Hand-written table definitions (see `migrations/2026-11-29-000003_session_events/up.sql`).
pub mod schema {
    diesel::table! {
        session_events (session_id, seq) {
            session_id -> Text,
            seq -> BigInt,
            #[sql_name = "type"]
            kind -> Text,
            payload_json -> Text,
            created_at -> Double,
        }
    }

    diesel::table! {
        session_event_heads (session_id) {
            session_id -> Text,
            last_seq -> BigInt,
            pruned_through -> BigInt,
        }
    }
}

use schema::{session_event_heads as heads, session_events as ev};

/// An event to append: its type (`message.complete`, `approval.request`, …) and payload.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub kind: String,
    pub payload: Value,
}

impl NewEvent {
    pub fn new(kind: impl Into<String>, payload: Value) -> NewEvent {
        NewEvent {
            kind: kind.into(),
            payload,
        }
    }
}

/// One stored event.
#[derive(Debug, Clone, PartialEq, Queryable, Selectable)]
#[diesel(table_name = ev)]
pub struct EventRow {
    pub session_id: String,
    pub seq: i64,
    pub kind: String,
    pub payload_json: String,
    pub created_at: f64,
}

impl EventRow {
    pub fn payload(&self) -> Value {
        serde_json::from_str(&self.payload_json).unwrap_or(Value::Null)
    }

    /// The wire form shared by WebSocket notifications, `session.events.since` and SSE:
    /// `{type, session_id, seq, payload, created_at}`.
    pub fn to_wire(&self) -> Value {
        json!({
            "type": self.kind,
            "session_id": self.session_id,
            "seq": self.seq,
            "payload": self.payload(),
            "created_at": self.created_at,
        })
    }
}

/// A transition's result together with the events it appended (in seq order).
#[derive(Debug)]
pub struct Logged<T> {
    pub value: T,
    pub events: Vec<EventRow>,
}

impl<T> Logged<T> {
    pub fn new(value: T, events: Vec<EventRow>) -> Logged<T> {
        Logged { value, events }
    }

    /// A result that appended nothing.
    pub fn quiet(value: T) -> Logged<T> {
        Logged {
            value,
            events: Vec::new(),
        }
    }
}

/// A session's position in its log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Head {
    /// The last sequence number handed out (0: none yet).
    pub last_seq: i64,
    /// Every event up to and including this one was pruned.
    pub pruned_through: i64,
}

pub fn head(conn: &mut SqliteConnection, session: &str) -> Result<Head, StoreError> {
    Ok(heads::table
        .filter(heads::session_id.eq(session))
        .select((heads::last_seq, heads::pruned_through))
        .first::<(i64, i64)>(conn)
        .optional()?
        .map(|(last_seq, pruned_through)| Head {
            last_seq,
            pruned_through,
        })
        .unwrap_or_default())
}

/// Append `events` to `session`'s log. Call inside the transaction of the change they report.
pub fn append(
    conn: &mut SqliteConnection,
    session: &str,
    events: &[NewEvent],
    now: f64,
) -> Result<Vec<EventRow>, StoreError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let n = events.len() as i64;
    // Advance the head and read where it ended in one statement that stays prepared (the
    // first append of a session creates its head row).
    let advance = |conn: &mut SqliteConnection| {
        HotSql::new(
            "UPDATE session_event_heads SET last_seq = last_seq + ? WHERE session_id = ? \
             RETURNING last_seq",
            &[Bind::Int(n), Bind::Text(session)],
        )
        .returning::<BigInt>()
        .get_result::<i64>(conn)
        .optional()
    };
    let end = match advance(conn)? {
        Some(end) => end,
        None => {
            diesel::insert_into(heads::table)
                .values(heads::session_id.eq(session))
                .execute(conn)?;
            advance(conn)?
                .ok_or_else(|| StoreError::Other(format!("no event head for session {session}")))?
        }
    };
    let last = end - n;
    let mut rows = Vec::with_capacity(events.len());
    for (i, e) in events.iter().enumerate() {
        let row = EventRow {
            session_id: session.to_string(),
            seq: last + 1 + i as i64,
            kind: e.kind.clone(),
            payload_json: e.payload.to_string(),
            created_at: now,
        };
        diesel::insert_into(ev::table)
            .values((
                ev::session_id.eq(&row.session_id),
                ev::seq.eq(row.seq),
                ev::kind.eq(&row.kind),
                ev::payload_json.eq(&row.payload_json),
                ev::created_at.eq(row.created_at),
            ))
            .execute(conn)?;
        rows.push(row);
    }
    Ok(rows)
}

/// Append events that report no other state change (tool activity), in their own transaction.
pub fn append_tx(
    conn: &mut SqliteConnection,
    session: &str,
    events: &[NewEvent],
    now: f64,
) -> Result<Vec<EventRow>, StoreError> {
    super::write_tx(conn, |conn| append(conn, session, events, now))
}

/// What a reader gets: the events after its position, and where to continue.
#[derive(Debug, Clone, PartialEq)]
pub struct Since {
    pub events: Vec<EventRow>,
    /// Pass this as `last_sequence` next time.
    pub last_sequence: i64,
    /// Some events after the requested position were pruned and cannot be sent.
    pub truncated: bool,
    /// `limit` cut the answer short: ask again from `last_sequence`.
    pub has_more: bool,
}

/// Up to `limit` events of `session` with `seq > after`, oldest first, read in one snapshot.
pub fn since(
    conn: &mut SqliteConnection,
    session: &str,
    after: i64,
    limit: i64,
) -> Result<Since, StoreError> {
    let limit = limit.max(1);
    let after = after.max(0);
    conn.transaction(|conn| {
        let h = head(conn, session)?;
        let mut events: Vec<EventRow> = ev::table
            .filter(ev::session_id.eq(session))
            .filter(ev::seq.gt(after))
            .order(ev::seq.asc())
            .limit(limit + 1)
            .select(EventRow::as_select())
            .load(conn)?;
        let has_more = events.len() as i64 > limit;
        events.truncate(limit as usize);
        let last_sequence = events
            .last()
            .map(|e| e.seq)
            .unwrap_or_else(|| after.min(h.last_seq).max(h.pruned_through));
        Ok(Since {
            truncated: after < h.pruned_through,
            events,
            last_sequence,
            has_more,
        })
    })
}

/// How long and how many events each session keeps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retention {
    /// Events older than this are pruned (≤ 0: no age limit).
    pub max_age_seconds: f64,
    /// At most this many of a session's newest events are kept (≥ 1).
    pub max_per_session: i64,
}

/// Prune every session's log by age and count, in one transaction; the number of events deleted.
/// `pruned_through` only moves forward, so `truncated` answers stay true once given.
///
/// It runs on the writer, so it reads only what it prunes: the heads (one row per session), the
/// events past the age cutoff (through the age index) and the ranges it deletes (through the
/// key), never the whole log.
pub fn prune(
    conn: &mut SqliteConnection,
    retention: Retention,
    now: f64,
) -> Result<usize, StoreError> {
    use diesel::sql_types::Text;
    #[derive(diesel::QueryableByName)]
    struct Through {
        #[diesel(sql_type = Text)]
        session_id: String,
        #[diesel(sql_type = BigInt)]
        pruned_through: i64,
    }
    let keep = retention.max_per_session.max(1);
    super::write_tx(conn, |conn| {
        let mut moved: Vec<Through> = diesel::sql_query(
            "UPDATE session_event_heads SET pruned_through = last_seq - ? \
             WHERE last_seq - ? > pruned_through RETURNING session_id, pruned_through",
        )
        .bind::<BigInt, _>(keep)
        .bind::<BigInt, _>(keep)
        .load(conn)?;
        if retention.max_age_seconds > 0.0 {
            let cutoff = now - retention.max_age_seconds;
            let old: Vec<Through> = diesel::sql_query(
                "SELECT session_id, MAX(seq) AS pruned_through \
                 FROM session_events INDEXED BY session_events_age \
                 WHERE created_at < ? GROUP BY session_id",
            )
            .bind::<Double, _>(cutoff)
            .load(conn)?;
            for o in old {
                let n = diesel::sql_query(
                    "UPDATE session_event_heads SET pruned_through = ? \
                     WHERE session_id = ? AND pruned_through < ?",
                )
                .bind::<BigInt, _>(o.pruned_through)
                .bind::<Text, _>(&o.session_id)
                .bind::<BigInt, _>(o.pruned_through)
                .execute(conn)?;
                if n > 0 {
                    moved.push(o);
                }
            }
        }
        let mut deleted = 0;
        for m in moved {
            deleted +=
                diesel::sql_query("DELETE FROM session_events WHERE session_id = ? AND seq <= ?")
                    .bind::<Text, _>(&m.session_id)
                    .bind::<BigInt, _>(m.pruned_through)
                    .execute(conn)?;
        }
        Ok(deleted)
    })
}

/// Prune every `every` (first right away) on the current arbiter, for the life of the process.
pub fn spawn_pruner(
    db: super::Db,
    clock: crate::clock::SharedClock,
    retention: Retention,
    every: std::time::Duration,
) {
    actix::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let now = clock.now();
            match db.write(move |c| prune(c, retention, now)).await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(pruned = n, "pruned session events"),
                Err(e) => tracing::warn!(error = %e, "cannot prune session events"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{epoch, testing};

    fn setup() -> (testing::tempfile_dir::TempDir, SqliteConnection) {
        let (d, mut conn) = testing::conn();
        let e = epoch::begin_epoch(&mut conn, "i", 1.0).expect("epoch");
        for id in ["s1", "s2"] {
            testing::session(&mut conn, e, id);
        }
        (d, conn)
    }

    fn ev(n: i64) -> NewEvent {
        NewEvent::new("tool.start", json!({ "n": n }))
    }

    #[test]
    fn sequences_are_per_session_and_gapless() {
        let (_d, mut c) = setup();
        let a = append_tx(&mut c, "s1", &[ev(1), ev(2)], 1.0).expect("append");
        let b = append_tx(&mut c, "s2", &[ev(1)], 1.0).expect("append");
        let a2 = append_tx(&mut c, "s1", &[ev(3)], 2.0).expect("append");
        assert_eq!(a.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(b[0].seq, 1);
        assert_eq!(a2[0].seq, 3);
        assert!(append_tx(&mut c, "s1", &[], 2.0).expect("empty").is_empty());
        let s = since(&mut c, "s1", 1, 10).expect("since");
        assert_eq!(
            s.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![2, 3]
        );
        assert_eq!(
            (s.last_sequence, s.truncated, s.has_more),
            (3, false, false)
        );
        assert_eq!(s.events[1].to_wire()["payload"]["n"], 3);
        let s = since(&mut c, "s1", 0, 2).expect("since");
        assert_eq!((s.last_sequence, s.has_more), (2, true));
        let s = since(&mut c, "s1", 3, 10).expect("since");
        assert_eq!((s.events.len(), s.last_sequence), (0, 3));
        let s = since(&mut c, "nobody", 0, 10).expect("since");
        assert_eq!(
            (s.events.len(), s.last_sequence, s.truncated),
            (0, 0, false)
        );
    }

    /// The pruner runs on the writer every minute: none of its statements may walk the whole log.
    #[test]
    fn pruning_reads_only_what_it_prunes() {
        #[derive(diesel::QueryableByName)]
        struct Step {
            #[diesel(sql_type = diesel::sql_types::Text)]
            detail: String,
        }
        let (_d, mut c) = setup();
        for sql in [
            "SELECT session_id, MAX(seq) AS pruned_through \
             FROM session_events INDEXED BY session_events_age \
             WHERE created_at < 1.0 GROUP BY session_id",
            "DELETE FROM session_events WHERE session_id = 's1' AND seq <= 3",
        ] {
            let plan: Vec<Step> = diesel::sql_query(format!("EXPLAIN QUERY PLAN {sql}"))
                .load(&mut c)
                .expect("plan");
            let plan: Vec<String> = plan.into_iter().map(|s| s.detail).collect();
            assert!(
                plan.iter()
                    .any(|d| d.starts_with("SEARCH session_events USING"))
                    && !plan.iter().any(|d| d.starts_with("SCAN session_events")),
                "{sql}: {plan:?}"
            );
        }
    }

    #[test]
    fn pruning_by_count_and_age_reports_truncated_and_keeps_the_head() {
        let (_d, mut c) = setup();
        for i in 0..6 {
            append_tx(&mut c, "s1", &[ev(i)], 10.0 + i as f64).expect("append");
        }
        append_tx(&mut c, "s2", &[ev(0)], 10.0).expect("append");
        let keep_four = Retention {
            max_age_seconds: 0.0,
            max_per_session: 4,
        };
        assert_eq!(prune(&mut c, keep_four, 100.0).expect("prune"), 2);
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert!(s.truncated);
        assert_eq!(s.events.first().map(|e| e.seq), Some(3));
        assert!(!since(&mut c, "s1", 2, 10).expect("since").truncated);
        // By age: everything older than 13.5 goes (seq 3 and 4 were written at 12 and 13).
        let by_age = Retention {
            max_age_seconds: 86.5,
            max_per_session: 100,
        };
        assert_eq!(prune(&mut c, by_age, 100.0).expect("prune"), 3);
        let s = since(&mut c, "s1", 2, 10).expect("since");
        assert!(s.truncated);
        assert_eq!(
            s.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![5, 6]
        );
        assert_eq!(head(&mut c, "s2").expect("head").pruned_through, 1);
        // Everything pruned: the head still moves on from where it was.
        let all = Retention {
            max_age_seconds: 1.0,
            max_per_session: 100,
        };
        prune(&mut c, all, 1000.0).expect("prune");
        let s = since(&mut c, "s1", 4, 10).expect("since");
        assert_eq!((s.events.len(), s.last_sequence, s.truncated), (0, 6, true));
        let next = append_tx(&mut c, "s1", &[ev(7)], 1000.0).expect("append");
        assert_eq!(next[0].seq, 7);
    }
}
