"""One-line Python functions to write, with tests, for the `code` environment.

Rows: `{"prompt": "Write a Python function `add_7(x)` that returns x plus 7. Put the code in a
```python block.", "answer": "```python\\ndef add_7(x):\\n    return x + 7\\n```", "fn_name": "add_7",
"tests": [{"input": [3], "output": 10}, ...]}`: function-call tests (`input` is the argument list,
`output` the return value), computed by running the reference solution (the `answer`) here. The
task and the instruction saying where to put the code come from seven templates each, two of them
held out of training (`phrasings`, `posttrain.data.generators.base.Phrasings`); the `answer` is the
solution in a ```python block, which scores 1 whichever instruction was drawn.
"""

from __future__ import annotations

import random
import string
from typing import Optional, Sequence

from posttrain.data.generators.base import (
    Phrasings, Reply, check_choices, check_range, distinct_rows, register_task_generator, with_instruction,
)

# (kind of arguments, name, parameters, what it returns, the body's expression, the constants {k} / {j} range over)
# Constants are integers from a range, letters, or words; `None`: no constant.
LETTERS = list(string.ascii_lowercase)
SUFFIXES = ["s", "ed", "ing", "er", "ly", "ful", "less", "ness", "!", "?"]
WORDS = ["apple", "river", "stone", "banana", "cloud", "tiger", "pencil", "garden", "moon", "rocket", "yellow",
         "piano", "lemon", "window", "silver", "dragon", "coffee", "planet", "summer", "orange"]
TEMPLATES: list[tuple[str, str, str, str, str, Optional[Sequence], Optional[Sequence]]] = [
    ("number", "add_{k}", "x", "returns x plus {k}", "x + {k}", range(1, 1000), None),
    ("number", "subtract_{k}", "x", "returns x minus {k}", "x - {k}", range(1, 1000), None),
    ("number", "subtract_from_{k}", "x", "returns {k} minus x", "{k} - x", range(1, 1000), None),
    ("number", "times_{k}", "x", "returns x multiplied by {k}", "x * {k}", range(2, 100), None),
    ("number", "remainder_{k}", "x", "returns the remainder when x is divided by {k}", "x % {k}", range(2, 100), None),
    ("number", "is_above_{k}", "x", "returns True if x is greater than {k}, otherwise False", "x > {k}", range(0, 1000), None),
    ("number", "is_below_{k}", "x", "returns True if x is less than {k}, otherwise False", "x < {k}", range(0, 1000), None),
    ("number", "is_equal_to_{k}", "x", "returns True if x equals {k}, otherwise False", "x == {k}", range(0, 1000), None),
    ("number", "is_multiple_of_{k}", "x", "returns True if x is divisible by {k}, otherwise False", "x % {k} == 0",
     range(2, 100), None),
    ("number", "at_most_{k}", "x", "returns the smaller of x and {k}", "min(x, {k})", range(1, 1000), None),
    ("number", "at_least_{k}", "x", "returns the larger of x and {k}", "max(x, {k})", range(1, 1000), None),
    ("number", "line_{k}_{j}", "x", "returns {k} times x plus {j}", "{k} * x + {j}", range(2, 10), range(1, 100)),
    ("number", "square", "x", "returns x squared", "x * x", None, None),
    ("number", "is_even", "x", "returns True if x is even, otherwise False", "x % 2 == 0", None, None),
    ("number", "absolute", "x", "returns the absolute value of x", "abs(x)", None, None),
    ("number", "negate", "x", "returns x with its sign flipped", "-x", None, None),
    ("number", "add", "a, b", "returns the sum of a and b", "a + b", None, None),
    ("number", "larger", "a, b", "returns the larger of a and b", "max(a, b)", None, None),
    ("number", "product", "a, b", "returns a multiplied by b", "a * b", None, None),
    ("number", "difference", "a, b", "returns a minus b", "a - b", None, None),
    ("text", "repeat_{k}", "s", "returns the string s repeated {k} times", "s * {k}", range(2, 6), None),
    ("text", "first_{k}", "s", "returns the first {k} characters of the string s", "s[:{k}]", range(1, 6), None),
    ("text", "last_{k}", "s", "returns the last {k} characters of the string s", "s[-{k}:]", range(1, 6), None),
    ("text", "count_{k}", "s", "returns how many times the letter '{k}' appears in the string s", "s.count('{k}')",
     LETTERS, None),
    ("text", "starts_with_{k}", "s", "returns True if the string s starts with the letter '{k}', otherwise False",
     "s.startswith('{k}')", LETTERS, None),
    ("text", "ends_with_{k}", "s", "returns True if the string s ends with the letter '{k}', otherwise False",
     "s.endswith('{k}')", LETTERS, None),
    ("text", "with_suffix_{i}", "s", "returns the string s followed by '{k}'", "s + '{k}'", SUFFIXES, None),
    ("text", "shout", "s", "returns the string s in upper case", "s.upper()", None, None),
    ("text", "reverse", "s", "returns the string s reversed", "s[::-1]", None, None),
    ("text", "length", "s", "returns the number of characters in the string s", "len(s)", None, None),
    ("list", "total", "xs", "returns the sum of the numbers in the list xs", "sum(xs)", None, None),
    ("list", "largest", "xs", "returns the largest number in the non-empty list xs", "max(xs)", None, None),
    ("list", "smallest", "xs", "returns the smallest number in the non-empty list xs", "min(xs)", None, None),
    ("list", "first_item", "xs", "returns the first number of the non-empty list xs", "xs[0]", None, None),
    ("list", "sorted_numbers", "xs", "returns the numbers of xs sorted from smallest to largest", "sorted(xs)", None, None),
    ("list", "count_{k}s", "xs", "returns how many times the number {k} appears in the list xs", "xs.count({k})",
     range(0, 10), None),
    ("list", "add_{k}_to_each", "xs", "returns a new list with {k} added to each number of the list xs",
     "[x + {k} for x in xs]", range(1, 21), None),
    ("list", "items_above_{k}", "xs", "returns the numbers of the list xs that are greater than {k}, in order",
     "[x for x in xs if x > {k}]", range(0, 10), None),
]
KINDS = ("number", "text", "list")
# The task in words: {signature} ("add_7(x)"), {name}, {params} and {returns} ("returns x plus 7").
QUESTIONS = Phrasings(seen=(
    "Write a Python function `{signature}` that {returns}.",
    "Define a function `{signature}` in Python that {returns}.",
    "Implement `{signature}`: a Python function that {returns}.",
    "Create a Python function named `{name}` with parameters ({params}) that {returns}.",
    "Please write `{signature}` in Python. It {returns}.",
), unseen=(
    "Your task: a Python function `{signature}` which {returns}.",
    "Code a function `{signature}` in Python; it {returns}.",
))
# Where to put the code: `env.code` (code_format auto) runs the last ```python block, else the last
# ``` block, else what is between <code> and </code>. {code}: the solution.
INSTRUCTIONS = Phrasings(seen=(
    Reply("Put the code in a ```python block.", "```python\n{code}```"),
    Reply("Reply with the function in a Markdown code block.", "Here it is:\n```\n{code}```"),
    Reply("Write the code between <code> and </code>.", "<code>\n{code}</code>"),
    Reply("Give only the code, fenced with ```python and ```.", "```python\n{code}```"),
    Reply("Format your answer as a ```python code block.", "```python\n{code}```"),
), unseen=(
    Reply("Wrap the function in <code></code> tags.", "<code>\n{code}</code>"),
    Reply("Answer with one ```python fenced block containing the function.", "```python\n{code}```"),
))


def _arguments(kind: str, name: str, k: object, rng: random.Random) -> list:
    """One test's argument list."""
    if kind == "number":
        if name in ("add", "larger", "product", "difference"):  # two arguments
            return [rng.randint(0, 99), rng.randint(0, 99)]
        if name in ("absolute", "negate"):
            return [rng.randint(-50, 50)]
        near = [k, k + 1] if isinstance(k, int) and name != "line_{k}_{j}" else []
        return [rng.choice(near + [rng.randint(0, 9), rng.randint(10, 999)])]
    if kind == "text":
        return [rng.choice(WORDS)]
    return [[rng.randint(0, 9) for _ in range(rng.randint(3, 6))]]


@register_task_generator("functions", env="code")
def functions(
    num_train: int, num_validation: int, seed: int, kinds: Sequence[str] = KINDS, num_tests: int = 4,
    instruction: Optional[str] = None, phrasings: str = "all",
) -> tuple[list[dict], list[dict]]:
    """A Python function whose body is one `return` line, named and described in the prompt.

    Options:
        kinds: any of `number` (one or two integer arguments: add, compare, remainder, ...; about
            9,100 distinct tasks), `text` (one string; about 100), `list` (a list of digits; about 45);
            default all. A kind is drawn uniformly, then one of its templates and its constants (a
            kind whose tasks are used up leaves the rest to the others).
        num_tests: function-call tests per task (default 4, 1..10), on varied arguments.
        instruction: the sentence ending every prompt (default None: one of `INSTRUCTIONS`, drawn
            per row, each a form `env.code`'s default `code_format` reads; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    chosen = check_choices(kinds, KINDS, "kinds")
    check_range(num_tests, 1, 10, "num_tests")

    # Every (template, constants) of the chosen kinds, drawn without replacement: names are distinct.
    pools: dict[str, list[tuple]] = {kind: [] for kind in chosen}
    for template in TEMPLATES:
        if template[0] in pools:
            pools[template[0]] += [(template, k, j) for k in template[5] or [None] for j in template[6] or [None]]
    total = sum(len(pool) for pool in pools.values())
    if num_train + num_validation > total:
        raise ValueError(f"asked for {num_train} train + {num_validation} validation distinct tasks, but functions "
                         f"makes only {total} with kinds {chosen}; ask for fewer (num_train, num_validation)")

    def make_row(rng: random.Random, phrase) -> tuple:
        pool = pools[rng.choice([kind for kind in chosen if pools[kind]])]
        i = rng.randrange(len(pool))
        pool[i], pool[-1] = pool[-1], pool[i]
        (kind, name, params, returns, body, ks, _), k, j = pool.pop()
        index = SUFFIXES.index(k) if ks is SUFFIXES else None
        fn_name = name.format(k=k, j=j, i=index)
        code = f"def {fn_name}({params}):\n    return {body.format(k=k, j=j)}\n"
        namespace: dict = {}
        exec(code, namespace)  # our own one-line template, to compute the expected outputs
        tests, seen = [], set()
        for _ in range(50 * num_tests):
            args = _arguments(kind, name, k, rng)
            if repr(args) not in seen:
                seen.add(repr(args))
                tests.append({"input": args, "output": namespace[fn_name](*args)})
            if len(tests) == num_tests:
                break
        text = phrase(QUESTIONS).format(signature=f"{fn_name}({params})", name=fn_name, params=params,
                                        returns=returns.format(k=k, j=j))
        return fn_name, {"prompt": with_instruction(text, phrase, INSTRUCTIONS, instruction),
                         "answer": f"```python\n{code}```", "fn_name": fn_name, "tests": tests}

    return distinct_rows(num_train, num_validation, seed, make_row, "functions", phrasings)
