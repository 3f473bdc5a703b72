"""megatron-core on a machine without CUDA: the smallest redirection that lets it build and train.

megatron-core 0.16 builds a GPTModel on the CPU with
``use_cpu_initialization=True`` and the local (non-Transformer-Engine) layer
spec, but its forward and backward passes still make two kinds of CUDA
calls:

1. ``torch.cuda.current_device()`` as a ``device=`` argument (rotary
   embeddings, a few buffers). :func:`apply` makes it answer ``"cpu"``.
2. The model-parallel RNG tracker (``tensor_parallel.get_cuda_rng_tracker``)
   forks CUDA generator states around dropout and initialisation.
   :class:`CpuRNGStatesTracker` keeps the same named states as CPU generator
   states, so a fork draws from a per-name stream exactly as on a GPU.

Two more are avoided where they are made: the default causal mask built on
``device="cuda"`` when no mask is given (hpcrl always passes one,
:func:`causal_mask`), and the ``.cuda()`` with which a GPTModel whose output
layer is tied to the embedding of another pipeline stage moves that weight
before their first all-reduce (:func:`building`, around the constructor only).

:func:`apply` does nothing for a rank on a GPU, and is idempotent. It is
called by the megatron engine's start-up before megatron-core builds anything,
and by nothing else: no other hpcrl process sees the redirection.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)

_APPLIED = False


def apply(seed: int = 1234, device: torch.device | None = None) -> bool:
    """Redirect megatron-core's CUDA calls to the CPU when this rank trains on the CPU (``device``; None: when
    there is no CUDA); True if it did. A CPU rank on a GPU node (``trainer.backend: gloo``) is redirected too:
    otherwise megatron-core puts its rotary tables on the GPU beside a model on the CPU."""
    global _APPLIED
    on_cpu = device.type == "cpu" if device is not None else not torch.cuda.is_available()
    if not on_cpu:
        return False
    if not _APPLIED:
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
        _APPLIED = True
        log.info("megatron-core on the CPU: torch.cuda.current_device() answers 'cpu', RNG tracker on CPU generators")
    install_rng_tracker(seed)
    return True


def install_rng_tracker(seed: int) -> None:
    """Replace megatron-core's tracker by :class:`CpuRNGStatesTracker`, seeded like
    ``model_parallel_cuda_manual_seed`` seeds the CUDA one (model-parallel stream offset by the TP rank)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * ep_rank + tp_rank + 1)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _tracker_base():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


class CpuRNGStatesTracker(_tracker_base()):  # type: ignore[misc]
    """megatron-core's RNG tracker with CPU generator states in place of CUDA ones."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


@contextlib.contextmanager
def building():
    """While megatron-core constructs a model on a machine without CUDA: ``Tensor.cuda()`` leaves a tensor where
    it is. Restored on exit; nothing changes where CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron-core's attention mask for causal attention: True where a position must not attend."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1).view(1, 1, seq_len,
                                                                                                   seq_len)
