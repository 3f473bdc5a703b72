"""The embedded torch inference engine: continuous batching over a HF model.

Lifecycle of a sequence: ``submit`` queues it; the next ``poll`` admits it
into a free slot of the running batch; each ``poll`` then decodes one token
for it (one decode step for the whole batch) until it emits eos ("stop") or
reaches its max_new_tokens ("length"); the poll that finishes it returns its
Completion and frees the slot for the next poll's admission.

State invariant, kept by every operation: each running sequence has one
*pending* token (the last token of prompt + output) that is not yet in the KV
cache; everything before it is. The cache is left-padded: row i's real
tokens are its last ``n_i = len(prompt) + len(output) - 1`` columns, so the
attention mask and position ids are derived from ``n_i`` with no device sync.

- admission prefills the new rows' ``tokens[:-1]`` as their own left-padded
  batch and concatenates that cache with the running one (left-padding the
  shorter); the decode step then feeds every row's pending token.
- a finished row is dropped with ``index_select`` and leading columns that
  are padding for every row are cut, so the cache does not grow without bound.
- ``update_weights`` loads the new weights and rebuilds the whole cache by
  the same prefill of ``tokens[:-1]`` (the old cache is wrong under new
  weights); the pending token stays the next input, so no token is lost or
  recomputed, and tokens sampled afterwards carry the new version. With
  ``keep_cache_on_update`` the old cache is kept instead (PipelineRL's
  in-flight update): no prefill, and later tokens are sampled by the new
  weights over keys/values the old ones computed. Their logprobs are still
  exactly the probabilities they were sampled with, which is what the
  decoupled PPO correction needs; they just no longer equal a fresh
  new-weight model's.

Admission is batched: waiting requests enter only when ``min_admit`` slots
are free (or all of them fit, or nothing runs), so each prefill forward
serves several rows instead of one or two per decode step. Rows with the
same context (the samples of one prompt group) are prefilled once and the
cache row is copied. ``stats`` keeps
the time spent in prefill for admission, cache rebuilds and decode steps,
and ``decode_by_rows``: the decode steps by their rows (bins of 8, the key
each bin's top), each bin's steps, rows, seconds and padded context tokens
(rows times the longest, pending tokens counted) summed: what a decode step costs
in the running loop against what it holds, for the pipeline simulator's
check (``scripts/sim_calibrate.py``). Fixed in size however long the run.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Hashable, Mapping

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hpcrl.model.limits import ModelLimits
from hpcrl.rollout.engine import Completion, Request, SamplingParams
from hpcrl.weights.version import WeightVersion

logger = logging.getLogger(__name__)


@dataclass
class _Seq:
    """A running sequence and what it has produced so far."""

    request: Request
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def cached_len(self) -> int:
        """Tokens of this row in the KV cache (all but the pending one)."""
        return len(self.request.prompt_ids) + len(self.output_ids) - 1

    def pending(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.request.prompt_ids[-1]

    def completion(self, reason: str) -> Completion:
        r = self.request
        return Completion(r.id, list(r.prompt_ids), self.output_ids, self.logprobs, self.versions, reason)


def _cache_len(cache: DynamicCache | None) -> int:
    return 0 if cache is None else cache.layers[0].keys.shape[-2]


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim -2 (sequence) of a [B, H, S, D] tensor on the left to `length`."""
    missing = length - t.shape[-2]
    if missing == 0:
        return t
    pad = t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3])
    return torch.cat([pad, t], dim=-2)


class TorchEngine:
    """Continuous-batching engine over a ``transformers`` causal LM (see module docstring)."""

    def __init__(
        self,
        model: transformers.PreTrainedModel,
        *,
        eos_token_id: int,
        pad_token_id: int,
        max_batch_size: int = 64,
        sampling: SamplingParams = SamplingParams(),
        version: int = 0,
        seed: int = 0,
        min_admit: int = 1,
        keep_cache_on_update: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be >= 1, got {max_batch_size}")
        if not 1 <= min_admit <= max_batch_size:
            raise ValueError(f"min_admit: must be in [1, max_batch_size={max_batch_size}], got {min_admit}")
        self.min_admit, self.keep_cache_on_update = min_admit, keep_cache_on_update
        self.model = model.eval()
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.sampling = sampling
        self._version = version
        self.limits = ModelLimits(vocab_size=model.get_input_embeddings().num_embeddings, context=None)
        self._device = next(model.parameters()).device
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[_Seq] = []
        self._cache: DynamicCache | None = None  # None while no row has a cached token
        self._check_cache_layers()
        self.stats: dict[str, float | dict] = {
            "tokens_generated": 0, "decode_steps": 0, "prefill_tokens": 0, "prefill_calls": 0,
            "weight_updates": 0, "running_sum": 0, "mean_running_batch_size": 0.0,
            "admit_prefill_s": 0.0, "rebuild_prefill_s": 0.0, "decode_s": 0.0,
            # every bin from the start, so that stats averaged over runs count an empty bin as 0
            "decode_by_rows": {str(8 * k): {"steps": 0, "rows": 0, "s": 0.0, "context": 0}
                               for k in range(1, -(-max_batch_size // 8) + 1)},
        }

    def _check_cache_layers(self) -> None:
        layers = DynamicCache(config=self.model.config).layers
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(f"model: only full-attention DynamicLayer caches are supported, got {kinds}")

    # ----------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        return self._version

    def num_in_flight(self) -> int:
        return len(self._running) + len(self._waiting)

    def num_running(self) -> int:
        """Sequences in the running batch."""
        return len(self._running)

    def num_waiting(self) -> int:
        """Requests queued but not yet admitted."""
        return len(self._waiting)

    def submit(self, request: Request) -> None:
        """Queue ``request``; raises :class:`~hpcrl.model.limits.Rejected` (a ValueError) for a token id outside
        the vocabulary, which would otherwise fail the decode step of every running sequence."""
        self.limits.check_ids(request.prompt_ids, f"request {request.id!r}: prompt_ids")
        self._waiting.append(request)

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """One decode step (admitting waiting requests first); never waits."""
        with torch.inference_mode():
            self._admit()
            if not self._running:
                return []
            return self._decode()

    def close(self) -> None:
        """Nothing to release: the model belongs to the caller."""

    def update_weights(self, weights: WeightVersion) -> None:
        self.load_state_dict(weights.tensors(), weights.version)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """``update_weights`` from tensors in hand."""
        self._check_state_dict(state_dict)
        with torch.no_grad():
            self.model.load_state_dict(dict(state_dict), strict=False)
        self._version = version
        self.stats["weight_updates"] += 1
        if self.keep_cache_on_update:
            return
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._cache = self._prefill_shared([s.tokens()[:-1] for s in self._running])
        self.stats["rebuild_prefill_s"] += time.perf_counter() - t0
        logger.debug("weights now version %d; rebuilt the cache of %d running sequences",
                    version, len(self._running))

    def abort_all(self) -> list[Request]:
        """Drop every running and waiting sequence (their tokens are discarded); returns them as
        fresh requests (original prompt, no output) so the caller can resubmit them."""
        aborted = [s.request for s in self._running]
        aborted += list(self._waiting)
        self._running, self._waiting, self._cache = [], collections.deque(), None
        return aborted

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Submit all requests, poll until all are done, return them in request order."""
        if self._running or self._waiting:
            raise RuntimeError("generate() needs an idle engine; drive a busy one with submit()/poll()")
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("requests: ids must be unique")
        for r in requests:
            self.submit(r)
        done: dict[Hashable, Completion] = {}
        while self._running or self._waiting:
            for c in self.poll():
                done[c.id] = c
        return [done[i] for i in ids]

    # ----------------------------------------------------------------- weights

    def _check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Reject unknown keys and missing parameters (a tied alias given counts)."""
        own = set(self.model.state_dict().keys())
        unexpected = sorted(set(state_dict) - own)
        if unexpected:
            raise ValueError(f"state_dict: unexpected keys {unexpected[:5]} (of {len(unexpected)})")
        aliases: dict[int, list[str]] = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        missing = [names[0] for names in aliases.values() if not any(n in state_dict for n in names)]
        if missing:
            raise ValueError(f"state_dict: missing parameters {missing[:5]} (of {len(missing)})")

    # ----------------------------------------------------------------- batching

    def _admit(self) -> None:
        free = self.max_batch_size - len(self._running)
        if not self._waiting or (self._running and free < min(self.min_admit, len(self._waiting))):
            return  # wait until a worthwhile number of slots is free: one larger prefill, not many tiny ones
        t0 = time.perf_counter()
        new: list[_Seq] = []
        while self._waiting and len(self._running) + len(new) < self.max_batch_size:
            r = self._waiting.popleft()
            limit = r.max_new_tokens if r.max_new_tokens is not None else self.sampling.max_new_tokens
            new.append(_Seq(r, limit))
        if not new:
            return
        part = self._prefill_shared([s.tokens()[:-1] for s in new])
        self._cache = self._merge(self._cache, len(self._running), part, len(new))
        self._running.extend(new)
        self.stats["admit_prefill_s"] += time.perf_counter() - t0

    def _prefill(self, contexts: list[list[int]]) -> DynamicCache | None:
        """KV cache of left-padded `contexts`; None when all are empty."""
        length = max((len(c) for c in contexts), default=0)
        if length == 0:
            return None
        ids = [[self.pad_token_id] * (length - len(c)) + c for c in contexts]
        mask = [[0] * (length - len(c)) + [1] * len(c) for c in contexts]
        input_ids = torch.tensor(ids, device=self._device)
        attention_mask = torch.tensor(mask, device=self._device)
        position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.stats["prefill_tokens"] += sum(len(c) for c in contexts)
        self.stats["prefill_calls"] += 1
        return cache

    def _prefill_shared(self, contexts: list[list[int]]) -> DynamicCache | None:
        """``_prefill`` computing each distinct context once, its cache row copied to every row that has it."""
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(c), len(distinct)) for c in contexts]
        if len(distinct) == len(contexts):
            return self._prefill(contexts)
        cache = self._prefill([list(c) for c in distinct])
        if cache is not None:
            idx = torch.tensor(rows, device=self._device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)
        return cache

    def _merge(self, a: DynamicCache | None, rows_a: int,
               b: DynamicCache | None, rows_b: int) -> DynamicCache | None:
        """Concatenate two left-padded caches along the batch (rows of `a` first)."""
        if a is None and b is None:
            return None
        if rows_a == 0:
            return b
        length = max(_cache_len(a), _cache_len(b))
        ref = (a if a is not None else b).layers
        merged = DynamicCache(config=self.model.config)
        for i, layer in enumerate(merged.layers):
            parts = []
            for cache, rows in ((a, rows_a), (b, rows_b)):
                k, v = ref[i].keys, ref[i].values
                if cache is None:
                    shape = (rows, k.shape[1], length, k.shape[3])
                    parts.append((k.new_zeros(shape), v.new_zeros(shape)))
                else:
                    lay = cache.layers[i]
                    parts.append((_left_pad(lay.keys, length), _left_pad(lay.values, length)))
            keys = torch.cat([p[0] for p in parts])
            values = torch.cat([p[1] for p in parts])
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        return merged

    # ----------------------------------------------------------------- decoding

    def _decode(self) -> list[Completion]:
        rows = len(self._running)
        context = rows * (_cache_len(self._cache) + 1)  # every row as long as the longest, its pending token too
        t0 = time.perf_counter()
        try:
            return self._decode_step()
        finally:
            took = time.perf_counter() - t0
            self.stats["decode_s"] += took
            shape = self.stats["decode_by_rows"][str(-(-rows // 8) * 8)]
            shape["steps"] += 1
            shape["rows"] += rows
            shape["s"] += took
            shape["context"] += context

    def _decode_step(self) -> list[Completion]:
        seqs = self._running
        length = _cache_len(self._cache)
        lengths = [s.cached_len() for s in seqs]
        cached = torch.tensor(lengths, device=self._device)
        attention_mask = self._decode_mask(cached, length, padded=min(lengths) < length)
        input_ids = torch.tensor([[s.pending()] for s in seqs], device=self._device)
        cache = self._cache if self._cache is not None else DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=cached[:, None], past_key_values=cache, use_cache=True)
        self._cache = cache
        tokens, logprobs = self._sample(out.logits[:, -1, :])
        self._record_step(len(seqs))
        finished: list[Completion] = []
        keep: list[int] = []
        for i, (s, tok, lp) in enumerate(zip(seqs, tokens, logprobs)):
            s.output_ids.append(tok)
            s.logprobs.append(lp)
            s.versions.append(self._version)
            if tok == self.eos_token_id and not self.sampling.ignore_eos:
                finished.append(s.completion("stop"))
            elif len(s.output_ids) >= s.max_new_tokens:
                finished.append(s.completion("length"))
            else:
                keep.append(i)
        if finished:
            self._drop_finished(keep)
        return finished

    def _decode_mask(self, cached: torch.Tensor, length: int, padded: bool) -> torch.Tensor | None:
        """The attention mask of a decode step, over the ``length`` cached columns and the pending one: row i's
        real columns are its last ``cached_i`` plus the pending column. Made here in the form the model's
        attention takes (None without padding; a 4-D mask for sdpa and eager attention), because the model's own
        conversion of a 2-D mask costs more host time than the step's kernels on a GPU (measured on an H100 with
        a 0.6B model: 48 ms a token with a 2-D mask, 20 without, docs/gpu.md)."""
        if not padded:  # one query attending to every column: no mask at all
            return None
        cols = torch.arange(length + 1, device=self._device)
        keep = cols[None, :] >= (length - cached)[:, None]  # [B, T+1]
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl == "sdpa":
            return keep[:, None, None, :]  # bool, True = attend
        if impl == "eager":
            dtype = next(self.model.parameters()).dtype
            return torch.zeros(keep.shape, dtype=dtype, device=self._device).masked_fill_(
                ~keep, torch.finfo(dtype).min)[:, None, None, :]
        return keep.long()  # other kernels (flash attention) take the 2-D padding mask

    def _sample(self, logits: torch.Tensor) -> tuple[list[int], list[float]]:
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        logp = torch.log_softmax(logits / self.sampling.temperature, dim=-1)
        if self.sampling.greedy:
            tok = logp.argmax(dim=-1)
        else:
            tok = torch.multinomial(logp.exp(), 1, generator=self._generator).squeeze(1)
        lp = logp.gather(1, tok[:, None]).squeeze(1)
        return tok.tolist(), lp.tolist()

    def _record_step(self, batch: int) -> None:
        st = self.stats
        st["decode_steps"] += 1
        st["tokens_generated"] += batch
        st["running_sum"] += batch
        st["mean_running_batch_size"] = st["running_sum"] / st["decode_steps"]

    def _drop_finished(self, keep: list[int]) -> None:
        """Remove finished rows and cut leading columns that are padding for every row."""
        self._running = [self._running[i] for i in keep]
        if not keep or self._cache is None:
            self._cache = None
            return
        longest = max(s.cached_len() for s in self._running)
        start = _cache_len(self._cache) - longest
        idx = torch.tensor(keep, device=self._device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, idx)[:, :, start:, :]
            layer.values = layer.values.index_select(0, idx)[:, :, start:, :]
