"""When a request stops, and what it reports: length, EOS, stop token ids and stop strings."""

from __future__ import annotations

import pytest
from engine_checkpoints import EOS_IDS, engine, greedy, random_prompts, run, token_ids

from prefixgrove import LLM

MAX = 32


@pytest.fixture(scope="module")
def llm(llama_dir: str) -> LLM:
    return engine(llama_dir)


@pytest.fixture(scope="module")
def free_run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and their greedy continuations with EOS ignored: what the stop tests cut short."""
    prompts = random_prompts([5 + 3 * i for i in range(16)], seed=30)
    return prompts, token_ids(run(llm, prompts, greedy(MAX, ignore_eos=True)))


def test_max_tokens_ends_with_length(llm):
    out = run(llm, random_prompts((9,), seed=31), greedy(7, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 7
    assert out.finish_reason == "length" and out.stop_reason is None


def test_eos_ends_with_stop_and_keeps_the_eos_token(llm, free_run):
    prompts, full = free_run
    hits = [
        (i, next((k for k, t in enumerate(f) if t in EOS_IDS), None)) for i, f in enumerate(full)
    ]
    hits = [(i, k) for i, k in hits if k is not None]
    assert hits, "no prompt's greedy continuation reaches EOS; pick other prompts"
    i, k = hits[0]
    out = run(llm, [prompts[i]], greedy(MAX))[0].outputs[0]
    assert out.token_ids == full[i][: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_ignore_eos_generates_past_eos(llm, free_run):
    prompts, full = free_run
    i = next(i for i, f in enumerate(full) if set(f[:-1]) & set(EOS_IDS))
    out = run(llm, [prompts[i]], greedy(MAX, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == full[i] and len(out.token_ids) == MAX
    assert out.finish_reason == "length"


def test_stop_token_id_ends_with_stop_and_names_the_token(llm, free_run):
    prompts, full = free_run
    tokens = full[0]
    k = next(k for k in range(3, MAX) if tokens.index(tokens[k]) == k)  # a first occurrence
    for ignore_eos in (False, True):
        out = run(llm, [prompts[0]], greedy(MAX, ignore_eos=ignore_eos, stop_token_ids=[tokens[k]]))
        completion = out[0].outputs[0]
        assert completion.token_ids == tokens[: k + 1]
        assert completion.finish_reason == "stop" and completion.stop_reason == tokens[k]


def _stop_string(text: str, start: int = 2) -> tuple[str, int]:
    """A two-character printable ASCII string whose first occurrence in text is at index >= start."""
    for i in range(start, len(text) - 1):
        s = text[i : i + 2]
        if s.isascii() and s.isprintable() and text.find(s) == i:
            return s, i
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("include", [False, True], ids=["stop-excluded", "stop-included"])
def test_stop_string_truncates_the_text(llm, free_run, include):
    prompts, full = free_run
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(f, skip_special_tokens=True) for f in full]
    i = 0
    stop, at = _stop_string(texts[i])
    params = greedy(MAX, ignore_eos=True, stop=[stop], include_stop_str_in_output=include)
    completion = run(llm, [prompts[i]], params)[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == texts[i][: at + (len(stop) if include else 0)]
    assert completion.token_ids == full[i][: len(completion.token_ids)]
    assert len(completion.token_ids) < MAX
    assert stop in tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_first_of_several_stop_strings_wins(llm, free_run):
    prompts, full = free_run
    text = llm.get_tokenizer().decode(full[0], skip_special_tokens=True)
    first, at = _stop_string(text)
    later, _ = _stop_string(text, start=at + 2)
    params = greedy(MAX, ignore_eos=True, stop=[later, first])
    completion = run(llm, [prompts[0]], params)[0].outputs[0]
    assert completion.stop_reason == first and completion.text == text[:at]


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_eos_text_skips_special_tokens_unless_asked(llm, free_run, skip):
    prompts, full = free_run
    i, k = next(
        (i, k) for i, f in enumerate(full) for k, t in enumerate(f) if t in EOS_IDS and k > 0
    )
    completion = run(llm, [prompts[i]], greedy(MAX, skip_special_tokens=skip))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert completion.token_ids == full[i][: k + 1]
    assert completion.text == tokenizer.decode(full[i][: k + 1], skip_special_tokens=skip)
    special = tokenizer.convert_ids_to_tokens(full[i][k])
    assert completion.text.endswith(special) != skip
