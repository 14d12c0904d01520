"""The demo's "human": VADER's compound sentiment as the gold score, and noisy choices.

VADER (Hutto & Gilbert, 2014; the `vaderSentiment` package) is a published rule-based
sentiment analyser with its own lexicon; its compound score in [-1, 1] plays the role
human sentiment judgements played in lm-human-preferences' sentiment task. The
labeller picks one of N responses with probability softmax(gold / temperature), so
it prefers more positive text and sometimes errs, as people do.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


class GoldJudge:
    """VADER compound scores of texts: float64 [N] in [-1, 1]."""

    def __init__(self):
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError:
            raise ImportError("the demo's judge needs vaderSentiment: "
                              "pip install -e '.[demo]'") from None
        self._analyzer = SentimentIntensityAnalyzer()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([self._analyzer.polarity_scores(t)["compound"] for t in texts])


def noisy_choices(gold: np.ndarray, temperature: float, seed: int) -> np.ndarray:
    """Index chosen among each row's N responses: gold float [M, N] -> int64 [M], drawn
    from softmax(gold / temperature) (temperature -> 0: always the best)."""
    logits = np.asarray(gold, np.float64) / max(temperature, 1e-6)
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    r = np.random.default_rng(seed)
    return np.array([r.choice(len(p), p=p) for p in probs])


def best_of_n_records(queries: Sequence[str], responses: Sequence[Sequence[str]],
                      choices: Sequence[int]) -> List[dict]:
    """Label records in the best-of-N JSONL shape the reward learner reads."""
    return [{"query": q, "responses": list(rs), "choice": int(c)}
            for q, rs, c in zip(queries, responses, choices)]
