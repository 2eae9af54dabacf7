//! `--zmq-worker ID=tcp://HOST:PORT[,replay=tcp://HOST:PORT]`: one worker's endpoints.

use crate::error::TransportError;
use crate::outbound::ZmqEndpoint;
use engine::WorkerId;
use std::fmt;
use std::str::FromStr;

/// Where one worker publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZmqSource {
    /// The worker.
    pub worker: WorkerId,
    /// Its PUB endpoint (a canonical `tcp://host:port`, [`ZmqEndpoint`]).
    pub publisher: String,
    /// Its replay (ROUTER) endpoint, if it has one (canonical too).
    pub replay: Option<String>,
    /// The topic prefix subscribed to (vLLM's `--kv-events-config` `topic`; `""`: every
    /// message the publisher sends).
    pub topic: String,
}

/// `s` as a canonical `tcp://host:port` ([`ZmqEndpoint`]: no userinfo, path or anything
/// else; `ipc://`, `inproc://` and the bind-only `tcp://*:port` are refused).
fn check_endpoint(s: &str, what: &'static str) -> Result<String, TransportError> {
    ZmqEndpoint::parse(s)
        .map(|e| e.as_str().to_owned())
        .map_err(|e| TransportError::Invalid {
            name: what,
            reason: e.to_string(),
        })
}

impl ZmqSource {
    /// A source from parts, checking the endpoints' shape.
    pub fn new(
        worker: WorkerId,
        publisher: &str,
        replay: Option<&str>,
    ) -> Result<Self, TransportError> {
        Ok(Self {
            worker,
            publisher: check_endpoint(publisher, "zmq endpoint")?,
            replay: replay
                .map(|r| check_endpoint(r, "replay endpoint"))
                .transpose()?,
            topic: String::new(),
        })
    }

    /// The source subscribed to `topic` only.
    pub fn with_topic(self, topic: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            ..self
        }
    }
}

impl FromStr for ZmqSource {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason: String| TransportError::Invalid {
            name: "--zmq-worker",
            reason,
        };
        let (id, rest) = s
            .split_once('=')
            .ok_or_else(|| invalid(format!("{s:?}: expected ID=tcp://HOST:PORT[,replay=...]")))?;
        let worker = id
            .trim()
            .parse::<u64>()
            .map_err(|_| invalid(format!("{id:?} is not a worker id (u64)")))?;
        let mut parts = rest.split(',');
        let publisher = parts.next().unwrap_or_default();
        let (mut replay, mut topic) = (None, None);
        for p in parts {
            match p.split_once('=') {
                Some(("replay", r)) if replay.is_none() => replay = Some(r),
                Some(("topic", t)) if topic.is_none() => topic = Some(t),
                _ => {
                    return Err(invalid(format!(
                        "unexpected {p:?} (only replay=... and topic=...)"
                    )));
                }
            }
        }
        Ok(Self::new(WorkerId(worker), publisher, replay)?.with_topic(topic.unwrap_or_default()))
    }
}

impl fmt::Display for ZmqSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.worker, self.publisher)?;
        if let Some(r) = &self.replay {
            write!(f, ",replay={r}")?;
        }
        if !self.topic.is_empty() {
            write!(f, ",topic={}", self.topic)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_flag_forms() {
        let s: ZmqSource = "7=tcp://10.0.0.5:5557".parse().unwrap();
        assert_eq!(s.worker, WorkerId(7));
        assert_eq!(s.publisher, "tcp://10.0.0.5:5557");
        assert_eq!(s.replay, None);
        let s: ZmqSource = "8=tcp://gpu-3:5557,replay=tcp://gpu-3:5558"
            .parse()
            .unwrap();
        assert_eq!(s.replay.as_deref(), Some("tcp://gpu-3:5558"));
        assert_eq!(s.to_string(), "8=tcp://gpu-3:5557,replay=tcp://gpu-3:5558");
        assert_eq!(s.topic, "");
        let s: ZmqSource = "9=tcp://gpu-3:5557,topic=kv-events".parse().unwrap();
        assert_eq!(s.topic, "kv-events");
        assert_eq!(s.to_string(), "9=tcp://gpu-3:5557,topic=kv-events");
    }

    #[test]
    fn refuses_malformed_flags() {
        for bad in [
            "",
            "7",
            "x=tcp://a:1",
            "7=udp://a:1",
            "7=tcp://a",
            "7=tcp://:1",
            "7=tcp://a:99999",
            "7=tcp://a:1,replay=http://b:2",
            "7=tcp://a:1,foo=tcp://b:2",
            "7=tcp://a:1,replay=tcp://b:2,replay=tcp://b:3",
            "7=tcp://a:1,topic=a,topic=b",
            "7=tcp://b@a:1",
            "7=tcp://a:1#@b",
            "7=tcp://*:1",
            "7=ipc:///tmp/x",
            "7=inproc://x",
        ] {
            assert!(bad.parse::<ZmqSource>().is_err(), "{bad:?} accepted");
        }
    }
}
