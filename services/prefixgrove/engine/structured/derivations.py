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
from collections import deque
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


# A rule's body as a formula over rule names: True (derives a string), a rule's name (derives once
# that rule does), or ("all", parts) / ("any", parts).
Formula = bool | str | tuple[str, list["Formula"]]


def rules_deriving_nothing(lark: str) -> list[str]:
    """The rules of `lark` that derive no string, if its start rule is among them (else []),
    start first; [] too where the grammar is not understood well enough to tell."""
    try:
        bodies = _rules(_tokens(lark))
        names = set(bodies)
        formulas = {name: _formula(body, names) for name, body in bodies.items()}
    except _Unknown:
        return []
    if _START not in formulas:
        return []
    deriving = _deriving(formulas)
    if _START in deriving:
        return []
    return sorted(set(formulas) - deriving, key=lambda name: (name != _START, name))


def _deriving(formulas: dict[str, Formula]) -> set[str]:
    """The rules that derive a string: each rule is looked at again only when a rule its body
    names is found to derive, so a long chain of rules costs its length, not its square."""
    users: dict[str, set[str]] = {}
    for name, formula in formulas.items():
        for used in _names(formula):
            users.setdefault(used, set()).add(name)
    deriving: set[str] = set()
    pending = deque(formulas)
    while pending:
        name = pending.popleft()
        if name not in deriving and _holds(formulas[name], deriving):
            deriving.add(name)
            pending.extend(users.get(name, ()))
    return deriving


def _holds(formula: Formula, deriving: set[str]) -> bool:
    if isinstance(formula, bool):
        return formula
    if isinstance(formula, str):
        return formula in deriving
    kind, parts = formula
    test = all if kind == "all" else any
    return test(_holds(part, deriving) for part in parts)


def _names(formula: Formula) -> set[str]:
    if isinstance(formula, bool):
        return set()
    if isinstance(formula, str):
        return {formula}
    return set().union(*(_names(part) for part in formula[1]))


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
    """Each rule's definitions (as token lists); terminals and directives are left out."""
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
            j = i + 1
            while j < len(tokens) and tokens[j].kind == "nl":
                j += 1
            if depth <= 0 and (j == len(tokens) or tokens[j].text != "|"):
                lines.append([])
            continue
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(tok.text, 0)
        lines[-1].append(tok)
    return [line for line in lines if line]


def _formula(body: list[list[_Tok]], rules: set[str]) -> Formula:
    """A rule's definitions as one formula (any of them)."""
    parts: list[Formula] = []
    for tokens in body:
        formula, end = _alternatives(tokens, 0, rules, 0)
        if end != len(tokens):
            raise _Unknown  # an unbalanced `)` or `]`
        parts.append(formula)
    return ("any", parts)


def _alternatives(tokens: list[_Tok], at: int, rules: set[str], depth: int) -> tuple[Formula, int]:
    """The `|`-separated alternatives from `at` as one formula; where the group ends."""
    if depth > _MAX_DEPTH:
        raise _Unknown
    alternatives: list[Formula] = []
    items: list[Formula] = []
    while at < len(tokens) and tokens[at].text not in (")", "]"):
        if tokens[at].text == "|":
            alternatives.append(("all", items))
            items, at = [], at + 1
            continue
        item, at = _item(tokens, at, rules, depth)
        items.append(item)
    alternatives.append(("all", items))
    return ("any", alternatives), at


def _item(tokens: list[_Tok], at: int, rules: set[str], depth: int) -> tuple[Formula, int]:
    """The item at `at` (with its quantifier) as a formula; where it ends."""
    tok = tokens[at]
    item: Formula
    if tok.text in ("(", "["):
        inner, end = _alternatives(tokens, at + 1, rules, depth + 1)
        item = True if tok.text == "[" else inner  # [x]: x or nothing
        at = end + 1
    elif tok.kind == "name" and tok.text in rules:
        item, at = tok.text, at + 1
    else:  # a literal, regex, token, terminal, template parameter, or what is not followed here
        item, at = True, at + 1
    quantifier = tokens[at].text if at < len(tokens) else ""
    if quantifier in ("?", "*", "~", "{}"):
        item = True  # may be there no times (a repetition's count is not followed here)
    return item, at


def _is_rule(name: str) -> bool:
    """Rules are named in lower case, terminals in upper case (either may start with `_`)."""
    return name.lstrip("_")[:1].islower()
