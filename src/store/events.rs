//! The durable per-session event log.
//!
//! Every notification that reports a committed state change (an admission, a claim, a settlement,
//! a prompt opened or settled, tool activity) is appended here by the transition that makes the
//! change, in the same transaction, with the session's next sequence number (`+1`, never reused).
//! The events of one transaction are stored as one row (a batch), so a commit adds one row and
//! one key entry however many events it reports. Streaming deltas are not stored. Old events
//! are pruned by age and count ([`prune`]); a reader asking for events that were pruned is told
//! `truncated`.

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Double};
use diesel::sqlite::SqliteConnection;
use serde_json::{json, Value};

use super::{hot_sql, Bind};
use crate::error::StoreError;

/// Hand-written table definitions (see `migrations/2026-11-30-000004_lean_event_log/up.sql` and
/// `migrations/2026-12-02-000009_event_heads_from_the_log/up.sql`).
pub mod schema {
    diesel::table! {
        /// One row per transaction that appended events: `events_json` is
        /// `[[type, payload], ...]` for `first_seq..=last_seq`.
        session_event_batches (session_ordinal, last_seq) {
            session_id -> Text,
            session_ordinal -> BigInt,
            last_seq -> BigInt,
            first_seq -> BigInt,
            events_json -> Text,
            created_at -> Double,
        }
    }

    diesel::table! {
        /// How far pruning reached, for the sessions it reached: every event up to and
        /// including `through` was pruned.
        session_events_pruned (session_id) {
            session_id -> Text,
            through -> BigInt,
        }
    }
}

use schema::session_event_batches as batches;

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
#[derive(Debug, Clone, PartialEq)]
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

    /// The WebSocket notification of this event under `authority_epoch`: the JSON-RPC frame
    /// `{"jsonrpc": "2.0", "method": "event", "params": <wire form + authority_epoch>}`, keys in
    /// the order `serde_json` writes them, written straight from the row. The stored payload is
    /// JSON `serde_json` wrote (see [`append`]) and goes in as it is, instead of being parsed into
    /// a value and written out again for every event sent.
    pub fn wire_frame(&self, authority_epoch: i64) -> String {
        let mut out = Vec::with_capacity(
            144 + self.payload_json.len() + self.session_id.len() + self.kind.len(),
        );
        // Each part is written into the one buffer with serde_json's writer (a value's
        // `to_string` goes through the formatter, one small write per token); writing to memory
        // cannot fail, and everything written is UTF-8 (the payload is a `String`).
        out.extend_from_slice(
            b"{\"jsonrpc\":\"2.0\",\"method\":\"event\",\"params\":{\"authority_epoch\":",
        );
        let _ = serde_json::to_writer(&mut out, &authority_epoch);
        out.extend_from_slice(b",\"created_at\":");
        let _ = serde_json::to_writer(&mut out, &Value::from(self.created_at));
        out.extend_from_slice(b",\"payload\":");
        out.extend_from_slice(self.payload_json.as_bytes());
        out.extend_from_slice(b",\"seq\":");
        let _ = serde_json::to_writer(&mut out, &self.seq);
        out.extend_from_slice(b",\"session_id\":");
        let _ = serde_json::to_writer(&mut out, self.session_id.as_str());
        out.extend_from_slice(b",\"type\":");
        let _ = serde_json::to_writer(&mut out, self.kind.as_str());
        out.extend_from_slice(b"}}");
        String::from_utf8(out).unwrap_or_default()
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

/// A session's head, read from its log in one statement (two seeks, one of them on the key page
/// an append then writes): its newest batch's `last_seq` and how far pruning reached. The last
/// sequence number is the larger: pruning removes only batches at or below its mark, so a batch
/// that is left ends past it, and when pruning removed every batch the mark is where the log
/// stood. It never goes back.
const HEAD: &str = "SELECT \
     coalesce((SELECT max(last_seq) FROM session_event_batches WHERE session_ordinal = ?), 0), \
     coalesce((SELECT through FROM session_events_pruned WHERE session_id = ?), 0)";

pub fn head(conn: &mut SqliteConnection, session: &str) -> Result<Head, StoreError> {
    match super::sessions::find_ordinal(conn, session)? {
        Some(ordinal) => head_at(conn, session, ordinal),
        // A session that does not exist has logged nothing.
        None => Ok(Head::default()),
    }
}

/// [`head`] of `session`, whose ordinal is `ordinal`.
fn head_at(conn: &mut SqliteConnection, session: &str, ordinal: i64) -> Result<Head, StoreError> {
    let (newest, pruned_through): (i64, i64) =
        hot_sql!(HEAD, &[Bind::Int(ordinal), Bind::Text(session)])
            .returning::<(BigInt, BigInt)>()
            .get_result(conn)?;
    Ok(Head {
        last_seq: newest.max(pruned_through),
        pruned_through,
    })
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
    let ordinal = super::sessions::ordinal(conn, session)?;
    append_at(conn, session, ordinal, events, now)
}

/// [`append`] for a caller that has read the session's ordinal already.
pub(crate) fn append_at(
    conn: &mut SqliteConnection,
    session: &str,
    ordinal: i64,
    events: &[NewEvent],
    now: f64,
) -> Result<Vec<EventRow>, StoreError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let n = events.len() as i64;
    // The batch's key `(session_ordinal, last_seq)` is unique: were two appends ever to compute
    // the same numbers, the second would fail here instead of reusing them.
    let first = head_at(conn, session, ordinal)?.last_seq + 1;
    let end = first + n - 1;
    let mut rows = Vec::with_capacity(events.len());
    let mut batch = String::with_capacity(64 * events.len());
    batch.push('[');
    for (i, e) in events.iter().enumerate() {
        let row = EventRow {
            session_id: session.to_string(),
            seq: first + i as i64,
            kind: e.kind.clone(),
            payload_json: e.payload.to_string(),
            created_at: now,
        };
        if i > 0 {
            batch.push(',');
        }
        batch.push('[');
        batch.push_str(&Value::from(row.kind.as_str()).to_string());
        batch.push(',');
        batch.push_str(&row.payload_json);
        batch.push(']');
        rows.push(row);
    }
    batch.push(']');
    diesel::insert_into(batches::table)
        .values((
            batches::session_id.eq(session),
            batches::session_ordinal.eq(ordinal),
            batches::last_seq.eq(end),
            batches::first_seq.eq(first),
            batches::events_json.eq(&batch),
            batches::created_at.eq(now),
        ))
        .execute(conn)?;
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

/// The most bytes of stored events one page reads (at least one batch is read, whatever its
/// size): a page of 500 whole replies of several MiB each was read, held and sent at once.
pub const PAGE_BYTES: i64 = 8 << 20;

/// Up to `limit` events of `session` with `seq > after`, oldest first, read in one snapshot;
/// `has_more` when `limit` or [`PAGE_BYTES`] cut it short.
pub fn since(
    conn: &mut SqliteConnection,
    session: &str,
    after: i64,
    limit: i64,
) -> Result<Since, StoreError> {
    since_within(conn, session, after, limit, PAGE_BYTES)
}

/// [`since`], reading batches of events of at most `max_bytes` in all (at least one).
pub fn since_within(
    conn: &mut SqliteConnection,
    session: &str,
    after: i64,
    limit: i64,
    max_bytes: i64,
) -> Result<Since, StoreError> {
    let limit = limit.max(1);
    let after = after.max(0);
    conn.transaction(|conn| {
        let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
            // A session that does not exist has logged nothing.
            return Ok(Since {
                events: Vec::new(),
                last_sequence: 0,
                truncated: false,
                has_more: false,
            });
        };
        let h = head_at(conn, session, ordinal)?;
        // Events at or below `pruned_through` may still sit in a batch that straddles it.
        let start = after.max(h.pruned_through);
        // Only the first batch can hold events at or below `start`, and every batch holds at
        // least one event: `limit + 2` batches hold `limit + 1` events when there are that many.
        // Their sizes first (read from the rows' headers): as many as fit in `max_bytes`.
        let sizes: Vec<(i64, i64)> = batches::table
            .filter(batches::session_ordinal.eq(ordinal))
            .filter(batches::last_seq.gt(start))
            .order(batches::last_seq.asc())
            .limit(limit + 2)
            .select((
                batches::last_seq,
                diesel::dsl::sql::<diesel::sql_types::BigInt>("octet_length(events_json)"),
            ))
            .load(conn)?;
        let (mut bytes, mut through, mut cut) = (0i64, start, false);
        for (i, (last_seq, size)) in sizes.iter().enumerate() {
            if i > 0 && bytes.saturating_add(*size) > max_bytes {
                cut = true;
                break;
            }
            bytes = bytes.saturating_add(*size);
            through = *last_seq;
        }
        let stored: Vec<(i64, String, f64)> = batches::table
            .filter(batches::session_ordinal.eq(ordinal))
            .filter(batches::last_seq.gt(start))
            .filter(batches::last_seq.le(through))
            .order(batches::last_seq.asc())
            .select((
                batches::first_seq,
                batches::events_json,
                batches::created_at,
            ))
            .load(conn)?;
        let mut events = Vec::new();
        for (first_seq, json, created_at) in stored {
            let parsed: Vec<(String, Value)> = serde_json::from_str(&json).map_err(|e| {
                StoreError::Other(format!(
                    "event batch of session {session} at {first_seq} is not readable: {e}"
                ))
            })?;
            for (i, (kind, payload)) in parsed.into_iter().enumerate() {
                let seq = first_seq + i as i64;
                if seq > start && events.len() as i64 <= limit {
                    events.push(EventRow {
                        session_id: session.to_string(),
                        seq,
                        kind,
                        payload_json: payload.to_string(),
                        created_at,
                    });
                }
            }
        }
        let has_more = cut || events.len() as i64 > limit;
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

/// How many of the oldest batches one pruning transaction walks for the age rule, at most.
const AGE_WALK: usize = 4096;
/// How many of the batches written since the count rule last ran one pruning transaction walks
/// for it, at most.
const COUNT_WALK: usize = 4096;
/// The batches after a rowid, in the order they were written (the pruning rules' walk).
const WALK_SQL: &str = "SELECT rowid, session_id, session_ordinal, last_seq, created_at \
                        FROM session_event_batches \
                        WHERE rowid > ? ORDER BY rowid LIMIT ?";
/// The `state_meta` key of the rowid up to which the count rule has seen every batch.
const COUNT_SEEN: &str = "session_events.count_rule_seen";

/// What one pruning transaction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Pruned {
    /// Stored batches deleted.
    pub batches: usize,
    /// Batches the count rule walked (written since it last ran).
    pub walked: usize,
    /// A walk stopped at its bound ([`AGE_WALK`], [`COUNT_WALK`]): run again for the rest.
    pub more: bool,
}

/// The rowid up to which the count rule has seen every batch (0: none yet).
pub(crate) fn count_rule_seen(conn: &mut SqliteConnection) -> Result<i64, StoreError> {
    Ok(super::epoch::meta_get(conn, COUNT_SEEN)?
        .and_then(|v| v.parse().ok())
        .unwrap_or(0))
}

/// Record that the count rule has seen every batch up to `rowid`.
fn set_count_rule_seen(conn: &mut SqliteConnection, rowid: i64) -> Result<(), StoreError> {
    super::epoch::meta_set(conn, COUNT_SEEN, &rowid.to_string())
}

/// Record that the count rule has seen every batch the log holds (for a log written outside
/// the daemon, as the bench writes its recovery store).
pub(crate) fn set_count_rule_seen_all(conn: &mut SqliteConnection) -> Result<(), StoreError> {
    let newest = newest_batch(conn)?;
    set_count_rule_seen(conn, newest)
}

/// The newest batch's rowid (0 in an empty log).
fn newest_batch(conn: &mut SqliteConnection) -> Result<i64, StoreError> {
    let newest: Option<i64> = hot_sql!("SELECT max(rowid) FROM session_event_batches", &[])
        .returning::<diesel::sql_types::Nullable<BigInt>>()
        .get_result(conn)?;
    Ok(newest.unwrap_or(0))
}

/// A stored batch as the pruning rules' walk reads it.
#[derive(diesel::QueryableByName)]
struct Walked {
    #[diesel(sql_type = BigInt)]
    rowid: i64,
    #[diesel(sql_type = diesel::sql_types::Text)]
    session_id: String,
    #[diesel(sql_type = BigInt)]
    session_ordinal: i64,
    #[diesel(sql_type = BigInt)]
    last_seq: i64,
    #[diesel(sql_type = Double)]
    created_at: f64,
}

/// Each session's newest `last_seq` among `batches`, by session id and ordinal.
fn newest_per_session(
    batches: impl IntoIterator<Item = Walked>,
) -> std::collections::HashMap<(String, i64), i64> {
    let mut newest = std::collections::HashMap::new();
    for b in batches {
        let last = newest
            .entry((b.session_id, b.session_ordinal))
            .or_insert(b.last_seq);
        *last = (*last).max(b.last_seq);
    }
    newest
}

/// Prune every session's log by age and count, in one transaction. `pruned_through` only moves
/// forward, so `truncated` answers stay true once given; a batch that straddles it stays until
/// all its events are pruned (readers skip the pruned ones).
///
/// It runs on the writer, so it reads only what it prunes, never the whole log:
/// - the count rule, the batches written since it last ran (it keeps how far it got in
///   `state_meta`, in the same transaction; at most [`COUNT_WALK`] per transaction): only a
///   session that wrote can have grown past its limit, and its newest batch says how far;
/// - the age rule, the oldest batches up to the first that is not past the cutoff (in rowid
///   order, which is the order they were written; at most [`AGE_WALK`] per transaction);
/// - the ranges it deletes (through the key).
pub fn prune(
    conn: &mut SqliteConnection,
    retention: Retention,
    now: f64,
) -> Result<Pruned, StoreError> {
    use diesel::sql_types::Text;
    let keep = retention.max_per_session.max(1);
    super::write_tx(conn, |conn| {
        // Move a session's mark forward (never back); whether it moved.
        let mark = |conn: &mut SqliteConnection, session: &str, through: i64| {
            diesel::sql_query(
                "INSERT INTO session_events_pruned (session_id, through) VALUES (?, ?) \
                 ON CONFLICT (session_id) DO UPDATE SET through = excluded.through \
                 WHERE through < excluded.through",
            )
            .bind::<Text, _>(session)
            .bind::<BigInt, _>(through)
            .execute(conn)
            .map(|n| n > 0)
        };
        let walk = |conn: &mut SqliteConnection, after: i64, n: usize| {
            diesel::sql_query(WALK_SQL)
                .bind::<BigInt, _>(after)
                .bind::<BigInt, _>(n as i64 + 1)
                .load::<Walked>(conn)
        };
        let mut moved: std::collections::HashMap<(String, i64), i64> = Default::default();
        let seen = count_rule_seen(conn)?;
        let mut grown = walk(conn, seen, COUNT_WALK)?;
        let mut more = grown.len() > COUNT_WALK;
        grown.truncate(COUNT_WALK);
        let walked = grown.len();
        let mut seen = grown.last().map_or(seen, |b| b.rowid);
        for (session, last) in newest_per_session(grown) {
            let through = last - keep;
            if through > 0 && mark(conn, &session.0, through)? {
                moved.insert(session, through);
            }
        }
        let cutoff = now - retention.max_age_seconds;
        // The oldest batch first (one seek): a log with nothing old is not walked.
        let aged = retention.max_age_seconds > 0.0
            && walk(conn, 0, 0)?
                .first()
                .is_some_and(|b| b.created_at < cutoff);
        if aged {
            // The oldest batches up to the first that is not old; past the bound, the rest is
            // for the next pruning.
            let mut old: Vec<Walked> = walk(conn, 0, AGE_WALK)?
                .into_iter()
                .take_while(|b| b.created_at < cutoff)
                .collect();
            more |= old.len() > AGE_WALK;
            old.truncate(AGE_WALK);
            for (session, through) in newest_per_session(old) {
                if mark(conn, &session.0, through)? {
                    let m = moved.entry(session).or_insert(through);
                    *m = (*m).max(through);
                }
            }
        }
        let mut deleted = 0;
        for ((_, ordinal), through) in moved {
            deleted += diesel::sql_query(
                "DELETE FROM session_event_batches WHERE session_ordinal = ? AND last_seq <= ?",
            )
            .bind::<BigInt, _>(ordinal)
            .bind::<BigInt, _>(through)
            .execute(conn)?;
        }
        if deleted > 0 {
            // Rowids are not AUTOINCREMENT: once the newest batches are deleted, new ones may
            // take their rowids again, and must not hide below the mark.
            seen = seen.min(newest_batch(conn)?);
        }
        set_count_rule_seen(conn, seen)?;
        Ok(Pruned {
            batches: deleted,
            walked,
            more,
        })
    })
}

/// Prune every `every` (first right away) on the current arbiter, for the life of the process.
/// A backlog is pruned in several transactions, so other commits run between them.
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
            let mut batches = 0;
            loop {
                let now = clock.now();
                match db.write(move |c| prune(c, retention, now)).await {
                    Ok(p) => {
                        batches += p.batches;
                        // Stop when the walks are done, or made no progress (which would loop).
                        if !p.more || (p.batches == 0 && p.walked == 0) {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot prune session events");
                        break;
                    }
                }
            }
            if batches > 0 {
                tracing::debug!(batches, "pruned session events");
            }
            // Chat-completion thread records and ended prompts age out with the events.
            if retention.max_age_seconds > 0.0 {
                type Prune = fn(&mut SqliteConnection, f64) -> Result<bool, StoreError>;
                let aging: [(&str, Prune); 2] = [
                    ("chat threads", super::threads::prune),
                    ("ended prompts", super::prompts::prune),
                ];
                for (what, prune) in aging {
                    loop {
                        let before = clock.now() - retention.max_age_seconds;
                        match db.write(move |c| prune(c, before)).await {
                            Ok(true) => {}
                            Ok(false) => break,
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot prune {what}");
                                break;
                            }
                        }
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::schema::session_events_pruned as pruned;
    use super::*;
    use crate::store::{epoch, testing};

    /// The frame written straight from a row is, byte for byte, the one made by building the
    /// notification as a value and writing it out: for awkward strings, numbers and payloads.
    #[test]
    fn a_wire_frame_is_the_notification_written_from_its_value() {
        let payloads = [
            json!({"admitted": "01a2", "sequence": 95, "input_id": "t-94"}),
            json!({"text": "quote \" backslash \\ newline \n tab \t nul \u{0} é 🐙 \u{2028}"}),
            json!({"n": -3, "x": 1.5e-7, "big": 12345678901234567890u64, "list": [null, true, {}]}),
            json!(null),
            json!("a bare string"),
            json!([1, 2, 3]),
        ];
        for (i, payload) in payloads.iter().enumerate() {
            let row = EventRow {
                session_id: format!("local-\"{i}\"-é"),
                seq: 7 + i as i64,
                kind: if i % 2 == 0 {
                    "message.delta"
                } else {
                    "odd\\kind\u{1}"
                }
                .into(),
                payload_json: payload.to_string(),
                created_at: [1796154756.9615738, 0.0, 1e21, -2.5, 3.0, 0.1][i],
            };
            for epoch in [1, 42, i64::MAX] {
                let mut params = row.to_wire();
                params["authority_epoch"] = json!(epoch);
                let frame = json!({"jsonrpc": "2.0", "method": "event", "params": params});
                assert_eq!(row.wire_frame(epoch), frame.to_string(), "payload {i}");
            }
        }
    }

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

    /// A page reads at most `max_bytes` of stored events (at least one batch), says `has_more`
    /// when that cut it short, and the next page goes on from where it ended: every event once.
    #[test]
    fn a_page_is_bounded_in_bytes() {
        let (_d, mut c) = setup();
        let big = |n: i64| {
            NewEvent::new(
                "message.complete",
                json!({"n": n, "text": "x".repeat(1000)}),
            )
        };
        for n in 1..=5 {
            append_tx(&mut c, "s1", &[big(n)], 1.0).expect("append");
        }
        append_tx(&mut c, "s1", &[ev(6), ev(7)], 1.0).expect("append");
        let mut seen = Vec::new();
        let mut pages = Vec::new();
        let mut after = 0;
        loop {
            let s = since_within(&mut c, "s1", after, 500, 2500).expect("since");
            pages.push(s.events.len());
            seen.extend(s.events.iter().map(|e| e.seq));
            after = s.last_sequence;
            if !s.has_more {
                break;
            }
        }
        assert_eq!(
            pages,
            [2, 2, 3],
            "two events of 1 KB, then the last with the small batch"
        );
        assert_eq!(seen, (1..=7).collect::<Vec<_>>());
        // One batch over the bound is still read whole (a page always moves on).
        let s = since_within(&mut c, "s1", 0, 500, 10).expect("since");
        assert_eq!((s.events.len(), s.last_sequence, s.has_more), (1, 1, true));
        // The default bound holds every event here.
        let s = since(&mut c, "s1", 0, 500).expect("since");
        assert_eq!((s.events.len(), s.has_more), (7, false));
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
        let (_d, mut c) = setup();
        for sql in [
            &WALK_SQL
                .replace("rowid > ?", "rowid > 5")
                .replace('?', "4097"),
            "DELETE FROM session_event_batches WHERE session_ordinal = 1 AND last_seq <= 3",
            &HEAD.replacen('?', "1", 1).replacen('?', "'s1'", 1),
            "SELECT max(rowid) FROM session_event_batches",
            "SELECT first_seq, events_json FROM session_event_batches \
             WHERE session_ordinal = 1 AND last_seq > 3 ORDER BY last_seq LIMIT 10",
        ] {
            let plan = testing::query_plan(&mut c, sql);
            assert!(
                plan.iter().any(|d| {
                    d.starts_with("SEARCH session_event_batches")
                        || d == "SCAN session_event_batches"
                }) && !plan.iter().any(|d| d.starts_with("USE TEMP B-TREE")),
                "{sql}: {plan:?}"
            );
        }
    }

    #[test]
    fn pruning_by_count_and_age_reports_truncated_and_keeps_the_head() {
        let (_d, mut c) = setup();
        // Written in time order (the age rule walks the log in the order it was written).
        append_tx(&mut c, "s2", &[ev(0)], 10.0).expect("append");
        for i in 0..6 {
            append_tx(&mut c, "s1", &[ev(i)], 10.0 + i as f64).expect("append");
        }
        let keep_four = Retention {
            max_age_seconds: 0.0,
            max_per_session: 4,
        };
        assert_eq!(prune(&mut c, keep_four, 100.0).expect("prune").batches, 2);
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert!(s.truncated);
        assert_eq!(s.events.first().map(|e| e.seq), Some(3));
        assert!(!since(&mut c, "s1", 2, 10).expect("since").truncated);
        // By age: everything older than 13.5 goes (seq 3 and 4 were written at 12 and 13).
        let by_age = Retention {
            max_age_seconds: 86.5,
            max_per_session: 100,
        };
        assert_eq!(prune(&mut c, by_age, 100.0).expect("prune").batches, 3);
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

    /// The count rule reads only the sessions that wrote since the last pruning, and a batch
    /// that takes the rowid of a deleted one is not hidden from it.
    #[test]
    fn the_count_rule_walks_only_what_was_written_since_it_last_ran() {
        let (_d, mut c) = setup();
        let keep_two = Retention {
            max_age_seconds: 0.0,
            max_per_session: 2,
        };
        for i in 0..4 {
            append_tx(&mut c, "s1", &[ev(i)], 10.0).expect("append");
        }
        let first = prune(&mut c, keep_two, 20.0).expect("prune");
        assert_eq!((first.batches, first.walked, first.more), (2, 4, false));
        assert_eq!(count_rule_seen(&mut c).expect("seen"), 4);
        // Pruning by count after the walk: s1 is not read again until it writes.
        append_tx(&mut c, "s2", &[ev(0), ev(1), ev(2)], 11.0).expect("append");
        let second = prune(&mut c, keep_two, 20.0).expect("prune");
        assert_eq!((second.batches, second.walked), (0, 1));
        // s2's one batch holds 3 events: the mark moves into it and the batch stays.
        assert_eq!(head(&mut c, "s2").expect("head").pruned_through, 1);
        append_tx(&mut c, "s1", &[ev(4)], 12.0).expect("append");
        let third = prune(&mut c, keep_two, 20.0).expect("prune");
        assert_eq!((third.batches, third.walked), (1, 1));
        assert_eq!(count_rule_seen(&mut c).expect("seen"), 6);
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert_eq!(
            s.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![4, 5]
        );
        // Everything goes by age, the newest rowid too; the next batches take rowids 1..=3
        // again, and the count rule still sees them.
        let by_age = Retention {
            max_age_seconds: 1.0,
            max_per_session: 2,
        };
        let fourth = prune(&mut c, by_age, 100.0).expect("prune");
        assert_eq!((fourth.batches, fourth.walked), (3, 0));
        assert_eq!(count_rule_seen(&mut c).expect("seen"), 0);
        for i in 0..3 {
            append_tx(&mut c, "s1", &[ev(i)], 200.0).expect("append");
        }
        let fifth = prune(&mut c, keep_two, 200.0).expect("prune");
        assert_eq!((fifth.batches, fifth.walked), (1, 3));
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert_eq!(
            s.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![7, 8]
        );
    }

    /// The heads kept before the log was read for them: each session's sequence continues where
    /// it stood and its pruning mark is kept; the down migration gives the heads back.
    #[test]
    fn the_heads_migration_keeps_every_sequence_and_mark() {
        use diesel::connection::SimpleConnection;
        use diesel_migrations::MigrationHarness;
        let (_dir, mut c) = testing::conn_just_before("_event_heads_from_the_log");
        for id in ["s1", "s2", "s3"] {
            testing::session(&mut c, 1, id);
        }
        c.batch_execute(
            r#"PRAGMA foreign_keys = OFF;
               INSERT INTO session_event_batches (session_id, last_seq, first_seq, events_json, created_at)
                 VALUES ('s1', 1, 1, '[["a",1]]', 1.0), ('s1', 3, 2, '[["a",2],["a",3]]', 2.0),
                        ('s3', 2, 1, '[["a",1],["a",2]]', 3.0);
               INSERT INTO session_event_heads (session_id, last_seq, pruned_through)
                 VALUES ('s1', 3, 1), ('s2', 5, 5), ('s3', 2, 0);"#,
        )
        .expect("old heads");
        c.run_pending_migrations(crate::store::MIGRATIONS)
            .expect("migrate");
        let heads = |c: &mut SqliteConnection| {
            ["s1", "s2", "s3", "s4"].map(|s| {
                let h = head(c, s).expect("head");
                (h.last_seq, h.pruned_through)
            })
        };
        assert_eq!(heads(&mut c), [(3, 1), (5, 5), (2, 0), (0, 0)]);
        let rows: Vec<(String, i64)> = pruned::table
            .select((pruned::session_id, pruned::through))
            .order(pruned::session_id)
            .load(&mut c)
            .expect("marks");
        assert_eq!(rows, vec![("s1".into(), 1), ("s2".into(), 5)]);
        let next = append(&mut c, "s2", &[ev(6)], 4.0).expect("append");
        assert_eq!(next[0].seq, 6);
        assert_eq!(heads(&mut c), [(3, 1), (6, 5), (2, 0), (0, 0)]);
        #[derive(diesel::QueryableByName, Debug, PartialEq)]
        struct OldHead {
            #[diesel(sql_type = diesel::sql_types::Text)]
            session_id: String,
            #[diesel(sql_type = BigInt)]
            last_seq: i64,
            #[diesel(sql_type = BigInt)]
            pruned_through: i64,
        }
        // Back past the migrations after it, then its own.
        testing::revert_through(&mut c, "_event_heads_from_the_log");
        let old: Vec<OldHead> = diesel::sql_query(
            "SELECT session_id, last_seq, pruned_through FROM session_event_heads \
             ORDER BY session_id",
        )
        .load(&mut c)
        .expect("heads");
        let old = old
            .into_iter()
            .map(|h| (h.session_id, h.last_seq, h.pruned_through))
            .collect::<Vec<_>>();
        assert_eq!(
            old,
            vec![
                ("s1".to_string(), 3, 1),
                ("s2".to_string(), 6, 5),
                ("s3".to_string(), 2, 0)
            ]
        );
    }

    /// The events of one transaction are one stored batch; pruning that reaches into the middle
    /// of a batch hides the pruned events from readers and keeps the rest.
    #[test]
    fn a_batch_straddling_the_pruned_mark_is_read_in_part() {
        let (_d, mut c) = setup();
        let rows = append_tx(&mut c, "s1", &[ev(1), ev(2), ev(3)], 10.0).expect("append");
        assert_eq!(
            rows.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        append_tx(&mut c, "s1", &[ev(4), ev(5)], 11.0).expect("append");
        let keep_three = Retention {
            max_age_seconds: 0.0,
            max_per_session: 3,
        };
        // Through 2: the first batch (1..=3) still holds 3.
        assert_eq!(prune(&mut c, keep_three, 100.0).expect("prune").batches, 0);
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert!(s.truncated);
        assert_eq!(
            s.events
                .iter()
                .map(|e| (e.seq, e.payload()["n"].as_i64()))
                .collect::<Vec<_>>(),
            vec![(3, Some(3)), (4, Some(4)), (5, Some(5))]
        );
        assert_eq!(s.events[0].kind, "tool.start");
        assert_eq!(s.events[0].created_at, 10.0);
        // A limit inside a batch: has_more, and the next page starts where this one ended.
        let s = since(&mut c, "s1", 0, 2).expect("since");
        assert_eq!(
            (
                s.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
                s.has_more
            ),
            (vec![3, 4], true)
        );
        let s = since(&mut c, "s1", s.last_sequence, 2).expect("since");
        assert_eq!(
            (
                s.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
                s.has_more
            ),
            (vec![5], false)
        );
    }

    /// A backlog past the age cutoff larger than one walk is pruned over several transactions,
    /// and the walk stops at the first batch that is not old enough.
    #[test]
    fn an_age_backlog_is_pruned_in_bounded_steps() {
        let (_d, mut c) = setup();
        for i in 0..(AGE_WALK + 10) {
            let session = if i % 2 == 0 { "s1" } else { "s2" };
            append_tx(&mut c, session, &[ev(i as i64)], 1.0).expect("append");
        }
        append_tx(&mut c, "s1", &[ev(-1)], 50.0).expect("append");
        let by_age = Retention {
            max_age_seconds: 10.0,
            max_per_session: 1_000_000,
        };
        // Both walks stop at their bounds: the count rule's at the 4,096th of 4,107 batches.
        let first = prune(&mut c, by_age, 20.0).expect("prune");
        assert_eq!(
            first,
            Pruned {
                batches: AGE_WALK,
                walked: COUNT_WALK,
                more: true,
            }
        );
        let second = prune(&mut c, by_age, 20.0).expect("prune");
        assert_eq!(
            second,
            Pruned {
                batches: 10,
                walked: 11,
                more: false,
            }
        );
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert!(s.truncated);
        assert_eq!(
            s.events
                .iter()
                .map(|e| e.payload()["n"].as_i64())
                .collect::<Vec<_>>(),
            vec![Some(-1)]
        );
        assert!(since(&mut c, "s2", 0, 10).expect("since").events.is_empty());
        assert_eq!(
            prune(&mut c, by_age, 20.0).expect("prune"),
            Pruned::default()
        );
    }

    /// A log written one row per event (before batches) reads back the same after the migration
    /// that turns each stored event into a batch of one.
    #[test]
    fn events_stored_before_batches_read_back_after_the_migration() {
        use diesel::connection::SimpleConnection;
        use diesel_migrations::MigrationHarness;
        let (_dir, mut c) = testing::conn_just_before("_lean_event_log");
        for id in ["s1", "s2"] {
            testing::session(&mut c, 1, id);
        }
        c.batch_execute(
            r#"PRAGMA foreign_keys = OFF;
               INSERT INTO session_events (session_id, seq, type, payload_json, created_at) VALUES
                 ('s1', 1, 'session.info', '{"admitted":"a1","sequence":1}', 10.0),
                 ('s1', 2, 'message.complete', '{"text":"h\u00e9 \"q\""}', 11.0),
                 ('s2', 1, 'session.info', '{}', 12.0);
               INSERT INTO session_event_heads (session_id, last_seq, pruned_through)
                 VALUES ('s1', 2, 0), ('s2', 1, 0);"#,
        )
        .expect("old events");
        c.run_pending_migrations(crate::store::MIGRATIONS)
            .expect("migrate");
        let s = since(&mut c, "s1", 0, 10).expect("since");
        assert_eq!(
            s.events
                .iter()
                .map(|e| (e.seq, e.kind.as_str(), e.payload(), e.created_at))
                .collect::<Vec<_>>(),
            vec![
                (
                    1,
                    "session.info",
                    json!({"admitted": "a1", "sequence": 1}),
                    10.0
                ),
                (2, "message.complete", json!({"text": "hé \"q\""}), 11.0),
            ]
        );
        // The next event continues the sequence in a batch of its own.
        let next = append_tx(&mut c, "s2", &[ev(1), ev(2)], 13.0).expect("append");
        assert_eq!(next.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(since(&mut c, "s2", 0, 10).expect("since").events.len(), 3);
    }
}
