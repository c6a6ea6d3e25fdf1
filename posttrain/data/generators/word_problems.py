"""Math word problems with small numbers, one or two steps, for the `math` environment.

Rows: `{"prompt": "Mia has 7 apples. She gets 5 more. How many apples does Mia have now? Answer with a
number.", "answer": "12"}`. Answers are whole numbers >= 0; the environment takes the response's
`\\boxed{}`, `####` or last number (`env.math.answer_format`).
"""

from __future__ import annotations

import random
from typing import Sequence

from posttrain.data.generators.base import check_choices, check_range, distinct_rows, register_task_generator

NAMES = [("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Ben", "He"), ("Lily", "She"), ("Sam", "He"),
         ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Max", "He"), ("Nora", "She"), ("Jack", "He"),
         ("Ella", "She"), ("Omar", "He"), ("Ruby", "She"), ("Ivan", "He")]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "coins", "flowers",
         "eggs", "toy cars", "stamps", "balloons", "oranges", "candies"]

# One-step templates per operation: {name}, {he} (pronoun), {items}, {a}, {b}; the answer is a op b.
TEMPLATES = {
    "add": [
        "{name} has {a} {items}. {he} gets {b} more. How many {items} does {name} have now?",
        "There are {a} {items} in a box. {name} puts in {b} more. How many {items} are in the box now?",
        "{name} found {a} {items} in the morning and {b} in the afternoon. How many {items} did {name} find in all?",
    ],
    "sub": [
        "{name} has {a} {items}. {he} gives {b} to a friend. How many {items} does {name} have left?",
        "There are {a} {items} on a table. {name} takes {b} of them. How many {items} are still on the table?",
        "{name} had {a} {items} and lost {b}. How many {items} does {name} have now?",
    ],
    "mul": [
        "{name} has {a} bags with {b} {items} in each bag. How many {items} does {name} have?",
        "There are {a} rows of {items} with {b} {items} in each row. How many {items} are there?",
        "{name} buys {a} packs of {items}. Each pack has {b} {items}. How many {items} does {name} buy?",
    ],
    "div": [
        "{name} shares {a} {items} equally among {b} friends. How many {items} does each friend get?",
        "{name} puts {a} {items} into {b} equal groups. How many {items} are in each group?",
    ],
}
# Second steps (steps=2): {c} more, or {c} fewer; the first step's question is dropped.
SECOND_STEPS = {
    "add": "Then {he_lower} gets {c} more.",
    "sub": "Then {he_lower} gives away {c}.",
}
FIRST_STATEMENTS = {  # the first step as a statement, for two-step problems: value a op b
    "add": "{name} has {a} {items} and gets {b} more.",
    "sub": "{name} has {a} {items} and gives {b} to a friend.",
    "mul": "{name} has {a} bags with {b} {items} in each bag.",
    "div": "{name} splits {a} {items} into {b} equal piles and keeps one pile.",
}
OPERATIONS = tuple(TEMPLATES)


def _operands(op: str, max_number: int, rng: random.Random) -> tuple[int, int, int]:
    """(a, b, a op b), all in range: sums and differences up to max_number, factors up to 10."""
    if op == "add":
        a = rng.randint(1, max_number - 1)
        b = rng.randint(1, max_number - a)
        return a, b, a + b
    if op == "sub":
        a = rng.randint(2, max_number)
        b = rng.randint(1, a - 1)
        return a, b, a - b
    top = max(2, min(10, max_number))
    a, b = rng.randint(2, top), rng.randint(2, top)
    return (a, b, a * b) if op == "mul" else (a * b, b, a)


@register_task_generator("word_problems", env="math")
def word_problems(
    num_train: int, num_validation: int, seed: int, operations: Sequence[str] = ("add", "sub"),
    max_number: int = 20, steps: int = 1, instruction: str = "Answer with a number.",
) -> tuple[list[dict], list[dict]]:
    """Word problems about people, things and counts.

    Options:
        operations: any of `add`, `sub`, `mul`, `div` (default `[add, sub]`), drawn uniformly.
        max_number: the largest number in a sum or difference (default 20, 5..1000); factors,
            divisors and quotients stay at most 10.
        steps: 1 (default) or 2: a second step adds or takes away a few more.
        instruction: the sentence ending every prompt (default "Answer with a number."; "" for none).
    """
    ops = check_choices(operations, OPERATIONS, "operations")
    check_range(max_number, 5, 1000, "max_number")
    check_range(steps, 1, 2, "steps")

    def make_row(rng: random.Random) -> dict:
        op = rng.choice(ops)
        name, he = rng.choice(NAMES)
        a, b, value = _operands(op, max_number, rng)
        fields = {"name": name, "he": he, "he_lower": he.lower(), "items": rng.choice(ITEMS), "a": a, "b": b}
        if steps == 1:
            text = rng.choice(TEMPLATES[op]).format(**fields)
        else:
            second = "add" if value == 0 or rng.random() < 0.5 else "sub"
            c = rng.randint(1, max(1, max_number - value)) if second == "add" else rng.randint(1, value)
            value = value + c if second == "add" else value - c
            text = " ".join([FIRST_STATEMENTS[op].format(**fields), SECOND_STEPS[second].format(**fields, c=c),
                             "How many {items} does {name} have now?".format(**fields)])
        return {"prompt": f"{text} {instruction}".strip(), "answer": str(value)}

    return distinct_rows(num_train, num_validation, seed, make_row, "word_problems")
