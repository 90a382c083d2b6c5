"""Whether a Lark grammar (as llguidance reads it, GBNF converted) derives any string at all.

llguidance compiles a grammar whose start rule can never finish, such as `root ::= "a" root`: every
prefix of `aaa...` is allowed, so its matcher masks nothing out until it fails mid-decode or the
output is cut at max_tokens. A rule derives a string when one of its alternatives is made only of
items that do; the rules that never do are found as a fixpoint over the grammar's rules.

Only rules can fail to derive: literals, regexes, terminals and everything not understood here
count as deriving something, so a grammar is refused only where its rules alone prove it empty (an
empty regex or terminal is what the first mask finds: grammars.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""(?P<skip>[ \t\r]+|\\\n|//[^\n]*|\#[^\n]*|->\s*[A-Za-z_0-9]+)
    |(?P<nl>\n)
    |(?P<atom>"(?:[^"\\\n]|\\.)*"i?|'(?:[^'\\\n]|\\.)*'i?|/(?:[^/\\\n]|\\.)+/[a-z]*
        |%[A-Za-z_]+|@[A-Za-z_0-9]+|<[^<>\s]*>)
    |(?P<name>[A-Za-z_][A-Za-z_0-9]*)
    |(?P<brace>\{)
    |(?P<op>[()\[\]|:?*+~])
    |(?P<other>.)""",
    re.X | re.S,
)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_MAX_DEPTH = 200  # nesting past this is not analysed (the grammar is taken to derive)
_START = "start"


@dataclass(frozen=True)
class _Tok:
    kind: str  # atom, name, op, nl
    text: str


class _Unknown(Exception):
    """Something this analysis does not follow: it then proves nothing."""


def rules_deriving_nothing(lark: str) -> list[str]:
    """The rules of `lark` that derive no string, if its start rule is among them (else []),
    start first; [] too where the grammar is not understood well enough to tell."""
    try:
        rules = _rules(_tokens(lark))
    except _Unknown:
        return []
    if _START not in rules:
        return []
    deriving: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            if name not in deriving and _derives(body, rules, deriving):
                deriving.add(name)
                changed = True
    if _START in deriving:
        return []
    return sorted(set(rules) - deriving, key=lambda name: (name != _START, name))


def _tokens(text: str) -> list[_Tok]:
    tokens: list[_Tok] = []
    at = 0
    while at < len(text):
        match = _TOKEN.match(text, at)
        assert match is not None  # `other` matches any character
        kind, at = match.lastgroup or "other", match.end()
        if kind == "brace":  # a %json {...} body, template arguments or {m,n}: one atom
            at = _after_braces(text, at)
            tokens.append(_Tok("brace", "{}"))
        elif kind == "other":
            tokens.append(_Tok("atom", match.group()))
        elif kind != "skip":
            tokens.append(_Tok(kind, match.group()))
    return tokens


def _after_braces(text: str, at: int) -> int:
    """Where the `{` just before `at` closes (strings inside skipped)."""
    depth = 1
    while at < len(text) and depth:
        char = text[at]
        if char == '"':
            end = _STRING.match(text, at)
            at = end.end() if end else len(text)
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        at += 1
    return at


def _rules(tokens: list[_Tok]) -> dict[str, list[list[_Tok]]]:
    """Each rule's alternatives (as token lists); terminals and directives are left out."""
    rules: dict[str, list[list[_Tok]]] = {}
    for line in _logical_lines(tokens):
        while line and line[0].text in ("?", "!"):  # ?rule: inlined, !rule: keeps its tokens
            line = line[1:]
        colon = next((i for i, t in enumerate(line) if t.text == ":"), None)
        head = line[0] if line else None
        if colon is None or head is None or head.kind != "name" or not _is_rule(head.text):
            continue  # a terminal (upper case), a directive, or what is not a definition
        rules.setdefault(head.text, []).append(line[colon + 1 :])
    return rules


def _logical_lines(tokens: list[_Tok]) -> list[list[_Tok]]:
    """Definitions: a newline outside brackets ends one unless the next line goes on with `|`."""
    lines: list[list[_Tok]] = [[]]
    depth = 0
    for i, tok in enumerate(tokens):
        if tok.kind == "nl":
            following = next((t for t in tokens[i + 1 :] if t.kind != "nl"), None)
            if depth <= 0 and (following is None or following.text != "|"):
                lines.append([])
            continue
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(tok.text, 0)
        lines[-1].append(tok)
    return [line for line in lines if line]


def _derives(body: list[list[_Tok]], rules: dict[str, list[list[_Tok]]], known: set[str]) -> bool:
    """Whether one of a rule's definitions derives a string, given the rules `known` to."""
    for tokens in body:
        alternatives, end = _alternatives(tokens, 0, rules, known, 0)
        if end != len(tokens):
            raise _Unknown  # an unbalanced `)` or `]`
        if alternatives:
            return True
    return False


def _alternatives(
    tokens: list[_Tok], at: int, rules: dict[str, list[list[_Tok]]], known: set[str], depth: int
) -> tuple[bool, int]:
    """Whether any `|`-separated alternative from `at` derives; where the group ends."""
    if depth > _MAX_DEPTH:
        raise _Unknown
    any_derives, this_derives = False, True
    while at < len(tokens) and tokens[at].text not in (")", "]"):
        tok = tokens[at]
        if tok.text == "|":
            any_derives, this_derives = any_derives or this_derives, True
            at += 1
            continue
        item, at = _item(tokens, at, rules, known, depth)
        this_derives = this_derives and item
    return any_derives or this_derives, at


def _item(
    tokens: list[_Tok], at: int, rules: dict[str, list[list[_Tok]]], known: set[str], depth: int
) -> tuple[bool, int]:
    """Whether the item at `at` (with its quantifier) derives a string; where it ends."""
    tok = tokens[at]
    if tok.text in ("(", "["):
        inner, end = _alternatives(tokens, at + 1, rules, known, depth + 1)
        derives = inner or tok.text == "["  # [x]: x or nothing
        at = end + 1
    elif tok.kind == "name":
        derives = (
            tok.text in known or tok.text not in rules
        )  # terminals and templates' parameters derive
        at += 1
    else:
        derives, at = True, at + 1  # a literal, regex, token or what is not followed here
    quantifier = tokens[at].text if at < len(tokens) else ""
    if quantifier in ("?", "*", "~", "{}"):
        derives = True  # may be there no times (a repetition's count is not followed here)
    return derives, at


def _is_rule(name: str) -> bool:
    """Rules are named in lower case, terminals in upper case (either may start with `_`)."""
    return name.lstrip("_")[:1].islower()
