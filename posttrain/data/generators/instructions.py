"""Write about a topic under one to three simple checkable constraints, for the `instructions` environment.

Rows: `{"prompt": "Write one sentence about cats. Do not use any commas.", "answer": <a compliant
response>, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}` (IFEval's fields). The
answer is a short response that follows every constraint, built with the constraints (a reference
for SFT or for checking the row, never shown to the model).
"""

from __future__ import annotations

import random
import re
from typing import Sequence

from posttrain.data.generators.base import (
    OptionError, check_choices, check_range, distinct_rows, register_task_generator,
)

# (topic, a plain sentence about it: no commas, none of FORBIDDEN, under ten words)
TOPICS = [
    ("the sea", "The sea is deep and full of fish."), ("cats", "Cats like to sleep in the warm sun."),
    ("rain", "Rain helps the plants and trees grow."), ("the moon", "The moon shines at night in the sky."),
    ("bread", "Fresh bread smells sweet in the morning."), ("music", "Music can make people feel happy."),
    ("trees", "Trees give us shade and clean air."), ("winter", "Winter brings snow and cold days."),
    ("friends", "Friends help each other when times are hard."), ("the sun", "The sun gives the earth light and heat."),
    ("books", "Books let us visit new places in our minds."), ("dogs", "Dogs are loyal and like to play."),
    ("coffee", "Coffee is a warm drink many people enjoy."), ("the city", "The city is busy with cars and people."),
    ("gardens", "A garden is full of flowers and bees."), ("school", "At school children learn to read and write."),
    ("the forest", "The forest is quiet and green."), ("birds", "Birds sing songs early in the day."),
    ("the beach", "The beach has soft sand and warm water."), ("mountains", "Mountains are tall and often covered in snow."),
    ("summer", "Summer days are long and bright."), ("the river", "The river flows slowly to the sea."),
    ("apples", "Apples are sweet fruits that grow on trees."), ("trains", "Trains carry people from town to town."),
    ("the night sky", "The night sky is full of stars."), ("flowers", "Flowers bloom in many bright colors."),
    ("the kitchen", "The kitchen is where we cook our food."), ("bicycles", "A bicycle is a quiet way to travel."),
    ("snow", "Snow falls softly on cold winter nights."), ("tea", "Tea is a calm drink for a slow afternoon."),
    ("soccer", "Soccer is a game played with a ball."), ("the wind", "The wind moves the leaves on the trees."),
    ("honey", "Bees make honey from the nectar of flowers."), ("the library", "The library is a calm place to read."),
    ("pizza", "Pizza is bread topped with cheese and sauce."), ("clouds", "Clouds float high above the ground."),
    ("the farm", "The farm has cows and sheep and hens."), ("stars", "Stars shine far away in space."),
    ("chess", "Chess is a game of careful thinking."), ("the park", "Children play on the grass in the park."),
    ("the zoo", "The zoo has lions and bears and monkeys."), ("boats", "Boats float on lakes and rivers."),
    ("the desert", "The desert is dry and hot during the day."), ("cheese", "Cheese is made from milk."),
    ("kites", "Kites fly high when the wind blows."), ("the train station", "The train station is full of travelers."),
    ("owls", "Owls hunt for food at night."), ("the island", "The island is surrounded by blue water."),
    ("painting", "Painting lets people share what they see."), ("the market", "The market sells fruit and fresh fish."),
    ("hats", "A hat keeps the sun off your face."), ("rivers", "Rivers carry water down to the sea."),
    ("the piano", "The piano has black and white keys."), ("horses", "Horses can run fast across open fields."),
    ("autumn", "In autumn the leaves turn red and gold."), ("spring", "Spring is when new flowers start to grow."),
    ("the bakery", "The bakery sells bread and cakes."), ("frogs", "Frogs live near ponds and lakes."),
    ("the lighthouse", "The lighthouse guides ships at night."), ("soup", "Hot soup is a warm meal on a cold day."),
]
FILLERS = ["Many people like {topic}.", "I enjoy learning about {topic}.", "There is a lot to say about {topic}."]
KEYWORDS = ["happy", "blue", "light", "quiet", "morning", "family", "water", "home", "simple", "bright", "peace", "color"]
FORBIDDEN = ["very", "really", "nice", "good", "thing", "beautiful", "amazing", "big", "love", "always", "never", "fun"]
END_PHRASES = ["That is all.", "The end.", "Thank you.", "Have a great day.", "See you soon.", "Any other questions?"]
OPENINGS = {  # one sentence, or (with bullets or a minimum length) a few
    False: ["Write one sentence about {topic}.", "Describe {topic} in one sentence.", "Tell me about {topic} in one sentence."],
    True: ["Write a few sentences about {topic}.", "Describe {topic} in a few sentences.", "Tell me about {topic} in a few sentences."],
}

NO_COMMA, LOWER, UPPER = "punctuation:no_comma", "change_case:english_lowercase", "change_case:english_capital"
WORDS, KEYWORD, FORBID = "length_constraints:number_words", "keywords:existence", "keywords:forbidden_words"
END, QUOTE, TITLE = "startend:end_checker", "startend:quotation", "detectable_format:title"
POSTSCRIPT, BULLETS = "detectable_content:postscript", "detectable_format:number_bullet_lists"
INSTRUCTIONS = (NO_COMMA, LOWER, UPPER, WORDS, KEYWORD, FORBID, END, QUOTE, TITLE, POSTSCRIPT, BULLETS)
CONFLICTS = [{LOWER, UPPER}, {QUOTE, BULLETS}]  # pairs that cannot hold together (a quote before the first "* ")


def _count_words(text: str) -> int:
    return len(re.findall(r"\w+", text))  # as IFEval counts them


def _draw_ids(rng: random.Random, allowed: list[str], n: int) -> list[str]:
    ids: list[str] = []
    for candidate in rng.sample(allowed, len(allowed)):
        if len(ids) < n and not any({candidate, other} in CONFLICTS for other in ids):
            ids.append(candidate)
    return ids


def _respond(rng: random.Random, ids: list[str], topic: str, sentence: str) -> tuple[str, dict[str, dict], list[str], bool]:
    """(a response following every instruction, each one's kwargs, each one's phrase in the prompt,
    whether it asks for several sentences)."""
    kwargs: dict[str, dict] = {i: {} for i in ids}
    phrases = {NO_COMMA: "Do not use any commas.", LOWER: "Write only in lowercase letters.",
               UPPER: "Write only in capital letters.", QUOTE: "Wrap your whole response in double quotation marks.",
               TITLE: "Start with a title in double angle brackets, like <<my title>>.",
               POSTSCRIPT: "Add a postscript that starts with P.S."}
    fillers = [f.format(topic=topic) for f in FILLERS]
    sentences = [sentence]
    if KEYWORD in ids:
        word = rng.choice(KEYWORDS)
        sentences.append(f"The word {word} fits it well.")
        kwargs[KEYWORD], phrases[KEYWORD] = {"keywords": [word]}, f"Include the word '{word}'."
    bullets = rng.randint(2, 3) if BULLETS in ids else 0
    minimum = rng.randint(10, 20) if WORDS in ids and rng.random() < 0.5 else 0
    while len(sentences) < bullets or _count_words(" ".join(sentences)) < minimum:
        sentences.append(fillers[(len(sentences) - 1) % len(fillers)])
    if bullets:
        groups = [sentences[i::bullets] for i in range(bullets)]
        lines = ["* " + " ".join(group) for group in groups]
        kwargs[BULLETS], phrases[BULLETS] = {"num_bullets": bullets}, f"Use exactly {bullets} bullet points that start with '* '."
    else:
        lines = [" ".join(sentences)]
    if TITLE in ids:
        lines.insert(0, f"<<{topic.title()}>>")
    if POSTSCRIPT in ids:
        lines.append(f"P.S. I hope you liked this note about {topic}.")
        kwargs[POSTSCRIPT] = {"postscript_marker": "P.S."}
    if END in ids:
        phrase = rng.choice(END_PHRASES)
        lines.append(phrase)
        kwargs[END], phrases[END] = {"end_phrase": phrase}, f"End your response with this exact phrase: {phrase}"
    text = "\n".join(lines)
    text = text.lower() if LOWER in ids else text.upper() if UPPER in ids else text
    text = f'"{text}"' if QUOTE in ids else text
    if WORDS in ids:
        if minimum:
            kwargs[WORDS], phrases[WORDS] = {"num_words": minimum, "relation": "at least"}, f"Use at least {minimum} words."
        else:
            limit = _count_words(text) + rng.randint(1, 6)
            kwargs[WORDS], phrases[WORDS] = {"num_words": limit, "relation": "less than"}, f"Use fewer than {limit} words."
    if FORBID in ids:
        word = rng.choice([w for w in FORBIDDEN if not re.search(rf"\b{w}\b", text, re.IGNORECASE)])
        kwargs[FORBID], phrases[FORBID] = {"forbidden_words": [word]}, f"Do not use the word '{word}'."
    return text, kwargs, [phrases[i] for i in ids], bool(bullets or minimum)


@register_task_generator("instructions", env="instructions")
def instructions(
    num_train: int, num_validation: int, seed: int, num_instructions: int = 1,
    instruction_ids: Sequence[str] = INSTRUCTIONS,
) -> tuple[list[dict], list[dict]]:
    """A short text about an everyday topic that must follow IFEval-style constraints.

    Options:
        num_instructions: constraints per prompt (default 1, 1..3), distinct and compatible.
        instruction_ids: the constraints drawn from (default all of these IFEval ids):
            `punctuation:no_comma`, `change_case:english_lowercase`, `change_case:english_capital`,
            `length_constraints:number_words` (fewer than or at least N words),
            `keywords:existence` (include a word), `keywords:forbidden_words` (avoid a word),
            `startend:end_checker` (end with a phrase), `startend:quotation`,
            `detectable_format:title` (`<<title>>`), `detectable_content:postscript` (`P.S.`),
            `detectable_format:number_bullet_lists` (exactly 2 or 3 `* ` bullets).
    """
    allowed = check_choices(instruction_ids, INSTRUCTIONS, "instruction_ids")
    check_range(num_instructions, 1, 3, "num_instructions")
    compatible = len(allowed) - sum(pair <= set(allowed) for pair in CONFLICTS)  # the pairs are disjoint
    if compatible < num_instructions:
        raise OptionError(f"num_instructions={num_instructions}: instruction_ids {allowed} hold only {compatible} "
                         f"that can hold together (conflicting: {[sorted(pair) for pair in CONFLICTS]})")

    def make_row(rng: random.Random) -> dict:
        ids = _draw_ids(rng, allowed, num_instructions)
        topic, sentence = rng.choice(TOPICS)
        answer, kwargs, phrases, several = _respond(rng, ids, topic, sentence)
        opening = rng.choice(OPENINGS[several])
        return {"prompt": " ".join([opening.format(topic=topic)] + phrases), "answer": answer,
                "instruction_id_list": ids, "kwargs": [kwargs[i] for i in ids]}

    return distinct_rows(num_train, num_validation, seed, make_row, "instructions")
