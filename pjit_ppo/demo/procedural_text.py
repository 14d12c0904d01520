"""A procedural English-like corpus with sentiment that a model can learn.

Sentences are `NP VP [and NP VP] .` with determiners, nouns, adjectives, verbs and
adverbs. Adjectives, verbs and adverbs come in positive, neutral and negative kinds;
the sentiment words are entries of VADER's lexicon (positive words score > 0 there,
negative < 0), so the demo's gold judge sees the sentiment the corpus carries. Each
sentence has a mood (positive, neutral or negative, equally likely) that most of its
sentiment words follow, so a prompt's first words hint at how it goes on, and a
policy can learn to continue any prompt more positively.

Prompts are a sentence's first noun phrase ("the old dog"); the rest of the
sentence is the continuation a policy writes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Dict, List, Sequence, Tuple

DETERMINERS = ("the", "a", "my", "our", "this", "that", "every")
NOUNS = ("dog", "cat", "teacher", "farmer", "child", "garden", "city", "river", "house",
         "doctor", "bird", "sister", "neighbor", "village", "king", "girl", "boy", "horse",
         "baker", "forest", "song", "storm", "market", "student", "painter", "sailor")
#: sentiment kind -> words; positive/negative ones all have a VADER valence of the same sign.
ADJECTIVES = {
    "positive": ("happy", "wonderful", "great", "lovely", "good", "nice", "beautiful",
                 "kind", "cheerful", "gentle", "brave", "friendly", "joyful", "sweet",
                 "pleasant", "glad", "proud"),
    "neutral": ("old", "small", "tall", "green", "red", "wooden", "quiet", "young", "round",
                "northern", "busy", "distant", "yellow", "square"),
    "negative": ("sad", "terrible", "awful", "ugly", "angry", "bad", "horrible", "cruel",
                 "nasty", "bitter", "miserable", "lonely", "scary", "dirty", "rude", "sick"),
}
VERBS = {
    "positive": ("loves", "likes", "enjoys", "admires", "helps", "hugs", "praises", "thanks",
                 "welcomes", "trusts", "celebrates"),
    "neutral": ("sees", "visits", "follows", "passes", "watches", "finds", "meets", "crosses",
                "paints", "carries"),
    "negative": ("hates", "fears", "hurts", "attacks", "blames", "rejects", "insults",
                 "destroys", "abandons", "kills"),
}
ADVERBS = {
    "positive": ("happily", "gladly", "warmly", "kindly"),
    "neutral": ("today", "again", "slowly", "often"),
    "negative": ("sadly", "angrily", "badly", "cruelly"),
}
MOODS = ("positive", "neutral", "negative")


@dataclasses.dataclass(frozen=True)
class CorpusOptions:
    """Sizes and probabilities of the generated corpus."""

    num_sentences: int = 6000       # training sentences (SFT corpus, PPO and label prompts)
    num_heldout: int = 600          # held-out sentences (SFT test loss, evaluation prompts)
    follow_mood: float = 0.75       # chance a sentiment word follows the sentence's mood
    adjective: float = 0.6          # chance a noun phrase has an adjective
    adverb: float = 0.25            # chance a verb phrase ends with an adverb
    second_clause: float = 0.35     # chance of "and NP VP"
    seed: int = 0


def _kind(r: random.Random, mood: str, follow: float) -> str:
    return mood if r.random() < follow else r.choice(MOODS)


def _noun_phrase(r: random.Random, mood: str, o: CorpusOptions) -> List[str]:
    words = [r.choice(DETERMINERS)]
    if r.random() < o.adjective:
        words.append(r.choice(ADJECTIVES[_kind(r, mood, o.follow_mood)]))
    return words + [r.choice(NOUNS)]


def _clause(r: random.Random, mood: str, o: CorpusOptions) -> Tuple[List[str], List[str]]:
    subject = _noun_phrase(r, mood, o)
    rest = [r.choice(VERBS[_kind(r, mood, o.follow_mood)])] + _noun_phrase(r, mood, o)
    if r.random() < o.adverb:
        rest.append(r.choice(ADVERBS[_kind(r, mood, o.follow_mood)]))
    return subject, rest


def sentence(r: random.Random, o: CorpusOptions) -> Tuple[str, str]:
    """(prompt, continuation): the first noun phrase, and the rest ending in " ."."""
    mood = r.choice(MOODS)
    subject, rest = _clause(r, mood, o)
    if r.random() < o.second_clause:
        s2, r2 = _clause(r, mood, o)
        rest = rest + ["and"] + s2 + r2
    return " ".join(subject), " " + " ".join(rest + ["."])


def generate(o: CorpusOptions = CorpusOptions()) -> Dict[str, List[Tuple[str, str]]]:
    """{"train": [(prompt, continuation)] * num_sentences, "heldout": [...] * num_heldout};
    held-out sentences never occur in train."""
    r = random.Random(o.seed)
    seen, train, heldout = set(), [], []
    while len(train) < o.num_sentences or len(heldout) < o.num_heldout:
        pair = sentence(r, o)
        text = pair[0] + pair[1]
        if len(heldout) < o.num_heldout and r.random() < 0.1 and text not in seen:
            heldout.append(pair)
        elif len(train) < o.num_sentences:
            train.append(pair)
        seen.add(text)
    held = {p + c for p, c in heldout}
    train = [pc for pc in train if pc[0] + pc[1] not in held]
    return {"train": train, "heldout": heldout}


def write(directory: str, o: CorpusOptions = CorpusOptions()) -> Dict[str, str]:
    """Writes the corpus files; returns their paths by name.

      corpus_train.txt / corpus_heldout.txt   one sentence per line (SFT corpus)
      prompts_train.jsonl / prompts_heldout.jsonl   {"prompt": first noun phrase}
    """
    os.makedirs(directory, exist_ok=True)
    parts = generate(o)
    paths = {}
    for split, pairs in parts.items():
        paths[f"corpus_{split}"] = p = os.path.join(directory, f"corpus_{split}.txt")
        with open(p, "w", encoding="utf-8") as f:
            f.writelines(prompt + cont + "\n" for prompt, cont in pairs)
        paths[f"prompts_{split}"] = p = os.path.join(directory, f"prompts_{split}.jsonl")
        with open(p, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"prompt": prompt}) + "\n" for prompt, _ in pairs)
    return paths


def words() -> Sequence[str]:
    """Every word the grammar can emit."""
    out = set(DETERMINERS) | set(NOUNS) | {"and", "."}
    for table in (ADJECTIVES, VERBS, ADVERBS):
        for group in table.values():
            out.update(group)
    return sorted(out)
