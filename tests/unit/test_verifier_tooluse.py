import json

import pytest

from sdpo_core.records import Verdict
from sdpo_core.verifiers.tooluse import (
    FORMAT_ERROR,
    FUNCTION_CALL_FORMAT_ERROR,
    TRUNCATED,
    FunctionCall,
    parse_function_calls,
    parse_react_steps,
    verify,
    verify_function_calls,
)


def steps_label(*steps: tuple[str, dict | str]) -> str:
    return json.dumps([{"Action": a, "Action_Input": i if isinstance(i, str) else json.dumps(i)} for a, i in steps])


TWO_STEPS = steps_label(("getCurrentWeather", {"city": "Lima"}), ("getForecast", {"city": "Lima", "days": 3}))
GOOD = (
    'Thought: first the current weather.\nAction: getCurrentWeather\nAction Input: {"city": "Lima"}\n'
    'Observation: sunny\nThought: now the forecast.\nAction: getForecast\nAction Input: {"city": "Lima", "days": 3}\n'
    "Final Answer: sunny now."
)


# -- ReAct steps ----------------------------------------------------------------------------------
def test_ordered_steps_matching_the_gold_score_one():
    assert verify(GOOD, TWO_STEPS, truncated=False) == Verdict(reward=1.0)


def test_same_steps_in_the_wrong_order_score_zero():
    swapped = (
        'Action: getForecast\nAction Input: {"city": "Lima", "days": 3}\n'
        'Action: getCurrentWeather\nAction Input: {"city": "Lima"}\n'
    )
    assert verify(swapped, TWO_STEPS, truncated=False) == Verdict(reward=0.0)


def test_each_input_pairs_with_the_latest_action_without_one():
    text = 'Action: a\nAction: b\nAction Input: {"x": 1}\nAction Input: {"y": 2}\n'
    assert parse_react_steps(text) == [("a", {"y": 2}), ("b", {"x": 1})]


def test_an_action_without_input_gets_an_empty_dict():
    text = "Action: getForecast\nAction Input: {}\nAction: getRandom\n"
    assert parse_react_steps(text) == [("getForecast", {}), ("getRandom", {})]
    label = steps_label(("getForecast", ""), ("getRandom", ""))
    assert verify(text, label, truncated=False).reward == 1.0


def test_an_input_may_start_on_a_later_line():
    text = 'Action: getForecast\nAction Input:\n\n  {"days": 3}\nAction: getRandom\nAction Input: \t{}\n'
    assert parse_react_steps(text) == [("getForecast", {"days": 3}), ("getRandom", {})]


def test_multiline_json_inputs_are_read_whole():
    text = 'Action: getForecast\nAction Input: {\n  "city": "Lima",\n  "days": 3\n}\n'
    assert parse_react_steps(text) == [("getForecast", {"city": "Lima", "days": 3})]


def test_input_values_must_match_exactly():
    text = (
        'Action: getCurrentWeather\nAction Input: {"city": "lima"}\n'
        'Action: getForecast\nAction Input: {"city": "Lima", "days": 3}'
    )
    assert verify(text, TWO_STEPS, truncated=False).reward == 0.0


def test_extra_or_missing_steps_score_zero():
    one = 'Action: getCurrentWeather\nAction Input: {"city": "Lima"}\n'
    assert verify(one, TWO_STEPS, truncated=False).reward == 0.0
    three = GOOD + '\nAction: getForecast\nAction Input: {"city": "Lima", "days": 3}'
    assert verify(three, TWO_STEPS, truncated=False).reward == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "",
        "I would call getForecast for Lima.",
        "Action: getForecast",
        'Action Input: {"city": "Lima"}',
        "Action:getForecast Action Input: {}",
    ],
)
def test_responses_without_an_action_line_followed_by_an_input_line_are_format_errors(response):
    verdict = verify(response, TWO_STEPS, truncated=False)
    assert verdict == Verdict(reward=0.0, feedback=FORMAT_ERROR, format_error=True)


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("Action: getForecast\nAction Input: {city: Lima}", "not valid JSON"),
        ("Action: getForecast\nAction Input: [1, 2]", "not a JSON object"),
        ("Action: getForecast\nAction Input: {}\nAction Input: {}", "no Action before it"),
        ("Action: ???\nAction Input: {}", "does not name a tool"),
    ],
)
def test_malformed_steps_are_format_errors_that_say_why(response, reason):
    verdict = verify(response, TWO_STEPS, truncated=False)
    assert verdict.format_error and verdict.reward == 0.0
    assert verdict.feedback.startswith(FORMAT_ERROR) and reason in verdict.feedback


def test_truncation_takes_priority():
    assert verify(GOOD, TWO_STEPS, truncated=True) == Verdict(reward=0.0, feedback=TRUNCATED, truncated=True)


def test_detailed_feedback_names_the_problem_without_gold_values():
    text = (
        'Action: getCurrentWeather\nAction Input: {"city": "Quito", "units": "metric"}\n'
        "Action: getHistory\nAction Input: {}"
    )
    feedback = verify(text, TWO_STEPS, truncated=False, detailed_feedback=True).feedback
    assert "the value 'Quito' of argument 'city' is not correct" in feedback
    assert "unexpected argument 'units'" in feedback
    assert "'getHistory' is not the right tool" in feedback
    assert "Lima" not in feedback and "getForecast" not in feedback


def test_detailed_feedback_reports_missing_arguments_and_steps():
    text = "Action: getCurrentWeather\nAction Input: {}"
    feedback = verify(text, TWO_STEPS, truncated=False, detailed_feedback=True).feedback
    assert "missing argument 'city'" in feedback
    assert "needs more tool calls" in feedback


def test_label_with_empty_string_input_means_no_arguments():
    assert verify("Action: ping\nAction Input: {}", steps_label(("ping", "")), truncated=False).reward == 1.0


@pytest.mark.parametrize(
    "label", ['{"Action": "x"}', '[{"Action_Input": "{}"}]', '[{"Action": "x", "Action_Input": "[1]"}]']
)
def test_malformed_labels_are_rejected(label):
    with pytest.raises(ValueError):
        verify("Action: x\nAction Input: {}", label, truncated=False)


# -- function calls (BFCL) ------------------------------------------------------------------------
AREA = {
    "name": "calculate_triangle_area",
    "parameters": {
        "type": "dict",
        "properties": {"base": {"type": "integer"}, "height": {"type": "integer"}, "unit": {"type": "string"}},
        "required": ["base", "height"],
    },
}
FACT = {"name": "math.factorial", "parameters": {"type": "dict", "properties": {"number": {"type": "integer"}}}}
SIMPLE = json.dumps(
    {
        "ground_truth": [{"calculate_triangle_area": {"base": [10], "height": [5], "unit": ["units", ""]}}],
        "functions": [AREA],
    }
)
PARALLEL = json.dumps(
    {"ground_truth": [{"math.factorial": {"number": [5]}}, {"math.factorial": {"number": [7]}}], "functions": [FACT]}
)
NO_CALL = json.dumps({"ground_truth": [], "functions": [AREA]})


@pytest.mark.parametrize(
    "response",
    [
        "[calculate_triangle_area(base=10, height=5)]",
        "calculate_triangle_area(base=10, height=5, unit='units')",
        "calculate_triangle_area(base=10, height=5, unit='Units')",  # strings compare case- and punctuation-insensitively
        '[{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}]',
        '{"name": "calculate_triangle_area", "arguments": "{\\"base\\": 10, \\"height\\": 5}"}',
        '{"calculate_triangle_area": {"base": 10, "height": 5}}',
        'Here you go:\n```json\n[{"name": "calculate_triangle_area", "parameters": {"base": 10, "height": 5}}]\n```',
        "```python\n[calculate_triangle_area(base=10, height=5)]\n```",
    ],
)
def test_accepted_calls_in_json_or_python_syntax_score_one(response):
    assert verify_function_calls(response, SIMPLE, truncated=False) == Verdict(reward=1.0)


def test_parallel_calls_match_in_any_order():
    response = "[math.factorial(number=7), math.factorial(number=5)]"
    assert verify_function_calls(response, PARALLEL, truncated=False).reward == 1.0


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("[calculate_triangle_area(base=10)]", "missing the required argument 'height'"),
        ("[calculate_triangle_area(base=10, height=5, color='red')]", "unexpected argument 'color'"),
        ("[calculate_triangle_area(base=12, height=5)]", "the value 12 of argument 'base'"),
        ("[calculate_triangle_area(base=10, height=5, unit='cm')]", "the value 'cm' of argument 'unit'"),
        (
            "[calculate_triangle_area(base='10', height=5)]",
            "argument 'base' of 'calculate_triangle_area' must be of type integer",
        ),
        ("[triangle_area(base=10, height=5)]", "'triangle_area' is not one of the available functions"),
        (
            "[calculate_triangle_area(base=10, height=5), calculate_triangle_area(base=10, height=5)]",
            "Expected 1 function call(s), got 2",
        ),
    ],
)
def test_wrong_calls_get_feedback_naming_the_problem(response, expected):
    verdict = verify_function_calls(response, SIMPLE, truncated=False)
    assert verdict.reward == 0.0 and not verdict.format_error
    assert expected in verdict.feedback


@pytest.mark.parametrize(
    "response",
    [
        "[calculate_triangle_area(base=12, height=5)]",
        "[calculate_triangle_area(base=10, height=5, unit='m')]",
        "[calculate_triangle_area(height=5)]",
        "[calculate_triangle_area(base=12.5, height=5)]",
    ],
)
def test_function_call_feedback_never_shows_accepted_values(response):
    feedback = verify_function_calls(response, SIMPLE, truncated=False).feedback
    assert "10" not in feedback and "units" not in feedback


def test_a_call_to_another_available_function_is_named_as_wrong():
    label = json.dumps({"ground_truth": [{"math.factorial": {"number": [5]}}], "functions": [AREA, FACT]})
    feedback = verify_function_calls("[calculate_triangle_area(base=1, height=2)]", label, truncated=False).feedback
    assert "'calculate_triangle_area' is not the right function to call here" in feedback


def test_parallel_feedback_points_at_the_call_that_is_wrong():
    feedback = verify_function_calls(
        "[math.factorial(number=5), math.factorial(number=8)]", PARALLEL, truncated=False
    ).feedback
    assert "the value 8 of argument 'number'" in feedback and "value 5" not in feedback


def test_declining_is_right_when_no_function_fits():
    assert verify_function_calls("I cannot help with that using these tools.", NO_CALL, truncated=False).reward == 1.0
    verdict = verify_function_calls("[calculate_triangle_area(base=1, height=1)]", NO_CALL, truncated=False)
    assert verdict.reward == 0.0 and "No function should be called" in verdict.feedback


@pytest.mark.parametrize("response", ["I think the area is 25.", "", "[1, 2, 3]"])
def test_no_calls_when_calls_are_needed_is_a_format_error(response):
    verdict = verify_function_calls(response, SIMPLE, truncated=False)
    assert verdict.format_error and verdict.reward == 0.0 and verdict.feedback.startswith(FUNCTION_CALL_FORMAT_ERROR)


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        ("[calculate_triangle_area(10, 5)]", "positional arguments"),
        ("[calculate_triangle_area(base=__import__('os').getcwd(), height=5)]", "not a literal"),
        ("[calculate_triangle_area(**{'base': 10})]", "**kwargs"),
        ('[{"name": "calculate_triangle_area", "arguments": "{oops"}]', "not valid JSON"),
    ],
)
def test_malformed_calls_are_format_errors_and_never_evaluated(response, reason):
    verdict = verify_function_calls(response, SIMPLE, truncated=False)
    assert verdict.format_error and reason in verdict.feedback


def test_truncated_function_calls_score_zero():
    assert verify_function_calls("[calculate_triangle_area(base=10, height=5)]", SIMPLE, truncated=True) == Verdict(
        reward=0.0, feedback=TRUNCATED, truncated=True
    )


def test_bool_is_not_accepted_for_an_integer_and_ints_are_not_bools():
    label = json.dumps({"ground_truth": [{"f": {"flag": [True], "n": [1]}}], "functions": []})
    assert verify_function_calls("f(flag=True, n=1)", label, truncated=False).reward == 1.0
    assert verify_function_calls("f(flag=1, n=True)", label, truncated=False).reward == 0.0


def test_nested_object_arguments_are_checked_key_by_key():
    label = json.dumps(
        {"ground_truth": [{"f": {"opts": [{"mode": ["fast", "quick"], "depth": [2, ""]}]}}], "functions": []}
    )
    assert verify_function_calls("f(opts={'mode': 'quick'})", label, truncated=False).reward == 1.0
    assert verify_function_calls("f(opts={'mode': 'slow'})", label, truncated=False).reward == 0.0


def test_parse_function_calls_reads_dotted_names_and_literals():
    assert parse_function_calls("[a.b(x=[1, 2], y={'k': None})]") == [
        FunctionCall("a.b", {"x": [1, 2], "y": {"k": None}})
    ]
    assert parse_function_calls("no calls here") is None


def test_malformed_function_call_labels_are_rejected():
    with pytest.raises(ValueError, match="ground_truth"):
        verify_function_calls("f()", json.dumps({"calls": []}), truncated=False)
    with pytest.raises(ValueError, match="ground-truth entry"):
        verify_function_calls("f()", json.dumps({"ground_truth": [{"f": [1]}]}), truncated=False)
