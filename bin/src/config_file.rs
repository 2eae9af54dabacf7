//! `--config kvengine.toml`: every router flag, and the workers, in one file.
//!
//! ```toml
//! router-mode = "kv"              # any long flag of `kvengine serve`, as on the command line
//! kv-cache-block-size = 16
//! cores = 8
//!
//! [[workers]]
//! id = 1
//! url = "http://gpu-1:8000"
//! api_key = "..."                 # vLLM --api-key (sent on forwarded requests)
//! # vLLM's --kv-events-config, as is: a `*` host means the worker's own (from `url`)
//! kv_events_config = '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
//! ```
//!
//! Settings become the flags' `KVENGINE_*` variables before the command line is parsed, so
//! a flag beats the variable, which beats the file. Unknown names are an error that names
//! them; nothing in the file is ignored silently.

use anyhow::{Context, Result, bail};
use clap::CommandFactory;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The file's worker entries.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerEntry {
    /// The worker id.
    pub id: u64,
    /// Its HTTP base URL.
    #[serde(default)]
    pub url: Option<String>,
    /// Its ZMQ publisher and replay endpoints (or `kv_events_config`).
    #[serde(default)]
    pub zmq: Option<String>,
    #[serde(default)]
    pub replay: Option<String>,
    /// vLLM's `--kv-events-config` JSON.
    #[serde(default)]
    pub kv_events_config: Option<String>,
    /// Its data-parallel ranks.
    #[serde(default)]
    pub dp_ranks: Vec<u32>,
    /// `aggregated`, `prefill` or `decode`.
    #[serde(default)]
    pub role: Option<String>,
    /// Its API key.
    #[serde(default)]
    pub api_key: Option<String>,
}

/// A parsed file.
#[derive(Debug, Default)]
pub struct ConfigFile {
    /// `KVENGINE_*` variable -> value.
    pub settings: BTreeMap<String, String>,
    /// The workers, in file order.
    pub workers: Vec<WorkerEntry>,
}

/// vLLM's `--kv-events-config` (the fields kvengine uses; the rest are the worker's).
#[derive(Debug, Deserialize)]
struct KvEventsConfig {
    #[serde(default)]
    publisher: Option<String>,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    replay_endpoint: Option<String>,
}

impl WorkerEntry {
    /// The worker's (publisher, replay) endpoints: `zmq` / `replay`, else from
    /// `kv_events_config` with `*` (or an empty host) replaced by `url`'s host.
    pub fn endpoints(&self) -> Result<Option<(String, Option<String>)>> {
        if let Some(z) = &self.zmq {
            return Ok(Some((z.clone(), self.replay.clone())));
        }
        let Some(json) = &self.kv_events_config else {
            return Ok(None);
        };
        let cfg: KvEventsConfig = serde_json::from_str(json)
            .with_context(|| format!("worker {}: kv_events_config is not JSON", self.id))?;
        if cfg.publisher.as_deref().is_some_and(|p| p != "zmq") {
            bail!(
                "worker {}: kv_events_config publisher {:?}: only zmq is supported",
                self.id,
                cfg.publisher
            );
        }
        let host = self.url.as_deref().and_then(url_host);
        let fix = |e: String| -> Result<String> {
            match e.strip_prefix("tcp://*:") {
                Some(port) => match &host {
                    Some(h) => Ok(format!("tcp://{h}:{port}")),
                    None => bail!(
                        "worker {}: endpoint {e:?} binds every interface; give the worker a \
                         url so its host is known",
                        self.id
                    ),
                },
                None => Ok(e),
            }
        };
        let Some(endpoint) = cfg.endpoint else {
            bail!("worker {}: kv_events_config has no endpoint", self.id);
        };
        Ok(Some((
            fix(endpoint)?,
            cfg.replay_endpoint.map(fix).transpose()?,
        )))
    }
}

/// `http://host:port/...` -> `host`.
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    };
    (!host.is_empty()).then(|| host.to_owned())
}

/// The `KVENGINE_*` variable of each long flag of `kvengine serve`.
fn flag_envs() -> BTreeMap<String, String> {
    let cmd = crate::Cli::command();
    cmd.get_arguments()
        .filter_map(|a| {
            let long = a.get_long()?;
            let env = a.get_env()?.to_str()?;
            Some((long.to_owned(), env.to_owned()))
        })
        .collect()
}

/// A setting's value as its variable would carry it.
fn scalar(key: &str, v: &toml::Value) -> Result<String> {
    Ok(match v {
        toml::Value::String(s) => s.clone(),
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) => f.to_string(),
        toml::Value::Boolean(b) => b.to_string(),
        _ => bail!("setting {key}: expected a string, number, boolean or a list of them"),
    })
}

/// Reads and checks `path`.
pub fn load(path: &Path) -> Result<ConfigFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the config file {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("parsing the config file {}", path.display()))?;
    let envs = flag_envs();
    let mut out = ConfigFile::default();
    let mut unknown = Vec::new();
    for (key, value) in table {
        if key == "workers" {
            out.workers = value
                .try_into()
                .with_context(|| format!("{}: [[workers]]", path.display()))?;
            continue;
        }
        let flag = key.replace('_', "-");
        let Some(env) = envs.get(&flag) else {
            unknown.push(key);
            continue;
        };
        let text = match &value {
            // A list (e.g. zmq-worker) is the variable's `;`-separated form.
            toml::Value::Array(items) => items
                .iter()
                .map(|v| scalar(&key, v))
                .collect::<Result<Vec<_>>>()?
                .join(";"),
            v => scalar(&key, v)?,
        };
        out.settings.insert(env.clone(), text);
    }
    if !unknown.is_empty() {
        bail!(
            "{}: unknown settings {unknown:?} (names are `kvengine serve`'s long flags, \
             e.g. router-mode, or [[workers]])",
            path.display()
        );
    }
    let mut ids = std::collections::BTreeSet::new();
    for w in &out.workers {
        if !ids.insert(w.id) {
            bail!("{}: worker {} is listed twice", path.display(), w.id);
        }
        w.endpoints()?;
    }
    Ok(out)
}

/// The config file named by `--config PATH` / `--config=PATH` on the command line, else
/// `KVENGINE_CONFIG`.
pub fn path_from_args() -> Option<PathBuf> {
    let args: Vec<String> = std::env::args().collect();
    for (i, a) in args.iter().enumerate() {
        if a == "--config" {
            return args.get(i + 1).map(PathBuf::from);
        }
        if let Some(p) = a.strip_prefix("--config=") {
            return Some(PathBuf::from(p));
        }
    }
    std::env::var_os("KVENGINE_CONFIG").map(PathBuf::from)
}

/// Sets each setting's variable unless it is set already. Must run at the top of `main`,
/// before any thread exists.
pub fn apply(file: &ConfigFile) {
    for (env, value) in &file.settings {
        if std::env::var_os(env).is_none() {
            // SAFETY: called at the top of `main` before the process starts any thread, so
            // nothing reads the environment concurrently.
            unsafe { std::env::set_var(env, value) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_events_config_star_means_the_workers_host() {
        let w = WorkerEntry {
            id: 3,
            url: Some("http://gpu-3.cluster:8000/".into()),
            kv_events_config: Some(
                r#"{"enable_kv_cache_events": true, "publisher": "zmq",
                    "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                    "topic": "kv-events"}"#
                    .into(),
            ),
            ..WorkerEntry::default()
        };
        assert_eq!(
            w.endpoints().unwrap(),
            Some((
                "tcp://gpu-3.cluster:5557".to_owned(),
                Some("tcp://gpu-3.cluster:5558".to_owned())
            ))
        );
        let no_url = WorkerEntry {
            url: None,
            ..w.clone()
        };
        assert!(no_url.endpoints().is_err());
        let nats = WorkerEntry {
            kv_events_config: Some(r#"{"publisher": "nats", "endpoint": "x"}"#.into()),
            ..w
        };
        assert!(nats.endpoints().is_err());
    }

    #[test]
    fn every_flag_with_a_variable_is_a_setting() {
        let envs = flag_envs();
        assert_eq!(envs["router-mode"], "KVENGINE_ROUTER_MODE");
        assert_eq!(envs["zmq-worker"], "KVENGINE_ZMQ_WORKERS");
        assert_eq!(envs["admin-token"], "KVENGINE_ADMIN_TOKEN");
    }
}
