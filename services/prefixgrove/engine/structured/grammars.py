"""Compiles structured-output constraints for one model's vocabulary, with llguidance.

llguidance over xgrammar, by measurement on the extraction schema of benchmarks/structured.py
(HISTORY.md, "Structured outputs"): its schemas compile two orders of magnitude faster (grammars are
built lazily, so a job whose requests each carry their own schema does not stall on compiles), and its
token masks are faster too. It is one abi3 wheel with no dependencies, and it computes masks
for a whole batch on its own threads without the GIL.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy as llnp

from .derivations import rules_deriving_nothing
from .json_schemas import without_unnamed_properties
from .params import StructuredOutputsParams

_CACHE_SIZE = 1024  # compiled grammars kept (a job usually has one or a few)
# Matchers' limits are llguidance's own; its errors leave out the parser's state (a request's error
# line quotes them)
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarCompiler:
    """Turns StructuredOutputsParams into llguidance grammars checked against the model's vocabulary,
    and makes matchers for them. The vocabulary is read once, when the first constraint arrives."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._grammars: OrderedDict[tuple[str, str, bool], str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._build_tokenizer()
            return self._tokenizer

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        if self._hf is None:
            raise ValueError(
                "structured outputs need the tokenizer, which skip_tokenizer_init=True leaves out"
            )
        if not hasattr(self._hf, "backend_tokenizer"):
            raise ValueError(
                f"structured outputs need a fast (Rust) tokenizer, not {type(self._hf).__name__}"
            )
        # EOS as the model's generation config ends a turn; the others are allowed beside it where
        # the grammar may end (masks.py).
        eos = self.eos_token_ids[0] if self.eos_token_ids else self._hf.eos_token_id
        # A tokenizer may know more ids than the model has logits for (an added pad): masks then
        # have bits past the logits, which nothing reads.
        vocab = max(self.vocab_size, len(self._hf))
        tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=vocab, eos_token=eos)
        self._check_bytes(tokenizer)
        return tokenizer

    def _check_bytes(self, tokenizer: llguidance.LLTokenizer) -> None:
        """llguidance reads each token's bytes from the tokenizer's JSON; where it reads them
        otherwise than the tokenizer decodes them (an unusual decoder, such as some GGUF conversions
        write), every mask would be wrong: refuse rather than constrain to the wrong bytes."""
        probe = 'Hello, world!\n\t{"key": [1, 2.5, true]} caf\u00e9 \u65e5\u672c'
        ids = self._hf.encode(probe, add_special_tokens=False)
        seen = tokenizer.decode_bytes(ids)
        if seen != probe.encode():
            raise ValueError(
                "structured outputs cannot use this tokenizer: its tokens' bytes as read from "
                f"its decoder ({seen[:40]!r}) are not the text it encodes ({probe[:40]!r}); "
                "a tokenizer.json with a ByteLevel or Metaspace decoder works"
            )

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar for `params`; ValueError naming what does not compile."""
        key = params.key
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = self._checked(key)
        with self._lock:
            self._grammars[key] = grammar
            if len(self._grammars) > _CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def _checked(self, key: tuple[str, str, bool]) -> str:
        """The grammar of `key`, refused (ValueError) where it does not compile or where it accepts
        no output at all, which would otherwise fail its request mid-decode or run to max_tokens."""
        kind = key[0]
        try:
            grammar = _grammar(key)
        except (ValueError, TypeError) as e:
            raise ValueError(_refusal(kind, str(e))) from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if failed:
            raise ValueError(_refusal(kind, messages[0]))
        if kind == "grammar":
            _check_rules_end(grammar)
        # what a sequence builds later must not fail then
        self._check_first_mask(kind, self.matcher(grammar))
        return grammar

    def _check_first_mask(self, kind: str, matcher: llguidance.LLMatcher) -> None:
        """Refuses a constraint no token can start (an empty regex, a rule that only recurses
        into itself first): its matcher fails on its first mask."""
        bitmask = llnp.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        llnp.fill_next_token_bitmask(matcher, bitmask, 0)
        if matcher.is_error() or not (bitmask.any() or matcher.is_accepting()):
            reason = matcher.get_error().strip().split("\n")[0] or "no token is allowed"
            raise ValueError(
                f"structured_outputs.{kind} accepts no output: no token can start it ({reason})"
            )

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A new matcher at the start of a grammar `compile` returned (which built one already, so
        this one builds too). Building one costs as much as several masks (HISTORY.md), so a sequence
        builds its own ahead while the host waits for the device, or when its first mask needs it
        (StepMasker, on its builder threads), not as a job of thousands is taken in. Safe on any
        thread.
        Not `deep_copy` of a kept one: copies share their parser's lexer behind a lock, and a
        step's masks, filled in parallel, then took several times as long (benchmarks/HISTORY.md)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise ValueError(f"structured_outputs does not compile: {_short(matcher.get_error())}")
        return matcher


def _grammar(key: tuple[str, str, bool]) -> str:
    """llguidance's grammar for a constraint's key (kind, canonical text, compact)."""
    kind, text, compact = key
    options: dict[str, Any] = {"whitespace_flexible": False} if compact else {}
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"},
            overrides=options,  # type: ignore[arg-type]
        )
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(
            without_unnamed_properties(json.loads(text)),
            overrides=options,  # type: ignore[arg-type]
        )
    if kind == "choice":
        # One terminal, matched by the lexer: as alternatives of a rule, each choice is an item of
        # the parser's row, and past 2,000 of them every request failed at its first token.
        strings = " | ".join(json.dumps(c) for c in json.loads(text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {strings}")
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("grammar", text)  # GBNF (llama.cpp) or Lark


def _check_rules_end(lark: str) -> None:
    """Refuses a grammar none of whose rules can end (`derivations.py`), naming a few of them."""
    endless = rules_deriving_nothing(lark)
    if not endless:
        return
    named = ", ".join(endless[:5])
    if len(endless) > 5:
        named += f" and {len(endless) - 5} more"
    raise ValueError(
        f"structured_outputs.grammar accepts no output: no rule of {named} ever ends (each of "
        "their alternatives needs one of them again); give one an alternative without them"
    )


def _refusal(kind: str, message: str) -> str:
    """llguidance's reason a constraint does not compile; one it proved empty accepts no output."""
    if "unsatisfiable" in message.lower():
        return f"structured_outputs.{kind} accepts no output: {_short(message)}"
    return f"structured_outputs.{kind} does not compile: {_short(message)}"


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[: limit - 3] + "..."
