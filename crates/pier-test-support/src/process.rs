//! Runs the `pier` binary as a child process: config in a temp dir, output captured to
//! files, readiness read from `PIER_READY_FILE`, killed on drop.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::client::RawConn;

/// How long Pier may take to become ready (or to reach a generation).
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// The file in Pier's temp dir that holds its test clock's offset (`PIER_TEST_CLOCK`).
const CLOCK_FILE: &str = "clock";

static DIR_SEQ: AtomicU64 = AtomicU64::new(0);

/// What Pier wrote to its ready file.
#[derive(Debug, Clone)]
struct Ready {
    listeners: Vec<(String, SocketAddr)>,
    admin: Option<SocketAddr>,
    generation: u64,
}

fn parse_ready(text: &str) -> Option<Ready> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let listeners = v
        .get("listeners")?
        .as_object()?
        .iter()
        .filter_map(|(k, a)| Some((k.clone(), a.as_str()?.parse().ok()?)))
        .collect();
    let admin = v
        .get("admin")
        .and_then(|a| a.as_str())
        .and_then(|a| a.parse().ok());
    let generation = v.get("generation").and_then(|g| g.as_u64()).unwrap_or(1);
    Some(Ready {
        listeners,
        admin,
        generation,
    })
}

/// A running `pier` process.
#[derive(Debug)]
pub struct PierProcess {
    child: Child,
    dir: TempDir,
    config_path: PathBuf,
    ready_path: PathBuf,
    ready: Ready,
    exited: Option<ExitStatus>,
}

/// A fresh directory under the system temp dir, removed on drop (kept when the
/// environment has `PIER_TEST_KEEP`, to look at after a failure).
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    pub fn new() -> TempDir {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let path = std::env::temp_dir().join(format!(
            "pier-test-{}-{}-{nanos}",
            std::process::id(),
            DIR_SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path).expect("create temp dir");
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes a file in the directory and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let p = self.path.join(name);
        fs::write(&p, contents).expect("write temp file");
        p
    }
}

impl Default for TempDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("PIER_TEST_KEEP").is_none() {
            let _ = fs::remove_dir_all(&self.path);
        }
    }
}

impl PierProcess {
    /// `pier serve -c <config>`; panics (with Pier's output) unless it is ready in 20 s.
    pub fn start(bin_path: &Path, config_toml: &str) -> PierProcess {
        Self::launch(bin_path, Some(config_toml), &["serve", "-c", "{config}"])
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Runs Pier with the given arguments (e.g. quick mode) and no config file; panics
    /// unless it is ready in 20 s.
    pub fn start_args(bin_path: &Path, args: &[&str]) -> PierProcess {
        Self::launch(bin_path, None, args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Writes `config_toml` (if any) to a temp dir, replaces `{config}` in `args` with its
    /// path, spawns Pier with `PIER_READY_FILE` and `RUST_LOG=info`, and waits up to 20 s
    /// for the ready file. The error holds the exit status and output if it did not start.
    pub fn launch(
        bin_path: &Path,
        config_toml: Option<&str>,
        args: &[&str],
    ) -> Result<PierProcess, String> {
        Self::launch_env(bin_path, config_toml, args, &[])
    }

    /// [`PierProcess::launch`] with extra environment variables.
    pub fn launch_env(
        bin_path: &Path,
        config_toml: Option<&str>,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<PierProcess, String> {
        let dir = TempDir::new();
        let config_path = dir.path().join("pier.toml");
        if let Some(text) = config_toml {
            fs::write(&config_path, text).expect("write config");
        }
        let ready_path = dir.path().join("ready.json");
        let cfg = config_path.to_string_lossy().into_owned();
        let args: Vec<String> = args.iter().map(|a| a.replace("{config}", &cfg)).collect();
        let stdout = fs::File::create(dir.path().join("stdout.log")).expect("stdout file");
        let stderr = fs::File::create(dir.path().join("stderr.log")).expect("stderr file");
        let child = Command::new(bin_path)
            .args(&args)
            .env("PIER_READY_FILE", &ready_path)
            .env("PIER_TEST_CLOCK", dir.path().join(CLOCK_FILE))
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", bin_path.display()))?;
        let mut p = PierProcess {
            child,
            dir,
            config_path,
            ready_path,
            ready: Ready {
                listeners: Vec::new(),
                admin: None,
                generation: 0,
            },
            exited: None,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(r) = p.read_ready() {
                p.ready = r;
                return Ok(p);
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                p.exited = Some(status);
                return Err(format!(
                    "pier {args:?} exited with {status} before it was ready\n{}",
                    p.logs()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "pier {args:?} was not ready after {READY_TIMEOUT:?}\n{}",
                    p.logs()
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn read_ready(&self) -> Option<Ready> {
        parse_ready(&fs::read_to_string(&self.ready_path).ok()?)
    }

    /// The address of the named listener; panics if Pier did not report it.
    pub fn listener(&self, name: &str) -> SocketAddr {
        self.ready
            .listeners
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| *a)
            .unwrap_or_else(|| {
                panic!(
                    "no listener {name:?} in the ready file ({:?})",
                    self.ready.listeners
                )
            })
    }

    /// Every listener Pier reported, by name.
    pub fn listeners(&self) -> Vec<(String, SocketAddr)> {
        self.ready.listeners.clone()
    }

    /// The admin listener's address; panics if there is none.
    pub fn admin(&self) -> SocketAddr {
        self.ready.admin.expect("pier reported no admin listener")
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Sends a signal (e.g. `libc::SIGTERM`, `libc::SIGHUP`) through `kill(1)`, which keeps
    /// this crate free of `unsafe`.
    pub fn signal(&self, sig: i32) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -{sig} {} failed", self.pid());
    }

    /// Replaces the config file atomically (write then rename), as an operator would.
    pub fn rewrite_config(&self, new_text: &str) {
        let tmp = self.dir.path().join("pier.toml.tmp");
        fs::write(&tmp, new_text).expect("write config");
        fs::rename(&tmp, &self.config_path).expect("rename config");
    }

    /// Moves Pier's cache clock `d` forward (whole seconds, rounded up), at
    /// once: the next request sees it (`PIER_TEST_CLOCK`, docs/testing.md).
    /// Freshness, Age, stale-while-revalidate and grace are then tested without
    /// waiting for real seconds to pass.
    pub fn advance_clock(&self, d: Duration) {
        let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
        let file = self.dir.path().join(CLOCK_FILE);
        let now: u64 = fs::read_to_string(&file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        // Write then rename: Pier never reads a half-written number.
        let tmp = self.dir.path().join("clock.tmp");
        fs::write(&tmp, (now + secs).to_string()).expect("write clock");
        fs::rename(&tmp, &file).expect("rename clock");
    }

    /// The generation in the ready file right now (1 at start).
    pub fn generation(&self) -> u64 {
        self.read_ready().map(|r| r.generation).unwrap_or(0)
    }

    /// Waits up to `timeout` for generation `n` (or later); refreshes the listener
    /// addresses when it comes.
    pub fn try_wait_generation(&mut self, n: u64, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(r) = self.read_ready() {
                if r.generation >= n {
                    self.ready = r;
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits (20 s at most) for generation `n`; panics with Pier's output otherwise.
    pub fn wait_generation(&mut self, n: u64) {
        if !self.try_wait_generation(n, READY_TIMEOUT) {
            panic!(
                "pier did not reach generation {n} (at {})\n{}",
                self.generation(),
                self.logs()
            );
        }
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.exited.is_some() {
            return self.exited;
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.exited = Some(s);
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Pier's stdout and stderr so far.
    pub fn logs(&self) -> String {
        let out = fs::read_to_string(self.dir.path().join("stdout.log")).unwrap_or_default();
        let err = fs::read_to_string(self.dir.path().join("stderr.log")).unwrap_or_default();
        format!("--- pier stdout ---\n{out}--- pier stderr ---\n{err}--- end ---")
    }

    /// `GET /metrics` on the admin listener; panics unless 200.
    pub fn metrics(&self) -> String {
        // The admin endpoint answers a Host that names it (issue 31).
        let host = self.admin().to_string();
        let r = RawConn::connect(self.admin())
            .request("GET", "/metrics", &[("host", &host)], b"")
            .unwrap_or_else(|e| panic!("GET /metrics: {e}\n{}", self.logs()));
        assert_eq!(r.status, 200, "GET /metrics: {}", r.body_str());
        r.body_str()
    }

    /// The value of one series, e.g.
    /// `pier_local_responses_total{status="502",reason="upstream-connect"}`; labels match
    /// in any order, and all of them must match.
    pub fn metric_value(&self, name_with_labels: &str) -> Option<f64> {
        let (name, mut want, _) = parse_metric_line(&format!("{name_with_labels} 0"))
            .unwrap_or_else(|| panic!("bad metric query {name_with_labels:?}"));
        want.sort();
        self.metrics().lines().find_map(|l| {
            let (n, mut labels, v) = parse_metric_line(l)?;
            labels.sort();
            (n == name && labels == want).then_some(v)
        })
    }

    /// The sum over every series of `name` whose labels include `labels` (0 if none).
    pub fn metric_sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.metrics()
            .lines()
            .filter_map(parse_metric_line)
            .filter(|(n, ls, _)| {
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| ls.iter().any(|(lk, lv)| lk == k && lv == v))
            })
            .map(|(_, _, v)| v)
            .sum()
    }

    /// Pier's resident memory in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        rss_kib(self.pid())
    }
}

impl Drop for PierProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let logs = self.logs();
            // The tail is what explains a failure; keep the test output readable.
            let start = logs.len().saturating_sub(20_000);
            let start = (start..logs.len())
                .find(|i| logs.is_char_boundary(*i))
                .unwrap_or(0);
            eprintln!("pier (pid {}) output:\n{}", self.child.id(), &logs[start..]);
        }
        if self.exited.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // The temp dir is removed when `self.dir` drops, after the child is gone.
    }
}

/// One Prometheus sample: name, labels (in file order), value.
pub type MetricSample = (String, Vec<(String, String)>, f64);

/// Parses one Prometheus text line into name, labels and value; `None` for comments,
/// blank lines and anything malformed.
pub fn parse_metric_line(line: &str) -> Option<MetricSample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_string();
    let mut labels = Vec::new();
    let mut rest = &line[name_end..];
    if let Some(r) = rest.strip_prefix('{') {
        let mut chars = r.char_indices().peekable();
        let mut end = None;
        loop {
            // Skip separators.
            while let Some((_, c)) = chars.peek() {
                if *c == ',' || *c == ' ' {
                    chars.next();
                } else {
                    break;
                }
            }
            match chars.peek() {
                Some((i, '}')) => {
                    end = Some(*i + 1);
                    break;
                }
                None => break,
                _ => {}
            }
            let mut key = String::new();
            for (_, c) in chars.by_ref() {
                if c == '=' {
                    break;
                }
                key.push(c);
            }
            if chars.next().map(|(_, c)| c) != Some('"') {
                return None;
            }
            let mut val = String::new();
            let mut closed = false;
            while let Some((_, c)) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some((_, 'n')) => val.push('\n'),
                        Some((_, c)) => val.push(c),
                        None => return None,
                    },
                    '"' => {
                        closed = true;
                        break;
                    }
                    c => val.push(c),
                }
            }
            if !closed {
                return None;
            }
            labels.push((key.trim().to_string(), val));
        }
        rest = &r[end?..];
    }
    let value = rest.split_whitespace().next()?;
    let v = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, labels, v))
}

/// Resident memory of a process in KiB, from `/proc/PID/status` (`VmRSS`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let s = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_metric_lines() {
        assert_eq!(
            parse_metric_line(
                r#"pier_local_responses_total{status="502",reason="upstream-connect"} 3"#
            ),
            Some((
                "pier_local_responses_total".into(),
                vec![
                    ("status".into(), "502".into()),
                    ("reason".into(), "upstream-connect".into())
                ],
                3.0
            ))
        );
        assert_eq!(
            parse_metric_line("pier_active_connections 7"),
            Some(("pier_active_connections".into(), vec![], 7.0))
        );
        assert_eq!(
            parse_metric_line(r#"x_bucket{le="+Inf",a="q\"uote"} 1.5 1700000000"#),
            Some((
                "x_bucket".into(),
                vec![("le".into(), "+Inf".into()), ("a".into(), "q\"uote".into())],
                1.5
            ))
        );
        assert_eq!(parse_metric_line("# HELP x y"), None);
        assert_eq!(parse_metric_line(""), None);
    }

    #[test]
    fn parses_ready_file() {
        let r = parse_ready(
            r#"{"pid":123,"listeners":{"main":"127.0.0.1:41234"},"admin":"127.0.0.1:41235","generation":3}"#,
        )
        .unwrap();
        assert_eq!(
            r.listeners,
            vec![("main".to_string(), "127.0.0.1:41234".parse().unwrap())]
        );
        assert_eq!(r.admin, Some("127.0.0.1:41235".parse().unwrap()));
        assert_eq!(r.generation, 3);
        let r = parse_ready(r#"{"pid":1,"listeners":{},"admin":null}"#).unwrap();
        assert_eq!(r.admin, None);
        assert_eq!(r.generation, 1);
        assert!(parse_ready(r#"{"pid":1,"list"#).is_none());
    }

    #[test]
    fn own_rss_is_readable() {
        assert!(rss_kib(std::process::id()).unwrap() > 0);
    }
}
