"""Easy multiple-choice questions for the `mcqa` environment.

Rows: `{"prompt": "Which of these is a fruit?\\nA) chair\\nB) banana\\nC) dog\\nReply with 'Answer: '
and the letter of the correct option.", "answer": "B", "options": [{"A": "chair"}, {"B": "banana"},
{"C": "dog"}]}`. The correct option's place is uniform over the letters.
"""

from __future__ import annotations

import random
from typing import Callable, Sequence

from posttrain.data.generators.base import check_choices, check_range, distinct_rows, register_task_generator

CATEGORIES = {
    "fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum"],
    "animal": ["cat", "dog", "horse", "lion", "mouse", "rabbit", "sheep", "tiger", "cow", "bear"],
    "color": ["red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white", "gray"],
    "vehicle": ["car", "bus", "train", "bicycle", "truck", "boat", "plane", "taxi", "tractor", "scooter"],
    "piece of furniture": ["chair", "table", "sofa", "bed", "desk", "shelf", "stool", "cupboard", "bench", "dresser"],
    "body part": ["hand", "foot", "nose", "ear", "knee", "elbow", "finger", "shoulder", "mouth", "neck"],
    "musical instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "cello", "banjo", "tuba"],
    "drink": ["water", "milk", "juice", "tea", "coffee", "lemonade", "cocoa", "soda", "smoothie", "milkshake"],
}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "up": "down", "old": "young",
             "tall": "short", "open": "closed", "full": "empty", "early": "late", "hard": "soft",
             "wet": "dry", "loud": "quiet", "rich": "poor", "strong": "weak", "clean": "dirty"}
CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin", "Japan": "Tokyo",
            "England": "London", "Russia": "Moscow", "Egypt": "Cairo", "China": "Beijing", "Greece": "Athens",
            "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna", "Norway": "Oslo", "Canada": "Ottawa",
            "Kenya": "Nairobi"}
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

Question = tuple[str, str, list[str]]  # (question, correct option, wrong options: at least num_options - 1)


def _category(rng: random.Random, n: int) -> Question:
    category = rng.choice(sorted(CATEGORIES))
    others = [word for other, words in CATEGORIES.items() if other != category for word in words]
    article = "an" if category[0] in "aeiou" else "a"
    return f"Which of these is {article} {category}?", rng.choice(CATEGORIES[category]), rng.sample(others, n - 1)


def _arithmetic(rng: random.Random, n: int) -> Question:
    a, b = rng.randint(1, 10), rng.randint(1, 10)
    op = rng.choice("+-")
    a, b = (a, b) if op == "+" or a >= b else (b, a)
    value = a + b if op == "+" else a - b
    wrong = rng.sample([v for v in range(max(0, value - 5), value + 6) if v != value], n - 1)
    return f"What is {a} {op} {b}?", str(value), [str(v) for v in wrong]


def _largest(rng: random.Random, n: int) -> Question:
    numbers = rng.sample(range(1, 100), n)
    word = rng.choice(["largest", "smallest"])
    pick = max(numbers) if word == "largest" else min(numbers)
    return f"Which number is the {word}?", str(pick), [str(v) for v in numbers if v != pick]


def _opposite(rng: random.Random, n: int) -> Question:
    pairs = list(OPPOSITES.items()) + [(b, a) for a, b in OPPOSITES.items()]
    word, right = rng.choice(pairs)
    wrong = rng.sample([w for pair in OPPOSITES.items() for w in pair if w not in (word, right)], n - 1)
    return f"What is the opposite of '{word}'?", right, wrong


def _capital(rng: random.Random, n: int) -> Question:
    country = rng.choice(sorted(CAPITALS))
    wrong = rng.sample([c for k, c in CAPITALS.items() if k != country], n - 1)
    return f"What is the capital of {country}?", CAPITALS[country], wrong


def _next_in_order(rng: random.Random, n: int) -> Question:
    names, unit = (DAYS, "day") if rng.random() < 0.5 else (MONTHS, "month")
    i = rng.randrange(len(names))
    direction = rng.choice(["after", "before"])
    right = names[(i + 1) % len(names)] if direction == "after" else names[i - 1]
    wrong = rng.sample([x for x in names if x not in (names[i], right)], n - 1)
    return f"Which {unit} comes right {direction} {names[i]}?", right, wrong


KINDS: dict[str, Callable[[random.Random, int], Question]] = {
    "category": _category, "arithmetic": _arithmetic, "largest": _largest, "opposite": _opposite,
    "capital": _capital, "order": _next_in_order,
}


@register_task_generator("multiple_choice", env="mcqa")
def multiple_choice(
    num_train: int, num_validation: int, seed: int, kinds: Sequence[str] = tuple(KINDS), num_options: int = 3,
    instruction: str = "Reply with 'Answer: ' and the letter of the correct option.",
) -> tuple[list[dict], list[dict]]:
    """Questions with one correct option among `num_options`, lettered A, B, ...

    Options:
        kinds: any of `category` (which word is a fruit / an animal / ...), `arithmetic` (a sum or
            difference of numbers up to 10), `largest` (the largest or smallest number), `opposite`
            (of a common adjective), `capital` (of a well-known country), `order` (the day or month
            before or after one); default all, drawn uniformly.
        num_options: options per question (default 3, 2..5).
        instruction: the line ending every prompt (default "Reply with 'Answer: ' and the letter of
            the correct option.", which `env.mcqa`'s strict grading reads; "" for none).
    """
    chosen = check_choices(kinds, tuple(KINDS), "kinds")
    check_range(num_options, 2, 5, "num_options")

    def make_row(rng: random.Random) -> dict:
        question, right, wrong = KINDS[rng.choice(chosen)](rng, num_options)
        texts = wrong[: num_options - 1]
        texts.insert(rng.randrange(num_options), right)
        letters = [chr(ord("A") + i) for i in range(num_options)]
        lines = [question] + [f"{letter}) {text}" for letter, text in zip(letters, texts)] + [instruction]
        return {"prompt": "\n".join(line for line in lines if line), "answer": letters[texts.index(right)],
                "options": [{letter: text} for letter, text in zip(letters, texts)]}

    return distinct_rows(num_train, num_validation, seed, make_row, "multiple_choice")
