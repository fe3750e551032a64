"""Word pools and a local English-like sentence generator: the haystack of every task.

Nothing is downloaded: the haystack is sentences drawn from a small grammar, seeded, so a
sample is the same on every machine. The pools are disjoint by construction (checked in
tests): no filler word is a needle key, a needle value or the question marker, so an answer
can only be found in its needle.
"""

from __future__ import annotations

import random

SUBJECTS = (
    "engineer", "farmer", "teacher", "painter", "sailor", "doctor", "child", "writer", "baker",
    "pilot", "gardener", "student", "merchant", "singer", "soldier", "driver", "hunter",
    "fisherman", "nurse", "traveler", "neighbor", "captain", "scholar", "mother", "father",
    "king", "queen", "monk", "clerk", "judge",
)
OBJECTS = (
    "bridge", "garden", "letter", "window", "basket", "book", "river", "road", "house", "boat",
    "field", "lamp", "table", "wall", "door", "coat", "map", "song", "story", "picture", "fence",
    "roof", "cart", "rope", "bottle", "chair", "candle", "blanket", "wheel", "bell",
)
ADJECTIVES = (
    "old", "quiet", "bright", "heavy", "small", "large", "careful", "patient", "narrow", "wide",
    "green", "red", "blue", "wooden", "stone", "broken", "new", "distant", "warm", "cold",
    "tired", "happy", "gentle", "simple", "strange", "famous", "empty", "busy", "soft", "tall",
)
VERBS = (
    "repaired", "painted", "carried", "found", "opened", "closed", "cleaned", "watched",
    "built", "moved", "lifted", "counted", "described", "remembered", "visited", "crossed",
    "followed", "answered", "sold", "bought", "measured", "pulled", "pushed", "washed",
    "studied", "drew", "borrowed", "returned", "noticed", "shared",
)
ADVERBS = (
    "slowly", "quickly", "carefully", "quietly", "happily", "proudly", "suddenly", "gently",
    "often", "rarely", "easily", "finally", "boldly", "calmly", "silently",
)
PLACES = (
    "village", "market", "harbor", "valley", "forest", "castle", "station", "school", "church",
    "mountain", "island", "library", "kitchen", "square", "meadow", "orchard", "mill", "tower",
    "lake", "hill",
)
TIMES = ("morning", "evening", "afternoon", "spring", "summer", "autumn", "winter", "night")
PREPOSITIONS = ("near", "behind", "beside", "across", "inside", "under", "above", "around")

_TEMPLATES = (
    "The {adj} {subj} {verb} the {obj} {prep} the {place}.",
    "A {subj} {adv} {verb} the {adj} {obj}.",
    "In the {time} the {subj} {verb} a {adj} {obj} {prep} the {place}.",
    "Every {subj} in the {place} {verb} the {obj} {adv}.",
    "The {subj} and the {subj2} {verb} the {adj} {obj} together.",
    "Some {adj} {obj} was {verb} by the {subj} in the {time}.",
    "Near the {place} a {adj} {subj} {adv} {verb} an {obj}.",
)

# Needle keys: single words that never occur in the filler, so each is one token for the
# fixture model's word-level tokenizer and a short word for any real tokenizer.
KEYS = (
    "walrus", "quasar", "tundra", "saffron", "obelisk", "marmot", "zephyr", "cobalt", "lagoon",
    "falcon", "juniper", "nebula", "otter", "pagoda", "quartz", "raven", "sequoia", "tiger",
    "umber", "violet", "wombat", "xenon", "yak", "zinnia", "anvil", "badger", "cactus", "dingo",
    "ember", "fjord", "glacier", "hazel", "iguana", "jasper", "kiwi", "lotus", "mango",
    "narwhal", "onyx", "puffin",
)
# Needle values: seven-digit numbers as in RULER, a fixed pool so that the fixture model's
# tokenizer holds each as one token. Drawn once from a fixed seed; none shares a prefix of
# another's digits with the filler (the filler has no digits at all).
VALUES = tuple(str(v) for v in random.Random(20261122).sample(range(1_000_000, 10_000_000), 128))
# Variable names for variable tracking (RULER uses five random capitals).
VARIABLES = tuple(
    sorted({"".join(random.Random(i).choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)) for i in range(64)})
)
QUESTION_MARKER = "What"  # the only word that opens a question; never in the filler


def filler_words() -> list[str]:
    """Every word the grammar can produce (for building word-level vocabularies)."""
    words = {*SUBJECTS, *OBJECTS, *ADJECTIVES, *VERBS, *ADVERBS, *PLACES, *TIMES, *PREPOSITIONS}
    for template in _TEMPLATES:
        words.update(w for w in template.replace(".", " ").split() if "{" not in w)
    return sorted(words)


def sentences(rng: random.Random):
    """An endless stream of English-like sentences drawn from ``rng``."""
    while True:
        yield rng.choice(_TEMPLATES).format(
            adj=rng.choice(ADJECTIVES), subj=rng.choice(SUBJECTS), subj2=rng.choice(SUBJECTS),
            verb=rng.choice(VERBS), obj=rng.choice(OBJECTS), prep=rng.choice(PREPOSITIONS),
            place=rng.choice(PLACES), adv=rng.choice(ADVERBS), time=rng.choice(TIMES),
        )
