//! `--trtllm-worker ID=http[s]://HOST:PORT[,poll_ms=N]`: where one TensorRT-LLM worker's
//! KV events are polled, and how often. The URL is a [`WorkerUrl`] with a port and no path.

use crate::error::TransportError;
use crate::outbound::WorkerUrl;
use engine::WorkerId;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// The poll interval when none is given: events reach the index within about this long
/// even when no request finishes on the worker (each finished request polls at once).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(100);

/// The shortest and longest poll intervals accepted.
pub const POLL_INTERVAL_RANGE: std::ops::RangeInclusive<Duration> =
    Duration::from_millis(1)..=Duration::from_secs(60);

/// One TensorRT-LLM worker's event source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrtllmSource {
    /// The worker.
    pub worker: WorkerId,
    /// `trtllm-serve`'s base URL (`http[s]://host:port`); events are at
    /// `{url}/kv_cache_events`.
    pub url: WorkerUrl,
    /// How often it is polled when no request finishing there asks for a poll first.
    pub poll_interval: Duration,
}

fn invalid(reason: String) -> TransportError {
    TransportError::Invalid {
        name: "--trtllm-worker",
        reason,
    }
}

impl TrtllmSource {
    /// A source from parts, checking the URL's shape (`http[s]://HOST:PORT`, no path) and
    /// the interval's range.
    pub fn new(
        worker: WorkerId,
        url: &str,
        poll_interval: Duration,
    ) -> Result<Self, TransportError> {
        let url = WorkerUrl::parse(url).map_err(|e| invalid(e.to_string()))?;
        if url.port().is_none() || !url.path().is_empty() {
            return Err(invalid(format!(
                "{url:?} is not http[s]://HOST:PORT",
                url = url.as_str()
            )));
        }
        if !POLL_INTERVAL_RANGE.contains(&poll_interval) {
            return Err(invalid(format!(
                "poll interval {poll_interval:?} is outside 1 ms..=60 s"
            )));
        }
        Ok(Self {
            worker,
            url,
            poll_interval,
        })
    }

    /// The URL polled: `{url}/kv_cache_events`.
    pub fn events_url(&self) -> String {
        format!("{}/kv_cache_events", self.url)
    }
}

impl FromStr for TrtllmSource {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (id, rest) = s.split_once('=').ok_or_else(|| {
            invalid(format!(
                "{s:?}: expected ID=http[s]://HOST:PORT[,poll_ms=N]"
            ))
        })?;
        let worker = id
            .trim()
            .parse::<u64>()
            .map_err(|_| invalid(format!("{id:?} is not a worker id (u64)")))?;
        let mut parts = rest.split(',');
        let url = parts.next().unwrap_or_default();
        let mut interval = None;
        for p in parts {
            match p.split_once('=') {
                Some(("poll_ms", ms)) if interval.is_none() => {
                    let ms = ms
                        .parse::<u64>()
                        .map_err(|_| invalid(format!("poll_ms {ms:?} is not a number")))?;
                    interval = Some(Duration::from_millis(ms));
                }
                _ => return Err(invalid(format!("unexpected {p:?} (only poll_ms=N)"))),
            }
        }
        Self::new(
            WorkerId(worker),
            url,
            interval.unwrap_or(DEFAULT_POLL_INTERVAL),
        )
    }
}

impl fmt::Display for TrtllmSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={},poll_ms={}",
            self.worker,
            self.url,
            self.poll_interval.as_millis()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_flag_forms() {
        let s: TrtllmSource = "3=http://ctx-0:8000".parse().unwrap();
        assert_eq!(s.worker, WorkerId(3));
        assert_eq!(s.url.as_str(), "http://ctx-0:8000");
        assert_eq!(s.poll_interval, DEFAULT_POLL_INTERVAL);
        assert_eq!(s.events_url(), "http://ctx-0:8000/kv_cache_events");
        let s: TrtllmSource = "4=http://10.0.0.4:8001/,poll_ms=250".parse().unwrap();
        assert_eq!(s.url.as_str(), "http://10.0.0.4:8001");
        assert_eq!(s.poll_interval, Duration::from_millis(250));
        assert_eq!(s.to_string(), "4=http://10.0.0.4:8001,poll_ms=250");
        assert_eq!(s.to_string().parse::<TrtllmSource>().unwrap(), s);
        let s: TrtllmSource = "5=https://ctx-1:8443".parse().unwrap();
        assert_eq!(s.events_url(), "https://ctx-1:8443/kv_cache_events");
    }

    #[test]
    fn refuses_malformed_flags() {
        for bad in [
            "",
            "3",
            "x=http://a:1",
            "3=tcp://a:1",
            "3=http://a:1#@b",
            "3=http://b@a:1",
            "3=http://a",
            "3=http://:1",
            "3=http://a:1/v1",
            "3=http://a:99999",
            "3=http://a:1,poll_ms=0",
            "3=http://a:1,poll_ms=61000",
            "3=http://a:1,poll_ms=x",
            "3=http://a:1,poll_ms=5,poll_ms=6",
            "3=http://a:1,replay=http://b:2",
        ] {
            assert!(bad.parse::<TrtllmSource>().is_err(), "{bad:?} accepted");
        }
    }
}
