"""What one sample of a prompt group is: the episode seam of the rollout loop.

The rollout loop (:class:`hpcrl.rollout.worker.RolloutWorker`) owns
admission, weight updates, the engine's polling, the staleness check and
publishing; how a sample comes about is an :class:`EpisodeRunner`'s
business (``rollout.episodes``, :mod:`hpcrl.rollout.registry`). :class:`SingleTurn` makes one sample
out of one completion of the prompt and scores the group with the reward
function; an agent runner makes one sample out of a multi-turn episode
(several engine requests, tool results between them) that ends with its own
reward, or one sample per request (the episode's ``parts``, each with its
share of the reward). Both hand the loop the same :class:`Episode` records,
and the loop turns a group of them into one spool group.

Lifecycle of one episode, keyed ``(ticket index, sample index)``:

1. :meth:`EpisodeRunner.start` begins it: it submits its engine requests
   (with ids the runner can route back; the loop never looks inside them),
   or hands the episode to code of its own (an agent) that makes requests
   as it goes.
2. Each finished engine request goes to :meth:`EpisodeRunner.collect`.
3. Once per turn of the loop, :meth:`EpisodeRunner.finished` returns the
   episodes that ended since the last call: after their last request, or
   whenever code outside the engine (tools, an agent program) finished them.
   An episode may be busy with no request in the engine; the loop counts it
   as work until it is returned here.
4. When every episode of a group is finished, :meth:`EpisodeRunner.score`
   gives their rewards, in order.

The loop calls every method on its own thread, the only thread that may
touch the engine: a runner whose episodes run elsewhere queues their
requests and submits them from :meth:`~EpisodeRunner.finished`.

A finished episode whose oldest token is too stale to be trained, or that
holds tokens of weights the trainer has since rolled back, is started
again from the beginning with :meth:`EpisodeRunner.start`. The loop may
resubmit any request that :meth:`InferenceEngine.abort_all` returned, so a
runner must tolerate the same request finishing after such a resubmission.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Protocol, runtime_checkable

from hpcrl.data.rows import Row
from hpcrl.reward.scorer import RewardResult, Scorer
from hpcrl.rollout.engine import Completion, InferenceEngine, Request

__all__ = ["Episode", "EpisodeKey", "EpisodeRunner", "SingleTurn", "build_single_turn"]

EpisodeKey = tuple[int, int]  # (ticket index, sample index within the group)


@dataclass
class Episode:
    """One finished sample, token by token (the response part of the trained sequence)."""

    response_ids: list[int]  # every token after the prompt: model tokens and, in a multi-turn episode,
    # the tool/user tokens between turns
    logprobs: list[float]  # behaviour logprob per token (0.0 where loss_mask is 0)
    versions: list[int]  # policy version that produced each token; masked context: that of the turn it precedes
    loss_mask: list[int]  # 1 = a model token that is trained, 0 = context the model did not write
    text: str  # the response as text (logged in the spool group's meta, given to the reward function)
    finish_reason: str  # of the last engine request: "stop" (eos) or "length"
    # the episode's own prompt, when it is not the group's encoded row prompt (an agent writes its own system
    # and user turns); the loop publishes the group's common prefix as the prompt, the rest loss-masked
    prompt_ids: list[int] | None = None
    # an episode trained as several samples (an agent's calls exported ``individual``): each part has its own
    # prompt_ids and tokens, and the episode's own token lists are empty; None: the episode is one sample
    parts: list[Episode] | None = None
    reward_scale: float = 1.0  # a part's reward is its episode's reward times this (turn discounting)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not len(self.logprobs) == len(self.versions) == len(self.loss_mask) == n:
            raise ValueError(f"episode: {n} tokens but {len(self.logprobs)} logprobs, {len(self.versions)} "
                             f"versions, {len(self.loss_mask)} mask entries")
        if self.parts is not None and (n or not self.parts or any(p.parts is not None for p in self.parts)):
            raise ValueError("episode: with parts, the episode holds no tokens of its own and each part is "
                             "one sample")

    def samples(self) -> list[Episode]:
        """What the episode is trained as: its parts, or itself."""
        return self.parts if self.parts is not None else [self]

    @property
    def head_version(self) -> int | None:
        """The oldest policy version among its tokens, as the spool file's name will carry it (None: no token)."""
        versions = [min(s.versions) for s in self.samples() if s.versions]
        return min(versions) if versions else None

    @property
    def newest_version(self) -> int | None:
        versions = [max(s.versions) for s in self.samples() if s.versions]
        return max(versions) if versions else None


@runtime_checkable
class EpisodeRunner(Protocol):
    """How the samples of an admitted prompt group are produced and scored."""

    def start(self, key: EpisodeKey, prompt_ids: list[int], row: Row) -> None:
        """Begin episode ``key`` on ``prompt_ids`` (the encoded prompt of ``row``): submit its requests."""

    def max_unfinished(self, slots: int) -> int:
        """How many unfinished episodes the loop may keep; ``slots`` is the engine's batch plus one group."""

    def collect(self, completion: Completion) -> None:
        """A finished engine request of one of the runner's episodes."""

    def wait(self, timeout_s: float) -> None:
        """Nothing is in the engine but episodes are unfinished (busy elsewhere): block until one of them
        makes a request or ends, at most ``timeout_s``."""

    def finished(self) -> list[tuple[EpisodeKey, Episode]]:
        """The episodes that ended since the last call (each once); may submit waiting requests."""

    def score(self, row: Row, episodes: list[Episode]) -> list[RewardResult]:
        """Rewards of a finished group's episodes, in order."""

    def close(self) -> None:
        """Stop what the runner started (the loop's :meth:`~hpcrl.rollout.worker.RolloutWorker.close` calls it)."""


class SingleTurn:
    """One sample = one completion of the prompt, scored by the reward function (``reward.fn``).

    Request ids are the episode keys; every output token is trained.
    """

    def __init__(self, engine: InferenceEngine, tokenizer, reward: Scorer) -> None:
        self.engine, self.tokenizer, self.reward = engine, tokenizer, reward
        self._done: list[tuple[EpisodeKey, Episode]] = []

    def max_unfinished(self, slots: int) -> int:
        return slots  # one request each: the engine's slots and one group queued

    def start(self, key: EpisodeKey, prompt_ids: list[int], row: Row) -> None:
        self.engine.submit(Request(id=key, prompt_ids=prompt_ids))

    def collect(self, completion: Completion) -> None:
        c = completion
        text = self.tokenizer.decode(c.output_ids, skip_special_tokens=True)
        self._done.append((_key(c.id), Episode(response_ids=list(c.output_ids), logprobs=list(c.logprobs),
                                               versions=list(c.versions), loss_mask=[1] * len(c.output_ids),
                                               text=text, finish_reason=c.finish_reason)))

    def finished(self) -> list[tuple[EpisodeKey, Episode]]:
        done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float) -> None:
        """Never called in practice: a single-turn episode is always in the engine until it ends."""
        time.sleep(timeout_s)

    def close(self) -> None:
        """Nothing of its own: the engine and the reward runner belong to the rollout job."""

    def score(self, row: Row, episodes: list[Episode]) -> list[RewardResult]:
        return self.reward.score_many([(row.prompt, e.text, {"answer": row.answer, **row.extra}) for e in episodes])


def build_single_turn(cfg, engine: InferenceEngine, tokenizer, reward: Scorer, model_path: str) -> SingleTurn:
    """``rollout.episodes: single_turn`` (:mod:`hpcrl.rollout.registry`)."""
    return SingleTurn(engine, tokenizer, reward)


def _key(request_id: Hashable) -> EpisodeKey:
    index, i = request_id  # type: ignore[misc]
    return int(index), int(i)
