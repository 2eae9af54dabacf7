//! vLLM's KV-connector hand-off (NixlConnector and friends).
//!
//! The prefill request asks for one token with `kv_transfer_params.do_remote_decode: true`;
//! the prefill worker keeps the blocks and answers with a top-level `kv_transfer_params`
//! (`remote_engine_id`, `remote_block_ids`, `remote_host`, `remote_port`, ...), which the
//! front door passes unchanged to the decode worker in the client's body. The decode worker
//! pulls the blocks it lacks and generates.

use super::handoff::{Body, Handoff, Pair, one_token};
use serde_json::{Value, json};

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub struct Vllm;

impl Handoff for Vllm {
    fn prefill_body(&self, client: &Body, _pair: &Pair) -> Body {
        let mut b = one_token(client);
        b.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }),
        );
        b
    }

    fn decode_body(
        &self,
        client: &Body,
        _pair: &Pair,
        prefill_answer: Option<&Value>,
    ) -> Result<Body, String> {
        let params = prefill_answer
            .and_then(|a| a.get("kv_transfer_params"))
            .filter(|p| p.is_object())
            .ok_or(
                "the prefill answer has no kv_transfer_params (is the worker started with a KV \
                 connector, and did it stop on its token limit?)",
            )?;
        let mut b = client.clone();
        b.insert("kv_transfer_params".into(), params.clone());
        Ok(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::openai::disagg::handoff::test_pair as pair;

    #[test]
    fn params_go_out_and_come_back_unchanged() {
        let client: Body =
            serde_json::from_str(r#"{"prompt":"x","stream":true,"max_tokens":9}"#).unwrap();
        let p = Vllm.prefill_body(&client, &pair());
        assert_eq!(p["kv_transfer_params"]["do_remote_decode"], json!(true));
        assert_eq!(p["max_tokens"], json!(1));
        let answer = json!({"choices": [], "kv_transfer_params": {
            "do_remote_prefill": true, "remote_engine_id": "e", "remote_block_ids": [[1, 2]],
            "remote_host": "h", "remote_port": 5600, "remote_request_id": "r"}});
        let d = Vllm.decode_body(&client, &pair(), Some(&answer)).unwrap();
        assert_eq!(d["kv_transfer_params"], answer["kv_transfer_params"]);
        assert_eq!(
            (d["stream"].clone(), d["max_tokens"].clone()),
            (json!(true), json!(9))
        );
        let err = Vllm
            .decode_body(&client, &pair(), Some(&json!({"kv_transfer_params": null})))
            .unwrap_err();
        assert!(err.contains("KV connector"));
    }
}
