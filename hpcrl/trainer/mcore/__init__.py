"""The Megatron-core train engine (``trainer.engine: megatron``), in parts.

- :mod:`hpcrl.trainer.mcore.cpu`: the one place that lets megatron-core run
  on a machine without CUDA (applied only there);
- :mod:`hpcrl.trainer.mcore.convert`: the model config and the weights
  between HuggingFace Qwen3/Llama checkpoints and megatron-core's GPTModel,
  split across tensor- and pipeline-parallel ranks and merged back.

megatron-core is imported only by these modules, so nothing else in hpcrl
needs it installed.
"""
