"""M2PO's second-moment mask (Zheng et al. 2025, "Prosperity before Collapse"), as pure functions.

Per trained token, ``m2 = (logp_behav - logp_prox)^2``: the squared log of the
behaviour weight, large where the data's policy and the proximal one disagree
(stale data, or a train/inference mismatch). When the mean ``M2`` over an
update's tokens (every rank's, every micro-batch's) reaches ``threshold``, the
tokens with the largest ``m2`` are left out of the loss, largest first, until
the mean of the rest is below it; below the threshold nothing is masked. Only
the extreme outliers go, where clipping or capping would also cut the
informative high-entropy tokens.

Largest-first masking keeps the tokens with ``m2 <= c`` for the largest cutoff
``c`` at which their mean stays below the threshold; that mean only grows with
``c``, so :func:`m2po_cutoff` finds ``c`` by bisection over global sums (one
all-reduce of two numbers per halving): the same cutoff with one rank and one
micro-batch as with many, without gathering the tokens anywhere. Tokens tied
with the cutoff are kept together. Should even the smallest ``m2`` reach the
threshold, every token is masked and the policy-gradient term moves nothing
(an entropy bonus or KL loss term still trains on them).

The trainer computes the cutoff once per update from the proximal pass
(:meth:`hpcrl.trainer.policy.PolicyTrainer._update`); the loss gives masked
tokens weight 0 (:func:`hpcrl.algo.losses.decoupled_ppo_loss`, ``m2_cutoff``).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

__all__ = ["m2_values", "m2po_cutoff"]

_HALVINGS = 64  # the bracket [0, sum of m2] shrinks to 2^-64 of itself


def m2_values(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The valid tokens' ``(behav - prox)^2``, 1-D float64 (padding, whatever it holds, is left out)."""
    valid = mask > 0
    d = behav.detach().to(torch.float64)[valid] - prox.detach().to(torch.float64)[valid]
    return d * d


def m2po_cutoff(chunks: Iterable[torch.Tensor], threshold: float,
                global_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> float:
    """The largest ``c`` such that the tokens with ``m2 <= c`` have a mean ``m2`` below ``threshold`` (``inf``
    when all of them do: nothing masked). ``chunks``: this rank's ``m2`` values (:func:`m2_values`), any number
    of tensors; ``global_sum`` sums a float64 tensor over the ranks (identity for one process). An infinite
    ``m2`` (a logprob of ``-inf``) is always masked and left out of the means."""
    if not threshold > 0:
        raise ValueError(f"threshold: must be > 0, got {threshold}")
    values = [c.to(torch.float64).reshape(-1) for c in chunks]
    infinite = sum(float((~torch.isfinite(v)).sum()) for v in values)
    values = [v[torch.isfinite(v)] for v in values]

    def kept(c: float) -> tuple[float, float, float]:
        s, n = 0.0, 0.0
        for v in values:
            below = v[v <= c]
            s, n = s + float(below.sum()), n + float(below.numel())
        out = global_sum(torch.tensor([s, n, infinite], dtype=torch.float64))
        return out[0].item(), out[1].item(), out[2].item()

    total, n, inf_tokens = kept(math.inf)
    if n == 0 or total / n < threshold:
        return math.inf if inf_tokens == 0 else total  # every finite one kept (each is <= their sum)
    lo, hi = 0.0, total  # every m2 is in [0, sum of all]: what lo keeps has a mean below, what hi keeps not
    for _ in range(_HALVINGS):
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        s, n, _ = kept(mid)
        if n == 0 or s / n < threshold:
            lo = mid
        else:
            hi = mid
    return lo
