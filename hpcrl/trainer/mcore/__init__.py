"""The Megatron-core train engine (``trainer.engine: megatron``), in parts.

- :mod:`hpcrl.trainer.mcore.cpu`: the one place that lets megatron-core run
  on a machine without CUDA (applied only there);
- :mod:`hpcrl.trainer.mcore.convert`: the model config and the weights
  between HuggingFace Qwen3/Llama checkpoints and megatron-core's GPTModel,
  split across tensor- and pipeline-parallel ranks and merged back;
- :mod:`hpcrl.trainer.mcore.model`: the parallel groups, this rank's
  GPTModel, a stage's forward pass, the HF weights gathered for publication;
- :mod:`hpcrl.trainer.mcore.pipeline`: the 1F1B schedule of the training
  passes across pipeline stages (and the overlapped passes without
  gradients);
- :mod:`hpcrl.trainer.mcore.reshard`: a checkpoint of other TP/PP sizes
  resharded onto this rank's as it loads;
- :mod:`hpcrl.trainer.mcore.engine`: the ``TrainEngine`` over them.

megatron-core is imported only by these modules, so nothing else in hpcrl
needs it installed.
"""
