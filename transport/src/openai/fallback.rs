//! The built-in stand-in tokenizer, for routers and simulated workers run without a model's
//! tokenizer files (`--tokenizer`): deterministic, and the same on both sides, so prefix hits
//! line up. It is not a real model's tokenization: with real workers, give kvengine the
//! model's tokenizer.
//!
//! Text is split on whitespace and each word becomes `xxh3_64(word) % 32000 + 1000`. A chat
//! is first rendered as one line per message, `"<|{role}|> {content}\n"` (content parts'
//! texts joined with a space), then tokenized the same way.

use super::tokenize::{ChatMessage, MessageContent};
use xxhash_rust::xxh3::xxh3_64;

/// Token id of one word.
pub fn word_token(word: &str) -> u32 {
    word_bytes_token(word.as_bytes())
}

/// Token ids of a text: its words as `str::split_whitespace` splits it.
pub fn text_token_ids(text: &str) -> Vec<u32> {
    if text.is_ascii() {
        ascii_token_ids(text.as_bytes())
    } else {
        text.split_whitespace().map(word_token).collect()
    }
}

/// [`text_token_ids`] of an ASCII text, split byte by byte: the same words as
/// `split_whitespace` (for ASCII, `char::is_whitespace` is space and `\t` to `\r`,
/// vertical tab included) without decoding a `char` per byte. A Mooncake prompt is ~70 KB
/// of words, tokenized on the core thread per request (docs/benchmarks.md, issue 31).
fn ascii_token_ids(text: &[u8]) -> Vec<u32> {
    text.split(|&b| b == b' ' || (b'\t'..=b'\r').contains(&b))
        .filter(|word| !word.is_empty())
        .map(word_bytes_token)
        .collect()
}

/// [`word_token`] of a word's bytes.
fn word_bytes_token(word: &[u8]) -> u32 {
    (xxh3_64(word) % 32_000) as u32 + 1_000
}

/// The text a chat is rendered to before tokenizing.
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|");
        out.push_str(&m.role);
        out.push_str("|> ");
        match &m.content {
            MessageContent::Text(t) => out.push_str(t),
            MessageContent::Parts(parts) => {
                let texts: Vec<&str> = parts.iter().filter_map(|p| p.text.as_deref()).collect();
                out.push_str(&texts.join(" "));
            }
            MessageContent::Null => {}
        }
        out.push('\n');
    }
    out
}

/// Token ids of a chat.
pub fn chat_token_ids(messages: &[ChatMessage]) -> Vec<u32> {
    text_token_ids(&render_chat(messages))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The ASCII path splits exactly as `split_whitespace` does (the reference), on
        /// texts of words, every ASCII whitespace byte and a few non-ASCII spaces and
        /// letters (which take the `char` path).
        #[test]
        fn ascii_split_is_split_whitespace(
            parts in proptest::collection::vec(
                prop_oneof![
                    Just(" "), Just("\t"), Just("\n"), Just("\x0b"), Just("\x0c"), Just("\r"),
                    Just("\u{a0}"), Just("\u{2003}"), Just("\u{85}"), Just("é"), Just("\x1f"),
                    Just("w"), Just("word"), Just("<|user|>"), Just("0"),
                ],
                0..40,
            )
        ) {
            let text: String = parts.concat();
            let reference: Vec<u32> = text.split_whitespace().map(word_token).collect();
            prop_assert_eq!(text_token_ids(&text), reference.clone());
            if text.is_ascii() {
                prop_assert_eq!(ascii_token_ids(text.as_bytes()), reference);
            }
        }
    }

    #[test]
    fn words_map_to_stable_ids_in_range() {
        let a = text_token_ids("hello  world\thello\n");
        assert_eq!(a.len(), 3);
        assert_eq!(a[0], a[2]);
        assert!(a.iter().all(|&t| (1_000..33_000).contains(&t)));
        assert_eq!(text_token_ids("hello world"), a[..2]);
    }

    #[test]
    fn chats_sharing_a_system_prompt_share_a_prefix() {
        let sys = ChatMessage::text("system", "you are a careful assistant");
        let a = chat_token_ids(&[sys.clone(), ChatMessage::text("user", "hi there")]);
        let b = chat_token_ids(&[sys, ChatMessage::text("user", "what is rust")]);
        assert_eq!(
            render_chat(&[ChatMessage::text("user", "hi")]),
            "<|user|> hi\n"
        );
        assert_eq!(a[..6], b[..6]);
        assert_ne!(a[6..], b[6..]);
    }
}
