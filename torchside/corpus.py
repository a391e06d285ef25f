"""`SyntheticCorpus`: a deterministic language with structure a small model learns, generated, never downloaded.

Each sequence of S + 1 tokens is a sparse bigram chain for its first half, then that half again:

- chain: a uniform first token, then each token is one of `successors` fixed followers of the
  previous one (a table drawn once from the seed), the i-th with probability proportional to
  1 / (i + 1) (Zipf). Learnable by the embedding and the head alone: the bigram statistics.
- repeat: the second half copies the first. Learnable only through attention (an induction
  head: find the previous occurrence of the current token, predict what followed it).

The best possible predictor pays the Zipf entropy on every chain transition and nothing on copies:
`loss_floor(S)`. Batch `step` is a pure function of (seed, step), the same on every rank and
topology, so a resumed run sees the batches an uninterrupted one would, without dataloader state.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class SyntheticCorpus:
    """Token batches of the language in the module docstring."""

    def __init__(self, vocab_size: int, *, successors: int = 4, seed: int = 0) -> None:
        for name, value, minimum in (("vocab_size", vocab_size, 2), ("successors", successors, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"SyntheticCorpus({name}={value!r}): pass an integer >= {minimum}")
        if 2 * successors > vocab_size:
            raise ValueError(f"SyntheticCorpus(successors={successors}): at most vocab_size / 2 = {vocab_size // 2}")
        self.vocab_size, self.seed = vocab_size, seed
        table_generator = torch.Generator().manual_seed(seed)
        # Distinct followers per token (so a transition's entropy is exactly the Zipf entropy): a random
        # start plus increasing offsets whose total stays below vocab_size.
        start_V1 = torch.randint(0, vocab_size, (vocab_size, 1), generator=table_generator)
        steps_VK = torch.randint(1, vocab_size // successors, (vocab_size, successors), generator=table_generator)
        self.followers_VK = (start_V1 + steps_VK.cumsum(dim=1)) % vocab_size
        weights = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64)
        self.probabilities_K = weights / weights.sum()
        self._followers, self._probabilities = self.followers_VK.numpy(), self.probabilities_K.numpy()

    @property
    def transition_entropy(self) -> float:
        """Entropy (nats) of one chain transition: the Zipf distribution's."""
        p = self.probabilities_K
        return float(-(p * p.log()).sum())

    def loss_floor(self, seq_len: int) -> float:
        """The mean cross entropy per predicted token of the best predictor (chain transitions only cost)."""
        half = (seq_len + 2) // 2  # tokens in the chain half of S + 1
        return (half - 1) * self.transition_entropy / seq_len

    def batch(self, step: int, batch_size: int, seq_len: int) -> Tensor:
        """Tokens [batch_size, seq_len + 1] (int64, CPU): inputs are [:, :-1], targets [:, 1:]."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"SyntheticCorpus.batch(step={step!r}): pass an integer >= 0")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SyntheticCorpus.batch({name}={value!r}): pass an integer >= 1")
        # numpy: the chain is a sequential walk of seq_len / 2 tiny gathers, and numpy's per-call cost is a
        # fraction of torch's (the walk must stay well under a GPU step's time).
        rng = np.random.default_rng((self.seed, step))
        half = (seq_len + 2) // 2
        choices_BT = rng.choice(len(self._probabilities), size=(batch_size, half - 1), p=self._probabilities)
        chain = np.empty((batch_size, half), dtype=np.int64)
        chain[:, 0] = rng.integers(0, self.vocab_size, size=batch_size)
        for t in range(1, half):
            chain[:, t] = self._followers[chain[:, t - 1], choices_BT[:, t - 1]]
        return torch.from_numpy(np.concatenate([chain, chain], axis=1)[:, : seq_len + 1])

    def __repr__(self) -> str:
        k = self.followers_VK.shape[1]
        return f"SyntheticCorpus(vocab_size={self.vocab_size}, successors={k}, seed={self.seed})"


__all__ = ["SyntheticCorpus"]
