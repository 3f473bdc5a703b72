"""Rollout: inference engines and the rollout loop (design.md §3.3).

``engine`` defines the boundary (``InferenceEngine``, ``Request``,
``Completion``, ``SamplingParams``); ``engines.build_engine`` builds the one
``rollout.engine`` names: ``torch_engine.TorchEngine`` (embedded continuous
batching) or ``remote_engine.RemoteEngine`` over a vLLM or SGLang server
(``vllm_engine``, ``sglang_engine``; ``server`` starts and stops it).
``worker.RolloutWorker`` is the loop; ``main`` the component's entry point.
"""
