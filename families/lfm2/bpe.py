"""Training a byte-level BPE tokenizer in LFM2's format.

The special tokens sit at LFM2's ids (`<|pad|>` 0, `<|startoftext|>` 1, `<|endoftext|>` 2,
`<|im_start|>` 6, `<|im_end|>` 7, ...), prompts get `<|startoftext|>` prepended, and the
chat template is ChatML as LFM2 writes it. The output is a tokenizer.json plus a
tokenizer_config.json that any Hugging Face loader reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|fim_pre|>",
    "<|fim_mid|>",
    "<|fim_suf|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tool_list_start|>",
    "<|tool_list_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|tool_response_start|>",
    "<|tool_response_end|>",
    "<|mask|>",  # the DSpark drafter's block filler
]
PAD, BOS, EOS_TEXT, IM_START, IM_END, MASK = 0, 1, 2, 6, 7, 14

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most `vocab_size` entries (specials and the 256 bytes
    included); fewer when the text runs out of merges."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size must be at least {len(SPECIAL_TOKENS) + 256} (specials + bytes), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A", pair="<|startoftext|> $A $B", special_tokens=[("<|startoftext|>", BOS)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: str | Path) -> None:
    """tokenizer.json + tokenizer_config.json (specials, chat template)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "add_bos_token": True,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
            for i, t in enumerate(SPECIAL_TOKENS)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
