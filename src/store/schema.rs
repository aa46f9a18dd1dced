// Diesel table definitions for the session authority (see migrations/*_authority).

diesel::table! {
    runtime_epoch (singleton) {
        singleton -> Integer,
        epoch -> BigInt,
        instance_id -> Text,
        started_at -> Double,
    }
}

diesel::table! {
    state_meta (key) {
        key -> Text,
        value -> Text,
    }
}

diesel::table! {
    sessions (id) {
        id -> Text,
        root_id -> Text,
        parent_session_id -> Nullable<Text>,
        tip_session_id -> Text,
        principal_id -> Text,
        request_id -> Text,
        request_digest -> Text,
        source -> Text,
        model -> Text,
        provider -> Text,
        base_url -> Nullable<Text>,
        cwd -> Text,
        toolsets_json -> Text,
        profile -> Text,
        title -> Nullable<Text>,
        system_prompt -> Nullable<Text>,
        runtime_generation -> BigInt,
        runtime_revision -> BigInt,
        compression_count -> Integer,
        prompt_tokens -> BigInt,
        completion_tokens -> BigInt,
        started_at -> Double,
        ended_at -> Nullable<Double>,
        end_reason -> Nullable<Text>,
        ordinal -> BigInt,
    }
}

diesel::table! {
    session_admissions (seq) {
        seq -> BigInt,
        admission_id -> Text,
        request_id -> Text,
        principal_id -> Text,
        target_session_id -> Text,
        session_ordinal -> BigInt,
        payload_json -> Text,
        payload_digest -> Text,
        intent -> Text,
        status -> Text,
        outcome -> Nullable<Text>,
        owner_epoch -> Nullable<BigInt>,
        execution_generation -> Nullable<BigInt>,
        result_json -> Nullable<Text>,
        created_at -> Double,
        updated_at -> Double,
    }
}

diesel::table! {
    messages (id) {
        id -> BigInt,
        session_id -> Text,
        session_ordinal -> BigInt,
        role -> Text,
        content -> Nullable<Text>,
        tool_call_id -> Nullable<Text>,
        tool_calls -> Nullable<Text>,
        tool_name -> Nullable<Text>,
        finish_reason -> Nullable<Text>,
        display_kind -> Nullable<Text>,
        admission_id -> Nullable<Text>,
        active -> Integer,
        compacted -> Integer,
        timestamp -> Double,
        reasoning -> Nullable<Text>,
    }
}

diesel::table! {
    prompts (prompt_id) {
        prompt_id -> Text,
        session_id -> Text,
        admission_id -> Text,
        execution_generation -> BigInt,
        kind -> Text,
        payload_json -> Text,
        opened_at -> Double,
        resolved_at -> Nullable<Double>,
        resolution -> Nullable<Text>,
        resolved_by -> Nullable<Text>,
        after_message_id -> Nullable<BigInt>,
    }
}

diesel::table! {
    approval_allowlist (pattern_key) {
        pattern_key -> Text,
        created_at -> Double,
        created_by -> Text,
    }
}

diesel::table! {
    session_approvals (session_id, pattern_key) {
        session_id -> Text,
        pattern_key -> Text,
        created_at -> Double,
    }
}

diesel::table! {
    principal_approvals (principal_id, pattern_key) {
        principal_id -> Text,
        pattern_key -> Text,
        created_at -> Double,
    }
}

diesel::table! {
    chat_threads (principal_id, thread_key) {
        principal_id -> Text,
        thread_key -> Text,
        session_id -> Text,
        created_at -> Double,
    }
}

diesel::allow_tables_to_appear_in_same_query!(
    chat_threads,
    runtime_epoch,
    state_meta,
    sessions,
    session_admissions,
    messages,
    prompts,
    approval_allowlist,
    principal_approvals,
    session_approvals,
);
