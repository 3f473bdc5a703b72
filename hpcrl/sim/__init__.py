"""The pipeline simulator: what a run of hpcrl would do with given costs, without running it.

:mod:`hpcrl.sim.model` holds the cost model and the workload,
:mod:`hpcrl.sim.pipeline` the discrete-event simulation. Light: no torch.
"""

from hpcrl.sim.model import Costs, Result, Workload
from hpcrl.sim.pipeline import Pipeline, simulate

__all__ = ["Costs", "Pipeline", "Result", "Workload", "simulate"]
