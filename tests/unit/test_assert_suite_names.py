"""What preparation decides for an assert-style suite: the names its tests take from the answer, and
the helpers and imports the judge brings itself (tasks/data/formats/python_tests.py)."""

import pytest

from tasks.data.formats.python_tests import called_entry_points, missing_imports, prompt_helpers
from tasks.data.rows import BadRow

PROMPT = '''import math


def poly(xs: list, x: float):
    """Evaluates a polynomial."""
    return sum(c * math.pow(x, i) for i, c in enumerate(xs))


@staticmethod
def find_zero(xs: list):
    """Returns x such that poly(x) = 0."""


LIMIT = 3
'''


def test_the_prompt_helpers_are_the_prompt_without_the_entry_point():
    helpers = prompt_helpers(PROMPT, "find_zero")
    assert "def poly" in helpers and "import math" in helpers and "LIMIT = 3" in helpers
    assert "find_zero" not in helpers and "staticmethod" not in helpers
    with pytest.raises(BadRow, match="defines no function 'solve'"):
        prompt_helpers(PROMPT, "solve")


def test_the_entry_point_is_what_the_reference_defines_and_the_tests_call():
    tests = ["assert sum(10, 15) == 6", "assert sum(4, 6) == 3"]  # MBPP's task 126: a builtin's name
    assert called_entry_points(tests, "", "def sum(a, b):\n    return 0\ndef helper():\n    pass\n") == ["sum"]
    # without a reference: the names the tests read that nothing else binds
    tests = ["x = [1, 2]\nassert f(x) == g(2)", "assert len(f([])) == 0"]
    assert called_entry_points(tests, "def g(n):\n    return n\n", None) == ["f"]
    assert called_entry_points(tests, "", "not python (") == ["f", "g"]


def test_tests_that_call_nothing_of_the_answer_or_need_its_objects_are_refused():
    with pytest.raises(BadRow, match="cannot tell which function"):
        called_entry_points(["assert len([1]) == 1"], "", None)
    with pytest.raises(BadRow, match=r"answer's own \['Node'\]"):
        called_entry_points(
            ["assert height(root) == 1"], "root = Node(1)", "class Node:\n    pass\ndef height(t): pass"
        )
    with pytest.raises(BadRow, match="test 2 is not valid Python"):
        called_entry_points(["assert f(1) == 1", "assert f(("], "", None)


def test_modules_the_tests_use_without_importing_them_are_imported_by_the_setup():
    tests = ["assert math.isclose(area(2), 12.56, rel_tol=0.01)", "import re\nassert re.match('a', f('a'))"]
    assert missing_imports(tests, "", ["area", "f"]) == ["math"]
    assert missing_imports(tests, "import math", ["area", "f"]) == []
