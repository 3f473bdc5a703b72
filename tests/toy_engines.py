"""Engines that hpcrl does not ship, registered from outside the package by import path.

``rollout.engine: toy_engines:TOY`` is the embedded engine behind a wrapper that counts its work and writes
the count to the run's logs when it closes; ``trainer.engine: toy_engines:TOY_TRAIN`` is FSDP2 under another
name that counts its steps into the metrics; ``reward.scorer: toy_engines:CountingScorer`` is the function
scorer counting what it scored; ``launch.scheduler: toy_engines:TOY_SCHED`` is the local scheduler listing what
it started; ``weights.mode: toy_engines:TOY_WEIGHTS`` is the disk transport listing what it published;
``rollout.episodes: toy_engines:TOY_EPISODES`` is the single-turn runner counting the episodes it finished. A test
sees from all six that the real processes built and drove them."""

from __future__ import annotations

import json

from hpcrl.launch.registry import SchedulerSpec
from hpcrl.rollout.registry import EngineSpec
from hpcrl.rollout.registry import EpisodeSpec
from hpcrl.weights.registry import TransportSpec
from hpcrl.trainer.registry import TrainEngineSpec


class Counting:
    """An :class:`~hpcrl.rollout.engine.InferenceEngine` around another one."""

    def __init__(self, inner, path) -> None:
        self.inner, self.path, self.counts = inner, path, {"submitted": 0, "completed": 0, "updates": 0}

    @property
    def version(self) -> int:
        return self.inner.version

    def submit(self, request) -> None:
        self.counts["submitted"] += 1
        self.inner.submit(request)

    def poll(self, timeout_s: float = 0.0):
        done = self.inner.poll(timeout_s)
        self.counts["completed"] += len(done)
        return done

    def update_weights(self, weights) -> None:
        self.counts["updates"] += 1
        self.inner.update_weights(weights)

    def abort_all(self):
        return self.inner.abort_all()

    def num_in_flight(self) -> int:
        return self.inner.num_in_flight()

    def close(self) -> None:
        self.inner.close()
        self.path.write_text(json.dumps(self.counts))


def build(cfg, site, *, seed: int, tokenizer, model=None):
    from hpcrl.rollout.engines import build_torch

    inner = build_torch(cfg, site, seed=seed, tokenizer=tokenizer, model=model)
    return Counting(inner, site.log_dir / f"{site.name}.toy.json")


TOY = EngineSpec("toy", build=build)


def build_train(model_path, cfg, algo, ctx, pad_id, dtype):
    """FSDP2 under another name, counting its steps into the metrics (``toy/steps``)."""
    from hpcrl.trainer.fsdp import FSDPEngine

    class CountingTrainer(FSDPEngine):
        steps = 0

        def train_step(self, seqs, version=None):
            stats = super().train_step(seqs, version)
            CountingTrainer.steps += 1
            return {**stats, "toy/steps": float(CountingTrainer.steps)}

    return CountingTrainer(model_path, cfg, algo, ctx, pad_id, dtype=dtype)


TOY_TRAIN = TrainEngineSpec("toy_train", build=build_train, lora=False)


class CountingScorer:
    """The function scorer under another name, writing what it scored to ``$HPCRL_TOY_SCORER_OUT/<pid>.json``
    when it closes."""

    def __init__(self, cfg) -> None:
        from hpcrl.reward.runner import RewardRunner

        self.inner, self.items = RewardRunner(cfg), 0

    def score(self, prompt: str, response: str, row: dict):
        self.items += 1
        return self.inner.score(prompt, response, row)

    def score_many(self, items):
        self.items += len(items)
        return self.inner.score_many(items)

    @property
    def counts(self) -> dict[str, int]:
        return self.inner.counts

    def close(self) -> None:
        import os
        from pathlib import Path

        self.inner.close()
        out = os.environ.get("HPCRL_TOY_SCORER_OUT")
        if out:
            Path(out, f"{os.getpid()}.json").write_text(json.dumps({"items": self.items, **self.inner.counts}))


def build_scheduler(cfg, run_dir):
    """The local scheduler, listing each component it starts in ``<run_dir>/logs/toy_scheduler.json``."""
    from hpcrl.launch.scheduler import LocalScheduler

    class Listing(LocalScheduler):
        def submit(self, spec):
            job = super().submit(spec)
            path = run_dir / "logs" / "toy_scheduler.json"
            started = json.loads(path.read_text()) if path.exists() else []
            path.write_text(json.dumps([*started, spec.name]))
            return job

    return Listing()


TOY_SCHED = SchedulerSpec("toy_sched", build=build_scheduler, job_word="toy pid")


def open_listing(root, cfg, role, fence=None, adapter=None):
    """The disk transport, listing each version it publishes in ``<root>/toy_published.txt``."""
    from hpcrl.weights.transport import DiskWeights

    class Listing(DiskWeights):
        def publish(self, state_dict, version):
            super().publish(state_dict, version)
            with open(self.root / "toy_published.txt", "a") as f:
                f.write(f"{version}\n")

    return Listing(root, cfg, fence, adapter)


TOY_WEIGHTS = TransportSpec("toy_weights", build=open_listing)


def build_episodes(cfg, engine, tokenizer, reward, model_path):
    """The single-turn runner, writing how many episodes it finished to ``$HPCRL_TOY_SCORER_OUT/<pid>.episodes``
    when it closes."""
    import os
    from pathlib import Path

    from hpcrl.rollout.episodes import SingleTurn

    class CountingEpisodes(SingleTurn):
        count = 0

        def finished(self):
            done = super().finished()
            self.count += len(done)
            return done

        def close(self):
            super().close()
            out = os.environ.get("HPCRL_TOY_SCORER_OUT")
            if out:
                Path(out, f"{os.getpid()}.episodes").write_text(str(self.count))

    return CountingEpisodes(engine, tokenizer, reward)


TOY_EPISODES = EpisodeSpec("toy_episodes", build=build_episodes)
