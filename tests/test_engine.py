"""TorchEngine against HF generate and full-sequence forwards on a tiny random Qwen3."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from hpcrl.rollout.engine import InferenceEngine, Request, SamplingParams
from hpcrl.rollout.torch_engine import TorchEngine
from hpcrl.weights.version import WeightVersion

torch.set_num_threads(1)
PAD, EOS, VOCAB = 0, 1, 40


def tiny_model(seed: int, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=True,
        pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None,
        initializer_range=0.5,  # the default 0.02 with tied embeddings just repeats the last token
    )
    return Qwen3ForCausalLM(cfg).to(dtype).eval()


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def full_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) at each output token, from one unpadded forward."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt) - 1
    return [logp[start + i, t].item() for i, t in enumerate(output)]


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | None = EOS) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=PAD,
        )
    return out[0, len(prompt):].tolist()


def test_protocol_and_config_errors():
    engine = TorchEngine(tiny_model(0), eos_token_id=EOS, pad_token_id=PAD)
    assert isinstance(engine, InferenceEngine)
    with pytest.raises(ValueError, match="^temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="^max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="^prompt_ids"):
        Request("x", [])
    with pytest.raises(ValueError, match="^max_batch_size"):
        TorchEngine(tiny_model(0), eos_token_id=EOS, pad_token_id=PAD, max_batch_size=0)


def test_greedy_continuous_batching_matches_hf_generate():
    model = tiny_model(1)
    ps = prompts(7, seed=1)
    engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=3,
                         sampling=SamplingParams(max_new_tokens=12, greedy=True))
    # per-request lengths make sequences finish at different steps
    reqs = [Request(i, p, max_new_tokens=6 + (i % 4) * 2) for i, p in enumerate(ps)]
    comps = engine.generate(reqs)
    assert [c.id for c in comps] == list(range(7))
    lengths = set()
    for r, c in zip(reqs, comps):
        expect = hf_greedy(model, r.prompt_ids, r.max_new_tokens)
        assert c.output_ids == expect, (r.id, c.output_ids, expect)
        ref = full_logprobs(model, r.prompt_ids, c.output_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4
        assert c.versions == [0] * len(c.output_ids)
        lengths.add(len(c.output_ids))
    assert len(lengths) > 1  # the batch really had sequences finishing at different steps
    assert engine.stats["tokens_generated"] == sum(len(c.output_ids) for c in comps)
    assert 1 < engine.stats["mean_running_batch_size"] <= 3


def test_decode_steps_are_kept_by_their_rows_with_their_time_and_padded_context():
    """stats["decode_by_rows"]: every decode step in the bin of its rows (8 wide, keyed by its top), with its rows,
    its time and the context it held, rows times the longest row (pending token counted), summed."""
    engine = TorchEngine(tiny_model(1), eos_token_id=EOS, pad_token_id=PAD, max_batch_size=12,
                         sampling=SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert set(engine.stats["decode_by_rows"]) == {"8", "16"}  # every bin there from the start, empty
    ps = prompts(10, seed=2, lo=5, hi=5)  # one length: no row's drop cuts the cache
    reqs = [Request(i, p, max_new_tokens=2 + i) for i, p in enumerate(ps)]  # one row ends at each step from the 2nd
    engine.generate(reqs)
    bins, st = engine.stats["decode_by_rows"], engine.stats
    assert set(bins) == {"8", "16"}  # every bin up to max_batch_size: 10, 10 and 9 rows, then 8 and fewer
    assert sum(b["steps"] for b in bins.values()) == st["decode_steps"] == 11
    assert sum(b["s"] for b in bins.values()) == pytest.approx(st["decode_s"])
    # 10 rows of the 5-token prompt, then of 6 tokens, then 9 rows of 7: each step's rows times the longest row
    assert bins["16"]["steps"] == 3 and bins["16"]["context"] == 10 * 5 + 10 * 6 + 9 * 7
    assert bins["16"]["rows"] == 29 and bins["8"]["rows"] == sum(range(1, 9))
    assert bins["8"]["context"] == sum(rows * (5 + k) for k, rows in zip(range(3, 11), range(8, 0, -1)))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_decode_mask_in_each_attention_form_matches_hf_generate(impl):
    """Rows of different lengths (a padded cache): the decode step's own 4-D mask, boolean for sdpa and additive
    for eager attention, gives HF generate's tokens and a full forward's logprobs."""
    model = tiny_model(2)
    model.config._attn_implementation = impl
    engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=4,
                         sampling=SamplingParams(max_new_tokens=8, greedy=True))
    reqs = [Request(i, p) for i, p in enumerate(prompts(6, seed=3, lo=1, hi=12))]
    for r, c in zip(reqs, engine.generate(reqs)):
        assert c.output_ids == hf_greedy(model, r.prompt_ids, 8), r.id
        ref = full_logprobs(model, r.prompt_ids, c.output_ids)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4


def test_eos_stops_and_length_limit():
    model = tiny_model(2)
    # force or forbid eos by biasing the logits (weights are tied, so use a hook)
    bias = torch.zeros(VOCAB)
    bias[EOS] = 50.0
    handle = model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD,
                         sampling=SamplingParams(max_new_tokens=5, greedy=True))
    (c,) = engine.generate([Request("a", [3, 4])])
    assert c.output_ids == [EOS] and c.finish_reason == "stop"
    handle.remove()
    bias[EOS] = -1e4
    handle = model.lm_head.register_forward_hook(lambda m, i, o: o + bias)
    (c,) = engine.generate([Request("b", [3, 4])])
    handle.remove()
    assert len(c.output_ids) == 5 and c.finish_reason == "length" and EOS not in c.output_ids


def test_interruption_matches_fresh_engine_under_new_weights():
    model_a, model_b = tiny_model(3), tiny_model(4)
    state_b = {k: v.clone() for k, v in model_b.state_dict().items() if k != "lm_head.weight"}
    sampling = SamplingParams(max_new_tokens=10, greedy=True)
    ps = prompts(4, seed=3, lo=2, hi=7)
    engine = TorchEngine(tiny_model(3), eos_token_id=-1, pad_token_id=PAD, max_batch_size=4, sampling=sampling)
    for i, p in enumerate(ps):
        engine.submit(Request(i, p))
    k = 4
    for _ in range(k):
        assert engine.poll() == []
    engine.update_weights(WeightVersion(1, state=state_b))
    assert engine.version == 1
    comps = {}
    while engine.num_running():
        comps.update({c.id: c for c in engine.poll()})
    for i, p in enumerate(ps):
        c = comps[i]
        before, after = c.output_ids[:k], c.output_ids[k:]
        assert before == hf_greedy(model_a, p, k, eos=None)
        assert c.versions == [0] * k + [1] * (10 - k)
        fresh = TorchEngine(model_b, eos_token_id=-1, pad_token_id=PAD,
                            sampling=SamplingParams(max_new_tokens=10 - k, greedy=True))
        (f,) = fresh.generate([Request(i, p + before)])
        assert after == f.output_ids
        ref_a = full_logprobs(model_a, p, before)
        ref_b = full_logprobs(model_b, p + before, after)
        assert max(abs(x - y) for x, y in zip(c.logprobs, ref_a + ref_b)) < 1e-4


def test_stale_cache_would_differ():
    """Guard for the test above: B's tokens really differ from A's after the swap."""
    model_a, model_b = tiny_model(3), tiny_model(4)
    p = prompts(1, seed=3, lo=5, hi=5)[0]
    assert hf_greedy(model_a, p, 8, eos=None) != hf_greedy(model_b, p, 8, eos=None)


def test_update_weights_rejects_bad_state_dict():
    engine = TorchEngine(tiny_model(0), eos_token_id=EOS, pad_token_id=PAD)
    good = tiny_model(1).state_dict()
    with pytest.raises(ValueError, match="^state_dict: unexpected"):
        engine.update_weights(WeightVersion(1, state={**good, "nope.weight": torch.zeros(1)}))
    partial = {k: v for k, v in good.items() if "layers.0.mlp" not in k}
    with pytest.raises(ValueError, match="^state_dict: missing"):
        engine.update_weights(WeightVersion(1, state=partial))
    assert engine.version == 0


def test_slot_refilled_next_step_and_sampling_reproducible():
    model = tiny_model(5)
    ps = prompts(10, seed=5)

    def run(seed: int) -> tuple[list, list[int]]:
        engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=3, seed=seed,
                             sampling=SamplingParams(max_new_tokens=8, temperature=1.3))
        for i, p in enumerate(ps):
            engine.submit(Request(i, p, max_new_tokens=2 + i % 5))
        done, freed_while_waiting = [], 0
        while engine.num_running() or engine.num_waiting():
            free_before = 3 - engine.num_running()
            waiting_before = engine.num_waiting()
            finished = engine.poll()
            done += finished
            if waiting_before >= free_before:
                # every step that had requests waiting ran a full batch: freed slots were refilled
                assert engine.num_running() + len(finished) == 3
            if finished and engine.num_waiting():
                freed_while_waiting += 1
        return sorted((c.id, c.output_ids, c.logprobs) for c in done), freed_while_waiting

    a, freed_while_waiting = run(seed=7)
    b, _ = run(seed=7)
    c, _ = run(seed=8)
    assert a == b
    assert [x[1] for x in a] != [x[1] for x in c]
    assert len(a) == 10
    assert freed_while_waiting >= 3  # the refill path was exercised


def test_sampled_logprobs_equal_tempered_full_forward():
    model = tiny_model(6)
    temperature = 0.7
    engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=4, seed=3,
                         sampling=SamplingParams(max_new_tokens=9, temperature=temperature))
    reqs = [Request(i, p) for i, p in enumerate(prompts(6, seed=6))]
    for r, c in zip(reqs, engine.generate(reqs)):
        ref = full_logprobs(model, r.prompt_ids, c.output_ids, temperature)
        assert max(abs(a - b) for a, b in zip(c.logprobs, ref)) < 1e-4
        assert all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs)
    greedy = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD,
                         sampling=SamplingParams(max_new_tokens=4, temperature=temperature, greedy=True))
    (g,) = greedy.generate([reqs[0]])
    ref = full_logprobs(model, reqs[0].prompt_ids, g.output_ids, temperature)
    assert max(abs(a - b) for a, b in zip(g.logprobs, ref)) < 1e-4


def test_cache_does_not_grow_without_bound():
    """Long-lived engine: cache length stays bounded by the longest live sequence."""
    model = tiny_model(7)
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=PAD, max_batch_size=2,
                         sampling=SamplingParams(max_new_tokens=3, greedy=True))
    for i, p in enumerate(prompts(12, seed=7, lo=2, hi=4)):
        engine.submit(Request(i, p))
    while engine.num_running() or engine.num_waiting():
        engine.poll()
        if engine.num_running():
            cache_len = engine._cache.layers[0].keys.shape[-2]
            assert cache_len <= 4 + 3


def test_batched_admission_gives_the_same_outputs_with_fewer_prefills():
    """min_admit only changes when rows enter the batch: greedy outputs stay the same, prefills drop."""
    model = tiny_model(5)
    reqs = [Request(i, p, max_new_tokens=2 + i % 5) for i, p in enumerate(prompts(16, seed=9))]

    def run(min_admit: int) -> tuple[list, int]:
        engine = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=4, min_admit=min_admit,
                             sampling=SamplingParams(max_new_tokens=8, greedy=True))
        for r in reqs:
            engine.submit(r)
        done = []
        while engine.num_running() or engine.num_waiting():
            running, waiting = engine.num_running(), engine.num_waiting()
            done += engine.poll()
            admitted = waiting - engine.num_waiting()
            if running and admitted:  # rows only join a running batch a worthwhile number at a time
                assert admitted >= min(min_admit, waiting)
        return sorted((c.id, c.output_ids, [round(x, 4) for x in c.logprobs]) for c in done), \
            engine.stats["prefill_calls"]

    one, calls_one = run(1)
    three, calls_three = run(3)
    assert one == three and len(one) == 16
    assert calls_three < calls_one
    with pytest.raises(ValueError, match="^min_admit: must be in"):
        TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=4, min_admit=5)


def test_keep_cache_on_update_samples_new_weights_over_the_old_cache():
    """kv_on_update=keep: no rebuild prefill; the next token comes from the new weights reading the
    keys/values the old weights computed, and its logprob is exactly that distribution's."""
    model_a, model_b = tiny_model(3), tiny_model(4)
    state_b = {k: v.clone() for k, v in model_b.state_dict().items() if k != "lm_head.weight"}
    p, k = prompts(1, seed=3, lo=5, hi=5)[0], 3
    engine = TorchEngine(tiny_model(3), eos_token_id=-1, pad_token_id=PAD, keep_cache_on_update=True,
                         sampling=SamplingParams(max_new_tokens=6, greedy=True))
    engine.submit(Request(0, p))
    for _ in range(k):
        assert engine.poll() == []
    calls = engine.stats["prefill_calls"]
    engine.update_weights(WeightVersion(1, state=state_b))
    assert engine.stats["prefill_calls"] == calls and engine.stats["rebuild_prefill_s"] == 0.0
    comps = []
    while engine.num_running():
        comps += engine.poll()
    (c,) = comps
    assert c.versions == [0] * k + [1] * (6 - k)
    context = p + c.output_ids[:k]
    cache = DynamicCache(config=model_a.config)
    with torch.no_grad():
        model_a(input_ids=torch.tensor([context[:-1]]), past_key_values=cache, use_cache=True)
        out = model_b(input_ids=torch.tensor([context[-1:]]), position_ids=torch.tensor([[len(context) - 1]]),
                      past_key_values=cache, use_cache=True)
    logp = torch.log_softmax(out.logits[0, -1], dim=-1)
    assert c.output_ids[k] == int(logp.argmax())
    assert abs(c.logprobs[k] - float(logp[c.output_ids[k]])) < 1e-4
    rebuilt = full_logprobs(model_b, context, c.output_ids[k:k + 1])[0]
    assert abs(rebuilt - c.logprobs[k]) > 1e-3  # the kept cache really is the old one (guard)


def test_a_prompt_group_is_prefilled_once_and_matches_separate_prefills():
    """8 samples of one prompt: one row of prefill work, the same sampled outputs as distinct prompts give."""
    model = tiny_model(8)
    p = prompts(1, seed=8, lo=6, hi=6)[0]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    shared = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=8, seed=1, sampling=sampling)
    outs = shared.generate([Request(i, list(p)) for i in range(8)])
    assert shared.stats["prefill_tokens"] == len(p) - 1  # one context computed, copied to 8 rows
    # the same rows with the prefix shared disabled (each row prefilled): identical tokens and logprobs
    separate = TorchEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_batch_size=8, seed=1, sampling=sampling)
    separate._prefill_shared = separate._prefill
    ref = separate.generate([Request(i, list(p)) for i in range(8)])
    assert [c.output_ids for c in outs] == [c.output_ids for c in ref]
    assert max(abs(a - b) for c, d in zip(outs, ref) for a, b in zip(c.logprobs, d.logprobs)) < 1e-5
    assert len({tuple(c.output_ids) for c in outs}) > 1  # sampled rows diverge: the copies are independent
