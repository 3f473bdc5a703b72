"""The run directory's filesystem: atomic publication (:mod:`hpcrl.fs.atomic`) and storage faults
(:mod:`hpcrl.fs.faults`). It imports nothing else of hpcrl, so every part, the configuration layer
included, may use it."""
