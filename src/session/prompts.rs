//! Live prompts: an approval or clarify question held by the session supervisor for one attempt.

use serde_json::Value;
use tokio::sync::oneshot;

/// How a prompt was answered.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptAnswer {
    Choice(String),
    Text(String),
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
    pub responder: oneshot::Sender<PromptAnswer>,
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
