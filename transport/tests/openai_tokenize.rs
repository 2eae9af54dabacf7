//! `transport::openai::tokenize` against hand-written tokenizer files in
//! `tests/data/tokenizer/`: a WordLevel vocabulary (whitespace pre-tokenizer, BOS added by a
//! TemplateProcessing post-processor) with a Llama-3-style and a ChatML/Qwen-style config.
//!
//! Vocabulary ids: 0 `[UNK]`, 1 `<|begin_of_text|>`, 2 `<|end_of_text|>`,
//! 3 `<|start_header_id|>`, 4 `<|end_header_id|>`, 5 `<|eot_id|>`, 6 `<|im_start|>`,
//! 7 `<|im_end|>`, then from 8: system user assistant tool You are a helpful . Hello world !
//! What is the weather ? It sunny in Paris , Hi there how can I help you today Tell me joke
//! and of Berlin :

use std::path::{Path, PathBuf};

use serde_json::json;
use transport::TransportError;
use transport::openai::tokenize::{
    ChatMessage, ChatOptions, ContentFormat, ContentPart, MessageContent, PromptTokenizer,
};

const BOS: u32 = 1;
const START: u32 = 3;
const END: u32 = 4;
const EOT: u32 = 5;
const IM_START: u32 = 6;
const IM_END: u32 = 7;
const SYSTEM: u32 = 8;
const USER: u32 = 9;
const ASSISTANT: u32 = 10;

fn data(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/tokenizer")
        .join(model)
}

fn llama() -> PromptTokenizer {
    PromptTokenizer::from_path(&data("llama3")).unwrap()
}

fn chatml() -> PromptTokenizer {
    PromptTokenizer::from_path(&data("chatml")).unwrap()
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::text(role, content)
}

fn invalid(err: TransportError) -> (&'static str, String) {
    match err {
        TransportError::Invalid { name, reason } => (name, reason),
        other => panic!("expected Invalid, got {other:?}"),
    }
}

/// A fresh directory under the system temp dir.
fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "kvengine-tokenize-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn encode_known_texts() {
    let t = llama();
    assert_eq!(
        t.encode("Hello world!", true).unwrap(),
        vec![BOS, 17, 18, 19]
    );
    assert_eq!(t.encode("Hello world!", false).unwrap(), vec![17, 18, 19]);
    assert_eq!(
        t.encode("What is the weather in Paris?", false).unwrap(),
        vec![20, 21, 22, 23, 27, 28, 24]
    );
    // Whitespace is only a separator; punctuation runs are their own words.
    assert_eq!(
        t.encode("  Hi there,\n how can I help you today?", true)
            .unwrap(),
        vec![BOS, 30, 31, 29, 32, 33, 34, 35, 36, 37, 24]
    );
    assert_eq!(t.encode("", true).unwrap(), vec![BOS]);
    assert_eq!(t.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn unknown_words_are_unk() {
    let t = llama();
    assert_eq!(
        t.encode("Hello, strange world", true).unwrap(),
        vec![BOS, 17, 29, 0, 18]
    );
    // Case matters: there is no normalizer.
    assert_eq!(t.encode("hello", false).unwrap(), vec![0]);
}

#[test]
fn special_tokens_in_text_are_single_ids() {
    let t = llama();
    assert_eq!(
        t.encode(
            "<|start_header_id|>user<|end_header_id|>Hi<|eot_id|>",
            false
        )
        .unwrap(),
        vec![START, USER, END, 30, EOT]
    );
    // add_special_tokens adds BOS even when the text already starts with it (as HF does).
    assert_eq!(
        t.encode("<|begin_of_text|>Hi", true).unwrap(),
        vec![BOS, BOS, 30]
    );
}

#[test]
fn llama_chat_renders_exactly() {
    let t = llama();
    assert!(t.has_chat_template());
    assert_eq!(t.content_format(), Some(ContentFormat::String));
    let messages = [
        msg("system", "You are a helpful assistant."),
        msg("user", "  Hello world!\n"),
        msg("assistant", "Hi there, how can I help you today?"),
        msg("user", "Tell me a joke."),
    ];
    let body = "<|begin_of_text|>\
        <|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>\
        <|start_header_id|>user<|end_header_id|>\n\nHello world!<|eot_id|>\
        <|start_header_id|>assistant<|end_header_id|>\n\nHi there, how can I help you today?<|eot_id|>\
        <|start_header_id|>user<|end_header_id|>\n\nTell me a joke.<|eot_id|>";
    assert_eq!(t.render_chat(&messages, false).unwrap(), body);
    assert_eq!(
        t.render_chat(&messages, true).unwrap(),
        format!("{body}<|start_header_id|>assistant<|end_header_id|>\n\n")
    );
}

#[test]
fn llama_chat_token_ids() {
    let t = llama();
    let messages = [
        msg("system", "You are a helpful assistant."),
        msg("user", "Hello world!"),
    ];
    let ids = t.chat_token_ids(&messages).unwrap();
    assert_eq!(
        ids,
        vec![
            BOS, START, SYSTEM, END, 12, 13, 14, 15, ASSISTANT, 16, EOT, // system
            START, USER, END, 17, 18, 19, EOT, // user
            START, ASSISTANT, END, // generation prompt
        ]
    );
    // The template writes BOS itself: encoding the rendering with special tokens would
    // double it, which is why chat uses add_special_tokens = false.
    let text = t.render_chat(&messages, true).unwrap();
    assert_eq!(t.encode(&text, false).unwrap(), ids);
    assert_eq!(t.encode(&text, true).unwrap()[..2], [BOS, BOS]);
}

#[test]
fn content_parts_are_joined_for_string_templates() {
    let t = llama();
    let parts = ChatMessage {
        role: "user".to_owned(),
        content: MessageContent::Parts(vec![
            ContentPart::text("Hello"),
            ContentPart::text("world!"),
        ]),
        extra: Default::default(),
    };
    assert_eq!(
        t.render_chat(&[parts], false).unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello\nworld!<|eot_id|>"
    );
    // The same from request JSON; a text part without text is skipped, as vLLM skips it.
    let from_json: Vec<ChatMessage> = serde_json::from_value(json!([
        {"role": "user", "content": [
            {"type": "text", "text": "Hello"}, {"type": "text"}, {"type": "text", "text": "world!"}
        ]}
    ]))
    .unwrap();
    assert_eq!(
        t.chat_token_ids(&from_json).unwrap(),
        vec![
            BOS, START, USER, END, 17, 18, 19, EOT, START, ASSISTANT, END
        ]
    );
}

#[test]
fn image_parts_are_refused() {
    let t = llama();
    let m: Vec<ChatMessage> = serde_json::from_value(json!([
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        ]}
    ]))
    .unwrap();
    let (name, reason) = invalid(t.chat_token_ids(&m).unwrap_err());
    assert_eq!(name, "chat_message");
    assert!(reason.contains("image_url"), "{reason}");
}

#[test]
fn shared_system_prompt_shares_a_token_prefix() {
    let t = llama();
    let system = msg(
        "system",
        "You are a helpful assistant. You are a helpful assistant of Paris and Berlin.",
    );
    let a = t
        .chat_token_ids(&[system.clone(), msg("user", "What is the weather in Paris?")])
        .unwrap();
    let b = t
        .chat_token_ids(&[system.clone(), msg("user", "Tell me a joke.")])
        .unwrap();
    let system_only = t.render_chat(&[system], false).unwrap();
    let prefix = t.encode(&system_only, false).unwrap();
    assert!(prefix.len() > 16, "the shared prefix spans a whole block");
    assert_eq!(a[..prefix.len()], prefix[..]);
    assert_eq!(b[..prefix.len()], prefix[..]);
    assert_ne!(a[prefix.len()..], b[prefix.len()..]);
    // And a multi-turn continuation extends the previous turn's prompt.
    let turn1 = [msg("user", "Hi there!")];
    let turn2 = [
        msg("user", "Hi there!"),
        msg("assistant", "Hello!"),
        msg("user", "Tell me a joke."),
    ];
    let p1 = t.render_chat(&turn1, false).unwrap();
    let p2 = t.render_chat(&turn2, true).unwrap();
    assert!(p2.starts_with(&p1));
    let (i1, i2) = (t.encode(&p1, false).unwrap(), t.encode(&p2, false).unwrap());
    assert_eq!(i2[..i1.len()], i1[..]);
}

#[test]
fn chatml_template_with_python_features() {
    let t = chatml();
    // The default template loops over message.content: vLLM's "openai" content format.
    assert_eq!(t.content_format(), Some(ContentFormat::OpenAi));
    let messages = [
        msg("system", "  You are a helpful assistant.  "),
        msg("user", "What is the weather in Paris?"),
        msg("assistant", "It is sunny."),
        msg("user", "And Berlin?"),
    ];
    assert_eq!(
        t.render_chat(&messages, true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n\
         <|im_start|>assistant\nIt is sunny.<|im_end|>\n\
         <|im_start|>user\nAnd Berlin?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // loop.first: without a system message the template adds its own.
    let ids = t.chat_token_ids(&[msg("user", "Hi!")]).unwrap();
    assert_eq!(
        ids,
        vec![
            IM_START, SYSTEM, 12, 13, 14, 15, ASSISTANT, 16, IM_END, // default system
            IM_START, USER, 30, 19, IM_END, IM_START, ASSISTANT,
        ]
    );
    // chat_template_kwargs reach the template.
    let options = ChatOptions {
        template_kwargs: serde_json::from_value(json!({"enable_thinking": false})).unwrap(),
        ..ChatOptions::default()
    };
    assert_eq!(
        t.render_chat_with(&[msg("user", "Hi!")], &options).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

#[test]
fn raise_exception_surfaces_as_template_error() {
    let t = chatml();
    let messages = [
        msg("user", "Hi!"),
        msg("system", "You are a helpful assistant."),
    ];
    let (name, reason) = invalid(t.render_chat(&messages, true).unwrap_err());
    assert_eq!(name, "chat_template");
    assert!(
        reason.contains("System message must be at the beginning."),
        "{reason}"
    );
    assert!(t.chat_token_ids(&messages).is_err());
}

#[test]
fn tool_calls_and_tools_use_tojson() {
    let t = chatml();
    let messages: Vec<ChatMessage> = serde_json::from_value(json!([
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]))
    .unwrap();
    assert_eq!(
        t.render_chat(&messages, true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
         {\"city\": \"Paris\", \"days\": 2}}\n</tool_call><|im_end|>\n\
         <|im_start|>tool\nsunny<|im_end|>\n\
         <|im_start|>assistant\n"
    );

    // With tools the list form's "tool_use" template is chosen. (Keys are in alphabetical
    // order so the expectation holds whether or not serde_json preserves key order.)
    let options = ChatOptions {
        tools: Some(vec![json!({
            "function": {"description": "Weather <today> & \"now\"", "name": "get_weather",
                         "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"}},
            "type": "function"
        })]),
        ..ChatOptions::default()
    };
    let messages = [
        msg("system", "You are a helpful assistant."),
        msg("user", "Hi!"),
    ];
    assert_eq!(
        t.render_chat_with(&messages, &options).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n<tools>\n\
         {\"function\": {\"description\": \"Weather <today> & \\\"now\\\"\", \"name\": \
         \"get_weather\", \"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \
         \"type\": \"object\"}}, \"type\": \"function\"}\n</tools><|im_end|>\n\
         <|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn tool_schemas_keep_the_request_key_order_as_python_does() {
    // Python's json.loads and json.dumps keep key order, so the engine's prompt lists a tool
    // as the client wrote it; so must ours, or every block hash of the prompt differs.
    let t = chatml();
    let tool: serde_json::Value = serde_json::from_str(
        r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}"#,
    )
    .unwrap();
    let options = ChatOptions {
        tools: Some(vec![tool]),
        ..ChatOptions::default()
    };
    let rendered = t.render_chat_with(&[msg("user", "Hi!")], &options).unwrap();
    assert!(
        rendered.contains(
            r#"{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}"#
        ),
        "{rendered}"
    );
}

#[test]
fn continue_final_message_leaves_the_turn_open() {
    let t = llama();
    let messages = [msg("user", "Hi!"), msg("assistant", "Hello world")];
    let options = ChatOptions {
        add_generation_prompt: false,
        continue_final_message: true,
        ..ChatOptions::default()
    };
    let text = t.render_chat_with(&messages, &options).unwrap();
    assert_eq!(
        text,
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHello world"
    );
    let both = ChatOptions {
        continue_final_message: true,
        ..ChatOptions::default()
    };
    assert_eq!(
        invalid(t.render_chat_with(&messages, &both).unwrap_err()).0,
        "chat_template"
    );
}

#[test]
fn missing_chat_template_is_a_clear_error() {
    let tokenizer_json = std::fs::read(data("llama3").join("tokenizer.json")).unwrap();
    for config in [None, Some(&br#"{"bos_token": "<|begin_of_text|>"}"#[..])] {
        let t = PromptTokenizer::from_parts(&tokenizer_json, config).unwrap();
        assert!(!t.has_chat_template());
        assert_eq!(t.content_format(), None);
        // Completions still work.
        assert_eq!(t.encode("Hi", true).unwrap(), vec![BOS, 30]);
        let (name, reason) = invalid(t.chat_token_ids(&[msg("user", "Hi")]).unwrap_err());
        assert_eq!(name, "chat_template");
        assert!(reason.contains("no chat template"), "{reason}");
    }
    // A template given afterwards (vLLM's --chat-template) makes chat work.
    let t = PromptTokenizer::from_parts(&tokenizer_json, None)
        .unwrap()
        .with_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
        .unwrap();
    assert_eq!(t.chat_token_ids(&[msg("user", "Hi")]).unwrap(), vec![30]);
}

#[test]
fn malformed_files_are_errors() {
    let tokenizer_json = std::fs::read(data("llama3").join("tokenizer.json")).unwrap();
    for bad in [
        &b""[..],
        b"{",
        b"[]",
        br#"{"model": {"type": "Nope"}}"#,
        b"\xff\xfe",
    ] {
        let (name, reason) = invalid(PromptTokenizer::from_parts(bad, None).unwrap_err());
        assert_eq!(name, "tokenizer");
        assert!(reason.contains("tokenizer.json"), "{reason}");
    }
    for bad_config in [
        &b"{"[..],
        b"[1]",
        br#"{"chat_template": 5}"#,
        br#"{"chat_template": [{"name": "default"}]}"#,
    ] {
        let (name, reason) =
            invalid(PromptTokenizer::from_parts(&tokenizer_json, Some(bad_config)).unwrap_err());
        assert_eq!(name, "tokenizer", "{reason}");
        assert!(reason.contains("tokenizer_config.json"), "{reason}");
    }
    // A template that does not compile.
    let (name, reason) = invalid(
        PromptTokenizer::from_parts(
            &tokenizer_json,
            Some(br#"{"chat_template": "{% for m in messages %}{{ m.content }"}"#),
        )
        .unwrap_err(),
    );
    assert_eq!(name, "chat_template");
    assert!(reason.contains("does not compile"), "{reason}");
    // A template that fails while rendering.
    let t = PromptTokenizer::from_parts(
        &tokenizer_json,
        Some(br#"{"chat_template": "{{ messages[0].content.nope.deeper }}"}"#),
    )
    .unwrap();
    let (name, reason) = invalid(t.render_chat(&[msg("user", "Hi")], true).unwrap_err());
    assert_eq!(name, "chat_template");
    assert!(reason.contains("failed"), "{reason}");
    // Several templates, none named "default".
    let t = PromptTokenizer::from_parts(
        &tokenizer_json,
        Some(br#"{"chat_template": [{"name": "a", "template": "a"}, {"name": "b", "template": "b"}]}"#),
    )
    .unwrap();
    let (name, reason) = invalid(t.render_chat(&[], true).unwrap_err());
    assert_eq!(name, "chat_template");
    assert!(reason.contains("default"), "{reason}");
}

#[test]
fn from_path_directory_and_file() {
    let dir = data("llama3");
    let from_dir = PromptTokenizer::from_path(&dir).unwrap();
    let from_file = PromptTokenizer::from_path(&dir.join("tokenizer.json")).unwrap();
    let messages = [msg("user", "Hello world!")];
    assert!(
        from_file.has_chat_template(),
        "config found beside the file"
    );
    assert_eq!(
        from_dir.chat_token_ids(&messages).unwrap(),
        from_file.chat_token_ids(&messages).unwrap()
    );

    let missing = dir.join("no-such-dir");
    let (name, reason) = invalid(PromptTokenizer::from_path(&missing).unwrap_err());
    assert_eq!(name, "tokenizer");
    assert!(reason.contains("no-such-dir"), "{reason}");

    // A directory with tokenizer.json only: no chat template.
    let tmp = temp_dir("bare");
    std::fs::copy(dir.join("tokenizer.json"), tmp.join("tokenizer.json")).unwrap();
    let bare = PromptTokenizer::from_path(&tmp).unwrap();
    assert!(!bare.has_chat_template());
    // chat_template.jinja and special_tokens_map.json beside it, as newer HF repos ship.
    std::fs::write(
        tmp.join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}\n",
    )
    .unwrap();
    std::fs::write(
        tmp.join("special_tokens_map.json"),
        r#"{"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|eot_id|>"}"#,
    )
    .unwrap();
    let t = PromptTokenizer::from_path(&tmp).unwrap();
    assert_eq!(
        t.render_chat(&messages, true).unwrap(),
        "<|begin_of_text|>Hello world!<|eot_id|>"
    );
    // A malformed config beside it names its path.
    std::fs::write(tmp.join("tokenizer_config.json"), "{not json").unwrap();
    let (name, reason) = invalid(PromptTokenizer::from_path(&tmp).unwrap_err());
    assert_eq!(name, "tokenizer");
    assert!(
        reason.contains(&*tmp.join("tokenizer_config.json").to_string_lossy()),
        "{reason}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn tokenizer_is_shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<PromptTokenizer>();
    let t = llama();
    let expected = t.chat_token_ids(&[msg("user", "Hello world!")]).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    assert_eq!(
                        t.chat_token_ids(&[msg("user", "Hello world!")]).unwrap(),
                        expected
                    );
                }
            });
        }
    });
}

/// `--tokenizer org/name` finds the repo in the local Hugging Face cache (the snapshot
/// `refs/main` names, or the only one); a path is taken as is; anything else is an error
/// that says how to fetch it.
#[test]
fn repo_ids_resolve_from_the_hugging_face_cache() {
    let home = std::env::temp_dir().join(format!("kvengine-hf-{}", std::process::id()));
    let repo = home.join("hub/models--acme--chat-model");
    let snap = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(data("chatml").join(f), snap.join(f)).unwrap();
    }
    // The only snapshot, then the one refs/main names.
    assert_eq!(
        PromptTokenizer::resolve("acme/chat-model", &home).unwrap(),
        snap
    );
    let newer = repo.join("snapshots/4567ef01");
    std::fs::create_dir_all(&newer).unwrap();
    std::fs::copy(snap.join("tokenizer.json"), newer.join("tokenizer.json")).unwrap();
    assert!(
        PromptTokenizer::resolve("acme/chat-model", &home).is_err(),
        "two, no ref"
    );
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd\n").unwrap();
    let dir = PromptTokenizer::resolve("acme/chat-model", &home).unwrap();
    assert_eq!(dir, snap);
    let from_cache = PromptTokenizer::from_path(&dir).unwrap();
    let direct = PromptTokenizer::from_path(&data("chatml")).unwrap();
    assert_eq!(format!("{from_cache:?}"), format!("{direct:?}"));
    // A path is a path.
    let p = data("chatml");
    assert_eq!(
        PromptTokenizer::resolve(p.to_str().unwrap(), &home).unwrap(),
        p
    );
    for bad in ["acme/missing", "/no/such/dir", "not-a-repo-id"] {
        let e = PromptTokenizer::resolve(bad, &home)
            .unwrap_err()
            .to_string();
        assert!(e.contains(bad), "{e}");
    }
    let e = PromptTokenizer::resolve("acme/missing", &home)
        .unwrap_err()
        .to_string();
    assert!(e.contains("huggingface-cli download acme/missing"), "{e}");
    let _ = std::fs::remove_dir_all(&home);
}
