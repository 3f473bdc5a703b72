"""The inference-engine boundary of a rollout job (DESIGN 3.3).

An engine owns a running batch of at most ``max_batch_size`` sequences and a
queue of waiting requests. The rollout loop drives it single-threaded:

1. ``add(request)`` queues a request; nothing is computed.
2. ``step()`` first admits waiting requests into free slots (prefilling
   them), then runs one decode step for every running sequence and returns
   the sequences that finished in that step. A slot freed in step k is
   refilled at step k + 1 (continuous batching).
3. ``update_weights(state_dict, version)`` may be called between any two
   steps. It interrupts generation: the weights are loaded, the KV cache of
   every unfinished sequence is rebuilt by prefill under the new weights, and
   every token sampled afterwards carries ``version``. Tokens sampled before
   keep the version that produced them, so a completion can span versions.

Every output token carries its behaviour logprob, ``log softmax(logits / T)``
at the sampled token, under the weights that sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Literal, Mapping, Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """How tokens are chosen; shared by all requests unless a request overrides."""

    max_new_tokens: int = 16  # output tokens per request, eos included
    temperature: float = 1.0  # > 0; logprobs are log softmax(logits / temperature)
    greedy: bool = False  # argmax; logprobs still reported under the tempered distribution

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")


@dataclass
class Request:
    """One prompt to complete."""

    id: Hashable  # caller's key; returned unchanged in the Completion
    prompt_ids: list[int]  # at least one token
    max_new_tokens: int | None = None  # per-request override of SamplingParams.max_new_tokens

    def __post_init__(self) -> None:
        if len(self.prompt_ids) == 0:
            raise ValueError(f"prompt_ids: must hold at least one token (request {self.id!r})")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1 or None, got {self.max_new_tokens}")


@dataclass
class Completion:
    """A finished request."""

    id: Hashable
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)  # includes the eos token if it stopped on eos
    logprobs: list[float] = field(default_factory=list)  # behaviour logprob of each output token
    versions: list[int] = field(default_factory=list)  # weight version that produced each output token
    finish_reason: Literal["stop", "length"] = "length"


@runtime_checkable
class InferenceEngine(Protocol):
    """What the rollout loop, evaluation and the trainer's tests need from an engine."""

    def add(self, request: Request) -> None:
        """Queue a request; it enters the running batch at the next step."""
        ...

    def step(self) -> list[Completion]:
        """Admit queued requests into free slots, decode one token for all running sequences."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Interrupt: load weights, rebuild the KV cache of unfinished sequences under them."""
        ...

    @property
    def version(self) -> int:
        """The weight version that produces the next tokens."""
        ...

    def num_running(self) -> int:
        """Sequences in the running batch."""
        ...

    def num_waiting(self) -> int:
        """Requests queued but not yet admitted."""
        ...
