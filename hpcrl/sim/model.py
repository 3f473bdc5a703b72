"""What the pipeline simulator is given: cost models and a workload.

Every cost is in seconds. :class:`Costs` describes one rollout replica's
engine (continuous batching: a decode step over all active rows, one
prefill call for the groups admitted together and one per weight update
in ``recompute`` mode) and the
trainer (a step's time against its tokens, publishing a version, the spool).
:class:`Workload` is what runs: the batch, the group size, the staleness
bound, the replicas, how long responses are. Neither imports torch: the
simulator is a light command.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Costs:
    """Seconds per operation; each ``*_per_*`` term is linear in what it names."""

    # one decode step of the rollout engine over ``rows`` active sequences holding ``context`` tokens in all
    # (with ``padded_cache``: rows times the longest, what a left-padded cache holds)
    decode_s: float = 2e-3
    decode_per_row_s: float = 5e-5
    decode_per_context_token_s: float = 0.0
    # prefill: one call for the groups admitted in one step (each group's prompt once, shared by its rows) and,
    # after new weights in recompute mode, one call over every in-flight row's prompt and generated tokens
    # (with ``padded_cache``: rows times the longest)
    prefill_s: float = 2e-3
    prefill_per_token_s: float = 2e-5
    # the engine keeps one left-padded cache for its running batch (hpcrl's embedded torch engine) instead of
    # pages (vLLM, SGLang): every row costs as much as the longest, and an admission into a running batch copies
    # the running cache into a new one, ``merge_per_token_s`` per padded token of the merged cache
    padded_cache: bool = False
    merge_per_token_s: float = 0.0
    # the rebuild after new weights when it costs otherwise than an admission (one large call over every row,
    # nothing merged into a running batch); None: as an admission's prefill
    rebuild_prefill_s: float | None = None
    rebuild_prefill_per_token_s: float | None = None
    reward_per_sample_s: float = 0.0  # scoring a finished sample, on the generating thread
    admit_s: float = 0.0  # the ledger's ticket per admitted group
    spool_write_per_group_s: float = 0.0  # on the generating thread (0: a writer thread publishes)
    weights_load_s: float = 5e-3  # the rollout receives and loads one new version
    weights_poll_s: float = 0.02  # how often a generating rollout looks for new weights (0: every step)
    # a rollout with nothing to do (no ticket, nothing in flight) sleeps this long between looks (rollout.
    # poll_interval_s), and a trainer waiting for its batch looks at the spool this often (0: woken at once)
    rollout_idle_poll_s: float = 0.0
    trainer_poll_s: float = 0.0
    # the trainer's step: fixed part, per trained token (prompt and response), per group read from the spool
    train_step_s: float = 0.05
    train_per_token_s: float = 2e-6
    spool_per_group_s: float = 3e-4
    publish_s: float = 5e-3  # publishing one version (collective or disk)
    # one process doing both on the same cores (colocated): its publish is an in-memory load instead
    colocated_publish_s: float = 1e-3
    # colocated: the trainer's feed looks at the spool between two engine steps while it waits for its batch
    colocated_pass_s: float = 0.0
    # disaggregated components sharing one machine's cores: a step (engine or trainer) that starts while the other
    # side is busy costs this many times more (1: separate accelerators, as on a cluster)
    shared_slowdown: float = 1.0
    # CPU seconds the pipeline's other threads (the spool writer, the trainer's read-ahead; not a reward call the
    # generating thread waits for) burn per group handed over. They run free on a core the compute leaves idle,
    # and take their time from the compute where none is: all of it from the generating step with
    # Workload.compute_fills_cores, half from it and half from the trainer's next step where the two share one
    # machine's cores and both are busy (Pipeline.side_cpu)
    side_cpu_per_group_s: float = 0.0

    def decode(self, rows: int, context: int) -> float:
        return self.decode_s + self.decode_per_row_s * rows + self.decode_per_context_token_s * context

    def prefill(self, tokens: int) -> float:
        return self.prefill_s + self.prefill_per_token_s * tokens

    def context(self, rows: int, total: int, longest: int) -> int:
        """What a step over ``rows`` rows holding ``total`` tokens, the longest ``longest``, costs as."""
        return rows * longest if self.padded_cache else total

    def rebuild(self, tokens: int) -> float:
        fixed = self.prefill_s if self.rebuild_prefill_s is None else self.rebuild_prefill_s
        per = self.prefill_per_token_s if self.rebuild_prefill_per_token_s is None else self.rebuild_prefill_per_token_s
        return fixed + per * tokens

    def train(self, tokens: int, groups: int) -> float:
        return self.train_step_s + self.train_per_token_s * tokens + self.spool_per_group_s * groups


@dataclass(frozen=True)
class Workload:
    """One training run as the simulator plays it."""

    steps: int = 60  # trainer steps (policy versions) to simulate
    batch_groups: int = 16  # B: prompt groups per step (admission.batch_size)
    group_size: int = 8  # G: samples per prompt
    max_staleness: int = 2  # eta (admission.max_staleness); 0 = synchronous
    mode: Literal["colocated", "disaggregated"] = "disaggregated"
    replicas: int = 1  # rollout replicas (disaggregated)
    max_batch_rows: int = 64  # rows one replica's engine decodes at once (rollout.max_batch_size)
    # groups a replica takes tickets for beyond its free rows, waiting to enter its engine (hpcrl's worker keeps
    # rollout.max_batch_size + group_size rows unfinished: 1); its engine admits waiting rows G or more at a time
    queued_groups: int = 0
    # decode steps one event plays at most (a chunk ends early where a row ends): 1 is exact; long responses on
    # large fleets need more (thousands of tokens per response), at the price of looking for weights and
    # admitting only between chunks
    tokens_per_event: int = 1
    # a replica takes at most its even share of what the bound lets be outstanding, ceil((eta + 1) B / replicas)
    # groups, as a dispatcher that spreads requests over servers does; False: as many as its rows hold (hpcrl's
    # workers each ask the ledger for themselves)
    spread_tickets: bool = False
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    prompt_tokens: int = 12
    # response lengths, drawn uniformly at random from this list per sample (repeat a length to weight it)
    response_tokens: tuple[int, ...] = (8,)
    # one draw per group instead: an entry is a group's prompt tokens and its samples' response tokens, as a
    # measured run's groups had them (a sample generated again, or every sample of a shape whose size is not
    # group_size, draws one of its group's lengths); empty: every prompt is prompt_tokens long and each sample
    # draws its own length from response_tokens. An entry may carry a third list, the response tokens each two
    # neighbours in its lengths share (the responses in the order of their token ids, as bench_async records
    # them): rows of a group whose responses agree on every token so far hold one context, which the rebuild
    # after new weights prefills once
    group_shapes: tuple[tuple[int, tuple[int, ...]] | tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    # share of groups whose samples all got the same reward: GRPO leaves them out of the loss
    # (algo.drop_uniform_groups), so the trainer reads them but does not train their tokens
    uniform_share: float = 0.0
    seed: int = 0
    shared_cores: bool = False  # disaggregated components on one machine's cores (Costs.shared_slowdown applies)
    # the generating process's compute threads use every core it has (colocated, two torch threads on two cores):
    # its other threads' CPU comes out of its steps (Costs.side_cpu_per_group_s)
    compute_fills_cores: bool = False
    # failures: each replica fails as a Poisson process of this rate per hour and comes back after restart_s; its
    # in-flight groups are lost and their tickets reissued
    rollout_failures_per_hour: float = 0.0
    restart_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_groups", "group_size", "replicas", "max_batch_rows", "prompt_tokens",
                     "tokens_per_event"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.queued_groups < 0:
            raise ValueError(f"max_staleness, queued_groups: must be >= 0, got {self.max_staleness}, "
                             f"{self.queued_groups}")
        if self.max_batch_rows < self.group_size:
            raise ValueError(f"max_batch_rows: must hold one group ({self.group_size} rows), got {self.max_batch_rows}")
        if not self.response_tokens or min(self.response_tokens) < 1:
            raise ValueError(f"response_tokens: a non-empty list of lengths >= 1, got {self.response_tokens}")
        bad = [s for s in self.group_shapes if s[0] < 1 or not s[1] or min(s[1]) < 1]
        if bad:
            raise ValueError(f"group_shapes: each a prompt >= 1 and a non-empty list of lengths >= 1, got {bad[0]}")
        bad = [s for s in self.group_shapes if len(s) > 2 and (
            len(s[2]) != len(s[1]) - 1 or any(not 0 <= c <= min(a, b) for c, a, b in zip(s[2], s[1], s[1][1:])))]
        if bad:
            raise ValueError("group_shapes: a shape's shared prefixes are one fewer than its lengths, each at most "
                             f"the shorter neighbour's length, got {bad[0]}")
        if self.mode not in ("colocated", "disaggregated"):
            raise ValueError(f"mode: colocated or disaggregated, got {self.mode!r}")
        if self.kv_on_update not in ("recompute", "keep"):
            raise ValueError(f"kv_on_update: recompute or keep, got {self.kv_on_update!r}")
        for name in ("steps", "batch_groups", "group_size", "max_staleness", "replicas", "max_batch_rows",
                     "prompt_tokens", "seed", "queued_groups", "tokens_per_event"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be an integer, got {getattr(self, name)!r}")
        if self.mode == "colocated" and (self.max_staleness != 0 or self.replicas != 1):
            raise ValueError("colocated: one process alternates generation and training (max_staleness 0, 1 replica)")
        if not 0.0 <= self.uniform_share < 1.0:
            raise ValueError(f"uniform_share: must be in [0, 1), got {self.uniform_share}")
        if self.rollout_failures_per_hour < 0 or self.restart_s < 0:
            raise ValueError("rollout_failures_per_hour and restart_s: must be >= 0")


@dataclass
class Result:
    """What a simulated run measured, as ``scripts/bench_async.py`` reports a real one."""

    wall_s: float
    samples: int
    tokens: int
    trainer_busy_s: float
    rollout_busy_s: list[float]
    # versions behind -> response tokens of the groups the trainer took (uniform groups' included)
    staleness_hist: dict[int, int] = field(default_factory=dict)
    dropped_groups: int = 0
    failures: int = 0
    # finished with a head older than eta behind the replica's weights, or left that far behind by the weights it
    # loaded while the rest of the group generated: generated again
    restarted_samples: int = 0
    prefill_calls: int = 0  # the engines' prefill calls: admissions and rebuilds after new weights
    decode_steps: int = 0  # the engines' decode steps, and the rows they decoded in all (their mean batch: the ratio)
    decode_rows: int = 0
    # seconds of finished work by phase, the shared-core slowdown included: "trainer/update", "trainer/spool",
    # "trainer/publish"; "rollout/decode", "rollout/admit_prefill", "rollout/rebuild_prefill", "rollout/ledger",
    # "rollout/reward", "rollout/weights", ... (summed over replicas; what bench_async's time split measures)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def trainer_busy(self) -> float:
        return self.trainer_busy_s / self.wall_s

    @property
    def rollout_busy(self) -> float:
        return sum(self.rollout_busy_s) / (len(self.rollout_busy_s) * self.wall_s)
