"""Short JSON objects to write from a description, for the `structured` environment.

Rows: `{"prompt": "Write a JSON object for a pet whose name is \\"Rex\\" and whose age is 3. Use the keys
\\"name\\" and \\"age\\". Reply with only the JSON object.", "answer": "{\\"name\\": \\"Rex\\", \\"age\\": 3}",
"schema_str": <JSON Schema text>}`. The schema requires exactly the asked keys with their types and,
with `exact_values`, the values the prompt gives (`const`), so a copied-wrong value scores 0. The
request and the answer instruction come from seven templates each, two of them held out of
training (`phrasings`, `posttrain.data.generators.base.Phrasings`); the `answer` is the bare JSON,
which scores 1 whichever instruction was drawn.
"""

from __future__ import annotations

import json
import random
from typing import Optional

from posttrain.data.generators.base import (
    OptionError, Phrasings, Reply, check_range, distinct_rows, register_task_generator, with_instruction,
)

NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gina", "Hugo", "Iris", "Jon", "Kim", "Liam", "Maya", "Noah"]
PETS = ["Rex", "Luna", "Max", "Bella", "Milo", "Coco", "Buddy", "Daisy", "Oscar", "Lola"]
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Oslo", "Cairo", "Madrid", "Berlin", "Dublin", "Vienna", "Seoul"]
THINGS = ["lamp", "chair", "book", "pen", "mug", "phone", "bag", "clock", "kite", "ball"]
TITLES = ["The Blue Sea", "A Long Road", "Night Sky", "The Old House", "Green Hills", "Small Steps", "Red Door"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
BOOL = [True, False]

# entity -> its fields: (key, JSON Schema type, the values drawn from)
ENTITIES: dict[str, list[tuple[str, str, list]]] = {
    "person": [("name", "string", NAMES), ("age", "integer", list(range(5, 90))), ("city", "string", CITIES)],
    "pet": [("name", "string", PETS), ("animal", "string", ["cat", "dog", "rabbit", "parrot", "fish", "horse"]),
            ("age", "integer", list(range(1, 16)))],
    "book": [("title", "string", TITLES), ("pages", "integer", list(range(50, 501))),
             ("year", "integer", list(range(1950, 2025)))],
    "product": [("item", "string", THINGS), ("price", "integer", list(range(1, 101))), ("in_stock", "boolean", BOOL)],
    "city": [("name", "string", CITIES), ("population_millions", "integer", list(range(1, 21))), ("capital", "boolean", BOOL)],
    "weather report": [("day", "string", DAYS), ("temperature", "integer", list(range(-5, 36))),
                       ("sunny", "boolean", BOOL)],
    "order": [("product", "string", THINGS), ("quantity", "integer", list(range(1, 11))), ("paid", "boolean", BOOL)],
}


# The request, in words: {entity}, {described} ("whose name is "Rex" and whose age is 3"), {key_word}
# ("key" or "keys") and {keys} ("name" and "age").
QUESTIONS = Phrasings(seen=(
    "Write a JSON object for a {entity} {described}. Use the {key_word} {keys}.",
    "Describe a {entity} {described} as a JSON object with the {key_word} {keys}.",
    "Make a JSON object with the {key_word} {keys} for a {entity} {described}.",
    "I need JSON for a {entity} {described}. The {key_word} must be {keys}.",
    "Create a JSON record of a {entity} {described}, using the {key_word} {keys}.",
), unseen=(
    "Encode a {entity} {described} in JSON, with exactly the {key_word} {keys}.",
    "Give the data of a {entity} {described} as a JSON object; name the {key_word} {keys}.",
))
# How to answer: `env.structured` reads a reply that is all JSON, or one ```json block and nothing else.
INSTRUCTIONS = Phrasings(seen=(
    Reply("Reply with only the JSON object.", "{answer}"),
    Reply("Output the JSON and nothing else.", "{answer}"),
    Reply("Respond with just the JSON, no explanation.", "{answer}"),
    Reply("Put the JSON object in a ```json code block and write nothing else.", "```json\n{answer}\n```"),
    Reply("Your whole reply must be valid JSON.", "{answer}"),
), unseen=(
    Reply("Return only the object, as JSON, without any other text.", "{answer}"),
    Reply("Answer with a single ```json fenced block holding the object.", "```json\n{answer}\n```"),
))


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@register_task_generator("json_output", env="structured")
def json_output(
    num_train: int, num_validation: int, seed: int, num_fields: int = 2, exact_values: bool = True,
    instruction: Optional[str] = None, phrasings: str = "all",
) -> tuple[list[dict], list[dict]]:
    """A JSON object of one entity (a person, pet, book, product, city, weather report or order)
    whose keys and values the prompt gives in words.

    Options:
        num_fields: keys per object (default 2, 1..3), a random subset of the entity's three, in order.
        exact_values: the schema pins each value to the prompt's (`const`; default true); false
            checks only the keys and types.
        instruction: the sentence ending every prompt (default None: one of `INSTRUCTIONS`, drawn
            per row; "" for none).
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`).
    """
    check_range(num_fields, 1, 3, "num_fields")
    if not isinstance(exact_values, bool):
        raise OptionError(f"exact_values={exact_values!r}: must be true or false")

    def make_row(rng: random.Random, phrase) -> tuple:
        entity = rng.choice(sorted(ENTITIES))
        fields = ENTITIES[entity]
        keep = sorted(rng.sample(range(len(fields)), num_fields))
        obj, properties = {}, {}
        for i in keep:
            key, kind, values = fields[i]
            obj[key] = rng.choice(values)
            properties[key] = {"type": kind, **({"const": obj[key]} if exact_values else {})}
        schema = {"type": "object", "properties": properties, "required": list(obj), "additionalProperties": False}
        described = _join([f"whose {key} is {json.dumps(value)}" for key, value in obj.items()])
        keys = _join([json.dumps(key) for key in obj])
        text = phrase(QUESTIONS).format(entity=entity, described=described, keys=keys,
                                        key_word="keys" if len(obj) > 1 else "key")
        return (entity, json.dumps(obj)), {"prompt": with_instruction(text, phrase, INSTRUCTIONS, instruction),
                                           "answer": json.dumps(obj), "schema_str": json.dumps(schema)}

    return distinct_rows(num_train, num_validation, seed, make_row, "json_output", phrasings)
