"""Verifier for math answers: final-answer extraction and numeric / symbolic comparison.

Final answer: the content of the last `\\boxed{…}` (or `\\fbox{…}`, nested braces allowed), else the
text after the last GSM8K-style `####`, else (only with `allow_last_number=True`) the last number in
the response. A label may be a bare answer, a whole GSM8K solution ending in `#### 72`, or a JSON
object `{"answer": "3.1416", "tolerance": {"abs": 1e-4, "rel": 0}}` for a real-valued answer.

Comparison, after normalisation (dollar signs, `\\left`/`\\right`, spacing commands, `\\text{}`
wrappers, thousands separators "1,000", a trailing unit word or `%`, "x = " prefixes):
1. as numbers: integers, decimals, scientific notation, `a/b`, `\\frac{a}{b}` (also `\\dfrac`,
   `\\tfrac`, `\\frac12`), exactly as fractions, never through a binary float. The expected
   value decides: "974067841" is not "974067840", nor is "9.74067841e8". Only a label that gives a
   `tolerance` (its answer is real-valued) accepts a number within max(abs, rel * |expected|);
2. as tuples: top-level comma lists compare element by element ("(1, 2)");
3. symbolically with sympy (`\\sqrt`, `\\pi`, powers, implicit products), only for short
   expressions made of whitelisted tokens, since sympy's parser evaluates its input; decimal
   literals are read as exact rationals there too ("1e20+1" is not 10^20);
4. else as normalised strings.

Feedback never reveals the expected answer unless `reveal_answer=True`.

Bounds (responses are adversarial): extraction is one linear pass over the response; an answer
longer than 1000 characters is only compared as text; numbers count only in ASCII digits (an
Arabic-Indic or fullwidth "٤٢" is not 42: the task asks for the answer as written in the
label's digits, and confusable digits would let a response match in a form no reader checks),
with at most 1000 digits and an exponent of at most 1000 in magnitude, so no comparison does
unbounded big-number work.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from functools import lru_cache

from sdpo_core.records import Verdict
from sdpo_core.verifiers.code_outputs import Tolerance, parse_tolerance

__all__ = [
    "FORMAT_ERROR",
    "TRUNCATED",
    "answers_match",
    "extract_final_answer",
    "normalise",
    "parse_label",
    "to_number",
    "verify",
]

TRUNCATED = "Your response was truncated because it exceeded the maximum length. Give the final answer earlier."
FORMAT_ERROR = (
    "Your answer had the wrong format. Put the final answer inside \\boxed{} (or after '#### ' on the last line)."
)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
_BOXED_TOKEN = re.compile(r"[^\s$]+")
_GSM8K = re.compile(r"####\s*([^\n]*)")
_LAST_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+", re.ASCII)
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_NUMBER_PARTS = re.compile(r"[+-]?(\d*)\.?(\d*)(?:[eE]([+-]?\d+))?", re.ASCII)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))", re.ASCII)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|~")
_UNIT_SUFFIX = re.compile(r"^(.*?\d)\s*(?:\\?%|\^\s*\{?\\circ\}?|°|[A-Za-z][A-Za-z ]*)$")
_SYMBOLIC_CHARS = re.compile(r"[A-Za-z0-9.+\-*/(),\s]*")
_SYMBOLIC_FUNCTIONS = frozenset({"sqrt", "pi", "oo", "log", "exp", "sin", "cos", "tan"})
_MAX_SYMBOLIC_CHARS = 120
_HUGE_LITERAL = re.compile(r"\d{51,}|\d[eE][+-]?\d{4,}", re.ASCII)  # sympy would expand 1e10000000 exactly
_MAX_EXPONENT = 1000
_MAX_ANSWER_CHARS = 1000
_MAX_DIGITS = 1000


def _braced(text: str, start: int) -> tuple[str, int] | None:
    """(content, end) of the brace group opening at text[start] == "{", or None when unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each "{" that is closed -> position of its "}" (one linear pass)."""
    stack: list[int] = []
    closing: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    return closing


def _last_boxed(text: str) -> str | None:
    """The content of the last closed `\boxed{...}` (or `\boxed 5`); linear in the text."""
    closing: dict[int, int] | None = None
    for m in reversed(list(_BOX.finditer(text))):
        if m.end() < len(text) and text[m.end()] == "{":
            if closing is None:
                closing = _closing_braces(text)
            end = closing.get(m.end())
            if end is not None:
                return text[m.end() + 1 : end]
        else:  # "\boxed 5"
            token = _BOXED_TOKEN.match(text, m.end())
            if token is not None:
                return token.group(0)
    return None


def extract_final_answer(text: str, *, allow_last_number: bool = False) -> str | None:
    """The response's final answer as text, or None when it gives none in a recognised form."""
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    marked: list[str] = _GSM8K.findall(text)
    if marked and marked[-1].strip():
        return marked[-1].strip()
    if allow_last_number:
        numbers: list[str] = _LAST_NUMBER.findall(text)
        if numbers:
            return numbers[-1]
    return None


def _replace_frac(text: str) -> str:
    """\\frac{a}{b} and \\frac12 -> (a)/(b), innermost-safe by repeated passes."""
    out = text
    for _ in range(20):
        m = re.search(r"\\[dt]?frac\s*", out)
        if m is None:
            return out
        i = m.end()
        parts = []
        for _ in range(2):
            if i < len(out) and out[i] == "{":
                group = _braced(out, i)
                if group is None:
                    return out
                parts.append(group[0])
                i = group[1]
            elif i < len(out) and out[i].isalnum():
                parts.append(out[i])
                i += 1
            else:
                return out
        out = out[: m.start()] + f"({parts[0]})/({parts[1]})" + out[i:]
    return out


def normalise(answer: str) -> str:
    """Canonical text of an answer: LaTeX noise, separators and units stripped."""
    s = answer.strip()
    boxed = _last_boxed(s)
    if boxed is not None:
        s = boxed
    elif "####" in s:
        s = s.rsplit("####", 1)[1]
    s = s.strip().strip("$").strip()
    s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
    s = _SPACING.sub("", s)
    s = _WRAPPERS.sub(r"\1", s)
    s = s.replace("\\$", "").replace("\\%", "%").replace("dfrac", "frac").replace("tfrac", "frac")
    s = _THOUSANDS.sub("", s)
    s = s.rstrip(".").strip()
    if re.match(r"^[A-Za-z]\s*=", s):  # "x = 5"
        s = s.split("=", 1)[1].strip()
    unit = _UNIT_SUFFIX.match(s)
    if unit is not None and to_number(unit.group(1)) is not None:
        s = unit.group(1).strip()
    return s


def _strip_outer_parens(s: str) -> str:
    """ "((x))" -> "x", but "(a)/(b)" stays whole."""
    while s.startswith("(") and s.endswith(")"):
        depth = 0
        for i, ch in enumerate(s):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0 and i < len(s) - 1:
                return s
        s = s[1:-1].strip()
    return s


def _bounded_fraction(text: str) -> Fraction | None:
    """Fraction(text) for an ASCII number within the digit and exponent bounds, else None."""
    parts = _NUMBER_PARTS.fullmatch(text)
    if _NUMBER.fullmatch(text) is None or parts is None:
        return None
    whole, decimals, exponent = parts.groups()
    if len(whole) + len(decimals) > _MAX_DIGITS or (
        exponent is not None and (len(exponent) > 6 or abs(int(exponent)) > _MAX_EXPONENT)
    ):
        return None
    return Fraction(text)


def to_number(text: str) -> Fraction | None:
    """The exact value of a plain number, a/b or \\frac{a}{b}; None for anything else (or too large)."""
    if len(text) > _MAX_ANSWER_CHARS:
        return None
    s = _replace_frac(text.strip().replace(" ", "")) if "frac" in text else text.strip().replace(" ", "")
    s = _strip_outer_parens(s.strip())
    sign = 1
    if s.startswith("-") and "/" in s:
        sign, s = -1, s[1:]
    if _NUMBER.fullmatch(s):
        return _bounded_fraction(s)
    m = re.fullmatch(r"\(?([+-]?[\d.]+)\)?/\(?([+-]?[\d.]+)\)?", s, re.ASCII)
    if m is None:
        return None
    numerator, denominator = _bounded_fraction(m.group(1)), _bounded_fraction(m.group(2))
    if numerator is None or denominator is None or denominator == 0:
        return None
    return sign * numerator / denominator


def _numbers_equal(answer: Fraction, expected: Fraction, tolerance: Tolerance | None) -> bool:
    """Equal values; within the label's tolerance of the expected value when it gives one."""
    if answer == expected:
        return True
    if tolerance is None:
        return False
    return abs(answer - expected) <= max(Fraction(tolerance.abs), Fraction(tolerance.rel) * abs(expected))


def parse_label(label: str) -> tuple[str, Tolerance | None]:
    """(expected answer, tolerance) of a label: a bare answer or a GSM8K solution (no tolerance), or
    `{"answer": ..., "tolerance": {"abs": x, "rel": y}}` for a real-valued answer."""
    text = label.strip()
    if not text.startswith("{"):
        return label, None
    try:
        data = json.loads(text)
    except ValueError:
        return label, None  # a set or a LaTeX group, "{1, 2}"
    if not isinstance(data, dict) or "answer" not in data:
        return label, None
    if set(data) - {"answer", "tolerance"} or not isinstance(data["answer"], str) or not data["answer"].strip():
        raise ValueError(
            f'a math label object is {{"answer": "...", "tolerance": {{"abs": x, "rel": y}}}}, got {label!r}'
        )
    return data["answer"], parse_tolerance(data.get("tolerance"), label="math")


def _split_top_level(s: str) -> list[str]:
    inner = s
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        inner = s[1:-1]
    parts, depth, current = [], 0, ""
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p.strip() for p in parts]


def _to_sympy_text(s: str) -> str | None:
    s = _replace_frac(s)
    s = re.sub(r"\\sqrt\s*\[([^\]]+)\]\s*\{([^{}]*)\}", r"((\2)**(1/(\1)))", s)
    s = re.sub(r"\\sqrt\s*\{", "sqrt{", s)
    s = re.sub(r"\\sqrt\s*(\d|[a-zA-Z])", r"sqrt(\1)", s)
    for latex, plain in (
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("\\pi", "pi"),
        ("\\infty", "oo"),
        ("\\ln", "log"),
        ("\\exp", "exp"),
        ("\\sin", "sin"),
        ("\\cos", "cos"),
        ("\\tan", "tan"),
    ):
        s = s.replace(latex, plain)
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    if not s.strip() or "\\" in s or len(s) > _MAX_SYMBOLIC_CHARS or _HUGE_LITERAL.search(s):
        return None
    if _SYMBOLIC_CHARS.fullmatch(s) is None or re.search(r"\.(?!\d)|(?<!\d)\.", s):
        return None
    if any(len(w) > 1 and w not in _SYMBOLIC_FUNCTIONS for w in re.findall(r"[A-Za-z]+", s)):
        return None  # only known functions and one-letter variables: parse_expr evaluates its input
    if not _balanced(s):
        return None  # sympy's implicit-multiplication pass indexes past the end on ")x(" (IndexError)
    return s


def _balanced(s: str) -> bool:
    """Whether every parenthesis in `s` closes one opened before it, and all are closed."""
    depth = 0
    for c in s:
        depth += (c == "(") - (c == ")")
        if depth < 0:
            return False
    return depth == 0


@lru_cache(maxsize=4096)
def _sympy_equal(a: str, b: str) -> bool:
    """Symbolic equality of two whitelisted expressions (sympy imported only when needed)."""
    import sympy
    from sympy.parsing.sympy_parser import (
        TokenError,
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        rationalize,
        standard_transformations,
    )

    names = {n: getattr(sympy, n) for n in ("sqrt", "pi", "oo", "log", "exp", "sin", "cos", "tan")}
    names.update({c: sympy.Symbol(c) for c in "abcdefghjklmnopqrstuvwxyzABCDFGHJKLMNOPQRSTUVWXYZ"})
    names.update({"e": sympy.E, "i": sympy.I, "E": sympy.E, "I": sympy.I})
    # rationalize: a decimal literal is the exact rational it denotes, never a binary float
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor, rationalize)
    # The input passed the token whitelist, so only these names can be referenced; no builtins.
    global_dict = {**{k: v for k, v in vars(sympy).items() if not k.startswith("_")}, "__builtins__": {}}
    try:
        left, right = (
            parse_expr(
                x,
                local_dict=dict(names),
                global_dict=dict(global_dict),
                transformations=transformations,
                evaluate=False,
            )
            for x in (a, b)
        )
    except (SyntaxError, TypeError, ValueError, AttributeError, ZeroDivisionError, sympy.SympifyError, TokenError):
        return False
    for expr in (left, right):
        if not isinstance(expr, sympy.Basic) or sympy.count_ops(expr) > 60:
            return False
        for power in expr.atoms(sympy.Pow):  # 9^9^9^9 would not finish: small flat exponents only
            exponent = power.exp
            nested = [p for p in exponent.atoms(sympy.Pow) if p.exp != -1]  # x**-1 is just a division
            if nested or any(abs(n) > _MAX_EXPONENT for n in exponent.atoms(sympy.Number)):
                return False
    try:
        return bool(sympy.simplify(left - right) == 0)
    except (TypeError, ValueError, ZeroDivisionError, RecursionError):
        return False


def answers_match(answer: str, expected: str, tolerance: Tolerance | None = None) -> bool:
    """Whether two final answers are the same value (see the module docstring for the rules);
    `tolerance` is the label's, for a real-valued answer."""
    if len(answer) > _MAX_ANSWER_CHARS:  # the label is trusted data; the answer is bounded
        return answer.strip() == normalise(expected)
    a, e = normalise(answer), normalise(expected)
    if a == e:
        return True
    na, ne = to_number(a), to_number(e)
    if na is not None and ne is not None:
        return _numbers_equal(na, ne, tolerance)
    parts_a, parts_e = _split_top_level(a), _split_top_level(e)
    if len(parts_e) > 1 or len(parts_a) > 1:
        return len(parts_a) == len(parts_e) and all(
            answers_match(x, y, tolerance) for x, y in zip(parts_a, parts_e, strict=True)
        )
    sa, se = _to_sympy_text(a), _to_sympy_text(e)
    if sa is not None and se is not None:
        return _sympy_equal(sa, se)
    return a.replace(" ", "").lower() == e.replace(" ", "").lower()


def verify(
    response_text: str,
    label: str,
    *,
    truncated: bool,
    allow_last_number: bool = False,
    reveal_answer: bool = False,
) -> Verdict:
    """Score one response against a final-answer label; 1.0 iff the final answers match.

    `allow_last_number` accepts the last number of an unmarked response as its answer;
    `reveal_answer` adds the expected answer to wrong-answer feedback.
    """
    if not label.strip():
        raise ValueError("the math label is empty")
    label, tolerance = parse_label(label)
    if truncated:
        return Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)
    answer = extract_final_answer(response_text, allow_last_number=allow_last_number)
    if answer is None:
        return Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    if answers_match(answer, label, tolerance):
        return Verdict(reward=1.0)
    shown = answer if len(answer) <= 100 else answer[:97] + "..."
    feedback = f"Your final answer {shown} is not correct."
    if reveal_answer:
        feedback += f" Expected: {normalise(label)}."
    return Verdict(reward=0.0, feedback=feedback)
