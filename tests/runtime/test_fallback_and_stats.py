"""CPU fallback for ops the device lacks, and the statistics contract."""
import json
import os
import subprocess
import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager_device.core.config import CONFIG
from conftest import assert_same

CONTRACT_KEYS = {
    "mode", "ops_recorded", "kernels_launched", "fused_kernels", "ops_fused", "flushes",
    "patterns", "kernel_cache", "plan_cache", "fallback_ops", "bytes_moved", "bytes_saved",
    "device_time_us", "errors",
}


def test_op_without_meta_kernel_falls_back_and_is_counted(any_mode):
    x = torch.randn(20)
    result = torch.histc(x.to("neuron"), bins=5)  # data-dependent on the CPU, runs there
    assert_same(result, torch.histc(x, bins=5))
    a = torch.randn(4, 3)
    q, tau = torch.geqrf(a.to("neuron"))  # no meta kernel
    expected_q, expected_tau = torch.geqrf(a)
    assert_same(q, expected_q)
    assert adaptive_eager.stats()["fallback_ops"] == {"aten::geqrf": 1}


def test_fallback_can_be_forbidden(any_mode):
    CONFIG.fallback = False
    with pytest.raises(NotImplementedError, match="aten::geqrf is not supported on the neuron device.*NEURON_FALLBACK=0"):
        torch.geqrf(torch.randn(4, 3, device="neuron"))


def test_data_dependent_ops_sync_and_match(any_mode):
    x = torch.tensor([0.0, 1.5, 0.0, -2.0])
    d = x.to("neuron")
    assert_same(d.nonzero(), x.nonzero())
    assert_same(d[d != 0], x[x != 0])
    assert_same(torch.unique(d), torch.unique(x))
    stats = adaptive_eager.stats()
    assert any(reason.startswith("data_dependent") for reason in stats["sync_points"])


def test_a_gather_with_integer_indices_is_a_kernel_not_a_sync_point(any_mode):
    """``x[idx]`` with integer indices (device, host or negative) has the shape of its
    indices: it queues like any kernel; only a mask's gather must sync. An index out of
    range fails on the queue and surfaces at the next sync point, as a CUDA device assert."""
    x = torch.randn(5, 4)
    d = x.to("neuron")
    rows, cols = torch.tensor([0, 3, -1]), torch.tensor([1, 2, 0])
    gathered = [d[rows.to("neuron")], d[torch.arange(3, device="neuron"), cols.to("neuron")], d[:, cols]]
    adaptive_eager.synchronize()
    adaptive_eager.reset_stats()
    again = d[rows.to("neuron")] * 2
    assert not any(reason.startswith("data_dependent") for reason in adaptive_eager.stats()["sync_points"])
    for result, expected in zip(gathered + [again], [x[rows], x[torch.arange(3), cols], x[:, cols], x[rows] * 2]):
        assert_same(result, expected)
    out_of_range = d[torch.tensor([7], device="neuron")]
    with pytest.raises(adaptive_eager.NeuronRuntimeError, match="(?s)aten::index.*out of bounds"):
        out_of_range.cpu()


def test_strict_statistics_count_exactly(strict_mode):
    x = torch.ones(8, device="neuron")  # empty + fill_: one kernel
    y = (x * 2 + 1).relu()  # three kernels
    v = y.view(2, 4)  # a view: no kernel, not an op
    v.sum().item()  # one kernel, then a host read
    stats = adaptive_eager.stats()
    assert CONTRACT_KEYS <= set(stats)
    assert stats["mode"] == "strict"
    assert stats["ops_recorded"] == 5
    assert stats["kernels_launched"] == 5
    assert stats["fused_kernels"] == 0 and stats["ops_fused"] == 0
    assert stats["view_ops"] == 1
    assert stats["errors"] == {"deferred": 0, "raised": 0}
    # fill_ writes 32 B; mul/add/relu read 32 and write 32 each; sum reads 32, writes 4
    assert stats["bytes_moved"] == 32 + 3 * 64 + 36
    # each kernel: 10 us launch overhead + its VectorE instruction's minimum, MIN_II = 64
    # cycles at 0.96 GHz (its bytes take less at 725 GB/s); reported to 1 ns
    assert stats["device_time_us"] == round(5 * 10.0 + 5 * 64 / 0.96e9 * 1e6, 3)


def test_reset_stats_zeroes_everything(any_mode):
    (torch.ones(3, device="neuron") + 1).cpu()
    adaptive_eager.reset_stats()
    stats = adaptive_eager.stats()
    assert stats["ops_recorded"] == 0 and stats["kernels_launched"] == 0 and stats["bytes_moved"] == 0


def test_stats_file_written_at_exit(tmp_path):
    path = tmp_path / "stats.json"
    code = "import torch; (torch.ones(4, device='neuron') * 3).sum().item()"
    env = dict(os.environ, NEURON_FUSION_STATS=str(path), NEURON_ADAPTIVE_EAGER="0")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    data = json.loads(path.read_text())
    assert CONTRACT_KEYS <= set(data)
    assert data["kernels_launched"] == 3


def test_memory_accounting_follows_tensor_lifetimes(any_mode):
    torch.neuron.synchronize()
    before = torch.neuron.memory_allocated()
    x = torch.empty(1024, device="neuron")  # 4 KiB, rounded to 512 B blocks
    assert torch.neuron.memory_allocated() == before + 4096
    del x
    torch.neuron.synchronize()
    assert torch.neuron.memory_allocated() == before
    torch.neuron.reset_peak_memory_stats()
    y = torch.empty(2048, device="neuron")
    assert torch.neuron.max_memory_allocated() == before + 8192
    del y
