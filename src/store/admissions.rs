//! The admission ledger: queued → started → terminal, with `unknown` for work whose owner died.
//! Claims and settlements are fenced by epoch and execution generation in SQL.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;
use sha2::{Digest, Sha256};

use super::epoch::check_epoch;
use super::events::{self, Logged, NewEvent};
use super::messages::{
    closing_messages, insert_messages, insert_messages_knowing, live, NewMessage, OpenCalls,
};
use super::schema::{session_admissions as sa, sessions};
use super::{hot_sql, Bind};
use crate::error::StoreError;

/// `status != 'terminal'`, written out so that queries of live rows can use the partial index
/// `session_admissions_open` (a bound parameter would not match its condition). Every query by
/// a live status needs it: settled rows are in no status index.
pub fn is_live() -> IsLive {
    IsLive
}

/// The condition of [`is_live`]. Its own type, not `diesel::dsl::sql`: diesel never keeps a
/// statement with an SQL literal prepared, and a claim and an admission run five such queries,
/// which the writer then parsed and planned again on every run. This fragment binds nothing
/// and its text never changes, so its statements are cached like any other.
#[derive(Debug, Clone, Copy, diesel::query_builder::QueryId)]
pub struct IsLive;

impl diesel::expression::Expression for IsLive {
    type SqlType = diesel::sql_types::Bool;
}

impl<QS> diesel::expression::AppearsOnTable<QS> for IsLive where
    QS: diesel::query_source::AppearsInFromClause<sa::table, Count = diesel::query_source::Once>
{
}

impl<QS> diesel::expression::SelectableExpression<QS> for IsLive where
    QS: diesel::query_source::AppearsInFromClause<sa::table, Count = diesel::query_source::Once>
{
}

impl<G> diesel::expression::ValidGrouping<G> for IsLive {
    type IsAggregate = diesel::expression::is_aggregate::Never;
}

impl diesel::query_builder::QueryFragment<diesel::sqlite::Sqlite> for IsLive {
    fn walk_ast<'b>(
        &'b self,
        mut out: diesel::query_builder::AstPass<'_, 'b, diesel::sqlite::Sqlite>,
    ) -> QueryResult<()> {
        out.push_sql("session_admissions.status != 'terminal'");
        Ok(())
    }
}

#[derive(Debug, Clone, Queryable, Selectable, serde::Serialize)]
#[diesel(table_name = sa)]
pub struct AdmissionRow {
    pub seq: i64,
    pub admission_id: String,
    pub request_id: String,
    pub principal_id: String,
    pub target_session_id: String,
    pub session_ordinal: i64,
    pub payload_json: String,
    pub payload_digest: String,
    pub intent: String,
    pub status: String,
    pub outcome: Option<String>,
    pub owner_epoch: Option<i64>,
    pub execution_generation: Option<i64>,
    pub result_json: Option<String>,
    pub created_at: f64,
    pub updated_at: f64,
}

impl AdmissionRow {
    /// The input text (public payload).
    pub fn text(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.payload_json)
            .ok()
            .and_then(|v| v.get("text").and_then(|t| t.as_str()).map(str::to_string))
            .unwrap_or_default()
    }

    pub fn is_terminal(&self) -> bool {
        self.status == "terminal"
    }
}

/// `sha256(target \0 payload)` as hex: the identity of an input's content.
pub fn digest(target: &str, payload_json: &str) -> String {
    let mut h = Sha256::new();
    h.update(target.as_bytes());
    h.update([0u8]);
    h.update(payload_json.as_bytes());
    hex(&h.finalize())
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 0xf) as usize] as char);
    }
    out
}

/// An input's stored payload and the digest of its content, made before the write (off the
/// writer thread, which every commit waits for).
#[derive(Debug, Clone)]
pub struct Input {
    payload_json: String,
    digest: String,
}

impl Input {
    /// `row`, admitted before under this input's id, when it holds this input: the same
    /// request again, answered with its admission whatever its status; another text under the
    /// same id is `admission_conflict`.
    pub fn same_as(&self, row: AdmissionRow) -> Result<AdmissionRow, StoreError> {
        if row.payload_digest == self.digest {
            return Ok(row);
        }
        Err(StoreError::AdmissionConflict(format!(
            "input_id {} was admitted with other content",
            row.request_id
        )))
    }

    pub fn new(target: &str, text: &str) -> Input {
        let payload_json = serde_json::json!({ "text": text }).to_string();
        let digest = digest(target, &payload_json);
        Input {
            payload_json,
            digest,
        }
    }
}

/// Admit an input. Same `(principal, target, request_id)` and digest → the existing row whatever
/// its status (`created == false`); another digest → `admission_conflict`. A new row is reported
/// by a `session.info {admitted}` event in the same transaction.
#[allow(clippy::too_many_arguments)]
pub fn admit(
    conn: &mut SqliteConnection,
    epoch: i64,
    principal: &str,
    target: &str,
    request_id: &str,
    text: &str,
    max_queued: i64,
    now: f64,
) -> Result<Logged<(AdmissionRow, bool)>, StoreError> {
    let input = Input::new(target, text);
    admit_input(
        conn, epoch, principal, target, request_id, &input, max_queued, now,
    )
}

/// [`admit`] with the payload made beforehand.
#[allow(clippy::too_many_arguments)]
pub fn admit_input(
    conn: &mut SqliteConnection,
    epoch: i64,
    principal: &str,
    target: &str,
    request_id: &str,
    input: &Input,
    max_queued: i64,
    now: f64,
) -> Result<Logged<(AdmissionRow, bool)>, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        // An unknown session is `not_found` here (nothing is queued for it meanwhile).
        let ordinal = super::sessions::ordinal(conn, target)?;
        let existing: Option<AdmissionRow> = sa::table
            .filter(sa::session_ordinal.eq(ordinal))
            .filter(sa::principal_id.eq(principal))
            .filter(sa::request_id.eq(request_id))
            .select(AdmissionRow::as_select())
            .first(conn)
            .optional()?;
        if let Some(row) = existing {
            return Ok(Logged::quiet((input.same_as(row)?, false)));
        }
        let waiting = queued_at_least(conn, ordinal, max_queued)?;
        if waiting >= max_queued {
            return Err(StoreError::SessionBusy(format!(
                "{waiting} inputs are already queued"
            )));
        }
        // Time-ordered: a new admission lands at the right edge of the id index instead of on
        // a random page of it (one page written per commit however large the ledger grows).
        let admission_id = uuid::Uuid::now_v7().simple().to_string();
        diesel::insert_into(sa::table)
            .values((
                sa::admission_id.eq(&admission_id),
                sa::request_id.eq(request_id),
                sa::principal_id.eq(principal),
                sa::target_session_id.eq(target),
                sa::session_ordinal.eq(ordinal),
                sa::payload_json.eq(&input.payload_json),
                sa::payload_digest.eq(&input.digest),
                sa::status.eq("queued"),
                sa::owner_epoch.eq(epoch),
                sa::created_at.eq(now),
                sa::updated_at.eq(now),
            ))
            .execute(conn)?;
        // The row is what was just written (no `RETURNING`: SQLite buffers returned rows in a
        // temporary table, measured at a quarter of the insert's cost); only `seq` is SQLite's.
        let seq: i64 = hot_sql!("SELECT last_insert_rowid()", &[])
            .returning::<diesel::sql_types::BigInt>()
            .get_result(conn)?;
        let row = AdmissionRow {
            seq,
            admission_id,
            request_id: request_id.to_string(),
            principal_id: principal.to_string(),
            target_session_id: target.to_string(),
            session_ordinal: ordinal,
            payload_json: input.payload_json.clone(),
            payload_digest: input.digest.clone(),
            intent: "queue".into(),
            status: "queued".into(),
            outcome: None,
            owner_epoch: Some(epoch),
            execution_generation: None,
            result_json: None,
            created_at: now,
            updated_at: now,
        };
        let logged = events::append_at(
            conn,
            target,
            ordinal,
            &[NewEvent::new(
                "session.info",
                serde_json::json!({"admitted": row.admission_id, "sequence": row.seq, "input_id": row.request_id}),
            )],
            now,
        )?;
        Ok(Logged::new((row, true), logged))
    })
}

/// How many inputs of `session` are queued, exactly when that could reach `limit`; otherwise a
/// number below `limit`. Counting a deep queue walks every queued row, so the first and last
/// queued sequence numbers (two index seeks) bound the count from above and the walk runs only
/// when the bound reaches `limit`.
fn queued_at_least(
    conn: &mut SqliteConnection,
    ordinal: i64,
    limit: i64,
) -> Result<i64, StoreError> {
    use diesel::sql_types::{BigInt, Nullable};
    let (first, last): (Option<i64>, Option<i64>) =
        hot_sql!(QUEUED_BOUNDS, &[Bind::Int(ordinal), Bind::Int(ordinal)])
            .returning::<(Nullable<BigInt>, Nullable<BigInt>)>()
            .get_result(conn)?;
    let (Some(first), Some(last)) = (first, last) else {
        return Ok(0);
    };
    if last - first + 1 < limit {
        return Ok(last - first + 1);
    }
    Ok(sa::table
        .filter(is_live())
        .filter(sa::session_ordinal.eq(ordinal))
        .filter(sa::status.eq("queued"))
        .count()
        .get_result(conn)?)
}

/// A session's first and last queued `seq`, in one statement: each a seek on the live rows'
/// index (a single `min` or `max` is; both in one select would walk the queue).
const QUEUED_BOUNDS: &str = "SELECT \
     (SELECT min(seq) FROM session_admissions WHERE session_admissions.status != 'terminal' \
      AND session_ordinal = ? AND status = 'queued'), \
     (SELECT max(seq) FROM session_admissions WHERE session_admissions.status != 'terminal' \
      AND session_ordinal = ? AND status = 'queued')";

pub fn by_id(conn: &mut SqliteConnection, admission_id: &str) -> Result<AdmissionRow, StoreError> {
    sa::table
        .filter(sa::admission_id.eq(admission_id))
        .select(AdmissionRow::as_select())
        .first(conn)
        .optional()?
        .ok_or_else(|| StoreError::NotFound(format!("no admission {admission_id}")))
}

/// The admission `principal` made to `session` under `request_id` (its `input_id`), if any: one
/// descent of the ledger's unique key, however many inputs the session has had. (A query of its
/// own, not a boxed one shared with [`latest_of`]: a room's watcher asks it on every look, and
/// diesel keeps only unboxed queries prepared.)
pub fn by_request(
    conn: &mut SqliteConnection,
    session: &str,
    principal: &str,
    request_id: &str,
) -> Result<Option<AdmissionRow>, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
        return Ok(None);
    };
    Ok(sa::table
        .filter(sa::session_ordinal.eq(ordinal))
        .filter(sa::principal_id.eq(principal))
        .filter(sa::request_id.eq(request_id))
        .select(AdmissionRow::as_select())
        .first(conn)
        .optional()?)
}

/// `principal`'s latest input to `session`.
pub fn latest_of(
    conn: &mut SqliteConnection,
    session: &str,
    principal: &str,
) -> Result<Option<AdmissionRow>, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
        return Ok(None);
    };
    // The newest row's `seq` from the idempotency key alone (its entries end with it), then
    // that row: ordered by `seq`, every row of the session was read, payload and result, and
    // sorted, on each chat completion in a named session.
    let Some(seq) = latest_seq(ordinal, principal).get_result::<Option<i64>>(conn)? else {
        return Ok(None);
    };
    Ok(sa::table
        .find(seq)
        .select(AdmissionRow::as_select())
        .first(conn)
        .optional()?)
}

/// The `seq` of `principal`'s newest row in the session numbered `ordinal`.
#[diesel::dsl::auto_type(no_type_alias)]
pub(crate) fn latest_seq<'a>(ordinal: i64, principal: &'a str) -> _ {
    let of_session: last_seq = last_seq(ordinal);
    of_session.filter(sa::principal_id.eq(principal))
}

/// The `seq` of the newest row in the session numbered `ordinal`.
#[diesel::dsl::auto_type]
pub(crate) fn last_seq(ordinal: i64) -> _ {
    let newest: diesel::helper_types::max<sa::seq> = diesel::dsl::max(sa::seq);
    sa::table
        .filter(sa::session_ordinal.eq(ordinal))
        .select(newest)
}

/// One admission of `session` (not another session's).
pub fn of_session(
    conn: &mut SqliteConnection,
    session: &str,
    admission_id: &str,
) -> Result<AdmissionRow, StoreError> {
    let row = by_id(conn, admission_id)?;
    if row.target_session_id != session {
        return Err(StoreError::NotFound(format!(
            "no admission {admission_id} in session {session}"
        )));
    }
    Ok(row)
}

/// How much of a pending input's text a session's snapshot carries, in characters. An input may
/// be 256 KiB and a session may have 1,000 queued: in full, one snapshot would be a quarter of
/// a gigabyte, read into memory, built into a frame and sent, on every `session.resume`.
pub const PENDING_TEXT_CHARS: i64 = 4096;

/// Non-terminal rows of a session, in seq order (none for a session that does not exist), as a
/// snapshot lists them: each row's payload holds at most [`PENDING_TEXT_CHARS`] of its text (cut
/// in the read: the rest never leaves the database), with the text's whole length in characters
/// beside it.
pub fn pending(
    conn: &mut SqliteConnection,
    session: &str,
) -> Result<Vec<(AdmissionRow, i64)>, StoreError> {
    use diesel::dsl::sql;
    use diesel::sql_types::{BigInt, Text};
    let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
        return Ok(Vec::new());
    };
    let preview = sql::<Text>(&format!(
        "json_object('text', substr(json_extract(payload_json, '$.text'), 1, {PENDING_TEXT_CHARS}))"
    ));
    let chars = sql::<BigInt>("ifnull(length(json_extract(payload_json, '$.text')), 0)");
    Ok(sa::table
        .filter(is_live())
        .filter(sa::session_ordinal.eq(ordinal))
        .order(sa::seq.asc())
        .select((
            (
                sa::seq,
                sa::admission_id,
                sa::request_id,
                sa::principal_id,
                sa::target_session_id,
                sa::session_ordinal,
                preview,
                sa::payload_digest,
                sa::intent,
                sa::status,
                sa::outcome,
                sa::owner_epoch,
                sa::execution_generation,
                sa::result_json,
                sa::created_at,
                sa::updated_at,
            ),
            chars,
        ))
        .load::<(AdmissionRow, i64)>(conn)?)
}

/// The admission that holds a session's FIFO as `unknown`, if one does: its earliest (a seek on
/// the live rows' index).
pub fn holding_unknown(
    conn: &mut SqliteConnection,
    session: &str,
) -> Result<Option<String>, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
        return Ok(None);
    };
    Ok(sa::table
        .filter(is_live())
        .filter(sa::session_ordinal.eq(ordinal))
        .filter(sa::status.eq("unknown"))
        .order(sa::seq.asc())
        .select(sa::admission_id)
        .first(conn)
        .optional()?)
}

/// Terminal rows of a session, in seq order (none for a session that does not exist).
pub fn terminal_of_session(
    conn: &mut SqliteConnection,
    session: &str,
) -> Result<Vec<AdmissionRow>, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
        return Ok(Vec::new());
    };
    Ok(sa::table
        .filter(sa::session_ordinal.eq(ordinal))
        .filter(sa::status.eq("terminal"))
        .order(sa::seq.asc())
        .select(AdmissionRow::as_select())
        .load(conn)?)
}

/// Every non-terminal row with status `status` across sessions (operator view).
pub fn all_with_status(
    conn: &mut SqliteConnection,
    status: &str,
    limit: i64,
) -> Result<Vec<AdmissionRow>, StoreError> {
    Ok(sa::table
        .filter(is_live())
        .filter(sa::status.eq(status))
        .order(sa::seq.asc())
        .limit(limit)
        .select(AdmissionRow::as_select())
        .load(conn)?)
}

/// The ledger's counts by status (and outcome for settled rows), for metrics and status,
/// without reading settled history again on every call. Each row is counted once, when it is
/// new; a settled row never changes, so it is counted then and kept here; a row live
/// then is kept by its sequence and looked up again only once it has left the live rows
/// (through their partial index), to count its settlement. So a call reads the rows written
/// since the last one, the live rows, and those settled since. (It used to count the rows up
/// to the oldest live one and read every row after it on each call: one input left `unknown`
/// for weeks made every scrape of `/metrics` read the whole ledger written since.)
#[derive(Debug, Default)]
pub struct LedgerTally {
    /// Every row with `seq <= scanned` has been read once.
    scanned: i64,
    /// The settled rows among them, by outcome.
    settled: std::collections::BTreeMap<Option<String>, i64>,
    /// The rows among them that were live when last read, by sequence in ascending order: their
    /// settlement is yet to count. (Eight bytes a row, the spare capacity given back: a backlog
    /// of 300,000 inputs is 2.4 MB.)
    live: Vec<i64>,
}

impl LedgerTally {
    /// `(status, outcome, count)` for every pair present, in one snapshot.
    pub fn counts(
        &mut self,
        conn: &mut SqliteConnection,
    ) -> Result<Vec<(String, Option<String>, i64)>, StoreError> {
        use diesel::connection::DefaultLoadingMode;
        use diesel::dsl::max;
        conn.transaction(|conn| {
            let scanned = sa::table
                .select(max(sa::seq))
                .get_result::<Option<i64>>(conn)?
                .unwrap_or(0)
                .max(self.scanned);
            // The settled rows new since the last call (the first call's are the whole ledger;
            // the live ones are counted among the live rows below), a walk of that range of
            // the sequence, counted as they stream by: grouped by SQL, its sorter took the C
            // heap 10 MB for 300,000 rows.
            let mut settled = self.settled.clone();
            for outcome in sa::table
                .filter(sa::seq.gt(self.scanned))
                .filter(sa::status.eq("terminal"))
                .select(sa::outcome)
                .load_iter::<Option<String>, DefaultLoadingMode>(conn)?
            {
                *settled.entry(outcome?).or_insert(0) += 1;
            }
            // The live rows (through their partial index), counted as they stream by: only
            // their sequences are kept. (Loaded whole, each row in strings of its own, and the
            // new rows grouped by SQLite's sorter, four scrapes with 300,000 inputs queued
            // across 256 sessions left the daemon 61 MB larger.)
            let mut now: std::collections::BTreeMap<(String, Option<String>), i64> =
                std::collections::BTreeMap::new();
            let mut still: Vec<i64> = Vec::with_capacity(self.live.len());
            for row in sa::table
                .filter(is_live())
                .select((sa::seq, sa::status, sa::outcome))
                .load_iter::<(i64, String, Option<String>), DefaultLoadingMode>(conn)?
            {
                let (seq, status, outcome) = row?;
                still.push(seq);
                *now.entry((status, outcome)).or_insert(0) += 1;
            }
            still.sort_unstable();
            still.shrink_to_fit();
            // Live when last read, and no longer: settled since.
            let gone = left_only(&self.live, &still);
            for chunk in gone.chunks(500) {
                let outcomes: Vec<Option<String>> = sa::table
                    .filter(sa::seq.eq_any(chunk))
                    .select(sa::outcome)
                    .load(conn)?;
                for outcome in outcomes {
                    *settled.entry(outcome).or_insert(0) += 1;
                }
            }
            let mut all: std::collections::BTreeMap<(String, Option<String>), i64> = settled
                .iter()
                .map(|(o, n)| (("terminal".to_string(), o.clone()), *n))
                .collect();
            for (pair, n) in now {
                *all.entry(pair).or_insert(0) += n;
            }
            // Kept only once the whole snapshot was read (a failed read counts nothing twice).
            self.settled = settled;
            self.live = still;
            self.scanned = scanned;
            Ok(all.into_iter().map(|((s, o), n)| (s, o, n)).collect())
        })
    }
}

/// The values of `a` not in `b`, both in ascending order.
fn left_only(a: &[i64], b: &[i64]) -> Vec<i64> {
    let mut rest = b.iter().peekable();
    a.iter()
        .copied()
        .filter(|x| {
            while rest.next_if(|y| *y < x).is_some() {}
            rest.peek() != Some(&x)
        })
        .collect()
}

/// Sessions that have queued work and nothing unknown: the pumps to start at boot.
pub fn sessions_ready_to_pump(conn: &mut SqliteConnection) -> Result<Vec<String>, StoreError> {
    let queued: Vec<String> = sa::table
        .filter(is_live())
        .filter(sa::status.eq("queued"))
        .select(sa::target_session_id)
        .distinct()
        .load(conn)?;
    let blocked: std::collections::HashSet<String> = sa::table
        .filter(is_live())
        .filter(sa::status.eq_any(["unknown", "started"]))
        .select(sa::target_session_id)
        .distinct()
        .load::<String>(conn)?
        .into_iter()
        .collect();
    Ok(queued
        .into_iter()
        .filter(|s| !blocked.contains(s))
        .collect())
}

/// What a claim found.
#[derive(Debug)]
pub enum Claim {
    /// The head was claimed: it is now `started` with a new generation.
    Started(Box<AdmissionRow>),
    /// Nothing queued.
    Idle,
    /// Something is already started (one at a time).
    Busy,
}

/// Claim the lowest-seq queued row of `session`: bump the session's generation and stamp it.
/// An `unknown` row holds the FIFO (`unknown_execution`). A claim is reported by
/// `session.info {running}` and `message.start` events in the same transaction.
///
/// Beside the claim: whether another input stays queued behind the one it started (read in the
/// same seek as the head, as the FIFO's next row; `true` when it found another one started).
pub fn claim_next(
    conn: &mut SqliteConnection,
    epoch: i64,
    session: &str,
    now: f64,
) -> Result<(Logged<Claim>, bool), StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        // A session whose stored policy is damaged starts nothing: its inputs stay queued.
        let ordinal = super::sessions::ordinal_of_intact(conn, session)?;
        // Three seeks on the live rows' index (session, status, seq), however deep the queue.
        let in_status = |status: &'static str| {
            sa::table
                .filter(is_live())
                .filter(sa::session_ordinal.eq(ordinal))
                .filter(sa::status.eq(status))
        };
        // The rows that hold the FIFO (unknown ones, or the one started), in one statement: two
        // seeks on the live rows' index, no sort. At most one is ever started, and none is
        // claimed while an unknown one holds the FIFO, so these are few.
        let holding: Vec<(String, String)> = sa::table
            .filter(is_live())
            .filter(sa::session_ordinal.eq(ordinal))
            .filter(sa::status.eq("unknown").or(sa::status.eq("started")))
            .select((sa::status, sa::admission_id))
            .load(conn)?;
        if let Some((_, u)) = holding.iter().find(|(status, _)| status == "unknown") {
            return Err(StoreError::UnknownExecution(format!(
                "admission {u} is unknown; resolve it first"
            )));
        }
        if !holding.is_empty() {
            return Ok((Logged::quiet(Claim::Busy), true));
        }
        let first_two: Vec<AdmissionRow> = in_status("queued")
            .order(sa::seq.asc())
            .select(AdmissionRow::as_select())
            .limit(2)
            .load(conn)?;
        let more = first_two.len() > 1;
        let Some(head) = first_two.into_iter().next() else {
            return Ok((Logged::quiet(Claim::Idle), false));
        };
        // A plain UPDATE and a SELECT: `RETURNING` buffers its row in a temporary table.
        hot_sql!(
            "UPDATE sessions SET runtime_generation = runtime_generation + 1 WHERE id = ?",
            &[Bind::Text(session)],
        )
        .execute(conn)?;
        let (generation, tip): (i64, String) = hot_sql!(
            "SELECT runtime_generation, tip_session_id FROM sessions WHERE id = ?",
            &[Bind::Text(session)],
        )
        .returning::<(diesel::sql_types::BigInt, diesel::sql_types::Text)>()
        .get_result(conn)?;
        let n = hot_sql!(
            "UPDATE session_admissions SET status = 'started', owner_epoch = ?, \
             execution_generation = ?, updated_at = ? WHERE admission_id = ? AND status = 'queued'",
            &[
                Bind::Int(epoch),
                Bind::Int(generation),
                Bind::Real(now),
                Bind::Text(&head.admission_id),
            ],
        )
        .execute(conn)?;
        if n != 1 {
            return Err(StoreError::StaleGeneration(
                "the head moved during the claim".into(),
            ));
        }
        // The input's user message is written when its turn starts, in the claim itself.
        let user = NewMessage {
            session_id: tip,
            role: "user".into(),
            content: Some(head.text()),
            admission_id: Some(head.admission_id.clone()),
            ..Default::default()
        };
        // The tip is the root itself until a compaction rotates it: its ordinal is known then.
        insert_messages_knowing(
            conn,
            std::slice::from_ref(&user),
            Some((session, ordinal)),
            now,
        )?;
        let ids = serde_json::json!({"admission_id": head.admission_id, "execution_generation": generation});
        let logged = events::append_at(
            conn,
            session,
            ordinal,
            &[
                NewEvent::new(
                    "session.info",
                    serde_json::json!({"running": true, "execution_generation": generation, "admission_id": head.admission_id}),
                ),
                NewEvent::new("message.start", ids),
            ],
            now,
        )?;
        // The row as the update left it (no second read).
        let started = AdmissionRow {
            status: "started".into(),
            owner_epoch: Some(epoch),
            execution_generation: Some(generation),
            updated_at: now,
            ..head
        };
        Ok((Logged::new(Claim::Started(Box::new(started)), logged), more))
    })
}

/// Settle a started row with `outcome`, appending `closing` (its last messages) to the tip,
/// `report` (the settlement's events) to the log and the turn's token `usage` (prompt,
/// completion) to the session in the same transaction: a usage that cannot be added undoes the
/// settlement too (a retry settles both), rather than leave the turn settled while its caller
/// is told the settlement failed. Fenced: started, this epoch, this generation, the session's
/// running one.
///
/// Only its events come back: the row would be one more read, and nothing needs it (its
/// `message.complete` event carries the outcome).
#[allow(clippy::too_many_arguments)]
pub fn settle(
    conn: &mut SqliteConnection,
    epoch: i64,
    session: &str,
    admission_id: &str,
    generation: i64,
    outcome: &str,
    result_json: &str,
    closing: &[NewMessage],
    report: &[NewEvent],
    usage: (i64, i64),
    now: f64,
) -> Result<Logged<()>, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        // The generation fence and the revision bump in one statement.
        let fenced = hot_sql!(
            "UPDATE sessions SET runtime_revision = runtime_revision + 1 \
             WHERE id = ? AND runtime_generation = ?",
            &[Bind::Text(session), Bind::Int(generation)],
        )
        .execute(conn)?;
        if fenced != 1 {
            return Err(StoreError::StaleGeneration(format!(
                "generation {generation} is not running"
            )));
        }
        let (tip, ordinal): (String, i64) = hot_sql!(
            "SELECT tip_session_id, ordinal FROM sessions WHERE id = ?",
            &[Bind::Text(session)],
        )
        .returning::<(diesel::sql_types::Text, diesel::sql_types::BigInt)>()
        .get_result(conn)?;
        let n = hot_sql!(
            "UPDATE session_admissions SET status = 'terminal', outcome = ?, result_json = ?, \
             updated_at = ? WHERE admission_id = ? AND target_session_id = ? \
             AND status = 'started' AND owner_epoch = ? AND execution_generation = ?",
            &[
                Bind::Text(outcome),
                Bind::Text(result_json),
                Bind::Real(now),
                Bind::Text(admission_id),
                Bind::Text(session),
                Bind::Int(epoch),
                Bind::Int(generation),
            ],
        )
        .execute(conn)?;
        if n != 1 {
            return Err(StoreError::StaleGeneration(format!(
                "admission {admission_id} is not the running attempt"
            )));
        }
        let rows: Vec<NewMessage> = closing
            .iter()
            .cloned()
            .map(|m| NewMessage {
                session_id: tip.clone(),
                ..m
            })
            .collect();
        insert_messages_knowing(conn, &rows, Some((session, ordinal)), now)?;
        if usage != (0, 0) {
            super::sessions::add_usage(conn, session, usage.0, usage.1)?;
        }
        let logged = events::append_at(conn, session, ordinal, report, now)?;
        Ok(Logged::new((), logged))
    })
}

/// Refuse unless attempt `generation` of root `root` is running under `epoch`: `stale_epoch` once
/// another process holds the home (even before its boot has marked this process's attempts
/// `unknown`), else `stale_generation` unless the attempt's admission is `started`, owned by
/// this epoch. A session's `runtime_generation` moves at a claim
/// only, so it still names an attempt that has been settled until the next claim; a write of
/// the attempt's (its transcript, a compaction) checks the admission itself.
pub fn require_running(
    conn: &mut SqliteConnection,
    epoch: i64,
    root: &str,
    generation: i64,
) -> Result<(), StoreError> {
    super::epoch::check_epoch(conn, epoch)?;
    let running: i64 = match super::sessions::find_ordinal(conn, root)? {
        Some(ordinal) => attempt_rows(ordinal, epoch, generation)
            .count()
            .get_result(conn)?,
        None => 0,
    };
    if running == 0 {
        return Err(StoreError::StaleGeneration(format!(
            "attempt {generation} is no longer running"
        )));
    }
    Ok(())
}

/// The row of attempt `generation` of the session numbered `ordinal`, if it is running under
/// `epoch`: found through the session's live rows (by the session's name it was a walk of every
/// session's, on the writer, for every message a turn appended).
#[diesel::dsl::auto_type(no_type_alias)]
fn attempt_rows(ordinal: i64, epoch: i64, generation: i64) -> _ {
    let started: &'static str = "started";
    let live: IsLive = is_live();
    sa::table
        .filter(live)
        .filter(sa::session_ordinal.eq(ordinal))
        .filter(sa::status.eq(started))
        .filter(sa::owner_epoch.eq(epoch))
        .filter(sa::execution_generation.eq(generation))
}

/// Cancel a queued row (terminal/cancelled). Started → `stale_generation`; unknown →
/// `unknown_execution`; terminal rows are returned as they are. A cancellation is reported by a
/// `session.info {cancelled}` event.
pub fn cancel(
    conn: &mut SqliteConnection,
    epoch: i64,
    session: &str,
    admission_id: &str,
    now: f64,
) -> Result<Logged<AdmissionRow>, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let row = of_session(conn, session, admission_id)?;
        match row.status.as_str() {
            "queued" => {
                // The fence is the statement's own: only this session's row, only while queued.
                let n = diesel::update(
                    sa::table
                        .filter(sa::admission_id.eq(admission_id))
                        .filter(sa::target_session_id.eq(session))
                        .filter(sa::status.eq("queued")),
                )
                .set((
                    sa::status.eq("terminal"),
                    sa::outcome.eq("cancelled"),
                    sa::updated_at.eq(now),
                ))
                .execute(conn)?;
                if n != 1 {
                    return Err(StoreError::StaleGeneration(format!(
                        "admission {admission_id} is no longer queued"
                    )));
                }
                let logged = events::append(
                    conn,
                    session,
                    &[NewEvent::new(
                        "session.info",
                        serde_json::json!({"cancelled": admission_id, "outcome": "cancelled"}),
                    )],
                    now,
                )?;
                Ok(Logged::new(by_id(conn, admission_id)?, logged))
            }
            "started" => Err(StoreError::StaleGeneration(
                "the admission is running; interrupt it instead".into(),
            )),
            "unknown" => Err(StoreError::UnknownExecution(
                "the admission is unknown; resolve it instead".into(),
            )),
            _ => Ok(Logged::quiet(row)),
        }
    })
}

/// The user message the claim of `admission_id` wrote, found among the messages of the sessions
/// of `root`'s lineage (through their key), not by a walk of every session's messages.
#[diesel::dsl::auto_type(no_type_alias)]
fn unclaimed_user_message<'a>(root: &'a str, admission_id: &'a str) -> _ {
    let user: &'static str = "user";
    super::schema::messages::table
        .filter(
            super::schema::messages::session_ordinal.eq_any(
                sessions::table
                    .filter(sessions::root_id.eq(root))
                    .select(sessions::ordinal),
            ),
        )
        .filter(super::schema::messages::admission_id.eq(admission_id))
        .filter(super::schema::messages::role.eq(user))
}

/// Put back a row claimed just as a graceful stop began, before anything of its turn ran: `queued`
/// again (so it runs after the restart, in its place), its claim's user message removed, in one
/// transaction. Fenced: started, this epoch, this generation. Reported by `session.info`.
pub fn unclaim(
    conn: &mut SqliteConnection,
    epoch: i64,
    session: &str,
    admission_id: &str,
    generation: i64,
    now: f64,
) -> Result<Logged<AdmissionRow>, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let n = diesel::update(
            sa::table
                .filter(sa::admission_id.eq(admission_id))
                .filter(sa::target_session_id.eq(session))
                .filter(sa::status.eq("started"))
                .filter(sa::owner_epoch.eq(epoch))
                .filter(sa::execution_generation.eq(generation)),
        )
        .set((
            sa::status.eq("queued"),
            sa::execution_generation.eq(None::<i64>),
            sa::updated_at.eq(now),
        ))
        .execute(conn)?;
        if n != 1 {
            return Err(StoreError::StaleGeneration(format!(
                "admission {admission_id} is not the claimed attempt {generation}"
            )));
        }
        diesel::delete(unclaimed_user_message(session, admission_id)).execute(conn)?;
        let logged = events::append(
            conn,
            session,
            &[NewEvent::new(
                "session.info",
                serde_json::json!({"running": false, "requeued": admission_id}),
            )],
            now,
        )?;
        Ok(Logged::new(by_id(conn, admission_id)?, logged))
    })
}

/// Settle an `unknown` row `terminal/interrupted` (the operator's decision), closing the transcript
/// in the same transaction. The generation must match; the input is never replayed. Reported by a
/// `session.info {resolved}` event.
pub fn resolve_unknown(
    conn: &mut SqliteConnection,
    epoch: i64,
    session: &str,
    admission_id: &str,
    generation: i64,
    now: f64,
) -> Result<Logged<AdmissionRow>, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let row = of_session(conn, session, admission_id)?;
        if row.status != "unknown" || row.execution_generation != Some(generation) {
            // Say where it is: settled already (by whom is in its outcome), or another attempt.
            let now_at = match (row.status.as_str(), row.outcome.as_deref()) {
                ("terminal", Some(outcome)) => format!("it is already settled ({outcome})"),
                ("unknown", _) => format!(
                    "it is unknown at generation {}",
                    row.execution_generation.unwrap_or_default()
                ),
                (status, _) => format!("it is {status}"),
            };
            return Err(StoreError::StaleGeneration(format!(
                "admission {admission_id} is not unknown at generation {generation}: {now_at}"
            )));
        }
        let tip: String = sessions::table
            .filter(sessions::id.eq(session))
            .select(sessions::tip_session_id)
            .first(conn)?;
        let transcript = live(conn, &tip)?;
        // Parked on a question when the process died (its last prompt was closed abandoned at
        // the boot, and nothing of the turn was recorded after it opened): the call it asked
        // about, and those after it, never ran. Else a call left without a result may have been
        // running: one after a prompt that timed out, say, whose resolution was not yet written
        // (the turn goes on without waiting for it), when the process died. "After" is read by
        // message id, which only grows (a clock stepped back between the prompt and a later
        // message made it look older); a prompt opened before ids were kept compares times.
        use super::schema::prompts as p;
        let last_prompt: Option<(Option<String>, f64, Option<i64>)> = p::table
            .filter(p::admission_id.eq(admission_id))
            .filter(p::execution_generation.eq(generation))
            .order((p::after_message_id.desc(), p::opened_at.desc()))
            .select((p::resolution, p::opened_at, p::after_message_id))
            .first(conn)
            .optional()?;
        let parked = match last_prompt {
            Some((Some(resolution), opened_at, after)) if resolution == "abandoned" => {
                !transcript.iter().any(|m| {
                    m.admission_id.as_deref() == Some(admission_id)
                        && after.map_or(m.timestamp > opened_at, |after| m.id > after)
                })
            }
            _ => false,
        };
        let closing: Vec<NewMessage> = closing_messages(
            &transcript,
            "[This turn was lost when the gateway stopped unexpectedly and was discarded by an operator. \
             It may have been partially done.]",
            Some(admission_id),
            if parked { OpenCalls::Ended(&[]) } else { OpenCalls::Lost },
        )
        .into_iter()
        .map(|m| NewMessage { session_id: tip.clone(), ..m })
        .collect();
        insert_messages(conn, &closing, now)?;
        // Fenced in the statement too: this session's row, unknown, at this generation.
        let n = diesel::update(
            sa::table
                .filter(sa::admission_id.eq(admission_id))
                .filter(sa::target_session_id.eq(session))
                .filter(sa::status.eq("unknown"))
                .filter(sa::execution_generation.eq(generation)),
        )
        .set((
            sa::status.eq("terminal"),
            sa::outcome.eq("interrupted"),
            sa::owner_epoch.eq(epoch),
            sa::result_json.eq(r#"{"resolved":"operator"}"#),
            sa::updated_at.eq(now),
        ))
        .execute(conn)?;
        if n != 1 {
            return Err(StoreError::StaleGeneration(format!(
                "admission {admission_id} is not unknown at generation {generation}"
            )));
        }
        diesel::update(sessions::table.filter(sessions::id.eq(session)))
            .set(sessions::runtime_revision.eq(sessions::runtime_revision + 1))
            .execute(conn)?;
        let logged = events::append(
            conn,
            session,
            &[NewEvent::new(
                "session.info",
                serde_json::json!({"resolved": admission_id, "outcome": "interrupted"}),
            )],
            now,
        )?;
        Ok(Logged::new(by_id(conn, admission_id)?, logged))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{epoch, testing};

    /// A settlement and its usage commit together or not at all: a usage refused leaves the
    /// turn running (to be settled again), not settled with the caller told it failed.
    #[test]
    fn a_settlement_and_its_usage_are_one_transaction() {
        use diesel::connection::SimpleConnection;
        let (_d, mut c, e, row) = testing::started_turn();
        let generation = row.execution_generation.expect("generation");
        let tokens = |c: &mut SqliteConnection| -> (i64, i64) {
            sessions::table
                .filter(sessions::id.eq("s1"))
                .select((sessions::prompt_tokens, sessions::completion_tokens))
                .first(c)
                .expect("tokens")
        };
        c.batch_execute(
            "CREATE TRIGGER refuse_usage BEFORE UPDATE OF prompt_tokens ON sessions \
             BEGIN SELECT RAISE(ABORT, 'usage refused'); END;",
        )
        .expect("trigger");
        let settle_now = |c: &mut SqliteConnection| {
            settle(
                c,
                e,
                "s1",
                &row.admission_id,
                generation,
                "completed",
                "{}",
                &[],
                &[],
                (7, 3),
                3.0,
            )
        };
        assert!(settle_now(&mut c).is_err(), "the usage was refused");
        assert_eq!(
            by_id(&mut c, &row.admission_id).expect("row").status,
            "started"
        );
        assert_eq!(tokens(&mut c), (0, 0));
        c.batch_execute("DROP TRIGGER refuse_usage").expect("drop");
        settle_now(&mut c).expect("settled with its usage");
        assert_eq!(
            by_id(&mut c, &row.admission_id).expect("row").status,
            "terminal"
        );
        assert_eq!(tokens(&mut c), (7, 3));
    }

    /// [`claim_next`]'s claim alone.
    fn claim(
        c: &mut SqliteConnection,
        epoch: i64,
        session: &str,
        now: f64,
    ) -> Result<Logged<Claim>, StoreError> {
        Ok(claim_next(c, epoch, session, now)?.0)
    }

    /// Inputs `a` then `b` of session `s1`, admitted queued.
    fn two_queued(c: &mut SqliteConnection, e: i64) -> (AdmissionRow, AdmissionRow) {
        let (a, _) = admit(c, e, "p", "s1", "a", "A", 10, 1.0).expect("a").value;
        let (b, _) = admit(c, e, "p", "s1", "b", "B", 10, 1.0).expect("b").value;
        (a, b)
    }

    fn setup() -> (testing::tempfile_dir::TempDir, SqliteConnection, i64) {
        let (d, mut conn) = testing::conn();
        let e = epoch::begin_epoch(&mut conn, "i", 1.0).expect("epoch");
        testing::session(&mut conn, e, "s1");
        (d, conn, e)
    }

    /// Every query of the ledger seeks an index, none scans the table, and those of the hot
    /// paths (admission, claim, settlement) stay prepared. Live rows, by
    /// session or across sessions, are found through the partial index (settled rows, almost
    /// the whole ledger, are not in it; with a bound `status != ?` SQLite could not use it);
    /// a replay and a session's settled rows through the idempotency key; a row by its id.
    #[test]
    fn ledger_queries_seek_an_index() {
        let (_d, mut c, _) = setup();
        // The SQL, and whether diesel keeps the statement prepared.
        fn sql<Q>(q: &Q) -> (String, bool)
        where
            Q: diesel::query_builder::QueryFragment<diesel::sqlite::Sqlite>,
        {
            let cached = q
                .is_safe_to_cache_prepared(&diesel::sqlite::Sqlite)
                .expect("cache");
            (testing::sql_of(q), cached)
        }
        // `USING INDEX` or `USING COVERING INDEX`.
        let open = "INDEX session_admissions_open";
        let key = "INDEX sqlite_autoindex_session_admissions_2";
        let id = "INDEX sqlite_autoindex_session_admissions_1";
        let cases = [
            (
                "live rows across sessions",
                sql(&sa::table
                    .filter(is_live())
                    .filter(sa::status.eq_any(["unknown", "started"]))
                    .select(sa::target_session_id)),
                open,
                false,
            ),
            (
                "a session's head",
                sql(&sa::table
                    .filter(is_live())
                    .filter(sa::session_ordinal.eq(1))
                    .filter(sa::status.eq("queued"))
                    .order(sa::seq.asc())
                    .select(sa::seq)
                    .limit(1)),
                open,
                true,
            ),
            (
                "a session's pending rows",
                sql(&sa::table
                    .filter(is_live())
                    .filter(sa::session_ordinal.eq(1))
                    .order(sa::seq.asc())
                    .select(sa::seq)),
                open,
                true,
            ),
            (
                "a replayed input",
                sql(&sa::table
                    .filter(sa::principal_id.eq("p"))
                    .filter(sa::session_ordinal.eq(1))
                    .filter(sa::request_id.eq("r"))
                    .select(sa::seq)),
                key,
                true,
            ),
            (
                "a session's settled rows",
                sql(&sa::table
                    .filter(sa::session_ordinal.eq(1))
                    .filter(sa::status.eq("terminal"))
                    .order(sa::seq.asc())
                    .select(sa::seq)),
                key,
                true,
            ),
            (
                "a row by id",
                sql(&sa::table.filter(sa::admission_id.eq("a")).select(sa::seq)),
                id,
                true,
            ),
            (
                "the rows holding a session's FIFO",
                sql(&sa::table
                    .filter(is_live())
                    .filter(sa::session_ordinal.eq(1))
                    .filter(sa::status.eq("unknown").or(sa::status.eq("started")))
                    .select((sa::status, sa::admission_id))),
                open,
                true,
            ),
            (
                "a session's queued bounds",
                (QUEUED_BOUNDS.replace('?', "1"), true),
                open,
                true,
            ),
            (
                "the tally's rows settled since its last count",
                sql(&sa::table
                    .filter(sa::seq.gt(1))
                    .filter(sa::status.eq("terminal"))
                    .select(sa::outcome)),
                "INTEGER PRIMARY KEY (rowid>?)",
                false,
            ),
            (
                "a principal's newest row",
                sql(&latest_seq(1, "p")),
                "SEARCH session_admissions USING COVERING INDEX sqlite_autoindex_session_admissions_2 (session_ordinal=? AND principal_id=?)",
                true,
            ),
            (
                "a session's newest row",
                sql(&last_seq(1)),
                "SEARCH session_admissions USING COVERING INDEX sqlite_autoindex_session_admissions_2 (session_ordinal=?)",
                true,
            ),
            (
                "a running attempt",
                sql(&attempt_rows(1, 1, 1).count()),
                "SEARCH session_admissions USING INDEX session_admissions_open (session_ordinal=? AND status=?)",
                true,
            ),
            (
                "the tally's live rows",
                sql(&sa::table
                    .filter(is_live())
                    .select((sa::seq, sa::status, sa::outcome))),
                "INDEX session_admissions_open",
                false,
            ),
        ];
        for (what, (sql, cached), index, hot) in cases {
            assert!(cached || !hot, "{what} is parsed again on every run: {sql}");
            let plan = testing::query_plan(&mut c, &sql);
            assert!(
                plan.iter().any(|d| d.contains(index)),
                "{what}: {sql}: {plan:?}"
            );
            assert!(
                !plan
                    .iter()
                    .any(|d| d.starts_with("SCAN session_admissions") && !d.contains("USING")),
                "{what} scans the ledger: {sql}: {plan:?}"
            );
        }
    }

    /// Putting a claim back finds its user message through the lineage's sessions and the
    /// messages' key, without scanning the messages of every session.
    #[test]
    fn an_unclaim_finds_its_user_message_by_key() {
        let (_d, mut c, _) = setup();
        let sql = testing::sql_of(&diesel::delete(unclaimed_user_message("s1", "a1")));
        let plan = testing::query_plan(&mut c, &sql);
        assert!(
            plan.iter().any(|d| d.contains("INDEX messages_live")),
            "{sql}: {plan:?}"
        );
        assert!(
            !plan.iter().any(|d| d == "SCAN messages"),
            "{sql}: {plan:?}"
        );
    }

    /// The ledger as the lean-ledger migration leaves it: every row and its FIFO order kept,
    /// `seq` going on from the largest, idempotent replays still found, no `sqlite_sequence`
    /// entry left, and the old indexes gone.
    #[test]
    fn the_lean_ledger_migration_keeps_every_row() {
        use diesel::connection::SimpleConnection;
        use diesel_migrations::MigrationHarness;
        let (_dir, mut c) = testing::conn_just_before("_lean_ledger");
        let e = epoch::begin_epoch(&mut c, "i", 1.0).expect("epoch");
        testing::session(&mut c, e, "s1");
        // Old rows with a gap in `seq` (as AUTOINCREMENT leaves after a failed insert).
        let row = |seq: i64, text: &str, status: &str, outcome: &str, generation: &str| {
            let payload = serde_json::json!({ "text": text }).to_string();
            format!(
                "({seq}, 'a{seq}', 'r{seq}', 'p', 's1', '{payload}', '{}', '{status}', {outcome}, \
                 1, {generation}, {seq}.0, {seq}.0)",
                digest("s1", &payload)
            )
        };
        c.batch_execute(&format!(
            "INSERT INTO session_admissions (seq, admission_id, request_id, principal_id, \
               target_session_id, payload_json, payload_digest, status, outcome, owner_epoch, \
               execution_generation, created_at, updated_at) VALUES {}, {};",
            row(3, "one", "terminal", "'completed'", "1"),
            row(7, "two", "queued", "NULL", "NULL"),
        ))
        .expect("old rows");
        c.run_pending_migrations(crate::store::MIGRATIONS)
            .expect("migrate");
        let indexes: Vec<String> = diesel::sql_query(
            "SELECT name AS detail FROM sqlite_schema WHERE type = 'index' \
             AND tbl_name = 'session_admissions' ORDER BY name",
        )
        .load::<testing::Detail>(&mut c)
        .expect("indexes")
        .into_iter()
        .map(|d| d.detail)
        .collect();
        assert_eq!(
            indexes,
            [
                "session_admissions_open",
                "sqlite_autoindex_session_admissions_1",
                "sqlite_autoindex_session_admissions_2"
            ]
        );
        assert_eq!(testing::sequence_entries(&mut c, "session_admissions"), 0);
        assert_eq!(
            by_id(&mut c, "a3").expect("a3").outcome.as_deref(),
            Some("completed")
        );
        assert_eq!(
            pending(&mut c, "s1")
                .expect("pending")
                .iter()
                .map(|(r, _)| (r.seq, r.text()))
                .collect::<Vec<_>>(),
            vec![(7, "two".to_string())]
        );
        let replay = admit(&mut c, e, "p", "s1", "r7", "two", 100, 3.0).expect("replay");
        assert_eq!((replay.value.0.seq, replay.value.1), (7, false));
        let next = admit(&mut c, e, "p", "s1", "r8", "three", 100, 3.0).expect("admit");
        assert_eq!((next.value.0.seq, next.value.1), (8, true));
        assert_eq!(
            terminal_of_session(&mut c, "s1")
                .expect("terminal")
                .iter()
                .map(|r| r.seq)
                .collect::<Vec<_>>(),
            vec![3]
        );
    }

    /// The kept tally matches a full count of the ledger at every step: rows settling out of
    /// order, live rows among settled ones, and their settlements counted once they come.
    #[test]
    fn the_ledger_tally_matches_a_full_count_without_rereading_settled_rows() {
        let (_d, mut c, e) = setup();
        testing::session(&mut c, e, "s2");
        let full = |c: &mut SqliteConnection| -> Vec<(String, Option<String>, i64)> {
            let mut v: Vec<(String, Option<String>, i64)> = sa::table
                .group_by((sa::status, sa::outcome))
                .select((sa::status, sa::outcome, diesel::dsl::count_star()))
                .load(c)
                .expect("full count");
            v.sort();
            v
        };
        let mut tally = LedgerTally::default();
        let check = |c: &mut SqliteConnection, tally: &mut LedgerTally| {
            assert_eq!(tally.counts(c).expect("tally"), full(c));
        };
        check(&mut c, &mut tally);
        // s2's input stays queued behind a started one: it holds the mark at its sequence.
        let started = admit(&mut c, e, "p", "s2", "hold-1", "x", 10, 1.0)
            .expect("admit")
            .value
            .0
            .admission_id;
        claim(&mut c, e, "s2", 1.0).expect("claim");
        let queued = admit(&mut c, e, "p", "s2", "hold-2", "x", 10, 1.0)
            .expect("admit")
            .value
            .0
            .admission_id;
        for i in 0..3 {
            one_turn(&mut c, e, &format!("in-{i}"));
            check(&mut c, &mut tally);
        }
        assert_eq!(
            tally.live.len(),
            2,
            "s2's started and queued rows are the only ones kept to read again"
        );
        cancel(&mut c, e, "s2", &queued, 2.0).expect("cancel queued");
        check(&mut c, &mut tally);
        let generation = by_id(&mut c, &started).expect("row").execution_generation;
        settle(
            &mut c,
            e,
            "s2",
            &started,
            generation.unwrap_or(0),
            "failed",
            "{}",
            &[],
            &[],
            (0, 0),
            3.0,
        )
        .expect("settle");
        check(&mut c, &mut tally);
        let newest: i64 = sa::table
            .select(diesel::dsl::max(sa::seq))
            .get_result::<Option<i64>>(&mut c)
            .expect("max")
            .unwrap_or(0);
        assert_eq!(
            (tally.scanned, tally.live.len()),
            (newest, 0),
            "everything is settled and counted once"
        );
        one_turn(&mut c, e, "after");
        check(&mut c, &mut tally);
    }

    /// A count reads the ledger through its keys and streams what it reads: no statement scans
    /// the whole ledger or sorts what it read (SQLite's sorter held 10 MB of the C heap for a
    /// backlog of 300,000 inputs).
    #[test]
    fn the_ledger_tally_neither_scans_nor_sorts_the_ledger() {
        let (_d, mut c, e) = setup();
        let mut tally = LedgerTally::default();
        one_turn(&mut c, e, "settled");
        admit(&mut c, e, "p", "s1", "queued", "x", 10, 1.0).expect("admit");
        tally.counts(&mut c).expect("first count");
        // Each turn admits its input and settles the FIFO's head: `queued` settles (live at the
        // last count), then `next` (new since it); `last` stays queued.
        one_turn(&mut c, e, "next");
        one_turn(&mut c, e, "last");
        let (counted, ran) = testing::statements_of(&mut c, |c| tally.counts(c));
        let counted = counted.expect("count");
        assert_eq!(
            counted,
            [
                ("queued".to_string(), None, 1),
                ("terminal".to_string(), Some("completed".to_string()), 3)
            ]
        );
        let reads: Vec<&String> = ran.iter().filter(|q| q.starts_with("SELECT")).collect();
        // The newest sequence, the rows new since the last count, the live rows, and the
        // settlements of those live then.
        assert_eq!(reads.len(), 4, "{ran:#?}");
        for sql in reads {
            let plan = testing::query_plan(&mut c, sql);
            assert!(
                !plan
                    .iter()
                    .any(|d| d.contains("TEMP B-TREE") || d == "SCAN session_admissions"),
                "{sql}: {plan:?}"
            );
        }
    }

    /// One turn's transitions: admit, claim, settle with a closing message and an event.
    fn one_turn(c: &mut SqliteConnection, e: i64, input: &str) {
        admit(c, e, "p", "s1", input, "hi", 10, 1.0).expect("admit");
        let Claim::Started(row) = claim(c, e, "s1", 2.0).expect("claim").value else {
            panic!("no claim")
        };
        let reply = NewMessage {
            role: "assistant".into(),
            content: Some("hello".into()),
            ..Default::default()
        };
        let report = [NewEvent::new("message.complete", serde_json::json!({}))];
        let generation = row.execution_generation.expect("generation");
        settle(
            c,
            e,
            "s1",
            &row.admission_id,
            generation,
            "completed",
            "{}",
            std::slice::from_ref(&reply),
            &report,
            (0, 0),
            3.0,
        )
        .expect("settle");
        crate::store::sessions::add_usage(c, "s1", 1, 1).expect("usage");
    }

    /// The statements of a turn are prepared once per connection and kept: the first turn caches
    /// its updates too (diesel keeps no `UPDATE` unless told), the second prepares nothing new.
    #[test]
    fn a_turn_keeps_its_statements_prepared() {
        use std::sync::{Arc, Mutex};
        let (_d, mut c, e) = setup();
        let cached: Arc<Mutex<Vec<String>>> = Arc::default();
        let sink = cached.clone();
        c.set_instrumentation(move |ev: diesel::connection::InstrumentationEvent<'_>| {
            if let diesel::connection::InstrumentationEvent::CacheQuery { sql, .. } = ev {
                if let Ok(mut v) = sink.lock() {
                    v.push(sql.to_string());
                }
            }
        });
        one_turn(&mut c, e, "first");
        let first = std::mem::take(&mut *cached.lock().expect("lock"));
        let updates = first.iter().filter(|s| s.starts_with("UPDATE")).count();
        assert!(
            updates >= 4,
            "the turn's updates should be kept prepared: {first:#?}"
        );
        one_turn(&mut c, e, "second");
        let second = cached.lock().expect("lock").clone();
        assert!(
            second.is_empty(),
            "the second turn prepared new statements: {second:#?}"
        );
    }

    #[test]
    fn left_only_keeps_what_the_second_sorted_list_lacks() {
        assert_eq!(left_only(&[1, 3, 5, 7, 9], &[2, 3, 4, 9, 10]), [1, 5, 7]);
        assert_eq!(left_only(&[1, 2], &[]), [1, 2]);
        assert_eq!(left_only(&[], &[1]), Vec::<i64>::new());
        assert_eq!(left_only(&[4, 5], &[1, 2, 3, 4, 5]), Vec::<i64>::new());
    }

    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(hex(&[]), "");
    }

    /// Once a newer epoch is taken, every write of the ledger, the sessions and the transcript
    /// that an old process might still send is refused `stale_epoch` and changes nothing (only
    /// the admission, the settlement, the prompts and the events had a test of their own).
    #[test]
    fn every_write_of_an_old_epoch_is_refused_and_changes_nothing() {
        use crate::store::messages::NewMessage;
        use crate::store::sessions;
        let (_d, mut c, e) = setup();
        let (a, b) = two_queued(&mut c, e);
        assert!(matches!(
            claim(&mut c, e, "s1", 2.0).map(|l| l.value),
            Ok(Claim::Started(_))
        ));
        epoch::begin_epoch(&mut c, "newer", 3.0).expect("a newer epoch");
        let state = |c: &mut SqliteConnection| {
            let rows: Vec<(String, String, Option<String>, Option<i64>)> = sa::table
                .order(sa::seq.asc())
                .select((
                    sa::admission_id,
                    sa::status,
                    sa::outcome,
                    sa::execution_generation,
                ))
                .load(c)
                .expect("ledger");
            let sessions: Vec<(String, i64, String)> = crate::store::schema::sessions::table
                .order(crate::store::schema::sessions::id.asc())
                .select((
                    crate::store::schema::sessions::id,
                    crate::store::schema::sessions::runtime_generation,
                    crate::store::schema::sessions::tip_session_id,
                ))
                .load(c)
                .expect("sessions");
            let messages: i64 = crate::store::schema::messages::table
                .count()
                .get_result(c)
                .expect("messages");
            (rows, sessions, messages)
        };
        let before = state(&mut c);
        let stale = |what: &str, r: Result<(), StoreError>| {
            assert!(matches!(r, Err(StoreError::StaleEpoch)), "{what}: {r:?}");
        };
        stale("claim", claim(&mut c, e, "s1", 3.0).map(|_| ()));
        stale(
            "cancel",
            cancel(&mut c, e, "s1", &b.admission_id, 3.0).map(|_| ()),
        );
        stale(
            "unclaim",
            unclaim(&mut c, e, "s1", &a.admission_id, 1, 3.0).map(|_| ()),
        );
        stale(
            "resolve_unknown",
            resolve_unknown(&mut c, e, "s1", &a.admission_id, 1, 3.0).map(|_| ()),
        );
        stale(
            "create_or_get",
            sessions::create_or_get(&mut c, e, &testing::new_session("s2"), 3.0).map(|_| ()),
        );
        let reply = [NewMessage::text("assistant", "late")];
        stale(
            "append_for_attempt",
            crate::store::messages::append_for_attempt(&mut c, e, "s1", 1, &reply, 3.0).map(|_| ()),
        );
        let compaction = sessions::Compaction {
            root_id: "s1".into(),
            old_tip: "s1".into(),
            child_id: Some("s1-child".into()),
            system_prompt: None,
            messages: vec![NewMessage::text("user", "summary")],
        };
        stale(
            "commit_compaction",
            sessions::commit_compaction(&mut c, e, 1, &compaction, 3.0).map(|_| ()),
        );
        assert_eq!(state(&mut c), before, "nothing changed");
    }

    #[test]
    fn admit_is_idempotent_and_conflicts_on_other_text() {
        let (_d, mut c, e) = setup();
        let (a, created) = admit(&mut c, e, "p", "s1", "in-1", "hello", 10, 1.0)
            .expect("admit")
            .value;
        assert!(created);
        // The row returned is the row stored, field for field.
        let stored = by_id(&mut c, &a.admission_id).expect("stored");
        assert_eq!(
            serde_json::to_value(&a).expect("json"),
            serde_json::to_value(&stored).expect("json")
        );
        let (b, created) = admit(&mut c, e, "p", "s1", "in-1", "hello", 10, 2.0)
            .expect("again")
            .value;
        assert!(!created);
        assert_eq!(a.admission_id, b.admission_id);
        assert!(matches!(
            admit(&mut c, e, "p", "s1", "in-1", "other", 10, 2.0),
            Err(StoreError::AdmissionConflict(_))
        ));
        assert!(matches!(
            admit(&mut c, e, "p", "nope", "in-2", "x", 10, 2.0),
            Err(StoreError::NotFound(_))
        ));
        admit(&mut c, e, "p", "s1", "in-2", "x", 2, 2.0).expect("second queued");
        assert!(matches!(
            admit(&mut c, e, "p", "s1", "in-3", "x", 2, 2.0),
            Err(StoreError::SessionBusy(_))
        ));
    }

    #[test]
    fn claims_are_fifo_one_at_a_time_and_settles_are_fenced() {
        let (_d, mut c, e) = setup();
        let (a, b) = two_queued(&mut c, e);
        let Claim::Started(first) = claim(&mut c, e, "s1", 2.0).expect("claim").value else {
            panic!("no claim")
        };
        assert_eq!(first.admission_id, a.admission_id);
        assert_eq!(first.execution_generation, Some(1));
        assert!(matches!(
            claim(&mut c, e, "s1", 2.0).expect("busy").value,
            Claim::Busy
        ));
        assert!(matches!(
            settle(
                &mut c,
                e,
                "s1",
                &a.admission_id,
                7,
                "completed",
                "{}",
                &[],
                &[],
                (0, 0),
                3.0
            ),
            Err(StoreError::StaleGeneration(_))
        ));
        settle(
            &mut c,
            e,
            "s1",
            &a.admission_id,
            1,
            "completed",
            "{}",
            &[],
            &[],
            (0, 0),
            3.0,
        )
        .expect("settle");
        let Claim::Started(second) = claim(&mut c, e, "s1", 4.0).expect("claim").value else {
            panic!("no claim")
        };
        assert_eq!(second.admission_id, b.admission_id);
        assert_eq!(second.execution_generation, Some(2));
    }

    /// An operator's resolution of an `unknown` turn finds its attempt's last prompt through the
    /// prompts' attempt index: it reads none of the other prompts the audit keeps, nor sorts them.
    #[test]
    fn resolving_an_unknown_turn_reads_only_its_attempts_prompts() {
        let (_d, mut c, e, a) = testing::started_turn();
        let g = a.execution_generation.expect("generation");
        crate::store::prompts::record_open(
            &mut c,
            e,
            "p1",
            "s1",
            &a.admission_id,
            g,
            "approval",
            &serde_json::json!({"prompt_id": "p1"}),
            2.5,
        )
        .expect("prompt");
        let e2 = epoch::begin_epoch(&mut c, "j", 3.0).expect("epoch");
        assert_eq!(epoch::recover_started(&mut c, e2, 3.0).expect("sweep"), 1);
        let (resolved, ran) = testing::statements_of(&mut c, |c| {
            resolve_unknown(c, e2, "s1", &a.admission_id, g, 4.0)
        });
        resolved.expect("resolve");
        let on_prompts: Vec<&String> = ran
            .iter()
            .filter(|q| q.starts_with("SELECT") && q.contains("FROM `prompts`"))
            .collect();
        assert_eq!(on_prompts.len(), 1, "{ran:#?}");
        let plan = testing::query_plan(&mut c, on_prompts[0]);
        assert!(
            plan.iter()
                .any(|d| d.contains("USING INDEX prompts_attempt"))
                && !plan.iter().any(|d| d.contains("TEMP B-TREE")),
            "{}: {plan:?}",
            on_prompts[0]
        );
    }

    #[test]
    fn unknown_holds_the_fifo_until_resolved_with_its_generation() {
        let (_d, mut c, e) = setup();
        let (a, _) = admit(&mut c, e, "p", "s1", "a", "A", 10, 1.0)
            .expect("a")
            .value;
        admit(&mut c, e, "p", "s1", "b", "B", 10, 1.0).expect("b");
        assert!(matches!(
            claim(&mut c, e, "s1", 2.0).map(|l| l.value),
            Ok(Claim::Started(_))
        ));
        let e2 = epoch::begin_epoch(&mut c, "j", 3.0).expect("epoch");
        assert_eq!(epoch::recover_started(&mut c, e2, 3.0).expect("sweep"), 1);
        assert!(matches!(
            claim(&mut c, e2, "s1", 3.0),
            Err(StoreError::UnknownExecution(_))
        ));
        assert!(sessions_ready_to_pump(&mut c).expect("ready").is_empty());
        // The old process can no longer settle it.
        assert!(matches!(
            settle(
                &mut c,
                e,
                "s1",
                &a.admission_id,
                1,
                "completed",
                "{}",
                &[],
                &[],
                (0, 0),
                3.0
            ),
            Err(StoreError::StaleEpoch)
        ));
        assert!(matches!(
            resolve_unknown(&mut c, e2, "s1", &a.admission_id, 9, 4.0),
            Err(StoreError::StaleGeneration(_))
        ));
        let r = resolve_unknown(&mut c, e2, "s1", &a.admission_id, 1, 4.0)
            .expect("resolve")
            .value;
        assert_eq!(
            (r.status.as_str(), r.outcome.as_deref()),
            ("terminal", Some("interrupted"))
        );
        assert!(matches!(
            resolve_unknown(&mut c, e2, "s1", &a.admission_id, 1, 4.0),
            Err(StoreError::StaleGeneration(_))
        ));
        assert!(matches!(
            claim(&mut c, e2, "s1", 5.0).map(|l| l.value),
            Ok(Claim::Started(_))
        ));
    }

    /// A turn's assistant message calling `clarify` (`ask`), then `terminal` (`run`).
    fn ask_then_run(admission_id: &str) -> crate::store::messages::NewMessage {
        let calls = serde_json::json!([
            {"id": "ask", "type": "function", "function": {"name": "clarify", "arguments": "{}"}},
            {"id": "run", "type": "function", "function": {"name": "terminal", "arguments": "{}"}},
        ]);
        crate::store::messages::NewMessage {
            role: "assistant".into(),
            tool_calls: Some(calls.to_string()),
            admission_id: Some(admission_id.into()),
            ..Default::default()
        }
    }

    /// The result of [`ask_then_run`]'s question that timed out: the turn went past it.
    fn timed_out_answer(admission_id: &str) -> crate::store::messages::NewMessage {
        crate::store::messages::NewMessage {
            role: "tool".into(),
            content: Some("timed out".into()),
            tool_call_id: Some("ask".into()),
            tool_name: Some("clarify".into()),
            admission_id: Some(admission_id.into()),
            ..Default::default()
        }
    }

    /// What `s1`'s transcript says of [`ask_then_run`]'s command once its turn was resolved.
    fn run_stub(c: &mut SqliteConnection) -> String {
        crate::store::messages::live(c, "s1")
            .expect("live")
            .into_iter()
            .find(|m| m.tool_call_id.as_deref() == Some("run"))
            .and_then(|m| m.content)
            .expect("the command's stub")
    }

    /// A turn parked on a question when the process died: the call it asked about never ran,
    /// and its stub says so. A turn whose question timed out and went on (its timeout not yet
    /// written when the process died, so the boot closed the prompt abandoned) to a command:
    /// that command may have run, and its stub says that. Before, both said "did not run".
    /// Both hold when the ended prompts were pruned meanwhile, and when the clock was stepped
    /// back between the prompt and the turn's next message (written at an earlier time).
    #[test]
    fn a_lost_turn_after_a_prompt_it_went_past_may_have_run_its_calls() {
        use crate::store::messages::append_for_attempt;
        use crate::store::prompts::{close_abandoned, record_open};
        for (went_on, at) in [(false, 0.0), (true, 2.3), (true, 2.15)] {
            let (_d, mut c, e) = setup();
            let a = admit(&mut c, e, "p", "s1", "a", "A", 10, 1.0)
                .expect("a")
                .value
                .0;
            let Claim::Started(_) = claim(&mut c, e, "s1", 2.0).expect("claim").value else {
                panic!("no claim")
            };
            let assistant = ask_then_run(&a.admission_id);
            append_for_attempt(&mut c, e, "s1", 1, &[assistant], 2.1).expect("calls");
            let payload = serde_json::json!({"question": "?"});
            record_open(
                &mut c,
                e,
                "q1",
                "s1",
                &a.admission_id,
                1,
                "clarify",
                &payload,
                2.2,
            )
            .expect("prompt");
            if went_on {
                let timed_out = timed_out_answer(&a.admission_id);
                append_for_attempt(&mut c, e, "s1", 1, &[timed_out], at).expect("result");
            }
            let e2 = epoch::begin_epoch(&mut c, "j", 3.0).expect("epoch");
            epoch::recover_started(&mut c, e2, 3.0).expect("sweep");
            assert_eq!(close_abandoned(&mut c, e2, 3.0).expect("close"), 1);
            // However long the operator takes: the pruner keeps an unknown turn's prompts (it
            // took them, and the parked turn's stub then said its command "may have run").
            crate::store::prompts::prune(&mut c, 1e12).expect("prune");
            resolve_unknown(&mut c, e2, "s1", &a.admission_id, 1, 4.0).expect("resolve");
            let stub = run_stub(&mut c);
            if went_on {
                assert!(stub.contains("may have run"), "at {at}: {stub}");
            } else {
                assert!(stub.contains("did not run"), "{stub}");
            }
        }
    }

    /// A prompt remembers its own session's newest message, not the table's: another
    /// session's claim, taken back by a drain, had the newest id, and its deleted user
    /// message's id went to this turn's next message, which then read as written before the
    /// prompt (its command's stub said "did not run").
    #[test]
    fn a_message_id_given_again_still_reads_as_after_the_prompt() {
        use crate::store::messages::append_for_attempt;
        use crate::store::prompts::{close_abandoned, record_open};
        let (_d, mut c, e) = setup();
        testing::session(&mut c, e, "s2");
        let b = admit(&mut c, e, "p", "s1", "b", "B", 10, 1.0)
            .expect("b")
            .value
            .0;
        let Claim::Started(_) = claim(&mut c, e, "s1", 2.0).expect("claim").value else {
            panic!("no claim")
        };
        let assistant = ask_then_run(&b.admission_id);
        append_for_attempt(&mut c, e, "s1", 1, &[assistant], 2.1).expect("calls");
        // Another session's claim writes the newest message of the table.
        let a = admit(&mut c, e, "p", "s2", "a", "A", 10, 2.2)
            .expect("a")
            .value
            .0;
        let Claim::Started(claimed) = claim(&mut c, e, "s2", 2.3).expect("claim a").value else {
            panic!("no claim of a")
        };
        let payload = serde_json::json!({"question": "?"});
        record_open(
            &mut c,
            e,
            "q1",
            "s1",
            &b.admission_id,
            1,
            "clarify",
            &payload,
            2.4,
        )
        .expect("prompt");
        // A drain takes that claim back (its user message deleted); the turn goes past its
        // question, and its next message gets the deleted one's id.
        let generation = claimed.execution_generation.expect("generation");
        unclaim(&mut c, e, "s2", &a.admission_id, generation, 2.5).expect("unclaim");
        let timed_out = timed_out_answer(&b.admission_id);
        append_for_attempt(&mut c, e, "s1", 1, &[timed_out], 2.6).expect("result");
        let e2 = epoch::begin_epoch(&mut c, "j", 3.0).expect("epoch");
        epoch::recover_started(&mut c, e2, 3.0).expect("sweep");
        assert_eq!(close_abandoned(&mut c, e2, 3.0).expect("close"), 1);
        resolve_unknown(&mut c, e2, "s1", &b.admission_id, 1, 4.0).expect("resolve");
        let stub = run_stub(&mut c);
        assert!(stub.contains("may have run"), "{stub}");
    }

    #[test]
    fn an_unclaimed_row_is_queued_again_without_its_user_message() {
        use crate::store::messages::live;
        let (_d, mut c, e) = setup();
        let (a, _) = admit(&mut c, e, "p", "s1", "a", "A", 10, 1.0)
            .expect("a")
            .value;
        let Claim::Started(first) = claim(&mut c, e, "s1", 2.0).expect("claim").value else {
            panic!("no claim")
        };
        assert_eq!(
            live(&mut c, "s1").expect("live").len(),
            1,
            "the claim wrote the user message"
        );
        assert!(matches!(
            unclaim(&mut c, e, "s1", &a.admission_id, 9, 3.0),
            Err(StoreError::StaleGeneration(_))
        ));
        let back = unclaim(
            &mut c,
            e,
            "s1",
            &a.admission_id,
            first.execution_generation.unwrap_or(0),
            3.0,
        )
        .expect("unclaim")
        .value;
        assert_eq!(
            (back.status.as_str(), back.execution_generation),
            ("queued", None)
        );
        assert!(live(&mut c, "s1").expect("live").is_empty());
        let Claim::Started(again) = claim(&mut c, e, "s1", 4.0).expect("claim").value else {
            panic!("no second claim")
        };
        assert_eq!(again.admission_id, a.admission_id);
        assert_eq!(again.execution_generation, Some(2));
        assert_eq!(live(&mut c, "s1").expect("live").len(), 1);
    }

    #[test]
    fn only_queued_rows_cancel() {
        let (_d, mut c, e) = setup();
        let (a, b) = two_queued(&mut c, e);
        claim(&mut c, e, "s1", 2.0).expect("claim");
        assert!(matches!(
            cancel(&mut c, e, "s1", &a.admission_id, 2.0),
            Err(StoreError::StaleGeneration(_))
        ));
        let r = cancel(&mut c, e, "s1", &b.admission_id, 2.0)
            .expect("cancel")
            .value;
        assert_eq!(r.outcome.as_deref(), Some("cancelled"));
    }

    fn kinds(events: &[events::EventRow]) -> Vec<(i64, &str)> {
        events.iter().map(|e| (e.seq, e.kind.as_str())).collect()
    }

    #[test]
    fn a_claim_says_whether_another_input_stays_queued() {
        let (_d, mut c, e) = setup();
        testing::session(&mut c, e, "s2");
        testing::session(&mut c, e, "s3");
        admit(&mut c, e, "p", "s1", "a", "A", 10, 1.0).expect("a");
        admit(&mut c, e, "p", "s1", "b", "B", 10, 1.0).expect("b");
        admit(&mut c, e, "p", "s2", "c", "C", 10, 1.0).expect("c");
        let (first, more) = claim_next(&mut c, e, "s1", 2.0).expect("claim s1");
        assert!(matches!(first.value, Claim::Started(r) if r.request_id == "a"));
        assert!(more, "b stays queued behind a");
        let (only, more) = claim_next(&mut c, e, "s2", 2.0).expect("claim s2");
        assert!(matches!(only.value, Claim::Started(r) if r.request_id == "c"));
        assert!(!more, "nothing is queued behind c");
        let (busy, more) = claim_next(&mut c, e, "s2", 2.0).expect("busy s2");
        assert!(matches!(busy.value, Claim::Busy));
        assert!(more, "a busy claim does not say the FIFO is empty");
        let (idle, more) = claim_next(&mut c, e, "s3", 2.0).expect("idle s3");
        assert!(matches!(idle.value, Claim::Idle));
        assert!(!more);
    }

    #[test]
    fn transitions_log_their_events_and_refusals_log_nothing() {
        let (_d, mut c, e) = setup();
        let a = admit(&mut c, e, "p", "s1", "a", "A", 10, 1.0).expect("a");
        assert_eq!(kinds(&a.events), vec![(1, "session.info")]);
        assert_eq!(a.events[0].payload()["admitted"], a.value.0.admission_id);
        let again = admit(&mut c, e, "p", "s1", "a", "A", 10, 1.0).expect("again");
        assert!(again.events.is_empty());
        let claim = claim(&mut c, e, "s1", 2.0).expect("claim");
        assert_eq!(
            kinds(&claim.events),
            vec![(2, "session.info"), (3, "message.start")]
        );
        let id = a.value.0.admission_id.clone();
        let report = [NewEvent::new(
            "message.complete",
            serde_json::json!({ "admission_id": id }),
        )];
        assert!(settle(
            &mut c,
            e,
            "s1",
            &id,
            9,
            "completed",
            "{}",
            &[],
            &report,
            (0, 0),
            3.0
        )
        .is_err());
        let done = settle(
            &mut c,
            e,
            "s1",
            &id,
            1,
            "completed",
            "{}",
            &[],
            &report,
            (0, 0),
            3.0,
        )
        .expect("settle");
        assert_eq!(kinds(&done.events), vec![(4, "message.complete")]);
        assert_eq!(events::head(&mut c, "s1").expect("head").last_seq, 4);
        let (b, _) = admit(&mut c, e, "p", "s1", "b", "B", 10, 4.0)
            .expect("b")
            .value;
        let cancelled = cancel(&mut c, e, "s1", &b.admission_id, 5.0).expect("cancel");
        assert_eq!(kinds(&cancelled.events), vec![(6, "session.info")]);
        let again = cancel(&mut c, e, "s1", &b.admission_id, 5.0).expect("again");
        assert!(again.events.is_empty());
    }
}
