"""Races between the host and the device worker, and between host threads, provoked on
purpose: the interpreter switches threads every microsecond, the device is kept busy by
large kernels, windows flush often, and two Python threads issue ops at once. Every
result must still equal the CPU's.

The adaptive host once read window records after handing them to the worker, which
releases them as it runs them (``AttributeError: 'NoneType' object has no attribute
'args'`` in the pattern checks); two threads issuing into one window or one doorbell
batch could lose ops.
"""
import math
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager

pytestmark = pytest.mark.usefixtures("any_mode")
# the library kernels (gelu, rms_norm) round differently from the chains they replace
LIBRARY_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture
def fast_switching():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


@pytest.fixture
def doorbell_every_launch():
    """The host hands every launch to the worker at once (no doorbell batching), so the
    worker runs a window while the host is still busy with the next."""
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    saved = (QUEUE.batch_items, QUEUE.batch_bytes)
    QUEUE.batch_items, QUEUE.batch_bytes = 1, 1
    yield
    QUEUE.batch_items, QUEUE.batch_bytes = saved


@pytest.fixture
def instant_device(monkeypatch):
    """The worker runs each handed-over window before the host's next instruction: the
    worst case of the race, made deterministic (the host then finds the window's records
    released if it still reads them)."""
    from adaptive_eager_device.hardware.execution_queue import QUEUE

    original = QUEUE.launch_batch

    def launch_and_run(*args, **kwargs):
        original(*args, **kwargs)
        QUEUE.drain()

    monkeypatch.setattr(QUEUE, "launch_batch", launch_and_run)


@pytest.fixture
def small_windows():
    """Windows of a block or two, so flushes interleave with the worker's runs."""
    with adaptive_eager.window_policy(min_ops=24, max_ops=48):
        yield


def _block(x, w, scale):
    """Chains the pattern library matches, written as Hugging Face writes them (softmax,
    tanh GELU, RMSNorm): their constant checks read the window's records at every flush."""
    scores = x @ w
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = e / e.sum(-1, keepdim=True)
    h = 0.5 * probs * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (probs + 0.044715 * torch.pow(probs, 3.0))))
    return scale * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))  # scale: a weight tensor


def _work(device, seed, steps):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 16, generator=g).to(device)
    w = torch.randn(16, 16, generator=g).to(device)
    outs = []
    for step in range(steps):
        x = _block(x, w, torch.full((16,), 1.0 + step / 10).to(device))
        outs.append(x.sum(-1))
    return torch.stack(outs).cpu()


def _busy_device():
    """Large kernels that keep the worker busy while the host flushes."""
    a = torch.randn(384, 384).to("neuron")
    for _ in range(6):
        a = (a @ a).tanh()
    return a


def test_many_windows_with_a_busy_device_and_fast_thread_switching(fast_switching, small_windows,
                                                                  doorbell_every_launch):
    for round_ in range(4):
        busy = _busy_device()
        expected = _work("cpu", round_, 12)
        torch.testing.assert_close(_work("neuron", round_, 12), expected, **LIBRARY_TOLERANCE)
        del busy
    torch.neuron.synchronize()
    if adaptive_eager.is_enabled():  # the chains whose checks once raced matched
        assert {"softmax", "gelu_tanh", "rms_norm"} <= set(adaptive_eager.stats()["patterns"])


def test_the_host_never_reads_a_window_it_handed_to_the_worker(small_windows, instant_device):
    torch.testing.assert_close(_work("neuron", 5, 6), _work("cpu", 5, 6), **LIBRARY_TOLERANCE)
    if adaptive_eager.is_enabled():
        assert {"softmax", "gelu_tanh", "rms_norm"} <= set(adaptive_eager.stats()["patterns"])


@pytest.fixture
def no_library_kernels():
    """Generic fusion only: results then equal the CPU's bit for bit (a library kernel
    rounds differently, and which chains match depends on how two threads' ops interleave
    in a window), so any race shows as a difference."""
    adaptive_eager.clear_caches()  # plans made with library kernels would be reused
    with adaptive_eager.window_policy(patterns=False):
        yield
    adaptive_eager.clear_caches()


def test_two_threads_issuing_ops_at_once(fast_switching, small_windows, doorbell_every_launch, no_library_kernels):
    results, errors = {}, []

    def run(seed):
        try:
            results[seed] = _work("neuron", seed, 20)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    busy = _busy_device()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    del busy
    assert not errors, errors
    for seed in (1, 2):
        assert torch.equal(results[seed], _work("cpu", seed, 20))


def test_two_threads_training_their_own_models(fast_switching):
    def build(device):
        torch.manual_seed(0)  # on this thread: the CPU generator is shared by all threads
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, device, seed, out):
        g = torch.Generator().manual_seed(seed)
        for _ in range(6):
            x = torch.randn(4, 8, generator=g).to(device)
            loss = F.mse_loss(model(x), x.sum(-1, keepdim=True))
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[seed] = [p.detach().cpu() for p in model.parameters()]

    on_device, on_cpu = {}, {}
    threads = [threading.Thread(target=train, args=(*build("neuron"), "neuron", seed, on_device)) for seed in (3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for seed in (3, 4):
        train(*build("cpu"), "cpu", seed, on_cpu)
        for a, b in zip(on_device[seed], on_cpu[seed]):
            torch.testing.assert_close(a, b)
    assert adaptive_eager.stats()["errors"] == {"deferred": 0, "raised": 0}


def test_memory_books_balance_while_the_worker_frees_buffers(fast_switching, doorbell_every_launch):
    """The worker frees buffers (the last kernel reading them has run) while the host
    allocates new ones: the books must balance to the byte afterwards."""
    torch.neuron.synchronize()
    before = torch.neuron.memory_allocated()
    x = torch.randn(64, 64).to("neuron")
    for _ in range(300):
        x = (x * 1.0001).tanh() + 0.5  # each step frees the previous step's buffers on the worker
    del x
    torch.neuron.synchronize()
    assert torch.neuron.memory_allocated() == before
