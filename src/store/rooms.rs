//! Hosted rooms: the room aggregate (members, authority, disband) and its events, plus the value
//! rules and typed errors shared by the room state functions (`leases.rs`, `room_tasks.rs`).
//!
//! Every mutation is one transaction ([`crate::store::write_tx`]: `BEGIN IMMEDIATE`, or a savepoint
//! of the writer's group commit) whose fences are checked in SQL
//! (`UPDATE … WHERE <fence>` and then the number of rows affected).

use diesel::prelude::*;
use diesel::sqlite::SqliteConnection;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::clock::Clock;
use crate::store::rooms_schema::{room_events, room_members, room_owners, rooms};

/// Most rooms that may be active (not disbanded) at once.
pub const MAX_ACTIVE_ROOMS: i64 = 256;
/// Most members a room may have.
pub const MAX_MEMBERS: usize = 128;
/// Longest room name, in characters.
pub const MAX_ROOM_NAME_CHARS: usize = 200;

/// Typed errors of the room state layer. The message is the stable human text.
#[derive(Debug, thiserror::Error)]
pub enum RoomStoreError {
    /// An input broke a value rule (identifier, payload, generation…).
    #[error("{0}")]
    Validation(String),
    /// The room does not exist, is disbanded, or is being disbanded (for new work).
    #[error("{0}")]
    RoomUnavailable(String),
    /// Another live process holds the room's driver lease.
    #[error("{0}")]
    LeaseHeld(String),
    /// The caller's lease no longer matches (expired, replaced, or authority moved).
    #[error("{0}")]
    StaleLease(String),
    /// A different commit already owns this identity (or the replay differs).
    #[error("{0}")]
    Conflict(String),
    /// The task moved on (generation, status or fence no longer match).
    #[error("{0}")]
    StaleTask(String),
    /// A stored row failed its integrity check (its digest or its JSON): the store's fault, not
    /// the caller's (it was `Conflict`, which told a client its own request was wrong).
    #[error("{0}")]
    Corrupt(String),
    /// The requested transition is not allowed from the current state.
    #[error("{0}")]
    InvalidTransition(String),
    /// The room has as many tasks queued as it may.
    #[error("{0}")]
    Full(String),
    /// The database failed.
    #[error("database error: {0}")]
    Database(#[from] diesel::result::Error),
    /// No database connection could be obtained.
    #[error("database unavailable: {0}")]
    Pool(String),
}

impl RoomStoreError {
    /// Whether this error fences the caller out (a stale lease or a stale task).
    pub fn is_fence(&self) -> bool {
        matches!(self, Self::StaleLease(_) | Self::StaleTask(_))
    }

    /// Whether the store failed (a write that did not commit, no connection): nothing was
    /// decided, and the same write may succeed when tried again.
    pub fn is_storage(&self) -> bool {
        matches!(self, Self::Database(_) | Self::Pool(_))
    }
}

pub type StoreResult<T> = Result<T, RoomStoreError>;

/// Validate an identifier: trimmed, 1..=128 chars, `^[A-Za-z0-9][A-Za-z0-9._:-]*$`.
pub fn validate_identifier(label: &str, value: &str) -> StoreResult<String> {
    let trimmed = value.trim();
    let mut chars = trimmed.chars();
    let valid = match chars.next() {
        Some(first) => {
            first.is_ascii_alphanumeric()
                && trimmed.len() <= 128
                && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-'))
        }
        None => false,
    };
    if valid {
        Ok(trimmed.to_string())
    } else {
        Err(RoomStoreError::Validation(format!("invalid {label}")))
    }
}

/// Canonical JSON: object keys sorted, no whitespace.
pub fn canonical_json(value: &serde_json::Value) -> String {
    // serde_json's map is ordered by key (no `preserve_order`), so `to_string` is canonical.
    value.to_string()
}

/// Lowercase hex SHA-256.
pub fn sha256_hex(text: &str) -> String {
    super::admissions::hex(&Sha256::digest(text.as_bytes()))
}

/// Read a clock and reject non-finite values.
pub(crate) fn read_clock(clock: &dyn Clock) -> StoreResult<f64> {
    let now = clock.now();
    if now.is_finite() {
        Ok(now)
    } else {
        Err(RoomStoreError::Validation(
            "clock must return a finite number".into(),
        ))
    }
}

/// A room member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomMember {
    pub profile: String,
    pub handle: String,
}

/// A room as stored.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoomView {
    pub room_id: String,
    pub name: String,
    pub members: Vec<RoomMember>,
    pub authority_gateway_id: String,
    pub authority_epoch: i64,
    pub revision: i64,
    pub created_at: f64,
    pub updated_at: f64,
    pub disband_requested_at: Option<f64>,
    pub disbanded_at: Option<f64>,
    /// True only when the call replayed an identical earlier commit.
    pub idempotent: bool,
}

#[derive(Debug, Clone, Queryable, Selectable)]
#[diesel(table_name = rooms)]
#[diesel(check_for_backend(diesel::sqlite::Sqlite))]
pub(crate) struct RoomRow {
    pub room_id: String,
    pub name: String,
    pub authority_gateway_id: String,
    pub authority_epoch: i64,
    pub next_seq: i64,
    pub revision: i64,
    pub created_at: f64,
    pub updated_at: f64,
    pub disband_requested_at: Option<f64>,
    pub disbanded_at: Option<f64>,
}

/// A room event.
#[derive(Debug, Clone, PartialEq, Serialize, Queryable, Selectable)]
#[diesel(table_name = room_events)]
#[diesel(check_for_backend(diesel::sqlite::Sqlite))]
pub struct RoomEvent {
    pub room_id: String,
    pub seq: i64,
    pub event_id: String,
    pub kind: String,
    pub actor_json: String,
    pub authority_epoch: Option<i64>,
    pub payload_json: String,
    pub created_at: f64,
}

pub(crate) fn load_room(
    conn: &mut SqliteConnection,
    room_id: &str,
) -> StoreResult<Option<RoomRow>> {
    Ok(rooms::table
        .find(room_id)
        .select(RoomRow::as_select())
        .first(conn)
        .optional()?)
}

/// Load a room that must exist and not be disbanded. `new_work` also refuses a room whose
/// disband has been requested (the disband fence).
pub(crate) fn live_room(
    conn: &mut SqliteConnection,
    room_id: &str,
    new_work: bool,
) -> StoreResult<RoomRow> {
    let room = load_room(conn, room_id)?
        .ok_or_else(|| RoomStoreError::RoomUnavailable("hosted room does not exist".into()))?;
    if room.disbanded_at.is_some() {
        return Err(RoomStoreError::RoomUnavailable(
            "hosted room is disbanded".into(),
        ));
    }
    if new_work && room.disband_requested_at.is_some() {
        return Err(RoomStoreError::RoomUnavailable(
            "hosted room is being disbanded".into(),
        ));
    }
    Ok(room)
}

fn load_members(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Vec<RoomMember>> {
    let rows: Vec<(String, String)> = room_members::table
        .filter(room_members::room_id.eq(room_id))
        .order(room_members::position.asc())
        .select((room_members::profile, room_members::handle))
        .load(conn)?;
    Ok(rows
        .into_iter()
        .map(|(profile, handle)| RoomMember { profile, handle })
        .collect())
}

fn room_view(conn: &mut SqliteConnection, row: RoomRow, idempotent: bool) -> StoreResult<RoomView> {
    let members = load_members(conn, &row.room_id)?;
    Ok(RoomView {
        room_id: row.room_id,
        name: row.name,
        members,
        authority_gateway_id: row.authority_gateway_id,
        authority_epoch: row.authority_epoch,
        revision: row.revision,
        created_at: row.created_at,
        updated_at: row.updated_at,
        disband_requested_at: row.disband_requested_at,
        disbanded_at: row.disbanded_at,
        idempotent,
    })
}

fn normalize_members(members: &[RoomMember]) -> StoreResult<Vec<RoomMember>> {
    if members.is_empty() || members.len() > MAX_MEMBERS {
        return Err(RoomStoreError::Validation(format!(
            "a room needs 1..={MAX_MEMBERS} members"
        )));
    }
    let mut out: Vec<RoomMember> = Vec::with_capacity(members.len());
    for member in members {
        let member = RoomMember {
            profile: validate_identifier("member profile", &member.profile)?,
            handle: validate_identifier("member handle", &member.handle)?,
        };
        if out.iter().any(|m| m.handle == member.handle) {
            return Err(RoomStoreError::Validation(format!(
                "duplicate member handle {}",
                member.handle
            )));
        }
        out.push(member);
    }
    Ok(out)
}

/// Create a room with authority epoch 1. An identical re-create is idempotent; a different one is a
/// conflict; a disbanded id is never reused.
pub fn create_room(
    conn: &mut SqliteConnection,
    room_id: &str,
    name: &str,
    members: &[RoomMember],
    authority_gateway_id: &str,
    clock: &dyn Clock,
) -> StoreResult<RoomView> {
    let room_id = validate_identifier("room_id", room_id)?;
    let gateway = validate_identifier("authority_gateway_id", authority_gateway_id)?;
    let name = name.trim().to_string();
    if name.is_empty() || name.chars().count() > MAX_ROOM_NAME_CHARS {
        return Err(RoomStoreError::Validation("invalid room name".into()));
    }
    let members = normalize_members(members)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        if let Some(existing) = load_room(conn, &room_id)? {
            if existing.disbanded_at.is_some() {
                return Err(RoomStoreError::Conflict(
                    "hosted room id was retired and cannot be reused".into(),
                ));
            }
            // Not the room asked for either: answered as made, it was about to be retired.
            if existing.disband_requested_at.is_some() {
                return Err(RoomStoreError::Conflict(
                    "hosted room is being disbanded; its id cannot be reused".into(),
                ));
            }
            let existing_members = load_members(conn, &room_id)?;
            if existing.name == name
                && existing_members == members
                && existing.authority_gateway_id == gateway
            {
                return room_view(conn, existing, true);
            }
            return Err(RoomStoreError::Conflict(
                "hosted room already exists with different content".into(),
            ));
        }
        let active: i64 = rooms::table
            .filter(rooms::disbanded_at.is_null())
            .count()
            .get_result(conn)?;
        if active >= MAX_ACTIVE_ROOMS {
            // Full, as a room's queue is (`session_busy`): nothing wrong with the request.
            return Err(RoomStoreError::Full(format!(
                "at most {MAX_ACTIVE_ROOMS} hosted rooms may be active: disband one first"
            )));
        }
        diesel::insert_into(rooms::table)
            .values((
                rooms::room_id.eq(&room_id),
                rooms::name.eq(&name),
                rooms::authority_gateway_id.eq(&gateway),
                rooms::authority_epoch.eq(1_i64),
                rooms::next_seq.eq(1_i64),
                rooms::revision.eq(1_i64),
                rooms::created_at.eq(now),
                rooms::updated_at.eq(now),
            ))
            .execute(conn)?;
        for (position, member) in members.iter().enumerate() {
            diesel::insert_into(room_members::table)
                .values((
                    room_members::room_id.eq(&room_id),
                    room_members::position.eq(position as i64),
                    room_members::handle.eq(&member.handle),
                    room_members::profile.eq(&member.profile),
                ))
                .execute(conn)?;
        }
        let row = live_room(conn, &room_id, false)?;
        room_view(conn, row, false)
    })
}

/// [`create_room`] for `principal`, who owns a room it creates (in the same transaction). An
/// identical re-create changes nothing, its owner included. The room's owner is returned beside
/// it: the caller refuses a principal that does not own the room it named.
pub fn create_owned_room(
    conn: &mut SqliteConnection,
    principal: &str,
    room_id: &str,
    name: &str,
    members: &[RoomMember],
    authority_gateway_id: &str,
    clock: &dyn Clock,
) -> StoreResult<(RoomView, Option<String>)> {
    crate::store::write_tx(conn, |conn| {
        let view = create_room(conn, room_id, name, members, authority_gateway_id, clock)?;
        if !view.idempotent {
            diesel::insert_into(room_owners::table)
                .values((
                    room_owners::room_id.eq(&view.room_id),
                    room_owners::principal.eq(principal),
                ))
                .execute(conn)?;
        }
        let owner = room_owner(conn, &view.room_id)?;
        Ok((view, owner))
    })
}

/// The principal that created room `room_id` (none for a room created before owners were
/// recorded, or no such room).
pub fn room_owner(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Option<String>> {
    Ok(room_owners::table
        .find(room_id)
        .select(room_owners::principal)
        .first(conn)
        .optional()?)
}

/// Read a room (disbanded rooms included).
pub fn get_room(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Option<RoomView>> {
    match load_room(conn, room_id)? {
        Some(row) => Ok(Some(room_view(conn, row, false)?)),
        None => Ok(None),
    }
}

/// Rooms driven by `gateway_id` (not disbanded), ordered by id.
pub fn list_rooms_for_gateway(
    conn: &mut SqliteConnection,
    gateway_id: &str,
) -> StoreResult<Vec<RoomView>> {
    let rows: Vec<RoomRow> = rooms::table
        .filter(rooms::authority_gateway_id.eq(gateway_id))
        .filter(rooms::disbanded_at.is_null())
        .order(rooms::room_id.asc())
        .select(RoomRow::as_select())
        .load(conn)?;
    rows.into_iter()
        .map(|row| room_view(conn, row, false))
        .collect()
}

/// The `(room_id, authority_epoch, disbanding)` of every room `gateway_id` drives and has not
/// retired, in room order: what the room scheduler reads on every cycle. `disbanding` is whether
/// its disband fence is up. One statement: [`list_rooms_for_gateway`] builds each room's whole
/// view, with a query per room for its members.
pub fn list_bindings_for_gateway(
    conn: &mut SqliteConnection,
    gateway_id: &str,
) -> StoreResult<Vec<(String, i64, bool)>> {
    Ok(rooms::table
        .filter(rooms::authority_gateway_id.eq(gateway_id))
        .filter(rooms::disbanded_at.is_null())
        .order(rooms::room_id.asc())
        .select((
            rooms::room_id,
            rooms::authority_epoch,
            rooms::disband_requested_at.is_not_null(),
        ))
        .load(conn)?)
}

#[allow(clippy::too_many_arguments)]
fn insert_event(
    conn: &mut SqliteConnection,
    room: &RoomRow,
    event_id: &str,
    kind: &str,
    actor: &serde_json::Value,
    authority_epoch: Option<i64>,
    payload: &serde_json::Value,
    now: f64,
) -> StoreResult<RoomEvent> {
    let seq = room.next_seq;
    let event = RoomEvent {
        room_id: room.room_id.clone(),
        seq,
        event_id: event_id.to_string(),
        kind: kind.to_string(),
        actor_json: canonical_json(actor),
        authority_epoch,
        payload_json: canonical_json(payload),
        created_at: now,
    };
    diesel::insert_into(room_events::table)
        .values((
            room_events::room_id.eq(&event.room_id),
            room_events::seq.eq(seq),
            room_events::event_id.eq(&event.event_id),
            room_events::kind.eq(&event.kind),
            room_events::actor_json.eq(&event.actor_json),
            room_events::authority_epoch.eq(authority_epoch),
            room_events::payload_json.eq(&event.payload_json),
            room_events::created_at.eq(now),
        ))
        .execute(conn)?;
    let updated = diesel::update(
        rooms::table
            .find(&room.room_id)
            .filter(rooms::next_seq.eq(seq)),
    )
    .set(rooms::next_seq.eq(seq + 1))
    .execute(conn)?;
    if updated != 1 {
        return Err(RoomStoreError::Conflict(
            "room event sequence changed".into(),
        ));
    }
    Ok(event)
}

fn find_event(
    conn: &mut SqliteConnection,
    room_id: &str,
    event_id: &str,
) -> StoreResult<Option<RoomEvent>> {
    Ok(room_events::table
        .filter(room_events::room_id.eq(room_id))
        .filter(room_events::event_id.eq(event_id))
        .select(RoomEvent::as_select())
        .first(conn)
        .optional()?)
}

/// Append an event to a live room. Replaying the same event id with the same content is idempotent.
pub fn append_room_event(
    conn: &mut SqliteConnection,
    room_id: &str,
    event_id: &str,
    kind: &str,
    actor: &serde_json::Value,
    payload: &serde_json::Value,
    clock: &dyn Clock,
) -> StoreResult<RoomEvent> {
    let event_id = validate_identifier("event_id", event_id)?;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let room = live_room(conn, room_id, false)?;
        if let Some(existing) = find_event(conn, room_id, &event_id)? {
            if existing.kind == kind
                && existing.actor_json == canonical_json(actor)
                && existing.payload_json == canonical_json(payload)
            {
                return Ok(existing);
            }
            return Err(RoomStoreError::Conflict(
                "event id is already bound to a different event".into(),
            ));
        }
        insert_event(
            conn,
            &room,
            &event_id,
            kind,
            actor,
            Some(room.authority_epoch),
            payload,
            now,
        )
    })
}

/// Events of a room in sequence order.
pub fn list_room_events(conn: &mut SqliteConnection, room_id: &str) -> StoreResult<Vec<RoomEvent>> {
    Ok(room_events::table
        .filter(room_events::room_id.eq(room_id))
        .order(room_events::seq.asc())
        .select(RoomEvent::as_select())
        .load(conn)?)
}

/// Compare-and-swap the room's authority: only if it is still held by
/// (`expected_gateway_id`, `expected_epoch`). The epoch becomes `expected_epoch + 1`, which fences
/// every later lease-checked commit of the old holder. Appends an `authority.claimed` event.
pub fn claim_authority(
    conn: &mut SqliteConnection,
    room_id: &str,
    expected_gateway_id: &str,
    expected_epoch: i64,
    new_gateway_id: &str,
    event_id: &str,
    clock: &dyn Clock,
) -> StoreResult<RoomView> {
    let new_gateway = validate_identifier("new_gateway_id", new_gateway_id)?;
    let event_id = validate_identifier("event_id", event_id)?;
    if expected_epoch < 1 {
        return Err(RoomStoreError::Validation(
            "expected_epoch must be a positive integer".into(),
        ));
    }
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let room = live_room(conn, room_id, false)?;
        let payload = serde_json::json!({
            "previous_gateway_id": expected_gateway_id,
            "authority_gateway_id": new_gateway,
            "authority_epoch": expected_epoch + 1,
        });
        if let Some(existing) = find_event(conn, room_id, &event_id)? {
            if existing.kind == "authority.claimed"
                && existing.payload_json == canonical_json(&payload)
            {
                let view = room_view(conn, room, true)?;
                return Ok(view);
            }
            return Err(RoomStoreError::Conflict(
                "event id is already bound to a different event".into(),
            ));
        }
        let updated = diesel::update(
            rooms::table
                .find(room_id)
                .filter(rooms::authority_gateway_id.eq(expected_gateway_id))
                .filter(rooms::authority_epoch.eq(expected_epoch))
                .filter(rooms::disbanded_at.is_null()),
        )
        .set((
            rooms::authority_gateway_id.eq(&new_gateway),
            rooms::authority_epoch.eq(expected_epoch + 1),
            rooms::revision.eq(rooms::revision + 1),
            rooms::updated_at.eq(now),
        ))
        .execute(conn)?;
        if updated != 1 {
            return Err(RoomStoreError::Conflict(
                "hosted room authority changed".into(),
            ));
        }
        let room = live_room(conn, room_id, false)?;
        let actor = serde_json::json!({ "gateway_id": new_gateway });
        insert_event(
            conn,
            &room,
            &event_id,
            "authority.claimed",
            &actor,
            Some(expected_epoch + 1),
            &payload,
            now,
        )?;
        let room = live_room(conn, room_id, false)?;
        room_view(conn, room, false)
    })
}

/// Raise the disband fence: the room accepts no new work (admit, start, a deferred task's retry)
/// from now on, while reads, lease upkeep, settlement, cancellation and the put-back of an attempt
/// its member never admitted continue. Idempotent.
pub fn begin_disband(
    conn: &mut SqliteConnection,
    room_id: &str,
    clock: &dyn Clock,
) -> StoreResult<RoomView> {
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        // Retired since the caller looked (its own pass finished the disband): the disbanded
        // room's view, as a disband of it answers, not "no such room".
        if let Some(room) = load_room(conn, room_id)?.filter(|r| r.disbanded_at.is_some()) {
            return room_view(conn, room, true);
        }
        let room = live_room(conn, room_id, false)?;
        if room.disband_requested_at.is_some() {
            return room_view(conn, room, true);
        }
        diesel::update(
            rooms::table
                .find(room_id)
                .filter(rooms::disband_requested_at.is_null()),
        )
        .set((
            rooms::disband_requested_at.eq(now),
            rooms::revision.eq(rooms::revision + 1),
            rooms::updated_at.eq(now),
        ))
        .execute(conn)?;
        let room = live_room(conn, room_id, false)?;
        room_view(conn, room, false)
    })
}

/// Disband a room whose disband fence is up and all of whose tasks have ended (queued and
/// deferred ones are cancelled by the disband first: one whose cancel failed would be left
/// queued in a retired room, never to run nor end). The id is retired for good. Idempotent.
pub fn disband_room(
    conn: &mut SqliteConnection,
    room_id: &str,
    clock: &dyn Clock,
) -> StoreResult<RoomView> {
    use crate::store::rooms_schema::room_tasks;
    let now = read_clock(clock)?;
    crate::store::write_tx(conn, |conn| {
        let room = load_room(conn, room_id)?
            .ok_or_else(|| RoomStoreError::RoomUnavailable("hosted room does not exist".into()))?;
        if room.disbanded_at.is_some() {
            return room_view(conn, room, true);
        }
        if room.disband_requested_at.is_none() {
            return Err(RoomStoreError::InvalidTransition(
                "disband must be requested before it completes".into(),
            ));
        }
        let blocking: i64 = room_tasks::table
            .filter(room_tasks::room_id.eq(room_id))
            .filter(room_tasks::status.eq_any([
                "queued",
                "deferred",
                "running",
                "stopping",
                "indeterminate",
            ]))
            .count()
            .get_result(conn)?;
        if blocking > 0 {
            return Err(RoomStoreError::InvalidTransition(
                "cannot disband a room while tasks have not ended".into(),
            ));
        }
        diesel::update(
            rooms::table
                .find(room_id)
                .filter(rooms::disbanded_at.is_null()),
        )
        .set((
            rooms::disbanded_at.eq(now),
            rooms::revision.eq(rooms::revision + 1),
            rooms::updated_at.eq(now),
        ))
        .execute(conn)?;
        // A retired id admits nothing again: its pruned tasks' generations are no longer needed
        // (and its tasks pruned from now on leave none).
        diesel::delete(
            crate::store::rooms_schema::room_task_tombstones::table
                .filter(crate::store::rooms_schema::room_task_tombstones::room_id.eq(room_id)),
        )
        .execute(conn)?;
        let room = load_room(conn, room_id)?
            .ok_or_else(|| RoomStoreError::RoomUnavailable("hosted room does not exist".into()))?;
        room_view(conn, room, false)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::rooms::testing::TestDb;

    fn members() -> Vec<RoomMember> {
        vec![RoomMember {
            profile: "ops".into(),
            handle: "ops".into(),
        }]
    }

    #[test]
    fn identifiers_follow_the_rule() {
        assert!(validate_identifier("x", "deadline:1").is_ok());
        assert!(validate_identifier("x", "reply:task-1").is_ok());
        assert!(validate_identifier("x", " a.b_c ").is_ok());
        assert!(validate_identifier("x", "").is_err());
        assert!(validate_identifier("x", "-a").is_err());
        assert!(validate_identifier("x", "a b").is_err());
        assert!(validate_identifier("x", &"a".repeat(129)).is_err());
    }

    #[test]
    fn create_room_is_idempotent_and_conflicts_on_difference() {
        let db = TestDb::new();
        let mut conn = db.conn();
        let clock = ManualClock::new(10.0);
        let first =
            create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap();
        assert!(!first.idempotent);
        assert_eq!(first.authority_epoch, 1);
        let again =
            create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap();
        assert!(again.idempotent);
        let err =
            create_room(&mut conn, "room-1", "Other", &members(), "gw-a", &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::Conflict(_)));
    }

    #[test]
    fn claim_authority_is_a_compare_and_swap_with_an_event() {
        let db = TestDb::new();
        let mut conn = db.conn();
        let clock = ManualClock::new(10.0);
        create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap();
        let claimed =
            claim_authority(&mut conn, "room-1", "gw-a", 1, "gw-b", "claim-b", &clock).unwrap();
        assert_eq!(claimed.authority_gateway_id, "gw-b");
        assert_eq!(claimed.authority_epoch, 2);
        let replay =
            claim_authority(&mut conn, "room-1", "gw-a", 1, "gw-b", "claim-b", &clock).unwrap();
        assert!(replay.idempotent);
        let err =
            claim_authority(&mut conn, "room-1", "gw-a", 1, "gw-c", "claim-c", &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::Conflict(ref m) if m.contains("authority changed")));
        let events = list_room_events(&mut conn, "room-1").unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].kind, "authority.claimed");
        let payload: serde_json::Value = serde_json::from_str(&events[0].payload_json).unwrap();
        assert_eq!(payload["previous_gateway_id"], "gw-a");
        assert_eq!(payload["authority_epoch"], 2);
    }

    #[test]
    fn disband_fences_new_work_and_retires_the_id() {
        let db = TestDb::new();
        let mut conn = db.conn();
        let clock = ManualClock::new(10.0);
        create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap();
        assert!(disband_room(&mut conn, "room-1", &clock).is_err());
        begin_disband(&mut conn, "room-1", &clock).unwrap();
        // Made again as it was while it is being disbanded: refused, not answered as made.
        let err =
            create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::Conflict(ref m) if m.contains("being disbanded")));
        let err = live_room(&mut conn, "room-1", true).unwrap_err();
        assert!(
            matches!(err, RoomStoreError::RoomUnavailable(ref m) if m.contains("being disbanded"))
        );
        assert!(live_room(&mut conn, "room-1", false).is_ok());
        disband_room(&mut conn, "room-1", &clock).unwrap();
        let err = live_room(&mut conn, "room-1", false).unwrap_err();
        assert!(matches!(err, RoomStoreError::RoomUnavailable(ref m) if m.contains("disbanded")));
        // A disband asked again once the room is retired answers the retired room (a client
        // asking whether it is done got "no such room" when the retirement came between).
        let again = begin_disband(&mut conn, "room-1", &clock).expect("idempotent");
        assert!(again.disbanded_at.is_some());
        let err =
            create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::Conflict(_)));
        assert!(list_rooms_for_gateway(&mut conn, "gw-a")
            .unwrap()
            .is_empty());
    }

    /// The active rooms are bounded, and a disbanded room no longer counts among them.
    #[test]
    fn a_disband_frees_a_place_among_the_active_rooms() {
        let db = TestDb::new();
        let mut conn = db.conn();
        let clock = ManualClock::new(10.0);
        for i in 0..MAX_ACTIVE_ROOMS {
            create_room(&mut conn, &format!("r{i}"), "R", &members(), "gw-a", &clock).unwrap();
        }
        let err = create_room(&mut conn, "one-more", "R", &members(), "gw-a", &clock).unwrap_err();
        assert!(matches!(err, RoomStoreError::Full(ref m) if m.contains("at most")));
        assert_eq!(
            crate::api::rooms::store_error(err).reason(),
            "session_busy",
            "a capacity refusal, not a bad request"
        );
        begin_disband(&mut conn, "r7", &clock).unwrap();
        assert!(create_room(&mut conn, "one-more", "R", &members(), "gw-a", &clock).is_err());
        disband_room(&mut conn, "r7", &clock).unwrap();
        create_room(&mut conn, "one-more", "R", &members(), "gw-a", &clock).unwrap();
    }

    #[test]
    fn room_events_replay_idempotently() {
        let db = TestDb::new();
        let mut conn = db.conn();
        let clock = ManualClock::new(10.0);
        create_room(&mut conn, "room-1", "Release", &members(), "gw-a", &clock).unwrap();
        let actor = serde_json::json!({"handle": "ops"});
        let payload = serde_json::json!({"text": "hi"});
        let first = append_room_event(
            &mut conn, "room-1", "ev-1", "message", &actor, &payload, &clock,
        )
        .unwrap();
        let again = append_room_event(
            &mut conn, "room-1", "ev-1", "message", &actor, &payload, &clock,
        )
        .unwrap();
        assert_eq!(first, again);
        let other = serde_json::json!({"text": "other"});
        assert!(
            append_room_event(&mut conn, "room-1", "ev-1", "message", &actor, &other, &clock)
                .is_err()
        );
        let second = append_room_event(
            &mut conn, "room-1", "ev-2", "message", &actor, &other, &clock,
        )
        .unwrap();
        assert_eq!(second.seq, 2);
    }

    #[test]
    fn migration_down_reverts_up() {
        let db = TestDb::new();
        let mut conn = db.conn();
        use diesel::connection::SimpleConnection;
        conn.batch_execute(crate::rooms::testing::TOMBSTONES_DOWN_SQL)
            .unwrap();
        conn.batch_execute(crate::rooms::testing::OWNERS_DOWN_SQL)
            .unwrap();
        conn.batch_execute(crate::rooms::testing::COUNTS_DOWN_SQL)
            .unwrap();
        conn.batch_execute(crate::rooms::testing::DOWN_SQL).unwrap();
        conn.batch_execute(crate::rooms::testing::UP_SQL).unwrap();
        conn.batch_execute(crate::rooms::testing::DOWN_SQL).unwrap();
        let left: i64 = diesel::dsl::sql::<diesel::sql_types::BigInt>(
            "SELECT COUNT(*) FROM sqlite_master WHERE name LIKE 'room%'",
        )
        .get_result(&mut conn)
        .unwrap();
        assert_eq!(left, 0);
    }
}
