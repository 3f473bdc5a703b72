"""Agent episodes through the real rollout loop: the embedded engine on a tiny model, the proxy under
uvicorn, agent functions written against the official ``openai`` client, the spool.

The agent of the first test is the multi-turn arithmetic one: answer, hear "wrong", answer again. Its
spool groups must hold whole episodes: the group's prompt is the chat template's opening, every model
token is trained with its engine logprob, the feedback turn is loss-masked, and the rewards are the
agent's own. The second test runs agents that raise, hang, make no call or return a bad value: each
scores 0 with its status, and the run goes on.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from hpcrl.admission.config import AdmissionConfig  # noqa: E402
from hpcrl.algo.config import AlgoConfig  # noqa: E402
from hpcrl.admission.ledger import AdmissionLedger  # noqa: E402
from hpcrl.agent.config import AgentConfig  # noqa: E402
from hpcrl.agent.proxy import read_admin_key  # noqa: E402
from hpcrl.agent.runner import AgentEpisodes, load_agent_fn  # noqa: E402
from hpcrl.data.rows import Row  # noqa: E402
from hpcrl.model.hf_io import load_model, load_tokenizer  # noqa: E402
from hpcrl.model.limits import ModelLimits  # noqa: E402
from hpcrl.model.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from hpcrl.reward.config import RewardConfig  # noqa: E402
from hpcrl.reward.runner import RewardRunner  # noqa: E402
from hpcrl.rollout.config import RolloutConfig  # noqa: E402
from hpcrl.rollout.engine import SamplingParams  # noqa: E402
from hpcrl.rollout.torch_engine import TorchEngine  # noqa: E402
from hpcrl.rollout.worker import RolloutWorker  # noqa: E402
from hpcrl.spool.format import read_group  # noqa: E402
from hpcrl.spool.store import Spool  # noqa: E402
from hpcrl.trainer.batch import to_sequences  # noqa: E402

ROWS = [Row(prompt=f"{i}+{i}=", answer=str(2 * i), index=i) for i in range(4)]


async def feedback_agent(data: dict, *, base_url: str, api_key: str) -> float:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": data["prompt"]}]
    try:
        for turn in range(2):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            answer = r.choices[0].message.content or ""
            if answer.strip() == data["answer"]:
                return 1.0 / (turn + 1)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "wrong"}]
        return 0.25  # answered twice, wrong twice: still the agent's own reward
    finally:
        await client.close()


async def persistent_agent(data: dict, *, base_url: str, api_key: str) -> float:
    """Answers 1 + index % 3 times, hearing "again" after each answer; 1 for a right last answer, else 0.25."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": data["prompt"]}]
    try:
        for turn in range(1 + data["index"] % 3):
            if turn:
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "again"}]
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            answer = r.choices[0].message.content or ""
        return 1.0 if answer.strip() == data["answer"] else 0.25
    finally:
        await client.close()


async def unruly_agent(data: dict, *, base_url: str, api_key: str) -> float:
    i = data["index"]
    if i == 0:
        raise RuntimeError("tool crashed")
    if i == 1:
        return 1.0  # claims success without asking the model anything
    if i == 2:
        await asyncio.sleep(3600)  # hangs past agent.timeout_s
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.completions.create(model="policy", prompt=data["prompt"], max_tokens=3)
    await client.close()
    if i == 4:
        return float("nan")  # would poison the group's advantages
    if i == 5:
        raise asyncio.CancelledError()  # its own, not the job stopping: an error like any other
    return 1.0


REMOTE_AGENT = """
import json, os, sys, urllib.request
base_url, api_key, admin_key = sys.argv[1], sys.argv[2], os.environ["ADMIN_KEY"]
answer, index = sys.argv[3], int(sys.argv[4])

def post(url, key, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))

text = post(base_url + "/completions", api_key, {"model": "p", "prompt": sys.argv[5], "max_tokens": 4})
text = text["choices"][0]["text"]
admin = base_url.removesuffix("/v1") + "/admin/sessions/" + api_key
if index != 3:  # the grader of row 3 ends the episode without a reward
    post(admin + "/reward", admin_key, {"reward": 1.0 if text.strip() == answer else 0.1 + index / 10})
if index == 2:  # leaves the end to the agent function, which returns None: the reward set here counts
    sys.exit(7)
post(admin + "/end", admin_key, {})
"""


async def remote_agent(data: dict, *, base_url: str, api_key: str) -> float | None:
    """Hands the episode to a program outside the job (here a subprocess) and waits: that program's grader sets
    the reward and ends the session through the admin API, which cancels this function."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", REMOTE_AGENT, base_url, api_key,
                                                data["answer"], str(data["index"]), data["prompt"],
                                                env={**os.environ, "ADMIN_KEY": ADMIN_KEY})
    try:
        if await proc.wait() == 7:
            return None
        await asyncio.sleep(3600)  # the end comes through the admin API, not from here
    finally:
        if proc.returncode is None:
            proc.kill()


ADMIN_KEY = "admin-" + "x" * 26


def make_worker(tmp_path: Path, fn, timeout_s: float = 60.0, rows: list[Row] = ROWS,
                **agent) -> tuple[RolloutWorker, Spool]:
    model_dir = build_tiny_model(tmp_path / "model", TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2,
                                                                     num_kv_heads=2, head_dim=16,
                                                                     intermediate_size=64))
    tokenizer = load_tokenizer(model_dir)
    engine = TorchEngine(load_model(model_dir), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, max_batch_size=8,
                         sampling=SamplingParams(max_new_tokens=4), seed=0)
    admission = AdmissionConfig(batch_size=len(rows), max_staleness=0)
    runner = AgentEpisodes(engine, tokenizer, AgentConfig(fn="x:y", timeout_s=timeout_s, max_concurrent_episodes=8,
                                                          **agent), fn, max_tokens=4,
                           limits=ModelLimits.of_dir(model_dir))
    spool = Spool(tmp_path / "spool")
    worker = RolloutWorker(RolloutConfig(group_size=2, max_batch_size=8, max_new_tokens=4), admission,
                           engine=engine, tokenizer=tokenizer, rows=rows,
                           ledger=AdmissionLedger(tmp_path / "admission", admission, len(rows)), spool=spool,
                           reward=RewardRunner(RewardConfig()), writer="w0", episodes=runner)
    return worker, spool


def run_until(worker: RolloutWorker, groups: int, timeout_s: float = 90.0) -> None:
    deadline = time.time() + timeout_s
    try:
        while worker.stats.groups_published < groups:
            assert time.time() < deadline, f"{worker.stats.groups_published} of {groups} groups after {timeout_s} s"
            if not worker.pump():
                time.sleep(0.005)
        worker.flush()
    finally:
        worker.close()


def test_multi_turn_agent_episodes_are_published_whole_with_the_feedback_masked(tmp_path) -> None:
    worker, spool = make_worker(tmp_path, feedback_agent)
    tok = worker.tokenizer
    run_until(worker, 4)
    groups = [read_group(e.path) for e in spool.ready()]
    assert sorted(g.meta["row"] for g in groups) == [0, 1, 2, 3]
    two_turns = 0
    for g in groups:
        prompt = tok.decode(g.prompt_ids.tolist(), skip_special_tokens=False)
        assert prompt == f"user: {g.meta['prompt']}<eos>\nassistant: ", prompt  # the template's opening, shared
        assert g.meta["reward_status"] == ["ok", "ok"]
        for s in g.samples:
            mask = s.loss_mask.astype(bool)
            assert s.reward in (1.0, 0.5, 0.25)
            assert np.all(s.behav_logprobs[mask] < 0) and np.all(s.behav_logprobs[~mask] == 0)
            if (~mask).any():  # answered wrongly first: the feedback turn sits between the answers, masked
                two_turns += 1
                gap = tok.decode(s.response_ids[~mask].tolist(), skip_special_tokens=False)
                assert gap.endswith("\nuser: wrong<eos>\nassistant: "), gap
                assert s.reward in (0.5, 0.25)
            else:
                assert s.reward == 1.0
    assert two_turns > 0  # an untrained model is wrong at least once in 8 episodes
    assert worker.episodes.stats["ok"] == 8 and worker.episodes.stats["off_branch_calls"] == 0


def test_individual_export_publishes_each_call_as_a_sample_with_its_discounted_reward(tmp_path) -> None:
    """``agent.export=individual``, ``turn_discount=0.5``: a group holds one sample per model call (row i's
    episodes make 1 + i % 3 calls each, so groups differ in size); each sample is that call's prompt (the
    conversation so far) and its output, only the output trained; an episode's last call gets its reward,
    each earlier one half of the next one's; the trainer's batch takes the groups of different sizes, each
    normalised over its own samples."""
    worker, spool = make_worker(tmp_path, persistent_agent, export="individual", turn_discount=0.5)
    tok = worker.tokenizer
    run_until(worker, 4)
    groups = sorted((read_group(e.path) for e in spool.ready()), key=lambda g: g.meta["row"])
    assert [g.meta["row"] for g in groups] == [0, 1, 2, 3]
    assert [len(g.samples) for g in groups] == [2, 4, 6, 2]  # group_size 2 episodes x their calls
    for g in groups:
        turns = 1 + g.meta["row"] % 3
        assert g.meta["sample_episodes"] == [0] * turns + [1] * turns and g.meta["reward_status"] == ["ok", "ok"]
        prompt = tok.decode(g.prompt_ids.tolist(), skip_special_tokens=False)
        assert prompt == f"user: {g.meta['prompt']}<eos>\nassistant: ", prompt
        for samples in (g.samples[:turns], g.samples[turns:]):
            last = samples[-1].reward
            assert last in (1.0, 0.25)
            assert [s.reward for s in samples] == [last * 0.5 ** (turns - 1 - k) for k in range(turns)]
            for k, s in enumerate(samples):
                mask = s.loss_mask.astype(bool)
                head = int(np.argmax(mask))  # the call's own prompt beyond the group's, then its output
                assert mask[head:].all() and not mask[:head].any() and (head == 0) == (k == 0)
                assert np.all(s.behav_logprobs[mask] < 0) and np.all(s.behav_logprobs[~mask] == 0)
                assert np.all(s.versions == 0)  # no weight update in this run
                if k:  # the conversation so far, then the feedback (the exact tokens: test_agent_proxy.py;
                    # a reply whose text loses a token, <unk> say, is re-rendered, not continued)
                    context = tok.decode(s.response_ids[:head].tolist(), skip_special_tokens=True)
                    before = tok.decode(samples[k - 1].response_ids.tolist(), skip_special_tokens=True)
                    assert context.startswith(before) and context.endswith("\nuser: again\nassistant: "), context
    assert worker.episodes.stats["ok"] == 8 and worker.episodes.stats["turns"] == 14
    seqs, n_uniform = to_sequences(groups, AlgoConfig())  # the trainer's batch: groups of 2, 4, 6, 2 samples
    kept = [g for g in groups if len({s.reward for s in g.samples}) > 1]
    assert n_uniform == 4 - len(kept) and len(seqs) == sum(len(g.samples) for g in kept) and len(kept) >= 2
    for g in kept:  # GRPO over each group's own samples
        r = np.array([s.reward for s in g.samples], np.float64)
        want = (r - r.mean()) / (r.std() + 1e-6)
        assert [q.advantage for q in seqs if q.ticket == g.ticket] == pytest.approx(want.tolist(), abs=1e-9)


@pytest.mark.parametrize("export", ["concat", "individual"])
def test_agents_that_raise_hang_never_ask_or_return_no_number_score_zero_and_the_run_goes_on(tmp_path,
                                                                                           export) -> None:
    rows = [Row(prompt=f"{i}+{i}=", answer=str(2 * i), index=i) for i in range(6)]
    # the timeout must pass for the hanging episode only: the others call the engine, slow on a loaded machine
    worker, spool = make_worker(tmp_path, unruly_agent, timeout_s=5.0, rows=rows, export=export)
    run_until(worker, 6)
    by_row = {g.meta["row"]: g for g in (read_group(e.path) for e in spool.ready())}
    assert by_row[0].meta["reward_status"] == ["error", "error"]
    assert by_row[1].meta["reward_status"] == ["no_call", "no_call"]
    assert by_row[2].meta["reward_status"] == ["timeout", "timeout"]
    assert by_row[3].meta["reward_status"] == ["ok", "ok"]
    assert by_row[4].meta["reward_status"] == ["invalid", "invalid"]
    assert by_row[5].meta["reward_status"] == ["error", "error"]
    for row in (0, 1, 2, 4, 5):
        assert [s.reward for s in by_row[row].samples] == [0.0, 0.0]
    assert all(len(s.response_ids) == 0 for s in by_row[1].samples)  # nothing generated: an empty sample
    assert [s.reward for s in by_row[3].samples] == [1.0, 1.0] and all(len(s.response_ids) for s in by_row[3].samples)
    assert by_row[3].prompt_ids.tolist() == worker.tokenizer.encode("3+3=", add_special_tokens=False)
    assert worker.episodes.stats == {"error": 4, "no_call": 2, "timeout": 2, "ok": 2, "invalid": 2, "turns": 6,
                                     "off_branch_calls": 0}
    assert not worker.episodes._results and not worker.episodes._delivered and not worker.episodes._runs


def test_agent_fn_must_be_an_importable_async_function() -> None:
    with pytest.raises(ValueError, match=r"^agent\.fn: 'tests_nowhere:f': module 'tests_nowhere' not found"):
        load_agent_fn("tests_nowhere:f")
    with pytest.raises(ValueError, match=r"must be an async function"):
        load_agent_fn("json:dumps")


def test_an_agent_outside_the_job_is_graded_and_ended_through_the_admin_api(tmp_path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    key_file.chmod(0o600)
    worker, spool = make_worker(tmp_path, remote_agent, host="0.0.0.0", admin_key_file=str(key_file))
    assert worker.episodes.base_url.startswith(f"http://{socket.gethostname()}:")  # what other nodes can reach
    run_until(worker, 4)
    by_row = {g.meta["row"]: g for g in (read_group(e.path) for e in spool.ready())}
    for row in (0, 1, 2):
        assert by_row[row].meta["reward_status"] == ["ok", "ok"]
        assert {float(s.reward) for s in by_row[row].samples} <= {1.0, float(np.float32(0.1 + row / 10))}  # as stored
        assert all(len(s.response_ids) for s in by_row[row].samples)  # the remote program's call is trained
    assert by_row[3].meta["reward_status"] == ["invalid", "invalid"]  # ended, never graded: 0
    assert worker.episodes.stats["ended_by_admin"] == 6 and worker.episodes.stats["ok"] == 6


def test_a_proxy_beyond_loopback_needs_an_admin_key_only_its_owner_reads(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"host: '0\.0\.0\.0' is not loopback.*agent\.admin_key_file"):
        AgentConfig(fn="x:y", host="0.0.0.0")
    with pytest.raises(ValueError, match=r"admin_key_file: the admin API is the agent proxy's"):
        AgentConfig(admin_key_file="k")
    key_file = tmp_path / "admin.key"
    with pytest.raises(ValueError, match=r"cannot read"):
        read_admin_key(str(key_file))
    key_file.write_text(ADMIN_KEY)
    key_file.chmod(0o644)
    with pytest.raises(ValueError, match=r"readable by others \(mode 644\); chmod 600"):
        read_admin_key(str(key_file))
    key_file.chmod(0o600)
    assert read_admin_key(str(key_file)) == ADMIN_KEY
    key_file.write_text("short")
    with pytest.raises(ValueError, match=r"at least 16 characters"):
        read_admin_key(str(key_file))
