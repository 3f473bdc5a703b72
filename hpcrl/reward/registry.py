"""The reward registry: the one place that maps ``reward.scorer`` to a :class:`~hpcrl.reward.scorer.Scorer`.

:data:`SCORERS` holds the built-in ones (``function``: a user function by
import path, :class:`~hpcrl.reward.runner.RewardRunner`; ``code``: model-written
programs in a sandbox, :class:`~hpcrl.reward.code.CodeScorer`); :func:`register_scorer`
adds another, and ``reward.scorer: my_pkg.scoring:build`` names one outside
hpcrl by import path. A scorer is built from the ``reward`` config alone.
Light (no torch): the config layer imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from hpcrl.plugins import resolve

if TYPE_CHECKING:
    from hpcrl.reward.config import RewardConfig

Scorer = Any  # hpcrl.reward.scorer.Scorer: not imported, so that the configuration layer imports no component

__all__ = ["SCORERS", "build_scorer", "check_scorer", "register_scorer"]

# reward.scorer -> (RewardConfig) -> Scorer, or its "module:attr" (imported where a scorer is built)
SCORERS: dict[str, str | Callable[..., Scorer]] = {"function": "hpcrl.reward.runner:RewardRunner",
                                                  "code": "hpcrl.reward.code:CodeScorer"}


def register_scorer(name: str, build: str | Callable[..., Scorer]) -> None:
    """Make ``name`` a choice of ``reward.scorer``; a name is registered once."""
    if name in SCORERS and SCORERS[name] != build:
        raise ValueError(f"reward.scorer: {name!r} is registered already")
    SCORERS[name] = build


def check_scorer(name: str, key: str = "reward.scorer") -> None:
    """ValueError naming ``key`` unless ``name`` is registered or an import path ``module:attr``."""
    if name not in SCORERS and ":" not in name:
        raise ValueError(f"{key}: must be one of {sorted(SCORERS)} or 'module:attr' of a scorer factory, got "
                         f"{name!r}")


def build_scorer(cfg: RewardConfig) -> Scorer:
    """The scorer ``cfg.scorer`` names, built from ``cfg``."""
    check_scorer(cfg.scorer)
    return resolve(SCORERS.get(cfg.scorer, cfg.scorer), "reward.scorer")(cfg)
