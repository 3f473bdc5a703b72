"""How fast does the run explorer open a large run? Builds a run directory of N trained groups (default 100k,
16 per step: 6,250 step directories and metrics rows; 8 samples of 64 tokens per group, real spool files)
and times, through the explorer's HTTP server, what the page asks for when it opens (summary, curves,
events, the first page of trajectories) and one trajectory, cold (fresh server) and warm (second load).

    python scripts/bench_explore.py [--groups 100000] [--out bench/explore.json] [--keep DIR]

Targets (issue: run explorer): the page's data in under 2 s, a trajectory in under 200 ms.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpcrl.explore.reader import RunView  # noqa: E402
from hpcrl.explore.server import make_server, serve_in_thread  # noqa: E402
from hpcrl.model.tiny import build_char_tokenizer  # noqa: E402
from hpcrl.spool.format import Sample, TrajectoryGroup, encode_group, file_name  # noqa: E402

PAGE_LOAD = ("/api/summary", "/api/curves?since=0", "/api/events", "/api/groups?kind=trained&offset=0&limit=50")


def build(root: Path, groups: int, per_step: int = 16, samples: int = 8, tokens: int = 64) -> None:
    (root / "logs").mkdir(parents=True)
    (root / "jobs").mkdir()
    (root / "config.yaml").write_text(f"admission: {{max_staleness: 4, batch_size: {per_step}}}\n"
                                      f"trainer: {{total_steps: {groups // per_step}}}\n")
    tok_dir = root / "tokenizer"
    build_char_tokenizer().save_pretrained(tok_dir)
    (root / "prepared.json").write_text(json.dumps({"init_model": str(tok_dir)}))
    rng = np.random.default_rng(0)
    t0, last = time.time(), time.time()
    with open(root / "logs" / "metrics.jsonl", "w") as metrics:
        for step in range(groups // per_step):
            d = root / "spool" / "trained" / f"step_{step:06d}"
            d.mkdir(parents=True)
            for k in range(per_step):
                ticket = step * per_step + k
                behind = rng.integers(0, 5, size=(samples, tokens))
                g = TrajectoryGroup(ticket=ticket, writer=f"r{k % 8}-e1n1",
                                    prompt_ids=rng.integers(3, 60, 24, np.int32),
                                    samples=[Sample(rng.integers(3, 60, tokens, np.int32),
                                                    -rng.random(tokens, np.float32),
                                                    np.maximum(step - np.sort(behind[i])[::-1], 0).astype(np.int32),
                                                    np.ones(tokens, np.uint8), float(rng.random() < 0.5), "stop")
                                             for i in range(samples)], meta={"prompt": f"row {ticket}"})
                (d / file_name(g)).write_bytes(encode_group(g))
            metrics.write(json.dumps({"step": step + 1, "reward/mean": float(rng.random()), "loss/pg_loss": 0.1,
                                      "time/unix": t0 + step, "time/elapsed_s": float(step),
                                      **{f"staleness/tokens_behind_{b}": 100.0 for b in range(5)}}) + "\n")
            if time.time() - last > 10:
                last = time.time()
                print(f"  built {(step + 1) * per_step}/{groups} groups ({last - t0:.0f} s)", file=sys.stderr,
                      flush=True)
    (root / "jobs" / "events.jsonl").write_text("".join(
        json.dumps({"time": t0 + s, "component": "trainer-r0", "job_id": str(s), "action": "restart",
                    "reason": "trainer-r0 exited with code -9"}) + "\n" for s in range(0, groups // per_step, 500)))


def fetch(port: int, path: str) -> tuple[float, int]:
    t = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status == 200, (path, resp.status, body[:300])
    return time.perf_counter() - t, len(body)


def page_load(port: int) -> float:
    """The page's opening requests, one after the other (the browser sends the first three at once)."""
    return sum(fetch(port, p)[0] for p in PAGE_LOAD)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=100_000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "explore.json")
    ap.add_argument("--keep", type=Path, help="build the run here (reused when it exists)")
    args = ap.parse_args()
    tmp = None
    if args.keep:
        root = args.keep
    else:
        tmp = tempfile.TemporaryDirectory(prefix="hpcrl-explore-")
        root = Path(tmp.name) / "run"
    if not (root / "config.yaml").exists():
        t = time.time()
        print(f"building a run of {args.groups} groups in {root} ...", file=sys.stderr, flush=True)
        build(root, args.groups)
        print(f"built in {time.time() - t:.0f} s", file=sys.stderr)
    result: dict = {"groups": args.groups, "run_dir_files": sum(len(f) for _, _, f in os.walk(root))}
    cold, warm, group = [], [], []
    for _ in range(3):  # a fresh explorer each time: cold caches (the OS's file cache stays warm)
        srv = make_server(RunView(root), "127.0.0.1", 0, token="")
        serve_in_thread(srv)
        port = srv.server_address[1]
        cold.append(page_load(port))
        warm.append(page_load(port))
        listing = json.loads(http_get(port, f"/api/groups?kind=trained&step_min={args.groups // 32}&limit=5"))
        for g in listing["groups"]:
            group.append(fetch(port, f"/api/group?path={g['path']}")[0])
        srv.shutdown()
        srv.server_close()
    result.update(page_load_cold_s=statistics.median(cold), page_load_warm_s=statistics.median(warm),
                  trajectory_s=statistics.median(group), trajectory_max_s=max(group),
                  curves_bytes=fetch_size(root), command=" ".join(sys.argv))
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if tmp:
        tmp.cleanup()


def http_get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    body = conn.getresponse().read()
    conn.close()
    return body


def fetch_size(root: Path) -> int:
    srv = make_server(RunView(root), "127.0.0.1", 0, token="")
    serve_in_thread(srv)
    try:
        return fetch(srv.server_address[1], "/api/curves?since=0")[1]
    finally:
        srv.shutdown()
        srv.server_close()


if __name__ == "__main__":
    main()
