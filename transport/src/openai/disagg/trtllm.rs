//! TensorRT-LLM's (`trtllm-serve`) hand-off.
//!
//! The context request carries `disaggregated_params: {"request_type": "context_only"}`
//! and is not streamed; the context server answers with `choices[0].disaggregated_params`
//! (`first_gen_tokens`, `ctx_request_id`, `encoded_opaque_state`, ...). The generation
//! request is the client's body with those parameters, `request_type` set to
//! `generation_only`. A context answer that already finished the request (its
//! `finish_reason` is neither `length` nor `not_finished`) is the client's answer (as SSE
//! for a streaming client).

use super::handoff::{Body, Handoff, Pair, not_streamed};
use serde_json::{Value, json};

/// See the module docs.
#[derive(Clone, Copy, Debug)]
pub struct Trtllm;

fn first_choice(answer: &Value) -> Option<&Value> {
    answer.get("choices").and_then(|c| c.get(0))
}

impl Handoff for Trtllm {
    fn prefill_body(&self, client: &Body, _pair: &Pair) -> Body {
        let mut b = not_streamed(client);
        b.insert(
            "disaggregated_params".into(),
            json!({"request_type": "context_only"}),
        );
        b
    }

    fn decode_body(
        &self,
        client: &Body,
        _pair: &Pair,
        prefill_answer: Option<&Value>,
    ) -> Result<Body, String> {
        let mut params = prefill_answer
            .and_then(first_choice)
            .and_then(|c| c.get("disaggregated_params"))
            .and_then(Value::as_object)
            .cloned()
            .ok_or("the context answer has no choices[0].disaggregated_params")?;
        params.insert("request_type".into(), json!("generation_only"));
        let mut b = client.clone();
        b.insert("disaggregated_params".into(), Value::Object(params));
        if let Some(ids) = prefill_answer
            .and_then(|a| a.get("prompt_token_ids"))
            .filter(|v| v.is_array())
        {
            b.insert("prompt_token_ids".into(), ids.clone());
        }
        Ok(b)
    }

    fn finished_in_prefill(&self, prefill_answer: &Value) -> bool {
        match first_choice(prefill_answer)
            .and_then(|c| c.get("finish_reason"))
            .and_then(Value::as_str)
        {
            Some("length" | "not_finished") | None => false,
            Some(_) => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::openai::disagg::handoff::test_pair as pair;

    #[test]
    fn context_then_generation() {
        let client: Body = serde_json::from_str(r#"{"prompt":"x","stream":true}"#).unwrap();
        let c = Trtllm.prefill_body(&client, &pair());
        assert_eq!(
            c["disaggregated_params"]["request_type"],
            json!("context_only")
        );
        assert_eq!(c["stream"], json!(false));
        let answer = json!({"choices": [{"finish_reason": "length", "disaggregated_params": {
            "request_type": "context_only", "first_gen_tokens": [42], "ctx_request_id": 7,
            "encoded_opaque_state": "aGk="}}]});
        assert!(!Trtllm.finished_in_prefill(&answer));
        let g = Trtllm.decode_body(&client, &pair(), Some(&answer)).unwrap();
        let p = &g["disaggregated_params"];
        assert_eq!(p["request_type"], json!("generation_only"));
        assert_eq!(
            (p["first_gen_tokens"].clone(), p["ctx_request_id"].clone()),
            (json!([42]), json!(7))
        );
        assert_eq!(g["stream"], json!(true));
        assert!(
            Trtllm
                .decode_body(&client, &pair(), Some(&json!({"choices": []})))
                .is_err()
        );
        let stopped = json!({"choices": [{"finish_reason": "stop"}]});
        assert!(Trtllm.finished_in_prefill(&stopped));
    }
}
