//! Prompt audit (every approval/clarify and how it ended) and the durable approval allow-lists.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;

use super::events::{self, EventRow, NewEvent};
use super::schema::{approval_allowlist, principal_approvals, prompts, session_approvals};
use crate::error::StoreError;

#[derive(Debug, Clone, Queryable, Selectable, serde::Serialize)]
#[diesel(table_name = prompts)]
pub struct PromptRow {
    pub prompt_id: String,
    pub session_id: String,
    pub admission_id: String,
    pub execution_generation: i64,
    pub kind: String,
    pub payload_json: String,
    pub opened_at: f64,
    pub resolved_at: Option<f64>,
    pub resolution: Option<String>,
    pub resolved_by: Option<String>,
}

/// Record an open prompt and its `<kind>.request` event (the payload clients answer from).
/// Fenced: the prompt's attempt must be the running one (its admission `started`, owned by
/// this epoch, at `generation`), else `stale_generation` and nothing is written: a prompt of an
/// attempt that has ended is never recorded open.
#[allow(clippy::too_many_arguments)]
pub fn record_open(
    conn: &mut SqliteConnection,
    epoch: i64,
    prompt_id: &str,
    session_id: &str,
    admission_id: &str,
    generation: i64,
    kind: &str,
    payload: &serde_json::Value,
    now: f64,
) -> Result<Vec<EventRow>, StoreError> {
    let payload_json = payload.to_string();
    super::write_tx(conn, |conn| {
        // An attempt's generation names it within its session: the running admission at this
        // generation is the prompt's own.
        super::admissions::require_running(conn, epoch, session_id, generation)?;
        // A message of the turn written after this prompt has a larger id than the session's
        // newest now, whatever the clock said (see `admissions::resolve_unknown`). The
        // session's own: the newest of the whole table could be another session's claim that
        // a drain then took back (its user message deleted), and its id was given again to
        // this turn's next message, which then read as written before the prompt.
        let tip = super::sessions::root_of(conn, session_id)?.tip_session_id;
        let after_message_id: Option<i64> = match super::sessions::find_ordinal(conn, &tip)? {
            Some(ordinal) => {
                use super::schema::messages as m;
                m::table
                    .filter(m::session_ordinal.eq(ordinal))
                    .filter(m::active.eq(1))
                    .select(diesel::dsl::max(m::id))
                    .first(conn)?
            }
            None => None,
        };
        diesel::insert_into(prompts::table)
            .values((
                prompts::prompt_id.eq(prompt_id),
                prompts::session_id.eq(session_id),
                prompts::admission_id.eq(admission_id),
                prompts::execution_generation.eq(generation),
                prompts::kind.eq(kind),
                prompts::payload_json.eq(&payload_json),
                prompts::opened_at.eq(now),
                prompts::after_message_id.eq(after_message_id.unwrap_or(0)),
            ))
            .execute(conn)?;
        events::append(
            conn,
            session_id,
            &[NewEvent::new(format!("{kind}.request"), payload.clone())],
            now,
        )
    })
}

fn settled_event(row: &PromptRow, resolution: &str) -> NewEvent {
    NewEvent::new(
        format!("{}.settled", row.kind),
        serde_json::json!({"prompt_id": row.prompt_id, "resolution": resolution,
                           "execution_generation": row.execution_generation}),
    )
}

/// Record how a prompt ended (first resolution wins) and its `<kind>.settled` event. Fenced by
/// the epoch: a process whose authority another took records nothing (`stale_epoch`; the new
/// one closed the prompts it found open at its boot).
pub fn record_resolution(
    conn: &mut SqliteConnection,
    epoch: i64,
    prompt_id: &str,
    resolution: &str,
    by: &str,
    now: f64,
) -> Result<Vec<EventRow>, StoreError> {
    super::write_tx(conn, |conn| {
        super::epoch::check_epoch(conn, epoch)?;
        Ok(resolve(conn, prompt_id, resolution, by, now)?.unwrap_or_default())
    })
}

/// Record a human's answer before the attempt acts on it, fenced: the prompt must still be open
/// and its attempt the running one (its admission `started` at `generation`, owned by `epoch`),
/// else `stale_generation` and nothing is written. An answer that commits here is the one the
/// attempt acts on; one that cannot commit is never acted on.
#[allow(clippy::too_many_arguments)]
pub fn record_answer(
    conn: &mut SqliteConnection,
    epoch: i64,
    session_id: &str,
    generation: i64,
    prompt_id: &str,
    resolution: &str,
    by: &str,
    now: f64,
) -> Result<Vec<EventRow>, StoreError> {
    super::write_tx(conn, |conn| {
        super::admissions::require_running(conn, epoch, session_id, generation)?;
        resolve(conn, prompt_id, resolution, by, now)?.ok_or_else(|| {
            StoreError::StaleGeneration(format!("prompt {prompt_id} is no longer open"))
        })
    })
}

/// Resolve the open prompt `prompt_id` and append its `<kind>.settled` event (`None`: it was
/// not open). Call inside a write transaction.
fn resolve(
    conn: &mut SqliteConnection,
    prompt_id: &str,
    resolution: &str,
    by: &str,
    now: f64,
) -> Result<Option<Vec<EventRow>>, StoreError> {
    let Some(row) = prompts::table
        .filter(prompts::prompt_id.eq(prompt_id))
        .filter(prompts::resolved_at.is_null())
        .select(PromptRow::as_select())
        .first(conn)
        .optional()?
    else {
        return Ok(None);
    };
    diesel::update(
        prompts::table
            .filter(prompts::prompt_id.eq(prompt_id))
            .filter(prompts::resolved_at.is_null()),
    )
    .set((
        prompts::resolved_at.eq(now),
        prompts::resolution.eq(resolution),
        prompts::resolved_by.eq(by),
    ))
    .execute(conn)?;
    let rows = events::append(
        conn,
        &row.session_id,
        &[settled_event(&row, resolution)],
        now,
    )?;
    Ok(Some(rows))
}

/// At boot: prompts left open by a previous process ended with it (each with its
/// `<kind>.settled {resolution: "abandoned"}` event). Fenced by the booting process's `epoch`: a
/// process that took the home after it owns the prompts open now.
pub fn close_abandoned(
    conn: &mut SqliteConnection,
    epoch: i64,
    now: f64,
) -> Result<usize, StoreError> {
    super::write_tx(conn, |conn| {
        super::epoch::check_epoch(conn, epoch)?;
        let open: Vec<PromptRow> = prompts::table
            .filter(prompts::resolved_at.is_null())
            .order(prompts::opened_at.asc())
            .select(PromptRow::as_select())
            .load(conn)?;
        diesel::update(prompts::table.filter(prompts::resolved_at.is_null()))
            .set((
                prompts::resolved_at.eq(now),
                prompts::resolution.eq("abandoned"),
                prompts::resolved_by.eq("restart"),
            ))
            .execute(conn)?;
        for row in &open {
            events::append(
                conn,
                &row.session_id,
                &[settled_event(row, "abandoned")],
                now,
            )?;
        }
        Ok(open.len())
    })
}

/// Ended prompts pruned by one transaction, at most.
const PRUNE_BATCH: i64 = 4096;

/// Delete up to a batch of the prompts that ended before `before` (their audit rows: the events
/// that reported them are pruned by then); whether more may be left. Open prompts are kept
/// however old, and so are those of a turn still `unknown`: its resolution reads them (a turn
/// parked on a prompt when the process died ran nothing after it, and its transcript says so).
pub fn prune(conn: &mut SqliteConnection, before: f64) -> Result<bool, StoreError> {
    super::write_tx(conn, |conn| {
        let old: Vec<String> = ended_before(before).load(conn)?;
        diesel::delete(prompts::table.filter(prompts::prompt_id.eq_any(&old))).execute(conn)?;
        Ok(old.len() as i64 == PRUNE_BATCH)
    })
}

/// The ids of the oldest batch of prompts that ended before `before` (a seek on
/// `prompts_resolved`).
fn ended_before(
    before: f64,
) -> prompts::BoxedQuery<'static, diesel::sqlite::Sqlite, diesel::sql_types::Text> {
    use super::schema::session_admissions as sa;
    let unknown: &'static str = "unknown";
    prompts::table
        .filter(prompts::resolved_at.is_not_null())
        .filter(prompts::resolved_at.lt(before))
        .filter(diesel::dsl::not(diesel::dsl::exists(
            sa::table
                .filter(sa::admission_id.eq(prompts::admission_id))
                .filter(sa::status.eq(unknown)),
        )))
        .order(prompts::resolved_at.asc())
        .select(prompts::prompt_id)
        .limit(PRUNE_BATCH)
        .into_boxed()
}

/// The prompts of attempt `generation` of admission `admission_id` still open (none resolved),
/// by prompt id: what a snapshot read in the same transaction as the log's head lists, so a
/// prompt is either in it or settled by an event after that head.
pub fn open_of_attempt(
    conn: &mut SqliteConnection,
    admission_id: &str,
    generation: i64,
) -> Result<Vec<PromptRow>, StoreError> {
    Ok(prompts::table
        .filter(prompts::admission_id.eq(admission_id))
        .filter(prompts::execution_generation.eq(generation))
        .filter(prompts::resolved_at.is_null())
        .order(prompts::prompt_id.asc())
        .select(PromptRow::as_select())
        .load(conn)?)
}

pub fn for_session(
    conn: &mut SqliteConnection,
    session_id: &str,
) -> Result<Vec<PromptRow>, StoreError> {
    Ok(prompts::table
        .filter(prompts::session_id.eq(session_id))
        .order(prompts::opened_at.asc())
        .select(PromptRow::as_select())
        .load(conn)?)
}

/// Is `key` approved for this session, or for good by its principal (or, kept before approvals
/// were a principal's, for everyone)?
pub fn is_approved(
    conn: &mut SqliteConnection,
    session_id: &str,
    principal_id: &str,
    key: &str,
) -> Result<bool, StoreError> {
    let always: i64 = approval_allowlist::table
        .filter(approval_allowlist::pattern_key.eq(key))
        .count()
        .get_result(conn)?;
    if always > 0 {
        return Ok(true);
    }
    let principal: i64 = principal_approvals::table
        .filter(principal_approvals::principal_id.eq(principal_id))
        .filter(principal_approvals::pattern_key.eq(key))
        .count()
        .get_result(conn)?;
    if principal > 0 {
        return Ok(true);
    }
    let session: i64 = session_approvals::table
        .filter(session_approvals::session_id.eq(session_id))
        .filter(session_approvals::pattern_key.eq(key))
        .count()
        .get_result(conn)?;
    Ok(session > 0)
}

/// Remember approvals of `keys` for the session (and for good, for the session's principal, when
/// `always`), in one transaction, fenced by the epoch.
pub fn remember(
    conn: &mut SqliteConnection,
    epoch: i64,
    session_id: &str,
    principal_id: &str,
    keys: &[&str],
    always: bool,
    now: f64,
) -> Result<(), StoreError> {
    super::write_tx(conn, |conn| {
        super::epoch::check_epoch(conn, epoch)?;
        for key in keys {
            diesel::insert_or_ignore_into(session_approvals::table)
                .values((
                    session_approvals::session_id.eq(session_id),
                    session_approvals::pattern_key.eq(key),
                    session_approvals::created_at.eq(now),
                ))
                .execute(conn)?;
            if always {
                diesel::insert_or_ignore_into(principal_approvals::table)
                    .values((
                        principal_approvals::principal_id.eq(principal_id),
                        principal_approvals::pattern_key.eq(key),
                        principal_approvals::created_at.eq(now),
                    ))
                    .execute(conn)?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing;

    /// An approval prompt `id` opened in session `s1` for `row`'s attempt at generation `g`.
    fn open_in_s1(
        c: &mut SqliteConnection,
        epoch: i64,
        row: &crate::store::admissions::AdmissionRow,
        id: &str,
        g: i64,
    ) -> Result<Vec<EventRow>, StoreError> {
        let payload = serde_json::json!({"prompt_id": id});
        record_open(
            c,
            epoch,
            id,
            "s1",
            &row.admission_id,
            g,
            "approval",
            &payload,
            3.0,
        )
    }

    /// [`testing::started_turn`] with prompts `ids` opened for its attempt; also the attempt's
    /// generation.
    fn started_with_prompts(
        ids: &[&str],
    ) -> (
        testing::tempfile_dir::TempDir,
        SqliteConnection,
        i64,
        crate::store::admissions::AdmissionRow,
        i64,
    ) {
        let (d, mut c, e, row) = testing::started_turn();
        let g = row.execution_generation.expect("generation");
        for id in ids {
            open_in_s1(&mut c, e, &row, id, g).expect("opened");
        }
        (d, c, e, row, g)
    }

    /// A prompt is recorded open only for the running attempt: another generation, or the same
    /// one once its turn settled, is stale and leaves neither a row nor a request event.
    #[test]
    fn a_prompt_opens_only_for_the_running_attempt() {
        let (_d, mut c, e, row) = testing::started_turn();
        let g = row.execution_generation.expect("generation");
        let open = |c: &mut SqliteConnection, id: &str, g: i64| open_in_s1(c, e, &row, id, g);
        assert!(matches!(
            open(&mut c, "stale", g + 1),
            Err(StoreError::StaleGeneration(_))
        ));
        assert_eq!(open(&mut c, "a1", g).expect("opened").len(), 1);
        testing::settle_bare(&mut c, e, &row, "completed", 4.0);
        assert!(matches!(
            open(&mut c, "late", g),
            Err(StoreError::StaleGeneration(_))
        ));
        let ids: Vec<String> = prompts::table
            .select(prompts::prompt_id)
            .load(&mut c)
            .expect("prompts");
        assert_eq!(ids, ["a1"]);
    }

    /// Once another process has taken the home's epoch, this one's prompt writes are refused
    /// `stale_epoch`, even before that process's boot has marked the attempt `unknown`: no
    /// prompt opened, no answer recorded (to be acted on), no approval remembered. Before, the
    /// attempt's `started` row, still owned by the old epoch, let all three through.
    #[test]
    fn prompt_writes_are_refused_once_the_epoch_moved_on() {
        let (_d, mut c, e, row, g) = started_with_prompts(&["a1"]);
        crate::store::epoch::begin_epoch(&mut c, "newer", 5.0).expect("a newer epoch");
        assert!(matches!(
            open_in_s1(&mut c, e, &row, "a2", g),
            Err(StoreError::StaleEpoch)
        ));
        assert!(matches!(
            record_answer(&mut c, e, "s1", g, "a1", "choice:always", "alice", 6.0),
            Err(StoreError::StaleEpoch)
        ));
        assert!(matches!(
            remember(&mut c, e, "s1", "p", &["rm"], true, 6.0),
            Err(StoreError::StaleEpoch)
        ));
        assert!(!is_approved(&mut c, "s1", "p", "rm").expect("read"));
        let open: Vec<(String, Option<String>)> = prompts::table
            .select((prompts::prompt_id, prompts::resolution))
            .load(&mut c)
            .expect("prompts");
        assert_eq!(open, [("a1".to_string(), None)]);
    }

    /// The pruner deletes the prompts that ended before its cutoff, through their index, and
    /// keeps the open ones however old.
    #[test]
    fn ended_prompts_age_out_and_open_ones_stay() {
        let (_d, mut c, e, _, _) = started_with_prompts(&["old", "new", "open"]);
        record_resolution(&mut c, e, "old", "timeout", "gateway", 10.0).expect("old ended");
        record_resolution(&mut c, e, "new", "timeout", "gateway", 30.0).expect("new ended");
        assert!(!prune(&mut c, 20.0).expect("prune"), "one batch");
        let kept: Vec<String> = prompts::table
            .order(prompts::prompt_id.asc())
            .select(prompts::prompt_id)
            .load(&mut c)
            .expect("prompts");
        assert_eq!(kept, ["new", "open"]);
        assert!(!prune(&mut c, 1e12).expect("prune"));
        let kept: Vec<String> = prompts::table
            .select(prompts::prompt_id)
            .load(&mut c)
            .expect("prompts");
        assert_eq!(kept, ["open"]);
        let sql = testing::sql_of(&ended_before(20.0));
        let plan = testing::query_plan(&mut c, &sql);
        assert!(
            plan.iter().any(|d| d.contains("prompts_resolved")),
            "{sql}: {plan:?}"
        );
        assert!(
            !plan
                .iter()
                .any(|d| d.starts_with("SCAN session_admissions")),
            "{sql}: {plan:?}"
        );
    }

    /// A start closes the prompts an earlier process left open, found through their index
    /// (`prompts_open`): it reads none of the ended prompts the audit keeps, which a week of
    /// approvals makes many (the bench's store of a million turns with one approval in ten: its
    /// start took 0.131 s from the disk reading them, 0.044 s through the index).
    #[test]
    fn a_start_finds_the_open_prompts_without_reading_the_ended_ones() {
        let (_d, mut c, e, _, _) = started_with_prompts(&["ended", "open"]);
        record_resolution(&mut c, e, "ended", "once", "p", 10.0).expect("ended");
        let (closed, ran) = testing::statements_of(&mut c, |c| close_abandoned(c, e, 20.0));
        assert_eq!(closed.expect("closed"), 1);
        let ended: Vec<(String, Option<String>)> = prompts::table
            .order(prompts::prompt_id.asc())
            .select((prompts::prompt_id, prompts::resolution))
            .load(&mut c)
            .expect("prompts");
        assert_eq!(
            ended,
            [
                ("ended".to_string(), Some("once".to_string())),
                ("open".to_string(), Some("abandoned".to_string()))
            ]
        );
        let on_prompts: Vec<&String> = ran.iter().filter(|q| q.contains("`prompts`")).collect();
        assert_eq!(on_prompts.len(), 2, "the read and the update: {ran:#?}");
        for sql in on_prompts {
            let plan = testing::query_plan(&mut c, sql);
            let on_table: Vec<&String> = plan.iter().filter(|d| d.contains("prompts")).collect();
            assert!(
                !on_table.is_empty()
                    && on_table
                        .iter()
                        .all(|d| d.contains("USING INDEX prompts_open")),
                "{sql}: {plan:?}"
            );
        }
    }

    /// A boot's closing of abandoned prompts is fenced by its epoch: a process that took the
    /// home after it (while it stalled between its steps) keeps its prompts open.
    #[test]
    fn a_deposed_boot_closes_no_prompt() {
        let (_d, mut c, e, _, _) = started_with_prompts(&["p1"]);
        let newer = crate::store::epoch::begin_epoch(&mut c, "newer", 5.0).expect("epoch");
        assert!(matches!(
            close_abandoned(&mut c, e, 6.0),
            Err(StoreError::StaleEpoch)
        ));
        let open: Vec<(String, Option<String>)> = prompts::table
            .select((prompts::prompt_id, prompts::resolution))
            .load(&mut c)
            .expect("prompts");
        assert_eq!(
            open,
            [("p1".to_string(), None)],
            "left to the newer process"
        );
        assert_eq!(close_abandoned(&mut c, newer, 7.0).expect("closed"), 1);
    }

    /// An answer is recorded only while its prompt is open and its attempt runs, at its
    /// generation under this epoch: otherwise `stale_generation`, and nothing is written, neither
    /// the resolution nor a settled event.
    #[test]
    fn an_answer_is_recorded_only_for_the_running_attempt() {
        let (_d, mut c, e, row, g) = started_with_prompts(&["a1", "a2"]);
        let answer = |c: &mut SqliteConnection, epoch: i64, g: i64, id: &str| {
            record_answer(c, epoch, "s1", g, id, "choice:once", "alice", 4.0)
        };
        let head = |c: &mut SqliteConnection| events::head(c, "s1").expect("head").last_seq;
        let before = head(&mut c);
        assert!(matches!(
            answer(&mut c, e, g + 1, "a1"),
            Err(StoreError::StaleGeneration(_))
        ));
        assert!(matches!(
            answer(&mut c, e + 1, g, "a1"),
            Err(StoreError::StaleEpoch)
        ));
        assert_eq!(head(&mut c), before, "no event for a refused answer");
        let settled = answer(&mut c, e, g, "a1").expect("recorded");
        assert_eq!(settled.len(), 1);
        assert_eq!(settled[0].kind, "approval.settled");
        // The first resolution wins: a second answer to the same prompt is refused.
        assert!(matches!(
            answer(&mut c, e, g, "a1"),
            Err(StoreError::StaleGeneration(_))
        ));
        testing::settle_bare(&mut c, e, &row, "completed", 5.0);
        assert!(matches!(
            answer(&mut c, e, g, "a2"),
            Err(StoreError::StaleGeneration(_))
        ));
        let resolved: Vec<(String, Option<String>, Option<String>)> = prompts::table
            .order(prompts::prompt_id.asc())
            .select((
                prompts::prompt_id,
                prompts::resolution,
                prompts::resolved_by,
            ))
            .load(&mut c)
            .expect("prompts");
        assert_eq!(
            resolved,
            [
                (
                    "a1".into(),
                    Some("choice:once".into()),
                    Some("alice".into())
                ),
                ("a2".into(), None, None)
            ]
        );
    }
}
