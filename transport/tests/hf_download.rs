//! `PromptTokenizer::fetch` against a local stand-in for the Hugging Face Hub, so the tests
//! need no network: the mock answers `GET /{org}/{name}/resolve/main/{file}` as the Hub
//! does for what hf-hub's blocking client reads (a `Range: bytes=0-0` probe for `etag`,
//! `x-repo-commit` and `Content-Range`, then a ranged download of the body; 404 for files a
//! repo lacks, 401 for a gated repo without the token, a relative 307 for a renamed repo).
//! The tokenizer served is the ChatML fixture of `tests/data/tokenizer/chatml`.
//!
//! Repos under `evil/` answer as a hostile mirror would: an etag or commit that is a path
//! (`../../..`, absolute), which must never become one.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use transport::TransportError;
use transport::openai::tokenize::{HubOptions, PromptTokenizer};

/// The commit every mock repo's `main` points at.
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
/// The token the gated repo wants.
const TOKEN: &str = "hf_test_secret";

fn fixture(file: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/tokenizer/chatml")
            .join(file),
    )
    .unwrap()
}

/// A repo on the mock Hub: its files, and the token it is gated behind.
struct MockRepo {
    files: HashMap<&'static str, Vec<u8>>,
    token: Option<&'static str>,
}

/// `org/name` → repo.
type Repos = Arc<HashMap<&'static str, MockRepo>>;

fn repos() -> Repos {
    let full = || {
        HashMap::from([
            ("tokenizer.json", fixture("tokenizer.json")),
            ("tokenizer_config.json", fixture("tokenizer_config.json")),
        ])
    };
    let bare = HashMap::from([("tokenizer.json", fixture("tokenizer.json"))]);
    let no_tokenizer = HashMap::from([("tokenizer_config.json", fixture("tokenizer_config.json"))]);
    Arc::new(HashMap::from([
        (
            "acme/chat-model",
            MockRepo {
                files: full(),
                token: None,
            },
        ),
        (
            "acme/bare",
            MockRepo {
                files: bare,
                token: None,
            },
        ),
        (
            "acme/gated",
            MockRepo {
                files: full(),
                token: Some(TOKEN),
            },
        ),
        (
            "acme/config-only",
            MockRepo {
                files: no_tokenizer,
                token: None,
            },
        ),
    ]))
}

fn hex_sha256(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// An error answer with the Hub's `X-Error-Message`.
fn hub_error(status: StatusCode, message: &str) -> Response {
    (status, [("x-error-message", message.to_owned())], "").into_response()
}

/// `bytes=START-` or `bytes=START-END` → the inclusive range within `len` bytes.
fn range(headers: &HeaderMap, len: usize) -> Option<(usize, usize)> {
    let spec = headers.get(header::RANGE)?.to_str().ok()?;
    let (start, end) = spec.strip_prefix("bytes=")?.split_once('-')?;
    let start: usize = start.parse().ok()?;
    let end = if end.is_empty() {
        len - 1
    } else {
        end.parse::<usize>().ok()?.min(len - 1)
    };
    (start <= end).then_some((start, end))
}

async fn resolve_file(
    State(repos): State<Repos>,
    UrlPath((org, name, revision, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    if org == "evil" {
        return evil_answer(&name, &headers);
    }
    // A renamed repo: the Hub answers with a relative redirect to the new name.
    if (org.as_str(), name.as_str()) == ("acme", "old-name") {
        let to = format!("/acme/chat-model/resolve/{revision}/{file}");
        return (StatusCode::TEMPORARY_REDIRECT, [(header::LOCATION, to)]).into_response();
    }
    let Some(repo) = repos.get(format!("{org}/{name}").as_str()) else {
        return hub_error(StatusCode::NOT_FOUND, "Repository not found");
    };
    if let Some(token) = repo.token {
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if auth != Some(format!("Bearer {token}").as_str()) {
            return hub_error(
                StatusCode::UNAUTHORIZED,
                "Access to this model is restricted. Please log in.",
            );
        }
    }
    if revision != "main" {
        return hub_error(StatusCode::NOT_FOUND, "Revision not found");
    }
    let Some(body) = repo.files.get(file.as_str()) else {
        return hub_error(StatusCode::NOT_FOUND, "Entry not found");
    };
    let etag = format!("\"{}\"", hex_sha256(body));
    let common = [("etag", etag), ("x-repo-commit", COMMIT.to_owned())];
    match range(&headers, body.len()) {
        Some((start, end)) => (
            StatusCode::PARTIAL_CONTENT,
            common,
            [(
                header::CONTENT_RANGE,
                format!("bytes {start}-{end}/{}", body.len()),
            )],
            body[start..=end].to_vec(),
        )
            .into_response(),
        None => (StatusCode::OK, common, body.clone()).into_response(),
    }
}

/// Where a hostile answer would have a client write: a name beside `HF_HOME` (reached
/// through `../`), and an absolute path.
fn escape_targets() -> (String, PathBuf) {
    let marker = format!("kvengine-hf-escaped-{}", std::process::id());
    let absolute = std::env::temp_dir().join(format!("{marker}-absolute"));
    (marker, absolute)
}

/// `evil/{name}`'s answer: the fixture's `tokenizer.json` (any file) with a hostile etag
/// or commit.
fn evil_answer(name: &str, headers: &HeaderMap) -> Response {
    let body = fixture("tokenizer.json");
    let (marker, absolute) = escape_targets();
    // From HF_HOME/hub/models--evil--x/blobs/ (or snapshots/), four levels up is HF_HOME's
    // parent.
    let up = format!("../../../../{marker}");
    let good_etag = format!("\"{}\"", hex_sha256(&body));
    let mut answer = vec![
        ("etag", good_etag.clone()),
        ("x-repo-commit", COMMIT.to_owned()),
    ];
    match name {
        "etag" => answer[0].1 = format!("\"{up}\""),
        "linked-etag" => answer.push(("x-linked-etag", up)),
        "absolute-etag" => answer[0].1 = format!("\"{}\"", absolute.display()),
        "commit" => answer[1].1 = up,
        "absolute-commit" => answer[1].1 = absolute.display().to_string(),
        _ => return hub_error(StatusCode::NOT_FOUND, "Repository not found"),
    }
    let mut response = match range(headers, body.len()) {
        Some((start, end)) => (
            StatusCode::PARTIAL_CONTENT,
            [(
                header::CONTENT_RANGE,
                format!("bytes {start}-{end}/{}", body.len()),
            )],
            body[start..=end].to_vec(),
        )
            .into_response(),
        None => (StatusCode::OK, body).into_response(),
    };
    for (k, v) in answer {
        response.headers_mut().insert(k, v.parse().unwrap());
    }
    response
}

/// The mock Hub, served on a runtime of its own (the download under test blocks).
struct MockHub {
    endpoint: String,
    _runtime: tokio::runtime::Runtime,
}

fn mock_hub() -> MockHub {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let app = Router::new()
        .route("/{org}/{name}/resolve/{revision}/{file}", get(resolve_file))
        .with_state(repos());
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let endpoint = format!("http://{}/", listener.local_addr().unwrap());
    runtime.spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    MockHub {
        endpoint,
        _runtime: runtime,
    }
}

/// A fresh, empty `HF_HOME`.
fn hf_home(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kvengine-hf-download-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn options(endpoint: &str) -> HubOptions {
    HubOptions::default()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(20))
}

fn reason(err: TransportError) -> String {
    match err {
        TransportError::Invalid { name, reason } => {
            assert_eq!(name, "tokenizer");
            reason
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// A repo missing from the cache is downloaded into the standard layout; `resolve` then
/// finds it offline and it loads as the same files do from disk.
#[test]
fn downloads_into_the_cache_and_resolves_offline() {
    let hub = mock_hub();
    let home = hf_home("full");
    assert!(PromptTokenizer::resolve("acme/chat-model", &home).is_err());

    let dir = PromptTokenizer::fetch("acme/chat-model", &home, &options(&hub.endpoint)).unwrap();
    let repo = home.join("hub/models--acme--chat-model");
    assert_eq!(dir, repo.join("snapshots").join(COMMIT));
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        COMMIT
    );
    assert_eq!(
        std::fs::read(dir.join("tokenizer.json")).unwrap(),
        fixture("tokenizer.json")
    );
    // The optional files the repo lacks (404) are simply absent.
    assert!(dir.join("tokenizer_config.json").is_file());
    assert!(!dir.join("special_tokens_map.json").exists());
    assert!(!dir.join("chat_template.jinja").exists());

    // Offline from here on: the mock Hub is gone.
    drop(hub);
    assert_eq!(
        PromptTokenizer::resolve("acme/chat-model", &home).unwrap(),
        dir
    );
    let loaded = PromptTokenizer::from_path(&dir).unwrap();
    assert!(loaded.has_chat_template());
    let direct = PromptTokenizer::from_path(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer/chatml"),
    )
    .unwrap();
    assert_eq!(format!("{loaded:?}"), format!("{direct:?}"));
    assert_eq!(
        loaded.encode("Hello world !", true).unwrap(),
        direct.encode("Hello world !", true).unwrap()
    );
    let _ = std::fs::remove_dir_all(&home);
}

/// A repo with `tokenizer.json` only loads without a chat template; one without
/// `tokenizer.json` is an error naming the file, and leaves nothing `resolve` would take.
#[test]
fn only_tokenizer_json_is_required() {
    let hub = mock_hub();
    let home = hf_home("bare");
    let dir = PromptTokenizer::fetch("acme/bare", &home, &options(&hub.endpoint)).unwrap();
    assert!(!dir.join("tokenizer_config.json").exists());
    assert!(
        !PromptTokenizer::from_path(&dir)
            .unwrap()
            .has_chat_template()
    );

    let e = reason(
        PromptTokenizer::fetch("acme/config-only", &home, &options(&hub.endpoint)).unwrap_err(),
    );
    assert!(e.contains("acme/config-only"), "{e}");
    assert!(e.contains("tokenizer.json: HTTP 404"), "{e}");
    assert!(e.contains("Entry not found"), "{e}");
    assert!(PromptTokenizer::resolve("acme/config-only", &home).is_err());

    let e = reason(
        PromptTokenizer::fetch("acme/no-such-repo", &home, &options(&hub.endpoint)).unwrap_err(),
    );
    assert!(
        e.contains("HTTP 404") && e.contains("Repository not found"),
        "{e}"
    );
    assert!(
        e.contains("huggingface-cli download acme/no-such-repo"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&home);
}

/// A gated repo needs the token (sent as a bearer token); without it the error says so,
/// and a wrong token never appears in the error.
#[test]
fn gated_repos_need_the_token() {
    let hub = mock_hub();
    let home = hf_home("gated");
    let e =
        reason(PromptTokenizer::fetch("acme/gated", &home, &options(&hub.endpoint)).unwrap_err());
    assert!(e.contains("HTTP 401") && e.contains("HF_TOKEN"), "{e}");
    assert!(e.contains("restricted"), "{e}");

    let wrong = options(&hub.endpoint).with_token(Some("hf_wrong_value".to_owned()));
    let e = reason(PromptTokenizer::fetch("acme/gated", &home, &wrong).unwrap_err());
    assert!(!e.contains("hf_wrong_value"), "{e}");
    assert!(!format!("{wrong:?}").contains("hf_wrong_value"));

    let right = options(&hub.endpoint).with_token(Some(TOKEN.to_owned()));
    let dir = PromptTokenizer::fetch("acme/gated", &home, &right).unwrap();
    assert_eq!(PromptTokenizer::resolve("acme/gated", &home).unwrap(), dir);
    let _ = std::fs::remove_dir_all(&home);
}

/// A renamed repo's relative redirect is followed; the files are cached under the name
/// asked for, where `resolve` looks.
#[test]
fn relative_redirects_are_followed() {
    let hub = mock_hub();
    let home = hf_home("renamed");
    let dir = PromptTokenizer::fetch("acme/old-name", &home, &options(&hub.endpoint)).unwrap();
    assert!(dir.starts_with(home.join("hub/models--acme--old-name")));
    assert_eq!(
        PromptTokenizer::resolve("acme/old-name", &home).unwrap(),
        dir
    );
    let _ = std::fs::remove_dir_all(&home);
}

/// No Hub at the address: an error (not a panic), quickly.
#[test]
fn unreachable_endpoint_is_an_error() {
    let home = hf_home("unreachable");
    let start = Instant::now();
    let e = reason(
        PromptTokenizer::fetch("acme/chat-model", &home, &options("http://127.0.0.1:9"))
            .unwrap_err(),
    );
    assert!(start.elapsed() < Duration::from_secs(20));
    assert!(
        e.contains("acme/chat-model") && e.contains("http://127.0.0.1:9"),
        "{e}"
    );
    assert!(
        e.contains("huggingface-cli download acme/chat-model"),
        "{e}"
    );
    assert!(PromptTokenizer::resolve("acme/chat-model", &home).is_err());
    let _ = std::fs::remove_dir_all(&home);
}

/// A Hub that accepts the connection and never answers: the deadline ends the wait.
#[test]
fn a_silent_endpoint_times_out() {
    // Connections complete in the kernel's backlog, but nobody ever reads or writes.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let home = hf_home("silent");
    let start = Instant::now();
    let silent = options(&endpoint).with_timeout(Duration::from_millis(500));
    let e = reason(PromptTokenizer::fetch("acme/chat-model", &home, &silent).unwrap_err());
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert!(e.contains("no complete answer within"), "{e}");
    drop(listener);
    let _ = std::fs::remove_dir_all(&home);
}

/// Names the Hub would refuse, and `HF_HUB_OFFLINE`, fail before any request.
#[test]
fn refused_before_any_request() {
    let home = hf_home("refused");
    for bad in [
        "acme/bad--name",
        "acme/.hidden",
        "acme/name.",
        "no-slash",
        "a/b/c",
    ] {
        let e =
            reason(PromptTokenizer::fetch(bad, &home, &options("http://127.0.0.1:9")).unwrap_err());
        assert!(e.contains("not a Hugging Face repo id"), "{bad}: {e}");
    }
    assert!(PromptTokenizer::is_repo_id("Qwen/Qwen2.5-7B-Instruct"));
    assert!(!PromptTokenizer::is_repo_id("./relative/path"));
    assert!(!PromptTokenizer::is_repo_id("/abs/path"));

    let offline = HubOptions {
        offline: true,
        ..options("http://127.0.0.1:9")
    };
    let e = reason(PromptTokenizer::fetch("acme/chat-model", &home, &offline).unwrap_err());
    assert!(e.contains("HF_HUB_OFFLINE"), "{e}");
    let _ = std::fs::remove_dir_all(&home);
}

/// A mirror that answers an etag or commit naming a path (`../../..` out of the cache, or
/// an absolute one), as `ETag`, `X-Linked-Etag` or `X-Repo-Commit`: the download is refused
/// with an error naming the header, and nothing is written outside the cache, nor a
/// snapshot left that `resolve` would take.
#[test]
fn a_mirror_cannot_write_outside_the_cache() {
    let hub = mock_hub();
    let home = hf_home("evil");
    let (marker, absolute) = escape_targets();
    let beside = home.parent().unwrap().join(&marker);
    let cleanup = || {
        for p in [&beside, &absolute] {
            let _ = std::fs::remove_dir_all(p);
            let _ = std::fs::remove_file(p);
            let _ = std::fs::remove_file(p.with_extension("lock"));
            let _ = std::fs::remove_file(p.with_extension("part"));
        }
    };
    cleanup();
    for (repo, header) in [
        ("evil/etag", "ETag"),
        ("evil/linked-etag", "ETag"),
        ("evil/absolute-etag", "ETag"),
        ("evil/commit", "X-Repo-Commit"),
        ("evil/absolute-commit", "X-Repo-Commit"),
    ] {
        let fetched = PromptTokenizer::fetch(repo, &home, &options(&hub.endpoint));
        let outside: Vec<PathBuf> = [&beside, &absolute]
            .iter()
            .flat_map(|p| {
                [
                    p.to_path_buf(),
                    p.with_extension("lock"),
                    p.with_extension("part"),
                ]
            })
            .filter(|p| std::fs::symlink_metadata(p).is_ok())
            .collect();
        cleanup();
        assert!(
            outside.is_empty(),
            "{repo}: written outside the cache: {outside:?}"
        );
        let e = reason(fetched.unwrap_err());
        assert!(
            e.contains(header) && e.contains("not a plain name"),
            "{repo}: {e}"
        );
        assert!(PromptTokenizer::resolve(repo, &home).is_err(), "{repo}");
    }
    // Nothing outside the repos' own directories either.
    let hub_dir = home.join("hub");
    if let Ok(entries) = std::fs::read_dir(&hub_dir) {
        for e in entries {
            let name = e.unwrap().file_name().into_string().unwrap();
            assert!(
                name.starts_with("models--evil--"),
                "{name} in {}",
                hub_dir.display()
            );
        }
    }
    let _ = std::fs::remove_dir_all(&home);
}
