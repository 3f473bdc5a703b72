"""Inspect the model artifacts a run leaves behind (published weights, model folders).

``python -m ckpt_tools inspect <dir-or-safetensors>`` lists every tensor
(name, dtype, shape, bytes), the totals and the stored metadata (e.g. the
policy version of ``weights/v<N>/``). Distributed checkpoints, verify,
to-hf and prune come with trainer checkpointing.
"""
