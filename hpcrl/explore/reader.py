"""What the run explorer shows, read from a run directory without changing it.

:class:`RunView` opens nothing for writing, takes no claim and creates no
directory: it lists the spool by file names (the ticket, version range and
writer are in each name, ``hpcrl/spool/format.py``), tails the run's JSONL
logs from the byte offset it reached last time (appended lines only, a
half-written last line waits for its newline), and opens one trajectory file
only when asked for it. Listings are cached per directory by modification
time, so a run of 100k groups is listed once and then only where it changed.
Lifecycle: one instance per explorer process, shared by its request threads
(a lock guards the caches); nothing to close.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from hpcrl.spool.format import parse_name, read_group
from hpcrl.spool.store import REASON_SUFFIX

__all__ = ["GroupQuery", "RunView", "KINDS"]

KINDS = ("trained", "ready", "claimed", "dropped", "quarantine")
_STEP_RE = re.compile(r"^step_(\d{6,})$")
_AGAIN_RE = re.compile(r"^again-(\d+)$")
MAX_PAGE = 500  # groups per listing page
MAX_OPEN_PER_QUERY = 2000  # files opened (groups for their reward, reason files) to filter one page


class _Tail:
    """The parsed lines of an append-only JSONL file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, []

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.rows
        end = chunk.rfind(b"\n") + 1  # complete lines only
        for line in chunk[:end].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn line of a crashed writer: skipped, as the trainer's reader does
            if isinstance(row, dict):
                self.rows.append(row)
        self.offset += end
        return self.rows


@dataclass(frozen=True)
class GroupQuery:
    """Filters of a trajectory listing; every field optional."""

    kind: str = "trained"
    step_min: int | None = None  # trained: optimizer step; otherwise: the group's newest version
    step_max: int | None = None
    ticket: int | None = None
    replica: str | None = None  # writer prefix, e.g. "r1"
    reason: str | None = None  # substring of the set-aside reason (dropped, quarantine)
    reward_min: float | None = None  # mean reward of the group's samples (opens the files)
    reward_max: float | None = None
    offset: int = 0
    limit: int = 50

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.offset < 0 or not 1 <= self.limit <= MAX_PAGE:
            raise ValueError(f"offset >= 0 and 1 <= limit <= {MAX_PAGE}, got offset={self.offset} limit={self.limit}")
        if self.replica is not None and not re.fullmatch(r"[A-Za-z0-9-]+", self.replica):
            raise ValueError(f"replica: expected a writer id like r1, got {self.replica!r}")
        for name in ("reward_min", "reward_max"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"{name}: must be finite, got {v}")


class RunView:
    """The run directory ``root`` as the explorer reads it."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        if not (self.root / "config.yaml").is_file():
            raise ValueError(f"{self.root} is not a run directory (no config.yaml): pass the run_dir of a submit")
        self.spool = self.root / "spool"
        self._lock = threading.Lock()
        self._tails: dict[str, _Tail] = {}
        self._listings: dict[Path, tuple[int, list[dict]]] = {}
        self._rewards: dict[str, float | None] = {}
        self._reasons: dict[str, str] = {}  # path -> set-aside reason ("" when none)
        self._tokenizer: Any = None
        self.config = _load_yaml(self.root / "config.yaml")

    # -- logs ----------------------------------------------------------------
    def _rows(self, rel: str) -> list[dict]:
        with self._lock:
            tail = self._tails.setdefault(rel, _Tail(self.root / rel))
            return tail.read()

    def curves(self, since: int = 0) -> dict[str, Any]:
        """Trainer steps from index ``since`` of logs/metrics.jsonl (numeric fields only), and the held-out
        evaluations of the evaluation component (logs/eval.jsonl)."""
        rows = self._rows("logs/metrics.jsonl")
        new = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for r in rows[since:]]
        evals = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                 for r in self._rows("logs/eval.jsonl")]
        return {"since": since, "next": len(rows), "rows": new, "evals": evals}

    def summary(self) -> dict[str, Any]:
        rows = self._rows("logs/metrics.jsonl")
        last = rows[-1] if rows else {}
        state = ("done" if (self.root / "DONE").exists() else "failed" if (self.root / "FAILED").exists()
                 else "stopped" if (self.root / "STOPPED").exists() else "running")
        cfg = self.config
        return {
            "run": self.root.name, "path": str(self.root), "state": state,
            "step": last.get("step"), "total_steps": _get(cfg, "trainer", "total_steps"),
            "max_staleness": _get(cfg, "admission", "max_staleness"),
            "batch_size": _get(cfg, "admission", "batch_size"), "group_size": _get(cfg, "rollout", "group_size"),
            "rollouts": _get(cfg, "launch", "rollouts"), "algo": _get(cfg, "algo", "name"),
            "model": _get(cfg, "model", "path") or ("tiny" if _get(cfg, "model", "tiny") else None),
            "counts": {k: self.count(k) for k in KINDS},
        }

    def events(self) -> list[dict[str, Any]]:
        """The supervisor's decisions (restart, fail, stop, scale, resume, rewind; a preemption is a restart
        whose reason says so), the autoscaler's, each committed checkpoint and each published weight version,
        sorted by time. Every event has time, component, kind and text."""
        out = []
        for e in self._rows("jobs/events.jsonl"):
            reason = str(e.get("reason", ""))
            kind = str(e.get("action", "event"))
            if kind == "restart" and "preempt" in reason.lower():
                kind = "preempt"
            out.append({"time": e.get("time"), "component": e.get("component", "run"), "kind": kind,
                        "text": reason, "job_id": e.get("job_id", "")})
        for e in self._rows("logs/fleet.jsonl"):
            out.append({"time": e.get("time"), "component": "fleet", "kind": "autoscale",
                        "text": json.dumps({k: v for k, v in e.items() if k != "time"})})
        for step, mtime in self._numbered(self.root / "ckpt", re.compile(r"^step_(\d+)$")):
            out.append({"time": mtime, "component": "trainer-r0", "kind": "checkpoint", "text": f"step {step}",
                        "step": step})
        for version, mtime in self._numbered(self.root / "weights", re.compile(r"^v(\d+)$")):
            out.append({"time": mtime, "component": "weights", "kind": "publish", "text": f"version {version}",
                        "version": version})
        for marker in ("DONE", "FAILED", "STOPPED"):
            p = self.root / marker
            if p.exists():
                out.append({"time": p.stat().st_mtime, "component": "run", "kind": marker.lower(), "text": marker})
        out = [e for e in out if isinstance(e["time"], (int, float))]
        return sorted(out, key=lambda e: e["time"])

    def components(self) -> list[str]:
        """Lanes of the timeline: the registry's components (trainer ranks, replicas, eval, reward)."""
        try:
            reg = json.loads((self.root / "jobs" / "registry.json").read_text())
        except (OSError, ValueError):
            reg = {}
        names = set(reg) if isinstance(reg, dict) else set()
        names |= {e["component"] for e in self.events()}
        return sorted(names, key=lambda n: (not n.startswith("trainer"), n))

    @staticmethod
    def _numbered(directory: Path, pattern: re.Pattern) -> Iterator[tuple[int, float]]:
        try:
            entries = list(os.scandir(directory))
        except FileNotFoundError:
            return
        for d in entries:
            m = pattern.match(d.name)
            if m and d.is_dir():
                try:
                    yield int(m.group(1)), d.stat().st_mtime
                except FileNotFoundError:
                    continue

    # -- the spool, by names -------------------------------------------------
    def _listing(self, directory: Path, **extra: Any) -> list[dict]:
        """The spool files of one directory (cached until its mtime changes)."""
        try:
            mtime = directory.stat().st_mtime_ns
        except FileNotFoundError:
            return []
        with self._lock:
            hit = self._listings.get(directory)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        rows = []
        try:
            names = os.listdir(directory)
        except FileNotFoundError:  # claimed/ between a commit's rename of it and its new claimed/
            return []
        for name in names:
            info = parse_name(name)
            if info is not None:
                rows.append({"path": str((directory / name).relative_to(self.spool)), "ticket": info.ticket,
                             "min_version": info.min_version, "max_version": info.max_version,
                             "writer": info.writer, **extra})
        rows.sort(key=lambda r: (r["ticket"], r["min_version"], r["writer"]))
        with self._lock:
            self._listings[directory] = (mtime, rows)
        return rows

    def _steps(self) -> list[tuple[int, Path]]:
        steps = []
        for d in _scandirs(self.spool / "trained"):
            m = _STEP_RE.match(d.name)
            if m:
                steps.append((int(m.group(1)), Path(d.path)))
        return sorted(steps)

    def _entries(self, q: GroupQuery) -> Iterator[dict]:
        if q.kind == "trained":
            for step, d in self._steps():
                if (q.step_min is None or step >= q.step_min) and (q.step_max is None or step <= q.step_max):
                    yield from self._listing(d, step=step)
            return
        base = self.spool / q.kind
        dirs = [base] + sorted((Path(d.path) for d in _scandirs(base) if _AGAIN_RE.match(d.name)),
                               key=lambda p: int(p.name.split("-")[1]))
        for d in dirs:
            for r in self._listing(d):
                if (q.step_min is None or r["max_version"] >= q.step_min) and \
                        (q.step_max is None or r["max_version"] <= q.step_max):
                    yield r

    def count(self, kind: str) -> int:
        return sum(1 for _ in self._entries(GroupQuery(kind=kind)))

    def groups(self, q: GroupQuery) -> dict[str, Any]:
        """One page of a listing, in (step, ticket) order; ``next_offset`` is where the next page starts
        (None: no more). Without a reward or reason filter nothing is opened; with one, each file (a group for
        its mean reward, a reason record) is opened once and cached, at most MAX_OPEN_PER_QUERY new ones per
        page (``truncated``: ask again from ``next_offset``; each such page opens new files, so paging ends)."""
        rows: list[dict] = []
        matched, opened = 0, [0]
        by_reward = q.reward_min is not None or q.reward_max is not None

        def can_open(path: str, cache: dict) -> bool:  # a file not read before is charged to the page's budget
            if path in cache:
                return True
            opened[0] += 1
            return opened[0] <= MAX_OPEN_PER_QUERY

        def truncated() -> dict[str, Any]:  # files still to open: the next page goes on from here
            return {"groups": self._with_rewards(rows), "next_offset": q.offset + len(rows), "truncated": True}

        for r in self._entries(q):
            if q.ticket is not None and r["ticket"] != q.ticket:
                continue
            if q.replica is not None and r["writer"].split("-")[0] != q.replica:
                continue
            if q.reason is not None:
                if not can_open(r["path"], self._reasons):
                    return truncated()
                if q.reason.lower() not in self._reason_text(r["path"]).lower():
                    continue
            if by_reward:
                if not can_open(r["path"], self._rewards):
                    return truncated()
                reward = self.mean_reward(r["path"])
                if reward is None or (q.reward_min is not None and reward < q.reward_min) or \
                        (q.reward_max is not None and reward > q.reward_max):
                    continue
                r = {**r, "reward_mean": reward}
            if matched >= q.offset:
                if len(rows) == q.limit:
                    return {"groups": self._with_rewards(rows), "next_offset": q.offset + len(rows),
                            "truncated": False}
                rows.append(r)
            matched += 1
        return {"groups": self._with_rewards(rows), "next_offset": None, "truncated": False}

    def _with_rewards(self, rows: list[dict]) -> list[dict]:
        """The page's rows with their mean reward (one small read per file, cached)."""
        return [r if "reward_mean" in r else {**r, "reward_mean": self.mean_reward(r["path"])} for r in rows]

    def _reason_text(self, rel: str) -> str:
        """The set-aside reason of a group (cached: a reason file is written once, with its group)."""
        with self._lock:
            if rel in self._reasons:
                return self._reasons[rel]
        reason = self.reason(rel)
        text = str(reason.get("reason", "")) if reason else ""
        with self._lock:
            self._reasons[rel] = text
        return text

    def reason(self, rel: str) -> dict | None:
        p = self.resolve(rel)
        try:
            data = json.loads(p.with_name(p.name + REASON_SUFFIX).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def mean_reward(self, rel: str) -> float | None:
        with self._lock:
            if rel in self._rewards:
                return self._rewards[rel]
        try:
            g = read_group(self.resolve(rel))
        except Exception:  # noqa: BLE001 - a quarantined or vanished file has no reward to filter on
            with self._lock:
                self._rewards[rel] = None  # not opened again by the next page
            return None
        reward = sum(s.reward for s in g.samples) / len(g.samples) if g.samples else 0.0
        with self._lock:
            self._rewards[rel] = reward
        return reward

    def resolve(self, rel: str) -> Path:
        """``rel`` (a path the listing gave) as a spool file; PermissionError for anything else."""
        if not isinstance(rel, str) or not rel or "\x00" in rel or rel.startswith("/"):
            raise PermissionError(f"not a spool path: {rel!r}")
        p = (self.spool / rel).resolve()
        if not p.is_relative_to(self.spool.resolve()) or parse_name(p.name) is None:
            raise PermissionError(f"not a spool file of this run: {rel!r}")
        return p

    # -- one trajectory --------------------------------------------------------
    def group(self, rel: str) -> dict[str, Any]:
        """One group whole: prompt, samples with their tokens (text piece, version, behaviour logprob,
        trained or masked), rewards and verdicts, and the reason it was set aside."""
        p = self.resolve(rel)
        if not p.is_file():
            raise FileNotFoundError(f"no such spool file (trained or moved since it was listed?): {rel}")
        out: dict[str, Any] = {"path": rel, "reason": self.reason(rel)}
        try:
            g = read_group(p)
        except Exception as e:  # noqa: BLE001 - a quarantined file may be unreadable: show why
            out["error"] = f"{type(e).__name__}: {e}"
            return out
        piece = self._pieces()
        meta = {k: v for k, v in g.meta.items() if k != "responses"}
        statuses = g.meta.get("reward_status") or []
        out.update(ticket=g.ticket, writer=g.writer, created=g.created, versions=list(g.version_range()), meta=meta,
                   prompt=[piece(int(t)) for t in g.prompt_ids], samples=[])
        for i, s in enumerate(g.samples):
            out["samples"].append({
                "reward": float(s.reward), "finish_reason": s.finish_reason,
                "verdict": statuses[i] if i < len(statuses) else None,
                "tokens": [[piece(int(t)), int(v), round(float(lp), 4), int(m)]
                           for t, v, lp, m in zip(s.response_ids, s.versions, s.behav_logprobs, s.loss_mask)],
            })
        return out

    def _pieces(self):
        """token id -> its text, from the run's tokenizer.json (the `tokenizers` library, no model load)."""
        if self._tokenizer is None:
            tok = None
            try:
                prepared = json.loads((self.root / "prepared.json").read_text())
                from tokenizers import Tokenizer
                tok = Tokenizer.from_file(str(Path(prepared["init_model"]) / "tokenizer.json"))
            except Exception:  # noqa: BLE001 - no tokenizer reachable: ids are shown instead of text
                tok = False
            self._tokenizer = tok
        tok = self._tokenizer
        if not tok:
            return lambda t: f"<{t}>"
        return lambda t: tok.decode([t], skip_special_tokens=False) or tok.id_to_token(t) or f"<{t}>"


def _scandirs(path: Path) -> list[os.DirEntry]:
    try:
        return [d for d in os.scandir(path) if d.is_dir()]
    except FileNotFoundError:
        return []


def _load_yaml(path: Path) -> dict:
    import yaml
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _get(cfg: dict, section: str, key: str) -> Any:
    sec = cfg.get(section)
    return sec.get(key) if isinstance(sec, dict) else None
