//! How the OpenAI front door is set up: [`ProxyConfig`], and in it how it disaggregates
//! ([`DisaggConfig`], [`Protocol`]). Plain settings, read by the proxy (`proxy`), the
//! forwarding it shares with the disaggregated flow (`forward`) and that flow (`disagg`);
//! this module uses none of them, so each can hold a configuration. The public paths are
//! [`crate::openai::proxy::ProxyConfig`] and [`crate::openai::disagg`]'s.

use super::tokenize::PromptTokenizer;
use crate::outbound::Outbound;
use engine::sched::SplitConfig;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

/// How the proxy is set up.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// The tokenizer of models without one of their own (`--tokenizer`); without it the
    /// built-in stand-in ([`crate::openai::fallback`]) is used.
    pub tokenizer: Option<Arc<PromptTokenizer>>,
    /// Per served model, its tokenizer (`[[models]] tokenizer`).
    pub model_tokenizers: std::collections::HashMap<String, Arc<PromptTokenizer>>,
    /// Bodies over this many bytes are refused with 413.
    pub max_body_bytes: usize,
    /// Longest wait for a worker's response headers.
    pub upstream_timeout: Duration,
    /// Disaggregated serving: used when both prefill and decode workers are registered.
    pub disagg: DisaggConfig,
    /// How long a client may take to send a request body once its headers arrived (408).
    pub body_timeout: Duration,
    /// Prompts of more tokens are refused (400 `context_length_exceeded`); `None`: each
    /// model's tokenizer's `model_max_length`, else
    /// [`crate::http::DEFAULT_MAX_PROMPT_TOKENS`].
    pub max_prompt_tokens: Option<usize>,
    /// How workers are reached (TLS trust for `https://` workers: [`crate::outbound`]).
    pub outbound: Outbound,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            tokenizer: None,
            model_tokenizers: std::collections::HashMap::new(),
            max_body_bytes: 64 << 20,
            upstream_timeout: Duration::from_secs(600),
            disagg: DisaggConfig::default(),
            max_prompt_tokens: None,
            body_timeout: crate::http::DEFAULT_BODY_TIMEOUT,
            outbound: Outbound::default(),
        }
    }
}

impl ProxyConfig {
    /// The tokenizer of `model`'s prompts: its own, else the router's.
    pub fn tokenizer_for(&self, model: &str) -> Option<&PromptTokenizer> {
        self.tokenizer_arc_for(model).map(|t| &**t)
    }

    pub(crate) fn tokenizer_arc_for(&self, model: &str) -> Option<&Arc<PromptTokenizer>> {
        self.model_tokenizers.get(model).or(self.tokenizer.as_ref())
    }

    /// The most prompt tokens a request for `model` may carry.
    pub fn prompt_cap(&self, model: &str) -> usize {
        self.max_prompt_tokens.unwrap_or_else(|| {
            self.tokenizer_for(model)
                .and_then(PromptTokenizer::max_length)
                .unwrap_or(crate::http::DEFAULT_MAX_PROMPT_TOKENS)
        })
    }

    /// The cap applied while a body is read, before its model is known: the largest any
    /// model allows.
    pub(crate) fn scan_cap(&self) -> usize {
        self.max_prompt_tokens.unwrap_or_else(|| {
            self.model_tokenizers
                .values()
                .chain(self.tokenizer.as_ref())
                .filter_map(|t| t.max_length())
                .fold(crate::http::DEFAULT_MAX_PROMPT_TOKENS, usize::max)
        })
    }
}

/// The engines' hand-off protocols.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Protocol {
    /// vLLM's KV connectors (NIXL and friends): `kv_transfer_params`.
    #[default]
    Vllm,
    /// SGLang's PD disaggregation: bootstrap host, port and room on both requests.
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`: context-only, then generation-only requests.
    Trtllm,
}

impl Protocol {
    /// The name used in flags.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
            Self::Trtllm => "trtllm",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            "trtllm" | "tensorrt-llm" | "trt-llm" => Ok(Self::Trtllm),
            _ => Err(format!(
                "unknown disaggregation protocol {s:?} (expected vllm, sglang or trtllm)"
            )),
        }
    }
}

/// How the front door disaggregates.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DisaggConfig {
    /// The workers' hand-off protocol.
    pub protocol: Protocol,
    /// When a prefill goes to a prefill worker.
    pub split: SplitConfig,
}
