//! Downloading a tokenizer from the Hugging Face Hub into the local cache
//! ([`PromptTokenizer::fetch`]), for a `--tokenizer org/name` that
//! [`PromptTokenizer::resolve`] does not find offline.
//!
//! The files land in the standard cache layout under `HF_HOME/hub`
//! (`models--org--name/{blobs,snapshots/<commit>,refs/main}`, written by the `hf-hub` crate,
//! as `huggingface-cli download` writes them), so the next start finds them offline.
//!
//! Invariants:
//! - `tokenizer.json` is downloaded last: `resolve` only finds a snapshot holding it, so a
//!   download that fails half way never leaves a cache that later loads without the chat
//!   template the optional files carry;
//! - the whole download is bounded by [`HubOptions::timeout`] (the blocking HTTP client has
//!   no read timeout of its own);
//! - the token never appears in errors or `Debug` output;
//! - nothing panics into the caller: the download runs on its own thread, and a panic there
//!   is reported as an error.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

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
        // The blocking client cannot be given a read timeout through hf-hub, and hf-hub has
        // a few internal unwraps: a thread of its own bounds the wait and contains a panic
        // (its sender is dropped, which the receiver sees as a disconnection).
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

/// The download itself, on the download thread: the optional files first, `tokenizer.json`
/// last (see the module docs), into `hub_dir` (`HF_HOME/hub`). Returns the snapshot
/// directory or why it failed.
fn download(
    repo_id: &str,
    hub_dir: PathBuf,
    hub: &HubOptions,
) -> std::result::Result<PathBuf, String> {
    // `from_cache`, not `new`: `new` looks up the home directory and panics without one.
    let mut builder = ApiBuilder::from_cache(Cache::new(hub_dir))
        .with_endpoint(hub.endpoint.clone())
        .with_progress(false)
        .with_user_agent("kvengine", env!("CARGO_PKG_VERSION"));
    // Without HF_TOKEN, keep the token file hf-hub read from the cache (`HF_HOME/token`).
    if let Some(token) = &hub.token {
        builder = builder.with_token(Some(token.clone()));
    }
    let api = builder.build().map_err(|e| describe(&e))?;
    let repo = api.repo(Repo::with_revision(
        repo_id.to_owned(),
        RepoType::Model,
        REVISION.to_owned(),
    ));
    let get_optional = |file: &str| match repo.download(file) {
        Ok(path) => Ok(Some(path)),
        Err(e) if status(&e) == Some(404) => Ok(None),
        Err(e) => Err(format!("{file}: {}", describe(&e))),
    };
    let mut optional = Vec::new();
    for file in OPTIONAL_FILES {
        if let Some(path) = get_optional(file)? {
            optional.push((file, path));
        }
    }
    let tokenizer = repo
        .download(TOKENIZER_FILE)
        .map_err(|e| format!("{TOKENIZER_FILE}: {}", describe(&e)))?;
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

/// The HTTP status of a failed request, if the server answered.
fn status(err: &ApiError) -> Option<u16> {
    match err {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, _) => Some(*code),
            ureq::Error::Transport(_) => None,
        },
        _ => None,
    }
}

/// An hf-hub error in words, with the Hub's own explanation (`X-Error-Message`) for HTTP
/// errors and a hint for the statuses gated and private repos answer with.
fn describe(err: &ApiError) -> String {
    match err {
        ApiError::RequestError(e) => match e.as_ref() {
            ureq::Error::Status(code, response) => {
                let mut text = format!("HTTP {code} from {}", response.get_url());
                if let Some(message) = response.header("x-error-message") {
                    text.push_str(&format!(" ({message})"));
                }
                if matches!(code, 401 | 403) {
                    text.push_str(
                        "; a gated or private repo needs HF_TOKEN set to a token with access",
                    );
                }
                text
            }
            ureq::Error::Transport(t) => t.to_string(),
        },
        ApiError::MissingHeader(_) | ApiError::InvalidHeader(_) => {
            format!("{err} in the answer (is the endpoint a Hugging Face Hub?)")
        }
        other => other.to_string(),
    }
}
