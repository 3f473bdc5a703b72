"""The device layer (hpcrl/runtime/device.py): what this CPU machine gets, and the CUDA and Ascend paths
through stand-ins of ``torch.cuda`` and of a ``torch_npu`` package (neither device exists here)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from hpcrl.runtime import device as D
from hpcrl.runtime.dist import pick_device
from hpcrl.weights.collective import pick_backend


def test_this_machine_gets_the_cpu_and_gloo_and_a_requested_accelerator_is_refused_by_its_key() -> None:
    assert D.detect("auto") is D.CPU and pick_device("auto", 0) == (torch.device("cpu"), "gloo")
    assert pick_backend("auto") == ("gloo", torch.device("cpu"))
    with pytest.raises(ValueError, match="trainer.backend: nccl requested but CUDA"):
        pick_device("nccl", 0)
    with pytest.raises(ValueError, match="weights.collective_backend: hccl requested but torch_npu"):
        pick_backend("hccl")
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        D.detect("mpi")


def test_cpu_peak_memory_is_the_peak_resident_set() -> None:
    before = D.CPU.peak_memory_bytes()
    big = torch.ones(512 * 2**20 // 4)  # 512 MiB, touched
    assert D.CPU.peak_memory_bytes() >= before + 256 * 2**20 or before > 1024 * 2**20
    del big
    assert D.of(torch.device("cpu")) is D.CPU and D.of(torch.device("meta")) is D.CPU


def test_visible_devices_come_from_the_variable_slurm_sets(monkeypatch) -> None:
    for var in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    assert D.visible_device_count(3) == 3 and D.visible_device_count() == 0
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    assert D.visible_device_count(1) == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert D.visible_device_count(2) == 0  # an empty list: none visible


def test_cuda_is_chosen_when_torch_sees_it(monkeypatch) -> None:
    selected = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", selected.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**20)
    assert pick_device("auto", 1) == (torch.device("cuda", 1), "nccl") and selected == [1]
    assert pick_backend("auto") == ("nccl", torch.device("cuda", 1))
    assert D.of(torch.device("cuda", 1)).peak_memory_bytes() == 3 * 2**20
    with pytest.raises(ValueError, match="hccl requested"):  # asked for explicitly, HCCL is not CUDA
        pick_device("hccl", 0)


def test_ascend_through_torch_npu_imported_only_when_looked_for(tmp_path) -> None:
    """A stand-in ``torch_npu`` package (what the real one does on import: rename the PrivateUse1 backend
    to ``npu`` and register ``torch.npu``) on the path of a fresh interpreter without CUDA."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import types
        import torch
        torch.utils.rename_privateuse1_backend("npu")
        selected = []
        torch.npu = types.SimpleNamespace(is_available=lambda: True, set_device=selected.append,
                                          current_device=lambda: 5, device_count=lambda: 8,
                                          max_memory_allocated=lambda: 7)
    """))
    check = textwrap.dedent("""
        import sys, os
        import torch
        from hpcrl.runtime import device as D
        from hpcrl.runtime.dist import pick_device
        from hpcrl.weights.collective import pick_backend
        assert "torch_npu" not in sys.modules  # importing hpcrl touches nothing Ascend
        dev, backend = pick_device("auto", 3)
        assert (str(dev), backend) == ("npu:3", "hccl"), (dev, backend)
        import torch_npu
        assert torch_npu.selected == [3]
        assert pick_backend("hccl") == ("hccl", torch.device("npu", 5))
        assert D.NPU.device_count() == 8 and D.of(dev).peak_memory_bytes() == 7
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.pop("ASCEND_RT_VISIBLE_DEVICES", None)
        assert D.visible_device_count() == 8
        print("ok")
    """)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_rollout_device_setting_places_the_embedded_engine(monkeypatch) -> None:
    """``rollout.device`` through the device layer: auto is the CPU here, an accelerator that is not there is
    refused by its key, and with CUDA present (a stand-in of torch.cuda) auto and cuda:N pick it and the memory
    share is set on it."""
    from hpcrl.rollout.config import RolloutConfig

    assert D.place("auto") == D.place("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="rollout.device: cuda:0 asked for, but this process sees 0 cuda"):
        D.place("cuda:0", "rollout.device")
    for bad in ("gpu", "cpu:1", "cuda:x", "auto:0"):
        with pytest.raises(ValueError, match="device: expected auto, cpu, cuda"):
            RolloutConfig(device=bad)
        with pytest.raises(ValueError, match="rollout.device: expected auto, cpu, cuda"):
            D.place(bad, "rollout.device")
    with pytest.raises(ValueError, match="device_memory_fraction: must be in"):
        RolloutConfig(device_memory_fraction=1.0)
    D.limit_memory(torch.device("cpu"), 0.5)  # the CPU: nothing to cap

    capped = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: capped.append((f, d)))
    assert D.place("auto") == torch.device("cuda", 0) and D.place("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cuda:2 asked for, but this process sees 2 cuda"):
        D.place("cuda:2")
    D.limit_memory(torch.device("cuda", 1), 0.3)
    D.limit_memory(torch.device("cuda", 0), 0.0)  # 0: no cap
    assert capped == [(0.3, torch.device("cuda", 1))]
