//! SGLang's PD hand-off.
//!
//! Both requests carry the same `bootstrap_host` (the prefill worker's host),
//! `bootstrap_port` (its `--disaggregation-bootstrap-port`) and `bootstrap_room` (a random
//! number below 2^63) and go out together: the decode worker waits in the room for the
//! prefill worker's blocks. The client gets the decode worker's answer; the prefill answer
//! is read only for its usage (and asked for unstreamed, to be read whole).

use super::handoff::{Body, Handoff, Pair, not_streamed};
use serde_json::{Value, json};

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub struct Sglang;

fn with_bootstrap(mut b: Body, pair: &Pair) -> Body {
    b.insert("bootstrap_host".into(), json!(pair.prefill_host));
    b.insert("bootstrap_port".into(), json!(pair.bootstrap_port));
    b.insert("bootstrap_room".into(), json!(pair.room));
    b
}

impl Handoff for Sglang {
    fn concurrent(&self) -> bool {
        true
    }

    fn prefill_body(&self, client: &Body, pair: &Pair) -> Body {
        with_bootstrap(not_streamed(client), pair)
    }

    fn decode_body(
        &self,
        client: &Body,
        pair: &Pair,
        _prefill_answer: Option<&Value>,
    ) -> Result<Body, String> {
        Ok(with_bootstrap(client.clone(), pair))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_halves_name_the_same_room() {
        let client: Body = serde_json::from_str(r#"{"prompt":"x","stream":true}"#).unwrap();
        let pair = Pair {
            prefill_host: "10.0.0.7".into(),
            bootstrap_port: 8998,
            room: (1 << 62) + 5,
        };
        let p = Sglang.prefill_body(&client, &pair);
        let d = Sglang.decode_body(&client, &pair, None).unwrap();
        for k in ["bootstrap_host", "bootstrap_port", "bootstrap_room"] {
            assert_eq!(p[k], d[k], "{k}");
        }
        assert_eq!(d["bootstrap_room"], json!((1u64 << 62) + 5));
        assert_eq!(
            (p["stream"].clone(), d["stream"].clone()),
            (json!(false), json!(true))
        );
    }
}
