"""The seeded visual tasks (`posttrain.data.generators.visual`): sizes, the same rows (pixels too)
for a seed, train and validation distinct scenes, the picture showing the answer, the wordings held
out by `phrasings`, the answers scored by the math and mcqa environments, and `data.generator`
refusing them in one line until training takes images."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.config.schema import DataConfig
from posttrain.config.schema.data import VISUAL_TASK_GENERATORS as SCHEMA_VISUAL
from posttrain.data.datasets import env_metadata
from posttrain.data.generators import TASK_GENERATORS, VISUAL_GENERATOR_ENVS, VISUAL_TASK_GENERATORS, base, visual
from posttrain.data.images import image_rows


def text_of(row: dict) -> str:
    [message] = row["prompt"]
    assert message["role"] == "user" and message["content"][0] == {"type": "image"}
    return message["content"][1]["text"]


def key(row: dict) -> tuple:
    """A row as values: its question, answer, options and pixels."""
    return text_of(row), row["answer"], str(row.get("options")), row["images"][0].tobytes()


def test_registered_apart_and_selectable_by_the_config():
    """Apart from the text generators (a text model is refused them at preflight:
    tests/unit/test_vision_training.py), selectable as `data.generator`."""
    assert sorted(SCHEMA_VISUAL) == sorted(VISUAL_TASK_GENERATORS) == sorted(VISUAL_GENERATOR_ENVS)
    assert not set(VISUAL_TASK_GENERATORS) & set(TASK_GENERATORS)
    assert VISUAL_GENERATOR_ENVS == {"shape_count": "math", "shape_color": "mcqa", "shape_position": "mcqa",
                                     "read_number": "math", "read_word": "mcqa"}
    assert DataConfig(dataset="generated", generator="shape_count").generator == "shape_count"


@pytest.mark.parametrize("name", sorted(VISUAL_TASK_GENERATORS))
def test_sizes_determinism_and_distinct_scenes_across_splits(name):
    fn = VISUAL_TASK_GENERATORS[name]
    train, validation = fn(200, 60, 5)
    assert (len(train), len(validation)) == (200, 60)
    assert all(r["images"][0].size == (64, 64) and r["images"][0].mode == "RGB" for r in train + validation)
    assert [key(r) for r in fn(200, 60, 5)[0]] == [key(r) for r in train]  # a pure function, pixels too
    assert [key(r) for r in fn(10, 60, 5)[1]] == [key(r) for r in validation]  # validation drawn first
    # Distinct problems: no (question, picture) of validation is a training one.
    assert not {(text_of(r), r["images"][0].tobytes()) for r in validation} & \
        {(text_of(r), r["images"][0].tobytes()) for r in train}
    other = fn(0, 60, 6)[1]
    assert sum(key(a) == key(b) for a, b in zip(other, validation)) == 0  # another seed, other rows
    assert len(image_rows(train[:3])) == 3  # the rows are in a format the data layer reads


def components(image, background=(255, 255, 255)) -> list[tuple[tuple, int]]:
    """(colour, leftmost x) of each 4-connected region of one non-background colour."""
    width, height = image.size
    pixels = image.load()
    seen, found = set(), []
    for y in range(height):
        for x in range(width):
            if (x, y) in seen or pixels[x, y] == background:
                continue
            color, stack, xs = pixels[x, y], [(x, y)], []
            seen.add((x, y))
            while stack:
                px, py = stack.pop()
                xs.append(px)
                for nx, ny in ((px + 1, py), (px - 1, py), (px, py + 1), (px, py - 1)):
                    if 0 <= nx < width and 0 <= ny < height and (nx, ny) not in seen and pixels[nx, ny] == color:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
            if len(xs) > 20:  # a shape, not an antialiased edge
                found.append((color, min(xs)))
    return found


def test_the_pictures_show_the_answers():
    rows = visual.shape_count(60, 0, 1, max_count=6)[0]
    assert [len(components(r["images"][0])) for r in rows] == [int(r["answer"]) for r in rows]
    assert {r["answer"] for r in rows} == {str(n) for n in range(1, 7)}
    for row in visual.shape_color(40, 0, 1)[0]:
        right = next(text for option in row["options"] for letter, text in option.items() if letter == row["answer"])
        assert visual.COLORS[right] in {color for color, _ in components(row["images"][0])}
    for row in visual.shape_position(40, 0, 1)[0]:  # three shapes, one per column; the named one is no option
        assert len(components(row["images"][0])) == 3
        assert sorted(components(row["images"][0]), key=lambda c: c[1])[0][1] < 21  # one in the left column
        options = [t for o in row["options"] for t in o.values()]
        [named] = [s for s in visual.SHAPES if s not in options]
        assert named in text_of(row).split("\n")[0]
    numbers = visual.read_number(30, 0, 1, num_digits=2)[0]
    assert all(10 <= int(r["answer"]) <= 99 for r in numbers) and len({r["answer"] for r in numbers}) > 15
    letters = [r["answer"] for r in visual.read_word(300, 0, 1, num_options=4)[0]]
    assert {letters.count(letter) for letter in "ABCD"} and min(letters.count(letter) for letter in "ABCD") > 50


@pytest.mark.parametrize("name", sorted(VISUAL_TASK_GENERATORS))
def test_held_out_wordings_give_the_same_problems_in_other_words(name):
    fn, module_lists = VISUAL_TASK_GENERATORS[name], [v for v in vars(visual).values() if isinstance(v, base.Phrasings)]
    for options in module_lists:
        assert len(set(options.seen)) >= 5 and len(set(options.unseen)) >= 2 and not set(options.seen) & set(options.unseen)
    seen, unseen = fn(100, 20, 3, phrasings="seen"), fn(100, 20, 3, phrasings="unseen")
    for a, b in zip(seen, unseen):
        assert [(r["answer"], r["images"][0].tobytes()) for r in a] == [(r["answer"], r["images"][0].tobytes()) for r in b]
        assert all(text_of(x) != text_of(y) for x, y in zip(a, b))
    seen_texts = {text_of(r) for split in seen for r in split}
    assert not seen_texts & {text_of(r) for split in unseen for r in split}


def scores(env, rows: list[dict], replies: list[str]) -> list[float]:
    logs = [[{"role": "user", "content": text_of(r)}, {"role": "assistant", "content": reply}] for r, reply in zip(rows, replies)]
    return env.step(logs, [env_metadata({k: v for k, v in r.items() if k != "images"}) for r in rows]).rewards.tolist()


def replies(rows: list[dict], instructions: base.Phrasings, answer=lambda r: r["answer"]) -> list[str]:
    out = []
    for row in rows:
        [instruction] = [i for i in instructions.seen + instructions.unseen if text_of(row).endswith(i.text)]
        out.append(instruction.reply.format(answer=answer(row)))
    return out


def test_the_math_and_mcqa_environments_score_the_answers():
    from posttrain.environments.math_env import MathEnvironment
    from posttrain.environments.mcqa_env import MCQAEnvironment
    from posttrain.data.generators import multiple_choice, word_problems

    numbers = visual.shape_count(40, 0, 2)[0] + visual.read_number(40, 0, 2, num_digits=3)[0]
    env = MathEnvironment({})
    try:
        assert scores(env, numbers, replies(numbers, word_problems.INSTRUCTIONS)) == [1.0] * 80
        wrong = replies(numbers, word_problems.INSTRUCTIONS, lambda r: str(int(r["answer"]) + 1))
        assert scores(env, numbers, wrong) == [0.0] * 80
    finally:
        env.shutdown()
    choices = visual.shape_color(40, 0, 2)[0] + visual.shape_position(40, 0, 2)[0] + visual.read_word(40, 0, 2)[0]
    env = MCQAEnvironment({})
    assert scores(env, choices, replies(choices, multiple_choice.INSTRUCTIONS)) == [1.0] * 120
    other = {"A": "B", "B": "C", "C": "A"}
    assert scores(env, choices, replies(choices, multiple_choice.INSTRUCTIONS, lambda r: other[r["answer"]])) == [0.0] * 120
