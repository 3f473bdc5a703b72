"""Rollout: inference engines and the rollout loop (DESIGN 3.3).

``engine`` defines the boundary (``InferenceEngine``, ``Request``,
``Completion``, ``SamplingParams``); ``torch_engine.TorchEngine`` is the
embedded continuous-batching implementation.
"""
