"""The pipeline simulator: what a run of hpcrl would do with given costs, without running it.

:mod:`hpcrl.sim.model` holds the cost model and the workload,
:mod:`hpcrl.sim.pipeline` the discrete-event simulation (its replicas in
:mod:`hpcrl.sim.replica`, their groups and rows in :mod:`hpcrl.sim.rows`), :mod:`hpcrl.sim.fit`
the fit of a cost model to a measured run's time split, :mod:`hpcrl.sim.gpu`
cost models of GPU clusters from published numbers. Light: no torch.
"""

from hpcrl.sim.model import Costs, Result, Workload
from hpcrl.sim.pipeline import Pipeline, simulate
from hpcrl.sim.fit import fit_phases

__all__ = ["Costs", "Pipeline", "Result", "Workload", "fit_phases", "simulate"]
