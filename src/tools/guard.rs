//! What a command line reaches of the gateway itself, read from its text: its own files (the
//! ledger, the keys, the config, the control socket) however their path is spelled, and its own
//! process. What these find is asked about like a dangerous command ([`super::danger`]'s
//! `GATEWAY_STATE` and `GATEWAY_PROCESS`). A speed bump, not a sandbox: a name built at run time
//! is not seen.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::config::lexically_normal;

/// The files of the gateway's home a command must not touch unasked: the ledger, the control
/// socket and lock, the keys, the config (the approval allowlist lives in the ledger).
const GATEWAY_FILES: &[&str] = &[
    "state.db",
    "gateway.sock",
    "gateway.lock",
    "api_keys",
    "config.yaml",
    "authority_epoch",
];

/// Does `command` name one of the gateway's files, by a path into the home or run from inside the
/// home outside its workspace, or name the home itself? A command runs as the daemon's user, so
/// without this a model could delete the ledger (`rm -f state.db`, no rule's business) or
/// approve itself (an INSERT into the allowlist) with no prompt.
pub fn touches_gateway_state(
    command: &str,
    cwd: &Path,
    home: &Path,
    user_home: Option<&str>,
) -> bool {
    let homes: Vec<PathBuf> = std::iter::once(home.to_path_buf())
        .chain(home.canonicalize().ok())
        .collect();
    let start = cwd.canonicalize().unwrap_or_else(|_| cwd.to_path_buf());
    let user_home = user_home.filter(|h| h.starts_with('/'));
    // The home may be named from the user's home: `~/.local/state/gatehouse`, `$HOME/…`, or be
    // that home (`cd ~`, `cd`, `cp -r $HOME x` under a service user whose home it is).
    let mut plain = unquoted(command);
    if let Some(h) = user_home {
        let h = h.trim_end_matches('/');
        // `cd` alone goes to the user's home.
        static BARE_CD: OnceLock<Option<regex::Regex>> = OnceLock::new();
        if let Some(bare) = BARE_CD
            .get_or_init(|| regex::Regex::new(r"(^|[;&|(\s])cd\s*($|[;&|)])").ok())
            .as_ref()
        {
            plain = bare
                .replace_all(&plain, |c: &regex::Captures| {
                    format!("{}cd {h} {}", &c[1], &c[2])
                })
                .into_owned();
        }
        plain = plain
            .replace("${HOME}", h)
            .replace("$HOME", h)
            .replace("~/", &format!("{h}/"));
        plain = plain
            .split(' ')
            .map(|w| if w == "~" { h } else { w })
            .collect::<Vec<_>>()
            .join(" ");
    }
    // Words in order, with the directory they are read in: `cd DIR` (`pushd`, a bare `cd` for
    // the user's home) and `-C DIR` (tar, make, git) move it for the words after them
    // (`cd ../.. && cat h/config.yaml`, `tar -C ../.. -cf - h` ran unasked).
    let mut cwd = start.clone();
    let all: Vec<&str> = words(&plain).collect();
    let mut named_by_path = false;
    let mut i = 0;
    while i < all.len() {
        let word = all[i];
        let moves = matches!(word, "cd" | "pushd" | "-C" | "--directory");
        if moves {
            let target = all.get(i + 1).copied().filter(|t| !t.starts_with('-'));
            match (target, user_home) {
                (Some(t), _) => cwd = lexically_normal(&cwd.join(t)),
                (None, Some(h)) if word == "cd" => cwd = PathBuf::from(h),
                _ => {}
            }
            if target.is_some() {
                i += 1;
            }
        }
        // A word of more readings than are taken apart is a doubt, and asked about.
        let Some(alternatives) = brace_alternatives(word) else {
            named_by_path = true;
            i += 1;
            continue;
        };
        for alternative in alternatives {
            let path = lexically_normal(&cwd.join(&alternative));
            named_by_path |= homes.iter().any(|h| {
                path == *h
                    || (path.parent() == Some(h.as_path())
                        && path
                            .file_name()
                            .is_some_and(|name| names_gateway_file(&name.to_string_lossy())))
            });
        }
        i += 1;
    }
    // A file named anywhere in a command that names the home (`cd ~/… && rm state.db`), or that
    // starts or ends in the home outside its workspace.
    let in_home = |dir: &Path| {
        homes
            .iter()
            .any(|h| dir.starts_with(h) && !dir.starts_with(h.join(crate::gateway::WORKSPACE)))
    };
    named_by_path
        || (names_gateway_file(&plain)
            && (in_home(&start)
                || in_home(&cwd)
                || homes
                    .iter()
                    .any(|h| plain.contains(h.to_string_lossy().as_ref()))))
}

/// The most readings of one word [`brace_alternatives`] makes.
const MAX_BRACE_READINGS: usize = 64;

/// A word's readings with its first brace group taken apart (`{..,x}/config.yaml` is
/// `../config.yaml` and `x/config.yaml`), nested or later groups in turn; `None` if there are
/// more than [`MAX_BRACE_READINGS`] (a group of 32,000 parts of a 64 KiB command was taken apart
/// whole: 32,000 copies of the word, a gigabyte, before the bound was looked at).
fn brace_alternatives(word: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut todo = vec![word.to_string()];
    while let Some(w) = todo.pop() {
        let open = w.find('{');
        let close = open.and_then(|o| w[o..].find('}').map(|c| o + c));
        match (open, close) {
            (Some(o), Some(c)) if w[o + 1..c].contains(',') => {
                let parts = w[o + 1..c].matches(',').count() + 1;
                if out.len() + todo.len() + parts > MAX_BRACE_READINGS {
                    return None;
                }
                for part in w[o + 1..c].split(',') {
                    todo.push(format!("{}{}{}", &w[..o], part, &w[c + 1..]));
                }
            }
            _ => out.push(w),
        }
    }
    Some(out)
}

/// The words of a command line as the rules read them (split at blanks, separators,
/// redirections and assignments).
fn words(plain: &str) -> impl Iterator<Item = &str> {
    plain
        .split(|c: char| {
            c.is_whitespace() || matches!(c, ';' | '&' | '|' | '(' | ')' | '<' | '>' | '`' | '=')
        })
        .filter(|w| !w.is_empty())
}

/// Does `command` name one of [`GATEWAY_FILES`], as the shell would read it? Quotes and escapes
/// do not change the name the shell passes on (`api_k''eys`, `st\ate.db` named them unasked),
/// and a pattern may name them without spelling them out (`*.db`, `api_*`, `st?te.db`,
/// `{state,x}.db`). A speed bump, not a sandbox: a command that builds a name at run time is
/// not seen.
fn names_gateway_file(command: &str) -> bool {
    let plain = unquoted(command);
    if GATEWAY_FILES.iter().any(|f| plain.contains(f)) {
        return true;
    }
    let patterned = words(&plain)
        .filter(|word| word.contains(['*', '?', '[', '{']))
        .any(|word| {
            let name = word.rsplit('/').next().unwrap_or(word);
            GATEWAY_FILES.iter().any(|f| glob_may_match(name, f))
        });
    patterned
}

/// `command` without the quotes and escapes that do not change what the shell passes on. A line
/// continuation is no character at all, and `$'…'` and `$"…"` are quotes too (`$'…'` written as
/// the characters it stands for): `$PP\⏎ID`, `st$''ate.db` and `$'\x73'tate.db` name what
/// they spell.
fn unquoted(command: &str) -> String {
    let joined = super::danger::joined_lines(command);
    let decoded = super::danger::ansi_c_decoded(&joined).unwrap_or(joined);
    decoded
        .chars()
        .filter(|c| !matches!(c, '\'' | '"' | '\\'))
        .collect()
}

/// Does `command` reach into the gateway's own process, `pid` (the terminal's shell is its
/// child)? Through `$PPID` (`/proc/$PPID/fd/N` is the open ledger: a command wrote an approval
/// into it and then ran unasked; `/proc/$PPID/environ` holds the model's key; `kill $PPID`),
/// or by its number under `/proc` or in a `kill`.
pub fn names_gateway_process(command: &str, pid: u32) -> bool {
    let plain = unquoted(command);
    if plain.contains("PPID") {
        return true;
    }
    let pid = pid.to_string();
    let mentions_pid = |text: &str| {
        text.match_indices(&pid).any(|(at, _)| {
            let before = text[..at].chars().next_back();
            let after = text[at + pid.len()..].chars().next();
            !before.is_some_and(|c| c.is_ascii_digit())
                && !after.is_some_and(|c| c.is_ascii_digit())
        })
    };
    let parts: Vec<&str> = plain.split([';', '&', '|', '\n', '(', ')']).collect();
    let signals = |part: &str| {
        part.split_whitespace().any(|w| {
            w.ends_with("kill") || w.ends_with("killall") || w == "prlimit" || w == "renice"
        })
    };
    (plain.contains(&format!("/proc/{pid}")) && mentions_pid(&plain))
        || parts.iter().any(|part| signals(part) && mentions_pid(part))
        // A pid found at run time (`kill $(pidof gatehouse)`, `` kill `pgrep …` ``,
        // `lsof -ti:8080 | xargs kill`, `fuser -k 8080/tcp`) may be ours.
        || (signals(&plain) && (plain.contains("$(") || plain.contains('`')))
        || parts.iter().any(|part| signals(part) && part.split_whitespace().any(|w| w.ends_with("xargs")))
        || parts.iter().any(|part| {
            let mut words = part.split_whitespace();
            words.any(|w| w.ends_with("fuser"))
                && words.any(|w| {
                    w == "--kill" || (w.starts_with('-') && !w.starts_with("--") && w.contains('k'))
                })
        })
        // Every process's entries, or one named at run time (`/proc/*/environ`, `/proc/$p/fd`).
        || plain.match_indices("/proc/").any(|(at, m)| {
            plain[at + m.len()..]
                .starts_with(['*', '?', '[', '{', '$', '`'])
        })
        // Found by name: `pgrep gatehouse | xargs kill`, `pidof gatehouse`.
        || (plain.contains("gatehouse")
            && ["pidof", "pgrep", "pkill", "killall"]
                .iter()
                .any(|finder| plain.split_whitespace().any(|w| w.ends_with(finder))))
        // The gateway's own command line (it speaks to the control socket, writes api_keys).
        || parts.iter().any(|part| {
            part.split_whitespace()
                .find(|w| !w.contains('='))
                .is_some_and(|first| first == "gatehouse" || first.ends_with("/gatehouse"))
        })
}

/// Could the shell pattern `pattern` match `name`? `*` is any run, `?` and a bracket class any
/// one character, a brace group any run (all of them more than the shell allows: a doubt is
/// asked about).
fn glob_may_match(pattern: &str, name: &str) -> bool {
    let mut tokens = Vec::new();
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        match c {
            '*' => tokens.push(None),
            '{' => {
                for c in chars.by_ref() {
                    if c == '}' {
                        break;
                    }
                }
                tokens.push(None);
            }
            '?' => tokens.push(Some(None)),
            '[' => {
                for c in chars.by_ref() {
                    if c == ']' {
                        break;
                    }
                }
                tokens.push(Some(None));
            }
            c => tokens.push(Some(Some(c))),
        }
    }
    // Classic wildcard matching over the tokens: None is a run, Some(None) any one character.
    let name: Vec<char> = name.chars().collect();
    let (mut p, mut n, mut star, mut mark) = (0, 0, None, 0);
    while n < name.len() {
        match tokens.get(p) {
            Some(Some(t)) if t.is_none_or(|c| c == name[n]) => {
                p += 1;
                n += 1;
            }
            Some(None) => {
                star = Some(p);
                mark = n;
                p += 1;
            }
            _ => match star {
                Some(s) => {
                    p = s + 1;
                    mark += 1;
                    n = mark;
                }
                None => return false,
            },
        }
    }
    tokens[p..].iter().all(Option::is_none)
}

#[cfg(test)]
mod tests {
    use super::{names_gateway_process, touches_gateway_state};

    #[test]
    fn the_gateways_files_are_seen_by_any_name_of_its_home() {
        use std::path::Path;
        let home = Path::new("/srv/u/.local/state/gatehouse");
        let elsewhere = Path::new("/srv/work");
        let user = Some("/srv/u");
        let touches = |c: &str, cwd: &Path| touches_gateway_state(c, cwd, home, user);
        assert!(touches("rm state.db", home));
        assert!(touches("echo 0 > authority_epoch", home));
        // Spelled as the shell joins it: a line continuation, `$'…'`, `$"…"`.
        for joined in [
            "sqlite3 st\\\nate.db 'insert into approval_allowlist values (1)'",
            "rm st$''ate.db",
            "rm $'\\x73'tate.db",
            "rm $\"state\".db",
            "cat api_\\\r\nkeys",
        ] {
            assert!(touches(joined, home), "{joined:?}");
        }
        assert!(touches(
            "rm /srv/u/.local/state/gatehouse/state.db",
            elsewhere
        ));
        assert!(touches(
            "cd ~/.local/state/gatehouse && rm state.db",
            elsewhere
        ));
        assert!(touches(
            "cp $HOME/.local/state/gatehouse/config.yaml x",
            elsewhere
        ));
        assert!(touches(
            "cat ${HOME}/.local/state/gatehouse/api_keys",
            elsewhere
        ));
        // However the path is spelled, and the home itself; not the workspace's own files.
        let workspace = Path::new("/srv/u/.local/state/gatehouse/workspace");
        for spelled in [
            ("cat ../config.yaml", workspace),
            (
                "sha256sum /srv/u/.local/state//gatehouse/api_keys",
                elsewhere,
            ),
            ("cat /srv/u/.local/state/./gatehouse/state.db", elsewhere),
            ("cat ../u/.local/state/gatehouse/config.yaml", elsewhere),
            ("cp -r /srv/u/.local/state/gatehouse /tmp/copy", elsewhere),
            ("tar cf - ~/.local/state/gatehouse", elsewhere),
            ("ls ..", workspace),
        ] {
            assert!(touches(spelled.0, spelled.1), "{}", spelled.0);
        }
        for own in ["cat config.yaml", "ls *.db", "rm -f -- *", "cat ./state.db"] {
            assert!(!touches(own, workspace), "{own}");
        }
        // A background process's log, as its call's result names it, is read unasked.
        for log in [
            "tail -n 50 /srv/u/.local/state/gatehouse/background/bg-0123456789ab.log",
            "cat ~/.local/state/gatehouse/background/bg-0123456789ab.log",
        ] {
            assert!(!touches(log, elsewhere), "{log}");
            assert!(!touches(log, workspace), "{log}");
        }
        // The home reached by moving first, or by the user's home when it is the gateway's
        // (a service user's), or through a brace group in the directory part.
        let service =
            |c: &str| touches_gateway_state(c, workspace, home, Some(home.to_str().unwrap()));
        for moved in [
            "cd ../.. && cat gatehouse/config.yaml",
            "tar -C ../.. -czf /tmp/x.tgz gatehouse",
            "cat {..,x}/config.yaml",
            "pushd .. && wc -c api_keys",
        ] {
            assert!(touches(moved, workspace), "{moved}");
        }
        // A word of more readings than are taken apart is asked about, whatever it reads
        // (taken apart whole, one of 10,000 parts in 64 KiB of command was a gigabyte).
        let many = format!("cat {{{}}}/notes.txt", ",".repeat(10_000));
        assert!(touches(&many, workspace));
        assert_eq!(super::brace_alternatives(&many), None);
        let few = format!("cat {{{}}}/notes.txt", ",".repeat(63));
        assert!(!touches(&few, workspace));
        assert_eq!(
            super::brace_alternatives("{a,b}{c,d}").map(|r| r.len()),
            Some(4)
        );
        for served in [
            "cd; cat config.yaml",
            "cd ~ && sqlite3 state.db .tables",
            "cd $HOME; wc -c api_keys",
            "cd ${HOME} && head -1 config.yaml",
            "cp -r ~ /tmp/copy",
            "cp -r $HOME /tmp/copy",
        ] {
            assert!(service(served), "{served}");
        }
        assert!(!service("cd src && cat config.yaml"));
        // Another directory's files of the same name, or the home's parent.
        // As the shell reads it: quoted, escaped, or by a pattern.
        for named in [
            "echo x >> api_k''eys",
            "cp sta\"\"te.db /tmp/x",
            "cat st\\ate.db",
            "cp *.db /tmp",
            "cat api_*",
            "cat ./st?te.db",
            "cat {state,x}.db",
            "cat gateway.[ls]ock",
            "rm -f -- *",
        ] {
            assert!(touches(named, home), "{named}");
        }
        assert!(!touches("ls *.txt", home));
        assert!(!touches("cat notes?.md", home));
        assert!(!touches("rm state.db", elsewhere));
        assert!(!touches("ls ~/.local/state", elsewhere));
        assert!(!touches("rm ~/other/state.db", elsewhere));
        assert!(!touches_gateway_state(
            "cd ~/.local/state/gatehouse && rm state.db",
            elsewhere,
            home,
            None
        ));
    }

    #[test]
    fn the_gateways_process_is_seen_by_its_shells_parent_or_its_number() {
        for reaching in [
            "sqlite3 /proc/$PPID/fd/14 'insert into x values(1)'",
            "tr '\\0' '\\n' < /proc/${PPID}/environ",
            "kill -9 $PPID",
            "cat /proc/4242/environ",
            "ls -l /proc/4242/fd",
            "kill 4242",
            "sleep 1; /bin/kill -TERM 4242",
            "kill -TERM $(pidof gatehouse)",
            "kill -0 `pgrep gatehouse`",
            "pgrep -x gatehouse | xargs kill -0",
            "renice -n 0 -p $(pidof gatehouse)",
            "gatehouse key create evil --home .",
            "cd /x && ./gatehouse sessions --home .",
            // Spelled as the shell joins it: a line continuation, `$'…'`, `$"…"`.
            "cat /proc/$PP\\\nID/environ",
            "cat /proc/$PP\\\r\nID/environ",
            "cat /proc/$'\\x24'PPID/environ",
            "cat /proc/$PP$''ID/environ",
            "grep -a OPENAI /proc/*/environ",
            "cat /proc/[0-9]*/environ",
            "for p in $(ls /proc); do cat /proc/$p/environ; done",
            "lsof -ti:8080 | xargs kill -9",
            "pgrep -f serve | xargs -r kill",
            "fuser -k 8080/tcp",
            "fuser -TERM -k -n tcp 8080",
            "fuser --kill 8080/tcp",
            "kill 42\\\n42",
        ] {
            assert!(names_gateway_process(reaching, 4242), "{reaching}");
        }
        for other in [
            "cat /proc/42420/status",
            "kill 14242",
            "head -n 4242 notes.txt",
            "cat /proc/self/status",
            "echo ppid",
            "kill %1",
            "ls ~/.local/state/gatehouse",
            "cargo build -p gatehouse",
            "server & pid=$!; sleep 1; kill $pid",
            "fuser -v 8080/tcp",
            "cat /proc/cpuinfo /proc/self/status",
            "xargs -n1 echo < pids.txt",
        ] {
            assert!(!names_gateway_process(other, 4242), "{other}");
        }
    }
}
