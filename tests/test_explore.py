"""The run explorer's reader and server on a run directory built here (real spool files, logs, events).

The page itself, in a real browser on real runs: tests/test_explore_browser.py.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from light import heavy_modules, light_command

from hpcrl.explore.export import export_html
from hpcrl.explore.reader import GroupQuery, RunView
from hpcrl.explore.server import make_server, serve_in_thread
from hpcrl.spool.format import Sample, TrajectoryGroup
from hpcrl.spool.store import Spool


def group(ticket: int, versions: list[int], reward: float, writer: str = "r0-e1n1") -> TrajectoryGroup:
    n = len(versions)
    sample = Sample(response_ids=np.arange(3, 3 + n, dtype=np.int32),
                    behav_logprobs=np.linspace(-0.1, -2.0, n).astype(np.float32),
                    versions=np.array(versions, dtype=np.int32), loss_mask=np.array([1] * (n - 1) + [0], np.uint8),
                    reward=reward, finish_reason="stop")
    return TrajectoryGroup(ticket=ticket, writer=writer, prompt_ids=np.array([5, 6, 7], np.int32),
                           samples=[sample, sample], meta={"prompt": f"p{ticket}", "reward_status": ["ok", "ok"]})


@pytest.fixture
def run(tmp_path) -> Path:
    root = tmp_path / "run"
    (root / "logs").mkdir(parents=True)
    (root / "jobs").mkdir()
    (root / "config.yaml").write_text("admission: {max_staleness: 2, batch_size: 2}\ntrainer: {total_steps: 4}\n")
    spool = Spool(root / "spool")
    t0 = time.time() - 100
    for step in range(4):
        published = [spool.publish(group(2 * step + k, [max(0, step - k), step], reward=float(k)))
                     for k in range(2)]
        entries = [e for e in spool.ready() if e.path in published]
        spool.mark_trained(spool.claim(entries), step)
    spool.publish(group(20, [1, 1], 0.5, writer="r1-e2n1"))
    spool.drop(spool.ready()[0], "stale: tokens of version 1 at trainer version 4 > eta 2")
    spool.publish(group(21, [3], 1.0, writer="r1-e2n1"))
    spool.quarantine(spool.ready()[0], "forged: owner epoch 1 is not the run's")
    (root / "spool" / "ready" / "g000000022_v000004-000004_r0-e1n1.h5").write_bytes(b"not hdf5")
    with open(root / "logs" / "metrics.jsonl", "w") as f:
        for step in range(4):
            f.write(json.dumps({"step": step, "reward/mean": 0.5, "time/unix": t0 + 10 * step,
                                "time/elapsed_s": 10 * step,
                                "staleness/tokens_behind_0": 3, "staleness/tokens_behind_1": step,
                                "note": "text is not a curve"}) + "\n")
    (root / "jobs" / "events.jsonl").write_text(
        json.dumps({"time": t0 + 15, "component": "trainer-r0", "job_id": "7", "action": "restart",
                    "reason": "trainer-r0 exited with code -9; restart 1/3"}) + "\n" +
        json.dumps({"time": t0 + 25, "component": "rollout-1", "job_id": "8", "action": "restart",
                    "reason": "rollout-1 was preempted (requeued by Slurm)"}) + "\n")
    (root / "ckpt" / "step_000002").mkdir(parents=True)
    return root


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_reader_lists_pages_and_filters_without_changing_the_run(run) -> None:
    before = tree(run)
    view = RunView(run)
    assert view.summary()["counts"] == {"trained": 8, "ready": 1, "claimed": 0, "dropped": 1, "quarantine": 1}
    page = view.groups(GroupQuery(limit=3))
    assert [g["ticket"] for g in page["groups"]] == [0, 1, 2] and page["next_offset"] == 3
    rest = view.groups(GroupQuery(offset=6, limit=3))
    assert [g["ticket"] for g in rest["groups"]] == [6, 7] and rest["next_offset"] is None
    assert [g["step"] for g in view.groups(GroupQuery(step_min=2, step_max=2))["groups"]] == [2, 2]
    assert [g["ticket"] for g in view.groups(GroupQuery(ticket=5))["groups"]] == [5]
    high = view.groups(GroupQuery(reward_min=0.5))["groups"]
    assert [g["ticket"] for g in high] == [1, 3, 5, 7] and all(g["reward_mean"] == 1.0 for g in high)
    assert view.groups(GroupQuery(kind="dropped", reason="STALE"))["groups"][0]["ticket"] == 20
    assert view.groups(GroupQuery(kind="dropped", reason="forged"))["groups"] == []
    assert [g["ticket"] for g in view.groups(GroupQuery(kind="quarantine", replica="r1"))["groups"]] == [21]
    assert view.groups(GroupQuery(kind="quarantine", replica="r0"))["groups"] == []
    events = view.events()
    assert [e["kind"] for e in events] == ["restart", "preempt", "checkpoint"]
    assert view.components() == ["trainer-r0", "rollout-1"]
    assert tree(run) == before  # nothing written, moved or created


def test_one_trajectory_has_each_tokens_version_logprob_and_mask(run) -> None:
    view = RunView(run)
    g = view.groups(GroupQuery(step_min=3))["groups"][1]  # ticket 7: versions [2, 3]
    detail = view.group(g["path"])
    assert detail["ticket"] == 7 and detail["versions"] == [2, 3]
    tokens = detail["samples"][0]["tokens"]
    assert [t[1] for t in tokens] == [2, 3] and [t[3] for t in tokens] == [1, 0]
    assert tokens[0][2] == pytest.approx(-0.1) and detail["samples"][0]["verdict"] == "ok"
    assert detail["prompt"] == ["<5>", "<6>", "<7>"]  # no tokenizer reachable: ids
    dropped = view.group(view.groups(GroupQuery(kind="dropped"))["groups"][0]["path"])
    assert "stale" in dropped["reason"]["reason"]
    broken = view.group("ready/g000000022_v000004-000004_r0-e1n1.h5")
    assert "error" in broken and "samples" not in broken


@pytest.mark.parametrize("path", ["../config.yaml", "/etc/passwd", "trained/../../config.yaml", "",
                                  "trained/step_000000/../../../jobs/events.jsonl", "ready/x.h5", "a\x00b"])
def test_paths_outside_the_spool_are_refused(run, path) -> None:
    with pytest.raises(PermissionError):
        RunView(run).group(path)


def test_a_link_out_of_the_spool_is_refused(run, tmp_path) -> None:
    outside = tmp_path / "g000000099_v000000-000000_r0-e1n1.h5"
    outside.write_bytes(b"secret")
    (run / "spool" / "ready" / outside.name).symlink_to(outside)
    with pytest.raises(PermissionError):
        RunView(run).group(f"ready/{outside.name}")


def test_curves_follow_a_growing_log_and_wait_for_a_torn_line(run) -> None:
    view = RunView(run)
    first = view.curves()
    assert first["next"] == 4 and "note" not in first["rows"][0] and first["rows"][0]["reward/mean"] == 0.5
    with open(run / "logs" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "reward/mean": 0.7}) + "\n" + '{"step": 5, "rew')
    more = view.curves(since=4)
    assert [r["step"] for r in more["rows"]] == [4] and more["next"] == 5
    with open(run / "logs" / "metrics.jsonl", "a") as f:
        f.write('ard/mean": 0.9}\n')
    assert view.curves(since=5)["rows"] == [{"step": 5, "reward/mean": 0.9}]


def test_not_a_run_directory(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a run directory"):
        RunView(tmp_path)


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict | bytes, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    ctype = resp.getheader("Content-Type") or ""
    return resp.status, json.loads(body) if "json" in ctype else body, dict(resp.getheaders())


@pytest.fixture
def server(run):
    srv = make_server(RunView(run), "127.0.0.1", 0, token="")  # no token: loopback only
    serve_in_thread(srv)
    yield srv
    srv.shutdown()
    srv.server_close()


BAD = [("/api/groups?limit=abc", 400), ("/api/groups?limit=0", 400), ("/api/groups?limit=100000", 400),
       ("/api/groups?kind=../../etc", 400), ("/api/groups?reward_min=nan", 400), ("/api/groups?offset=-1", 400),
       ("/api/groups?replica=r0/../x", 400), ("/api/groups?bogus=1", 400), ("/api/groups?limit=1&limit=2", 400),
       ("/api/group", 400), ("/api/group?path=../config.yaml", 403), ("/api/group?path=%2Fetc%2Fpasswd", 403),
       ("/api/group?path=trained/step_000000/g000000077_v000000-000000_r0-e1n1.h5", 404),
       ("/api/nothing", 404), ("/static/../config.yaml", 404), ("/static/reader.py", 404)]


def test_the_server_answers_bad_requests_with_4xx_and_stays_up(server) -> None:
    port = server.server_address[1]
    for path, status in BAD:
        code, body, _ = get(port, path)
        assert code == status, (path, code, body)
        assert isinstance(body, dict) and body["error"]
    code, body, _ = get(port, "/api/groups?kind=trained&step_min=1&limit=2")
    assert code == 200 and [g["ticket"] for g in body["groups"]] == [2, 3]
    code, body, headers = get(port, "/")
    assert code == 200 and b"static/explore.js" in body and headers["Cache-Control"] == "no-store"
    code, body, _ = get(port, "/static/plotly.min.js")
    assert code == 200 and len(body) > 1_000_000
    code, _, _ = get(port, "/api/summary", {"Host": "attacker.example:80"})  # DNS rebinding
    assert code == 403
    code, body, _ = get(port, "/api/group?path=" + body_path(port))
    assert code == 200 and body["samples"]


def body_path(port: int) -> str:
    return get(port, "/api/groups?limit=1")[1]["groups"][0]["path"]


def test_a_token_guards_every_route_and_the_cookie_carries_it(run) -> None:
    srv = make_server(RunView(run), "127.0.0.1", 0, token="s3cret")
    serve_in_thread(srv)
    port = srv.server_address[1]
    try:
        for path in ("/", "/api/summary", "/static/explore.js"):
            assert get(port, path)[0] == 401
        assert get(port, "/api/summary", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(port, "/api/summary", {"Authorization": "Bearer s3cret"})[0] == 200
        code, _, headers = get(port, "/?token=s3cret")
        assert code == 200 and "HttpOnly" in headers["Set-Cookie"] and f"_{port}=" in headers["Set-Cookie"]
        cookie = headers["Set-Cookie"].split(";")[0]
        assert get(port, "/api/summary", {"Cookie": cookie})[0] == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_token_is_generated_unless_turned_off_on_loopback(run) -> None:
    for host in ("127.0.0.1", "0.0.0.0"):
        srv = make_server(RunView(run), host, 0)
        try:
            assert len(srv.token) >= 24
        finally:
            srv.server_close()
    with pytest.raises(ValueError, match="off loopback the explorer needs an access token"):
        make_server(RunView(run), "0.0.0.0", 0, token="")


def test_the_export_is_one_file_with_the_data_and_no_network(run, tmp_path) -> None:
    out = export_html(RunView(run), tmp_path / "report.html", groups_per_kind=3)
    html = out.read_text()
    assert "window.HPCRL_EXPORT" in html
    assert not re.search(r"<script[^>]*\bsrc=|<link[^>]*stylesheet|static/", html.split("window.HPCRL_EXPORT")[0])
    assert html.count("<script>") == 3  # the data, the chart library, the page's script: all inline
    start = html.index("window.HPCRL_EXPORT = ") + len("window.HPCRL_EXPORT = ")
    data = json.loads(html[start:html.index(";</script>", start)].replace("<\\/", "</"))
    assert len(data["groups"]["trained"]) == 3 and len(data["curves"]["rows"]) == 4
    assert all(g["path"] in data["details"] for g in data["groups"]["trained"])
    assert os.path.getsize(out) < 8_000_000


def test_the_command_exports_without_loading_torch(run, tmp_path) -> None:
    out = tmp_path / "r.html"
    proc = subprocess.run(light_command("hpcrl.explore", str(run), "--export", str(out), "--export-groups", "2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and out.stat().st_size > 1_000_000, proc.stderr[-2000:]
    assert heavy_modules(proc.stderr) == []
    bad = subprocess.run(light_command("hpcrl.explore", str(tmp_path)), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not a run directory" in bad.stderr


def test_unreadable_files_are_opened_once_for_the_reward_filter(run, monkeypatch) -> None:
    import hpcrl.explore.reader as reader

    monkeypatch.setattr(reader, "MAX_OPEN_PER_QUERY", 2)
    for k in range(4):  # junk ahead of the readable file in quarantine
        (run / "spool" / "quarantine" / f"g00000000{k}_v000000-000000_r9-e1n1.h5").write_bytes(b"junk")
    view, offset, found = RunView(run), 0, []
    for _ in range(6):
        page = view.groups(GroupQuery(kind="quarantine", reward_min=0.0, offset=offset))
        found += [g["ticket"] for g in page["groups"]]
        if not page["truncated"]:
            break
        offset = page["next_offset"]
    assert found == [21]  # reached: each junk file cost one open, once


def test_the_reason_filter_opens_each_reason_file_once_and_pages(run, monkeypatch) -> None:
    import hpcrl.explore.reader as reader

    monkeypatch.setattr(reader, "MAX_OPEN_PER_QUERY", 2)
    for k in range(5):  # set aside for another reason, ahead of the stale group (ticket 20)
        name = f"g00000000{k}_v000000-000000_r9-e1n1.h5"
        (run / "spool" / "dropped" / name).write_bytes(b"junk")
        (run / "spool" / "dropped" / (name + ".reason.json")).write_text(json.dumps({"reason": "forged epoch"}))
    view, offset, found, opened = RunView(run), 0, [], []
    real = view.reason
    monkeypatch.setattr(view, "reason", lambda rel: opened.append(rel) or real(rel))
    for _ in range(8):
        page = view.groups(GroupQuery(kind="dropped", reason="stale", offset=offset))
        found += [g["ticket"] for g in page["groups"]]
        assert len(set(opened)) == len(opened) and len(opened) <= 2 * (_ + 1)  # at most 2 new files a page
        if not page["truncated"]:
            break
        offset = page["next_offset"]
    assert found == [20] and len(opened) == 6
    view, offset, found = RunView(run), 0, []  # both filters: a group is opened only once its reason matched
    for _ in range(8):
        page = view.groups(GroupQuery(kind="dropped", reason="stale", reward_min=0.0, offset=offset))
        found += [g["ticket"] for g in page["groups"]]
        if not page["truncated"]:
            break
        offset = page["next_offset"]
    assert found == [20] and set(view._rewards) == {g for g in view._reasons if "000020" in g}


def test_the_export_of_a_live_run_skips_a_group_moved_meanwhile(run, tmp_path, monkeypatch) -> None:
    view = RunView(run)
    real = view.group

    def moved(rel: str) -> dict:
        if rel.startswith("ready/"):
            raise FileNotFoundError(rel)  # claimed by the trainer between the listing and the read
        return real(rel)

    monkeypatch.setattr(view, "group", moved)
    html = export_html(view, tmp_path / "r.html", groups_per_kind=2).read_text()
    assert "ready/g000000022" not in html.split("window.HPCRL_EXPORT")[1].split("</script>")[0]


def test_no_text_of_the_run_can_break_out_of_the_exported_script(run, tmp_path) -> None:
    (run / "spool" / "dropped" / "g000000020_v000001-000001_r1-e2n1.h5.reason.json").write_text(
        json.dumps({"reason": "<!--<script></script><b>x</b>"}))
    html = export_html(RunView(run), tmp_path / "r.html").read_text()
    data = html[html.index("window.HPCRL_EXPORT = "):html.index("</script>")]
    assert "<" not in data.split("=", 1)[1] and "\\u003c!--" in data


def test_without_plotly_the_command_refuses_at_start_with_the_install_line(run) -> None:
    """The base install has no plotly: the explorer says so and serves nothing (it once served a page whose every
    chart stayed empty, 'Plotly is not defined')."""
    code = ("import sys; sys.modules['plotly'] = None  # as if not installed\n"
            "from hpcrl.explore.__main__ import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run([sys.executable, "-c", code, str(run), "--port", "0"], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pip install -e '.[explore]'" in proc.stderr and "explorer for" not in proc.stderr, proc.stderr
