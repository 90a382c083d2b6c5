"""Incremental detokenization gives, piece by piece, exactly the text of decoding everything at once."""

from __future__ import annotations

import pytest

from prefixgrove.catalog.byte_tokenizer import EOS_ID, VOCAB_SIZE, byte_tokenizer
from prefixgrove.engine.sampling.detokenizer import Detokenizer, DetokState

TEXTS = ["plain ascii", "grüße, 森林 and 🌲🌳!", "\n\t  spaced  ", "é"]


def pieces(detok: Detokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    state, out = DetokState(), []
    for k in range(1, len(ids) + 1):
        out.append(detok.step(state, ids[:k], skip_special))
    assert "".join(out) == state.text
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_text(text: str):
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(text)
    assert "".join(pieces(Detokenizer(tokenizer, VOCAB_SIZE), ids)) == text


def test_a_character_split_over_tokens_appears_once_complete():
    ids = byte_tokenizer().encode("a🌲")  # 1 + 4 bytes
    assert pieces(Detokenizer(byte_tokenizer(), VOCAB_SIZE), ids) == ["a", "", "", "", "🌲"]


def test_special_tokens_are_skipped_or_kept():
    tokenizer = byte_tokenizer()
    ids = [*tokenizer.encode("ok"), EOS_ID]
    detok = Detokenizer(tokenizer, VOCAB_SIZE)
    assert "".join(pieces(detok, ids, skip_special=True)) == "ok"
    assert detok.decode(ids, skip_special_tokens=False) == "ok<|end_of_text|>"


def test_ids_beyond_the_tokenizer_decode_to_nothing():
    # Random-weight models may have a larger vocabulary than their tokenizer knows.
    detok = Detokenizer(byte_tokenizer(), VOCAB_SIZE + 100)
    assert detok.decode([104, VOCAB_SIZE + 5, 105]) == "hi"
