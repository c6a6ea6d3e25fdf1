"""Seeded visual tasks drawn with Pillow (nothing downloaded): rows with an image, for the
vision-language models (`tiny-vl`, `posttrain.models.vision`).

Each row is in TRL's image format (`posttrain.data.images`): the prompt as one user message whose
content is the image part and the question, the image (64 x 64, RGB, white background) in `images`,
and the answer in the form the existing environments score:

| generator | environment | the question |
|---|---|---|
| `shape_count` | `math` | how many shapes (1 to `max_count`) are in the image; the number |
| `shape_color` | `mcqa` | the colour of the named shape; options of colours, the letter |
| `shape_position` | `mcqa` | which shape is directly left (right) of the named one; options of shapes, the letter |
| `read_number` | `math` | the number written in the image (`num_digits` digits); the number |
| `read_word` | `mcqa` | the short word written in the image; options of words, the letter |

    {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many shapes ..."}]}],
     "images": [<PIL.Image.Image 64x64>], "answer": "3"}

Shapes (circle, square, triangle, diamond, about 16 pixels across) sit in the cells of a 3 x 3
grid, a pixel or two off centre, so they never overlap. Train and validation rows are distinct
scenes (`base.distinct_rows`: what tells two problems apart is the whole scene and the question),
validation drawn first; the question and the answer instruction come from several templates, two
of each held out of training (`phrasings`). The instructions are the text generators' (`word_problems`
for `math`, `multiple_choice` for `mcqa`), so the same replies score.

These are registered with `visual=True` (`base.VISUAL_TASK_GENERATORS`): `data.generator` takes them
with a vision-language policy (`tiny-vl`; `posttrain/configs/grpo_vl_tiny.yaml`) and preflight
refuses them with a text model in one line.
"""

from __future__ import annotations

import functools
import random
from typing import NamedTuple, Optional

from PIL import Image, ImageDraw, ImageFont

from posttrain.data.generators.base import (
    Phraser, Phrasings, check_range, distinct_rows, register_task_generator, with_instruction,
)
from posttrain.data.generators.multiple_choice import INSTRUCTIONS as CHOICE_INSTRUCTIONS
from posttrain.data.generators.word_problems import INSTRUCTIONS as NUMBER_INSTRUCTIONS

SIZE = 64  # pixels, square: the tiny-vl processor's size (no resampling)
GRID = 3  # cells per side
RADIUS = 8  # a shape's half width
JITTER = 2  # largest offset of a shape from its cell's centre
SHAPES = ("circle", "square", "triangle", "diamond")
COLORS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220), "yellow": (230, 190, 0),
          "purple": (140, 50, 180), "orange": (240, 120, 10)}
WORDS = ("cat", "dog", "sun", "car", "hat", "pen", "cup", "map", "bus", "egg", "fox", "key", "owl", "pig", "box",
         "bed", "jar", "web", "ant", "bee", "fish", "tree", "star", "moon", "ship", "frog", "lamp", "door", "bird", "cake")


class Shape(NamedTuple):
    kind: str
    color: str
    x: int  # centre, pixels
    y: int


@functools.lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)  # Pillow's bundled font: the same glyphs everywhere


def draw_shapes(shapes: list[Shape]) -> Image.Image:
    """A SIZE x SIZE white RGB image with `shapes` drawn filled."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(image)
    for kind, color, x, y in shapes:
        fill, r = COLORS[color], RADIUS
        if kind == "circle":
            draw.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif kind == "square":
            draw.rectangle((x - r + 1, y - r + 1, x + r - 1, y + r - 1), fill=fill)
        elif kind == "triangle":
            draw.polygon([(x, y - r), (x + r, y + r - 1), (x - r, y + r - 1)], fill=fill)
        else:  # diamond
            draw.polygon([(x, y - r), (x + r, y), (x, y + r), (x - r, y)], fill=fill)
    return image


def draw_text(text: str, color: tuple[int, int, int], size: int, dx: int, dy: int) -> Image.Image:
    """A SIZE x SIZE white RGB image with `text` in Pillow's default font at `size`, centred and
    moved by (dx, dy) pixels."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    ImageDraw.Draw(image).text((SIZE // 2 + dx, SIZE // 2 + dy), text, fill=color, font=_font(size), anchor="mm")
    return image


def _cell_centre(cell: int, rng: random.Random) -> tuple[int, int]:
    step = SIZE // GRID
    col, row = cell % GRID, cell // GRID
    return (col * step + step // 2 + 1 + rng.randint(-JITTER, JITTER),
            row * step + step // 2 + 1 + rng.randint(-JITTER, JITTER))


def _scene(rng: random.Random, cells: list[int], kinds: list[str]) -> list[Shape]:
    return [Shape(kind, rng.choice(sorted(COLORS)), *_cell_centre(cell, rng)) for cell, kind in zip(cells, kinds)]


def _row(image: Image.Image, text: str, answer: str, **fields) -> dict:
    """A row in TRL's format: the image, then the question, in one user message."""
    return {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
            "images": [image], "answer": answer, **fields}


def _choice_row(image: Image.Image, question: str, right: str, wrong: list[str], rng: random.Random, phrase: Phraser,
                instruction: Optional[str]) -> dict:
    """An `mcqa` row: the question, the options lettered A, B, ... (the right one at a uniform
    place), the answer instruction; the right letter as `answer`, the options as `options`."""
    texts = list(wrong)
    texts.insert(rng.randrange(len(texts) + 1), right)
    letters = [chr(ord("A") + i) for i in range(len(texts))]
    lines = [question] + [f"{letter}) {text}" for letter, text in zip(letters, texts)]
    return _row(image, with_instruction("\n".join(lines), phrase, CHOICE_INSTRUCTIONS, instruction, sep="\n"),
                letters[texts.index(right)], options=[{letter: text} for letter, text in zip(letters, texts)])


COUNT_QUESTIONS = Phrasings(seen=(
    "How many shapes are in the image?",
    "Count the shapes in the picture.",
    "How many shapes can you see?",
    "What is the number of shapes in this image?",
    "How many coloured shapes does the picture show?",
), unseen=(
    "Count every shape drawn in the image. How many are there?",
    "The image shows some shapes. How many?",
))


@register_task_generator("shape_count", env="math", visual=True)
def shape_count(num_train: int, num_validation: int, seed: int, max_count: int = 5, instruction: Optional[str] = None,
                phrasings: str = "all") -> tuple[list[dict], list[dict]]:
    """Count the shapes: 1 to `max_count` shapes of any kind and colour; the count as `answer`.

    Options:
        max_count: most shapes in an image (default 5, 1..9: the cells of the grid).
        instruction: the sentence ending every prompt (default None: one of word_problems'
            `INSTRUCTIONS`, drawn per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    check_range(max_count, 1, GRID * GRID, "max_count")

    def make_row(rng: random.Random, phrase: Phraser) -> tuple:
        count = rng.randint(1, max_count)
        shapes = _scene(rng, rng.sample(range(GRID * GRID), count), [rng.choice(SHAPES) for _ in range(count)])
        text = with_instruction(phrase(COUNT_QUESTIONS), phrase, NUMBER_INSTRUCTIONS, instruction)
        return tuple(shapes), _row(draw_shapes(shapes), text, str(count))

    return distinct_rows(num_train, num_validation, seed, make_row, "shape_count", phrasings)


COLOR_QUESTIONS = Phrasings(seen=(
    "What colour is the {shape}?",
    "Which colour does the {shape} have?",
    "What is the colour of the {shape} in the image?",
    "The image has a {shape}. What colour is it?",
    "Pick the colour of the {shape}.",
), unseen=(
    "Name the colour the {shape} is drawn in.",
    "Which of these colours is the {shape}?",
))


@register_task_generator("shape_color", env="mcqa", visual=True)
def shape_color(num_train: int, num_validation: int, seed: int, max_shapes: int = 3, num_options: int = 3,
                instruction: Optional[str] = None, phrasings: str = "all") -> tuple[list[dict], list[dict]]:
    """The colour of the named shape: 1 to `max_shapes` shapes of different kinds; `num_options`
    colours to choose from, the right one's letter as `answer`.

    Options:
        max_shapes: most shapes in an image (default 3, 1..4: one of each kind at most).
        num_options: colours to choose from (default 3, 2..6).
        instruction: the line ending every prompt (default None: one of multiple_choice's
            `INSTRUCTIONS`, drawn per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    check_range(max_shapes, 1, len(SHAPES), "max_shapes")
    check_range(num_options, 2, len(COLORS), "num_options")

    def make_row(rng: random.Random, phrase: Phraser) -> tuple:
        count = rng.randint(1, max_shapes)
        shapes = _scene(rng, rng.sample(range(GRID * GRID), count), rng.sample(SHAPES, count))
        target = rng.choice(shapes)
        wrong = rng.sample([c for c in sorted(COLORS) if c != target.color], num_options - 1)
        question = phrase(COLOR_QUESTIONS).format(shape=target.kind)
        row = _choice_row(draw_shapes(shapes), question, target.color, wrong, rng, phrase, instruction)
        return (tuple(shapes), target.kind, tuple(o for d in row["options"] for o in d.values())), row

    return distinct_rows(num_train, num_validation, seed, make_row, "shape_color", phrasings)


POSITION_QUESTIONS = Phrasings(seen=(
    "Which shape is directly to the {direction} of the {shape}?",
    "What shape is right next to the {shape}, on its {direction}?",
    "Which shape comes just {direction} of the {shape}?",
    "Name the shape immediately to the {direction} of the {shape}.",
    "Look at the {shape}. Which shape is next to it on the {direction}?",
), unseen=(
    "Which shape sits closest to the {shape} on its {direction} side?",
    "Moving {direction} from the {shape}, which shape do you reach first?",
))


@register_task_generator("shape_position", env="mcqa", visual=True)
def shape_position(num_train: int, num_validation: int, seed: int, instruction: Optional[str] = None,
                   phrasings: str = "all") -> tuple[list[dict], list[dict]]:
    """Which shape is left (or right) of another: three shapes of different kinds, one per column
    of the grid (each in any row); the question names one and a direction, and the shape next to
    it that way is the answer. The options are the three kinds other than the named one (the
    answer, the third shape, a kind not drawn); the right one's letter as `answer`.

    Options:
        instruction: the line ending every prompt (default None: one of multiple_choice's
            `INSTRUCTIONS`, drawn per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """

    def make_row(rng: random.Random, phrase: Phraser) -> tuple:
        kinds = rng.sample(SHAPES, GRID)  # kinds[c]: the shape in column c
        cells = [rng.randrange(GRID) * GRID + col for col in range(GRID)]
        shapes = _scene(rng, cells, kinds)
        direction = rng.choice(["left", "right"])
        col = rng.randint(1, GRID - 1) if direction == "left" else rng.randint(0, GRID - 2)
        right = kinds[col - 1] if direction == "left" else kinds[col + 1]
        wrong = [k for k in SHAPES if k not in (kinds[col], right)]
        rng.shuffle(wrong)
        question = phrase(POSITION_QUESTIONS).format(direction=direction, shape=kinds[col])
        row = _choice_row(draw_shapes(shapes), question, right, wrong, rng, phrase, instruction)
        return (tuple(shapes), direction, col, tuple(o for d in row["options"] for o in d.values())), row

    return distinct_rows(num_train, num_validation, seed, make_row, "shape_position", phrasings)


# Text colours: dark enough to read on white.
INK = {"black": (0, 0, 0), "navy": (20, 30, 120), "dark red": (150, 20, 20), "dark green": (20, 100, 30)}
NUMBER_QUESTIONS = Phrasings(seen=(
    "What number is written in the image?",
    "Read the number in the picture.",
    "Which number does the image show?",
    "What is the number drawn here?",
    "The image shows a number. What is it?",
), unseen=(
    "Tell me the number you can read in the image.",
    "Which number is printed in this picture?",
))


@register_task_generator("read_number", env="math", visual=True)
def read_number(num_train: int, num_validation: int, seed: int, num_digits: int = 1, instruction: Optional[str] = None,
                phrasings: str = "all") -> tuple[list[dict], list[dict]]:
    """Read a drawn number of `num_digits` digits (dark ink, Pillow's default font, a few pixels
    off centre); the number as `answer`.

    Options:
        num_digits: digits of the number (default 1: 0 to 9; up to 3).
        instruction: the sentence ending every prompt (default None: one of word_problems'
            `INSTRUCTIONS`, drawn per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    check_range(num_digits, 1, 3, "num_digits")
    size = {1: 40, 2: 32, 3: 24}[num_digits]

    def make_row(rng: random.Random, phrase: Phraser) -> tuple:
        number = rng.randint(0 if num_digits == 1 else 10 ** (num_digits - 1), 10 ** num_digits - 1)
        ink, dx, dy = rng.choice(sorted(INK)), rng.randint(-6, 6), rng.randint(-6, 6)
        text = with_instruction(phrase(NUMBER_QUESTIONS), phrase, NUMBER_INSTRUCTIONS, instruction)
        return (number, ink, dx, dy), _row(draw_text(str(number), INK[ink], size, dx, dy), text, str(number))

    return distinct_rows(num_train, num_validation, seed, make_row, "read_number", phrasings)


WORD_QUESTIONS = Phrasings(seen=(
    "Which word is written in the image?",
    "What word does the picture show?",
    "Read the word in the image.",
    "The image shows a word. Which one?",
    "Pick the word drawn in the picture.",
), unseen=(
    "Which of these words can you read in the image?",
    "What is the word printed here?",
))


@register_task_generator("read_word", env="mcqa", visual=True)
def read_word(num_train: int, num_validation: int, seed: int, num_options: int = 3, instruction: Optional[str] = None,
              phrasings: str = "all") -> tuple[list[dict], list[dict]]:
    """Read a drawn short word (three or four letters, `WORDS`); `num_options` words to choose
    from, the right one's letter as `answer`.

    Options:
        num_options: words to choose from (default 3, 2..5).
        instruction: the line ending every prompt (default None: one of multiple_choice's
            `INSTRUCTIONS`, drawn per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    check_range(num_options, 2, 5, "num_options")

    def make_row(rng: random.Random, phrase: Phraser) -> tuple:
        word = rng.choice(WORDS)
        ink, dx, dy = rng.choice(sorted(INK)), rng.randint(-4, 4), rng.randint(-8, 8)
        wrong = rng.sample([w for w in WORDS if w != word], num_options - 1)
        image = draw_text(word, INK[ink], 20, dx, dy)
        row = _choice_row(image, phrase(WORD_QUESTIONS), word, wrong, rng, phrase, instruction)
        return (word, ink, dx, dy, tuple(o for d in row["options"] for o in d.values())), row

    return distinct_rows(num_train, num_validation, seed, make_row, "read_word", phrasings)
