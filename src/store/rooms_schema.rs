//! Hand-written diesel table definitions for the hosted-room tables
//! (see `migrations/2026-11-29-000002_rooms/up.sql`).

diesel::table! {
    rooms (room_id) {
        room_id -> Text,
        name -> Text,
        authority_gateway_id -> Text,
        authority_epoch -> BigInt,
        next_seq -> BigInt,
        revision -> BigInt,
        created_at -> Double,
        updated_at -> Double,
        disband_requested_at -> Nullable<Double>,
        disbanded_at -> Nullable<Double>,
    }
}

diesel::table! {
    room_members (room_id, position) {
        room_id -> Text,
        position -> BigInt,
        handle -> Text,
        profile -> Text,
    }
}

diesel::table! {
    room_events (room_id, seq) {
        room_id -> Text,
        seq -> BigInt,
        event_id -> Text,
        kind -> Text,
        actor_json -> Text,
        authority_epoch -> Nullable<BigInt>,
        payload_json -> Text,
        created_at -> Double,
    }
}

diesel::table! {
    room_leases (room_id) {
        room_id -> Text,
        gateway_id -> Text,
        authority_epoch -> BigInt,
        process_generation -> Text,
        lease_generation -> BigInt,
        expires_at -> Double,
        acquired_at -> Double,
        updated_at -> Double,
        released_at -> Nullable<Double>,
    }
}

diesel::table! {
    room_tasks (room_id, task_id) {
        room_id -> Text,
        task_id -> Text,
        thread_id -> Text,
        turn_id -> Text,
        source_event_seq -> BigInt,
        payload_json -> Text,
        payload_digest -> Text,
        status -> Text,
        execution_generation -> BigInt,
        cancel_generation -> BigInt,
        run_gateway_id -> Nullable<Text>,
        run_process_generation -> Nullable<Text>,
        run_lease_generation -> Nullable<BigInt>,
        cancel_id -> Nullable<Text>,
        settlement_id -> Nullable<Text>,
        settlement_status -> Nullable<Text>,
        result_json -> Nullable<Text>,
        created_at -> Double,
        updated_at -> Double,
        started_at -> Nullable<Double>,
        terminal_at -> Nullable<Double>,
        indeterminate_at -> Nullable<Double>,
    }
}

diesel::table! {
    /// Kept by triggers on `room_tasks` (`migrations/2026-12-01-000005_room_task_counts`).
    room_task_counts (room_id, status) {
        room_id -> Text,
        status -> Text,
        n -> BigInt,
    }
}

diesel::table! {
    /// The last execution generation of each pruned task id, written by a trigger on
    /// `room_tasks` (`migrations/2026-12-05-000016_room_task_tombstones`).
    room_task_tombstones (room_id, task_id) {
        room_id -> Text,
        task_id -> Text,
        execution_generation -> BigInt,
    }
}

diesel::table! {
    /// The principal that created each room (`migrations/2026-12-04-000012_room_owners`).
    room_owners (room_id) {
        room_id -> Text,
        principal -> Text,
    }
}
