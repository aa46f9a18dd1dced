//! Room driver leases: one row per room, rewritten in place. A lease is live iff it is unreleased
//! and `expires_at > now` (strict). Every takeover bumps `lease_generation`, which fences the old
//! holder out of every later lease-checked commit, and so does an authority claim.

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;
use serde::Serialize;

use crate::clock::Clock;
use crate::store::rooms::{
    live_room, load_room, read_clock, validate_identifier, RoomStoreError, StoreResult,
};
use crate::store::rooms_schema::{room_leases, room_tasks};

/// The capability to drive one room: who holds it, for which authority, until when.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Lease {
    pub room_id: String,
    pub gateway_id: String,
    pub authority_epoch: i64,
    pub process_generation: String,
    pub lease_generation: i64,
    pub expires_at: f64,
    /// True when this acquisition took the room over from another holder (or a released or expired
    /// lease), so the new holder must recover the room.
    pub reclaimed: bool,
}

/// A lease row as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Queryable, Selectable)]
#[diesel(table_name = room_leases)]
#[diesel(check_for_backend(diesel::sqlite::Sqlite))]
pub struct LeaseRow {
    pub room_id: String,
    pub gateway_id: String,
    pub authority_epoch: i64,
    pub process_generation: String,
    pub lease_generation: i64,
    pub expires_at: f64,
    pub acquired_at: f64,
    pub updated_at: f64,
    pub released_at: Option<f64>,
}

impl LeaseRow {
    fn held_by(&self, lease: &Lease) -> bool {
        self.gateway_id == lease.gateway_id
            && self.authority_epoch == lease.authority_epoch
            && self.process_generation == lease.process_generation
            && self.lease_generation == lease.lease_generation
    }
}

/// Read a room's lease row, if any.
pub fn get_lease(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Option<LeaseRow>> {
    load_lease_row(conn, room_id)
}

/// Boot: end every live lease this gateway's earlier processes hold (expired as of `now`), and
/// say how many. The caller has just taken the session authority's epoch, which fences those
/// processes out of every member turn; their leases would only make this process wait out the
/// TTL before it may recover their rooms (a `running` task keeps a lease from being released,
/// so a crash, or a stop whose drain left a task running, leaves one behind). Ending a lease
/// bumps nothing: the next acquisition takes the room over (a new lease generation, which
/// fences the old holder out of every lease-checked commit) and recovers it.
pub fn end_earlier_process_leases(
    conn: &mut SqliteConnection,
    gateway_id: &str,
    process_generation: &str,
    clock: &dyn Clock,
) -> StoreResult<usize> {
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        Ok(diesel::update(
            room_leases::table
                .filter(room_leases::gateway_id.eq(gateway_id))
                .filter(room_leases::process_generation.ne(process_generation))
                .filter(room_leases::released_at.is_null())
                .filter(room_leases::expires_at.gt(now)),
        )
        .set((
            room_leases::expires_at.eq(now),
            room_leases::updated_at.eq(now),
        ))
        .execute(conn)?)
    })
}

/// Outcome of a release.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReleaseOutcome {
    pub idempotent: bool,
}

fn load_lease_row(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Option<LeaseRow>> {
    Ok(room_leases::table
        .find(room_id)
        .select(LeaseRow::as_select())
        .first(conn)
        .optional()?)
}

fn validate_ttl(ttl_seconds: f64) -> StoreResult<()> {
    if ttl_seconds.is_finite() && ttl_seconds > 0.0 {
        Ok(())
    } else {
        Err(RoomStoreError::Validation(
            "lease_ttl_seconds must be positive".into(),
        ))
    }
}

fn authority_changed() -> RoomStoreError {
    RoomStoreError::StaleLease("hosted room authority changed".into())
}

fn stale_or_expired() -> RoomStoreError {
    RoomStoreError::StaleLease("driver lease is stale or expired".into())
}

/// Check, inside the caller's transaction, that `lease` is active at `now`: the room exists and is
/// not disbanded, its authority is the lease's, and the row is this unreleased, unexpired lease.
pub(crate) fn check_active_lease(
    conn: &mut SqliteConnection,
    lease: &Lease,
    now: f64,
) -> StoreResult<LeaseRow> {
    let room = live_room(conn, &lease.room_id, false)?;
    if room.authority_gateway_id != lease.gateway_id
        || room.authority_epoch != lease.authority_epoch
    {
        return Err(authority_changed());
    }
    let row = load_lease_row(conn, &lease.room_id)?.ok_or_else(stale_or_expired)?;
    if !row.held_by(lease) || row.released_at.is_some() || row.expires_at <= now {
        return Err(stale_or_expired());
    }
    Ok(row)
}

/// Acquire (or extend) the room's driver lease for (`gateway_id`, `authority_epoch`,
/// `process_generation`).
pub fn acquire_lease(
    conn: &mut SqliteConnection,
    room_id: &str,
    gateway_id: &str,
    authority_epoch: i64,
    process_generation: &str,
    ttl_seconds: f64,
    clock: &dyn Clock,
) -> StoreResult<Lease> {
    let gateway_id = validate_identifier("gateway_id", gateway_id)?;
    let process_generation = validate_identifier("process_generation", process_generation)?;
    validate_ttl(ttl_seconds)?;
    if authority_epoch < 1 {
        return Err(RoomStoreError::Validation(
            "authority_epoch must be a positive integer".into(),
        ));
    }
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let room = live_room(conn, room_id, false)?;
        if room.authority_gateway_id != gateway_id || room.authority_epoch != authority_epoch {
            return Err(authority_changed());
        }
        let mut lease = Lease {
            room_id: room.room_id.clone(),
            gateway_id: gateway_id.clone(),
            authority_epoch,
            process_generation: process_generation.clone(),
            lease_generation: 1,
            expires_at: now + ttl_seconds,
            reclaimed: false,
        };
        let Some(row) = load_lease_row(conn, room_id)? else {
            diesel::insert_into(room_leases::table)
                .values((
                    room_leases::room_id.eq(&lease.room_id),
                    room_leases::gateway_id.eq(&lease.gateway_id),
                    room_leases::authority_epoch.eq(authority_epoch),
                    room_leases::process_generation.eq(&lease.process_generation),
                    room_leases::lease_generation.eq(1_i64),
                    room_leases::expires_at.eq(lease.expires_at),
                    room_leases::acquired_at.eq(now),
                    room_leases::updated_at.eq(now),
                ))
                .execute(conn)?;
            return Ok(lease);
        };
        let live = row.released_at.is_none() && row.expires_at > now;
        let same_authority = row.gateway_id == gateway_id && row.authority_epoch == authority_epoch;
        let fence = room_leases::table
            .find(room_id)
            .filter(room_leases::lease_generation.eq(row.lease_generation))
            .filter(room_leases::process_generation.eq(&row.process_generation));
        if live && same_authority && row.process_generation == process_generation {
            lease.lease_generation = row.lease_generation;
            lease.expires_at = row.expires_at.max(now + ttl_seconds);
            let updated = diesel::update(fence)
                .set((
                    room_leases::expires_at.eq(lease.expires_at),
                    room_leases::updated_at.eq(now),
                ))
                .execute(conn)?;
            if updated != 1 {
                return Err(stale_or_expired());
            }
            return Ok(lease);
        }
        if live && same_authority {
            return Err(RoomStoreError::LeaseHeld(
                "room driver lease is held by another generation".into(),
            ));
        }
        lease.lease_generation = row.lease_generation + 1;
        lease.reclaimed = true;
        let updated = diesel::update(fence)
            .set((
                room_leases::gateway_id.eq(&lease.gateway_id),
                room_leases::authority_epoch.eq(authority_epoch),
                room_leases::process_generation.eq(&lease.process_generation),
                room_leases::lease_generation.eq(lease.lease_generation),
                room_leases::expires_at.eq(lease.expires_at),
                room_leases::acquired_at.eq(now),
                room_leases::updated_at.eq(now),
                room_leases::released_at.eq(None::<f64>),
            ))
            .execute(conn)?;
        if updated != 1 {
            return Err(stale_or_expired());
        }
        Ok(lease)
    })
}

/// Extend an active lease: `expires_at = max(current, now + ttl)` (never shortens).
pub fn renew_lease(
    conn: &mut SqliteConnection,
    lease: &Lease,
    ttl_seconds: f64,
    clock: &dyn Clock,
) -> StoreResult<Lease> {
    validate_ttl(ttl_seconds)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let row = check_active_lease(conn, lease, now)?;
        let expires_at = row.expires_at.max(now + ttl_seconds);
        let updated = diesel::update(
            room_leases::table
                .find(&lease.room_id)
                .filter(room_leases::lease_generation.eq(lease.lease_generation))
                .filter(room_leases::process_generation.eq(&lease.process_generation))
                .filter(room_leases::released_at.is_null()),
        )
        .set((
            room_leases::expires_at.eq(expires_at),
            room_leases::updated_at.eq(now),
        ))
        .execute(conn)?;
        if updated != 1 {
            return Err(stale_or_expired());
        }
        Ok(Lease {
            expires_at,
            reclaimed: false,
            ..lease.clone()
        })
    })
}

/// Fail unless `lease` is active now.
pub fn require_active_lease(
    conn: &mut SqliteConnection,
    lease: &Lease,
    clock: &dyn Clock,
) -> StoreResult<()> {
    let now = read_clock(clock)?;
    check_active_lease(conn, lease, now).map(|_| ())
}

/// Release a lease. Refused while any task of the room is running.
pub fn release_lease(
    conn: &mut SqliteConnection,
    lease: &Lease,
    clock: &dyn Clock,
) -> StoreResult<ReleaseOutcome> {
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let room = load_room(conn, &lease.room_id)?
            .ok_or_else(|| RoomStoreError::RoomUnavailable("hosted room does not exist".into()))?;
        if room.authority_gateway_id != lease.gateway_id
            || room.authority_epoch != lease.authority_epoch
        {
            return Err(authority_changed());
        }
        let row = load_lease_row(conn, &lease.room_id)?
            .ok_or_else(|| RoomStoreError::StaleLease("driver lease is stale".into()))?;
        if !row.held_by(lease) {
            return Err(RoomStoreError::StaleLease("driver lease is stale".into()));
        }
        if row.released_at.is_some() {
            return Ok(ReleaseOutcome { idempotent: true });
        }
        // Renewed since this lease was read (the same generation, a later expiry): whoever
        // renewed it holds it now, and it is theirs to release.
        if row.expires_at != lease.expires_at {
            return Err(RoomStoreError::StaleLease(
                "driver lease was renewed after it was read".into(),
            ));
        }
        if row.expires_at <= now {
            return Err(RoomStoreError::StaleLease(
                "driver lease expired before release".into(),
            ));
        }
        let running: i64 = room_tasks::table
            .filter(room_tasks::room_id.eq(&lease.room_id))
            .filter(room_tasks::status.eq("running"))
            .count()
            .get_result(conn)?;
        if running > 0 {
            return Err(RoomStoreError::InvalidTransition(
                "cannot release a room lease while tasks are running".into(),
            ));
        }
        let updated = diesel::update(
            room_leases::table
                .find(&lease.room_id)
                .filter(room_leases::lease_generation.eq(lease.lease_generation))
                .filter(room_leases::process_generation.eq(&lease.process_generation))
                .filter(room_leases::released_at.is_null()),
        )
        .set((
            room_leases::expires_at.eq(now),
            room_leases::updated_at.eq(now),
            room_leases::released_at.eq(Some(now)),
        ))
        .execute(conn)?;
        if updated != 1 {
            return Err(RoomStoreError::StaleLease("driver lease is stale".into()));
        }
        Ok(ReleaseOutcome { idempotent: false })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::rooms::testing::TestDb;
    use crate::store::rooms::claim_authority;

    #[test]
    fn acquire_extends_for_the_same_process_and_refuses_another_live_one() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let lease = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 10.0, &clock).unwrap();
        assert_eq!(lease.lease_generation, 1);
        assert!(!lease.reclaimed);
        clock.set(105.0);
        let again = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 10.0, &clock).unwrap();
        assert_eq!(again.lease_generation, 1);
        assert_eq!(again.expires_at, 115.0);
        let err =
            acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-b", 10.0, &clock).unwrap_err();
        assert!(
            matches!(err, RoomStoreError::LeaseHeld(ref m) if m.contains("another generation"))
        );
    }

    #[test]
    fn reclaim_after_expiry_bumps_generation_and_fences_the_old_lease() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let old = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 1.0, &clock).unwrap();
        clock.set(101.0);
        // expiry is strict: expires_at == now is expired
        assert!(matches!(
            require_active_lease(&mut conn, &old, &clock),
            Err(RoomStoreError::StaleLease(_))
        ));
        let new = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-b", 10.0, &clock).unwrap();
        assert_eq!(new.lease_generation, 2);
        assert!(new.reclaimed);
        let err = renew_lease(&mut conn, &old, 10.0, &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::StaleLease(ref m) if m.contains("stale or expired")));
        require_active_lease(&mut conn, &new, &clock).unwrap();
    }

    #[test]
    fn renew_never_shortens() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let lease = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        let renewed = renew_lease(&mut conn, &lease, 5.0, &clock).unwrap();
        assert_eq!(renewed.expires_at, 130.0);
        clock.set(128.0);
        let renewed = renew_lease(&mut conn, &lease, 5.0, &clock).unwrap();
        assert_eq!(renewed.expires_at, 133.0);
    }

    #[test]
    fn authority_change_fences_the_old_lease() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let lease = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        claim_authority(&mut conn, "room-1", "gw-a", 1, "gw-b", "claim-1", &clock).unwrap();
        let err = renew_lease(&mut conn, &lease, 30.0, &clock).unwrap_err();
        assert!(
            matches!(err, RoomStoreError::StaleLease(ref m) if m.contains("authority changed"))
        );
        let err =
            acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap_err();
        assert!(
            matches!(err, RoomStoreError::StaleLease(ref m) if m.contains("authority changed"))
        );
        // the new authority takes the still-live lease over
        let taken = acquire_lease(&mut conn, "room-1", "gw-b", 2, "proc-b", 30.0, &clock).unwrap();
        assert_eq!(taken.lease_generation, 2);
        assert!(taken.reclaimed);
    }

    /// At boot, the leases this gateway's earlier processes hold end at once, and only those:
    /// the room they held is taken over (a new generation, the old lease fenced) without
    /// waiting out the TTL; another gateway's lease and a released one are left alone.
    #[test]
    fn a_boot_ends_the_leases_of_this_gateways_earlier_processes() {
        let db = TestDb::with_room("room-1", "gw-a");
        db.add_room("room-2", "ops", "gw-b");
        db.add_room("room-3", "ops", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let old = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        let other = acquire_lease(&mut conn, "room-2", "gw-b", 1, "proc-b", 30.0, &clock).unwrap();
        let released =
            acquire_lease(&mut conn, "room-3", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        release_lease(&mut conn, &released, &clock).unwrap();
        clock.set(101.0);
        let err =
            acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-new", 30.0, &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::LeaseHeld(_)), "{err:?}");

        assert_eq!(
            end_earlier_process_leases(&mut conn, "gw-a", "proc-new", &clock).unwrap(),
            1
        );
        let taken =
            acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-new", 30.0, &clock).unwrap();
        assert_eq!(taken.lease_generation, old.lease_generation + 1);
        assert!(taken.reclaimed);
        assert!(require_active_lease(&mut conn, &old, &clock).is_err());
        require_active_lease(&mut conn, &other, &clock).unwrap();
        assert!(get_lease(&mut conn, "room-3")
            .unwrap()
            .unwrap()
            .released_at
            .is_some());
        // The process's own leases are its own.
        assert_eq!(
            end_earlier_process_leases(&mut conn, "gw-a", "proc-new", &clock).unwrap(),
            0
        );
        require_active_lease(&mut conn, &taken, &clock).unwrap();
    }

    #[test]
    fn release_is_idempotent_and_then_reacquire_reclaims() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let lease = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        assert!(!release_lease(&mut conn, &lease, &clock).unwrap().idempotent);
        assert!(release_lease(&mut conn, &lease, &clock).unwrap().idempotent);
        assert!(require_active_lease(&mut conn, &lease, &clock).is_err());
        let again = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        assert_eq!(again.lease_generation, 2);
        assert!(again.reclaimed);
        assert!(matches!(
            release_lease(&mut conn, &lease, &clock),
            Err(RoomStoreError::StaleLease(ref m)) if m.contains("stale")
        ));
    }

    /// A lease renewed after it was read (same generation, later expiry) is not released by
    /// the reader: the renewer holds it (a room's idle pass and an operator's retry raced so).
    #[test]
    fn a_lease_renewed_since_it_was_read_is_not_released() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let read = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 30.0, &clock).unwrap();
        clock.set(110.0);
        let renewed = renew_lease(&mut conn, &read, 30.0, &clock).unwrap();
        assert_eq!(renewed.lease_generation, read.lease_generation);
        assert!(matches!(
            release_lease(&mut conn, &read, &clock),
            Err(RoomStoreError::StaleLease(ref m)) if m.contains("renewed")
        ));
        require_active_lease(&mut conn, &renewed, &clock).unwrap();
        assert!(
            !release_lease(&mut conn, &renewed, &clock)
                .unwrap()
                .idempotent
        );
    }

    #[test]
    fn release_of_an_expired_lease_is_stale() {
        let db = TestDb::with_room("room-1", "gw-a");
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let lease = acquire_lease(&mut conn, "room-1", "gw-a", 1, "proc-a", 1.0, &clock).unwrap();
        clock.set(102.0);
        assert!(matches!(
            release_lease(&mut conn, &lease, &clock),
            Err(RoomStoreError::StaleLease(ref m)) if m.contains("expired before release")
        ));
    }

    #[test]
    fn lease_on_a_missing_room_is_unavailable() {
        let db = TestDb::new();
        let mut conn = db.conn();
        let clock = ManualClock::new(100.0);
        let err = acquire_lease(&mut conn, "nope", "gw-a", 1, "proc-a", 1.0, &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::RoomUnavailable(_)));
        let err = acquire_lease(&mut conn, "nope", "gw-a", 1, "proc-a", 0.0, &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::Validation(_)));
    }
}
