"""Math word problems with small numbers, one or two steps, for the `math` environment.

Rows: `{"prompt": "Mia has 7 apples. She gets 5 more. How many apples does Mia have now? Answer with a
number.", "answer": "12"}`. Answers are whole numbers >= 0; the environment takes the response's
`\\boxed{}`, `####` or last number (`env.math.answer_format`). Each operation's story, the
two-step question and the answer instruction come from seven templates each, two of them held out
of training (`phrasings`, `posttrain.data.generators.base.Phrasings`).
"""

from __future__ import annotations

import random
from typing import Optional, Sequence

from posttrain.data.generators.base import (
    Phrasings, Reply, check_choices, check_range, distinct_rows, register_task_generator, with_instruction,
)

NAMES = [("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Ben", "He"), ("Lily", "She"), ("Sam", "He"),
         ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Max", "He"), ("Nora", "She"), ("Jack", "He"),
         ("Ella", "She"), ("Omar", "He"), ("Ruby", "She"), ("Ivan", "He")]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards", "coins", "flowers",
         "eggs", "toy cars", "stamps", "balloons", "oranges", "candies"]

# One-step stories per operation: {name}, {he} / {him} (pronouns), {items}, {a}, {b}; the answer is a op b.
TEMPLATES = {
    "add": Phrasings(seen=(
        "{name} has {a} {items}. {he} gets {b} more. How many {items} does {name} have now?",
        "There are {a} {items} in a box. {name} puts in {b} more. How many {items} are in the box now?",
        "{name} found {a} {items} in the morning and {b} in the afternoon. How many {items} did {name} find in all?",
        "{name} buys {a} {items} and then {b} more. How many {items} did {name} buy altogether?",
        "A shelf holds {a} {items}. {name} adds {b} {items} to it. How many {items} are on the shelf now?",
    ), unseen=(
        "{name} collected {a} {items} on Monday and {b} on Tuesday. What is the total number of {items} {name} collected?",
        "{name} had {a} {items}, and a friend gave {him} {b} more. How many {items} does {name} have in total?",
    )),
    "sub": Phrasings(seen=(
        "{name} has {a} {items}. {he} gives {b} to a friend. How many {items} does {name} have left?",
        "There are {a} {items} on a table. {name} takes {b} of them. How many {items} are still on the table?",
        "{name} had {a} {items} and lost {b}. How many {items} does {name} have now?",
        "{name} starts with {a} {items} and uses {b} of them. How many {items} are left?",
        "A jar holds {a} {items}. {name} removes {b}. How many {items} remain in the jar?",
    ), unseen=(
        "{name} owned {a} {items} but sold {b} of them. How many {items} does {name} still own?",
        "Out of {a} {items}, {name} gave away {b}. How many {items} does {name} keep?",
    )),
    "mul": Phrasings(seen=(
        "{name} has {a} bags with {b} {items} in each bag. How many {items} does {name} have?",
        "There are {a} rows of {items} with {b} {items} in each row. How many {items} are there?",
        "{name} buys {a} packs of {items}. Each pack has {b} {items}. How many {items} does {name} buy?",
        "Each of {a} boxes holds {b} {items}. How many {items} are in the boxes altogether?",
        "{name} makes {a} piles of {items} with {b} {items} in each pile. How many {items} are in the piles?",
    ), unseen=(
        "{name} gets {b} {items} every day for {a} days. How many {items} does {name} get in total?",
        "There are {a} shelves, and every shelf has {b} {items}. How many {items} are on the shelves in all?",
    )),
    "div": Phrasings(seen=(
        "{name} shares {a} {items} equally among {b} friends. How many {items} does each friend get?",
        "{name} puts {a} {items} into {b} equal groups. How many {items} are in each group?",
        "There are {a} {items} packed equally into {b} boxes. How many {items} are in each box?",
        "{name} splits {a} {items} evenly between {b} bags. How many {items} end up in each bag?",
        "{name} has {a} {items} and gives the same number to each of {b} classmates. How many {items} does each "
        "classmate get?",
    ), unseen=(
        "If {a} {items} are shared equally by {b} children, how many {items} does each child receive?",
        "{name} arranges {a} {items} in {b} equal rows. How many {items} are in each row?",
    )),
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
FINAL_QUESTIONS = Phrasings(seen=(  # the question of a two-step problem
    "How many {items} does {name} have now?",
    "How many {items} does {name} have at the end?",
    "How many {items} does {name} end up with?",
    "What is the number of {items} {name} has now?",
    "Now how many {items} does {name} have?",
), unseen=(
    "In the end, how many {items} does {name} hold?",
    "After that, what is the count of {name}'s {items}?",
))
# How to answer. The math environment takes the last `\boxed{}`, else what follows `####`, else
# the last number (`answer_format: auto`), or only the last number (`last_number`): every reply
# below is scored correct by both.
INSTRUCTIONS = Phrasings(seen=(
    Reply("Answer with a number.", "{answer}"),
    Reply("Give the final answer in \\boxed{}.", "The answer is \\boxed{{{answer}}}."),
    Reply("End your reply with 'Answer: ' followed by the number.", "Answer: {answer}"),
    Reply("Reply with just the number.", "{answer}"),
    Reply("Explain briefly, then write the final answer after '####'.", "Counting them all gives {answer}.\n#### {answer}"),
), unseen=(
    Reply("Solve it and put the number at the very end of your reply.", "The answer is {answer}."),
    Reply("What is the answer? Write it as a number in \\boxed{}.", "\\boxed{{{answer}}}"),
))
OPERATIONS = tuple(TEMPLATES)
ORIGINAL_STORIES = {"add": 3, "sub": 3, "mul": 3, "div": 2}  # stories per operation before there were phrasings


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
    max_number: int = 20, steps: int = 1, instruction: Optional[str] = None, phrasings: str = "all",
) -> tuple[list[dict], list[dict]]:
    """Word problems about people, things and counts.

    Options:
        operations: any of `add`, `sub`, `mul`, `div` (default `[add, sub]`), drawn uniformly.
        max_number: the largest number in a sum or difference (default 20, 5..1000); factors,
            divisors and quotients stay at most 10.
        steps: 1 (default) or 2: a second step adds or takes away a few more.
        instruction: the sentence ending every prompt (default None: one of `INSTRUCTIONS`, drawn
            per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    ops = check_choices(operations, OPERATIONS, "operations")
    check_range(max_number, 5, 1000, "max_number")
    check_range(steps, 1, 2, "steps")

    def make_row(rng: random.Random, phrase) -> tuple:
        op = rng.choice(ops)
        name, he = rng.choice(NAMES)
        a, b, value = _operands(op, max_number, rng)
        fields = {"name": name, "he": he, "he_lower": he.lower(), "him": "him" if he == "He" else "her",
                  "items": rng.choice(ITEMS), "a": a, "b": b}
        if steps == 1:
            rng.randrange(ORIGINAL_STORIES[op])  # the story was drawn here once: kept, so a seed gives the same problems
            problem = (op, name, fields["items"], a, b)
            text = phrase(TEMPLATES[op]).format(**fields)
        else:
            second = "add" if value == 0 or rng.random() < 0.5 else "sub"
            c = rng.randint(1, max(1, max_number - value)) if second == "add" else rng.randint(1, value)
            value = value + c if second == "add" else value - c
            problem = (op, name, fields["items"], a, b, second, c)
            text = " ".join([FIRST_STATEMENTS[op].format(**fields), SECOND_STEPS[second].format(**fields, c=c),
                             phrase(FINAL_QUESTIONS).format(**fields)])
        return problem, {"prompt": with_instruction(text, phrase, INSTRUCTIONS, instruction), "answer": str(value)}

    return distinct_rows(num_train, num_validation, seed, make_row, "word_problems", phrasings)
