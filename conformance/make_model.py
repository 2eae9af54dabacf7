#!/usr/bin/env python3
"""Writes a tiny Llama model directory for the real-vLLM conformance suite.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here, with the `tokenizers`
library, over generated English-like text (deterministic: a fixed seed), and the weights are
never written (vLLM runs with `--load-format dummy`).

    python conformance/make_model.py OUT_DIR

Files: config.json, tokenizer.json, tokenizer_config.json (with a Jinja chat template),
special_tokens_map.json, generation_config.json.
"""

import json
import os
import random
import sys

VOCAB_SIZE = 2000

# Words the generated corpus (and the suite's prompts) are made of.
WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or are "
    "router cache block worker prompt token request system user assistant model engine "
    "event stream index prefix hash chain shard core queue memory cluster server client "
    "answer question reply message history context window budget latency throughput "
    "policy tenant salt adapter rank replica snapshot restart eviction storage network "
    "red green blue yellow orange purple black white silver golden bright dark quiet loud "
    "river mountain forest ocean desert island valley city village garden castle bridge "
    "tower market harbor station library museum school kitchen office window door table "
    "cat dog horse bird fish lion tiger bear wolf fox rabbit mouse eagle owl snake whale "
    "run walk jump swim read write speak listen think build break fix move carry hold "
    "find keep give take make send receive open close start stop begin finish wait watch "
    "quick slow happy sad brave calm eager gentle proud wise young old new ancient modern "
    "one two three four five six seven eight nine ten hundred thousand first second last "
    "always never often sometimes today tomorrow yesterday morning evening night summer "
    "winter spring autumn because although while until unless whether however therefore "
    "please thanks hello goodbye yes no maybe sure certainly indeed perhaps really very"
).split()

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


def corpus(n_sentences=20000, seed=1234):
    rng = random.Random(seed)
    for _ in range(n_sentences):
        n = rng.randint(4, 16)
        words = [rng.choice(WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        yield " ".join(words) + rng.choice([".", ".", "?", "!", ","])
    # some digits and punctuation so numbers tokenize into something stable
    for i in range(2000):
        yield f"Item {i}: value {rng.randint(0, 99999)} ({rng.choice(WORDS)})."


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    # Completions are tokenized with special tokens (vLLM's default): a BOS in front.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok


def main(out):
    os.makedirs(out, exist_ok=True)
    tok = train_tokenizer()
    n = tok.get_vocab_size()
    assert n <= VOCAB_SIZE, n
    tok.save(os.path.join(out, "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB_SIZE,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(s)): {
                "content": s, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False, "special": True,
            }
            for s in SPECIALS
        },
    }
    special_tokens_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    generation_config = {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}
    for name, obj in [
        ("config.json", config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
        ("generation_config.json", generation_config),
    ]:
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=2)
    print(f"model dir {out}: vocab {n} (config {VOCAB_SIZE})", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py OUT_DIR")
    main(sys.argv[1])
