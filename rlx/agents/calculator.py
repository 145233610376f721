"""The `calculator` tool: exact arithmetic on an expression parsed with `ast`, never `eval`.

Accepted: integers and decimals (`12`, `0.1`, `2.5e3`), `+ - * / // % **`, unary `+ -` and
parentheses. Arithmetic is exact (`fractions.Fraction`), so `0.1 + 0.2` is `0.3`. The result is
written as:
- an integer when it is one: `6 * 7` -> `42`;
- an exact decimal when it terminates: `7 / 4` -> `1.75`;
- otherwise a reduced fraction with a 12-digit approximation: `1 / 3` -> `1/3 (≈ 0.333333333333)`.

Sizes are bounded so a model cannot stall a rollout with `9 ** 9 ** 9`: an exponent whose result
would pass `max_digits` digits is refused before it is computed, as is any intermediate number
that large. `//` and `%` follow Python (floor division; the remainder has the divisor's sign).
Errors (division by zero, a name, `^`) raise `ToolError` with a message the model can act on.
"""

from __future__ import annotations

import ast
import decimal
import math
from fractions import Fraction

from rlx.agents.tool import Tool, ToolError

_BITS_PER_DIGIT = math.log2(10)
MAX_DEPTH = 200  # nesting of operators: counted, not left to Python's recursion limit, which libraries raise
_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
    "required": ["expression"],
}


class Calculator(Tool):
    name = "calculator"
    description = ("Evaluates an arithmetic expression exactly. Supports + - * / // % ** and parentheses "
                   "on integers and decimals, e.g. \"(1234 + 5678) * 3 / 7\".")
    parameters = _PARAMETERS

    def __init__(self, max_digits: int = 1000, max_length: int = 2000) -> None:
        self.max_digits, self.max_length = max_digits, max_length

    def run(self, arguments: dict) -> str:
        return format_number(evaluate(arguments["expression"], self.max_digits, self.max_length))


def evaluate(expression: str, max_digits: int = 1000, max_length: int = 2000) -> Fraction:
    """The exact value of `expression`; ToolError says what is wrong with one it cannot compute."""
    if len(expression) > max_length:
        raise ToolError(f"Error: the expression has {len(expression)} characters; the limit is {max_length}.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        detail = getattr(exc, "msg", None) or str(exc) or type(exc).__name__
        raise ToolError(f"Error: cannot parse {expression!r} as arithmetic ({detail}).") from None
    return _Evaluator(expression, max_digits).value(tree.body)


class _Evaluator:
    def __init__(self, source: str, max_digits: int) -> None:
        self.source, self.max_digits = source.strip(), max_digits
        self.max_bits = int(max_digits * _BITS_PER_DIGIT) + 1  # a cheap bound, to refuse powers uncomputed
        self.bound = 10 ** max_digits  # the exact one: the smallest number with max_digits + 1 digits

    def value(self, node: ast.expr, depth: int = 0) -> Fraction:
        if depth > MAX_DEPTH:
            raise ToolError(f"Error: the expression is nested too deeply (more than {MAX_DEPTH} levels).")
        if isinstance(node, ast.Constant):
            return self._checked(self._literal(node))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            operand = self.value(node.operand, depth + 1)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
            return self._checked(self._binary(node.op, self.value(node.left, depth + 1),
                                              self.value(node.right, depth + 1)))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
            raise ToolError("Error: '^' is not a power here; write powers with ** (e.g. 2 ** 10).")
        shown = ast.get_source_segment(self.source, node) or type(node).__name__
        raise ToolError(f"Error: {shown!r} is not arithmetic; use numbers, + - * / // % ** and parentheses.")

    def _literal(self, node: ast.Constant) -> Fraction:
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"Error: {node.value!r} is not a number.")
        if isinstance(node.value, int):
            return Fraction(node.value)
        # A decimal from its own text, so that 0.1 is exactly 1/10 and not the nearest binary float;
        # through Decimal so that an exponent like 1e999999 is refused before 10**999999 is computed.
        text = (ast.get_source_segment(self.source, node) or repr(node.value)).replace("_", "")
        number = decimal.Decimal(text)
        if abs(number.adjusted()) > self.max_digits or len(number.as_tuple().digits) > self.max_digits:
            raise ToolError(f"Error: a number has more than {self.max_digits} digits.")
        return Fraction(number)

    def _binary(self, op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
        if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("Error: division by zero.")
        if isinstance(op, ast.Pow):
            return self._power(left, right)
        if isinstance(op, ast.Add):
            return left + right
        if isinstance(op, ast.Sub):
            return left - right
        if isinstance(op, ast.Mult):
            return left * right
        if isinstance(op, ast.Div):
            return left / right
        if isinstance(op, ast.FloorDiv):
            return Fraction(left // right)
        return left % right

    def _power(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise ToolError("Error: only whole-number exponents are supported (the result must be exact).")
        if base == 0 and exponent < 0:
            raise ToolError("Error: division by zero (0 raised to a negative power).")
        size = max(base.numerator.bit_length(), base.denominator.bit_length(), 1)
        if abs(base) != 1 and base != 0 and (size - 1) * abs(exponent.numerator) > self.max_bits:
            raise ToolError(f"Error: the result would have more than {self.max_digits} digits.")
        return base ** exponent.numerator

    def _checked(self, value: Fraction) -> Fraction:
        if abs(value.numerator) >= self.bound or value.denominator >= self.bound:
            raise ToolError(f"Error: a number in the calculation has more than {self.max_digits} digits.")
        return value


def format_number(value: Fraction) -> str:
    """An integer, an exact decimal when one exists, else `p/q (≈ decimal)`."""
    if value.denominator == 1:
        return str(value.numerator)
    twos, fives, rest = _factor_2_5(value.denominator)
    if rest == 1:  # a terminating decimal: scale to an integer and place the point
        places = max(twos, fives)
        scaled = abs(value.numerator) * 10 ** places // value.denominator
        digits = str(scaled).rjust(places + 1, "0")
        return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]
    with decimal.localcontext(prec=12):
        approx = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
    return f"{value.numerator}/{value.denominator} (≈ {approx})"


def _factor_2_5(n: int) -> tuple[int, int, int]:
    twos = (n & -n).bit_length() - 1
    n >>= twos
    fives = 0
    while n % 5 == 0:
        n //= 5
        fives += 1
    return twos, fives, n
