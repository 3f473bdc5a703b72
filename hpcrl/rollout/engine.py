"""The inference-engine boundary of a rollout job (design.md §3.3).

One seam for every engine: the embedded torch engine, which decodes in the
rollout's own thread, and server engines (vLLM, SGLang) that batch on their
own side and answer HTTP requests asynchronously. The rollout loop drives an
engine single-threaded, through submit/complete:

1. ``submit(request)`` hands a request over and returns at once.
2. ``poll(timeout_s)`` makes progress and returns the requests that finished
   since the last poll. The embedded engine admits waiting requests into
   free slots (prefilling them) and decodes one token for every running
   sequence; a server engine waits up to ``timeout_s`` for responses its
   background client has collected. Continuous batching is the engine's
   business: a slot freed by a finished request is refilled without the loop.
3. ``update_weights(weights)`` may be called between any two polls with a
   :class:`~hpcrl.weights.version.WeightVersion` (where the version's
   weights are, not tensors pushed through the loop). It interrupts
   generation: the engine loads the weights, every unfinished request goes
   on under them, and every token produced afterwards carries the new
   version. Tokens produced before keep the version that produced them, so
   a completion can span versions; how each engine makes that exact is in
   its module docstring.
4. ``abort_all()`` drops everything in flight (tokens discarded) and returns
   the original requests; ``close()`` releases the engine (stops a server it
   started).

Every output token carries its behaviour logprob, ``log softmax(logits / T)``
at the sampled token, under the weights that sampled it.

:func:`hpcrl.rollout.engines.build_engine` builds the engine that
``rollout.engine`` names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Literal, Protocol, runtime_checkable

from hpcrl.weights.version import WeightVersion


@dataclass
class SamplingParams:
    """How tokens are chosen; shared by all requests unless a request overrides."""

    max_new_tokens: int = 16  # output tokens per request, eos included
    temperature: float = 1.0  # > 0; logprobs are log softmax(logits / temperature)
    greedy: bool = False  # argmax; the torch engine reports tempered logprobs, vLLM/SGLang raw log_softmax (T=0)
    ignore_eos: bool = False  # generate max_new_tokens even past eos (benchmarks with fixed lengths)

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
    """What the rollout loop and colocated mode need from an engine."""

    @property
    def version(self) -> int:
        """The weight version that produces the next tokens."""
        ...

    def submit(self, request: Request) -> None:
        """Hand a request over; returns at once."""
        ...

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Make progress; the requests finished since the last poll (waits at most ``timeout_s`` for one)."""
        ...

    def update_weights(self, weights: WeightVersion) -> None:
        """Interrupt: load ``weights``; unfinished requests go on under them with the new version."""
        ...

    def abort_all(self) -> list[Request]:
        """Drop every request in flight (their tokens are discarded); return them as submitted."""
        ...

    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned by ``poll``."""
        ...

    def close(self) -> None:
        """Release the engine (a server engine stops the server it started)."""
        ...
