"""Safe arithmetic for the built-in tasks: a tokenizer and recursive-descent parser, no ``eval``.

Grammar (standard precedence, left associative, exact rational arithmetic)::

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := NUMBER | '(' expr ')'

Only the characters ``0-9 + - * / ( )`` and spaces are accepted; anything else, a
malformed expression, a division by zero, more than ``MAX_LEN`` characters or nesting
deeper than ``MAX_DEPTH`` is a :class:`ArithError`. Numbers are non-negative integers of at
most 4 digits (a leading ``-`` is not part of the grammar: ``-3+5`` is malformed), so no
input can make the parser slow or huge.

>>> evaluate("3+4*2-5")
Fraction(6, 1)
>>> evaluate("(3+5)*2"), numbers("(3+5)*2")
(Fraction(16, 1), [3, 5, 2])
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_LEN, MAX_DEPTH = 64, 8
_TOKEN = re.compile(r"\s*(\d{1,4}|[-+*/()])")
_ALLOWED = set("0123456789+-*/() ")


class ArithError(ValueError):
    """Not a well-formed expression (see the module docstring)."""


def tokens(text: str) -> list[str]:
    if len(text) > MAX_LEN or not set(text) <= _ALLOWED:
        raise ArithError("characters outside 0-9 + - * / ( ) or too long")
    out, pos, text = [], 0, text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ArithError(f"bad token at {pos}")
        out.append(m.group(1))
        pos = m.end()
    if not out:
        raise ArithError("empty")
    return out


def evaluate(text: str) -> Fraction:
    """The exact value of ``text``; raises :class:`ArithError` when it is not well formed."""
    toks = tokens(text)
    value, pos = _expr(toks, 0, 0)
    if pos != len(toks):
        raise ArithError(f"unexpected {toks[pos]!r}")
    return value


def numbers(text: str) -> list[int]:
    """The integer literals of ``text``, in order (call after :func:`evaluate` succeeded)."""
    return [int(t) for t in tokens(text) if t.isdigit()]


def _expr(toks: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    value, pos = _term(toks, pos, depth)
    while pos < len(toks) and toks[pos] in "+-":
        op = toks[pos]
        rhs, pos = _term(toks, pos + 1, depth)
        value = value + rhs if op == "+" else value - rhs
    return value, pos


def _term(toks: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    value, pos = _factor(toks, pos, depth)
    while pos < len(toks) and toks[pos] in "*/":
        op = toks[pos]
        rhs, pos = _factor(toks, pos + 1, depth)
        if op == "/" and rhs == 0:
            raise ArithError("division by zero")
        value = value * rhs if op == "*" else value / rhs
    return value, pos


def _factor(toks: list[str], pos: int, depth: int) -> tuple[Fraction, int]:
    if pos >= len(toks):
        raise ArithError("expression ends early")
    t = toks[pos]
    if t.isdigit():
        return Fraction(int(t)), pos + 1
    if t == "(":
        if depth >= MAX_DEPTH:
            raise ArithError("nested too deep")
        value, pos = _expr(toks, pos + 1, depth + 1)
        if pos >= len(toks) or toks[pos] != ")":
            raise ArithError("missing ')'")
        return value, pos + 1
    raise ArithError(f"unexpected {t!r}")
