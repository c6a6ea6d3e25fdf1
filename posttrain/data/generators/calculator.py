"""Arithmetic with numbers large enough to want a calculator, for the `tools` environment.

Rows: `{"prompt": "What is 347 * 29? Use the calculator, then give the number in \\boxed{}.",
"answer": "10063", "expression": "347 * 29"}`. The environment offers its tools (`env.tools.tools`,
default the calculator) through the prompt, runs the model's `<tool_call>`s and grades the final
answer like the math environment. Results are whole numbers >= 0 (divisions are exact). The
question and the instruction come from seven templates each, two of them held out of training
(`phrasings`, `posttrain.data.generators.base.Phrasings`).
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

from posttrain.data.generators.base import (
    Phrasings, Reply, check_choices, check_range, distinct_rows, register_task_generator, with_instruction,
)

SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
QUESTIONS = Phrasings(seen=(
    "What is {expression}?", "Compute {expression}.", "Calculate {expression}.", "Find the value of {expression}.",
    "Work out {expression}.",
), unseen=("How much is {expression}?", "Evaluate the expression {expression}."))
# How to use the tool and answer: the final answer is graded like the math environment's (`\boxed{}`,
# else `####`, else the last number), so each reply below is scored correct.
INSTRUCTIONS = Phrasings(seen=(
    Reply("Use the calculator, then give the number in \\boxed{}.", "The result is \\boxed{{{answer}}}."),
    Reply("Call the calculator tool, then reply with the result in \\boxed{}.", "\\boxed{{{answer}}}"),
    Reply("Check it with the calculator tool and end your reply with the number.", "The answer is {answer}."),
    Reply("Use the calculator tool first; then answer with just the number.", "{answer}"),
    Reply("Get the result from the calculator, then write 'Answer: ' and the number.", "Answer: {answer}"),
), unseen=(
    Reply("First ask the calculator, then state the result in \\boxed{}.", "\\boxed{{{answer}}}"),
    Reply("Let the calculator tool do the arithmetic and reply with the final number.", "It is {answer}."),
))


def _step(value: int, op: str, digits: int, rng: random.Random) -> Optional[tuple[int, int]]:
    """(operand, new value) of applying `op` to `value` with a new operand of at most `digits`
    digits (at least 2), or None when no operand keeps the result a whole number >= 0."""
    top = 10**digits - 1
    if op == "add":
        c = rng.randint(2, top)
        return c, value + c
    if op == "mul":
        c = rng.randint(2, min(top, 99))  # keeps products readable
        return c, value * c
    if op == "sub":
        if value < 3:
            return None
        c = rng.randint(2, min(top, value - 1))
        return c, value - c
    divisors = [c for c in range(2, min(top, 99) + 1) if value % c == 0 and value // c > 1]
    if not divisors:
        return None
    c = rng.choice(divisors)
    return c, value // c


@register_task_generator("calculator", env="tools")
def calculator(
    num_train: int, num_validation: int, seed: int, operations: Sequence[str] = ("add", "sub", "mul", "div"),
    num_digits: int = 3, num_operands: int = 2, instruction: Optional[str] = None, phrasings: str = "all",
) -> tuple[list[dict], list[dict]]:
    """`What is <expression>?` for an expression of integers, worked left to right (parenthesised
    where precedence would say otherwise).

    Options:
        operations: any of `add`, `sub`, `mul`, `div` (default all), drawn uniformly per step;
            multipliers and divisors stay at most 99, divisions are exact.
        num_digits: digits of the first number and of added or subtracted ones (default 3, 2..6).
        num_operands: numbers in the expression (default 2, 2..4).
        instruction: the sentence ending every prompt (default None: one of `INSTRUCTIONS`, drawn
            per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    ops = check_choices(operations, tuple(SYMBOLS), "operations")
    check_range(num_digits, 2, 6, "num_digits")
    check_range(num_operands, 2, 4, "num_operands")

    def make_row(rng: random.Random, phrase) -> tuple:
        while True:  # redraw until every step keeps a whole number >= 0
            first_op = rng.choice(ops)
            if first_op == "div":  # a multiple of a small divisor, so the first division is exact
                value = rng.randint(2, 99) * rng.randint(2, max(2, (10**num_digits - 1) // 99))
            else:
                value = rng.randint(10 ** (num_digits - 1), 10**num_digits - 1)
            expression, last, op = str(value), None, first_op
            for i in range(num_operands - 1):
                op = first_op if i == 0 else rng.choice(ops)
                step = _step(value, op, num_digits, rng)
                if step is None:
                    break
                operand, value = step
                if last in ("add", "sub") and op in ("mul", "div"):
                    expression = f"({expression})"
                expression, last = f"{expression} {SYMBOLS[op]} {operand}", op
            else:
                text = phrase(QUESTIONS).format(expression=expression)
                return expression, {"prompt": with_instruction(text, phrase, INSTRUCTIONS, instruction),
                                    "answer": str(value), "expression": expression}

    return distinct_rows(num_train, num_validation, seed, make_row, "calculator", phrasings)
