//! Chat-completion threads: which session goes on with an OpenAI-style conversation.
//!
//! A chat-completions client sends the whole conversation every time. Each request's list of
//! messages is recorded (as a key) with the session its input went to; the next request of the
//! same conversation is that list, the answer, and a new user message, so it finds the session
//! by the key of the list without its last two messages, and goes on there only when that session
//! is exactly where the conversation left it: the recorded input is the session's last one,
//! completed, with the answer the client sends back. Anything else (another branch of the
//! conversation, a history the client wrote or edited, a session that has moved on) is not that
//! session's conversation.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;

use super::schema::{chat_threads, session_admissions as sa};
use crate::error::StoreError;

/// The session recorded for `key`, if any.
pub fn find(
    conn: &mut SqliteConnection,
    principal: &str,
    key: &str,
) -> Result<Option<String>, StoreError> {
    Ok(chat_threads::table
        .filter(chat_threads::principal_id.eq(principal))
        .filter(chat_threads::thread_key.eq(key))
        .select(chat_threads::session_id)
        .first(conn)
        .optional()?)
}

/// Record, in one transaction, that the requests `keys` went to `session`; answer the session
/// each key names now (the first record of a key stands: a retried request goes where it went
/// before, and a key that another request recorded first names that request's session).
pub fn record(
    conn: &mut SqliteConnection,
    principal: &str,
    keys: &[String],
    session: &str,
    now: f64,
) -> Result<Vec<String>, StoreError> {
    Ok(record_made(conn, principal, keys, session, now)?
        .into_iter()
        .map(|(named, _)| named)
        .collect())
}

/// [`record`], also saying of each key whether this call made its record (else it was there).
pub fn record_made(
    conn: &mut SqliteConnection,
    principal: &str,
    keys: &[String],
    session: &str,
    now: f64,
) -> Result<Vec<(String, bool)>, StoreError> {
    super::write_tx(conn, |conn| {
        let mut named = Vec::with_capacity(keys.len());
        for key in keys {
            let made = diesel::insert_or_ignore_into(chat_threads::table)
                .values((
                    chat_threads::principal_id.eq(principal),
                    chat_threads::thread_key.eq(key),
                    chat_threads::session_id.eq(session),
                    chat_threads::created_at.eq(now),
                ))
                .execute(conn)?
                == 1;
            named.push((
                chat_threads::table
                    .filter(chat_threads::principal_id.eq(principal))
                    .filter(chat_threads::thread_key.eq(key))
                    .select(chat_threads::session_id)
                    .first(conn)?,
                made,
            ));
        }
        Ok(named)
    })
}

/// Claim, for the request whose conversation's key is `key`, the going on in `session` from the
/// request whose key is `previous`: whether it is this request's (the first to claim it, or this
/// same request again). Two requests that go on from the same one at once (two branches of a
/// conversation, or two end users' identical openings) both found the session where the
/// conversation left off, and both went on in it, each turn seeing the other's message: only
/// the claim's holder goes on there now. The claim is a record of its own,
/// `next-<session>-<previous>` (a conversation that comes back after its records aged out goes
/// on in another session, free of the old claim), holding the claimant's key where a record
/// holds a session id.
///
/// Answers whether the claim is this request's, and whether this call made it (else this same
/// request, sent twice at once, made it first).
pub fn claim_next(
    conn: &mut SqliteConnection,
    principal: &str,
    session: &str,
    previous: &str,
    key: &str,
    now: f64,
) -> Result<(bool, bool), StoreError> {
    let claims = record_made(
        conn,
        principal,
        &[format!("next-{session}-{previous}")],
        key,
        now,
    )?;
    Ok(claims
        .first()
        .map_or((false, false), |(holder, made)| (holder == key, *made)))
}

/// A refused request's claim and records, to let go of (see [`let_go`]).
pub struct Refused<'a> {
    /// The session it claimed going on in.
    pub session: &'a str,
    /// The key of the conversation's previous request.
    pub previous: &'a str,
    /// Its conversation's key, the claim's holder.
    pub key: &'a str,
    /// The ids the previous request's input may have, and its answer.
    pub left: (&'a [String], &'a str),
    /// The records this request made: each key with what it names (the session, or the
    /// request's own input for its `input-` record).
    pub records: &'a [(String, String)],
}

/// Let go of the claim a refused request made (see [`claim_next`]) on going on in its
/// session, and of the records it made naming the session (sent again after another branch
/// went on there, it found them and went on there too): only while the session is still where
/// the conversation left it, so a claim whose request was admitted after all is kept. Whether
/// it was let go.
pub fn let_go(
    conn: &mut SqliteConnection,
    principal: &str,
    refused: &Refused,
) -> Result<bool, StoreError> {
    let Refused {
        session,
        previous,
        key,
        left: (requests, answer),
        records,
    } = *refused;
    super::write_tx(conn, |conn| {
        if !left_at(conn, session, principal, requests, answer)? {
            return Ok(false);
        }
        // Each record only while it still names what this request wrote (an `input-` record is
        // replaced by the conversation's next keyed request).
        let forget = |conn: &mut SqliteConnection, record: &str, named: &str| {
            diesel::delete(
                chat_threads::table
                    .filter(chat_threads::principal_id.eq(principal))
                    .filter(chat_threads::thread_key.eq(record))
                    .filter(chat_threads::session_id.eq(named)),
            )
            .execute(conn)
        };
        let gone = forget(conn, &format!("next-{session}-{previous}"), key)? == 1;
        if gone {
            for (record, named) in records {
                forget(conn, record, named)?;
            }
        }
        Ok(gone)
    })
}

/// The record naming the input of the request whose conversation's key is `key`, when that
/// request named its input by an `Idempotency-Key`.
pub fn input_key(key: &str) -> String {
    format!("input-{key}")
}

/// Record that the request whose conversation's key is `key` named its input `input` (by its
/// `Idempotency-Key`), in the place of a session id. The latest stands: the same conversation
/// sent again under a new key (to ask again) is the input the next request goes on from.
pub fn record_input(
    conn: &mut SqliteConnection,
    principal: &str,
    key: &str,
    input: &str,
    now: f64,
) -> Result<(), StoreError> {
    diesel::replace_into(chat_threads::table)
        .values((
            chat_threads::principal_id.eq(principal),
            chat_threads::thread_key.eq(input_key(key)),
            chat_threads::session_id.eq(input),
            chat_threads::created_at.eq(now),
        ))
        .execute(conn)?;
    Ok(())
}

/// Is `session` where a conversation left it: its last admission is `principal`'s input named
/// by one of `requests` (or a later attempt of it, `request` + `-N`), completed with the final
/// answer `answer`?
pub fn left_at(
    conn: &mut SqliteConnection,
    session: &str,
    principal: &str,
    requests: &[String],
    answer: &str,
) -> Result<bool, StoreError> {
    let Some(ordinal) = super::sessions::find_ordinal(conn, session)? else {
        return Ok(false);
    };
    // The newest row's `seq` from the idempotency key alone, then that row (see `latest_of`).
    let Some(seq) = super::admissions::last_seq(ordinal).get_result::<Option<i64>>(conn)? else {
        return Ok(false);
    };
    let last: Option<(String, String, Option<String>, Option<String>)> = sa::table
        .find(seq)
        .select((
            sa::request_id,
            sa::principal_id,
            sa::outcome,
            sa::result_json,
        ))
        .first(conn)
        .optional()?;
    let Some((request_id, owner, outcome, result)) = last else {
        return Ok(false);
    };
    let same_input = requests.iter().any(|request| {
        request_id == *request
            || request_id
                .strip_prefix(request.as_str())
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    let final_response = result
        .as_deref()
        .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
        .and_then(|r| r["final_response"].as_str().map(str::to_string));
    Ok(same_input
        && owner == principal
        && outcome.as_deref() == Some("completed")
        && final_response.is_some_and(|f| f.trim() == answer.trim()))
}

/// Records pruned by one transaction, at most.
const PRUNE_BATCH: i64 = 4096;

/// Delete up to a batch of the records made before `before`; whether more may be left. A
/// conversation whose record is gone starts a new session with its history when it comes back.
pub fn prune(conn: &mut SqliteConnection, before: f64) -> Result<bool, StoreError> {
    super::write_tx(conn, |conn| {
        let old = chat_threads::table
            .filter(chat_threads::created_at.lt(before))
            .order(chat_threads::created_at.asc())
            .select((chat_threads::principal_id, chat_threads::thread_key))
            .limit(PRUNE_BATCH)
            .load::<(String, String)>(conn)?;
        for (principal, key) in &old {
            diesel::delete(
                chat_threads::table
                    .filter(chat_threads::principal_id.eq(principal))
                    .filter(chat_threads::thread_key.eq(key)),
            )
            .execute(conn)?;
        }
        Ok(old.len() as i64 == PRUNE_BATCH)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing;

    #[test]
    fn records_are_found_kept_first_and_pruned_by_age() {
        let (_dir, mut c) = testing::conn();
        let keys = |k: &[&str]| k.iter().map(|k| k.to_string()).collect::<Vec<_>>();
        assert_eq!(
            record(&mut c, "p", &keys(&["k1"]), "s1", 10.0).expect("record"),
            ["s1"]
        );
        assert_eq!(
            record(&mut c, "p", &keys(&["k1", "k2"]), "s2", 20.0).expect("record again"),
            ["s1", "s2"],
            "the first record of a key stands"
        );
        assert_eq!(find(&mut c, "p", "k1").expect("find"), Some("s1".into()));
        assert_eq!(
            find(&mut c, "q", "k1").expect("find"),
            None,
            "per principal"
        );
        assert!(!prune(&mut c, 15.0).expect("prune"));
        assert_eq!(find(&mut c, "p", "k1").expect("find"), None);
        assert_eq!(find(&mut c, "p", "k2").expect("find"), Some("s2".into()));
    }

    /// A store migrated with 000014 before its index was added to it gets the index from
    /// 000018, and the pruner's oldest-first read goes through it (it scanned and sorted the
    /// whole table).
    #[test]
    fn a_store_without_the_age_index_gets_it() {
        use diesel::connection::SimpleConnection;
        use diesel_migrations::MigrationHarness;
        let (_dir, mut c) = testing::conn_just_before("chat_threads_age");
        c.batch_execute("DROP INDEX chat_threads_age")
            .expect("drop");
        c.run_pending_migrations(crate::store::MIGRATIONS)
            .expect("migrate");
        let plan = testing::query_plan(
            &mut c,
            "SELECT principal_id, thread_key FROM chat_threads WHERE created_at < 5 \
             ORDER BY created_at LIMIT 10",
        );
        assert!(
            plan.iter().any(|d| d.contains("chat_threads_age")),
            "{plan:?}"
        );
        // A store that had it keeps it, the migration refusing nothing.
        let (_dir, mut c) = testing::conn();
        let plan = testing::query_plan(
            &mut c,
            "SELECT principal_id FROM chat_threads ORDER BY created_at LIMIT 1",
        );
        assert!(
            plan.iter().any(|d| d.contains("chat_threads_age")),
            "{plan:?}"
        );
    }

    /// A claim on going on from an input is let go of only by its holder, and only while the
    /// session is still where the conversation left off.
    #[test]
    fn a_claim_is_let_go_only_by_its_holder_while_the_session_waits() {
        use crate::store::admissions;
        let (_dir, mut c, e, row) = testing::started_turn();
        let generation = row.execution_generation.expect("generation");
        admissions::settle(
            &mut c,
            e,
            "s1",
            &row.admission_id,
            generation,
            "completed",
            r#"{"final_response": "A"}"#,
            &[],
            &[],
            (0, 0),
            3.0,
        )
        .expect("settle");
        let inputs = ["other".to_string(), "in".to_string()];
        let let_go_of =
            |c: &mut SqliteConnection, key: &str, answer: &str, records: &[(String, String)]| {
                let_go(
                    c,
                    "p",
                    &Refused {
                        session: "s1",
                        previous: "prev",
                        key,
                        left: (&inputs, answer),
                        records,
                    },
                )
                .expect("let go")
            };
        assert!(left_at(&mut c, "s1", "p", &inputs, "A").expect("left at"));
        assert_eq!(
            claim_next(&mut c, "p", "s1", "prev", "k1", 4.0).expect("claim"),
            (true, true)
        );
        assert_eq!(
            claim_next(&mut c, "p", "s1", "prev", "k1", 4.0).expect("claim"),
            (true, false),
            "the same request again holds it, but did not make it"
        );
        let made = record_made(
            &mut c,
            "p",
            &["k1".to_string(), "kept".to_string()],
            "s1",
            4.0,
        )
        .expect("record");
        assert_eq!(made, [("s1".to_string(), true), ("s1".to_string(), true)]);
        assert!(
            !claim_next(&mut c, "p", "s1", "prev", "k2", 4.0)
                .expect("claim")
                .0
        );
        let own = [("k1".to_string(), "s1".to_string())];
        assert!(!let_go_of(&mut c, "k2", "A", &own), "not the holder");
        assert!(
            !let_go_of(&mut c, "k1", "B", &own),
            "another answer: not where the conversation left off"
        );
        assert!(let_go_of(&mut c, "k1", "A", &own));
        assert_eq!(
            find(&mut c, "p", "k1").expect("find"),
            None,
            "the refused request's own record goes too"
        );
        assert_eq!(
            find(&mut c, "p", "kept").expect("find"),
            Some("s1".into()),
            "a record it did not name stays"
        );
        assert!(
            claim_next(&mut c, "p", "s1", "prev", "k2", 5.0)
                .expect("claim")
                .0
        );
        // Its input admitted after all: the session moved on, and the claim stands.
        admissions::admit(&mut c, e, "p", "s1", "k2-input", "next", 10, 6.0).expect("admit");
        assert!(!let_go_of(&mut c, "k2", "A", &[]));
        assert!(
            !claim_next(&mut c, "p", "s1", "prev", "k3", 7.0)
                .expect("claim")
                .0
        );
    }
}
