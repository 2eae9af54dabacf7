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
//! model = "qwen"                  # a [[models]] name (none: the router's only pool)
//!
//! [[models]]                      # one pool, block size and tokenizer per served model
//! name = "qwen"                   # what clients send as `model`
//! block_size = 16                 # its workers' --block-size (default kv-cache-block-size)
//! tokenizer = "Qwen/Qwen2.5-7B-Instruct"  # default: the `tokenizer` setting
//! ```
//!
//! The command line has the same two forms: `--worker id=1,url=...,model=qwen` and
//! `--model qwen,block_size=16,tokenizer=...` (see [`WorkerEntry::from_spec`] and
//! [`ModelEntry::from_spec`]).
//!
//! Settings become the flags' `KVENGINE_*` variables before the command line is parsed, so
//! a flag beats the variable, which beats the file. Unknown names are an error that names
//! them; nothing in the file is ignored silently.

use anyhow::{Context, Result, bail};
use clap::CommandFactory;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// The model it serves (a `[[models]]` name).
    #[serde(default)]
    pub model: Option<String>,
    /// The topic its publisher sends under (else `kv_events_config`'s; else every message).
    #[serde(default)]
    pub topic: Option<String>,
    /// Where its KV events come from: `zmq` (vLLM, SGLang: the default when it has ZMQ
    /// endpoints) or `trtllm` (TensorRT-LLM: `POST {url}/kv_cache_events`, polled).
    #[serde(default)]
    pub events: Option<String>,
    /// With `events = "trtllm"`: the poll interval in milliseconds (default 100; each
    /// request that finishes on the worker also polls it at once).
    #[serde(default)]
    pub poll_ms: Option<u64>,
}

/// The file's model entries.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// What clients send as `model`.
    pub name: String,
    /// Its workers' KV block size (default: the router's `kv-cache-block-size`).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Its tokenizer, as `--tokenizer` takes it (default: `--tokenizer`'s).
    #[serde(default)]
    pub tokenizer: Option<String>,
}

/// `key=value,key=value` pairs of a CLI spec.
fn spec_pairs(spec: &str) -> Result<Vec<(&str, &str)>, String> {
    spec.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.trim(), v.trim()))
                .ok_or_else(|| format!("{p:?} is not key=value"))
        })
        .collect()
}

impl ModelEntry {
    /// `--model NAME[,block_size=N][,tokenizer=SPEC]`.
    pub fn from_spec(spec: &str) -> Result<Self, String> {
        let (name, rest) = spec.split_once(',').unwrap_or((spec, ""));
        let mut m = ModelEntry {
            name: name.trim().to_owned(),
            ..ModelEntry::default()
        };
        for (k, v) in spec_pairs(rest)? {
            match k {
                "block_size" => {
                    m.block_size = Some(v.parse().map_err(|e| format!("block_size: {e}"))?);
                }
                "tokenizer" => m.tokenizer = Some(v.to_owned()),
                _ => return Err(format!("unknown model key {k:?} (block_size, tokenizer)")),
            }
        }
        m.check().map_err(|e| e.to_string())?;
        Ok(m)
    }

    fn check(&self) -> Result<()> {
        if self.name.is_empty() {
            bail!("a model needs a name");
        }
        if self.block_size == Some(0) {
            bail!("model {:?}: block_size must be above 0", self.name);
        }
        Ok(())
    }
}

impl WorkerEntry {
    /// `--worker id=1,url=http://gpu-1:8000,model=NAME,role=prefill,zmq=tcp://gpu-1:5557,
    /// replay=tcp://gpu-1:5558,topic=T,dp_ranks=0:1,api_key=KEY` (`id` required; `dp_ranks`
    /// separated by `:`), or for TensorRT-LLM `--worker id=1,url=http://ctx-1:8000,
    /// events=trtllm,poll_ms=100`. vLLM's `kv_events_config` JSON is for the config file.
    pub fn from_spec(spec: &str) -> Result<Self, String> {
        let mut w = WorkerEntry::default();
        let mut id = None;
        for (k, v) in spec_pairs(spec)? {
            let some = || Some(v.to_owned());
            match k {
                "id" => id = Some(v.parse::<u64>().map_err(|e| format!("id: {e}"))?),
                "url" => w.url = some(),
                "model" => w.model = some(),
                "role" => w.role = some(),
                "zmq" => w.zmq = some(),
                "replay" => w.replay = some(),
                "api_key" => w.api_key = some(),
                "topic" => w.topic = some(),
                "events" => w.events = some(),
                "poll_ms" => w.poll_ms = Some(v.parse().map_err(|e| format!("poll_ms: {e}"))?),
                "dp_ranks" => {
                    w.dp_ranks = v
                        .split(':')
                        .map(|r| r.parse::<u32>().map_err(|e| format!("dp_ranks: {e}")))
                        .collect::<Result<_, _>>()?;
                }
                _ => {
                    return Err(format!(
                        "unknown worker key {k:?} (id, url, model, role, zmq, replay, \
                         topic, events, poll_ms, dp_ranks, api_key)"
                    ));
                }
            }
        }
        w.id = id.ok_or("a worker needs id=N")?;
        w.check().map_err(|e| e.to_string())?;
        Ok(w)
    }
}

/// A parsed file.
#[derive(Debug, Default)]
pub struct ConfigFile {
    /// `KVENGINE_*` variable -> value.
    pub settings: BTreeMap<String, String>,
    /// The workers, in file order.
    pub workers: Vec<WorkerEntry>,
    /// The served models, in file order.
    pub models: Vec<ModelEntry>,
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
    #[serde(default)]
    topic: Option<String>,
}

impl WorkerEntry {
    /// Checks the addresses' shape (a bare `http[s]://HOST[:PORT][/PREFIX]` URL, `tcp://HOST:PORT`
    /// endpoints: [`transport::outbound::addr`]) and the event source.
    fn check(&self) -> Result<()> {
        if let Some(url) = &self.url {
            transport::outbound::WorkerUrl::parse(url)
                .map_err(|e| anyhow::anyhow!("worker {}: url {e}", self.id))?;
        }
        self.trtllm_source()?;
        if let Some((zmq, replay)) = self.endpoints()? {
            transport::zmq::ZmqSource::new(engine::WorkerId(self.id), &zmq, replay.as_deref())
                .with_context(|| format!("worker {}", self.id))?;
        }
        Ok(())
    }

    /// Whether its events come from TensorRT-LLM's `/kv_cache_events`.
    pub fn is_trtllm(&self) -> bool {
        self.events.as_deref() == Some("trtllm")
    }

    /// With `events = "trtllm"`: where and how often its events are polled. `None` for ZMQ
    /// workers.
    pub fn trtllm_source(&self) -> Result<Option<transport::trtllm::TrtllmSource>> {
        match self.events.as_deref() {
            None | Some("zmq") => {
                if self.poll_ms.is_some() {
                    bail!("worker {}: poll_ms is for events = \"trtllm\"", self.id);
                }
                Ok(None)
            }
            Some("trtllm") => {
                if self.zmq.is_some() || self.replay.is_some() || self.kv_events_config.is_some() {
                    bail!(
                        "worker {}: events = \"trtllm\" polls the worker's url; it takes no \
                         zmq, replay or kv_events_config",
                        self.id
                    );
                }
                let Some(url) = &self.url else {
                    bail!(
                        "worker {}: events = \"trtllm\" needs the worker's url (trtllm-serve)",
                        self.id
                    );
                };
                let interval = self.poll_ms.map_or(
                    transport::trtllm::DEFAULT_POLL_INTERVAL,
                    Duration::from_millis,
                );
                let source =
                    transport::trtllm::TrtllmSource::new(engine::WorkerId(self.id), url, interval)
                        .with_context(|| format!("worker {}", self.id))?;
                Ok(Some(source))
            }
            Some(other) => bail!(
                "worker {}: events = {other:?}: expected \"zmq\" or \"trtllm\"",
                self.id
            ),
        }
    }

    /// The topic to subscribe to: `topic`, else `kv_events_config`'s, else `""` (every
    /// message).
    pub fn topic(&self) -> Result<String> {
        if let Some(t) = &self.topic {
            return Ok(t.clone());
        }
        let Some(json) = &self.kv_events_config else {
            return Ok(String::new());
        };
        let cfg: KvEventsConfig = serde_json::from_str(json)
            .with_context(|| format!("worker {}: kv_events_config is not JSON", self.id))?;
        Ok(cfg.topic.unwrap_or_default())
    }

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
        let host = self
            .url
            .as_deref()
            .and_then(|u| transport::outbound::WorkerUrl::parse(u).ok())
            .map(|u| u.host().to_string());
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

/// The `KVENGINE_*` variable of each long flag of `kvengine serve`, under its long name and
/// under each of its aliases (a former name, e.g. `hub-fanout`, or Dynamo's).
fn flag_envs() -> BTreeMap<String, String> {
    let cmd = crate::Cli::command();
    let mut out = BTreeMap::new();
    for a in cmd.get_arguments() {
        let (Some(long), Some(env)) = (a.get_long(), a.get_env().and_then(|e| e.to_str())) else {
            continue;
        };
        for name in std::iter::once(long).chain(a.get_all_aliases().unwrap_or_default()) {
            out.insert(name.to_owned(), env.to_owned());
        }
    }
    out
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
        if key == "models" {
            out.models = value
                .try_into()
                .with_context(|| format!("{}: [[models]]", path.display()))?;
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
             e.g. router-mode, or [[workers]] and [[models]])",
            path.display()
        );
    }
    check(&out.workers, &out.models).with_context(|| path.display().to_string())?;
    Ok(out)
}

/// Workers and models that agree: ids and names listed once, every named model listed
/// (when any is: a typo would otherwise make a pool of its own).
pub fn check(workers: &[WorkerEntry], models: &[ModelEntry]) -> Result<()> {
    let mut names = std::collections::BTreeSet::new();
    for m in models {
        m.check()?;
        if !names.insert(m.name.as_str()) {
            bail!("model {:?} is listed twice", m.name);
        }
    }
    let mut ids = std::collections::BTreeSet::new();
    for w in workers {
        if !ids.insert(w.id) {
            bail!("worker {} is listed twice", w.id);
        }
        w.check()?;
        if let Some(m) = &w.model
            && !models.is_empty()
            && !names.contains(m.as_str())
        {
            bail!(
                "worker {}: model {m:?} is not one of the models {names:?}",
                w.id
            );
        }
    }
    Ok(())
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
    fn cli_specs_give_whole_workers_and_models() {
        let w = WorkerEntry::from_spec(
            "id=4,url=http://gpu-4:8000,model=qwen,role=prefill,zmq=tcp://gpu-4:5557,\
             replay=tcp://gpu-4:5558,topic=kv,dp_ranks=0:1,api_key=k",
        )
        .unwrap();
        assert_eq!(
            w,
            WorkerEntry {
                id: 4,
                url: Some("http://gpu-4:8000".into()),
                zmq: Some("tcp://gpu-4:5557".into()),
                replay: Some("tcp://gpu-4:5558".into()),
                kv_events_config: None,
                dp_ranks: vec![0, 1],
                role: Some("prefill".into()),
                api_key: Some("k".into()),
                model: Some("qwen".into()),
                topic: Some("kv".into()),
                events: None,
                poll_ms: None,
            }
        );
        assert_eq!(w.topic().unwrap(), "kv");
        assert_eq!(w.trtllm_source().unwrap(), None);
        let t =
            WorkerEntry::from_spec("id=5,url=http://ctx-0:8000,events=trtllm,poll_ms=250").unwrap();
        assert!(t.is_trtllm());
        let source = t.trtllm_source().unwrap().unwrap();
        assert_eq!(source.events_url(), "http://ctx-0:8000/kv_cache_events");
        assert_eq!(source.poll_interval, std::time::Duration::from_millis(250));
        for bad in [
            "id=5,events=trtllm",
            "id=5,url=http://ctx-0:8000,events=trtllm,zmq=tcp://ctx-0:5557",
            "id=5,url=http://ctx-0:8000,events=nats",
            "id=5,url=http://ctx-0:8000,poll_ms=10",
            "id=5,url=http://ctx-0:8000,events=trtllm,poll_ms=0",
            "id=5,url=ctx-0:8000,events=trtllm",
        ] {
            assert!(WorkerEntry::from_spec(bad).is_err(), "{bad:?} accepted");
        }
        for bad in [
            "url=http://a:1",
            "id=x",
            "id=1,colour=red",
            "id=1,zmq=udp://a:1",
            "id=1,url=http://169.254.169.254#@gpu-1",
            "id=1,url=http://gpu-1@169.254.169.254",
            "id=1,url=http://gpu-1?x",
            "id=1,url=ftp://gpu-1",
            "id=1,zmq=tcp://gpu-1@169.254.169.254:5557",
            "id",
        ] {
            assert!(WorkerEntry::from_spec(bad).is_err(), "{bad:?} accepted");
        }
        let m = ModelEntry::from_spec("qwen,block_size=32,tokenizer=stand-in").unwrap();
        assert_eq!(
            (m.name.as_str(), m.block_size, m.tokenizer.as_deref()),
            ("qwen", Some(32), Some("stand-in"))
        );
        assert_eq!(ModelEntry::from_spec("plain").unwrap().block_size, None);
        for bad in [
            "",
            ",block_size=16",
            "m,block_size=0",
            "m,block_size=x",
            "m,size=1",
        ] {
            assert!(ModelEntry::from_spec(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn workers_must_name_listed_models() {
        let model = |n: &str| ModelEntry {
            name: n.into(),
            ..ModelEntry::default()
        };
        let worker = |id, m: Option<&str>| WorkerEntry {
            id,
            model: m.map(str::to_owned),
            ..WorkerEntry::default()
        };
        check(&[worker(1, Some("a")), worker(2, None)], &[model("a")]).unwrap();
        // No [[models]]: a worker's model names its own pool.
        check(&[worker(1, Some("b"))], &[]).unwrap();
        assert!(check(&[worker(1, Some("typo"))], &[model("a")]).is_err());
        assert!(check(&[], &[model("a"), model("a")]).is_err());
        assert!(check(&[worker(1, None), worker(1, None)], &[]).is_err());
    }

    #[test]
    fn the_topic_comes_from_kv_events_config() {
        let w = WorkerEntry {
            id: 1,
            url: Some("http://h:1".into()),
            kv_events_config: Some(
                r#"{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events"}"#.into(),
            ),
            ..WorkerEntry::default()
        };
        assert_eq!(w.topic().unwrap(), "kv-events");
        assert_eq!(WorkerEntry::default().topic().unwrap(), "");
    }

    #[test]
    fn every_flag_with_a_variable_is_a_setting() {
        let envs = flag_envs();
        assert_eq!(envs["router-mode"], "KVENGINE_ROUTER_MODE");
        assert_eq!(envs["zmq-worker"], "KVENGINE_ZMQ_WORKERS");
        assert_eq!(envs["admin-token"], "KVENGINE_ADMIN_TOKEN");
        // A renamed flag's former name is still a setting, of the same variable.
        assert_eq!(envs["junction-fanout"], "KVENGINE_JUNCTION_FANOUT");
        assert_eq!(envs["hub-fanout"], "KVENGINE_JUNCTION_FANOUT");
    }
}
