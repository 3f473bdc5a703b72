"""Simulate runs of the pipeline from the command line, one table row per setting swept.

    python -m hpcrl.sim --sweep max_staleness=0,1,2,4,8 steps=200 replicas=2
    python -m hpcrl.sim --costs bench/sim_costs.json --sweep replicas=1,2,4,8 max_staleness=4
    python -m hpcrl.sim --sweep rollout_failures_per_hour=0,1,4 restart_s=120 steps=2000

``key=value`` sets a :class:`~hpcrl.sim.model.Workload` field, or a
:class:`~hpcrl.sim.model.Costs` field (by its name), all applied together;
``--costs`` reads a JSON object of ``Costs`` fields first, or the cost model
``scripts/sim_calibrate.py --out`` writes (its fit for ``--threads``). ``--sweep key=v1,v2,...`` runs one
simulation per value. Prints simulated trained samples/s, the ratio to the
first row, busy fractions, the staleness of trained tokens, groups set
aside and failures; ``--json`` writes the rows. No torch: it starts at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from hpcrl.sim.model import Costs, Workload
from hpcrl.sim.pipeline import simulate

_WORK = {f.name: f for f in dataclasses.fields(Workload)}
_COSTS = {f.name: f for f in dataclasses.fields(Costs)}


def _value(name: str, text: str, current: Any) -> Any:
    """``text`` as the type of the field's default; a clean error for anything else."""
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if isinstance(current, tuple):
            return tuple(int(x) for x in text.split("/"))  # response_tokens=2/4/8/64
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
    except ValueError:
        kind = {bool: "true or false", tuple: "integers joined by /", int: "an integer", float: "a finite number"}
        raise SystemExit(f"{name}: expected {kind[type(current)]}, got {text!r}") from None
    return text


def build(settings: dict[str, str], costs: Costs) -> tuple[Workload, Costs]:
    """A workload and ``costs`` with every ``name -> text`` setting applied at once (their order does not matter)."""
    work_kw, cost_kw = {}, {}
    defaults = Workload()
    for name, text in settings.items():
        if name in _WORK:
            work_kw[name] = _value(name, text, getattr(defaults, name))
        elif name in _COSTS:
            cost_kw[name] = _value(name, text, getattr(costs, name))
        else:
            raise SystemExit(f"unknown setting {name!r}: a Workload field ({', '.join(_WORK)}) "
                             f"or a Costs field ({', '.join(_COSTS)})")
    try:
        return Workload(**work_kw), dataclasses.replace(costs, **cost_kw)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def load_costs(path: Path, threads: int) -> Costs:
    """A JSON object of Costs fields, or a cost model ``scripts/sim_calibrate.py --out`` wrote (its fit for
    ``threads`` torch threads, and the measured slowdown of two processes sharing cores)."""
    data = json.loads(path.read_text())
    if "threads1" in data:
        key = f"threads{threads}"
        if key not in data:
            raise SystemExit(f"{path}: no cost model for {threads} thread(s) (has {', '.join(sorted(data))})")
        data = {**data[key], "shared_slowdown": data.get("shared_slowdown", {}).get("mean", 1.0)}
    unknown = set(data) - set(_COSTS)
    if unknown:
        raise SystemExit(f"{path}: unknown Costs fields {sorted(unknown)}")
    return dataclasses.replace(Costs(), **data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.sim", description=__doc__.splitlines()[0])
    parser.add_argument("--costs", type=Path, help="a JSON object of Costs fields, or a sim_calibrate.py cost model")
    parser.add_argument("--threads", type=int, default=1, help="with a sim_calibrate.py cost model: its fit for this "
                        "many torch threads")
    parser.add_argument("--sweep", default=None, help="key=v1,v2,...: one run per value")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("settings", nargs="*", help="key=value for a Workload or Costs field")
    args = parser.parse_intermixed_args(argv)
    costs = load_costs(args.costs, args.threads) if args.costs else Costs()
    settings = {}
    for item in args.settings:
        name, sep, text = item.partition("=")
        if not sep:
            parser.error(f"expected key=value, got {item!r}")
        settings[name] = text
    key, values = (args.sweep.partition("=")[0], args.sweep.partition("=")[2].split(",")) if args.sweep else ("", [""])
    work, costs = build(settings, costs) if not key else (Workload(), costs)  # a sweep builds each of its runs
    rows, base = [], None
    print(f"{key or 'run':>26} {'samples/s':>10} {'ratio':>6} {'trainer':>8} {'rollouts':>9} {'staleness':>22} "
          f"{'set aside':>9} {'failures':>8}")
    for value in values:
        w, c = build({**settings, key: value}, costs) if key else (work, costs)
        if not rows:
            work, costs = w, c  # what the file records: the first run's (the sweep changes only its key)
        try:
            r = simulate(w, c)
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"{key}={value}: {e}") from None
        base = base or r.samples_per_s
        total = sum(r.staleness_hist.values()) or 1
        stale = " ".join(f"{k}:{100 * n / total:.0f}%" for k, n in r.staleness_hist.items() if n / total >= 0.01)
        print(f"{value or '-':>26} {r.samples_per_s:10.1f} {r.samples_per_s / base:6.2f} {r.trainer_busy:8.2f} "
              f"{r.rollout_busy:9.2f} {stale:>22} {r.dropped_groups:9d} {r.failures:8d}")
        rows.append({"setting": {key: value} if key else {}, "samples_per_s": r.samples_per_s,
                     "ratio": r.samples_per_s / base, "trainer_busy": r.trainer_busy, "rollout_busy": r.rollout_busy,
                     "staleness_hist": r.staleness_hist, "dropped_groups": r.dropped_groups,
                     "failures": r.failures, "wall_s": r.wall_s})
    if args.json:
        args.json.write_text(json.dumps({"workload": dataclasses.asdict(work), "costs": dataclasses.asdict(costs),
                                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
