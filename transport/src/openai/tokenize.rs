//! Prompt tokenization exactly as vLLM's OpenAI server does it, so the router hashes the
//! same token ids into the same KV blocks the engine will hold.
//!
//! - `/v1/completions`: the prompt text is encoded with the model's Hugging Face
//!   `tokenizer.json`, `add_special_tokens = true` by default (the post-processor adds BOS &
//!   co.): [`PromptTokenizer::encode`].
//! - `/v1/chat/completions`: the messages are rewritten as vLLM rewrites them (see
//!   [`ChatMessage`] and the `messages` module docs), rendered with the model's chat template
//!   (Jinja, configured as `transformers` configures it: see the `template` module), and the
//!   text is encoded with `add_special_tokens = false`, since the template writes the special
//!   tokens itself: [`PromptTokenizer::chat_token_ids`].
//!
//! Invariants:
//! - one [`tokenizers::Tokenizer`] and one compiled set of templates per model, built once and
//!   shared by `&self` ([`PromptTokenizer`] is `Send + Sync`); truncation and padding stored in
//!   `tokenizer.json` are switched off, as transformers switches them off for a plain
//!   `encode`;
//! - the same messages and options always give the same text and ids (except through
//!   `strftime_now`, which templates use for today's date);
//! - every failure is a [`TransportError::Invalid`] named `tokenizer` (files that cannot be
//!   read or parsed, encoding failures), `chat_template` (no template, a template that does
//!   not compile, fails to render or calls `raise_exception`) or `chat_message` (content
//!   kvengine cannot tokenize, such as images); nothing panics.
//!
//! Known gaps: `tokenizer_config.json`'s `add_bos_token` / `add_eos_token` overrides (which
//! some transformers tokenizer classes apply on top of `tokenizer.json`) are not applied;
//! multimodal content is refused; tokenizers are built with `fancy-regex` instead of
//! Oniguruma, which agrees on every pre-tokenizer pattern in common use. Objects that reach a
//! template from JSON (`tools`, tool-call arguments) keep their key order only if
//! `serde_json`'s `preserve_order` feature is on in the build; otherwise their keys are sorted
//! where Python would keep the request's order.

mod download;
mod messages;
mod template;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use minijinja::{Environment, Value};
use serde_json::Map;
use tokenizers::Tokenizer;

use crate::error::{Result, TransportError};

pub use download::{DEFAULT_ENDPOINT, DEFAULT_TIMEOUT, HubOptions};
pub use messages::{
    ChatMessage, ContentFormat, ContentPart, MessageContent, detect_content_format,
};

/// The template name used for a plain-string `chat_template`, and the one chosen from the
/// list form when no tools are given.
const DEFAULT_TEMPLATE: &str = "default";
/// The template chosen from the list form when the request carries tools.
const TOOL_USE_TEMPLATE: &str = "tool_use";
/// Special-token keys of `tokenizer_config.json` passed to the template (as transformers'
/// `special_tokens_map`).
const SPECIAL_TOKEN_KEYS: [&str; 8] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
];

/// Options of one chat rendering, the fields of vLLM's chat request that shape the prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatOptions {
    /// Append the assistant header so the model answers (vLLM's default: `true`).
    pub add_generation_prompt: bool,
    /// Leave the final (assistant) message open so the model continues it, as transformers'
    /// `continue_final_message`; incompatible with `add_generation_prompt`.
    pub continue_final_message: bool,
    /// The request's `tools`, passed to the template as `tools` (`None` when absent).
    pub tools: Option<Vec<serde_json::Value>>,
    /// The request's `documents`, passed as `documents` (`None` when absent).
    pub documents: Option<Vec<serde_json::Value>>,
    /// The request's `chat_template_kwargs` (e.g. `enable_thinking`), set as template
    /// variables over the special tokens.
    pub template_kwargs: Map<String, serde_json::Value>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            continue_final_message: false,
            tools: None,
            documents: None,
            template_kwargs: Map::new(),
        }
    }
}

/// One model's tokenizer and chat template. Build once per model, share by reference.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    /// Holds the named chat templates (`default`, `tool_use` …), compiled at construction.
    env: Environment<'static>,
    /// Template name → the content format vLLM's `auto` detection gives it.
    templates: HashMap<String, ContentFormat>,
    /// Overrides the detected content format (vLLM's `--chat-template-content-format`).
    content_format: Option<ContentFormat>,
    /// `bos_token`, `eos_token` … as template variables.
    special_tokens: Vec<(String, Value)>,
    /// The model's longest input, from `tokenizer_config.json`'s `model_max_length` when it
    /// holds a real length (transformers writes 1e30 for "unknown").
    max_length: Option<usize>,
}

impl fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names: Vec<&String> = self.templates.keys().collect();
        names.sort();
        f.debug_struct("PromptTokenizer")
            .field("vocab_size", &self.tokenizer.get_vocab_size(true))
            .field("chat_templates", &names)
            .field("content_format", &self.content_format)
            .finish_non_exhaustive()
    }
}

/// `model_max_length` values above this are transformers' "no limit" sentinel (1e30) or
/// the like, not a length.
const MAX_SANE_MODEL_LENGTH: u64 = 1 << 28;

fn tokenizer_err(reason: String) -> TransportError {
    TransportError::Invalid {
        name: "tokenizer",
        reason,
    }
}

fn template_err(reason: String) -> TransportError {
    TransportError::Invalid {
        name: "chat_template",
        reason,
    }
}

/// A minijinja error with its source chain and, when known, the template line.
fn describe(err: &minijinja::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// `org/name` split in two when `spec` has a repo id's shape (see
/// [`PromptTokenizer::is_repo_id`]); an org starting with `.` is a relative path's look.
fn split_repo_id(spec: &str) -> Option<(&str, &str)> {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    };
    match spec.split_once('/') {
        Some((o, n)) if part_ok(o) && part_ok(n) && !o.starts_with('.') => Some((o, n)),
        _ => None,
    }
}

/// Reads a file that may be absent: `Ok(None)` if it does not exist.
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(tokenizer_err(format!(
            "cannot read {}: {e}",
            path.display()
        ))),
    }
}

impl PromptTokenizer {
    /// Where `spec` names a tokenizer: an existing path as is, else a Hugging Face repo id
    /// (`org/name`) looked up in the local Hugging Face cache under `hf_home` (`HF_HOME`):
    /// `hub/models--org--name/snapshots/<refs/main>` (or its only snapshot). Nothing is
    /// downloaded here: a repo missing from the cache is an error saying how to fetch it
    /// ([`fetch`](Self::fetch) downloads it into the cache).
    pub fn resolve(spec: &str, hf_home: &Path) -> Result<PathBuf> {
        let path = Path::new(spec);
        if path.exists() {
            return Ok(path.to_path_buf());
        }
        let Some((org, name)) = split_repo_id(spec) else {
            return Err(tokenizer_err(format!("{spec}: no such file or directory")));
        };
        let repo = hf_home.join("hub").join(format!("models--{org}--{name}"));
        let snapshots = repo.join("snapshots");
        // `refs/main` names a commit: anything but a plain name (a path) is ignored.
        let by_ref = std::fs::read_to_string(repo.join("refs").join("main"))
            .ok()
            .filter(|h| download::plain_name(h.trim()))
            .map(|h| snapshots.join(h.trim()));
        let only = || {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir(&snapshots)
                .ok()?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.join("tokenizer.json").is_file())
                .collect();
            dirs.sort();
            (dirs.len() == 1).then(|| dirs.remove(0))
        };
        match by_ref
            .filter(|d| d.join("tokenizer.json").is_file())
            .or_else(only)
        {
            Some(dir) => Ok(dir),
            None => Err(tokenizer_err(format!(
                "{spec} is neither a path nor in the Hugging Face cache at {} (fetch it with \
                 `huggingface-cli download {spec} tokenizer.json tokenizer_config.json`, or \
                 pass the tokenizer's directory)",
                repo.display()
            ))),
        }
    }

    /// Whether `spec` has the shape of a Hugging Face repo id (`org/name`, ASCII letters,
    /// digits, `.`, `_`, `-`), the names [`resolve`](Self::resolve) looks up in the cache.
    /// It says nothing about whether such a path exists.
    pub fn is_repo_id(spec: &str) -> bool {
        split_repo_id(spec).is_some()
    }

    /// Loads a model's tokenizer. `path` is a directory holding `tokenizer.json` and
    /// (optionally) `tokenizer_config.json`, or a `tokenizer.json` file (then
    /// `tokenizer_config.json` is looked for beside it). Beside them, as transformers does, a
    /// `chat_template.jinja` replaces the config's default template and a
    /// `special_tokens_map.json` supplies special tokens the config lacks.
    pub fn from_path(path: &Path) -> Result<Self> {
        let (tokenizer_path, dir): (PathBuf, PathBuf) = if path.is_dir() {
            (path.join("tokenizer.json"), path.to_path_buf())
        } else {
            let dir = path
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."));
            (path.to_path_buf(), dir)
        };
        let tokenizer_json = std::fs::read(&tokenizer_path)
            .map_err(|e| tokenizer_err(format!("cannot read {}: {e}", tokenizer_path.display())))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = read_optional(&config_path)?;
        let jinja_path = dir.join("chat_template.jinja");
        let jinja = read_optional(&jinja_path)?
            .map(|b| {
                String::from_utf8(b).map_err(|e| {
                    template_err(format!("{} is not UTF-8: {e}", jinja_path.display()))
                })
            })
            .transpose()?;
        let map_path = dir.join("special_tokens_map.json");
        let special_map = read_optional(&map_path)?;
        Self::build(
            &tokenizer_json,
            &tokenizer_path.display().to_string(),
            config.as_deref(),
            &config_path.display().to_string(),
            jinja,
            special_map.as_deref(),
            &map_path.display().to_string(),
        )
    }

    /// From in-memory file contents (tests, embedded defaults): `tokenizer.json` and,
    /// optionally, `tokenizer_config.json`.
    pub fn from_parts(tokenizer_json: &[u8], tokenizer_config_json: Option<&[u8]>) -> Result<Self> {
        Self::build(
            tokenizer_json,
            "tokenizer.json",
            tokenizer_config_json,
            "tokenizer_config.json",
            None,
            None,
            "special_tokens_map.json",
        )
    }

    fn build(
        tokenizer_json: &[u8],
        tokenizer_origin: &str,
        config: Option<&[u8]>,
        config_origin: &str,
        chat_template_file: Option<String>,
        special_tokens_map: Option<&[u8]>,
        map_origin: &str,
    ) -> Result<Self> {
        let mut tokenizer = Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| tokenizer_err(format!("cannot parse {tokenizer_origin}: {e}")))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| tokenizer_err(format!("{tokenizer_origin}: {e}")))?;
        tokenizer.with_padding(None);

        let parse_object = |bytes: &[u8], origin: &str| -> Result<Map<String, serde_json::Value>> {
            match serde_json::from_slice(bytes) {
                Ok(serde_json::Value::Object(map)) => Ok(map),
                Ok(_) => Err(tokenizer_err(format!("{origin} is not a JSON object"))),
                Err(e) => Err(tokenizer_err(format!("cannot parse {origin}: {e}"))),
            }
        };
        let config = config
            .map(|b| parse_object(b, config_origin))
            .transpose()?
            .unwrap_or_default();
        let special_map = special_tokens_map
            .map(|b| parse_object(b, map_origin))
            .transpose()?
            .unwrap_or_default();

        let mut special_tokens = Vec::new();
        for key in SPECIAL_TOKEN_KEYS {
            let Some(v) = config.get(key).or_else(|| special_map.get(key)) else {
                continue;
            };
            if let Some(token) = special_token_value(v) {
                special_tokens.push((key.to_owned(), token));
            }
        }

        let mut sources: Vec<(String, String)> = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::String(s)) => vec![(DEFAULT_TEMPLATE.to_owned(), s.clone())],
            Some(serde_json::Value::Array(list)) => {
                let mut out = Vec::with_capacity(list.len());
                for item in list {
                    let name = item.get("name").and_then(|n| n.as_str());
                    let template = item.get("template").and_then(|t| t.as_str());
                    match (name, template) {
                        (Some(n), Some(t)) => out.push((n.to_owned(), t.to_owned())),
                        _ => {
                            return Err(tokenizer_err(format!(
                                "{config_origin}: each chat_template entry needs string \
                                 \"name\" and \"template\" fields"
                            )));
                        }
                    }
                }
                out
            }
            Some(_) => {
                return Err(tokenizer_err(format!(
                    "{config_origin}: chat_template must be a string or a list of \
                     {{\"name\", \"template\"}}"
                )));
            }
        };
        if let Some(source) = chat_template_file {
            sources.retain(|(name, _)| name != DEFAULT_TEMPLATE);
            sources.push((DEFAULT_TEMPLATE.to_owned(), source));
        }

        let max_length = config
            .get("model_max_length")
            .and_then(serde_json::Value::as_u64)
            .filter(|&n| n > 0 && n <= MAX_SANE_MODEL_LENGTH)
            .and_then(|n| usize::try_from(n).ok());
        let mut this = PromptTokenizer {
            tokenizer,
            env: template::environment(),
            templates: HashMap::new(),
            content_format: None,
            special_tokens,
            max_length,
        };
        for (name, source) in sources {
            this.add_template(name, source)?;
        }
        Ok(this)
    }

    fn add_template(&mut self, name: String, source: String) -> Result<()> {
        let format = detect_content_format(&source);
        self.env
            .add_template_owned(name.clone(), source)
            .map_err(|e| {
                template_err(format!(
                    "chat template {name:?} does not compile: {}",
                    describe(&e)
                ))
            })?;
        self.templates.insert(name, format);
        Ok(())
    }

    /// Replaces the default chat template, as vLLM's `--chat-template` does.
    pub fn with_chat_template(mut self, source: impl Into<String>) -> Result<Self> {
        self.add_template(DEFAULT_TEMPLATE.to_owned(), source.into())?;
        Ok(self)
    }

    /// Forces the content format instead of detecting it from the template, as vLLM's
    /// `--chat-template-content-format string|openai` does.
    pub fn with_content_format(mut self, format: ContentFormat) -> Self {
        self.content_format = Some(format);
        self
    }

    /// The model's longest input in tokens, if its `tokenizer_config.json` says
    /// (`model_max_length`).
    pub fn max_length(&self) -> Option<usize> {
        self.max_length
    }

    /// Whether a chat template is available (chat requests fail without one).
    pub fn has_chat_template(&self) -> bool {
        !self.templates.is_empty()
    }

    /// The content format the default template is rendered with (`None` without a template).
    pub fn content_format(&self) -> Option<ContentFormat> {
        self.pick_template(false)
            .ok()
            .map(|(_, detected)| self.content_format.unwrap_or(detected))
    }

    /// The underlying Hugging Face tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// transformers' choice: `tool_use` when tools are given and it exists, else `default`,
    /// else the only template there is.
    fn pick_template(&self, with_tools: bool) -> Result<(&str, ContentFormat)> {
        let find = |name: &str| self.templates.get_key_value(name);
        let found = (if with_tools {
            find(TOOL_USE_TEMPLATE)
        } else {
            None
        })
        .or_else(|| find(DEFAULT_TEMPLATE))
        .or_else(|| {
            if self.templates.len() == 1 {
                self.templates.iter().next()
            } else {
                None
            }
        });
        match found {
            Some((name, format)) => Ok((name.as_str(), *format)),
            None if self.templates.is_empty() => Err(template_err(
                "the tokenizer has no chat template (tokenizer_config.json has no \
                 \"chat_template\" and there is no chat_template.jinja): chat requests need \
                 one"
                .to_owned(),
            )),
            None => {
                let mut names: Vec<&String> = self.templates.keys().collect();
                names.sort();
                Err(template_err(format!(
                    "the tokenizer has several chat templates ({names:?}) and none is named \
                     \"default\""
                )))
            }
        }
    }

    /// Renders the chat template with `messages` and `add_generation_prompt`, the special
    /// tokens of `tokenizer_config.json` (`bos_token`, `eos_token` …, given as a string or in
    /// the `{"content": ...}` form) and `tools = None`. The template is the config's
    /// `chat_template` string, or from its list form the one named `default`.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat_with(
            messages,
            &ChatOptions {
                add_generation_prompt,
                ..ChatOptions::default()
            },
        )
    }

    /// Renders the chat template with every option of a chat request (tools, documents,
    /// `chat_template_kwargs`, `continue_final_message`). With tools, the list form's
    /// `tool_use` template is preferred when there is one.
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String> {
        if options.continue_final_message && options.add_generation_prompt {
            return Err(template_err(
                "continue_final_message and add_generation_prompt cannot both be set".to_owned(),
            ));
        }
        let (name, detected) = self.pick_template(options.tools.is_some())?;
        let format = self.content_format.unwrap_or(detected);
        let conversation = messages::template_messages(messages, format)?;

        let optional = |v: &Option<Vec<serde_json::Value>>| {
            v.as_ref()
                .map(Value::from_serialize)
                .unwrap_or(Value::from(()))
        };
        let mut ctx: Vec<(String, Value)> = self.special_tokens.clone();
        ctx.extend(
            options
                .template_kwargs
                .iter()
                .map(|(k, v)| (k.clone(), Value::from_serialize(v))),
        );
        ctx.push(("messages".to_owned(), Value::from(conversation)));
        ctx.push(("tools".to_owned(), optional(&options.tools)));
        ctx.push(("documents".to_owned(), optional(&options.documents)));
        ctx.push((
            "add_generation_prompt".to_owned(),
            Value::from(options.add_generation_prompt),
        ));
        let template = self
            .env
            .get_template(name)
            .map_err(|e| template_err(describe(&e)))?;
        let rendered = template.render(Value::from_iter(ctx)).map_err(|e| {
            template_err(format!("chat template {name:?} failed: {}", describe(&e)))
        })?;
        if options.continue_final_message {
            return continue_final(rendered, messages);
        }
        Ok(rendered)
    }

    /// Token ids of a text prompt. vLLM's completions API encodes with
    /// `add_special_tokens = true` by default (the tokenizer's post-processor adds BOS and
    /// the like); a rendered chat template is encoded with `false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| tokenizer_err(format!("encoding failed: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// What vLLM feeds the engine for a chat request with default options:
    /// `render_chat(messages, true)` encoded with `add_special_tokens = false`.
    pub fn chat_token_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        self.chat_token_ids_with(messages, &ChatOptions::default())
    }

    /// [`render_chat_with`](Self::render_chat_with) encoded with `add_special_tokens = false`.
    pub fn chat_token_ids_with(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<Vec<u32>> {
        let text = self.render_chat_with(messages, options)?;
        self.encode(&text, false)
    }
}

/// A special token from `tokenizer_config.json`: a string, `{"content": "..."}` (an
/// `AddedToken`), or for `additional_special_tokens` a list of either.
fn special_token_value(v: &serde_json::Value) -> Option<Value> {
    match v {
        serde_json::Value::String(s) => Some(Value::from(s.as_str())),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(Value::from),
        serde_json::Value::Array(items) => Some(Value::from(
            items
                .iter()
                .filter_map(special_token_value)
                .collect::<Vec<_>>(),
        )),
        _ => None,
    }
}

/// transformers' `continue_final_message`: cut the rendering right after the final
/// message's text so the model continues it.
fn continue_final(rendered: String, messages: &[ChatMessage]) -> Result<String> {
    let final_text: String = match messages.last().map(|m| &m.content) {
        Some(MessageContent::Text(s)) => s.clone(),
        Some(MessageContent::Parts(parts)) => parts
            .iter()
            .rev()
            .find_map(|p| p.text.clone())
            .ok_or_else(|| {
                template_err(
                    "continue_final_message is set but the final message has no text".to_owned(),
                )
            })?,
        _ => {
            return Err(template_err(
                "continue_final_message is set but there is no final message text".to_owned(),
            ));
        }
    };
    let stripped = final_text.trim();
    let Some(loc) = rendered.rfind(stripped) else {
        return Err(template_err(
            "continue_final_message is set but the final message does not appear in the \
             rendered chat"
                .to_owned(),
        ));
    };
    let lstripped = final_text.trim_start();
    // transformers compares a slice of the lstripped length with the unstripped text.
    let end = if rendered.get(loc..loc + lstripped.len()) == Some(final_text.as_str()) {
        loc + lstripped.len()
    } else {
        loc + stripped.len()
    };
    let mut rendered = rendered;
    rendered.truncate(end);
    Ok(rendered)
}
