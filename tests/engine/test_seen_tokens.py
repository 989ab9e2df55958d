"""SeenTokens: the distinct ids and output counts penalties read, kept incrementally, against a
brute-force count of the whole sequence after every update."""

import random

import numpy as np

from services.engine.seen_tokens import BULK_TOKENS, SeenTokens
from services.engine.sequence import Sequence
from services.engine.sampling_params import SamplingParams


def brute_force(tokens: list[int], num_prompt: int) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    counts: dict[int, float] = {}
    for position, t in enumerate(tokens):
        if t not in counts:
            ids.append(t)
            counts[t] = 0.0
        if position >= num_prompt:
            counts[t] += 1.0
    return ids, [counts[t] for t in ids]


def test_incremental_and_bulk_updates_match_a_recount():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice([5, 50, 5000])
        num_prompt = rng.randrange(1, 200)
        tokens = [rng.randrange(vocab) for _ in range(num_prompt)]
        seen = SeenTokens()
        for _ in range(30):
            seen.update(np.array(tokens, dtype=np.int64), num_prompt)
            ids, counts = seen.arrays()
            want_ids, want_counts = brute_force(tokens, num_prompt)
            assert ids.tolist() == want_ids
            assert counts.tolist() == want_counts
            # one token per step (decode), sometimes a burst past the bulk threshold (a resumed stream)
            burst = rng.choice([1, 1, 1, 3, BULK_TOKENS + 5])
            tokens += [rng.randrange(vocab) for _ in range(burst)]


def test_a_prompt_counted_in_bulk_may_end_mid_update():
    # The first update holds the prompt and outputs together (a resumed stream): only the
    # outputs count.
    tokens = [7, 7, 3, 9] * 10 + [3, 3, 11]
    seen = SeenTokens()
    seen.update(np.array(tokens, dtype=np.int64), 40)
    ids, counts = seen.arrays()
    assert ids.tolist() == [7, 3, 9, 11]
    assert counts.tolist() == [0.0, 2.0, 0.0, 1.0]


def test_with_outputs_counts_extra_tokens_and_leaves_the_state_alone():
    seen = SeenTokens()
    seen.update(np.array([4, 5, 4, 6], dtype=np.int64), 2)
    ids, counts = seen.with_outputs([6, 8, 8, 4])
    assert ids.tolist() == [4, 5, 6, 8]
    assert counts.tolist() == [2.0, 0.0, 2.0, 2.0]
    ids, counts = seen.arrays()
    assert ids.tolist() == [4, 5, 6]
    assert counts.tolist() == [1.0, 0.0, 1.0]


def test_a_sequence_keeps_its_seen_tokens_up_to_date():
    seq = Sequence("r", [1, 2, 1], SamplingParams(repetition_penalty=1.2))
    assert seq.seen_arrays()[0].tolist() == [1, 2]
    seq.token_ids += [2, 9]
    ids, counts = seq.seen_arrays()
    assert ids.tolist() == [1, 2, 9]
    assert counts.tolist() == [0.0, 1.0, 1.0]
