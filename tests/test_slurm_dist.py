"""Rank bootstrap without torchrun: 2 ranks started by ``srun --mpi=pmix`` or ``mpirun`` form a gloo group.

Each rank runs tests/rank_probe.py, which calls ``init_from_env`` (rank,
world size and rendezvous from Slurm's environment or from MPI via mpi4py)
and all-reduces its rank + 1: both must report the sum 3 and their own,
distinct ranks.
"""

from __future__ import annotations

import json
import sys
import shutil
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import ROOT, cluster_skip_reason, job_env

pytestmark = pytest.mark.slurm
PROBE = str(Path(__file__).parent / "rank_probe.py")


def json_objects(text: str) -> list[dict]:
    """Every JSON object in ``text``: mpirun forwards each rank's output in chunks of its own choosing, so
    two ranks' lines can arrive glued together (``{...}{...}``) or split."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i >= 0:
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            end = i + 1
        else:
            found.append(obj)
        i = text.find("{", end)
    return found


def check_two_ranks(proc: subprocess.CompletedProcess, source: str) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = sorted(json_objects(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1], proc.stdout
    for r in reports:
        assert (r["world"], r["sum"], r["backend"], r["source"]) == (2, 3.0, "gloo", source)


@pytest.mark.skipif(cluster_skip_reason() is not None, reason=cluster_skip_reason() or "")
def test_srun_pmix_two_ranks_on_two_nodes_form_a_gloo_group() -> None:
    proc = subprocess.run(["srun", "--mpi=pmix", "-N2", "-n2", "--time=5", sys.executable, PROBE],
                          capture_output=True, text=True, timeout=120, env=job_env(), cwd=ROOT)
    check_two_ranks(proc, "slurm")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found (scripts/slurm_cluster.sh installs Open MPI)")
def test_mpirun_two_ranks_bootstrap_through_mpi4py() -> None:
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install -e '.[test]')")
    env = {k: v for k, v in job_env().items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["OMPI_MCA_btl"] = "self,tcp"
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, PROBE],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    check_two_ranks(proc, "mpi")
