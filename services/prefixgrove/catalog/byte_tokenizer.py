"""A byte-level tokenizer for the built-in random-weight models: every UTF-8 text round-trips exactly.

Token id b (0..255) is byte b; Llama-3-style special tokens follow. It is a real Hugging Face fast
tokenizer, so chat templates, `save_pretrained` and incremental decoding behave as for a checkpoint's own.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
BOS_ID, EOS_ID, EOT_ID = 256, 257, 260
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's reversible map from bytes to printable characters, which the ByteLevel pre-tokenizer uses.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@lru_cache(maxsize=1)
def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in _byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[1]
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
