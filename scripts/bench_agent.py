"""Do the agent examples learn? Runs one of them and reports what changed.

    python scripts/bench_agent.py --steps 300 --out bench/agent_feedback.json
    python scripts/bench_agent.py --example tool --steps 200 --out bench/agent_tool.json

``--example feedback`` (``configs/agent_feedback.yaml``): the multi-turn
feedback agent (examples/agents/feedback_arithmetic.py: an answer, "wrong,
try again", a second answer; reward 1 / 0.5 / 0). ``--example tool``
(``configs/agent_tool.yaml``): the calculator agent
(examples/agents/calculator_tool.py: a tool call, its result, an answer;
reward 1 / 0). ``--example code_tool`` (``configs/agent_code_tool.yaml``):
the same with a Python tool run in the reward sandbox
(examples/agents/python_tool.py). All are trained through the rollout's
OpenAI-compatible proxy. Reported:

* held-out accuracy at the start and the end: for the feedback agent the
  greedy first turn's answer; for the tool agent (``eval.agent: true`` in
  its config) the mean reward of the agent's own greedy episodes, tool calls
  and all;
* from the trained spool groups, over the first and the last ``--window``
  steps: the first-try rate (reward 1), the any-try rate (reward > 0), the
  mean reward and the mean number of trained turns per episode; for the
  tool agent also the tool-call validity (the first model turn is a
  well-formed ``calculator`` call whose expression the tool evaluates) and
  the right-call rate (its result is the product asked for);
* episode outcomes (ok / error / timeout / no_call, from the groups' meta),
  trained samples/s, wall seconds.

Extra ``key=value`` arguments go to the run (e.g. ``trainer.lr=3e-4``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from _bench import ROOT, submit

sys.path.insert(0, str(ROOT))
from hpcrl.metrics.writer import read_evals  # noqa: E402
from hpcrl.spool.format import read_group  # noqa: E402


EXAMPLES = {"feedback": "configs/agent_feedback.yaml", "tool": "configs/agent_tool.yaml",
            "code_tool": "configs/agent_code_tool.yaml"}


def turns(sample) -> list[list[int]]:
    """The model's turns of a concat-exported episode: the runs of trained tokens."""
    out, cur = [], []
    for t, m in zip(sample.response_ids.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out, cur = out + [cur], []
    return out + [cur] if cur else out


def tool_call_check(first_turn: str, prompt: str) -> tuple[bool, bool]:
    """(valid, right) of the tool agent's first turn: a well-formed calculator call, and one giving the product."""
    from examples.agents.calculator_tool import calculate, tool_result
    from hpcrl.agent.proxy import parse_tool_calls

    _, calls = parse_tool_calls(first_turn)
    if len(calls) != 1:
        return False, False
    got = tool_result(calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    return not got.startswith("error"), got == calculate(prompt)


def window_stats(items: list, tok=None) -> dict:
    """``items``: (sample, prompt text) of the episodes of a window; with ``tok``, the tool agent's call rates."""
    n = max(len(items), 1)
    out = {"samples": len(items),
           "first_try": sum(s.reward == 1.0 for s, _ in items) / n,
           "any_try": sum(s.reward > 0 for s, _ in items) / n,
           "reward": sum(s.reward for s, _ in items) / n,
           # of the episodes whose first answer was wrong, the share the second answer got right (reward 0.5)
           "second_try": sum(s.reward == 0.5 for s, _ in items) / max(sum(s.reward < 1.0 for s, _ in items), 1),
           "turns": sum(len(turns(s)) for s, _ in items) / n}
    if tok is not None:
        checks = [tool_call_check(tok.decode((turns(s) or [[]])[0], skip_special_tokens=True), p) for s, p in items]
        out["tool_call_valid"] = sum(v for v, _ in checks) / n
        out["tool_call_right"] = sum(r for _, r in checks) / n
    return out


def report(run_dir: Path, window: int, tool: bool = False) -> dict:
    records = [json.loads(x) for x in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [(r["step"], r["eval/accuracy"]) for r in read_evals(run_dir / "logs")]
    steps = [r for r in records if "reward/mean" in r]
    by_step: dict[int, list] = {}
    statuses: Counter = Counter()
    for d in (run_dir / "spool" / "trained").glob("step_*"):
        for f in d.glob("*.h5"):
            g = read_group(f)
            prompt = g.meta.get("prompt", "")
            by_step.setdefault(int(d.name[5:]), []).extend((s, prompt) for s in g.samples)
            statuses.update(g.meta.get("reward_status", []))
    last = max(by_step)
    early = [s for k, v in by_step.items() if k < window for s in v]
    late = [s for k, v in by_step.items() if k > last - window for s in v]
    from hpcrl.prepared import load_prepared

    prep, tok = load_prepared(run_dir), None
    if tool:
        from hpcrl.model.hf_io import load_tokenizer

        tok = load_tokenizer(prep.base_model)
    return {"eval": evals, "first_window": window_stats(early, tok), "last_window": window_stats(late, tok),
            "warm_start": {"accuracy": prep.sft_accuracy, "steps": prep.sft_steps},
            "statuses": dict(statuses), "samples_per_s": steps[-1].get("throughput/samples_per_s"),
            "wall_s": steps[-1].get("time/elapsed_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--example", choices=sorted(EXAMPLES), default="feedback")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--window", type=int, default=30, help="steps at each end to compare")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None, help="default bench/agent_<example>.json")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hpcrl-agent-") as tmp:
        run_dir = submit(Path(tmp) / "run", [f"trainer.total_steps={args.steps}", f"eval.every_steps={args.eval_every}",
                                             *args.overrides], f"agent_{args.example}", config=EXAMPLES[args.example])
        rep = report(run_dir, args.window, tool=args.example == "tool")
    rep["meta"] = {"command": " ".join(["bench_agent.py", *(argv if argv is not None else sys.argv[1:])]),
                   "example": args.example, "steps": args.steps, "window": args.window,
                   "total_wall_s": time.time() - t0}
    (e0, a0), (e1, a1) = rep["eval"][0], rep["eval"][-1]
    f, la = rep["first_window"], rep["last_window"]
    what = "agent episodes' (eval.agent)" if args.example == "tool" else "first-turn"
    print(f"warm start: accuracy {rep['warm_start']['accuracy']} after {rep['warm_start']['steps']} steps")
    print(f"held-out {what} accuracy: {100 * a0:.1f}% (step {e0}) -> {100 * a1:.1f}% (step {e1})")
    for name, w in (("first", f), ("last", la)):
        print(f"{name} {args.window} steps: first-try {100 * w['first_try']:.1f}%  any-try {100 * w['any_try']:.1f}%  "
              f"second try right after a wrong first {100 * w['second_try']:.1f}%  "
              f"reward {w['reward']:.3f}  turns {w['turns']:.2f}  ({w['samples']} samples)"
              + (f"  tool call valid {100 * w['tool_call_valid']:.1f}% right {100 * w['tool_call_right']:.1f}%"
                 if "tool_call_valid" in w else ""))
    print(f"episodes {rep['statuses']}  {rep['samples_per_s']:.1f} samples/s  {rep['wall_s']:.0f}s")
    out = args.out or ROOT / "bench" / f"agent_{args.example}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
