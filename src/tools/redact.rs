//! Secrets in a command's output are masked before the output goes anywhere (the model's
//! provider, the transcript, every client following the session): an agent that runs `env` or
//! `cat .env` should not hand the keys it finds to all of them.
//!
//! What is recognised: provider and platform keys by their shape (`sk-…`, `ghp_…`,
//! `github_pat_…`, `xox…-`, `AKIA…`, `AIza…`, `sk_live_…`, `glpat-…`, `npm_…`, `hf_…`, this
//! gateway's own `gk_…` keys and `gt_…` tokens), private key blocks, `Authorization: Bearer …`
//! and `Basic …` values, the password of a URL's credentials (`postgres://app:…@db`), and the
//! value of an assignment whose name says secret (`API_KEY=…`, `password: …`, `"token": "…"`). A masked value
//! keeps its first four characters, so a reader can still tell which key was there.

use std::borrow::Cow;
use std::sync::OnceLock;

use regex::{Captures, Regex};

/// What replaces the rest of a secret.
const MASK: &str = "…[redacted]";

struct Rules {
    /// Whole tokens recognised by their shape.
    tokens: Regex,
    /// Private key blocks.
    private_keys: Regex,
    /// `Authorization: Bearer <value>` (or `Basic`).
    bearer: Regex,
    /// `scheme://user:<password>@host`.
    url_password: Regex,
    /// `<secret-sounding name> = <value>` (also `:`, quoted names and values).
    assignment: Regex,
}

fn rules() -> Option<&'static Rules> {
    static RULES: OnceLock<Option<Rules>> = OnceLock::new();
    RULES
        .get_or_init(|| {
            Some(Rules {
                tokens: Regex::new(concat!(
                    r"\b(?:sk-[A-Za-z0-9_-]{20,}",
                    r"|gh[pousr]_[A-Za-z0-9]{30,}",
                    r"|github_pat_[A-Za-z0-9_]{30,}",
                    r"|xox[abposr]-[A-Za-z0-9-]{10,}",
                    r"|AKIA[0-9A-Z]{16}",
                    r"|AIza[0-9A-Za-z_-]{35}",
                    r"|g[kt]_[0-9a-f]{32,}",
                    // Stripe's live and test keys, GitLab's, npm's and Hugging Face's tokens.
                    r"|[rs]k_(?:live|test)_[A-Za-z0-9]{16,}",
                    r"|glpat-[A-Za-z0-9_-]{20,}",
                    r"|npm_[A-Za-z0-9]{36}",
                    r"|hf_[A-Za-z0-9]{30,}",
                    // A JSON Web Token: its header and claims are base64url JSON (`{"` is `eyJ`).
                    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})\b",
                ))
                .ok()?,
                // A whole block only (a lone header, in source code or grep output, is text).
                private_keys: Regex::new(
                    r"(?s)-----BEGIN [A-Z ]*PRIVATE KEY(?: BLOCK)?-----[A-Za-z0-9+/=:\s.,()-]*?-----END [A-Z ]*PRIVATE KEY(?: BLOCK)?-----",
                )
                .ok()?,
                bearer: Regex::new(r"(?i)(\b(?:bearer|basic)\s+)([A-Za-z0-9._~+/=-]{12,})").ok()?,
                // The password of a URL's credentials (`postgres://app:S3cr3t@db/app`).
                url_password: Regex::new(r"(?i)(\b[a-z][a-z0-9+.-]*://[^\s:/@]+:)([^\s@/]+)@")
                    .ok()?,
                // The value must look like a secret, not code: no calls, paths, generics or
                // member access (`let token = lexer.next_token()?`, `max_tokens: Option<u64>`,
                // `/etc/passwd:root:x:0:0`).
                assignment: Regex::new(concat!(
                    r#"(?i)(["']?\b[A-Z0-9_-]*(?:api[_-]?key|secret|token|passw(?:or)?d|credential|private[_-]?key)"#,
                    // A password's symbols too (`p@ss!w0rd#2024`), not code's (`.`, `(`, `<`).
                    // An `&` is one when a value character follows it: `&&` (or `&` then a
                    // space) ends the value, as a pipe, a closing bracket or a NUL (between
                    // `/proc/…/environ`'s entries) do. Else `KEY=abcdefgh&&rm -rf ~` was masked
                    // through the `rm`, hiding it from the approval prompt that showed it.
                    r#"[A-Z0-9_-]*["']?\s*[=:]\s*["']?)((?:[A-Za-z0-9+/_~=@!#$%^*-]|&[A-Za-z0-9+/_~=@!#$%^*-]){8,})"#,
                    r#"($|[\s"',;&|)\]}\x00])"#,
                ))
                .ok()?,
            })
        })
        .as_ref()
}

/// Did the secret filter's patterns compile? Without them every output is withheld: the daemon
/// refuses to start instead (a build of the regex crate without a feature a pattern needs once
/// withheld every command's output while the tests, built with more features, passed).
pub fn ready() -> bool {
    rules().is_some()
}

/// How a match is written once masked.
type Masking = fn(&Captures) -> String;

/// `value` with all but its first four characters masked.
fn mask(value: &str) -> String {
    let kept: String = value.chars().take(4).collect();
    format!("{kept}{MASK}")
}

/// `text` with every secret it shows masked (borrowed as it is when there is none).
pub fn redact(text: &str) -> Cow<'_, str> {
    let Some(r) = rules() else {
        // The patterns are fixed and covered by tests; should one not compile, say so loudly
        // rather than pass secrets on.
        return Cow::Owned("[output withheld: the secret filter is unavailable]".into());
    };
    let mut out = Cow::Borrowed(text);
    let private = r
        .private_keys
        .replace_all(&out, "-----BEGIN PRIVATE KEY-----…[redacted]")
        .into_owned();
    if private != out {
        out = Cow::Owned(private);
    }
    let steps: [(&Regex, Masking); 4] = [
        (&r.tokens, |c| mask(&c[0])),
        (&r.bearer, |c| format!("{}{}", &c[1], mask(&c[2]))),
        (&r.url_password, |c| format!("{}{}@", &c[1], mask(&c[2]))),
        (&r.assignment, |c| {
            format!("{}{}{}", &c[1], mask(&c[2]), &c[3])
        }),
    ];
    for (regex, replace) in steps {
        if regex.is_match(&out) {
            let replaced = regex.replace_all(&out, replace).into_owned();
            out = Cow::Owned(replaced);
        }
    }
    out
}

/// A tool call's arguments (JSON text) with the secrets of each of its strings masked, as
/// [`redact`] masks them in the decoded string: read in the JSON text itself, the escapes
/// (`\n`, `\"`) broke a private key's block and a quoted assignment, which were shown whole.
/// Text that is not JSON is masked as it is; arguments with nothing to mask are kept as sent.
pub fn redact_json_text(text: &str) -> Cow<'_, str> {
    fn strings(v: &mut serde_json::Value, changed: &mut bool) {
        match v {
            serde_json::Value::String(s) => {
                if let Cow::Owned(masked) = redact(s) {
                    *s = masked;
                    *changed = true;
                }
            }
            serde_json::Value::Array(items) => items.iter_mut().for_each(|v| strings(v, changed)),
            serde_json::Value::Object(map) => map.values_mut().for_each(|v| strings(v, changed)),
            _ => {}
        }
    }
    let Ok(mut value) = serde_json::from_str::<serde_json::Value>(text) else {
        return redact(text);
    };
    let mut changed = false;
    strings(&mut value, &mut changed);
    if changed {
        Cow::Owned(value.to_string())
    } else {
        Cow::Borrowed(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A secret in a tool call's JSON arguments is masked as it is in the decoded command:
    /// a private key's block across escaped line breaks, a quoted assignment.
    #[test]
    fn secrets_in_json_arguments_are_masked_as_in_the_command() {
        let key = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n-----END OPENSSH PRIVATE KEY-----";
        for command in [
            format!("cat > ~/.ssh/id_ed25519 <<'EOF'\n{key}\nEOF"),
            r#"export DB_PASSWORD="hunter2hunter2""#.to_string(),
            r#"curl -d '{"password":"hunter2hunter2"}' https://x"#.to_string(),
        ] {
            let args = serde_json::json!({"command": command}).to_string();
            let shown = redact_json_text(&args);
            assert!(!shown.contains("hunter2hunter2"), "{shown}");
            assert!(!shown.contains("b3BlbnNzaC1rZXkt"), "{shown}");
            let decoded: serde_json::Value = serde_json::from_str(&shown).expect("still JSON");
            assert_eq!(decoded["command"], redact(&command).as_ref(), "{shown}");
        }
        let plain = r#"{"command": "ls -la"}"#;
        assert!(matches!(redact_json_text(plain), Cow::Borrowed(t) if t == plain));
        assert_eq!(
            redact_json_text("not json sk-abcdefghijklmnopqrstuvwxyz"),
            "not json sk-a…[redacted]"
        );
    }

    #[test]
    fn secrets_are_masked_and_the_rest_is_left_alone() {
        let cases = [
            (
                "OPENAI_API_KEY=sk-proj-abcdefghijklmnopqrstuvwxyz0123",
                "OPENAI_API_KEY=sk-p…[redacted]",
            ),
            (
                "token ghp_0123456789abcdefghijklmnopqrstuvwxyzAB here",
                "token ghp_…[redacted] here",
            ),
            ("aws AKIAABCDEFGHIJKLMNOP done", "aws AKIA…[redacted] done"),
            (
                "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig",
                "Authorization: Bearer eyJh…[redacted]",
            ),
            ("DB_PASSWORD=hunter2hunter2", "DB_PASSWORD=hunt…[redacted]"),
            (
                r#"{"client_secret": "abcdefgh12345678"}"#,
                r#"{"client_secret": "abcd…[redacted]"}"#,
            ),
            (
                "key: gk_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "key: gk_0…[redacted]",
            ),
            (
                "a\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\n-----END OPENSSH PRIVATE KEY-----\nz",
                "a\n-----BEGIN PRIVATE KEY-----…[redacted]\nz",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(redact(input), want, "{input}");
        }
        // Shapes that came through whole: a password with symbols, a URL's password, Basic
        // credentials, and more providers' keys.
        for (input, want) in [
            ("DB_PASSWORD=p@ss!w0rd#2024", "DB_PASSWORD=p@ss…[redacted]"),
            (
                "DATABASE_URL=postgres://app:S3cr3tPass@db:5432/app",
                "DATABASE_URL=postgres://app:S3cr…[redacted]@db:5432/app",
            ),
            (
                "Authorization: Basic dXNlcjpwYXNzd29yZA==",
                "Authorization: Basic dXNl…[redacted]",
            ),
            (
                "STRIPE_KEY sk_live_51H8abcdefghijklmnop",
                "STRIPE_KEY sk_l…[redacted]",
            ),
            ("glpat-abcdefghij0123456789", "glpa…[redacted]"),
            ("hf_abcdefghijklmnopqrstuvwxyz012345", "hf_a…[redacted]"),
            // What follows a value is shown: a command after it, the next entry of a process's
            // environment (NUL-separated), a closing bracket.
            (
                "export API_KEY=abcdefgh&&rm -rf ~/x",
                "export API_KEY=abcd…[redacted]&&rm -rf ~/x",
            ),
            ("TOKEN=abcdefgh12|sh", "TOKEN=abcd…[redacted]|sh"),
            (
                "OPENAI_API_KEY=abcd1234efgh5678\0HOME=/root",
                "OPENAI_API_KEY=abcd…[redacted]\0HOME=/root",
            ),
            ("{token: abcdefgh1234}", "{token: abcd…[redacted]}"),
            ("DB_PASSWORD=p@ss&w0rd2024", "DB_PASSWORD=p@ss…[redacted]"),
            (
                r#"{"access_token":"eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"}"#,
                r#"{"access_token":"eyJh…[redacted]"}"#,
            ),
        ] {
            assert_eq!(redact(input), want, "{input}");
        }
        for plain in [
            "let token = lexer.next_token()?;",
            "    max_tokens: Option<u64>,",
            "/etc/passwd:root:x:0:0:root:/root:/bin/bash",
            "const H: &str = \"-----BEGIN PRIVATE KEY-----\";\nfn main() {}",
            "total 48\ndrwxr-xr-x 2 root root 4096 Dec  4 07:00 src",
            "PATH=/usr/bin:/bin",
            "tokens: 12",
            "sk-short",
            "the password is not shown here",
            "commit 0123456789abcdef0123456789abcdef01234567",
            "see https://example.com/docs and git@github.com:org/repo.git",
            "ssh://git@host:22/repo",
            "password = compute_password(&user)",
        ] {
            assert!(matches!(redact(plain), Cow::Borrowed(_)), "{plain}");
        }
    }
}
