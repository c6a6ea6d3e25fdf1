"""Write about a topic under one to three simple checkable constraints, for the `instructions` environment.

Rows: `{"prompt": "Write one sentence about cats. Do not use any commas.", "answer": <a compliant
response>, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}` (IFEval's fields). The
answer is a short response that follows every constraint, built with the constraints (a reference
for SFT or for checking the row, never shown to the model). The request and each constraint come
from seven wordings each, two of them held out of training (`phrasings`,
`posttrain.data.generators.base.Phrasings`).
"""

from __future__ import annotations

import json
import random
import re
from typing import Sequence

from posttrain.data.generators.base import (
    OptionError, Phraser, Phrasings, check_choices, check_range, distinct_rows, register_task_generator,
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
    ("rabbits", "Rabbits have long ears and soft fur."), ("the post office", "The post office sends letters across the country."),
    ("volcanoes", "A volcano can pour out hot melted rock."), ("rainbows", "A rainbow appears when sunlight meets rain."),
    ("the violin", "The violin is played with a bow."), ("oranges", "Oranges are juicy fruits full of vitamin C."),
    ("the airport", "The airport is busy with planes and travelers."), ("penguins", "Penguins swim well but cannot fly."),
    ("the calendar", "A calendar shows the days of the month."), ("candles", "A candle gives a soft warm light."),
    ("the bridge", "The bridge lets cars cross the river."), ("whales", "Whales are huge animals that live in the ocean."),
    ("gloves", "Gloves keep your hands warm in winter."), ("the museum", "The museum shows art and old objects."),
    ("butterflies", "Butterflies have bright wings with many patterns."), ("the clock", "The clock tells us the time of day."),
    ("rice", "Rice is a grain eaten all over the world."), ("the lake", "The lake is calm and cool in the evening."),
    ("umbrellas", "An umbrella keeps you dry in the rain."), ("the hospital", "Doctors and nurses work at the hospital."),
    ("squirrels", "Squirrels gather nuts before the cold months."), ("the guitar", "The guitar has six strings."),
    ("sandwiches", "A sandwich is food between two slices of bread."), ("the harbor", "Ships rest in the harbor after a long trip."),
    ("elephants", "Elephants are large animals with long trunks."), ("the campfire", "People sit around the campfire to keep warm."),
    ("lemons", "Lemons taste sour and bright."), ("the classroom", "The classroom has desks and a board."),
    ("foxes", "Foxes are clever animals with bushy tails."), ("the bus", "The bus takes people across town."),
    ("ice cream", "Ice cream is a cold sweet treat."), ("the orchard", "The orchard is full of fruit trees."),
    ("dolphins", "Dolphins are smart animals that live in the sea."), ("the map", "A map shows where places are."),
    ("pumpkins", "Pumpkins grow on vines in the fall."), ("the storm", "The storm brought thunder and heavy rain."),
    ("shoes", "Shoes protect our feet when we walk."), ("the playground", "Children run and climb at the playground."),
    ("turtles", "Turtles carry their shells on their backs."), ("the cafe", "The cafe serves warm drinks and cake."),
]
FILLERS = ["Many people like {topic}.", "I enjoy learning about {topic}.", "There is a lot to say about {topic}."]
KEYWORDS = ["happy", "blue", "light", "quiet", "morning", "family", "water", "home", "simple", "bright", "peace", "color"]
FORBIDDEN = ["very", "really", "nice", "good", "thing", "beautiful", "amazing", "big", "love", "always", "never", "fun"]
END_PHRASES = ["That is all.", "The end.", "Thank you.", "Have a great day.", "See you soon.", "Any other questions?"]
OPENINGS = {  # the request: one sentence, or (with bullets or a minimum length) a few
    False: Phrasings(seen=(
        "Write one sentence about {topic}.",
        "Describe {topic} in one sentence.",
        "Tell me about {topic} in one sentence.",
        "Write a single sentence on {topic}.",
        "Say something about {topic} in one sentence.",
    ), unseen=(
        "Give me one sentence about {topic}.",
        "Compose a one-sentence note about {topic}.",
    )),
    True: Phrasings(seen=(
        "Write a few sentences about {topic}.",
        "Describe {topic} in a few sentences.",
        "Tell me about {topic} in a few sentences.",
        "Write a short paragraph about {topic}.",
        "Say a few things about {topic}.",
    ), unseen=(
        "Give me a few sentences about {topic}.",
        "Compose a short note about {topic}.",
    )),
}
ORIGINAL_OPENINGS = 3  # openings per length before there were phrasings

NO_COMMA, LOWER, UPPER = "punctuation:no_comma", "change_case:english_lowercase", "change_case:english_capital"
WORDS, KEYWORD, FORBID = "length_constraints:number_words", "keywords:existence", "keywords:forbidden_words"
END, QUOTE, TITLE = "startend:end_checker", "startend:quotation", "detectable_format:title"
POSTSCRIPT, BULLETS = "detectable_content:postscript", "detectable_format:number_bullet_lists"
INSTRUCTIONS = (NO_COMMA, LOWER, UPPER, WORDS, KEYWORD, FORBID, END, QUOTE, TITLE, POSTSCRIPT, BULLETS)
CONFLICTS = [{LOWER, UPPER}, {QUOTE, BULLETS}]  # pairs that cannot hold together (a quote before the first "* ")

# Each constraint in words; {word}, {phrase}, {n}: its argument. The reference answer follows the
# constraint whatever its wording, so every one scores 1.
CONSTRAINTS = {
    NO_COMMA: Phrasings(seen=(
        "Do not use any commas.", "Write without a single comma.", "Your response must contain no commas.",
        "Avoid commas entirely.", "Leave out all commas.",
    ), unseen=("No commas are allowed in your answer.", "Make sure there is not one comma in your reply.")),
    LOWER: Phrasings(seen=(
        "Write only in lowercase letters.", "Use lowercase letters only, with no capitals.",
        "Your whole response must be in lowercase.", "Do not use any capital letters.", "Write everything in small letters.",
    ), unseen=("Keep every letter lowercase.", "Your answer should contain no uppercase letters at all.")),
    UPPER: Phrasings(seen=(
        "Write only in capital letters.", "Use capital letters only.", "Your whole response must be in uppercase.",
        "Do not use any lowercase letters.", "Write everything in block capitals.",
    ), unseen=("Keep every letter uppercase.", "Your answer should contain no lowercase letters at all.")),
    QUOTE: Phrasings(seen=(
        "Wrap your whole response in double quotation marks.", "Put your entire answer inside double quotes.",
        "Start and end your response with a double quotation mark.",
        "Enclose everything you write in double quotation marks.", "Your whole reply must be one quotation, in double quotes.",
    ), unseen=("Surround the full response with double quotes.", "Place the complete answer between double quotation marks.")),
    TITLE: Phrasings(seen=(
        "Start with a title in double angle brackets, like <<my title>>.",
        "Begin with a title wrapped in double angle brackets, such as <<title>>.",
        "Give your response a title in the form <<title>>.", "Put a title like <<a title>> at the top.",
        "Add a title in double angle brackets (<<...>>) first.",
    ), unseen=("Open with a title enclosed in << and >>.", "Include a title written as <<title>> before the text.")),
    POSTSCRIPT: Phrasings(seen=(
        "Add a postscript that starts with P.S.", "End with a postscript starting with P.S.", "Include a P.S. at the end.",
        "Finish with a note that begins with P.S.", "Add a line starting with P.S. after the text.",
    ), unseen=("Close with a postscript marked P.S.", "Write a P.S. line at the bottom.")),
    END: Phrasings(seen=(
        "End your response with this exact phrase: {phrase}", "Finish your response with the exact words: {phrase}",
        "Your last words must be: {phrase}", "Close your response with exactly this phrase: {phrase}",
        "The response must end with the phrase: {phrase}",
    ), unseen=("Make the very end of your reply this phrase: {phrase}",
               "Conclude with these exact words and nothing after them: {phrase}")),
    KEYWORD: Phrasings(seen=(
        "Include the word '{word}'.", "Use the word '{word}' somewhere.", "Make sure the word '{word}' appears.",
        "Your response must contain the word '{word}'.", "Mention the word '{word}' at least once.",
    ), unseen=("Work the word '{word}' into your answer.", "Do not forget to use the word '{word}'.")),
    FORBID: Phrasings(seen=(
        "Do not use the word '{word}'.", "Avoid the word '{word}'.", "Never write the word '{word}'.",
        "The word '{word}' must not appear.", "Leave out the word '{word}'.",
    ), unseen=("Your reply may not contain the word '{word}'.", "Keep the word '{word}' out of your response.")),
    BULLETS: Phrasings(seen=(
        "Use exactly {n} bullet points that start with '* '.", "Write exactly {n} bullet points, each starting with '* '.",
        "Format the answer as {n} bullet points beginning with '* '.", "Give exactly {n} bullets, marked with '* '.",
        "Your response must have exactly {n} bullet points ('* ').",
    ), unseen=("Organize your answer into exactly {n} '* ' bullet points.",
               "List exactly {n} points, each on a line starting with '* '.")),
    "at least": Phrasings(seen=(  # length_constraints:number_words, either relation
        "Use at least {n} words.", "Write no fewer than {n} words.", "Your response must be at least {n} words long.",
        "Make your answer {n} words or longer.", "Write a minimum of {n} words.",
    ), unseen=("The response should contain {n} or more words.", "Do not write fewer than {n} words.")),
    "less than": Phrasings(seen=(
        "Use fewer than {n} words.", "Write less than {n} words.", "Keep your response under {n} words.",
        "Your answer must be shorter than {n} words.", "Stay below {n} words.",
    ), unseen=("The response should contain fewer than {n} words.", "Use less than {n} words in total.")),
}


def _count_words(text: str) -> int:
    return len(re.findall(r"\w+", text))  # as IFEval counts them


def _draw_ids(rng: random.Random, allowed: list[str], n: int) -> list[str]:
    ids: list[str] = []
    for candidate in rng.sample(allowed, len(allowed)):
        if len(ids) < n and not any({candidate, other} in CONFLICTS for other in ids):
            ids.append(candidate)
    return ids


def _respond(rng: random.Random, phrase: Phraser, ids: list[str], topic: str,
             sentence: str) -> tuple[str, dict[str, dict], list[str], bool]:
    """(a response following every instruction, each one's kwargs, each one's phrase in the prompt,
    whether it asks for several sentences). The response and kwargs come from `rng`, the phrases
    from `phrase`."""
    kwargs: dict[str, dict] = {i: {} for i in ids}
    say = {i: {} for i in ids}  # each constraint's fields in its phrase
    fillers = [f.format(topic=topic) for f in FILLERS]
    sentences = [sentence]
    if KEYWORD in ids:
        word = rng.choice(KEYWORDS)
        sentences.append(f"The word {word} fits it well.")
        kwargs[KEYWORD], say[KEYWORD] = {"keywords": [word]}, {"word": word}
    bullets = rng.randint(2, 3) if BULLETS in ids else 0
    minimum = rng.randint(10, 20) if WORDS in ids and rng.random() < 0.5 else 0
    while len(sentences) < bullets or _count_words(" ".join(sentences)) < minimum:
        sentences.append(fillers[(len(sentences) - 1) % len(fillers)])
    if bullets:
        groups = [sentences[i::bullets] for i in range(bullets)]
        lines = ["* " + " ".join(group) for group in groups]
        kwargs[BULLETS], say[BULLETS] = {"num_bullets": bullets}, {"n": bullets}
    else:
        lines = [" ".join(sentences)]
    if TITLE in ids:
        lines.insert(0, f"<<{topic.title()}>>")
    if POSTSCRIPT in ids:
        lines.append(f"P.S. I hope you liked this note about {topic}.")
        kwargs[POSTSCRIPT] = {"postscript_marker": "P.S."}
    if END in ids:
        end_phrase = rng.choice(END_PHRASES)
        lines.append(end_phrase)
        kwargs[END], say[END] = {"end_phrase": end_phrase}, {"phrase": end_phrase}
    text = "\n".join(lines)
    text = text.lower() if LOWER in ids else text.upper() if UPPER in ids else text
    text = f'"{text}"' if QUOTE in ids else text
    if WORDS in ids:
        limit = minimum or _count_words(text) + rng.randint(1, 6)
        kwargs[WORDS] = {"num_words": limit, "relation": "at least" if minimum else "less than"}
        say[WORDS] = {"n": limit}
    if FORBID in ids:
        word = rng.choice([w for w in FORBIDDEN if not re.search(rf"\b{w}\b", text, re.IGNORECASE)])
        kwargs[FORBID], say[FORBID] = {"forbidden_words": [word]}, {"word": word}
    phrases = [phrase(CONSTRAINTS[kwargs[i]["relation"] if i == WORDS else i]).format(**say[i]) for i in ids]
    return text, kwargs, phrases, bool(bullets or minimum)


@register_task_generator("instructions", env="instructions")
def instructions(
    num_train: int, num_validation: int, seed: int, num_instructions: int = 1,
    instruction_ids: Sequence[str] = INSTRUCTIONS, phrasings: str = "all",
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
        phrasings: `all` (default), `seen` or `unseen` templates (`data.phrasings`) of the request
            and of each constraint.
    """
    allowed = check_choices(instruction_ids, INSTRUCTIONS, "instruction_ids")
    check_range(num_instructions, 1, 3, "num_instructions")
    compatible = len(allowed) - sum(pair <= set(allowed) for pair in CONFLICTS)  # the pairs are disjoint
    if compatible < num_instructions:
        raise OptionError(f"num_instructions={num_instructions}: instruction_ids {allowed} hold only {compatible} "
                         f"that can hold together (conflicting: {[sorted(pair) for pair in CONFLICTS]})")

    def make_row(rng: random.Random, phrase: Phraser) -> tuple:
        ids = _draw_ids(rng, allowed, num_instructions)
        topic, sentence = rng.choice(TOPICS)
        answer, kwargs, phrases, several = _respond(rng, phrase, ids, topic, sentence)
        rng.randrange(ORIGINAL_OPENINGS)  # the opening was drawn here once: kept, so a seed gives the same problems
        opening = phrase(OPENINGS[several]).format(topic=topic)
        problem = json.dumps([ids, topic, [kwargs[i] for i in ids]])
        return problem, {"prompt": " ".join([opening] + phrases), "answer": answer,
                         "instruction_id_list": ids, "kwargs": [kwargs[i] for i in ids]}

    return distinct_rows(num_train, num_validation, seed, make_row, "instructions", phrasings)
