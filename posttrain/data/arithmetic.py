"""Synthetic arithmetic problems: the embedded default task.

Records look like `{"prompt": "12+34=", "answer": "46", "a": 12, "b": 34, "op": "+"}`. The prompt
is as compact as it gets (no spaces, no words) because a character-level tiny model spends a
forward pass per character; a pretrained model reads words better, e.g. with
`data.prompt_template: "What is {a} {op} {b}?"`. Operands are uniform in `[0, 10**num_digits)`; answers are plain integers in
decimal, negative for some subtractions.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

# operation name -> (symbol written in the prompt, exact result)
OPERATIONS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "add": ("+", lambda a, b: a + b),
    "sub": ("-", lambda a, b: a - b),
    "mul": ("*", lambda a, b: a * b),
}


def _sample_problem_ids(space: int, n: int, rng: random.Random) -> list[int]:
    """`n` distinct integers from `range(space)`, uniformly, in random order."""
    if 2 * n > space:
        return rng.sample(range(space), n)  # space is small here (< 2n), so this is cheap
    # Huge spaces (12 digits: 10**24 problems) overflow `len(range)`; rejection is fast when sparse.
    seen: set[int] = set()
    ids: list[int] = []
    while len(ids) < n:
        i = rng.randrange(space)
        if i not in seen:
            seen.add(i)
            ids.append(i)
    return ids


def generate_arithmetic(
    n_train: int,
    n_val: int,
    operations: Sequence[str] = ("add",),
    num_digits: int = 2,
    seed: int = 1234,
) -> tuple[list[dict], list[dict]]:
    """Generate disjoint train and validation sets of distinct arithmetic problems.

    Args:
        n_train: number of training problems.
        n_val: number of validation problems; none of them appears in the training set.
        operations: any of `add`, `sub`, `mul` (default `("add",)`); problems are spread
            uniformly over them.
        num_digits: operands have at most this many digits (default 2: 0..99).
        seed: the output is a pure function of all arguments (default 1234).

    Raises:
        ValueError: an unknown operation, or more problems requested than exist
            (`len(operations) * 10**(2 * num_digits)`).
    """
    unknown = [op for op in operations if op not in OPERATIONS]
    if unknown or not operations:
        raise ValueError(f"unknown arithmetic operations {unknown or operations}; choose from {list(OPERATIONS)}")
    if num_digits < 1 or n_train < 0 or n_val < 0:
        raise ValueError(f"need num_digits >= 1 and n_train, n_val >= 0; got {num_digits}, {n_train}, {n_val}")
    ops = list(dict.fromkeys(operations))  # drop duplicates, keep order
    base = 10**num_digits
    space = len(ops) * base * base
    if n_train + n_val > space:
        raise ValueError(
            f"asked for {n_train} train + {n_val} validation distinct problems but {ops} with "
            f"num_digits={num_digits} has only {space}; raise num_digits, add operations or ask for fewer"
        )
    rng = random.Random(seed)
    records = []
    for pid in _sample_problem_ids(space, n_train + n_val, rng):
        op_index, rest = divmod(pid, base * base)
        a, b = divmod(rest, base)
        symbol, fn = OPERATIONS[ops[op_index]]
        # The operands and the operator ride along, so `data.prompt_template` can phrase the
        # problem for a pretrained model: "What is {a} {op} {b}?".
        records.append({"prompt": f"{a}{symbol}{b}=", "answer": str(fn(a, b)), "a": a, "b": b, "op": symbol})
    return records[:n_train], records[n_train:]
