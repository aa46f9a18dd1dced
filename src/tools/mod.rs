//! Tools the model can call: `terminal` (a real child process, gated by dangerous-command
//! approval) and `clarify` (a question to the user). The prompt flow itself lives in the turn.

pub mod danger;
pub mod guard;
pub mod redact;
pub mod terminal;

use actix::prelude::*;
use serde_json::{json, Value};
use tokio::sync::watch;

pub use terminal::{CommandOutcome, CommandSpec, TerminalError};

/// Tool names this gateway knows.
pub const KNOWN_TOOLS: &[&str] = &["terminal", "clarify"];

/// The OpenAI function schema of `name`.
pub fn schema(name: &str) -> Option<Value> {
    match name {
        "terminal" => Some(json!({
            "type": "function",
            "function": {
                "name": "terminal",
                "description": "Run a shell command in the session's working directory and return its output and exit code.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "The command line to run."},
                        "timeout": {"type": "integer", "description": "Seconds before the command is killed (at most the gateway's limit, which is also the default)."},
                        "workdir": {"type": "string", "description": "Working directory, absolute or under the session's (defaults to the session's)."}
                    },
                    "required": ["command"]
                }
            }
        })),
        "clarify" => Some(json!({
            "type": "function",
            "function": {
                "name": "clarify",
                "description": "Ask the user one or more questions and wait for the answer.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "question": {"type": "string"},
                        "choices": {"type": "array", "items": {"type": "string"}},
                        "questions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "id": {"type": "string"},
                                    "question": {"type": "string"},
                                    "choices": {"type": "array", "items": {"type": "string"}}
                                },
                                "required": ["question"]
                            }
                        }
                    }
                }
            }
        })),
        _ => None,
    }
}

/// Runs terminal commands on its own arbiter so child processes never share a session's thread.
pub struct TerminalTool;

impl Actor for TerminalTool {
    type Context = Context<Self>;
}

impl TerminalTool {
    pub fn start_on_own_arbiter() -> Addr<TerminalTool> {
        let arbiter = Arbiter::new();
        TerminalTool::start_in_arbiter(&arbiter.handle(), |_| TerminalTool)
    }
}

/// Run one command; `cancel` true kills its process group.
pub struct RunCommand {
    pub spec: CommandSpec,
    pub cancel: watch::Receiver<bool>,
}

impl Message for RunCommand {
    type Result = Result<CommandOutcome, TerminalError>;
}

impl Handler<RunCommand> for TerminalTool {
    type Result = ResponseFuture<Result<CommandOutcome, TerminalError>>;

    fn handle(&mut self, m: RunCommand, _: &mut Context<Self>) -> Self::Result {
        Box::pin(terminal::run_command(m.spec, m.cancel))
    }
}
