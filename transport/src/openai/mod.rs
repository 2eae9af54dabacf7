//! kvengine's OpenAI-compatible front door (`/v1/chat/completions`, `/v1/completions`).
//!
//! To route an OpenAI request by KV-cache overlap, kvengine must know the token ids the
//! engine will compute for it: [`tokenize`] reproduces vLLM's prompt processing (chat
//! template rendering and Hugging Face tokenization) from the model's tokenizer files, or
//! uses a built-in stand-in ([`fallback`]) shared with the simulated workers. [`proxy`]
//! routes each request and streams the chosen worker's answer back;
//! [`disagg`] splits it between a prefill and a decode worker where the deployment has both.
//!
//! Layers, each using only those below it: [`proxy`] (the routes and handlers) above
//! [`disagg`] (the two-worker flow), above `forward` (sending to a worker and the one retry,
//! which both use), above `config` (the settings, public as
//! [`proxy::ProxyConfig`] and [`disagg::DisaggConfig`]).

mod attribution;
mod config;
pub mod disagg;
pub mod fallback;
mod forward;
pub mod headers;
pub mod openai_error;
pub mod proxy;
mod relay;
pub mod request_prompt;
mod sse;
pub mod tokenize;
mod usage;
