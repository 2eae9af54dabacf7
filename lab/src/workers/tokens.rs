//! Prompt text to token ids, and output token ids to text.
//!
//! With a model's tokenizer (`--tokenizer PATH`) prompts are tokenized exactly as vLLM does
//! ([`PromptTokenizer`]: chat requests through the chat template, completion text with
//! special tokens). Without one, the built-in stand-in that kvengine's router also uses
//! ([`transport::openai::fallback`]): the text is split on whitespace and each word becomes
//! one token, `xxh3_64(word) % 32000 + 1000`; chat messages are first rendered as one
//! `"<|role|> content\n"` line each.
//!
//! A router only finds prefix hits on a simulated worker if it tokenizes prompts the same
//! way: give kvengine the same `--tokenizer`, or neither.
//!
//! Output tokens are synthetic ids ([`sim::engine::output_token`]); each one is shown as
//! a short word followed by a space ([`token_text`]).

use std::sync::Arc;

use transport::openai::tokenize::PromptTokenizer;

/// How a worker turns prompts into token ids.
#[derive(Clone, Debug, Default)]
pub enum Prompter {
    /// The built-in stand-in shared with kvengine's router (see the module docs).
    #[default]
    Fallback,
    /// A model's tokenizer and chat template, as vLLM uses them.
    Model(Arc<PromptTokenizer>),
}

impl Prompter {
    /// The model's tokenizer, if this worker has one (else the stand-in is used).
    pub fn tokenizer(&self) -> Option<&PromptTokenizer> {
        match self {
            Prompter::Fallback => None,
            Prompter::Model(t) => Some(t),
        }
    }
}

/// Words the synthetic output tokens are shown as.
const WORDS: [&str; 64] = [
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by",
    "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an",
    "had", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
    "been", "if", "more", "when", "will", "would", "who", "so", "no", "cache", "block", "token",
    "prefix", "model", "route", "worker", "engine", "batch", "page", "hit", "miss", "queue",
    "step", "fast", "warm",
];

/// The text of output token `token`: a short word followed by a space.
pub fn token_text(token: u32) -> String {
    let word = WORDS
        .get(token as usize % WORDS.len())
        .copied()
        .unwrap_or("x");
    format!("{word} ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use transport::openai::fallback;

    #[test]
    fn without_a_model_the_worker_reads_prompts_as_the_router_does() {
        use transport::openai::request_prompt::{PromptSource, prompt_token_ids};
        assert!(Prompter::Fallback.tokenizer().is_none());
        let body = br#"{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}"#;
        assert_eq!(
            prompt_token_ids(body, PromptSource::Chat, Prompter::Fallback.tokenizer()).unwrap(),
            fallback::text_token_ids("<|system|> be brief <|user|> hi")
        );
    }

    #[test]
    fn token_text_is_a_word_and_a_space() {
        for t in [0, 1000, 31_999, u32::MAX] {
            let s = token_text(t);
            assert!(s.ends_with(' ') && s.len() > 1);
        }
    }
}
