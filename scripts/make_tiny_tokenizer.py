#!/usr/bin/env python3
"""Builds the shipped "tiny" model assets in ``daemon/assets/tiny/``.

dynamod never downloads a model, so tests, the mocker and ``dynamod up`` need a tokenizer and
model config that ship with the package. This script trains a small byte-level BPE tokenizer
(Llama-3-style pre-tokenization and special tokens) and writes the HF-style files a real model
directory has: ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template),
``config.json`` (a tiny Llama geometry a later script can instantiate with random weights) and
``generation_config.json``, plus a README recording the corpus and its licence.

Training corpus (public domain, available offline through Debian's package registry):

- The King James Version of the Bible (1611; its copyright has long expired), as shipped in
  Debian's ``bible-kjv-text`` package and printed by the ``bible`` program from ``bible-kjv``
  (``apt-get install bible-kjv``). Pass ``--corpus FILE`` to use a text file instead.
- A small block of text this script generates itself (JSON tool calls, numbers, chat-style
  lines), so the vocabulary has merges for the punctuation that tool calling uses.

Re-running with the same corpus produces byte-identical files (the BPE trainer is deterministic
for a fixed input order; the generated block uses a fixed seed).

Usage::

    python scripts/make_tiny_tokenizer.py [--out daemon/assets/tiny] [--corpus kjv.txt]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "daemon" / "assets" / "tiny"

VOCAB_SIZE = 4096
CONTEXT_LENGTH = 8192

# Llama 3's special tokens (a subset), appended after the BPE vocabulary like Llama 3 does.
BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
PYTHON_TAG = "<|python_tag|>"
PAD = "<|finetune_right_pad_id|>"
SPECIAL_TOKENS = [BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT, EOM, PYTHON_TAG, PAD]

# Llama 3's pre-tokenizer split: contractions, letter runs, 1-3 digit groups, punctuation, spaces.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama-3.1-style chat template: headers per message, JSON tool calls, tool results as "ipython".
# Content may be a string or a list of {"type": "text", "text": ...} parts; tool-call arguments may
# be a JSON string (raw OpenAI form) or a mapping (already parsed).
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is none -%}
{%- elif content is string -%}{{ content }}
{%- elif content is mapping -%}{{ content | tojson }}
{%- else -%}
{%- for part in content -%}
{%- if part is string -%}{{ part }}
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- else -%}{{ raise_exception('Only text content parts are supported, got ' ~ part['type']) }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{{- bos_token }}
{%- if messages and messages[0]['role'] in ['system', 'developer'] %}
{%- set system_message = render_content(messages[0]['content']) %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if system_message or tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- system_message }}
{%- if tools %}
{%- if system_message %}{{- '\\n\\n' }}{%- endif %}
{{- 'You have access to the following functions. To call a function, respond with JSON of the form '
    '{"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for tool in tools %}
{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}
{{- '\\n\\n' }}
{%- endfor %}
{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in loop_messages %}
{%- set role = message['role'] %}
{%- if role not in ['system', 'developer', 'user', 'assistant', 'tool', 'ipython'] %}
{{- raise_exception('Unknown message role: ' ~ role) }}
{%- endif %}
{%- if role in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{{- render_content(message['content']) }}
{{- '<|eot_id|>' }}
{%- elif role == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- render_content(message['content']) }}
{%- for tool_call in message['tool_calls'] %}
{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}
{%- if not loop.first or message['content'] %}{{- '\\n' }}{%- endif %}
{{- '{"name": "' ~ call['name'] ~ '", "parameters": ' }}
{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}{%- endif %}
{{- '}' }}
{%- endfor %}
{{- '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' ~ ('system' if role == 'developer' else role) ~ '<|end_header_id|>\\n\\n' }}
{{- render_content(message['content']) }}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

_VERSE_REF = re.compile(r"^\S+\d+:\d+\s+")


def kjv_lines(corpus: Path | None) -> Iterator[str]:
    """Yields the KJV one verse per line, without the verse reference."""
    if corpus is not None:
        text = corpus.read_text(encoding="utf-8")
    else:
        if shutil.which("bible") is None:
            sys.exit("the 'bible' program is missing: apt-get install bible-kjv (or pass --corpus FILE)")
        text = subprocess.run(
            ["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True
        ).stdout
    for line in text.splitlines():
        line = _VERSE_REF.sub("", line).strip()
        if line:
            yield line


def generated_lines(seed: int = 1611, count: int = 4000) -> Iterator[str]:
    """Yields deterministic machine-style text: JSON tool calls, numbers, chat-ish lines.

    The KJV has no braces, quotes-in-JSON or digits beyond verse numbers; without these the
    tokenizer would spend a token per character on every tool call.
    """
    rng = random.Random(seed)
    words = (
        "city unit query limit name path date count value id location celsius search weather result "
        "status error message system user assistant ipython tool function hello world"
    ).split()
    functions = ["get_weather", "search_web", "read_file", "get_time", "lookup", "calculate"]
    for i in range(count):
        kind = i % 4
        if kind == 0:
            args = {
                rng.choice(words): rng.choice([rng.randint(0, 10_000), rng.choice(words), True, None])
                for _ in range(rng.randint(1, 3))
            }
            yield json.dumps({"name": rng.choice(functions), "parameters": args})
        elif kind == 1:
            yield " ".join(str(rng.randint(0, 100_000)) for _ in range(rng.randint(3, 9)))
        elif kind == 2:
            yield json.dumps({rng.choice(words): [rng.random() for _ in range(rng.randint(1, 4))]})
        else:
            yield f"The {rng.choice(words)} is {rng.randint(0, 999)}.{rng.randint(0, 99):02d} ({rng.choice(words)})."
            yield f"{rng.choice(words[-8:])}\n\n{rng.choice(words)} {rng.choice(words)}"


def build_tokenizer(lines: list[str]) -> Tokenizer:
    """Trains the byte-level BPE and appends the special tokens after the learned vocabulary."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer, length=len(lines))
    learned = tokenizer.get_vocab_size(with_added_tokens=True)
    if learned != VOCAB_SIZE - len(SPECIAL_TOKENS):
        sys.exit(f"corpus too small: learned {learned} tokens, wanted {VOCAB_SIZE - len(SPECIAL_TOKENS)}")
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    bos_id = tokenizer.token_to_id(BEGIN_OF_TEXT)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BEGIN_OF_TEXT}:0 $A:0",
                pair=f"{BEGIN_OF_TEXT}:0 $A:0 {BEGIN_OF_TEXT}:1 $B:1",
                special_tokens=[(BEGIN_OF_TEXT, bos_id)],
            ),
        ]
    )
    return tokenizer


def write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_configs(out: Path, tokenizer: Tokenizer) -> dict[str, int]:
    """Writes tokenizer_config.json, config.json and generation_config.json; returns special ids."""
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    write_json(
        out / "tokenizer_config.json",
        {
            "added_tokens_decoder": {
                str(ids[tok]): {
                    "content": tok,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for tok in SPECIAL_TOKENS
            },
            "bos_token": BEGIN_OF_TEXT,
            "eos_token": EOT,
            "pad_token": PAD,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": CONTEXT_LENGTH,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHAT_TEMPLATE,
        },
    )
    eos_ids = [ids[END_OF_TEXT], ids[EOM], ids[EOT]]
    write_json(
        out / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "max_position_embeddings": CONTEXT_LENGTH,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "initializer_range": 0.02,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
            "use_cache": True,
            "bos_token_id": ids[BEGIN_OF_TEXT],
            "eos_token_id": eos_ids,
            "pad_token_id": ids[PAD],
        },
    )
    write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[BEGIN_OF_TEXT],
            "eos_token_id": eos_ids,
            "pad_token_id": ids[PAD],
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
        },
    )
    return ids


README = """\
# The "tiny" model assets

`resolve_model("tiny")` serves these files. They are the output of
`scripts/make_tiny_tokenizer.py`; edit the script and re-run it rather than editing them by hand.

| file | what it is |
| --- | --- |
| `tokenizer.json` | byte-level BPE, {vocab_size} tokens ({learned} learned + {n_special} special), Llama 3 pre-tokenizer split; any UTF-8 text round-trips |
| `tokenizer_config.json` | bos `<|begin_of_text|>`, eos `<|eot_id|>`, the chat template (Llama 3.1 style: system/user/assistant/tool, JSON tool calls, `add_generation_prompt`) |
| `config.json` | a tiny Llama geometry (hidden 64, 2 layers, 4 heads, 2 KV heads), context {context_length}, for building a random-weight model |
| `generation_config.json` | eos ids {eos_ids} (`<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`) |

Special token ids: {special_ids}.

## Training corpus and licence

- **The King James Version of the Bible** (1611), {kjv_lines} verses, {kjv_chars} characters
  (sha256 `{kjv_sha}`). Public domain: its copyright expired centuries ago (the Debian package's
  copyright file says so). Taken offline from Debian's `bible-kjv-text` package (printed with
  `bible -f Gen1:1-Rev22:21` from `bible-kjv`), verse references stripped.
- **Text generated by the script** with a fixed seed ({gen_lines} lines: JSON tool calls, numbers,
  short sentences), written for this project, so no third-party rights apply.

The trained tokenizer and these configuration files are part of dynamod and carry its licence
(Apache-2.0).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory [%(default)s]")
    parser.add_argument(
        "--corpus",
        type=Path,
        default=None,
        help="KJV text, one verse per line (default: run the 'bible' program)",
    )
    args = parser.parse_args(argv)

    kjv = list(kjv_lines(args.corpus))
    generated = list(generated_lines())
    kjv_text = "\n".join(kjv)
    tokenizer = build_tokenizer(kjv + generated)

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"), pretty=False)
    ids = write_configs(args.out, tokenizer)
    eos_ids = [ids[END_OF_TEXT], ids[EOM], ids[EOT]]
    (args.out / "README.md").write_text(
        README.format(
            vocab_size=VOCAB_SIZE,
            learned=VOCAB_SIZE - len(SPECIAL_TOKENS),
            n_special=len(SPECIAL_TOKENS),
            context_length=CONTEXT_LENGTH,
            eos_ids=eos_ids,
            special_ids=", ".join(f"`{tok}` {i}" for tok, i in ids.items()),
            kjv_lines=len(kjv),
            kjv_chars=len(kjv_text),
            kjv_sha=hashlib.sha256(kjv_text.encode("utf-8")).hexdigest(),
            gen_lines=len(generated),
        ),
        encoding="utf-8",
    )
    for path in sorted(args.out.iterdir()):
        print(f"wrote {path} bytes={path.stat().st_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
