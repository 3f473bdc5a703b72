"""Cost models for GPU clusters nobody here can measure, from published numbers.

The simulator's :class:`~hpcrl.sim.model.Costs` for one rollout replica on
its own GPU(s) and a trainer on ``train_gpus`` GPUs, derived from the
hardware's peak numbers and the model's shape by a roofline, with the
efficiency of each side taken from a published measurement:

* a decode step over ``n`` rows holding ``C`` context tokens reads the
  weights once and every row's KV cache, and computes ``2 P`` FLOPs per
  row: ``(2 P + C * kv_bytes) / (bandwidth * bw_efficiency) + n * 2 P /
  (flops * mfu)`` plus a fixed per-step overhead (kernel launches,
  scheduling), taken from a published batch-1 decode speed
  (:func:`step_overhead_s`);
* a prefill computes ``2 P`` FLOPs per token;
* a training step computes, per trained token, a forward for the proximal
  log-probabilities and a forward + backward for the update (``8 P``) plus
  attention (``16 * layers * hidden * s`` for a mean attended length
  ``s``), at the achieved FLOP/s of the training engine.

Every constant names its source (docs/performance.md, "Predictions for GPU
clusters"); what no source gives is a parameter of :func:`gpu_costs` with
the value used stated where it is used. Lifecycle: pure functions, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcrl.sim.model import Costs


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense BF16 tensor FLOP/s
    bandwidth: float  # HBM bytes/s
    memory: float  # HBM bytes
    source: str


# H800 SXM: the H100 SXM5's GH100 die, 80 GB HBM3, NVLink cut to 400 GB/s (the one difference): 989.4 dense BF16
# TFLOP/s, 3.35 TB/s (H100 SXM5 figures, NVIDIA H100 white paper as tabulated at glennklockwood.com/garden/processors/
# h100); AReaL's experiments ran on H800 (arXiv 2505.24298, section 6.1)
H800 = Hardware("H800 SXM", 989.4e12, 3.35e12, 80e9, "NVIDIA H100 SXM5 peak figures; AReaL section 6.1")


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    source: str
    # one sequence decoding alone: tokens/s on an A100 80GB with vLLM 0.6.3, BF16, input of 1 token, 2,048 new
    # (Qwen2.5 speed benchmark, QwenLM/Qwen2.5 docs/source/benchmark/speed_benchmark.rst; the Qwen2.5 base of each)
    batch1_tokens_per_s: float = 0.0

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value, every layer, 2 bytes each (bf16/fp16 cache)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


# the models of AReaL's Table 1 (config.json of each on the Hugging Face hub; Qwen2 architecture)
R1_DISTILL_QWEN_1_5B = ModelShape("DeepSeek-R1-Distill-Qwen-1.5B", 1.78e9, 28, 1536, 2, 128,
                                  "huggingface.co/deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B config.json", 183.33)
R1_DISTILL_QWEN_7B = ModelShape("DeepSeek-R1-Distill-Qwen-7B", 7.62e9, 28, 3584, 4, 128,
                                "huggingface.co/deepseek-ai/DeepSeek-R1-Distill-Qwen-7B config.json", 84.28)
A100_BANDWIDTH = 2.039e12  # A100 80GB SXM HBM2e bytes/s (NVIDIA A100 datasheet)


def step_overhead_s(model: ModelShape) -> float:
    """A decode step's fixed cost (launches, scheduling, sampling): a batch-1 step's published time less reading
    the weights once at the A100's full bandwidth (an upper bound on the step's memory time, so a lower bound on
    the overhead)."""
    if model.batch1_tokens_per_s <= 0:
        raise ValueError(f"{model.name}: no published batch-1 decode speed to take the step overhead from")
    return max(0.0, 1.0 / model.batch1_tokens_per_s - 2 * model.params / A100_BANDWIDTH)


def gpu_costs(model: ModelShape, hw: Hardware, train_gpus: int, mean_sequence: float, *,
              train_flops_per_gpu: float, decode_bw_efficiency: float = 0.6, decode_mfu: float = 0.3,
              decode_step_overhead_s: float | None = None, weights_broadcast_s: float = 0.5,
              train_step_overhead_s: float = 1.0) -> Costs:
    """Costs of one replica (one GPU) and of a trainer on ``train_gpus`` GPUs, for sequences of ``mean_sequence``
    tokens on average (prompt + response: the attention term of training). ``train_flops_per_gpu``: achieved
    FLOP/s of the training engine per GPU (a published figure; see the module docstring)."""
    if min(train_gpus, mean_sequence, train_flops_per_gpu) <= 0:
        raise ValueError("train_gpus, mean_sequence and train_flops_per_gpu must be > 0")
    if not 0 < decode_bw_efficiency <= 1 or not 0 < decode_mfu <= 1:
        raise ValueError("decode_bw_efficiency and decode_mfu are fractions of the peak: in (0, 1]")
    bw, p = hw.bandwidth * decode_bw_efficiency, model.params
    if decode_step_overhead_s is None:
        decode_step_overhead_s = step_overhead_s(model)
    attention = 16 * model.layers * model.hidden * (mean_sequence / 2)  # causal: half the sequence on average
    return Costs(
        decode_s=decode_step_overhead_s + 2 * p / bw,  # the weights, read once a step
        decode_per_row_s=2 * p / (hw.flops * decode_mfu),
        decode_per_context_token_s=model.kv_bytes_per_token / bw,
        prefill_s=decode_step_overhead_s, prefill_per_token_s=2 * p / (hw.flops * decode_mfu),
        weights_load_s=weights_broadcast_s, weights_poll_s=0.0,
        train_step_s=train_step_overhead_s,
        train_per_token_s=(8 * p + attention) / (train_gpus * train_flops_per_gpu),
        spool_per_group_s=0.0, publish_s=weights_broadcast_s, colocated_publish_s=weights_broadcast_s)


def kv_rows(model: ModelShape, hw: Hardware, mean_context: float, usable: float = 0.85) -> int:
    """Rows one GPU's engine holds at once: the KV cache left after the weights (``usable`` of the memory: the
    engine's static fraction, e.g. SGLang's mem_fraction_static) over one row's cache at ``mean_context``."""
    free = hw.memory * usable - 2 * model.params
    return max(1, int(free / (model.kv_bytes_per_token * mean_context)))
