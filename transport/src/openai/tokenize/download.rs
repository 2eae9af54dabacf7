//! Downloading a tokenizer from the Hugging Face Hub into the local cache
//! ([`PromptTokenizer::fetch`]), for a `--tokenizer org/name` that
//! [`PromptTokenizer::resolve`] does not find offline.
//!
//! The files land in the standard cache layout under `HF_HOME/hub`
//! (`models--org--name/{blobs/<etag>,snapshots/<commit>/<file>,refs/main}`, as
//! `huggingface-cli download` writes them), so the next start finds them offline. The
//! protocol is the Hub's (and `huggingface_hub`'s): a `Range: bytes=0-0` probe of
//! `{endpoint}/{org}/{name}/resolve/main/{file}` (relative redirects followed, e.g. a renamed
//! repo) whose answer names the file's etag (`X-Linked-Etag`, else `ETag`) and the commit
//! (`X-Repo-Commit`), then the download of the file itself (redirects followed, e.g. to a
//! CDN).
//!
//! This module writes the cache itself rather than through the `hf-hub` crate: hf-hub
//! 0.4.3 joins the etag and commit a server answers into cache paths unchecked
//! (`blobs/<etag>`, `snapshots/<commit>/<file>`, with `PathBuf::push`), so a mirror
//! (`HF_ENDPOINT`) answering `../../x` or an absolute path would have it create directories,
//! files and symlinks anywhere the process may write; it also sent the token to whatever
//! host an absolute redirect named.
//!
//! Invariants:
//! - nothing is written outside `HF_HOME/hub/models--org--name/`: every name that becomes
//!   a path component (the repo id, the revision, the file names, and the etag and commit
//!   the server answers) is checked to be a plain name ([`plain_name`]) before a path is
//!   built from it, and every path is checked to lie under the repo's directory before it
//!   is used; an answer that fails is refused with an error naming the header;
//! - `tokenizer.json` is downloaded last: `resolve` only finds a snapshot holding it, so a
//!   download that fails half way never leaves a cache that later loads without the chat
//!   template the optional files carry;
//! - the whole download is bounded by [`HubOptions::timeout`] (each request, and the wait
//!   for all of them), and each file by [`MAX_FILE_BYTES`];
//! - the token never appears in errors or `Debug` output, and is sent to the endpoint's
//!   host only (redirects elsewhere go without it);
//! - nothing panics into the caller: the download runs on its own thread, and a panic there
//!   is reported as an error.

use std::fmt;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use super::{PromptTokenizer, split_repo_id, tokenizer_err};
use crate::error::Result;

/// The Hub used when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// How long [`PromptTokenizer::fetch`] waits by default for all its files: long enough for
/// a large `tokenizer.json` (~10 MB) on a slow link, short enough that a start against a
/// silent network fails instead of hanging.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// The file a tokenizer cannot do without.
const TOKENIZER_FILE: &str = "tokenizer.json";
/// Files `from_path` reads when present; a repo may lack any of them (a 404 is fine).
const OPTIONAL_FILES: [&str; 3] = [
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
/// The branch downloaded, the one `resolve` follows through `refs/main`.
const REVISION: &str = "main";
/// The largest file accepted (tokenizer files are at most tens of MB).
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// Relative redirects followed by a probe (a renamed repo takes one).
const MAX_PROBE_REDIRECTS: usize = 5;

/// Where and how [`PromptTokenizer::fetch`] downloads: the Hub's address, the access token
/// and a deadline. [`HubOptions::from_env`] reads them as `huggingface_hub` does.
#[derive(Clone)]
pub struct HubOptions {
    /// The Hub's base URL (`HF_ENDPOINT`, default [`DEFAULT_ENDPOINT`]), without a trailing
    /// `/`: files are fetched from `{endpoint}/{org}/{name}/resolve/main/{file}`.
    pub endpoint: String,
    /// The access token (`HF_TOKEN`), needed for gated and private repos. `None` falls back
    /// to the token file `huggingface-cli login` writes (`HF_HOME/token`), if any.
    pub token: Option<String>,
    /// The deadline for the whole download (every file, redirects included).
    pub timeout: Duration,
    /// `HF_HUB_OFFLINE`: never touch the network, so `fetch` fails at once.
    pub offline: bool,
}

impl fmt::Debug for HubOptions {
    /// Says whether a token is set, never what it is.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubOptions")
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("offline", &self.offline)
            .finish()
    }
}

impl Default for HubOptions {
    /// The public Hub, no token, [`DEFAULT_TIMEOUT`], online.
    fn default() -> Self {
        HubOptions {
            endpoint: DEFAULT_ENDPOINT.to_owned(),
            token: None,
            timeout: DEFAULT_TIMEOUT,
            offline: false,
        }
    }
}

impl HubOptions {
    /// The options the environment gives, as `huggingface_hub` reads it: `HF_ENDPOINT`,
    /// `HF_TOKEN` (empty means unset) and `HF_HUB_OFFLINE` (`1`, `true`, `yes`, `on`).
    pub fn from_env() -> Self {
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let mut options = HubOptions::default();
        if let Some(endpoint) = var("HF_ENDPOINT") {
            options = options.with_endpoint(endpoint);
        }
        options.token = var("HF_TOKEN");
        options.offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            ["1", "true", "yes", "on"]
                .iter()
                .any(|t| v.eq_ignore_ascii_case(t))
        });
        options
    }

    /// Points at another Hub (a mirror, a test server). A trailing `/` is dropped, since the
    /// file URLs are built as `{endpoint}/{repo}/...`.
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = endpoint.into().trim_end_matches('/').to_owned();
        self
    }

    /// Sets the access token (for gated and private repos).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// Sets the deadline of the whole download.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

/// The Hub's own rule for a repo name (stricter than what `resolve` accepts from a cache
/// that already exists): no `--` or `..`, no leading or trailing `-` or `.`, at most 96
/// characters. Refusing here keeps odd names out of URLs and cache paths.
fn hub_name_ok(part: &str) -> bool {
    part.len() <= 96
        && !part.contains("--")
        && !part.contains("..")
        && !part.starts_with(['-', '.'])
        && !part.ends_with(['-', '.'])
}

impl PromptTokenizer {
    /// Downloads the tokenizer of the Hugging Face repo `spec` (`org/name`, branch `main`)
    /// into the cache under `hf_home` (`HF_HOME`) and returns the snapshot directory, which
    /// [`resolve`](Self::resolve) then finds offline and [`from_path`](Self::from_path)
    /// loads. `tokenizer.json` is required; `tokenizer_config.json`,
    /// `special_tokens_map.json` and `chat_template.jinja` are fetched when the repo has them.
    ///
    /// Blocks the calling thread for at most `hub.timeout` (a download still running then is
    /// left to finish or fail in the background). Every failure (no network, HTTP errors such
    /// as 401 for a gated repo without `HF_TOKEN`, a repo without `tokenizer.json`, the
    /// deadline) is a [`TransportError::Invalid`](crate::TransportError::Invalid) named
    /// `tokenizer` that names the repo and how to fetch it for offline use.
    pub fn fetch(spec: &str, hf_home: &Path, hub: &HubOptions) -> Result<PathBuf> {
        let fail = |reason: String| {
            tokenizer_err(format!(
                "cannot download the tokenizer of {spec} from {}: {reason} (for offline use, \
                 fetch it with `huggingface-cli download {spec} tokenizer.json \
                 tokenizer_config.json`, or pass the tokenizer's directory)",
                hub.endpoint
            ))
        };
        match split_repo_id(spec) {
            Some((org, name)) if hub_name_ok(org) && hub_name_ok(name) => {}
            _ => {
                return Err(tokenizer_err(format!(
                    "{spec} is not a Hugging Face repo id (org/name)"
                )));
            }
        }
        if hub.offline {
            return Err(fail("HF_HUB_OFFLINE is set".to_owned()));
        }
        // Each request has the deadline too, but several follow one another: a thread of
        // its own bounds the whole wait and contains a panic (its sender is dropped, which
        // the receiver sees as a disconnection).
        let (tx, rx) = mpsc::channel();
        let (repo_id, hub_dir, options) = (spec.to_owned(), hf_home.join("hub"), hub.clone());
        std::thread::Builder::new()
            .name("hf-download".to_owned())
            .spawn(move || {
                // The receiver is gone only after the deadline: nobody is left to tell.
                let _ = tx.send(download(&repo_id, hub_dir, &options));
            })
            .map_err(|e| fail(format!("cannot start the download thread: {e}")))?;
        let dir = match rx.recv_timeout(hub.timeout) {
            Ok(Ok(dir)) => dir,
            Ok(Err(reason)) => return Err(fail(reason)),
            Err(RecvTimeoutError::Timeout) => {
                return Err(fail(format!("no complete answer within {:?}", hub.timeout)));
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(fail("the download failed unexpectedly".to_owned()));
            }
        };
        // The caller's next start looks the tokenizer up with `resolve`: check it finds it
        // now, rather than only that files were written somewhere.
        Self::resolve(spec, hf_home).map_err(|e| {
            fail(format!(
                "downloaded into {}, but the cache lookup failed: {e}",
                dir.display()
            ))
        })
    }
}

/// Whether `name` may be one component of a cache path: 1 to 128 ASCII letters, digits,
/// `-`, `_` and `.`, and not `.` or `..`. A Hub etag (a hex digest) and commit (40 hex
/// digits) are such names; a path (`a/b`, `../x`, `/x`) is not.
pub(crate) fn plain_name(name: &str) -> bool {
    (1..=128).contains(&name.len())
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Why a download failed: an HTTP status (with the Hub's `X-Error-Message`), or anything
/// else, in words.
#[derive(Debug)]
enum Fail {
    Status {
        code: u16,
        url: String,
        message: Option<String>,
    },
    Other(String),
}

impl fmt::Display for Fail {
    /// With a hint for the statuses gated and private repos answer with.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Fail::Status { code, url, message } => {
                write!(f, "HTTP {code} from {url}")?;
                if let Some(m) = message {
                    write!(f, " ({m})")?;
                }
                if matches!(code, 401 | 403) {
                    f.write_str(
                        "; a gated or private repo needs HF_TOKEN set to a token with access",
                    )?;
                }
                Ok(())
            }
            Fail::Other(s) => f.write_str(s),
        }
    }
}

impl From<ureq::Error> for Fail {
    fn from(e: ureq::Error) -> Self {
        match e {
            ureq::Error::Status(code, response) => Fail::Status {
                code,
                url: response.get_url().to_owned(),
                message: response.header("x-error-message").map(str::to_owned),
            },
            ureq::Error::Transport(t) => Fail::Other(t.to_string()),
        }
    }
}

/// What the probe of a file says: where its bytes are, their etag, the commit.
struct Probe {
    /// The URL to download from (the probe's, or the absolute redirect it answered).
    url: String,
    etag: String,
    commit: String,
}

/// One repo's download: the HTTP client, the endpoint and token, the repo's cache directory.
struct Fetcher {
    /// For the probe: no redirect followed (it follows relative ones itself).
    probe_agent: ureq::Agent,
    /// For the download: redirects followed, the token kept on the same host only.
    agent: ureq::Agent,
    /// `scheme://host[:port]` of the endpoint (relative redirects resolve against it).
    origin: String,
    /// `{endpoint}/{org}/{name}`.
    base: String,
    /// `HF_HOME/hub/models--org--name`: everything written lies under it.
    repo_dir: PathBuf,
    /// The token: `HF_TOKEN`, else the file `huggingface-cli login` writes.
    token: Option<String>,
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    Some(format!("{scheme}://{authority}"))
}

impl Fetcher {
    /// A GET of `url` by `agent`; with the token only if `url` is on the endpoint's
    /// origin.
    fn get(&self, agent: &ureq::Agent, url: &str) -> ureq::Request {
        let request = agent.get(url);
        match &self.token {
            Some(token) if origin(url).as_deref() == Some(self.origin.as_str()) => {
                request.set("Authorization", &format!("Bearer {token}"))
            }
            _ => request,
        }
    }

    /// The probe: `Range: bytes=0-0`, relative redirects followed (an absolute one is
    /// where the bytes are), the etag and commit headers read and checked
    /// ([`plain_name`]).
    fn probe(&self, file: &str) -> std::result::Result<Probe, Fail> {
        let mut url = format!("{}/resolve/{REVISION}/{file}", self.base);
        let mut hops = 0;
        let response = loop {
            let response = self
                .get(&self.probe_agent, &url)
                .set("Range", "bytes=0-0")
                .call()?;
            let relative = response
                .header("location")
                .filter(|l| l.starts_with('/') && !l.starts_with("//"))
                .map(str::to_owned);
            match relative {
                Some(path) if (300..400).contains(&response.status()) => {
                    hops += 1;
                    if hops > MAX_PROBE_REDIRECTS {
                        return Err(Fail::Other("too many redirects".to_owned()));
                    }
                    url = format!("{}{path}", self.origin);
                }
                _ => break response,
            }
        };
        let header = |name: &'static str| {
            response.header(name).map(str::to_owned).ok_or_else(|| {
                Fail::Other(format!(
                    "no {name} header in the answer (is the endpoint a Hugging Face Hub?)"
                ))
            })
        };
        let etag = match response.header("x-linked-etag") {
            Some(e) => e.to_owned(),
            None => header("etag")?,
        };
        let etag = etag.trim().trim_start_matches("W/").replace('"', "");
        let commit = header("x-repo-commit")?.trim().to_owned();
        for (what, value) in [("ETag", &etag), ("X-Repo-Commit", &commit)] {
            if !plain_name(value) {
                return Err(Fail::Other(format!(
                    "the server answered {what} {value:?}, which is not a plain name: refused \
                     as a cache path"
                )));
            }
        }
        let url = match response.header("location") {
            Some(l) if (300..400).contains(&response.status()) => l.to_owned(),
            _ => url,
        };
        Ok(Probe { url, etag, commit })
    }

    /// `parts` joined under the repo's directory, each checked ([`plain_name`]), and the
    /// result checked to lie under it (invariant 1).
    fn cache_path(&self, parts: &[&str]) -> std::result::Result<PathBuf, Fail> {
        let mut path = self.repo_dir.clone();
        for part in parts {
            if !plain_name(part) {
                return Err(Fail::Other(format!(
                    "{part:?} is not a plain name: refused as a cache path"
                )));
            }
            path.push(part);
        }
        let inside = path
            .strip_prefix(&self.repo_dir)
            .is_ok_and(|rest| rest.components().all(|c| matches!(c, Component::Normal(_))));
        if !inside {
            return Err(Fail::Other(format!(
                "{} is outside the cache directory {}",
                path.display(),
                self.repo_dir.display()
            )));
        }
        Ok(path)
    }

    /// Downloads `file` into the cache; returns its path under `snapshots/<commit>/`.
    fn download(&self, file: &str) -> std::result::Result<PathBuf, Fail> {
        let probe = self.probe(file)?;
        let blob = self.cache_path(&["blobs", &probe.etag])?;
        let partial = self.cache_path(&["blobs", &format!("{}.incomplete", probe.etag)])?;
        let snapshot = self.cache_path(&["snapshots", &probe.commit])?;
        let pointer = self.cache_path(&["snapshots", &probe.commit, file])?;
        let refs = self.cache_path(&["refs"])?;
        let reference = self.cache_path(&["refs", REVISION])?;
        let io = |what: &str, path: &Path, e: std::io::Error| {
            Fail::Other(format!("cannot {what} {}: {e}", path.display()))
        };
        if !blob.is_file() {
            let response = self.get(&self.agent, &probe.url).call()?;
            let mut bytes = Vec::new();
            response
                .into_reader()
                .take(MAX_FILE_BYTES + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| Fail::Other(e.to_string()))?;
            if bytes.len() as u64 > MAX_FILE_BYTES {
                return Err(Fail::Other(format!(
                    "larger than {MAX_FILE_BYTES} bytes: refused"
                )));
            }
            let blobs = self.cache_path(&["blobs"])?;
            std::fs::create_dir_all(&blobs).map_err(|e| io("create", &blobs, e))?;
            std::fs::write(&partial, &bytes).map_err(|e| io("write", &partial, e))?;
            std::fs::rename(&partial, &blob).map_err(|e| io("write", &blob, e))?;
        }
        std::fs::create_dir_all(&snapshot).map_err(|e| io("create", &snapshot, e))?;
        if std::fs::symlink_metadata(&pointer).is_err() {
            link(&probe.etag, &blob, &pointer).map_err(|e| io("link", &pointer, e))?;
        }
        std::fs::create_dir_all(&refs).map_err(|e| io("create", &refs, e))?;
        std::fs::write(&reference, &probe.commit).map_err(|e| io("write", &reference, e))?;
        Ok(pointer)
    }
}

/// `snapshots/<commit>/<file>` → `../../blobs/<etag>`, as the Hub's clients link them (a
/// copy where there are no symlinks).
fn link(etag: &str, blob: &Path, pointer: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let _ = blob;
        std::os::unix::fs::symlink(Path::new("../../blobs").join(etag), pointer)
    }
    #[cfg(not(unix))]
    {
        let _ = etag;
        std::fs::copy(blob, pointer).map(|_| ())
    }
}

/// The token file `huggingface-cli login` writes (`HF_HOME/token`, beside `hub_dir`).
fn token_file(hub_dir: &Path) -> Option<String> {
    let token = std::fs::read_to_string(hub_dir.parent()?.join("token")).ok()?;
    let token = token.trim();
    (!token.is_empty()).then(|| token.to_owned())
}

/// The download itself, on the download thread: the optional files first, `tokenizer.json`
/// last (see the module docs), into `hub_dir` (`HF_HOME/hub`). Returns the snapshot
/// directory or why it failed.
fn download(
    repo_id: &str,
    hub_dir: PathBuf,
    hub: &HubOptions,
) -> std::result::Result<PathBuf, String> {
    let folder = match split_repo_id(repo_id) {
        Some((org, name)) => format!("models--{org}--{name}"),
        None => return Err(format!("{repo_id} is not a repo id")),
    };
    let Some(origin) = origin(&hub.endpoint).filter(|_| plain_name(&folder)) else {
        return Err(format!("cannot download {repo_id} from {}", hub.endpoint));
    };
    let agent = |redirects: u32| {
        ureq::AgentBuilder::new()
            .redirects(redirects)
            .redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost)
            .timeout(hub.timeout)
            .try_proxy_from_env(true)
            .user_agent(&format!("kvengine/{}", env!("CARGO_PKG_VERSION")))
            .build()
    };
    let fetcher = Fetcher {
        probe_agent: agent(0),
        agent: agent(5),
        origin,
        base: format!("{}/{repo_id}", hub.endpoint),
        repo_dir: hub_dir.join(&folder),
        token: hub.token.clone().or_else(|| token_file(&hub_dir)),
    };
    let get_optional = |file: &str| match fetcher.download(file) {
        Ok(path) => Ok(Some(path)),
        Err(Fail::Status { code: 404, .. }) => Ok(None),
        Err(e) => Err(format!("{file}: {e}")),
    };
    let mut optional = Vec::new();
    for file in OPTIONAL_FILES {
        if let Some(path) = get_optional(file)? {
            optional.push((file, path));
        }
    }
    let tokenizer = fetcher
        .download(TOKENIZER_FILE)
        .map_err(|e| format!("{TOKENIZER_FILE}: {e}"))?;
    let Some(snapshot) = tokenizer.parent().map(Path::to_path_buf) else {
        return Err(format!(
            "{TOKENIZER_FILE} landed at {}",
            tokenizer.display()
        ));
    };
    // Each file is stored under the commit `main` had when it was fetched: a push between
    // two files splits them over two snapshots. Fetch the stragglers again, once, now
    // that `main` has moved.
    for (file, path) in optional {
        if path.parent() == Some(snapshot.as_path()) {
            continue;
        }
        match get_optional(file)? {
            Some(again) if again.parent() != Some(snapshot.as_path()) => {
                return Err(format!(
                    "the repo changed while downloading ({file} and {TOKENIZER_FILE} are of \
                     different commits): try again"
                ));
            }
            _ => {}
        }
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_become_path_components() {
        for ok in [
            "0123456789abcdef0123456789abcdef01234567",
            "a1b2-c3_d4.e5",
            "main",
            "tokenizer.json",
        ] {
            assert!(plain_name(ok), "{ok}");
        }
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "../../x",
            "/abs",
            "a/b",
            "a\\b",
            "x\u{0}",
            "é",
            "a b",
            "C:x",
            &"a".repeat(129),
        ] {
            assert!(!plain_name(bad), "{bad:?}");
        }
    }
}
