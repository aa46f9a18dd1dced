//! The authority epoch: one row, +1 per boot. Every ledger write checks it first, so a stale
//! process can never commit work it no longer owns.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;

use super::schema::{runtime_epoch, session_admissions, state_meta};
use crate::error::StoreError;

/// Take a new epoch (strictly greater than every earlier one) for `instance_id`.
pub fn begin_epoch(
    conn: &mut SqliteConnection,
    instance_id: &str,
    now: f64,
) -> Result<i64, StoreError> {
    begin_epoch_above(conn, instance_id, now, 0)
}

/// [`begin_epoch`], also greater than `floor`: the highest epoch taken on this home as recorded
/// outside the database, which a database restored from a backup would otherwise take again.
pub fn begin_epoch_above(
    conn: &mut SqliteConnection,
    instance_id: &str,
    now: f64,
    floor: i64,
) -> Result<i64, StoreError> {
    super::write_tx(conn, |conn| {
        let current: Option<i64> = runtime_epoch::table
            .select(runtime_epoch::epoch)
            .filter(runtime_epoch::singleton.eq(1))
            .first(conn)
            .optional()?;
        let next = current.unwrap_or(0).max(floor) + 1;
        diesel::replace_into(runtime_epoch::table)
            .values((
                runtime_epoch::singleton.eq(1),
                runtime_epoch::epoch.eq(next),
                runtime_epoch::instance_id.eq(instance_id),
                runtime_epoch::started_at.eq(now),
            ))
            .execute(conn)?;
        Ok(next)
    })
}

/// Fail with `StaleEpoch` unless `epoch` is the stored one. Call inside a write transaction.
pub fn check_epoch(conn: &mut SqliteConnection, epoch: i64) -> Result<(), StoreError> {
    let current: Option<i64> = runtime_epoch::table
        .select(runtime_epoch::epoch)
        .filter(runtime_epoch::singleton.eq(1))
        .first(conn)
        .optional()?;
    if current == Some(epoch) {
        Ok(())
    } else {
        Err(StoreError::StaleEpoch)
    }
}

/// Boot recovery: every `started` row of an older epoch becomes `unknown` (generation kept),
/// each reported by a `session.info {unknown}` event in the same transaction.
pub fn recover_started(
    conn: &mut SqliteConnection,
    epoch: i64,
    now: f64,
) -> Result<usize, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let lost: Vec<(String, String, Option<i64>)> = session_admissions::table
            .filter(super::admissions::is_live())
            .filter(session_admissions::status.eq("started"))
            .filter(session_admissions::owner_epoch.ne(epoch))
            .select((
                session_admissions::target_session_id,
                session_admissions::admission_id,
                session_admissions::execution_generation,
            ))
            .load(conn)?;
        for (session, admission, generation) in &lost {
            super::events::append(conn, session, &[unknown_event(admission, *generation)], now)?;
        }
        let n = diesel::update(
            session_admissions::table
                .filter(super::admissions::is_live())
                .filter(session_admissions::status.eq("started"))
                .filter(session_admissions::owner_epoch.ne(epoch)),
        )
        .set((
            session_admissions::status.eq("unknown"),
            session_admissions::updated_at.eq(now),
        ))
        .execute(conn)?;
        Ok(n)
    })
}

/// What tells a session's clients that `admission` is `unknown` now.
fn unknown_event(admission: &str, generation: Option<i64>) -> super::events::NewEvent {
    super::events::NewEvent::new(
        "session.info",
        serde_json::json!({"unknown": admission, "execution_generation": generation,
                           "running": false}),
    )
}

/// One `started` row of this epoch whose supervisor ended without settling it (a fault in one
/// of its handlers dropped the turn): `unknown`, as a crash leaves it, reported by the same
/// `session.info {unknown}` event. The operator resolves it without waiting for a restart, and
/// nothing runs it again. Fenced in the statement: the row `started` at this generation,
/// owned by this epoch. False if it was no longer that (its settlement committed).
pub fn abandon_started(
    conn: &mut SqliteConnection,
    epoch: i64,
    admission_id: &str,
    generation: i64,
    now: f64,
) -> Result<bool, StoreError> {
    super::write_tx(conn, |conn| {
        check_epoch(conn, epoch)?;
        let session: Option<String> = session_admissions::table
            .filter(session_admissions::admission_id.eq(admission_id))
            .select(session_admissions::target_session_id)
            .first(conn)
            .optional()?;
        let Some(session) = session else {
            return Ok(false);
        };
        let n = diesel::update(
            session_admissions::table
                .filter(session_admissions::admission_id.eq(admission_id))
                .filter(session_admissions::status.eq("started"))
                .filter(session_admissions::execution_generation.eq(generation))
                .filter(session_admissions::owner_epoch.eq(epoch)),
        )
        .set((
            session_admissions::status.eq("unknown"),
            session_admissions::updated_at.eq(now),
        ))
        .execute(conn)?;
        if n == 0 {
            return Ok(false);
        }
        let event = unknown_event(admission_id, Some(generation));
        super::events::append(conn, &session, &[event], now)?;
        Ok(true)
    })
}

/// A value from `state_meta`, created with `make` on first use.
pub fn meta_get_or_create(
    conn: &mut SqliteConnection,
    key: &str,
    make: impl FnOnce() -> String,
) -> Result<String, StoreError> {
    super::write_tx(conn, |conn| {
        if let Some(v) = meta_get(conn, key)? {
            return Ok(v);
        }
        let value = make();
        diesel::insert_into(state_meta::table)
            .values((state_meta::key.eq(key), state_meta::value.eq(&value)))
            .execute(conn)?;
        Ok(value)
    })
}

/// The value of `key` in `state_meta`, if it has one.
pub fn meta_get(conn: &mut SqliteConnection, key: &str) -> Result<Option<String>, StoreError> {
    Ok(state_meta::table
        .select(state_meta::value)
        .filter(state_meta::key.eq(key))
        .first(conn)
        .optional()?)
}

/// Set `key` to `value` in `state_meta` (inside the caller's transaction).
pub fn meta_set(conn: &mut SqliteConnection, key: &str, value: &str) -> Result<(), StoreError> {
    diesel::insert_into(state_meta::table)
        .values((state_meta::key.eq(key), state_meta::value.eq(value)))
        .on_conflict(state_meta::key)
        .do_update()
        .set(state_meta::value.eq(value))
        .execute(conn)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing;

    #[test]
    fn epochs_strictly_increase_and_fence() {
        let (_d, mut conn) = testing::conn();
        let a = begin_epoch(&mut conn, "a", 1.0).expect("epoch");
        let b = begin_epoch(&mut conn, "b", 2.0).expect("epoch");
        assert_eq!((a, b), (1, 2));
        assert!(matches!(
            check_epoch(&mut conn, a),
            Err(StoreError::StaleEpoch)
        ));
        assert!(check_epoch(&mut conn, b).is_ok());
        assert!(matches!(
            recover_started(&mut conn, a, 3.0),
            Err(StoreError::StaleEpoch)
        ));
    }
}
