"""The calculator tool: exact arithmetic on a parsed expression; every expected value is worked by hand."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlx.agents.calculator import Calculator, evaluate, format_number
from rlx.agents.tools import ToolBox, ToolError, build_tool


@pytest.mark.parametrize("expression,expected", [
    ("17 + 25", "42"),
    ("1234 + 5678 + 91 + 3456", "10459"),
    ("(1234 + 5678) * 3 / 7", "20736/7 (≈ 2962.28571429)"),  # 6912 * 3 = 20736, not a multiple of 7
    ("7 / 4", "1.75"),
    ("-7 / 4", "-1.75"),
    ("1 / 3", "1/3 (≈ 0.333333333333)"),
    ("-2 / 6", "-1/3 (≈ -0.333333333333)"),
    ("0.1 + 0.2", "0.3"),  # exact, where binary floats give 0.30000000000000004
    ("2.5e-3 * 4", "0.01"),
    ("1e3", "1000"),
    ("7 // 2", "3"),
    ("7 // -2", "-4"),  # floor division, as in Python
    ("-7 % 3", "2"),  # the remainder takes the divisor's sign
    ("7 % -3", "-2"),
    ("2 ** 10", "1024"),
    ("2 ** -2", "0.25"),
    ("(2 / 3) ** 2", "4/9 (≈ 0.444444444444)"),
    ("2 ** 3 ** 2", "512"),  # right-associative: 2 ** 9
    ("-3 ** 2", "-9"),  # unary minus binds looser than **
    ("+-+5", "-5"),
    ("  ( 1 + 2 ) * ( 3 + 4 ) ", "21"),
    ("1 ** 100000", "1"),  # exponent size does not matter when the base is 1
    ("10 ** 999", "1" + "0" * 999),  # 1000 digits: the limit itself is fine
])
def test_exact_results(expression, expected):
    assert format_number(evaluate(expression)) == expected


@pytest.mark.parametrize("expression,message", [
    ("1 / 0", "division by zero"),
    ("5 // (2 - 2)", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("10 ** 1000", "more than 1000 digits"),  # 1001 digits
    ("9 ** 9 ** 9", "more than 1000 digits"),  # refused before it is computed
    ("1e5000", "more than 1000 digits"),
    ("(10 ** 600) * (10 ** 600)", "more than 1000 digits"),
    ("4 ** 0.5", "whole-number exponents"),
    ("2 ^ 3", "write powers with **"),
    ("x + 1", "'x' is not arithmetic"),
    ("__import__('os').system('true')", "is not arithmetic"),
    ("'a' * 3", "is not a number"),
    ("1, 000", "is not arithmetic"),
    ("(1 + 2", "cannot parse"),
    ("", "cannot parse"),
    ("-" * 1500 + "1", "nested too deeply"),
])
def test_refusals_say_why(expression, message):
    with pytest.raises(ToolError, match="Error: .*" + message.replace("*", r"\*").replace("(", r"\(")):
        evaluate(expression)


def test_result_is_a_fraction_not_a_float():
    assert evaluate("1 / 3 * 3") == 1
    assert evaluate("0.1 * 3") == Fraction(3, 10)


def test_length_and_digit_limits_are_options():
    with pytest.raises(ToolError, match="the limit is 10"):
        evaluate("1 + 2 + 3 + 4", max_length=10)
    with pytest.raises(ToolError, match="more than 5 digits"):
        evaluate("999 * 999", max_digits=5)  # 998001: 6 digits
    assert evaluate("99 * 999", max_digits=5) == 98901


def test_through_the_toolbox():
    box = ToolBox([build_tool("calculator")])
    assert box.specs() == [Calculator().spec()]
    assert box.specs()[0]["function"]["parameters"]["required"] == ["expression"]
    ok = box.call("calculator", {"expression": "6 * 7"})
    assert (ok.text, ok.outcome) == ("42", "ok")
    failed = box.call("calculator", {"expression": "1 / 0"})
    assert (failed.text, failed.outcome) == ("Error: division by zero.", "error")
    assert box.call("calculator", {"expr": "1"}).outcome == "bad_arguments"


def test_nesting_is_bounded_by_count_not_by_the_recursion_limit():
    import sys

    assert evaluate("-" * 150 + "1") == 1
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)  # as some libraries raise it: the bound must not move with it
    try:
        with pytest.raises(ToolError, match="nested too deeply"):
            evaluate("-" * 1500 + "1")
    finally:
        sys.setrecursionlimit(before)
