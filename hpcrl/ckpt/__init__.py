"""The checkpoint directory of a run: layout, atomic commit, verification, retention, rewind
(:mod:`hpcrl.ckpt.store`). What a trainer writes into it and reads back is the trainer's
(:mod:`hpcrl.trainer.checkpoint`), and so is turning one into a HuggingFace model
(:mod:`hpcrl.trainer.export`): this package imports no component, so the light commands use it."""
