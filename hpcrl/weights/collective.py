"""Collective weight transport: trainer rank 0 broadcasts flat buckets to the rollout engines.

Roles. The trainer's rank 0 is the **host**: it starts a ``TCPStore`` and
records its address in ``<weights>/collective.json`` (atomically), so any
rollout can find it through the run directory. Each rollout is a **member**:
it reads that file, connects to the store and registers (a member id from a
store counter). Host and members then share a side process group (gloo on
CPU, NCCL on CUDA, HCCL on Ascend) built on ``PrefixStore(f"g{gen}", store)``
with the host as rank 0; the trainer's own FSDP world is not touched.

Protocol (store keys under ``hpcrl/weights/``), all driven by one host thread:

1. membership: ``members_next`` (counter, joins) and ``leave/<id>``
   (clean exits). Any change, or a failed transfer, re-forms the group.
2. re-forming generation ``g``: the host sets ``state`` = ``{gen, members,
   seq, version}``; each listed member answers ``ack/<g>/<id>`` at its next
   poll; members that do not answer within ``join_timeout_s`` are dropped
   and a new generation is tried. When all answered the host sets ``go/<g>``
   and everyone builds the group. If the host holds published weights, the
   announcement carries a new ``seq`` and the current version is broadcast
   right away, so a joining rollout receives it in full before it generates.
3. new version: :meth:`CollectiveWeights.publish` only packs the state into
   buckets (a copy) and returns; the host thread announces a new ``seq`` and
   broadcasts the buckets. A newer publish supersedes one not yet sent.

Members poll ``state`` in :meth:`latest_version` (between decode steps):
joining, acknowledging and receiving all happen there, so generation pauses
only while a transfer is in flight. :meth:`fetch` (or :meth:`locate`) hands over
what was received. A member that finds itself dropped registers again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from hpcrl.fs import atomic
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.buckets import Layout, TransferStats, broadcast, new_group, pick_backend  # noqa: F401 (re-exported)
from hpcrl.weights.version import WeightVersion

log = logging.getLogger(__name__)

RENDEZVOUS_FILE = "collective.json"
_PREFIX = "hpcrl/weights/"
class _Base:
    def __init__(self, root: str | Path, cfg: WeightsConfig) -> None:
        self.root, self.cfg = Path(root), cfg
        self.backend, self.device = pick_backend(cfg.collective_backend)
        self.stats = TransferStats()
        self.store: dist.Store | None = None
        self.pg = None
        self._layout: Layout | None = None

    def published_file(self, version: int) -> Path | None:
        """No file: versions travel over the group."""
        return None

    def discard_after(self, version: int) -> int:
        """Nothing to withdraw: no version is kept (a restarted host holds none until it publishes)."""
        return 0

    def _get(self, key: str) -> str | None:
        k = _PREFIX + key
        return self.store.get(k).decode() if self.store.check([k]) else None

    def _set(self, key: str, value: str) -> None:
        self.store.set(_PREFIX + key, value)


def open_collective(root: str | Path, cfg: WeightsConfig, role: str, fence: Fence | NoFence | None = None,
                    adapter: object = None) -> "CollectiveWeights | CollectiveMember":
    """``weights.mode: collective`` (:mod:`hpcrl.weights.registry`): the host on the trainer's rank 0, a member in
    each rollout (``adapter`` is refused before: this transport sends whole policies)."""
    return CollectiveWeights.host(root, cfg, fence) if role == "host" else CollectiveWeights.member(root, cfg)


class CollectiveWeights(_Base):
    """Host side (trainer rank 0). Use :meth:`host` / :meth:`member` to build either role."""

    @staticmethod
    def host(root: str | Path, cfg: WeightsConfig, fence: Fence | NoFence | None = None) -> "CollectiveWeights":
        return CollectiveWeights(root, cfg, fence)

    @staticmethod
    def member(root: str | Path, cfg: WeightsConfig) -> "CollectiveMember":
        return CollectiveMember(root, cfg)

    def __init__(self, root: str | Path, cfg: WeightsConfig, fence: Fence | NoFence | None = None) -> None:
        super().__init__(root, cfg)
        self.fence = fence or NoFence()
        self.fence.check("weights rendezvous")  # a replaced owner's trainer must not redirect the rollouts
        self.root.mkdir(parents=True, exist_ok=True)
        host = cfg.collective_host or socket.gethostname()
        self.store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=cfg.collective_timeout_s), multi_tenant=False)
        self._set("state", json.dumps({"gen": 0, "members": [], "seq": 0, "version": 0}))
        self.store.add(_PREFIX + "members_next", 0)
        atomic.write_json(self.root / RENDEZVOUS_FILE, {"host": host, "port": self.store.port, "pid": os.getpid(),
                                                        "backend": self.backend, "time": time.time()})
        self.gen, self.seq, self.members, self.wanted, self._known = 0, 0, [], set(), 0
        self._pending: tuple[int, list[torch.Tensor]] | None = None  # newest (version, buckets) published
        self._sent = 0  # version last broadcast to the current group
        self._broken = False
        self._lock, self._wake, self._stop = threading.Lock(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weights-host", daemon=True)
        self._thread.start()
        log.info("collective weights: store %s:%d (%s)", host, self.store.port, self.backend)

    # -- WeightTransport ------------------------------------------------------
    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.fence.check(f"weight publish of version {version}")
        t0 = time.perf_counter()
        state = {name: t.detach() for name, t in state_dict.items()}
        if self._layout is None:
            self._layout = Layout.of(state, int(self.cfg.bucket_mb * 2**20))
        flat = self._layout.pack(state, self.device)
        with self._lock:
            self._pending = (version, flat)
        self._wake.set()
        self.stats.pack_seconds += time.perf_counter() - t0

    def latest_version(self) -> int:
        with self._lock:
            return self._pending[0] if self._pending else 0

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        with self._lock:
            if not self._pending or self._pending[0] != version:
                raise FileNotFoundError(f"version {version} is not the newest published")
            return self._layout.unpack(self._pending[1])

    def locate(self, version: int) -> WeightVersion:
        return WeightVersion(version, state=self.fetch(version))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.pg = None

    def wait_sent(self, version: int, timeout_s: float = 60.0) -> bool:
        """Block until ``version`` has reached every current member (tests and benchmarks)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self._sent >= version and not self._broken:
                return True
            time.sleep(0.005)
        return False

    # -- host thread ------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                if self._membership_changed() or self._broken:
                    self._reform()
                elif self.members and self._pending and self._pending[0] > self._sent:
                    self._send_current(new_seq=True)
                else:
                    self._wake.wait(self.cfg.collective_poll_s)
                    self._wake.clear()
            except Exception as e:  # a member died mid-transfer or the group timed out: re-form
                if self._stop.is_set():
                    return
                log.warning("collective weights: %s; re-forming the group", e)
                self.stats.failures += 1
                self._broken, self.pg = True, None

    def _membership_changed(self) -> bool:
        n = self.store.add(_PREFIX + "members_next", 0)
        self.wanted.update(range(self._known + 1, n + 1))
        self._known = n
        for m in list(self.wanted):
            if self.store.check([f"{_PREFIX}leave/{m}"]):
                self.wanted.discard(m)
        return sorted(self.wanted) != self.members

    def _reform(self) -> None:
        candidates = sorted(self.wanted)
        while True:
            self.gen += 1
            has_state = self._pending is not None
            seq = self.seq + 1 if has_state and candidates else self.seq
            version = self._pending[0] if has_state else 0
            self._set("state", json.dumps({"gen": self.gen, "members": candidates, "seq": seq, "version": version}))
            missing = self._await_acks(candidates)
            if not missing:
                break
            log.warning("collective weights: members %s did not answer; dropping them", missing)
            self.wanted -= set(missing)
            candidates = sorted(self.wanted)
        self._set(f"go/{self.gen}", "1")
        self.members, self.seq, self._broken = candidates, seq, False
        self.pg = None
        if candidates:
            t0 = time.perf_counter()
            self.pg = new_group(self.backend, dist.PrefixStore(f"{_PREFIX}g{self.gen}/", self.store), 0,
                                len(candidates) + 1, self.cfg.collective_timeout_s)
            self.stats.reforms += 1
            log.info("collective weights: group %d formed with members %s in %.2fs", self.gen, candidates,
                     time.perf_counter() - t0)
            if has_state:
                self._send_current(new_seq=False)

    def _await_acks(self, candidates: list[int]) -> list[int]:
        deadline = time.time() + self.cfg.join_timeout_s
        waiting = list(candidates)
        while waiting and time.time() < deadline and not self._stop.is_set():
            waiting = [m for m in waiting if not self.store.check([f"{_PREFIX}ack/{self.gen}/{m}"])]
            if waiting:
                time.sleep(0.002)
        return waiting

    def _send_current(self, new_seq: bool) -> None:
        with self._lock:
            version, flat = self._pending
        if self._get("layout") is None:
            self._set("layout", self._layout.to_json())
        if new_seq:
            self.seq += 1
            self._set("state", json.dumps({"gen": self.gen, "members": self.members, "seq": self.seq,
                                           "version": version}))
        t0 = time.perf_counter()
        broadcast(self.pg, flat)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.transfers += 1
        self.stats.bytes += sum(t.numel() * t.element_size() for t in flat)
        self._sent = version


class CollectiveMember(_Base):
    """Member side (a rollout): joins through the run directory, receives every version broadcast."""

    def __init__(self, root: str | Path, cfg: WeightsConfig) -> None:
        super().__init__(root, cfg)
        self.mid: int | None = None
        self.gen: int | None = None  # generation of the group this member is in
        self.seq, self.version = 0, 0
        self._received: dict[str, torch.Tensor] | None = None
        self._connected_once = False
        self._retry_at = 0.0
        self._next_poll = 0.0

    def latest_version(self) -> int:
        """The newest version held; joins (or rejoins a restarted trainer) between decode steps.

        The trainer's store is asked at most every ``collective_poll_s``: a
        poll is two round trips to the trainer's process, and asked at every
        decode step they took ~10 % of a rollout's time on 2 busy cores.
        """
        now = time.monotonic()
        if self.store is not None and now < self._next_poll:
            return self.version
        if self.store is None and time.time() < self._retry_at:
            return self.version
        self._next_poll = now + self.cfg.collective_poll_s
        try:
            if self.store is None:
                self._connect()
                self._wait_joined()
            self._poll()
        except (RuntimeError, OSError, ValueError, KeyError) as e:  # the trainer is gone: keep the weights in hand
            if not self._connected_once:
                raise
            log.warning("collective weights: lost the trainer (%s); generating with version %d, retrying",
                        e, self.version)
            self.store = self.pg = None
            self._retry_at = time.time() + 2.0
        return self.version

    def fetch(self, version: int) -> dict[str, torch.Tensor]:
        if self._received is None or version != self.version:
            raise FileNotFoundError(f"version {version} was not received (holding {self.version})")
        state, self._received = self._received, None
        return state

    def locate(self, version: int) -> WeightVersion:
        return WeightVersion(version, state=self.fetch(version))

    def close(self) -> None:
        if self.store is not None and self.mid is not None:
            try:
                self._set(f"leave/{self.mid}", "1")
            except Exception as e:  # the trainer may already be gone at the end of a run
                log.debug("leave not recorded: %s", e)
        self.pg = None

    def _connect(self) -> None:
        """Connect to the trainer named in the rendezvous file; a stale file (dead trainer) is re-read."""
        path, deadline = self.root / RENDEZVOUS_FILE, time.time() + self.cfg.rendezvous_timeout_s
        while True:
            if path.exists():
                info = atomic.read_json(path)
                try:
                    self.store = dist.TCPStore(info["host"], info["port"], is_master=False,
                                               timeout=timedelta(seconds=min(5.0, self.cfg.collective_timeout_s)))
                    break
                except RuntimeError as e:  # the trainer named there is gone; its successor rewrites the file
                    log.info("collective weights: rendezvous %s:%s not answering (%s)", info["host"], info["port"], e)
            if time.time() > deadline:
                raise TimeoutError(f"weights.rendezvous_timeout_s: no trainer answering at {path}")
            time.sleep(0.5)
        self.store.set_timeout(timedelta(seconds=self.cfg.collective_timeout_s))
        self._register()
        self._connected_once = True

    def _register(self) -> None:
        self.mid = self.store.add(_PREFIX + "members_next", 1)
        self.gen, self.seq = None, 0  # a (new) host numbers its transfers from scratch
        log.info("collective weights: registered as member %d", self.mid)

    def _wait_joined(self) -> None:
        """Block until this member is in a group and holds the trainer's current version."""
        deadline = time.time() + self.cfg.rendezvous_timeout_s
        while self.gen is None:
            if time.time() > deadline:
                raise TimeoutError("weights.rendezvous_timeout_s: the trainer never admitted this rollout")
            self._poll()
            if self.gen is None:
                time.sleep(0.005)

    def _poll(self) -> None:
        raw = self._get("state")
        if raw is None:
            return  # a (new) trainer that has not published its group state yet
        st = json.loads(raw)
        if st["gen"] == self.gen and self.pg is None:
            return  # our last transfer failed: wait for the host to re-form the group
        if st["gen"] != self.gen:
            if self.mid in st["members"]:
                self._join(st)
            elif self.gen is not None:  # dropped (too slow to answer): ask to be let in again
                log.warning("collective weights: member %d dropped from group %d; registering again",
                            self.mid, st["gen"])
                self._register()
            return
        if st["seq"] > self.seq:
            self._receive(st)

    def _join(self, st: dict) -> None:
        gen = st["gen"]
        self._set(f"ack/{gen}/{self.mid}", "1")
        deadline = time.time() + 2 * self.cfg.join_timeout_s
        while not self.store.check([f"{_PREFIX}go/{gen}"]):
            if json.loads(self._get("state"))["gen"] != gen or time.time() > deadline:
                return  # abandoned (another member did not answer): the next poll sees the new generation
            time.sleep(0.002)
        rank = st["members"].index(self.mid) + 1
        self.pg = new_group(self.backend, dist.PrefixStore(f"{_PREFIX}g{gen}/", self.store), rank,
                            len(st["members"]) + 1, self.cfg.collective_timeout_s)
        self.gen = gen
        self.stats.reforms += 1
        if st["seq"] > self.seq:
            self._receive(st)

    def _receive(self, st: dict) -> None:
        if self._layout is None:
            raw = self._get("layout")
            if raw is None:
                return  # the host has not described its buckets yet: receive on a later poll
            self._layout = Layout.from_json(raw)
        flat = self._layout.empty(self.device)
        t0 = time.perf_counter()
        try:
            broadcast(self.pg, flat)
        except Exception as e:  # the host re-forms the group; keep generating with the weights in hand
            log.warning("collective weights: receive of version %d failed (%s)", st["version"], e)
            self.stats.failures += 1
            self.pg = None
            return
        self.stats.seconds += time.perf_counter() - t0
        self.stats.transfers += 1
        self.stats.bytes += sum(t.numel() * t.element_size() for t in flat)
        self.seq, self.version = st["seq"], st["version"]
        self._received = self._layout.unpack(flat)
