"""prime-rl's fake SFT data (`[data] type = "fake"`): token rows made up instead of read, to measure
the trainer alone. Row i is a pure function of (seed, i), so a resume replays exactly the rows a
never-stopped run would have trained (the data cursor is the same as for real rows)."""

from __future__ import annotations

import numpy as np

from hpcrl.trainer.sft_data import Rows, TokenizedSample

ROWS_PER_EPOCH = 1 << 20  # an "epoch" of fake rows: indices the cursor draws from


def fake_rows() -> Rows:
    """A stand-in row source: only its length (and name) is used; `fake_sample` makes the rows."""
    return Rows(range(ROWS_PER_EPOCH), source="fake")


def fake_sample(i: int, seq_len: int, vocab: int, length: str, input_ids: str, seed: int) -> TokenizedSample:
    """Row i: `seq_len` tokens (length = fixed) or a seeded length in [2, seq_len) (variable); every
    token i mod vocab (input_ids = increasing, prime-rl's) or seeded random ids; every token after the
    first trained (a mask is aligned with input_ids: the first token has nothing to be predicted from)."""
    rng = np.random.default_rng([seed, i])
    n = int(rng.integers(2, max(3, seq_len))) if length == "variable" else seq_len
    if input_ids == "random":
        ids = rng.integers(0, vocab, size=n, dtype=np.int64).astype(np.int32)
    else:
        ids = np.full(n, i % vocab, dtype=np.int32)
    mask = np.ones(n, dtype=bool)
    mask[0] = False
    return TokenizedSample(input_ids=ids, loss_mask=mask)
