//! Live prompts: an approval or clarify question held by the session supervisor for one attempt.

use serde_json::Value;
use tokio::sync::oneshot;

use crate::error::GatewayError;

/// How a prompt was answered.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptAnswer {
    Choice(String),
    Text(String),
}

impl PromptAnswer {
    /// How the answer is recorded in the prompt audit.
    pub fn resolution(&self) -> String {
        match self {
            PromptAnswer::Choice(c) => format!("choice:{c}"),
            PromptAnswer::Text(t) if t.is_empty() => "skipped".to_string(),
            PromptAnswer::Text(_) => "answered".to_string(),
        }
    }
}

/// A human's answer, handed by the supervisor to the attempt that asked. The attempt records it
/// (fenced by its generation and the epoch) before it acts on it, and says so on `taken`:
/// `Ok` once it will act on it, else why it will not (its interrupt, a lost fence, the store).
pub struct Answer {
    pub answer: PromptAnswer,
    /// The principal who answered.
    pub by: String,
    pub taken: oneshot::Sender<Result<(), GatewayError>>,
    /// The prompt as it was shown, handed back: an answer the store cannot record opens it
    /// again (the turn holds no copy of it while it waits).
    pub payload: Value,
    pub choices: Vec<String>,
}

/// A prompt waiting for a human, owned by the supervisor until answered or retired.
pub struct OpenPrompt {
    pub prompt_id: String,
    pub kind: PromptKind,
    pub generation: i64,
    pub admission_id: String,
    /// The wire form listed in `session.resume.prompts` and sent as `*.request`.
    pub payload: Value,
    pub choices: Vec<String>,
    pub responder: oneshot::Sender<Answer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    Approval,
    Clarify,
}

impl PromptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PromptKind::Approval => "approval",
            PromptKind::Clarify => "clarify",
        }
    }

    pub fn parse(s: &str) -> Option<PromptKind> {
        match s {
            "approval" => Some(PromptKind::Approval),
            "clarify" => Some(PromptKind::Clarify),
            _ => None,
        }
    }
}
