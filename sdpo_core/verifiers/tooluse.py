"""Verifiers for tool use: ReAct-style Action / Action Input steps, and JSON function calls.

`verify` (data sources `tooluse`, `toolalpaca`): the response is ReAct text ("Thought: …",
"Action: name", "Action Input: {json}"). Its steps are the ordered list of (action, input) pairs:
each Action Input is paired with the latest Action that has no input yet, and an Action left
without one gets `{}`. The reward is 1.0 iff that list equals the gold list exactly, order included
(the stricter check of the Relax port: the paper's own checker compared a multiset of names and a
merged dict, so order and per-step pairing did not matter). The response must also contain an
"Action: …" line directly followed by an "Action Input:" line. Label: JSON list of
`{"Action": name, "Action_Input": "<json object text>"}` (the paper's `answer` field).

`verify_function_calls` (data source `bfcl`): the response holds function calls, either as JSON
(`[{"name": f, "arguments": {...}}]`, one object, or `{f: {...}}`) or in Python call syntax
(`[f(a=1), g(b="x")]`), optionally in a fenced block. Label: JSON
`{"ground_truth": [{f: {arg: [accepted values...]}}], "functions": [JSON schemas]}` as the Berkeley
Function Calling Leaderboard stores it, where "" among the accepted values means the argument may
be left out, and an empty ground truth means no function should be called. Calls match in any order.

Bounds (responses are adversarial): parsing is linear in the response; JSON values nest at most
32 levels (deeper is a format error, never a RecursionError); Python-syntax calls are parsed only
up to 20,000 characters.

Feedback: format and truncation messages always. For wrong answers `verify` says nothing unless
`detailed_feedback=True`; `verify_function_calls` always explains. The explanations name the wrong
function, the missing or unexpected argument, or the value given that is not accepted; they never
print an expected value.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

from sdpo_core.records import Verdict

__all__ = [
    "FORMAT_ERROR",
    "FUNCTION_CALL_FORMAT_ERROR",
    "TRUNCATED",
    "FunctionCall",
    "check_function_calls",
    "parse_function_calls",
    "parse_react_steps",
    "verify",
    "verify_function_calls",
]

TRUNCATED = "Your response was truncated because it exceeded the maximum length. Make the tool calls earlier."
FORMAT_ERROR = (
    "Your answer had the wrong format. Each tool call must be written as a line 'Action: <tool name>' "
    "followed by a line 'Action Input: <JSON object>'."
)
FUNCTION_CALL_FORMAT_ERROR = (
    'Your answer had the wrong format. Give the function calls as JSON, [{"name": "<function>", '
    '"arguments": {...}}], or as Python calls, [function(argument=value)].'
)
_MAX_ISSUES = 5

_ACTION = re.compile(r"^[ \t]*Action[ \t]*:[ \t]*(.*)$", re.MULTILINE)
# group 1 (a lookahead, so matches do not move) is the whitespace before the JSON value
_ACTION_INPUT = re.compile(r"^[ \t]*Action[ \t]+Input[ \t]*:[ \t]*(?=(\s*))", re.MULTILINE)
_MAX_DEPTH = 32
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


# -- ReAct steps (ToolAlpaca) -----------------------------------------------------------------------
class _FormatError(ValueError):
    """The response cannot be read as tool calls; the message says why (shown as feedback)."""


def parse_react_steps(response_text: str) -> list[tuple[str, dict[str, Any]]]:
    """Ordered (action, input) pairs; raises ValueError (with the reason) on malformed steps."""
    events: list[tuple[int, str, Any]] = []
    for m in _ACTION.finditer(response_text):
        name = _NAME.match(m.group(1).strip().strip("`'\""))
        if name is None:
            raise _FormatError(f"'Action: {m.group(1).strip()[:60]}' does not name a tool.")
        events.append((m.start(), "action", name.group(0)))
    decoder = json.JSONDecoder()
    for m in _ACTION_INPUT.finditer(response_text):
        start = m.end(1)
        # the parser is called at once, before the loop moves on
        value = _decode_json(lambda: decoder.raw_decode(response_text, start)[0], "an Action Input")  # noqa: B023
        if not isinstance(value, dict):
            raise _FormatError(f"an Action Input is a JSON {type(value).__name__}, not a JSON object.")
        events.append((m.start(), "input", value))
    events.sort(key=lambda e: e[0])
    steps: list[list[Any]] = []
    open_steps: list[int] = []  # indices of steps without input yet, latest last
    for _, kind, value in events:
        if kind == "action":
            open_steps.append(len(steps))
            steps.append([value, None])
            continue
        if not open_steps:
            raise _FormatError("an Action Input has no Action before it.")
        steps[open_steps.pop()][1] = value
    return [(name, args if args is not None else {}) for name, args in steps]


def _has_call_lines(text: str) -> bool:
    """Whether a line containing "Action:" is directly followed by one starting "Action Input:"."""
    lines = text.split("\n")
    return any(
        "Action:" in line and following.startswith("Action Input:") for line, following in itertools.pairwise(lines)
    )


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            pending.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            pending.extend((v, depth + 1) for v in item)
    return deepest


def _decode_json(parse: Any, what: str) -> Any:
    """parse() for a JSON value in the response; a _FormatError when it is invalid or too deep."""
    try:
        value = parse()
    except json.JSONDecodeError as exc:
        raise _FormatError(f"{what} is not valid JSON ({exc.msg}).") from None
    except RecursionError:
        raise _FormatError(f"{what} nests JSON deeper than {_MAX_DEPTH} levels.") from None
    if _depth(value) > _MAX_DEPTH:
        raise _FormatError(f"{what} nests JSON deeper than {_MAX_DEPTH} levels.")
    return value


def _gold_steps(label: str) -> list[tuple[str, dict[str, Any]]]:
    gold = json.loads(label)
    if not isinstance(gold, list):
        raise ValueError(f"a tool-use label must be a JSON list of steps, got {type(gold).__name__}")
    steps = []
    for i, step in enumerate(gold):
        if not isinstance(step, dict) or "Action" not in step:
            raise ValueError(f"tool-use label step {i} must be an object with 'Action', got {step!r}")
        raw = step.get("Action_Input", "")
        args = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or {})
        if not isinstance(args, dict):
            raise ValueError(f"tool-use label step {i}: Action_Input must be a JSON object, got {raw!r}")
        steps.append((str(step["Action"]), args))
    return steps


def _step_issues(got: list[tuple[str, dict[str, Any]]], gold: list[tuple[str, dict[str, Any]]]) -> list[str]:
    issues = []
    for i, ((name, args), (gold_name, gold_args)) in enumerate(zip(got, gold, strict=False)):
        where = f"Step {i + 1}"
        if name != gold_name:
            issues.append(f"{where}: '{name}' is not the right tool for this step.")
            continue
        issues.extend(f"{where} ({name}): missing argument '{k}'." for k in gold_args if k not in args)
        issues.extend(f"{where} ({name}): unexpected argument '{k}'." for k in args if k not in gold_args)
        issues.extend(
            f"{where} ({name}): the value {_show(args[k])} of argument '{k}' is not correct."
            for k in gold_args
            if k in args and args[k] != gold_args[k]
        )
    if len(got) < len(gold):
        issues.append("The request needs more tool calls than you made.")
    elif len(got) > len(gold):
        issues.append("You made more tool calls than the request needs.")
    return issues


def verify(response_text: str, label: str, *, truncated: bool, detailed_feedback: bool = False) -> Verdict:
    """Score ReAct tool calls against the gold step list; 1.0 iff the ordered steps are equal.

    With `detailed_feedback` a wrong answer is explained step by step (without gold values);
    otherwise only format and truncation get feedback, as in the Relax port.
    """
    gold = _gold_steps(label)
    if truncated:
        return Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)
    if not _has_call_lines(response_text):
        return Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)
    try:
        steps = parse_react_steps(response_text)
    except _FormatError as exc:
        return Verdict(reward=0.0, feedback=f"{FORMAT_ERROR} Here {exc}", format_error=True)
    if steps == gold:
        return Verdict(reward=1.0)
    if not detailed_feedback:
        return Verdict(reward=0.0)
    issues = _step_issues(steps, gold)[:_MAX_ISSUES]
    return Verdict(reward=0.0, feedback="The tool calls are not right:\n" + "\n".join(issues))


# -- function calls (BFCL) -------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionCall:
    name: str
    arguments: dict[str, Any]


def _call_from_json(item: Any) -> FunctionCall:
    if not isinstance(item, dict):
        raise _FormatError(f"a call must be a JSON object, got {type(item).__name__}.")
    if "name" in item:
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):  # OpenAI style: arguments as JSON text
            args = _decode_json(lambda: json.loads(args), f"the arguments of '{item['name']}'") if args.strip() else {}
        if not isinstance(item["name"], str) or not isinstance(args, dict):
            raise _FormatError("each call needs a string 'name' and an object of 'arguments'.")
        return FunctionCall(item["name"], args)
    if len(item) == 1:
        ((name, args),) = item.items()
        if isinstance(args, dict):
            return FunctionCall(str(name), args)
    raise _FormatError('each call needs "name" and "arguments".')


def _dotted_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted_name(node.value)}.{node.attr}"
    raise _FormatError("a call must name a function.")


def _call_from_python(node: ast.expr) -> FunctionCall:
    if not isinstance(node, ast.Call):
        raise _FormatError("expected a list of function calls.")
    name = _dotted_name(node.func)
    if node.args:
        raise _FormatError(f"'{name}' is called with positional arguments; name every argument (argument=value).")
    args = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise _FormatError(f"'{name}' uses **kwargs; name every argument.")
        try:
            args[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise _FormatError(f"the value of argument '{keyword.arg}' of '{name}' is not a literal.") from None
    return FunctionCall(name, args)


def _parse_candidate(text: str) -> list[FunctionCall] | None:
    text = text.strip()
    if not text:
        return None
    if text[0] in "[{":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        except RecursionError:
            raise _FormatError(f"the calls nest JSON deeper than {_MAX_DEPTH} levels.") from None
        if value is not None and _depth(value) > _MAX_DEPTH:
            raise _FormatError(f"the calls nest JSON deeper than {_MAX_DEPTH} levels.")
        if value is not None:
            items = value if isinstance(value, list) else [value]
            return [_call_from_json(item) for item in items]
    if len(text) > 20_000:  # ast on huge adversarial text is slow; calls are never that long
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    if not nodes or not all(isinstance(n, ast.Call) for n in nodes):
        return None
    return [_call_from_python(n) for n in nodes]


def parse_function_calls(response_text: str) -> list[FunctionCall] | None:
    """The calls in a response (last fenced block first, then the whole text); None when there are none.

    Raises ValueError with the reason when something looks like calls but is malformed.
    """
    candidates = [*reversed(_FENCE.findall(response_text)), response_text]
    for candidate in candidates:
        calls = _parse_candidate(candidate)
        if calls is not None:
            return calls
    return None


_JSON_TYPES = {
    "integer": (int,),
    "float": (int, float),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list, tuple),
    "tuple": (list, tuple),
    "list": (list, tuple),
    "dict": (dict,),
    "object": (dict,),
}
_PUNCTUATION = str.maketrans("", "", " \t\n,./-_*^'\"")


def _normalise(value: Any) -> Any:
    if isinstance(value, str):
        return value.lower().translate(_PUNCTUATION)
    if isinstance(value, (list, tuple)):
        return [_normalise(v) for v in value]
    if isinstance(value, dict):
        return {k: _normalise(v) for k, v in value.items()}
    return value


def _accepted(value: Any, candidate: Any) -> bool:
    if isinstance(candidate, dict) and candidate and all(isinstance(v, list) for v in candidate.values()):
        # a nested object given as {key: [accepted values]}
        if not isinstance(value, dict) or set(value) - set(candidate):
            return False
        return all(
            ("" in options) if key not in value else any(_accepted(value[key], o) for o in options if o != "")
            for key, options in candidate.items()
        )
    if isinstance(value, bool) or isinstance(candidate, bool):
        return value is candidate
    if isinstance(value, (int, float)) and isinstance(candidate, (int, float)):
        return value == candidate
    return bool(_normalise(value) == _normalise(candidate))


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _call_issues(call: FunctionCall, expected: dict[str, list[Any]], schema: dict[str, Any] | None) -> list[str]:
    issues = []
    properties = (schema or {}).get("parameters", {}).get("properties", {})
    for arg in call.arguments:
        if arg not in expected:
            issues.append(f"'{call.name}' got an unexpected argument '{arg}'.")
    for arg, accepted in expected.items():
        if arg not in call.arguments:
            if "" not in accepted:
                issues.append(f"'{call.name}' is missing the required argument '{arg}'.")
            continue
        value = call.arguments[arg]
        declared = properties.get(arg, {}).get("type")
        python_types = _JSON_TYPES.get(declared) if isinstance(declared, str) else None
        if python_types is not None and (
            not isinstance(value, python_types) or (isinstance(value, bool) and bool not in python_types)
        ):
            issues.append(f"argument '{arg}' of '{call.name}' must be of type {declared}, got {_show(value)}.")
            continue
        if not any(_accepted(value, candidate) for candidate in accepted if candidate != ""):
            issues.append(f"the value {_show(value)} of argument '{arg}' of '{call.name}' is not accepted.")
    return issues


def check_function_calls(
    calls: list[FunctionCall], ground_truth: list[dict[str, dict[str, list[Any]]]], functions: list[dict[str, Any]]
) -> list[str]:
    """The problems with `calls` against BFCL ground truth (empty list: all correct)."""
    schemas = {f["name"]: f for f in functions}
    if not ground_truth:
        if calls:
            return [f"No function should be called for this request, but you called '{calls[0].name}'."]
        return []
    if len(calls) != len(ground_truth):
        return [f"Expected {len(ground_truth)} function call(s), got {len(calls)}."]
    issues: list[str] = []
    unused = list(range(len(calls)))
    for expected_call in ground_truth:
        ((name, expected_args),) = expected_call.items()
        same_name = [i for i in unused if calls[i].name == name]
        exact = next((i for i in same_name if not _call_issues(calls[i], expected_args, schemas.get(name))), None)
        if exact is not None:
            unused.remove(exact)
        elif same_name:
            unused.remove(same_name[0])
            issues.extend(_call_issues(calls[same_name[0]], expected_args, schemas.get(name)))
    # With equal counts, each expected function that got no call of its name left one other call unused.
    wrong = [
        f"'{calls[i].name}' is not one of the available functions."
        if schemas and calls[i].name not in schemas
        else f"'{calls[i].name}' is not the right function to call here."
        for i in unused
    ]
    return wrong + issues


def verify_function_calls(response_text: str, label: str, *, truncated: bool) -> Verdict:
    """Score function calls against BFCL-style ground truth; 1.0 iff every call is accepted."""
    spec = json.loads(label)
    if not isinstance(spec, dict) or not isinstance(spec.get("ground_truth"), list):
        raise ValueError(f"a function-call label must be a JSON object with a 'ground_truth' list, got {label[:200]!r}")
    ground_truth = spec["ground_truth"]
    for entry in ground_truth:
        if not (isinstance(entry, dict) and len(entry) == 1 and isinstance(next(iter(entry.values())), dict)):
            raise ValueError(f"each ground-truth entry must be {{function: {{argument: [values]}}}}, got {entry!r}")
    if truncated:
        return Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)
    try:
        calls = parse_function_calls(response_text)
    except _FormatError as exc:
        return Verdict(reward=0.0, feedback=f"{FUNCTION_CALL_FORMAT_ERROR} Here {exc}", format_error=True)
    if calls is None:
        if not ground_truth:
            return Verdict(reward=1.0)  # declining to call is the right answer
        return Verdict(reward=0.0, feedback=FUNCTION_CALL_FORMAT_ERROR, format_error=True)
    issues = check_function_calls(calls, ground_truth, spec.get("functions") or [])
    if not issues:
        return Verdict(reward=1.0)
    return Verdict(reward=0.0, feedback="Function call check failed:\n" + "\n".join(issues[:_MAX_ISSUES]))
