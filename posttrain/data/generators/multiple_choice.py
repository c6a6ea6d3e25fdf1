"""Easy multiple-choice questions for the `mcqa` environment.

Rows: `{"prompt": "Which of these is a fruit?\\nA) chair\\nB) banana\\nC) dog\\nReply with 'Answer: '
and the letter of the correct option.", "answer": "B", "options": [{"A": "chair"}, {"B": "banana"},
{"C": "dog"}]}`. The correct option's place is uniform over the letters. Each kind's question and
the answer instruction come from seven templates each, two of them held out of training
(`phrasings`, `posttrain.data.generators.base.Phrasings`).
"""

from __future__ import annotations

import random
from typing import Callable, Optional, Sequence

from posttrain.data.generators.base import (
    Phrasings, Reply, check_choices, check_range, distinct_rows, register_task_generator, with_instruction,
)

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

# The question of each kind, in words: {fields} as each kind's function returns them.
QUESTIONS = {
    "category": Phrasings(seen=(
        "Which of these is {article} {category}?",
        "Which one of the following is {article} {category}?",
        "Pick the {category} from the options below.",
        "One of these words names {article} {category}. Which one?",
        "Which option is {article} {category}?",
    ), unseen=(
        "Find the {category} among these choices.",
        "Which of the words below stands for {article} {category}?",
    )),
    "arithmetic": Phrasings(seen=(
        "What is {a} {op} {b}?",
        "Which option equals {a} {op} {b}?",
        "Choose the value of {a} {op} {b}.",
        "{a} {op} {b} = ?",
        "Which number is {a} {op} {b}?",
    ), unseen=(
        "Pick the result of {a} {op} {b}.",
        "How much is {a} {op} {b}?",
    )),
    "largest": Phrasings(seen=(
        "Which number is the {word}?",
        "Which of these numbers is the {word}?",
        "Pick the {word} number.",
        "Find the {word} of these numbers.",
        "Which option holds the {word} number?",
    ), unseen=(
        "Among these numbers, which one is the {word}?",
        "Choose the {word} value below.",
    )),
    "opposite": Phrasings(seen=(
        "What is the opposite of '{word}'?",
        "Which word means the opposite of '{word}'?",
        "Pick the antonym of '{word}'.",
        "Which word is the opposite of '{word}'?",
        "Choose the word that means the reverse of '{word}'.",
    ), unseen=(
        "What word has the opposite meaning to '{word}'?",
        "Find the opposite of the word '{word}'.",
    )),
    "capital": Phrasings(seen=(
        "What is the capital of {country}?",
        "Which city is the capital of {country}?",
        "Pick the capital city of {country}.",
        "The capital of {country} is which city?",
        "Which of these cities is the capital of {country}?",
    ), unseen=(
        "Name the capital of {country}.",
        "Which city serves as the capital of {country}?",
    )),
    "order": Phrasings(seen=(
        "Which {unit} comes right {direction} {name}?",
        "What {unit} is right {direction} {name}?",
        "Which {unit} is just {direction} {name}?",
        "Pick the {unit} that comes directly {direction} {name}.",
        "Which {unit} immediately comes {direction} {name}?",
    ), unseen=(
        "Name the {unit} that falls right {direction} {name}.",
        "Choose the {unit} coming just {direction} {name}.",
    )),
}
# How to answer: every reply is one `env.mcqa`'s strict grading reads (the last \boxed{}, an
# <answer> tag, or "Answer: B" / "the answer is (B)").
INSTRUCTIONS = Phrasings(seen=(
    Reply("Reply with 'Answer: ' and the letter of the correct option.", "Answer: {answer}"),
    Reply("Give the letter of the correct option in \\boxed{}.", "\\boxed{{{answer}}}"),
    Reply("End your reply with 'The answer is' and the letter.", "The answer is {answer}."),
    Reply("Write the letter of your choice between <answer> and </answer>.", "<answer>{answer}</answer>"),
    Reply("Answer in the form 'Answer: X', where X is the letter you choose.", "Answer: {answer}"),
), unseen=(
    Reply("Choose one option and state it as 'The answer is (X)'.", "The answer is ({answer})."),
    Reply("Respond with the correct letter inside \\boxed{}.", "The correct option is \\boxed{{{answer}}}."),
))

Question = tuple[dict, str, list[str]]  # (the question's fields, correct option, wrong options: at least num_options - 1)


def _category(rng: random.Random, n: int) -> Question:
    category = rng.choice(sorted(CATEGORIES))
    others = [word for other, words in CATEGORIES.items() if other != category for word in words]
    article = "an" if category[0] in "aeiou" else "a"
    return {"article": article, "category": category}, rng.choice(CATEGORIES[category]), rng.sample(others, n - 1)


def _arithmetic(rng: random.Random, n: int) -> Question:
    a, b = rng.randint(1, 10), rng.randint(1, 10)
    op = rng.choice("+-")
    a, b = (a, b) if op == "+" or a >= b else (b, a)
    value = a + b if op == "+" else a - b
    wrong = rng.sample([v for v in range(max(0, value - 5), value + 6) if v != value], n - 1)
    return {"a": a, "op": op, "b": b}, str(value), [str(v) for v in wrong]


def _largest(rng: random.Random, n: int) -> Question:
    numbers = rng.sample(range(1, 100), n)
    word = rng.choice(["largest", "smallest"])
    pick = max(numbers) if word == "largest" else min(numbers)
    return {"word": word}, str(pick), [str(v) for v in numbers if v != pick]


def _opposite(rng: random.Random, n: int) -> Question:
    pairs = list(OPPOSITES.items()) + [(b, a) for a, b in OPPOSITES.items()]
    word, right = rng.choice(pairs)
    wrong = rng.sample([w for pair in OPPOSITES.items() for w in pair if w not in (word, right)], n - 1)
    return {"word": word}, right, wrong


def _capital(rng: random.Random, n: int) -> Question:
    country = rng.choice(sorted(CAPITALS))
    wrong = rng.sample([c for k, c in CAPITALS.items() if k != country], n - 1)
    return {"country": country}, CAPITALS[country], wrong


def _next_in_order(rng: random.Random, n: int) -> Question:
    names, unit = (DAYS, "day") if rng.random() < 0.5 else (MONTHS, "month")
    i = rng.randrange(len(names))
    direction = rng.choice(["after", "before"])
    right = names[(i + 1) % len(names)] if direction == "after" else names[i - 1]
    wrong = rng.sample([x for x in names if x not in (names[i], right)], n - 1)
    return {"unit": unit, "direction": direction, "name": names[i]}, right, wrong


KINDS: dict[str, Callable[[random.Random, int], Question]] = {
    "category": _category, "arithmetic": _arithmetic, "largest": _largest, "opposite": _opposite,
    "capital": _capital, "order": _next_in_order,
}


@register_task_generator("multiple_choice", env="mcqa")
def multiple_choice(
    num_train: int, num_validation: int, seed: int, kinds: Sequence[str] = tuple(KINDS), num_options: int = 3,
    instruction: Optional[str] = None, phrasings: str = "all",
) -> tuple[list[dict], list[dict]]:
    """Questions with one correct option among `num_options`, lettered A, B, ...

    Options:
        kinds: any of `category` (which word is a fruit / an animal / ...), `arithmetic` (a sum or
            difference of numbers up to 10), `largest` (the largest or smallest number), `opposite`
            (of a common adjective), `capital` (of a well-known country), `order` (the day or month
            before or after one); default all, drawn uniformly.
        num_options: options per question (default 3, 2..5).
        instruction: the line ending every prompt (default None: one of `INSTRUCTIONS`, drawn per
            row, each a form `env.mcqa`'s strict grading reads; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    chosen = check_choices(kinds, tuple(KINDS), "kinds")
    check_range(num_options, 2, 5, "num_options")

    def make_row(rng: random.Random, phrase) -> tuple:
        kind = rng.choice(chosen)
        fields, right, wrong = KINDS[kind](rng, num_options)
        texts = wrong[: num_options - 1]
        texts.insert(rng.randrange(num_options), right)
        letters = [chr(ord("A") + i) for i in range(num_options)]
        lines = [phrase(QUESTIONS[kind]).format(**fields)] + [f"{letter}) {text}" for letter, text in zip(letters, texts)]
        problem = (kind, tuple(sorted(fields.items())), tuple(texts))
        return problem, {"prompt": with_instruction("\n".join(lines), phrase, INSTRUCTIONS, instruction, sep="\n"),
                         "answer": letters[texts.index(right)],
                         "options": [{letter: text} for letter, text in zip(letters, texts)]}

    return distinct_rows(num_train, num_validation, seed, make_row, "multiple_choice", phrasings)
