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

:func:`forward_only` runs the passes without gradients (proximal and
reference logprobs, the critic's values) the same way: each stage goes on
to the next micro-batch as soon as it has sent one on.

Hidden states travel to the next stage and their gradients back point to
point, paired as megatron-core's schedules pair them (:class:`_Neighbours`):
in the steady state a stage sends its output on together with receiving
the gradient it waits for, and sends a gradient back together with
receiving its next input, so that two neighbours sending to each other at
once never wait on each other (NCCL's sends wait for their receives).
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
import torch.distributed as dist

from hpcrl.trainer.mcore import model as M

__all__ = ["forward_only", "one_forward_one_backward"]


def one_forward_one_backward(model, layout: M.Layout, inputs: list[torch.Tensor],
                             loss_of: Callable[[int, torch.Tensor], torch.Tensor]) -> list[tuple[str, int]]:
    """The forward and backward passes of micro-batches ``inputs`` (token ids ``[batch, seq]``) through this
    rank's stage of ``model``; on the last stage ``loss_of(i, logits)`` is micro-batch ``i``'s loss (called
    there only). Gradients accumulate into the parameters' ``.grad``. Returns the passes in the order this
    stage ran them: ``("F", i)``, ``("B", i)``."""
    p2p = _Neighbours(model, layout, inputs)
    order: list[tuple[str, int]] = []
    in_flight: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()  # (i, input, output or loss)

    def forward(i: int, received: torch.Tensor | None) -> torch.Tensor:
        order.append(("F", i))
        if received is not None:
            received.requires_grad_(True)
        out = M.run_stage(model, inputs[i], received)
        if layout.last_stage:
            out = loss_of(i, out)
        in_flight.append((i, received, out))
        return out

    def backward(grad: torch.Tensor | None) -> torch.Tensor | None:
        """The oldest micro-batch's backward pass from the gradient of its output (None: its loss); the gradient
        of its input, for the previous stage."""
        i, received, out = in_flight.popleft()
        order.append(("B", i))
        out.backward(grad)
        if received is not None and received.grad is None:  # the previous stage would wait for it forever
            raise RuntimeError(f"pipeline stage {layout.stage}: micro-batch {i}'s input got no gradient")
        return None if received is None else received.grad

    n, warmup = len(inputs), min(layout.pp - layout.stage - 1, len(inputs))
    for i in range(warmup):
        p2p.send_forward(forward(i, p2p.recv_forward(i)))
    received = p2p.recv_forward(warmup) if warmup < n else None
    for i in range(warmup, n):
        out = forward(i, received)
        grad = p2p.send_forward_recv_backward(out, in_flight[0][0])
        grad_in = backward(grad)
        if i == n - 1:
            p2p.send_backward(grad_in)
        else:
            received = p2p.send_backward_recv_forward(grad_in, i + 1)
    while in_flight:
        p2p.send_backward(backward(p2p.recv_backward(in_flight[0][0])))
    return order


class _Neighbours:
    """The point-to-point transfers of one stage with the previous and the next one, as megatron-core's
    schedules pair them: a send and a receive with the same neighbour go out together
    (``batch_isend_irecv``), which two stages sending to each other at once need on NCCL, where a lone send
    waits for its receive; each call returns once its transfers are done. The first stage has no previous
    neighbour and the last no next one: those calls do nothing there (None where a tensor would come)."""

    def __init__(self, model, layout: M.Layout, inputs: list[torch.Tensor]) -> None:
        from megatron.core import parallel_state as ps

        self.prev = None if layout.first_stage else ps.get_pipeline_model_parallel_prev_rank()
        self.next = None if layout.last_stage else ps.get_pipeline_model_parallel_next_rank()
        self.group = ps.get_pipeline_model_parallel_group()
        self.shapes = [M.hidden_shape(model, ids) for ids in inputs]
        self.dtype, self.device = model.config.params_dtype, M.device_of(model)

    def _run(self, send: tuple[torch.Tensor, int | None] | None, recv: tuple[int, int | None] | None
             ) -> torch.Tensor | None:
        ops, got = [], None
        if send is not None and send[1] is not None:
            ops.append(dist.P2POp(dist.isend, send[0].detach().contiguous(), send[1], group=self.group))
        if recv is not None and recv[1] is not None:
            got = torch.empty(self.shapes[recv[0]], dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got, recv[1], group=self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return got

    def recv_forward(self, i: int) -> torch.Tensor | None:
        return self._run(None, (i, self.prev))

    def send_forward(self, out: torch.Tensor) -> None:
        self._run((out, self.next), None)

    def send_forward_recv_backward(self, out: torch.Tensor, i: int) -> torch.Tensor | None:
        """Send ``out`` on and receive the gradient of micro-batch ``i``'s output."""
        return self._run((out, self.next), (i, self.next))

    def send_backward_recv_forward(self, grad: torch.Tensor | None, i: int) -> torch.Tensor | None:
        """Send ``grad`` back and receive micro-batch ``i``'s input."""
        return self._run((grad, self.prev) if grad is not None else None, (i, self.prev))

    def recv_backward(self, i: int) -> torch.Tensor | None:
        return self._run(None, (i, self.next))

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self._run((grad, self.prev), None)


def forward_only(model, layout: M.Layout, inputs: list[torch.Tensor],
                 compute: Callable[[int, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Forward passes of micro-batches ``inputs`` without gradients, the stages computing at the same time (a
    stage sends each micro-batch's hidden states on without waiting and goes on to the next); on the last
    stage ``compute(i, logits)`` of each, in order ([] on the others)."""
    sends: list[dist.Work] = []
    results = []
    with torch.no_grad():
        for i, ids in enumerate(inputs):
            out = M.stage_forward(model, ids, layout, sends)
            if layout.last_stage:
                results.append(compute(i, out))
            while len(sends) > 1:  # the send before this one has arrived by now, or soon: at most two held
                sends.pop(0).wait()
    for work in sends:
        work.wait()
    return results
