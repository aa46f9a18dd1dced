//! Faults between the gateway and the model, through the chaos model server: each fault has a
//! defined outcome (retried within `model.max_retries`, then a failed turn whose error is in the
//! receipt and closes the transcript), other sessions keep working meanwhile, and the same
//! session serves a normal request right after.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::chaos::{dead_url, ChaosModel, Fault};
use crate::helpers::*;

const T: Duration = Duration::from_secs(30);

/// What a fault must lead to.
struct Expect {
    /// `completed` or `failed`.
    outcome: &'static str,
    /// A piece of the error in the receipt and the transcript (failed turns).
    error: &'static str,
    /// Requests the model saw for the input (`None`: not countable, e.g. connection refused).
    attempts: Option<usize>,
    /// The fault takes long enough that healthy sessions must finish while it is still running.
    slow: bool,
}

impl Expect {
    /// The turn completes after `attempts` requests, none of them slow.
    fn completed(attempts: usize) -> Expect {
        Expect {
            outcome: "completed",
            error: "",
            attempts: Some(attempts),
            slow: false,
        }
    }
}

/// `fault` on the first request, a good answer after.
fn first_then_ok(fault: Fault) -> impl Fn(usize) -> Fault + Send + Sync + 'static {
    move |n| {
        if n == 1 {
            fault.clone()
        } else {
            Fault::Ok("ACK_FAULT".into())
        }
    }
}

/// Run one fault on session `faulty` (input `FAULT`) beside a healthy session, then a normal
/// input on the faulty session.
async fn fault_case(
    name: &str,
    fault: impl Fn(usize) -> Fault + Send + Sync + 'static,
    extra: Value,
    faulty_base_url: Option<String>,
    expect: Expect,
) {
    fault_case_shown(name, fault, extra, faulty_base_url, expect, None).await
}

/// [`fault_case`]; with `shown`, the flag is set once the faulty turn's first delta has reached
/// the client (a fault that must come after it waits for that).
async fn fault_case_shown(
    name: &str,
    fault: impl Fn(usize) -> Fault + Send + Sync + 'static,
    extra: Value,
    faulty_base_url: Option<String>,
    expect: Expect,
    shown: Option<Arc<AtomicBool>>,
) {
    let chaos = ChaosModel::start(move |text, n| {
        if text == "FAULT" {
            fault(n)
        } else {
            Fault::Ok(format!("ACK_{text}"))
        }
    });
    let home = Home::new();
    // The idle timeout is every streamed request's, the healthy ones' too: 1.5 s leaves a
    // loaded machine room to answer them without a retry. The call's timeout is above three
    // idle tries and their back-off.
    let mut cfg = config(
        &chaos.url,
        json!({"model": {"max_retries": 2, "idle_timeout_seconds": 1.5, "timeout_seconds": 12,
                         "max_response_bytes": 65536}}),
    );
    merge(&mut cfg, extra);
    home.write_config(&cfg);
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let create = match &faulty_base_url {
        Some(u) => json!({"base_url": u}),
        None => json!({}),
    };
    let faulty = ws.create("faulty", &home.path, create).await["session_id"]
        .as_str()
        .expect("sid")
        .to_string();
    let healthy = ws.session("healthy", &home.path).await;
    let began = Instant::now();
    let r = ws.submit(&faulty, "FAULT", "FAULT").await;
    if let Some(shown) = &shown {
        ws.event(T, |e| {
            e["type"] == "message.delta" && e["session_id"] == faulty.as_str()
        })
        .await;
        shown.store(true, Ordering::SeqCst);
    }
    for i in 0..3 {
        let text = format!("H{i}");
        ws.submit(&healthy, &text, &text).await;
    }
    // Other sessions keep working while the fault plays out.
    wait_until(&format!("{name}: the healthy session"), T, || {
        ["H0", "H1", "H2"]
            .iter()
            .all(|t| home.admission(t).status == "terminal")
    })
    .await;
    for t in ["H0", "H1", "H2"] {
        assert_eq!(
            home.admission(t).outcome.as_deref(),
            Some("completed"),
            "{name}: healthy {t}"
        );
    }
    if expect.slow {
        assert_eq!(
            home.admission("FAULT").status,
            "started",
            "{name}: the healthy session finished while the fault was still running"
        );
    }
    wait_until(&format!("{name}: the faulty turn settles"), T, || {
        home.admission("FAULT").status == "terminal"
    })
    .await;
    let elapsed = began.elapsed();
    let row = home.admission("FAULT");
    assert_eq!(
        row.outcome.as_deref(),
        Some(expect.outcome),
        "{name}: {:?}",
        row.result_json
    );
    let receipt = ws
        .ok(
            "prompt.receipt",
            json!({"session_id": faulty, "admission_id": r["admission_id"]}),
        )
        .await;
    assert_eq!(receipt["status"], "terminal", "{name}");
    assert_eq!(receipt["outcome"], expect.outcome, "{name}");
    if expect.outcome == "failed" {
        let error = receipt["result"]["error"].as_str().unwrap_or("");
        assert!(
            error.contains(expect.error),
            "{name}: receipt error {error:?} lacks {:?}",
            expect.error
        );
        assert_eq!(receipt["result"]["failed"], true, "{name}");
        // A rate limit keeps a reason of its own; every other failure of the model is one.
        let reason = if expect.error.starts_with("rate limited") {
            "rate_limited"
        } else {
            "model_error"
        };
        assert_eq!(receipt["result"]["reason"], reason, "{name}");
        let transcript = home.transcript(&faulty);
        let last = transcript.last().expect("a transcript");
        assert_eq!(last.role, "assistant", "{name}: the turn is closed");
        let content = last.content.clone().unwrap_or_default();
        assert!(
            content.starts_with("[Turn failed:") && content.contains(expect.error),
            "{name}: closing message {content:?}"
        );
    } else {
        assert_eq!(receipt["result"]["final_response"], "ACK_FAULT", "{name}");
    }
    if let Some(n) = expect.attempts {
        assert_eq!(chaos.attempts("FAULT"), n, "{name}: model attempts");
    }
    // Retries back off (0.5 s, then 1 s): a fault retried twice takes at least 1.5 s.
    if expect.attempts.is_some_and(|n| n >= 3) {
        assert!(
            elapsed >= Duration::from_millis(1400),
            "{name}: retried without back-off ({elapsed:?})"
        );
    }
    // The same session serves a normal request right after.
    if faulty_base_url.is_none() {
        ws.submit(&faulty, "AFTER", "AFTER").await;
        wait_until(&format!("{name}: AFTER"), T, || {
            home.admission("AFTER").status == "terminal"
        })
        .await;
        let after = home.admission("AFTER");
        assert_eq!(after.outcome.as_deref(), Some("completed"), "{name}");
        assert_eq!(
            chaos.attempts("AFTER"),
            1,
            "{name}: the next input ran once"
        );
    } else {
        // A session frozen to a dead endpoint keeps failing cleanly; a new one works.
        let fresh = ws.session("fresh", &home.path).await;
        ws.submit(&fresh, "AFTER", "AFTER").await;
        wait_until(&format!("{name}: AFTER"), T, || {
            home.admission("AFTER").status == "terminal"
        })
        .await;
        assert_eq!(
            home.admission("AFTER").outcome.as_deref(),
            Some("completed"),
            "{name}"
        );
    }
    // The settlement commits before the supervisor drops its running attempt.
    ws.resume_when(&faulty, &format!("{name}: the session idle"), |v| {
        v["running"] == false
    })
    .await;
    assert!(
        !home.log().contains("panicked"),
        "{name}: a panic in the log"
    );
}

#[actix_rt::test]
async fn model_connection_refused_retries_then_fails_the_turn() {
    let (dead, _held) = dead_url();
    fault_case(
        "connection_refused",
        |_| Fault::Ok("unused".into()),
        json!({}),
        Some(dead),
        Expect {
            outcome: "failed",
            error: "transient: send:",
            attempts: None,
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_closing_without_a_response_is_retried_then_fails() {
    fault_case(
        "close_without_response",
        |_| Fault::CloseWithoutResponse,
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "transient:",
            attempts: Some(3),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_reset_before_any_event_is_retried_and_recovers() {
    fault_case(
        "reset_before_body",
        first_then_ok(Fault::ResetBeforeBody),
        json!({}),
        None,
        Expect::completed(2),
    )
    .await;
}

#[actix_rt::test]
async fn model_stream_closed_before_its_end_is_retried_and_recovers() {
    // The body ended cleanly (a close-delimited stream) with neither a finish_reason nor
    // `[DONE]`: cut off, not an empty answer (it was kept as one, and the turn completed blank).
    fault_case(
        "ends_early_before_any_event",
        first_then_ok(Fault::EndsEarly(None)),
        json!({}),
        None,
        Expect::completed(2),
    )
    .await;
}

#[actix_rt::test]
async fn model_stream_closed_after_a_delta_fails_without_a_retry() {
    // Half an answer is not an answer: it was stored as complete.
    fault_case(
        "ends_early_after_a_delta",
        |_| Fault::EndsEarly(Some("partial ".into())),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "transient: stream ended",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_reply_framed_by_the_close_over_http11_fails_with_why() {
    // Read as an empty body, it completed the turn blank; it is refused, once, and says why.
    fault_case(
        "close_delimited_http11",
        |_| Fault::CloseDelimited11("ACK_FAULT".into()),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "unreadable response: an HTTP/1.1 reply with neither Content-Length",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_reset_mid_stream_fails_without_a_retry() {
    // A delta already reached the client: retrying would show it twice, so the turn fails.
    let shown = Arc::new(AtomicBool::new(false));
    let gate = shown.clone();
    fault_case_shown(
        "reset_mid_stream",
        move |_| Fault::ResetMidStream(gate.clone()),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "transient: stream:",
            attempts: Some(1),
            slow: false,
        },
        Some(shown),
    )
    .await;
}

#[actix_rt::test]
async fn model_stall_past_the_idle_timeout_retries_then_fails() {
    fault_case(
        "stall",
        |_| Fault::Stall,
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "timed out: no event for",
            attempts: Some(3),
            slow: true,
        },
    )
    .await;
}

/// A server that takes a streamed request and never sends even its response head is given up
/// at the idle timeout and asked again, as a stream silent after its head is. Before, the call
/// waited out its whole timeout, never asked again.
#[actix_rt::test]
async fn a_stream_whose_head_never_comes_is_asked_again_at_the_idle_timeout() {
    fault_case(
        "no-head",
        first_then_ok(Fault::NoHead),
        json!({"model": {"idle_timeout_seconds": 1, "timeout_seconds": 30, "stream": true}}),
        None,
        Expect::completed(2),
    )
    .await;
}

/// A server that says when to come back (`Retry-After` on a 429) is asked again no sooner:
/// here after 2 s, where the back-off alone would have asked again after 0.5 s.
#[actix_rt::test]
async fn a_rate_limited_call_waits_as_long_as_the_server_says() {
    let times: Arc<std::sync::Mutex<Vec<Instant>>> = Arc::default();
    let seen = times.clone();
    let chaos = ChaosModel::start(move |text, n| {
        if text != "LIMITED" {
            return Fault::Ok(format!("ACK_{text}"));
        }
        seen.lock().expect("times").push(Instant::now());
        if n == 1 {
            Fault::RetryAfter(2)
        } else {
            Fault::Ok("ACK_LIMITED".into())
        }
    });
    limited_completes(&chaos, json!({"max_retries": 1})).await;
    let times = times.lock().expect("times").clone();
    assert_eq!(times.len(), 2, "one retry");
    let waited = times[1] - times[0];
    assert!(
        waited >= Duration::from_millis(1900),
        "asked again after {waited:?}"
    );
}

/// A refusal whose body never comes is classified by its status at the idle timeout and
/// retried after its `Retry-After`. Before, the body was waited for until the call's timeout,
/// and the call then failed without a retry.
#[actix_rt::test]
async fn a_refusal_whose_body_stalls_is_retried() {
    let chaos = ChaosModel::start(|text, n| {
        if text == "LIMITED" && n == 1 {
            Fault::StalledRefusal
        } else {
            Fault::Ok(format!("ACK_{text}"))
        }
    });
    limited_completes(
        &chaos,
        json!({"max_retries": 1, "timeout_seconds": 20, "idle_timeout_seconds": 1}),
    )
    .await;
    assert_eq!(chaos.attempts("LIMITED"), 2);
}

/// An error or malformed event after the answer's finish_reason is no part of the answer: the
/// turn completes with it, asked once. Before, it failed a whole answer the client had been
/// shown.
#[actix_rt::test]
async fn an_error_after_the_finish_reason_does_not_fail_the_answer() {
    let chaos = ChaosModel::start(|text, _| {
        if text == "LIMITED" {
            Fault::ErrorAfterFinish("ACK_LIMITED".into())
        } else {
            Fault::Ok(format!("ACK_{text}"))
        }
    });
    limited_completes(&chaos, json!({"max_retries": 2})).await;
    assert_eq!(chaos.attempts("LIMITED"), 1);
}

/// A 200 whose chunked body is empty is a malformed reply, asked again (and the body that
/// ended while it was looked at is not read again: awc's decoder panics on it).
#[actix_rt::test]
async fn an_empty_chunked_reply_is_asked_again() {
    let chaos = ChaosModel::start(|text, n| {
        if text == "LIMITED" && n == 1 {
            Fault::EmptyChunked
        } else {
            Fault::Ok(format!("ACK_{text}"))
        }
    });
    limited_completes(&chaos, json!({"max_retries": 2})).await;
    assert_eq!(chaos.attempts("LIMITED"), 2);
}

/// A plain reply under `max_response_bytes` is taken whatever part of it was looked at first:
/// the rest was read against the bound less that part, and awc compares the whole body's
/// `Content-Length` with its limit, so a reply of more than half the bound was refused.
#[actix_rt::test]
async fn a_plain_reply_near_its_bound_is_taken() {
    let model = FakeModel::start(|_| {
        Reply::Message(
            json!({"role": "assistant", "content": "z".repeat(2500)}),
            "stop",
        )
    });
    let (home, d) = Daemon::with_model(
        &model,
        json!({"model": {"stream": false, "max_response_bytes": 4096}}),
    );
    let mut ws = d.ws().await;
    let sid = ws.session("near", &home.path).await;
    ws.submit(&sid, "NEAR", "NEAR").await;
    wait_until("NEAR", T, || home.admission("NEAR").status == "terminal").await;
    let row = home.admission("NEAR");
    assert_eq!(row.outcome.as_deref(), Some("completed"), "{row:?}");
}

/// A stream labelled as another type is read as the stream it is, once, with a stream's
/// bounds: its answer (here a character an event, its framing past `max_response_bytes`) is
/// kept whole. Before, its events were taken for a malformed JSON reply, and the answer (a
/// whole generation) was asked for again on every retry, and the call failed.
#[actix_rt::test]
async fn a_stream_labelled_as_another_type_is_read_as_a_stream() {
    let answer = format!("ACK_LIMITED {}", "y".repeat(250));
    let sent = answer.clone();
    let chaos = ChaosModel::start(move |text, _| {
        if text == "LIMITED" {
            Fault::Mislabelled(sent.clone())
        } else {
            Fault::Ok(format!("ACK_{text}"))
        }
    });
    limited_completes(
        &chaos,
        json!({"max_retries": 2, "max_response_bytes": 4096}),
    )
    .await;
    assert_eq!(chaos.attempts("LIMITED"), 1);
}

/// A server's `Retry-After` that fits in what is left of the call's time is kept to, the
/// spread added to it only where it fits too: here 3 s of a 3.5 s call. Before, the spread
/// (up to half again) passed the deadline in most calls, and the call gave up the retry the
/// server had allowed.
#[actix_rt::test]
async fn a_servers_wait_that_fits_the_calls_time_is_kept_to() {
    let chaos = ChaosModel::start(|text, n| {
        if text == "LIMITED" && n == 1 {
            Fault::RetryAfter(3)
        } else {
            Fault::Ok(format!("ACK_{text}"))
        }
    });
    limited_completes(&chaos, json!({"max_retries": 1, "timeout_seconds": 3.5})).await;
    assert_eq!(chaos.attempts("LIMITED"), 2);
}

/// The input `LIMITED` sent to a daemon on `chaos` (with `model` as its `model` config)
/// completes.
async fn limited_completes(chaos: &ChaosModel, model: Value) {
    let home = Home::new();
    home.write_config(&config(&chaos.url, json!({ "model": model })));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("limited", &home.path).await;
    ws.submit(&sid, "LIMITED", "LIMITED").await;
    wait_until("LIMITED", T, || {
        home.admission("LIMITED").status == "terminal"
    })
    .await;
    let row = home.admission("LIMITED");
    assert_eq!(row.outcome.as_deref(), Some("completed"), "{row:?}");
}

/// A stream that falls silent after its finish_reason (no `[DONE]`) has answered: the turn
/// completes with it, without waiting out the idle timeout. Before, the turn failed at the idle
/// timeout (after retries) when the client had already seen the whole answer.
#[actix_rt::test]
async fn a_stream_silent_after_its_finish_reason_has_answered() {
    fault_case(
        "silent-after-finish",
        |_| Fault::SilentAfterFinish("ACK_FAULT".into()),
        json!({"model": {"idle_timeout_seconds": 20}}),
        None,
        Expect::completed(1),
    )
    .await;
}

/// A stream that sends only comments (a server whose upstream is stuck says it is still
/// processing) is silent: at `model.idle_timeout_seconds` it is given up and asked again. Before,
/// each comment restarted the idle timer, and the call waited out its whole timeout.
#[actix_rt::test]
async fn a_stream_of_comments_only_is_asked_again_at_the_idle_timeout() {
    fault_case(
        "comments-only",
        first_then_ok(Fault::Comments(Duration::from_millis(100))),
        json!({"model": {"idle_timeout_seconds": 1, "timeout_seconds": 30}}),
        None,
        Expect::completed(2),
    )
    .await;
}

/// A stream that breaks on every try (a proxy that cuts event streams) is asked plainly on its
/// last try, and the turn completes. Before, every try streamed and the turn failed.
#[actix_rt::test]
async fn a_stream_that_breaks_on_every_try_is_asked_plainly_at_the_last() {
    streams_failing_every_try_are_asked_plainly_at_the_last(
        Fault::ResetBeforeBody,
        &["one", "two"],
    )
    .await;
}

/// A stream cut cleanly halfway through an event on every try is cut off (not a malformed
/// answer): tried again, and asked plainly at the last try. Before, each try failed as
/// malformed, the last streamed too, and the turn failed.
#[actix_rt::test]
async fn a_stream_cut_inside_an_event_on_every_try_is_asked_plainly_at_the_last() {
    streams_failing_every_try_are_asked_plainly_at_the_last(Fault::EndsInsideEvent, &["cut"]).await;
}

/// Each of `texts`, whose streams all fail with `fault` (a plain request is answered), completes
/// on its third try, asked plainly.
async fn streams_failing_every_try_are_asked_plainly_at_the_last(fault: Fault, texts: &[&str]) {
    let chaos = ChaosModel::inspecting(move |body, _| {
        if body["stream"] == true {
            fault.clone()
        } else {
            Fault::Ok(format!("ACK_{}", last_user(body)))
        }
    });
    let home = Home::new();
    home.write_config(&config(
        &chaos.url,
        json!({"model": {"max_retries": 2, "stream": true}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    let sid = ws.session("cut-streams", &home.path).await;
    for &text in texts {
        ws.submit(&sid, text, text).await;
        wait_until(text, T, || home.admission(text).status == "terminal").await;
        assert_eq!(
            home.admission(text).outcome.as_deref(),
            Some("completed"),
            "{text}: {:?}",
            home.admission(text).result_json
        );
        // Two streams, then the plain one: each call streams first again.
        assert_eq!(chaos.attempts(text), 3, "{text}");
    }
}

/// A stream whose body is cut short after its finish_reason (half a usage chunk, no `[DONE]`,
/// no end of the chunked body) has answered as well. Before, the broken body failed the turn
/// (not asked again, as the client had been shown the answer).
#[actix_rt::test]
async fn a_stream_cut_after_its_finish_reason_has_answered() {
    fault_case(
        "cut-after-finish",
        |_| Fault::CutAfterFinish("ACK_FAULT".into()),
        json!({}),
        None,
        Expect::completed(1),
    )
    .await;
}

/// `model.timeout_seconds` bounds the whole call, retries included: a model that sends nothing
/// (or drips) past it fails the turn after one attempt. Before, every attempt had the whole
/// timeout and a timed-out attempt was retried, so a silent model held the session four times
/// as long.
#[actix_rt::test]
async fn model_past_the_request_timeout_fails_without_a_retry() {
    for (name, fault) in [
        ("silent", Fault::Stall),
        ("drip", Fault::Drip(Duration::from_millis(200))),
    ] {
        fault_case(
            name,
            move |_| fault.clone(),
            // Long enough for the healthy session's three turns to end first (`slow`) on a
            // loaded machine.
            json!({"model": {"timeout_seconds": 3, "idle_timeout_seconds": 30}}),
            None,
            Expect {
                outcome: "failed",
                error: "no complete response within",
                attempts: Some(1),
                slow: true,
            },
        )
        .await;
    }
}

/// Every request slot of an endpoint taken by a call that hangs: another session's call waits
/// for one (the bound is the endpoint's), and the operator can see it: a warning, and
/// `gatehouse_model_slot_waits_total`.
#[actix_rt::test]
async fn a_call_waiting_for_a_model_slot_is_logged_and_counted() {
    let model = FakeModel::start(|body| {
        if last_user(body) == "HANG" {
            Reply::Hang
        } else {
            Reply::Message(json!({"role": "assistant", "content": "ok"}), "stop")
        }
    });
    let (home, d) = Daemon::with_model(&model, json!({"model": {"max_concurrent_requests": 1}}));
    let mut ws = d.ws().await;
    let hung = ws.session("hung", &home.path).await;
    let other = ws.session("other", &home.path).await;
    ws.submit(&hung, "HANG", "HANG").await;
    wait_until("HANG reaches the model", T, || model.reached("HANG") == 1).await;
    assert_eq!(
        metric(&d.origin(), "gatehouse_model_slot_waits_total").await,
        0.0
    );
    ws.submit(&other, "hello", "hello").await;
    wait_until("the wait is logged", T, || {
        home.log()
            .contains("every request slot of the model endpoint is taken")
    })
    .await;
    assert_eq!(
        metric(&d.origin(), "gatehouse_model_slot_waits_total").await,
        1.0
    );
    assert_eq!(model.reached("hello"), 0, "it waits for the slot");
    model.release();
    wait_until("both settle", T, || {
        ["HANG", "hello"]
            .iter()
            .all(|t| home.admission(t).status == "terminal")
    })
    .await;
}

/// The wait for a request slot is part of the call's time: a call behind one that hangs fails
/// at its own timeout, not after the other's timeout and then its own whole.
#[actix_rt::test]
async fn the_wait_for_a_model_slot_counts_against_the_calls_timeout() {
    let model = FakeModel::start(|_| Reply::Hang);
    let (home, d) = Daemon::with_model(
        &model,
        json!({"model": {"max_concurrent_requests": 1, "timeout_seconds": 3, "max_retries": 0}}),
    );
    let mut ws = d.ws().await;
    let first = ws.session("first", &home.path).await;
    let second = ws.session("second", &home.path).await;
    ws.submit(&first, "HANG1", "HANG1").await;
    wait_until("HANG1 reaches the model", T, || model.reached("HANG1") == 1).await;
    let asked = Instant::now();
    ws.submit(&second, "HANG2", "HANG2").await;
    wait_until("HANG2 settles", T, || {
        home.admission("HANG2").status == "terminal"
    })
    .await;
    // Its own 3 s and the settling; waiting out the first call's timeout, then its own whole,
    // it took nearly 6 s.
    let took = asked.elapsed();
    assert!(
        took < Duration::from_millis(5500),
        "the second call took {took:?} with a timeout of 3 s"
    );
    let row = home.admission("HANG2");
    assert_eq!(row.outcome.as_deref(), Some("failed"), "{row:?}");
    model.release();
}

/// A refusal whose body is long (a proxy that echoes the request) is read for its head: it
/// was read as empty, its reason lost (and a context overflow taken for another refusal).
#[actix_rt::test]
async fn a_long_refusal_is_read_for_its_head() {
    fault_case(
        "long_refusal",
        |_| {
            Fault::Status(
                400,
                format!(
                    r#"{{"error":{{"message":"unknown model fake-model-x","echo":"{}"}}}}"#,
                    "x".repeat(70 * 1024)
                ),
            )
        },
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "unknown model fake-model-x",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_5xx_burst_within_the_retries_recovers() {
    fault_case(
        "5xx_burst",
        |n| {
            if n <= 2 {
                Fault::Status(503, r#"{"error":{"message":"overloaded"}}"#.into())
            } else {
                Fault::Ok("ACK_FAULT".into())
            }
        },
        json!({}),
        None,
        Expect::completed(3),
    )
    .await;
}

#[actix_rt::test]
async fn model_5xx_past_the_retries_fails_the_turn() {
    fault_case(
        "5xx_persistent",
        |_| Fault::Status(502, r#"{"error":{"message":"bad gateway"}}"#.into()),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "transient: HTTP 502",
            attempts: Some(3),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_429_is_retried_then_fails_the_turn() {
    fault_case(
        "429",
        |_| Fault::Status(429, r#"{"error":{"message":"slow down"}}"#.into()),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "rate limited:",
            attempts: Some(3),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_malformed_sse_is_retried_then_fails_the_turn() {
    fault_case(
        "malformed_sse",
        |_| Fault::Malformed,
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "invalid response: SSE chunk",
            attempts: Some(3),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_stream_over_the_size_limit_fails_without_a_retry() {
    fault_case(
        "stream_too_large",
        |_| Fault::Huge(300_000),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "response larger than 65536 bytes",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

/// `model.max_response_bytes` bounds the answer a stream carries, not its events' framing:
/// 1,000 one-character reasoning deltas in events of about 300 bytes (300 KB on the wire) are
/// an answer of about 1,000 bytes, within a bound of 64 KiB. They were refused as a response
/// larger than it.
#[actix_rt::test]
async fn a_stream_is_bounded_by_its_answer_not_its_framing() {
    fault_case(
        "chatty",
        |_| Fault::Chatty(1000),
        json!({}),
        None,
        Expect::completed(1),
    )
    .await;
}

#[actix_rt::test]
async fn model_json_body_over_the_size_limit_fails_without_a_retry() {
    fault_case(
        "json_too_large",
        |_| Fault::HugeJson(300_000),
        json!({"model": {"stream": false}}),
        None,
        Expect {
            outcome: "failed",
            error: "response larger than 65536 bytes",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

#[actix_rt::test]
async fn model_auth_failure_is_not_retried() {
    fault_case(
        "401",
        |_| Fault::Status(401, r#"{"error":{"message":"bad key"}}"#.into()),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "authentication failed",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

/// An error the model reports inside a stream is classed as an HTTP error would be: a bad key
/// is not asked again (it was, as "transient", three times here), a failing server is.
#[actix_rt::test]
async fn model_errors_in_the_stream_are_retried_only_when_the_server_failed() {
    fault_case(
        "sse_invalid_key",
        |_| {
            Fault::SseError(json!({"message": "Incorrect API key provided",
                                   "type": "invalid_request_error", "code": "invalid_api_key"}))
        },
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "authentication failed",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
    fault_case(
        "sse_server_error",
        |_| Fault::SseError(json!({"message": "The server had an error", "type": "server_error"})),
        json!({}),
        None,
        Expect {
            outcome: "failed",
            error: "server_error",
            attempts: Some(3),
            slow: false,
        },
    )
    .await;
}

/// A plain reply that is an error (HTTP 200 with `error`) is classed by what it says too: it
/// was taken for an unreadable answer and asked three times.
#[actix_rt::test]
async fn a_plain_reply_that_is_an_error_is_classed_by_what_it_says() {
    fault_case(
        "json_model_not_found",
        |_| {
            Fault::Status(
                200,
                r#"{"error":{"message":"The model `x` does not exist","code":"model_not_found"}}"#
                    .into(),
            )
        },
        json!({"model": {"stream": false}}),
        None,
        Expect {
            outcome: "failed",
            error: "does not exist",
            attempts: Some(1),
            slow: false,
        },
    )
    .await;
}

// ---------- storage faults ----------

/// Limit the size of files the daemon may write (its "disk"), or lift the limit.
fn set_file_size_limit(pid: u32, bytes: Option<u64>) {
    let lim = libc::rlimit {
        rlim_cur: bytes.unwrap_or(libc::RLIM_INFINITY),
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: prlimit on our own child with a valid rlimit value and no old-value pointer.
    let rc = unsafe { libc::prlimit(pid as i32, libc::RLIMIT_FSIZE, &lim, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
}

/// A model that holds `SLOW` until `go` is set, and answers everything else at once.
fn gated_model() -> (ChaosModel, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let go = std::sync::Arc::new(AtomicBool::new(false));
    let g = go.clone();
    let model = ChaosModel::start(move |text, _| {
        if text == "SLOW" {
            let deadline = Instant::now() + Duration::from_secs(60);
            while !g.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        Fault::Ok(format!("ACK_{text}"))
    });
    (model, go)
}

async fn expect_storage_unavailable(ws: &mut Ws, method: &str, params: Value, what: &str) {
    let v = ws.call(method, params).await;
    assert_eq!(v["error"]["code"], 5001, "{what}: {v}");
    assert_eq!(
        v["error"]["data"]["reason"], "storage_unavailable",
        "{what}: {v}"
    );
}

#[actix_rt::test]
async fn storage_disk_full_refuses_writes_then_recovers() {
    use std::os::unix::process::CommandExt;
    use std::sync::atomic::Ordering;
    let (model, go) = gated_model();
    let home = Home::new();
    home.write_config(&config(&model.url, json!({})));
    // A real write error instead of the default SIGXFSZ death when the limit is hit.
    let d = Daemon::start_with(&home, |cmd| {
        // SAFETY: only async-signal-safe work between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
    });
    let mut ws = d.ws().await;
    let sid = ws.session("disk", &home.path).await;
    ws.submit(&sid, "A", "A").await;
    wait_until("A", T, || home.admission("A").status == "terminal").await;
    // A turn in flight and one queued behind it when the disk fills up.
    ws.submit(&sid, "SLOW", "SLOW").await;
    wait_until("SLOW at the model", T, || model.attempts("SLOW") == 1).await;
    ws.submit(&sid, "QUEUED", "QUEUED").await;
    set_file_size_limit(d.child.id(), Some(4096));
    go.store(true, Ordering::SeqCst);
    let before = home.admissions().len();
    for (what, method, params) in [
        (
            "submit",
            "prompt.submit",
            json!({"session_id": sid, "input_id": "B", "text": "B"}),
        ),
        (
            "create",
            "session.create",
            json!({"request_id": "new", "cwd": home.path}),
        ),
    ] {
        expect_storage_unavailable(&mut ws, method, params, what).await;
        // Reads keep working during the fault.
        let snap = ws.ok("session.resume", json!({"session_id": sid})).await;
        assert_eq!(snap["session_id"], sid);
    }
    assert_eq!(home.admissions().len(), before, "nothing half-written");
    assert_eq!(
        model.attempts("QUEUED"),
        0,
        "nothing ran while the disk was full"
    );
    // The fault clears: the in-flight turn settles, the queued one runs, new writes work.
    set_file_size_limit(d.child.id(), None);
    wait_until("SLOW and QUEUED settle", T, || {
        ["SLOW", "QUEUED"]
            .iter()
            .all(|t| home.admission(t).status == "terminal")
    })
    .await;
    assert_eq!(
        home.admission("QUEUED").outcome.as_deref(),
        Some("completed")
    );
    assert_eq!(model.attempts("QUEUED"), 1);
    ws.submit(&sid, "B", "B").await;
    wait_until("B", T, || home.admission("B").status == "terminal").await;
    assert_eq!(home.admission("B").outcome.as_deref(), Some("completed"));
    assert_eq!((model.attempts("SLOW"), model.attempts("B")), (1, 1));
    let users: Vec<String> = home
        .transcript(&sid)
        .into_iter()
        .filter(|m| m.role == "user")
        .filter_map(|m| m.content)
        .collect();
    assert_eq!(users, ["A", "SLOW", "QUEUED", "B"]);
    ws.create("new", &home.path, json!({})).await;
}

/// A daemon whose session `name` has run its first input, `A`: where the storage faults start.
struct Stored {
    model: ChaosModel,
    home: Home,
    daemon: Daemon,
    ws: Ws,
    sid: String,
}

async fn stored(name: &str) -> Stored {
    stored_with(name, json!({})).await
}

/// [`stored`] with `extra` config.
async fn stored_with(name: &str, extra: Value) -> Stored {
    let (model, go) = gated_model();
    go.store(true, std::sync::atomic::Ordering::SeqCst);
    let home = Home::new();
    home.write_config(&config(&model.url, extra));
    let daemon = Daemon::start(&home);
    let mut ws = daemon.ws().await;
    let sid = ws.session(name, &home.path).await;
    ws.submit(&sid, "A", "A").await;
    wait_until("A", T, || home.admission("A").status == "terminal").await;
    Stored {
        model,
        home,
        daemon,
        ws,
        sid,
    }
}

impl Stored {
    /// While the fault lasts a submit is refused (`storage_unavailable`) and writes nothing, and
    /// a read still works; once `clear` ends it, the same input is admitted and runs once.
    async fn refused_then_recovered(&mut self, what: &str, clear: impl FnOnce()) {
        let (sid, home) = (self.sid.clone(), &self.home);
        let before = home.admissions().len();
        expect_storage_unavailable(
            &mut self.ws,
            "prompt.submit",
            json!({"session_id": sid, "input_id": "B", "text": "B"}),
            what,
        )
        .await;
        let snap = self
            .ws
            .ok("session.resume", json!({"session_id": sid}))
            .await;
        assert_eq!(snap["session_id"], sid, "{what}: reads work");
        assert_eq!(
            home.admissions().len(),
            before,
            "{what}: nothing half-written"
        );
        clear();
        self.ws.submit(&sid, "B", "B").await;
        wait_until("B", T, || home.admission("B").status == "terminal").await;
        assert_eq!(home.admission("B").outcome.as_deref(), Some("completed"));
        assert_eq!(self.model.attempts("B"), 1);
    }
}

#[actix_rt::test]
async fn storage_locked_database_refuses_writes_then_recovers() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, SqliteConnection};
    let mut s = stored("locked").await;
    // Another process holds the write lock.
    let mut holder =
        SqliteConnection::establish(&s.home.path.join("state.db").to_string_lossy()).expect("open");
    holder.batch_execute("BEGIN IMMEDIATE").expect("write lock");
    s.refused_then_recovered("submit under a lock", || {
        holder.batch_execute("ROLLBACK").expect("release")
    })
    .await;
}

/// A commit that does not come (here: another process holds the write lock, and the writer
/// waits out its 5 s busy timeout) is answered `storage_unavailable` after
/// `session.admission_timeout_seconds`, not whenever the disk answers; the same input sent
/// again afterwards is admitted (or found) and runs once.
#[actix_rt::test]
async fn an_admission_that_does_not_commit_in_time_is_answered_unavailable() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, SqliteConnection};
    let mut s = stored_with(
        "stalled",
        // Short against the writer's 5 s busy timeout, long enough for every other submit here
        // (the last one waits behind the stalled write's end) on a loaded machine.
        json!({"session": {"admission_timeout_seconds": 2}}),
    )
    .await;
    let mut holder =
        SqliteConnection::establish(&s.home.path.join("state.db").to_string_lossy()).expect("open");
    holder.batch_execute("BEGIN IMMEDIATE").expect("write lock");
    let sid = s.sid.clone();
    expect_storage_unavailable(
        &mut s.ws,
        "prompt.submit",
        json!({"session_id": sid, "input_id": "B", "text": "B"}),
        "submit while the commit cannot come",
    )
    .await;
    assert!(
        s.home.log().contains("did not commit in time"),
        "answered by the bound, not by the writer's own failure"
    );
    holder.batch_execute("ROLLBACK").expect("release");
    s.ws.submit(&sid, "B", "B").await;
    wait_until("B", T, || s.home.admission("B").status == "terminal").await;
    assert_eq!(s.model.attempts("B"), 1);
}

/// Set or clear the immutable attribute (`chattr +i`): even root cannot write such a file, so it
/// stands for a read-only database. `false` when this file system or machine cannot do it.
fn set_immutable(path: &std::path::Path, on: bool) -> bool {
    std::process::Command::new("chattr")
        .arg(if on { "+i" } else { "-i" })
        .arg(path)
        .output()
        .is_ok_and(|o| o.status.success())
}

#[actix_rt::test]
async fn storage_read_only_database_refuses_writes_then_recovers() {
    let mut s = stored("read-only").await;
    let wal = s.home.path.join("state.db-wal");
    if !set_immutable(&wal, true) {
        eprintln!(
            "skipped: chattr +i is not available here, so no file can be made read-only for root"
        );
        return;
    }
    // Writable again however this test ends (an immutable file cannot be removed either).
    struct Writable<'a>(&'a std::path::Path);
    impl Drop for Writable<'_> {
        fn drop(&mut self) {
            set_immutable(self.0, false);
        }
    }
    let _writable = Writable(&wal);
    s.refused_then_recovered("submit to a read-only database", || {
        assert!(set_immutable(&wal, false), "chattr -i {}", wal.display())
    })
    .await;
}

/// The database file moved away under a running daemon: a commit made to the file it has open
/// is no longer in the file the next start reads, so it is not acknowledged (`storage_unavailable`),
/// nothing more is committed, `/readyz` says why, and the metrics show it.
#[actix_rt::test]
async fn storage_file_moved_away_under_the_daemon_acknowledges_nothing_more() {
    let mut s = stored("moved").await;
    let origin = s.daemon.origin();
    assert_eq!(metric(&origin, "gatehouse_storage_healthy").await, 1.0);
    let (db, away) = (
        s.home.path.join("state.db"),
        s.home.path.join("state.db.away"),
    );
    std::fs::rename(&db, &away).expect("move the database away");
    let sid = s.sid.clone();
    for input in ["B", "C"] {
        expect_storage_unavailable(
            &mut s.ws,
            "prompt.submit",
            json!({"session_id": sid, "input_id": input, "text": input}),
            &format!("submit {input} with the file moved away"),
        )
        .await;
    }
    let (status, body) = http_get(&format!("{origin}/readyz")).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("removed or replaced"), "{body}");
    // Said to anyone who asks: the file's name, not where the home is.
    assert!(
        body.contains("state.db") && !body.contains(&*s.home.path.to_string_lossy()),
        "{body}"
    );
    assert_eq!(metric(&origin, "gatehouse_storage_healthy").await, 0.0);
    assert!(metric(&origin, "gatehouse_db_commit_failures_total").await >= 2.0);
    // Back in place, the file is still not written: only a restart trusts it again. B's commit
    // reached the file before the check found it gone (unacknowledged: the same input sent
    // again finds it); C came after and was rolled back.
    std::fs::rename(&away, &db).expect("move the database back");
    expect_storage_unavailable(
        &mut s.ws,
        "prompt.submit",
        json!({"session_id": sid, "input_id": "D", "text": "D"}),
        "submit D with the file back",
    )
    .await;
    let inputs: Vec<String> = s
        .home
        .admissions()
        .into_iter()
        .map(|r| r.request_id)
        .collect();
    assert!(!inputs.iter().any(|i| i == "C" || i == "D"), "{inputs:?}");
}

/// A scrape that cannot read the ledger's counts says so (`gatehouse_metrics_read_ok` 0) rather
/// than show the admission families empty, which a dashboard read as "nothing queued".
#[actix_rt::test]
async fn metrics_that_cannot_read_the_ledger_say_so() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, SqliteConnection};
    let s = stored("unreadable").await;
    let origin = s.daemon.origin();
    assert_eq!(metric(&origin, "gatehouse_metrics_read_ok").await, 1.0);
    SqliteConnection::establish(&s.home.path.join("state.db").to_string_lossy())
        .expect("open")
        .batch_execute("ALTER TABLE session_admissions RENAME TO session_admissions_away")
        .expect("rename the ledger away");
    assert_eq!(metric(&origin, "gatehouse_metrics_read_ok").await, 0.0);
}

/// Another process took the home's authority (its epoch is newer): the daemon's writes are
/// refused in SQL, and it says so on `/readyz` instead of staying ready while it refuses all.
#[actix_rt::test]
async fn a_daemon_whose_authority_was_taken_is_not_ready() {
    let mut s = stored("deposed").await;
    let origin = s.daemon.origin();
    assert_eq!(http_get(&format!("{origin}/readyz")).await.0, 200);
    s.home.move_epoch_on();
    let sid = s.sid.clone();
    s.ws.refused(
        "prompt.submit",
        json!({"session_id": sid, "input_id": "B", "text": "B"}),
        "stale_epoch",
    )
    .await;
    let (status, body) = http_get(&format!("{origin}/readyz")).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("took this home's authority"), "{body}");
    assert_eq!(metric(&origin, "gatehouse_storage_healthy").await, 0.0);
}

/// An endpoint that refuses to stream is asked once more without streaming, and plainly from
/// then on (the turn completes; the next turn costs one request). One that refuses the
/// streaming options as fields it does not take is such an endpoint too: every streamed turn
/// failed there.
#[actix_rt::test]
async fn an_endpoint_that_refuses_to_stream_is_asked_plainly() {
    for (status, refusal) in [
        (
            400,
            json!({"error": {"message": "Streaming is not supported for this model", "type": "invalid_request_error"}}),
        ),
        (
            422,
            json!({"object": "error", "message": {"detail": [{"type": "extra_forbidden",
                "loc": ["body", "stream_options", "include_usage"], "msg": "Extra inputs are not permitted"}]}}),
        ),
    ] {
        let refused = refusal.clone();
        let model = FakeModel::start(move |body| {
            if body["stream"] == true {
                return Reply::Status(status, refused.clone());
            }
            Reply::Message(
                json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
                "stop",
            )
        });
        let (home, d) = Daemon::with_model(&model, json!({"model": {"stream": true}}));
        let mut ws = d.ws().await;
        let sid = ws.session("plain", &home.path).await;
        for text in ["one", "two"] {
            ws.submit(&sid, text, text).await;
            wait_until(text, T, || home.admission(text).status == "terminal").await;
            assert_eq!(
                home.admission(text).outcome.as_deref(),
                Some("completed"),
                "{text} after {refusal}"
            );
        }
        let streamed: Vec<(String, bool)> = model
            .requests()
            .iter()
            .map(|b| (last_user(b), b["stream"] == true))
            .collect();
        assert_eq!(
            streamed,
            [
                ("one".to_string(), true),
                ("one".to_string(), false),
                ("two".to_string(), false)
            ],
            "{refusal}"
        );
    }
}

/// An input claimed just as a graceful stop begins is put back `queued` (nothing of it ran) and
/// runs once after the restart, even when putting it back fails at first: the stop retries the
/// write. Before, a failed put-back settled the input `interrupted` without its ever running.
///
/// The claim is held in flight in the writer (a trigger makes it slow) while the stop begins,
/// and putting it back is refused until the test has seen the refusal logged.
#[actix_rt::test]
async fn a_claim_the_stop_cannot_put_back_at_first_is_queued_again_not_interrupted() {
    use diesel::connection::SimpleConnection;
    use diesel::{Connection, SqliteConnection};
    let mut s = stored("unclaim").await;
    let mut outside =
        SqliteConnection::establish(&s.home.path.join("state.db").to_string_lossy()).expect("open");
    // A claim takes about a second (a join of 4,000 × 4,000 rows); putting a claimed row back
    // is refused.
    outside
        .batch_execute(
            "PRAGMA busy_timeout = 10000;
             CREATE TABLE burn(x INTEGER);
             WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 4000)
                INSERT INTO burn SELECT x FROM n;
             CREATE TRIGGER slow_claim BEFORE UPDATE OF status ON session_admissions
                WHEN OLD.status = 'queued' AND NEW.status = 'started'
                BEGIN SELECT sum(a.x * b.x) FROM burn a, burn b; END;
             CREATE TRIGGER no_unclaim BEFORE UPDATE OF status ON session_admissions
                WHEN OLD.status = 'started' AND NEW.status = 'queued'
                BEGIN SELECT RAISE(ABORT, 'refused by the test'); END;",
        )
        .expect("triggers");
    let sid = s.sid.clone();
    // Not waiting for the reply: an idle session's claim commits with the admission, and the
    // stop must begin while that write is in the writer, which holds the write lock while it
    // lasts.
    s.ws.send_raw(
        json!({"jsonrpc": "2.0", "id": "x", "method": "prompt.submit",
               "params": {"session_id": sid, "input_id": "X", "text": "X"}})
        .to_string(),
    )
    .await;
    let busy = |c: &mut SqliteConnection| {
        let taken = c
            .batch_execute("PRAGMA busy_timeout = 0; BEGIN IMMEDIATE")
            .is_err();
        if !taken {
            c.batch_execute("ROLLBACK").expect("release");
        }
        taken
    };
    let mut probe =
        SqliteConnection::establish(&s.home.path.join("state.db").to_string_lossy()).expect("open");
    wait_until("the claim in the writer", T, || {
        busy(&mut probe) && {
            std::thread::sleep(Duration::from_millis(100));
            busy(&mut probe)
        }
    })
    .await;
    // SAFETY: sending a signal to our own child process.
    unsafe {
        libc::kill(s.daemon.child.id() as i32, libc::SIGTERM);
    }
    wait_until("the put-back refused", T, || {
        s.home
            .log()
            .contains("could not queue the claimed input again; retrying")
    })
    .await;
    outside
        .batch_execute("DROP TRIGGER no_unclaim")
        .expect("lift the refusal");
    let mut exited = None;
    wait_until("the stop", T, || {
        exited = s.daemon.child.try_wait().ok().flatten();
        exited.is_some()
    })
    .await;
    assert_eq!(exited.and_then(|e| e.code()), Some(0), "{}", s.home.log());
    let x = s.home.admission("X");
    assert_eq!(x.status, "queued", "{x:?}");
    assert_eq!(s.model.attempts("X"), 0);
    outside
        .batch_execute("DROP TRIGGER slow_claim")
        .expect("drop");
    let _restarted = Daemon::start(&s.home);
    wait_until("X", T, || s.home.admission("X").status == "terminal").await;
    assert_eq!(s.home.admission("X").outcome.as_deref(), Some("completed"));
    assert_eq!(s.model.attempts("X"), 1);
}

/// An endpoint that hangs with more than a hundred calls open does not hold the connections
/// another endpoint needs: awc's own bound (100 a scheme, all endpoints together) made every
/// other endpoint's call wait, uncounted, until the hung calls timed out.
#[actix_rt::test]
async fn a_hung_endpoint_does_not_take_the_connections_of_others() {
    const HUNG: usize = 104;
    let hung = FakeModel::start(|_| Reply::Hang);
    let healthy = FakeModel::start(|body| {
        Reply::Message(
            json!({"role": "assistant", "content": format!("ACK_{}", last_user(body))}),
            "stop",
        )
    });
    let home = Home::new();
    home.write_config(&config(
        &healthy.url,
        json!({"model": {"max_concurrent_requests": 256, "timeout_seconds": 120}}),
    ));
    let d = Daemon::start(&home);
    let mut ws = d.ws().await;
    for i in 0..HUNG {
        let sid = ws
            .create(
                &format!("hung-{i}"),
                &home.path,
                json!({"base_url": hung.url, "toolsets": []}),
            )
            .await["session_id"]
            .as_str()
            .expect("sid")
            .to_string();
        ws.submit(&sid, &format!("H{i}"), "HANG").await;
    }
    wait_until("every hung call reaches its endpoint", T, || {
        hung.requests().len() == HUNG
    })
    .await;
    let sid = ws.toolless("healthy", &home.path).await;
    ws.submit(&sid, "OK", "OK").await;
    wait_until("the healthy endpoint's turn", T, || {
        home.admission("OK").status == "terminal"
    })
    .await;
    assert_eq!(home.admission("OK").outcome.as_deref(), Some("completed"));
    hung.release();
}
