"""Preference labels as DPO pairs: the label files reward learning reads, split into
training and held-out labels, tokenised, and each label turned into (chosen, rejected)
pairs. A pairwise label is one pair; a best-of-N label gives N - 1 pairs (chosen = the
choice, rejected = each other response, in response order)."""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from pjit_ppo.data import preferences
from pjit_ppo.errors import DataError

#: The arrays of a set of pairs (host numpy, P pairs), the batch keys of the DPO step.
PAIR_KEYS = ("query", "query_mask", "chosen", "chosen_mask", "rejected", "rejected_mask",
             "weight")


def split_labels(config) -> Tuple[List[preferences.PreferenceRecord],
                                  List[preferences.PreferenceRecord]]:
    """(training records, held-out records) of a DPOConfig: test_labels_path, or
    test_fraction of labels_path chosen by a permutation from `seed` (the same split
    reward learning makes of the same file and seed). DataError names file and line."""
    records = preferences.load_preferences(config.labels_path)
    if config.test_labels_path:
        return records, preferences.load_preferences(config.test_labels_path)
    n_test = max(1, int(round(len(records) * config.test_fraction)))
    if n_test >= len(records):
        raise DataError(f"{config.labels_path}: {len(records)} label(s) cannot be split into "
                        f"training and held-out sets; add labels or set test_labels_path")
    order = np.random.default_rng([config.seed, 104729]).permutation(len(records))
    return ([records[i] for i in sorted(order[n_test:])],
            [records[i] for i in sorted(order[:n_test])])


def preference_pairs(prefs: preferences.Preferences, pad_id: int) -> Dict[str, np.ndarray]:
    """Tokenised labels -> pairs, label by label (a label's N - 1 pairs together).

    prefs: `preferences.Preferences` with M labels of N responses (query [M, Q],
    responses [M, N, R], response_mask [M, N, R], choice [M]).
    Returns {name: host array} with P = M (N - 1) rows: query int32 [P, Q],
    query_mask bool [P, Q] (query != pad_id), chosen / rejected int32 [P, R],
    chosen_mask / rejected_mask bool [P, R], weight float32 [P] (ones).
    """
    m, n, _ = prefs.responses.shape
    choice = prefs.choice.astype(np.int64)
    label = np.repeat(np.arange(m), n - 1)                        # [P]
    # The j-th rejected response of a label: index j, skipping the chosen one.
    j = np.tile(np.arange(n - 1), m)
    rejected = j + (j >= choice[label])
    chosen = choice[label]
    query = prefs.query[label]
    return {"query": query, "query_mask": query != pad_id,
            "chosen": prefs.responses[label, chosen],
            "chosen_mask": prefs.response_mask[label, chosen],
            "rejected": prefs.responses[label, rejected],
            "rejected_mask": prefs.response_mask[label, rejected],
            "weight": np.ones(len(label), np.float32)}


def tokenized_pairs(records, tokenizer, config) -> Dict[str, np.ndarray]:
    """`preference_pairs` of label records tokenised to the config's sequence shapes."""
    prefs = preferences.tokenize_preferences(
        records, tokenizer, query_length=config.query_length,
        response_length=config.response_length, pad_id=config.pad_token_id,
        start_text=config.start_text, end_text=config.end_text)
    return preference_pairs(prefs, config.pad_token_id)
