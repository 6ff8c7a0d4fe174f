"""A tiny, safe arithmetic evaluator for the calculator tool (no ``eval``).

Grammar (recursive descent)::

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/' | '//' | '%') unary)*
    unary  := ('+' | '-') unary | power
    power  := atom ('**' unary)?          # also '^'
    atom   := NUMBER | '(' expr ')'

Numbers are integers or decimals. Limits keep a hostile expression cheap: length, nesting
depth, exponent size and result magnitude. Everything else raises ``CalcError``.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

MAX_LEN = 200
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_ABS = 10**30

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\*\*|//|[-+*/%^()]))")


class CalcError(ValueError):
    """The expression is not valid arithmetic, or too large to evaluate."""


def _tokenize(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise CalcError(f"unexpected {text[pos : pos + 10]!r} at {pos}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str]):
        self.t = tokens
        self.i = 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalcError("unexpected end of expression")
        self.i += 1
        return tok

    def expr(self) -> Fraction:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise CalcError("expression nested too deeply")
        v = self.term()
        while self.peek() in ("+", "-"):
            v = v + self.term() if self.take() == "+" else v - self.term()
            _check(v)
        self.depth -= 1
        return v

    def term(self) -> Fraction:
        v = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()
            r = self.unary()
            if op == "*":
                v = v * r
            else:
                if r == 0:
                    raise CalcError("division by zero")
                if op == "/":
                    v = v / r
                elif op == "//":
                    v = Fraction(math.floor(v / r))
                else:
                    v = v - r * math.floor(v / r)
            _check(v)
        return v

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise CalcError("expression nested too deeply")
            sign = self.take()
            v = self.unary()
            self.depth -= 1
            return -v if sign == "-" else v
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() in ("**", "^"):
            self.take()
            exp = self.unary()
            if exp.denominator != 1:
                raise CalcError("only integer exponents are supported")
            if abs(exp) > MAX_EXPONENT:
                raise CalcError(f"exponent larger than {MAX_EXPONENT}")
            if base == 0 and exp < 0:
                raise CalcError("division by zero")
            base = base ** int(exp)
            _check(base)
        return base

    def atom(self) -> Fraction:
        tok = self.take()
        if tok == "(":
            v = self.expr()
            if self.take() != ")":
                raise CalcError("expected ')'")
            return v
        if tok[0].isdigit() or tok[0] == ".":
            return Fraction(tok)
        raise CalcError(f"unexpected {tok!r}")


def _check(v: Fraction) -> None:
    if abs(v) > MAX_ABS:
        raise CalcError("result too large")


def evaluate(text: str) -> Fraction:
    """The exact value of an arithmetic expression; raises ``CalcError``."""
    if not isinstance(text, str):
        raise CalcError("expression must be a string")
    if len(text) > MAX_LEN:
        raise CalcError(f"expression longer than {MAX_LEN} characters")
    tokens = _tokenize(text)
    if not tokens:
        raise CalcError("empty expression")
    p = _Parser(tokens)
    v = p.expr()
    if p.i != len(tokens):
        raise CalcError(f"unexpected {tokens[p.i]!r} after the expression")
    return v


def format_value(v: Fraction, digits: int = 10) -> str:
    """Integers exactly; other values as a decimal rounded to ``digits`` places."""
    if v.denominator == 1:
        return str(v.numerator)
    s = f"{float(v):.{digits}f}".rstrip("0").rstrip(".")
    return s if s not in ("-0", "") else "0"


def calculate(text: str) -> str:
    """``evaluate`` then ``format_value``: the tool's answer as text."""
    return format_value(evaluate(text))


__all__ = ["CalcError", "calculate", "evaluate", "format_value"]
