"""Collective weight transport over gloo between real processes.

A host process publishes versions 1..3 (and the same tensors through disk
mode); member A joins at the start and receives every version; member B joins
after version 2 and must hold version 2 before it would generate, then gets
version 3 like A; member A leaves cleanly after version 3 and the group is
re-formed without it. Every received state must equal the host's tensors and
the disk-mode file bit for bit.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from hpcrl.weights.collective import Layout
from hpcrl.weights.config import WeightsConfig
from hpcrl.weights.transport import DiskWeights, open_transport

CFG = WeightsConfig(mode="collective", bucket_mb=0.001, collective_backend="gloo", join_timeout_s=10,
                    rendezvous_timeout_s=60, collective_timeout_s=30, collective_poll_s=0.005)


def state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    emb = torch.randn(50, 16, generator=g)
    return {"embed.weight": emb, "lm_head.weight": emb, "layer.weight": torch.randn(16, 33, generator=g),
            "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16), "step": torch.tensor([version])}


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.01)


def _host(root: str, disk_root: str, out: str) -> None:
    torch.set_num_threads(1)
    root_p = Path(root)
    host, disk = open_transport(root, CFG, "host"), DiskWeights(disk_root, WeightsConfig())
    _wait_for(root_p / "a.ready")
    for v in (1, 2):
        host.publish(state(v), v)
        disk.publish(state(v), v)
        assert host.wait_sent(v)
    (root_p / "v2.sent").touch()
    _wait_for(root_p / "b.ready")  # B joined (and, the test checks, received version 2 first)
    host.publish(state(3), 3)
    disk.publish(state(3), 3)
    assert host.wait_sent(3)
    _wait_for(root_p / "a.left")
    deadline = time.time() + 30
    while (host.members != [2] or host.stats.reforms < 3) and time.time() < deadline:  # re-formed without A, still serving B
        time.sleep(0.01)
    Path(out).write_text(f"{host.members} {host.stats.reforms}")
    (root_p / "stop").touch()
    _wait_for(root_p / "b.left")
    host.close()


def _member(root: str, name: str, want: list[int], out: str) -> None:
    torch.set_num_threads(1)
    root_p = Path(root)
    m = open_transport(root, CFG, "member")
    got = {}
    first = m.latest_version()  # joins: blocks until admitted and holding the current version
    got[first] = m.fetch(first) if first else None
    (root_p / f"{name}.ready").touch()
    deadline = time.time() + 60
    while max(got) < want[-1] and time.time() < deadline:
        v = m.latest_version()
        if v not in got:
            got[v] = m.fetch(v)
        time.sleep(0.002)
    torch.save({"first": first, "got": {k: v for k, v in got.items() if v is not None}}, out)
    while name == "b" and not (root_p / "stop").exists():  # B stays in the group until the host has checked
        m.latest_version()
        time.sleep(0.002)
    m.close()
    (root_p / f"{name}.left").touch()


def test_layout_roundtrip_many_buckets() -> None:
    from hpcrl.weights.transport import unique_tensors
    s = unique_tensors(state(5))
    layout = Layout.of(s, bucket_bytes=256)
    assert len(layout.buckets) > 3 and {d for d, _ in layout.buckets} == {"torch.float32", "torch.bfloat16",
                                                                         "torch.int64"}
    back = Layout.from_json(layout.to_json()).unpack(layout.pack(s, torch.device("cpu")))
    assert back.keys() == s.keys() and all(torch.equal(back[k], s[k]) for k in s)


def test_layout_sends_a_tied_alias_once_and_unpacks_it_under_both_names() -> None:
    emb, other = torch.randn(10, 4), torch.randn(4, 4)
    s = {"embed.weight": emb, "layer.weight": other, "lm_head.weight": emb}
    layout = Layout.of(s, bucket_bytes=1 << 20)
    assert sum(n for _, n in layout.buckets) == emb.numel() + other.numel()
    back = Layout.from_json(layout.to_json()).unpack(layout.pack(s, torch.device("cpu")))
    assert back.keys() == s.keys() and torch.equal(back["lm_head.weight"], emb)
    # a zero-size tensor sits where the next one starts: it is no alias of it
    z = {"empty": torch.zeros(0), "next": torch.arange(4.0)}
    layout = Layout.of(z, bucket_bytes=1 << 20)
    back = layout.unpack(layout.pack(z, torch.device("cpu")))
    assert torch.equal(back["next"], z["next"]) and back["empty"].numel() == 0


def test_member_joining_mid_run_gets_current_weights_bit_identical(tmp_path) -> None:
    ctx = mp.get_context("spawn")
    root, disk = tmp_path / "weights", tmp_path / "disk"
    host = ctx.Process(target=_host, args=(str(root), str(disk), str(tmp_path / "host.txt")))
    a = ctx.Process(target=_member, args=(str(root), "a", [1, 2, 3], str(tmp_path / "a.pt")))
    host.start()
    a.start()
    _wait_for(root / "v2.sent")
    b = ctx.Process(target=_member, args=(str(root), "b", [2, 3], str(tmp_path / "b.pt")))
    b.start()
    for p in (host, a, b):
        p.join(120)
        assert p.exitcode == 0
    ra, rb = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert ra["first"] == 0 and sorted(ra["got"]) == [1, 2, 3]
    assert rb["first"] == 2, "a rollout joining after version 2 must hold version 2 before generating"
    assert sorted(rb["got"]) == [2, 3]
    for got in (ra["got"], rb["got"]):
        for v, received in got.items():
            on_disk = load_file(str(disk / f"v{v:06d}" / "model.safetensors"))
            assert received.keys() == on_disk.keys()
            for k in on_disk:
                assert received[k].dtype == on_disk[k].dtype and torch.equal(received[k], on_disk[k])
                assert torch.equal(received[k], state(v)[k])
    members, reforms = (tmp_path / "host.txt").read_text().rsplit(" ", 1)
    assert members == "[2]", "after A left the group must be re-formed with B alone"
    assert int(reforms) >= 3  # A alone, A+B, B alone
