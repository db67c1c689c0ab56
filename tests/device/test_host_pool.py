"""The device worker's host memory pool (device/csrc/host_pool.cpp): the blocks its kernels
allocate are reused, not mapped and faulted in afresh every step; other threads' CPU
allocations are not the pool's; ``empty_cache`` frees what it holds; it holds no more than
its limit."""
import ast
import subprocess
import sys
import threading

import torch

from adaptive_eager_device import _C

MIB = 1 << 20


def _stats() -> dict:
    torch.neuron.synchronize()
    return _C.host_pool_stats()


def _step(weights, x):
    """A few worker kernels with outputs over the pool's 64 KiB floor (1 MiB each)."""
    y = x
    for weight in weights:
        y = torch.relu(y @ weight) * 0.5 + 1.0
    return y.sum()


def test_a_repeated_step_allocates_nothing_new(strict_mode):
    weights = [torch.randn(512, 512, device="neuron") for _ in range(3)]
    x = torch.randn(512, 512, device="neuron")
    for _ in range(2):  # the blocks a step needs, made once
        _step(weights, x).item()
    before = _stats()
    assert before["installed"]
    for _ in range(3):
        _step(weights, x).item()
    after = _stats()
    assert after["misses"] == before["misses"]
    assert after["hits"] - before["hits"] >= 3 * 3 * 3  # matmul, relu, mul, add per layer


def test_results_are_the_cpus_with_reused_blocks(strict_mode):
    torch.manual_seed(0)
    weights = [torch.randn(256, 256) for _ in range(2)]
    x = torch.randn(256, 256)
    expected = _step(weights, x)
    on_device = [weight.to("neuron") for weight in weights]
    for _ in range(3):  # blocks a step freed hold its old values when the next reuses them
        assert torch.equal(_step(on_device, x.to("neuron")).cpu(), expected)


def test_other_threads_allocate_as_before(strict_mode):
    before = _stats()
    kept = [torch.empty(4 * MIB)]  # the host thread's own CPU tensors

    def elsewhere():
        kept.append(torch.ones(4 * MIB))

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    after = _stats()
    assert (after["hits"], after["misses"], after["in_use_bytes"]) == (
        before["hits"], before["misses"], before["in_use_bytes"])


def test_empty_cache_frees_the_cached_blocks(strict_mode):
    x = torch.randn(1024, 1024, device="neuron")
    (x * 2).sum().item()  # a 4 MiB block, freed to the cache
    assert _stats()["cached_bytes"] >= 4 * MIB
    torch.neuron.empty_cache()
    assert _stats()["cached_bytes"] == 0


_DRIFT = """
import torch
from adaptive_eager_device import _C
MIB = 1 << 20
base = torch.zeros(8 * MIB, device="neuron")  # 32 MiB of floats
for step in range(24):  # 16 MiB, 16.5 MiB, ...: each a miss, each freed to the cache
    (base[: 4 * MIB + step * 128 * 1024] + 1.0).sum().item()
torch.neuron.synchronize()
print(_C.host_pool_stats())
"""


def test_drifting_sizes_do_not_grow_the_cache_past_its_limit():
    """A block too small for the next request (a growing KV cache) stays cached only
    while the cache is under max(256 MiB, the most the pool had in use): a fresh process,
    whose peak is this loop's."""
    done = subprocess.run([sys.executable, "-c", _DRIFT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    stats = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert stats["misses"] >= 24 and stats["hits"] == 0
    assert stats["peak_in_use_bytes"] < 256 * MIB
    assert 0 < stats["cached_bytes"] <= 256 * MIB
    assert stats["releases"] > 0  # the oldest blocks went back to the C library


def test_the_most_recently_freed_block_is_reused_first(strict_mode):
    """Of two cached blocks of one size, the next allocation takes the one freed last (still
    in the CPU's caches), as glibc's bins would: not the oldest."""
    from adaptive_eager_device.memory.tensor import storage_of

    x = torch.randn(512, 512, device="neuron")  # 1 MiB results, over the pool's floor
    (x * 2).sum().item()  # warm: the kernels' blocks exist

    def address(tensor):
        torch.neuron.synchronize()
        return storage_of(tensor).data.data_ptr()

    older, newer = x * 3, x * 4
    first, second = address(older), address(newer)
    del older
    torch.neuron.synchronize()
    del newer  # freed after `older`
    torch.neuron.synchronize()
    again = x * 5
    assert address(again) == second != first


def test_a_waiting_host_releases_what_the_worker_ran(strict_mode):
    """A host waiting at a sync point releases the launches the worker has run every few
    items (executor.cpp: wait_completed), so the bytes only they still held, a step's dead
    intermediates, are reused while the worker runs on, not after the sync: a chain of
    4 MiB results, each dead once the next op is issued, never has them all allocated."""
    from adaptive_eager_device.hardware.execution_queue import QUEUE
    from conftest import _Hold

    expected = torch.randn(MIB)  # 4 MiB
    y = expected.to("neuron")
    torch.neuron.synchronize()
    base = _C.host_pool_stats()["in_use_bytes"]
    gate = threading.Event()
    QUEUE.submit(_Hold(gate))  # the worker runs nothing until every op is issued
    QUEUE.ring()
    ops = 48
    for _ in range(ops):
        y = y * 0.5  # the previous result dies here; its launch holds it until released
        expected = expected * 0.5
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _C.host_pool_stats()["in_use_bytes"] - base)
            done.wait(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threading.Timer(0.1, gate.set).start()
    try:
        torch.neuron.synchronize()
    finally:
        done.set()
        sampler.join()
        gate.set()
    assert 4 * MIB <= peak[0] <= ops // 2 * 4 * MIB  # (released only at the end: all 48 at once)
    assert torch.equal(y.cpu(), expected)
