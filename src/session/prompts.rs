//! Live prompts: an approval or clarify question held by the session supervisor for one attempt.

use serde_json::value::RawValue;
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
    pub payload: Box<RawValue>,
    pub choices: Vec<String>,
}

/// A prompt waiting for a human, owned by the supervisor until answered or retired.
pub struct OpenPrompt {
    pub prompt_id: String,
    pub kind: PromptKind,
    pub generation: i64,
    pub admission_id: String,
    /// The wire form listed in `session.resume.prompts` and sent as `*.request`, as its JSON
    /// text: a `Value`'s maps cost every parked session some 2 KiB more.
    pub payload: Box<RawValue>,
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

/// The open prompts of a session's running attempt, by `prompt_id`. A turn asks one question at
/// a time, so a list as long as what it holds, not a map: a map's least table (four slots) cost
/// every parked session some 500 bytes more.
#[derive(Default)]
pub struct OpenPrompts(Vec<OpenPrompt>);

impl OpenPrompts {
    /// Open `p`, in place of an open prompt of the same id.
    pub fn insert(&mut self, p: OpenPrompt) {
        self.remove(&p.prompt_id);
        self.0.reserve_exact(1);
        self.0.push(p);
    }

    pub fn remove(&mut self, prompt_id: &str) -> Option<OpenPrompt> {
        let at = self.0.iter().position(|p| p.prompt_id == prompt_id)?;
        let p = self.0.swap_remove(at);
        if self.0.is_empty() {
            self.0 = Vec::new();
        }
        Some(p)
    }

    pub fn get(&self, prompt_id: &str) -> Option<&OpenPrompt> {
        self.0.iter().find(|p| p.prompt_id == prompt_id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &OpenPrompt> {
        self.0.iter()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The ids of the open prompts that `pick` picks.
    pub fn ids_where(&self, pick: impl Fn(&OpenPrompt) -> bool) -> Vec<String> {
        self.0
            .iter()
            .filter(|p| pick(p))
            .map(|p| p.prompt_id.clone())
            .collect()
    }

    /// Close every prompt (the supervisor restarted); how many there were.
    pub fn clear(&mut self) -> usize {
        std::mem::take(&mut self.0).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(id: &str, generation: i64) -> (OpenPrompt, oneshot::Receiver<Answer>) {
        let (responder, rx) = oneshot::channel();
        let payload =
            serde_json::value::to_raw_value(&serde_json::json!({"prompt_id": id})).expect("json");
        let p = OpenPrompt {
            prompt_id: id.into(),
            kind: PromptKind::Approval,
            generation,
            admission_id: "a".into(),
            payload,
            choices: vec!["once".into()],
            responder,
        };
        (p, rx)
    }

    #[test]
    fn open_prompts_are_kept_by_id_and_one_id_is_one_prompt() {
        let mut open = OpenPrompts::default();
        let (a, _ra) = prompt("a", 1);
        let (b, _rb) = prompt("b", 2);
        let (a_again, _ra2) = prompt("a", 3);
        open.insert(a);
        open.insert(b);
        open.insert(a_again);
        assert_eq!(open.iter().count(), 2);
        assert_eq!(open.get("a").map(|p| p.generation), Some(3));
        assert_eq!(open.ids_where(|p| p.generation > 2), vec!["a".to_string()]);
        assert!(open.remove("nope").is_none());
        assert_eq!(open.remove("b").map(|p| p.generation), Some(2));
        assert!(open.get("b").is_none());
        assert_eq!(
            open.remove("a").map(|p| p.payload.get().to_string()),
            Some(r#"{"prompt_id":"a"}"#.to_string())
        );
        assert!(open.is_empty());
        let (c, _rc) = prompt("c", 4);
        open.insert(c);
        assert_eq!(open.clear(), 1);
        assert!(open.is_empty());
    }
}
