"""The 1F1B pipeline schedule of the megatron engine's training passes (``trainer.megatron.pipeline_parallel``).

Lifecycle: one call of :func:`one_forward_one_backward` per update of a
model (the policy's, then the critic's), on every rank of the pipeline, with
the same micro-batches on the ranks of one model-parallel group.

Stage ``s`` of ``p`` runs ``p - s - 1`` forward passes first (warm-up), then
alternates one forward pass and the backward pass of its oldest micro-batch
in flight, then runs the backward passes left (cool-down); the last stage
runs each micro-batch's backward pass right after its forward pass, where
the loss is computed (``loss_of``). So the stages compute at the same time
(stage ``s`` works on micro-batch ``i`` while stage ``s + 1`` works on
``i - 1``), and a stage keeps the activations of at most ``p - s``
micro-batches for their backward passes, whatever their number. The
gradient each micro-batch's loss puts into the parameters is the same as in
any other order, so the update is the same (sums of float32 gradients in the
order of the micro-batches, as one rank adds them).

Hidden states travel to the next stage and their gradients back with
non-blocking sends (a stage's sends never wait for the receiver, which is
what keeps the schedule free of deadlocks) and blocking receives; the sends
are waited for at the end.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from hpcrl.trainer.mcore import model as M

__all__ = ["one_forward_one_backward"]


def one_forward_one_backward(model, layout: M.Layout, inputs: list[torch.Tensor],
                             loss_of: Callable[[int, torch.Tensor], torch.Tensor]) -> list[tuple[str, int]]:
    """The forward and backward passes of micro-batches ``inputs`` (token ids ``[batch, seq]``) through this
    rank's stage of ``model``; on the last stage ``loss_of(i, logits)`` is micro-batch ``i``'s loss (called
    there only). Gradients accumulate into the parameters' ``.grad``. Returns the passes in the order this
    stage ran them: ``("F", i)``, ``("B", i)``."""
    from megatron.core import parallel_state as ps

    sends: list[dist.Work] = []
    order: list[tuple[str, int]] = []
    in_flight: deque[tuple[int, torch.Tensor]] = deque()  # outputs sent on, waiting for their gradient from the next stage
    next_rank = None if layout.last_stage else ps.get_pipeline_model_parallel_next_rank()

    def forward(i: int) -> None:
        order.append(("F", i))
        out = M.stage_forward(model, inputs[i], layout, sends)
        if layout.last_stage:
            order.append(("B", i))
            loss_of(i, out).backward()
        else:
            in_flight.append((i, out))

    def backward() -> None:
        i, out = in_flight.popleft()
        order.append(("B", i))
        grad = torch.empty_like(out)
        dist.recv(grad, src=next_rank)
        out.backward(grad)

    n, warmup = len(inputs), min(layout.pp - layout.stage - 1, len(inputs))
    for i in range(warmup):
        forward(i)
    for i in range(warmup, n):
        forward(i)
        if in_flight:
            backward()
    while in_flight:
        backward()
    for work in sends:
        work.wait()
    return order
