"""OpInfo op coverage of the ``neuron`` device, against CPU PyTorch.

For every OpInfo in PyTorch's ``op_db`` and every *configuration* (dtype x mode x
direction), take up to ``--samples`` sample inputs, run the op on the CPU, then on
``neuron`` (every tensor of the sample moved with ``.to('neuron')``; a ``device='cpu'``
keyword becomes ``device='neuron'``), and compare with
``torch.testing.assert_close(..., equal_nan=True)``.

Configurations (all by default):

- dtypes ``float32`` and ``bfloat16`` (the CPU reference is the CPU's own result in that
  dtype; tolerances are the OpInfo's ``toleranceOverride`` for that dtype, else
  assert_close's defaults for it);
- modes ``strict`` and ``adaptive`` eager (``adaptive_eager.mode(...)``);
- directions ``forward`` (outputs, and inputs an op mutates) and ``backward`` (float32
  only by default; ops with ``supports_autograd``): samples built with
  ``requires_grad=True``, outputs passed through the sample's ``output_process_fn_grad``,
  a fixed random cotangent per differentiable output (as torch's test_ops does), then
  ``torch.autograd.grad`` on the CPU and on ``neuron``; the gradient of every input that
  requires grad must match (and the forward outputs too).

Outcome of each op in each configuration:

- ``pass``: every compared sample matched, and no aten op ran on the CPU fallback;
- ``pass_fallback``: every compared sample matched, but some aten op ran on the CPU
  fallback (``adaptive_eager.stats()['fallback_ops']``);
- ``fail``: a sample gave a wrong result, a result on the wrong device, or raised on
  ``neuron`` although the CPU ran it (first failure's one-line reason is kept);
- ``skip``: the op does not support the dtype (or autograd) on the CPU, no samples, the
  CPU itself raised on every sample, no sample has a tensor or device argument
  (``broadcast_shapes``: nothing would run on ``neuron``), or (backward) no sample has a
  differentiable output.

Random ops (a fixed name list, plus the ops OpInfo itself marks "output is
non-deterministic" or "not comparable", such as ``empty``) are compared by shape and dtype
only (their gradients too). For them, the values of a run seeded identically on both
devices are also compared, as information only (``seeded_values`` in the JSON): the
device's contract says a seeded run draws the CPU's numbers.

Usage::

    python bench/op_coverage.py [--dtypes float32,bfloat16] [--modes strict,adaptive]
        [--backward/--no-backward] [--forward/--no-forward] [--backward-dtypes float32]
        [--ops add,mul] [--limit N] [--samples K] [--json PATH]

Prints one summary line per configuration, then per configuration the failures grouped
by reason and the fallback ops, and writes ``bench/results/latest/op_coverage.json``
(``bench/results/op_coverage.json`` with ``--save``): per op, per configuration, the
outcome, its reason and the fallback ops. Exit status 1 when any op fails. Warnings that
PyTorch's kernels print for the samples' inputs (``std(): degrees of freedom is <= 0``)
are counted, not printed (``-v`` prints them).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import contextlib
import itertools
import json
import os
import re
import signal
import sys
import tempfile
import time
import warnings

import torch

import adaptive_eager

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(_HERE, "results", "op_coverage.json")  # the tracked results (--save)
if os.path.dirname(_HERE) not in sys.path:  # `python bench/op_coverage.py`
    sys.path.insert(0, os.path.dirname(_HERE))
from bench import SAVE_HELP, provenance, results_path  # noqa: E402
DEFAULT_SAMPLES = 16  # per op and configuration: the whole default sweep takes ~1 min here (all: ~3 min)
OP_TIME_BUDGET_S = 10.0  # stop running further samples of an op once it took this long
SAMPLE_HARD_TIMEOUT_S = 120  # SIGALRM watchdog: one sample that hangs becomes a failure

NEURON = torch.device("neuron")
CPU = torch.device("cpu")

# -- which ops are random ------------------------------------------------------------
_RANDOM_COMPONENT = re.compile(
    r"^(rand\w*|normal|bernoulli|\w*dropout\w*|multinomial|uniform|exponential|cauchy"
    r"|geometric|log_normal|poisson)$"
)
# Names the pattern catches that are deterministic.
_NOT_RANDOM = {
    "native_dropout_backward",  # takes the mask as an input
    "nn.functional.feature_alpha_dropout.without_train",  # identity in eval mode
    "signal.windows.exponential",  # a window function
}
# Skip reasons by which OpInfo itself says an op's output cannot be compared.
_UNCOMPARABLE_REASONS = ("output is non-deterministic", "is not comparable")


def op_key(opinfo) -> str:
    """``name`` or ``name.variant_test_name``."""
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


def _skip_reasons(opinfo):
    """The reason strings of the unittest.skip decorators an OpInfo carries."""
    from torch.testing._internal.opinfo.core import DecorateInfo

    for info in itertools.chain(opinfo.decorators or (), getattr(opinfo, "skips", ()) or ()):
        if not isinstance(info, DecorateInfo):
            continue
        for decorator in info.decorators:
            for cell in getattr(decorator, "__closure__", None) or ():
                try:
                    value = cell.cell_contents
                except ValueError:
                    continue
                if isinstance(value, str):
                    yield value


def compare_mode(opinfo) -> str:
    """``values``, or ``shape_dtype`` for random/uncomparable ops (with the reason)."""
    key = op_key(opinfo)
    if key in _NOT_RANDOM:
        return "values"
    if any(_RANDOM_COMPONENT.match(part) for part in opinfo.name.split(".")):
        return "shape_dtype"
    if any(any(r in reason for r in _UNCOMPARABLE_REASONS) for reason in _skip_reasons(opinfo)):
        return "shape_dtype"
    return "values"


# -- known causes ----------------------------------------------------------------------
# One line on why each failure or fallback the sweep still shows happens, printed with the
# report; keyed by op key (failures) or aten op name (fallbacks). A failure or fallback
# with no entry here is printed as unexplained: look into it.
_CSR = "compressed sparse layouts (CSR, CSC, BSR, BSC) are not supported on the neuron device (refused with a clear error)"
_SPARSE_ON_HOST = ("a sparse COO op: the CPU's sparse kernel runs on the host bytes after a sync point "
                   "(device/ops/sparse.py), as CUDA has sparse kernels and the device has none of its own")
KNOWN_CAUSES = {
    "sparse.sampled_addmm": "the sample is a sparse CSR tensor: " + _CSR,
    "sparse.mm.reduce": "the sample is a sparse CSR tensor: " + _CSR,
    "aten::_to_sparse": "a dense op with a sparse result, which only the host can size: " + _SPARSE_ON_HOST,
    "aten::_to_dense": _SPARSE_ON_HOST,
    "aten::sparse_mask": _SPARSE_ON_HOST,
    "aten::geqrf": ("no meta kernel in PyTorch, so the output shape is unknown until it runs; kept on the "
                    "fallback on purpose: it is the tests' and README's example of an op the device lacks"),
    "nn.functional.linear_cross_entropy.chunked": (
        "bfloat16: PyTorch itself picks another algorithm by device type (LinearCrossEntropyOptions "
        "acc_policy='auto': 'accurate' with float32 accumulation on 'cpu', 'compact' in bfloat16 "
        "elsewhere); not a device bug"),
    "nn.functional.linear_cross_entropy.chunked_none": (
        "bfloat16: PyTorch itself picks another algorithm by device type (LinearCrossEntropyOptions "
        "acc_policy='auto': 'accurate' with float32 accumulation on 'cpu', 'compact' in bfloat16 "
        "elsewhere); not a device bug"),
}


# -- tolerances ----------------------------------------------------------------------
_TOLERANCE_TESTS = {None, "test_compare_cpu", "test_variant_consistency_eager", "test_noncontiguous_samples"}


# assert_close's defaults (rtol, atol) per dtype: torch.testing._comparison's table.
_DEFAULT_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def tolerances(opinfo, dtype=torch.float32) -> dict:
    """The OpInfo's own tolerance overrides for ``dtype`` that apply to a CPU comparison
    (``toleranceOverride`` on the whole op or on the eager-consistency tests, for any
    device or the CPU); the loosest of them, never tighter than assert_close's default
    for ``dtype``. Empty when there is none (assert_close's defaults for the dtype)."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    atol = rtol = None
    for info in itertools.chain(opinfo.decorators or (), getattr(opinfo, "skips", ()) or ()):
        if not isinstance(info, DecorateInfo) or info.test_name not in _TOLERANCE_TESTS:
            continue
        if info.device_type not in (None, "cpu"):
            continue
        if not info.active_if or (info.dtypes is not None and dtype not in info.dtypes):
            continue
        for decorator in info.decorators:
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                tol = decorator.d[dtype]
                atol = max(atol or 0.0, tol.atol)
                rtol = max(rtol or 0.0, tol.rtol)
    if atol is None:
        return {}
    default_rtol, default_atol = _DEFAULT_TOLERANCES.get(dtype, _DEFAULT_TOLERANCES[torch.float32])
    return {"atol": max(atol, default_atol), "rtol": max(rtol, default_rtol)}


# -- moving samples --------------------------------------------------------------------
# Tensor arguments PyTorch requires on the CPU whatever the device (the OpInfo builds them
# with torch.tensor(...) and no device): op key -> positions in sample.args left alone.
HOST_TENSOR_ARGS = {
    "tensor_split": {0},  # tensor_indices_or_sections "expected to be on cpu"
}


class _Mover:
    """Moves a sample's tensors to ``neuron`` the way ``sample_inputs('neuron')`` would
    have built them: the same tensor object is moved once; a tensor that is a view into a
    larger storage (``base[5:15]``, ``x[:, ::2]``) is moved with its whole storage and
    re-viewed on the device with the same sizes, strides and storage offset (so
    ``as_strided`` and non-contiguous kernels see what they see on the CPU), and views
    of one storage stay views of one device storage."""

    def __init__(self, grad: bool = False) -> None:
        self.by_id: dict = {}
        self.by_storage: dict = {}
        # grad: a CPU tensor that requires grad becomes a neuron *leaf* that requires grad
        # (gradients are taken with respect to it, as with respect to the CPU one).
        self.grad = grad

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        moved = self.by_id.get(id(t))
        if moved is None:
            if self.grad:
                with torch.no_grad():
                    moved = self._move(t.detach())
                moved = moved.detach().requires_grad_(t.requires_grad)
            else:
                moved = self._move(t)
            self.by_id[id(t)] = moved
        return moved

    def _move(self, t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided or t.device.type != "cpu":
            return t.to(NEURON)
        storage = t.untyped_storage()
        total = storage.nbytes() // t.element_size()
        key = (storage.data_ptr(), t.dtype)
        base = self.by_storage.get(key)
        if base is None:
            if t.storage_offset() == 0 and total == t.numel():
                return t.to(NEURON)  # the common case: a tensor that owns its storage
            base = t.as_strided((total,), (1,), 0).to(NEURON)
            self.by_storage[key] = base
        return base.as_strided(t.shape, t.stride(), t.storage_offset())

    def __call__(self, value):
        return map_tensors(value, self.tensor)


def map_tensors(value, fn):
    """``value`` with ``fn`` applied to every tensor, recursively through lists, tuples
    (named tuples keep their type) and dicts; non-tensors left alone."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def to_cpu(value):
    """``value`` with every tensor copied to the CPU (recursively), for comparison."""
    return map_tensors(value, lambda tensor: tensor.to(CPU))


def _is_cpu_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu"
    return isinstance(value, str) and value == "cpu"


def neuron_call_args(sample, key: str = "", mover=None):
    """(input, args, kwargs, on_device) for the neuron run of ``sample``.

    Tensors move to ``neuron``; a CPU device argument (``device='cpu'`` of factories,
    ``x.to('cpu', ...)``) becomes ``neuron``: the sample was built for the CPU as "the
    device under test". ``on_device`` says whether anything now names the device, i.e.
    whether tensor results must come back on ``neuron``."""
    mover = _Mover() if mover is None else mover
    host_positions = HOST_TENSOR_ARGS.get(key, ())
    inp = mover(sample.input)
    args = tuple(
        value if index in host_positions
        else (NEURON if _is_cpu_device(value) else mover(value))
        for index, value in enumerate(sample.args)
    )
    kwargs = {
        name: (NEURON if name == "device" and _is_cpu_device(value) else mover(value))
        for name, value in sample.kwargs.items()
    }
    retargeted = any(a is NEURON for a in args) or kwargs.get("device") is NEURON
    return inp, args, kwargs, bool(mover.by_id) or retargeted


def _leaves(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)


def describe(value) -> str:
    """``f32[2, 3]`` for tensors; short reprs for the rest (for failure reports)."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        extra = ""
        if value.layout != torch.strided:
            extra = f" {str(value.layout).replace('torch.', '')}"
        elif not value.is_contiguous() and value.numel() > 1:
            extra = f" stride={tuple(value.stride())}"
        return f"{dtype}{list(value.shape)}{extra}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={describe(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def describe_sample(sample) -> str:
    parts = [describe(sample.input)] + [describe(a) for a in sample.args]
    parts += [f"{k}={describe(v)}" for k, v in sample.kwargs.items()]
    return ", ".join(parts)


# -- comparing -------------------------------------------------------------------------
class DeviceMismatch(AssertionError):
    pass


def check_devices(neuron_value, cpu_value) -> None:
    """Every tensor the CPU run returned on the CPU must come back on ``neuron``."""
    if isinstance(cpu_value, torch.Tensor):
        if not isinstance(neuron_value, torch.Tensor):
            raise DeviceMismatch(f"result is {type(neuron_value).__name__}, CPU gives a tensor")
        if cpu_value.device.type == "cpu" and neuron_value.device.type != "neuron":
            raise DeviceMismatch(f"result tensor on {neuron_value.device}, expected neuron")
    elif isinstance(cpu_value, (list, tuple)) and isinstance(neuron_value, (list, tuple)):
        if len(cpu_value) != len(neuron_value):
            raise DeviceMismatch(f"result has {len(neuron_value)} items, CPU gives {len(cpu_value)}")
        for n, c in zip(neuron_value, cpu_value):
            check_devices(n, c)


def _shape_dtype(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_shape_dtype(v) for v in value)
    return type(value).__name__


def compare(neuron_cpu_value, cpu_value, mode: str, tol: dict) -> None:
    """Raise AssertionError when the (already host-side) neuron result differs."""
    if mode == "shape_dtype":
        got, want = _shape_dtype(neuron_cpu_value), _shape_dtype(cpu_value)
        if got != want:
            raise AssertionError(f"shape/dtype differ: neuron {got} vs cpu {want}")
        return
    try:
        torch.testing.assert_close(neuron_cpu_value, cpu_value, equal_nan=True, **tol)
    except TypeError:
        # Values assert_close does not know (strings, dtypes, torch.Size inside odd
        # containers): plain equality.
        if neuron_cpu_value != cpu_value:
            raise AssertionError(f"values differ: neuron {neuron_cpu_value!r} vs cpu {cpu_value!r}") from None


# -- reasons ---------------------------------------------------------------------------
def _first_line(text: str) -> str:
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


def exception_reason(exc: BaseException) -> str:
    """One line: ``Type: first line of the message``. A deferred device error names the
    failing aten op and the kernel's original exception."""
    if isinstance(exc, adaptive_eager.NeuronRuntimeError) and getattr(exc, "failure", None) is not None:
        failure = exc.failure
        original = failure.original
        return (
            f"{type(exc).__name__}: {failure.op_name}: "
            f"{type(original).__name__}: {_first_line(original)}"
        )
    return f"{type(exc).__name__}: {_first_line(exc)}"


def mismatch_reason(exc: AssertionError) -> str:
    if isinstance(exc, DeviceMismatch):
        return f"wrong device: {_first_line(exc)}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    detail = lines[0] if lines else "assertion failed"
    for prefix in ("Mismatched elements", "Greatest absolute difference"):
        extra = next((line for line in lines[1:] if line.startswith(prefix)), None)
        if extra:
            detail = f"{detail} {extra}"
    return f"mismatch: {detail}"


def group_key(reason: str) -> str:
    """A reason with its numbers, shapes and quoted names blurred, to group failures."""
    text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", reason)
    text = re.sub(r"#(, #)+", "#", text)
    return text[:200]


# -- device hygiene --------------------------------------------------------------------
def _settle_device() -> str | None:
    """Wait for the device; return (and clear) a deferred error left by an earlier op."""
    try:
        torch.neuron.synchronize()
    except adaptive_eager.NeuronRuntimeError as exc:
        return exception_reason(exc)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return exception_reason(exc)
    return None


class SampleTimeout(Exception):
    pass


@contextlib.contextmanager
def _watchdog(seconds: int):
    """Raise SampleTimeout in the main thread after ``seconds`` (POSIX only). Stands
    aside when a real-time timer is already armed (pytest-timeout's signal method): one
    process has one such timer, and that watcher's is kept."""
    if (seconds <= 0 or not hasattr(signal, "SIGALRM") or not _in_main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        yield
        return

    def _fire(signum, frame):
        raise SampleTimeout(f"sample took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, _fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# -- one op ----------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _grad_leaves(value):
    """Tensors in ``value`` that require grad, each once, in order."""
    seen = set()
    for tensor in _leaves(value):
        if tensor.requires_grad and id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def _differentiable_outputs(value):
    """Output tensors gradients flow back from (those that require grad)."""
    return [t for t in _leaves(value) if t.requires_grad]


class _SampleRun:
    """What one sample needs: the op, the comparison mode and tolerances, the record."""

    def __init__(self, opinfo, record, mode, tol, seeded):
        self.opinfo = opinfo
        self.key = op_key(opinfo)
        self.record = record
        self.mode = mode
        self.tol = tol
        self.seeded = seeded


def _neuron_inputs(run, sample, grad=False):
    try:
        mover = _Mover(grad=grad)
        n_input, n_args, n_kwargs, moved = neuron_call_args(sample, run.key, mover)
        torch.neuron.synchronize()
        return mover, n_input, n_args, n_kwargs, moved
    except SampleTimeout:
        raise
    except Exception as exc:  # noqa: BLE001
        raise _Failure("moving inputs to neuron: " + exception_reason(exc)) from None


def _cpu_call(run, fn):
    """The CPU reference: a sample the CPU rejects is not a sample (skipped)."""
    try:
        torch.manual_seed(0)
        return fn()
    except SampleTimeout:
        raise
    except Exception:  # noqa: BLE001
        run.record["samples_cpu_failed"] += 1
        raise _Abort from None


def _forward_sample(run, sample) -> bool:
    """Compare one sample's outputs (and mutated inputs); raises _Failure or _Abort.
    Returns whether anything in the call named the device."""
    opinfo = run.opinfo
    _, n_input, n_args, n_kwargs, moved = _neuron_inputs(run, sample)
    cpu_result = _cpu_call(run, lambda: opinfo.op(sample.input, *sample.args, **sample.kwargs))
    cpu_inputs_after = (sample.input, tuple(sample.args), dict(sample.kwargs))
    with _device_errors():
        torch.manual_seed(0)
        n_result = opinfo.op(n_input, *n_args, **n_kwargs)
        torch.neuron.synchronize()
        if moved:
            check_devices(n_result, cpu_result)
        host_result = to_cpu(n_result)
        host_inputs_after = to_cpu((n_input, n_args, n_kwargs))
        process = getattr(sample, "output_process_fn_grad", None) or (lambda x: x)
        compare(process(host_result), process(cpu_result), run.mode, run.tol)
        if run.mode == "values":
            # in-place ops: the mutated inputs must match as well
            try:
                compare(list(_leaves(host_inputs_after)), list(_leaves(cpu_inputs_after)), run.mode, run.tol)
            except AssertionError as exc:
                raise AssertionError(f"mutated input differs: {_first_line(exc)}") from None
        else:
            run.seeded.append(_values_equal(process(host_result), process(cpu_result)))
    return moved


_COTANGENT_SEED = 1234


def _backward_sample(run, sample) -> bool:
    """Compare one sample's gradients: outputs through ``output_process_fn_grad``, a fixed
    random cotangent per differentiable output, ``torch.autograd.grad`` with respect to
    every input that requires grad, on the CPU and on ``neuron``."""
    opinfo = run.opinfo
    mover, n_input, n_args, n_kwargs, moved = _neuron_inputs(run, sample, grad=True)
    process = getattr(sample, "output_process_fn_grad", None) or (lambda x: x)
    cpu_leaves = list(_grad_leaves((sample.input, sample.args, sample.kwargs)))
    cpu_result = _cpu_call(run, lambda: opinfo.op(sample.input, *sample.args, **sample.kwargs))
    cpu_outputs = _differentiable_outputs(process(cpu_result))
    if not cpu_outputs or not cpu_leaves:
        run.record["samples_no_grad"] += 1
        raise _Abort
    torch.manual_seed(_COTANGENT_SEED)
    cotangents = [torch.randn_like(t) for t in cpu_outputs]
    cpu_grads = _cpu_call(
        run, lambda: torch.autograd.grad(cpu_outputs, cpu_leaves, cotangents, allow_unused=True))
    n_leaves = [mover.by_id[id(t)] for t in cpu_leaves]
    with _device_errors():
        torch.manual_seed(0)
        n_result = opinfo.op(n_input, *n_args, **n_kwargs)
        torch.neuron.synchronize()
        if moved:
            check_devices(n_result, cpu_result)
        host_result = to_cpu(n_result)
        try:
            compare(process(host_result), process(cpu_result), run.mode, run.tol)
        except AssertionError as exc:
            raise AssertionError(f"forward: {_first_line(exc)}") from None
        n_outputs = _differentiable_outputs(process(n_result))
        if len(n_outputs) != len(cpu_outputs):
            raise AssertionError(
                f"{len(n_outputs)} outputs require grad on neuron, {len(cpu_outputs)} on cpu")
        n_grads = torch.autograd.grad(n_outputs, n_leaves, [c.to(NEURON) for c in cotangents], allow_unused=True)
        torch.neuron.synchronize()
        for index, (n_grad, cpu_grad) in enumerate(zip(n_grads, cpu_grads)):
            where = f"grad of input #{index} ({describe(cpu_leaves[index])})"
            if (n_grad is None) != (cpu_grad is None):
                raise AssertionError(
                    f"{where}: {'None' if n_grad is None else 'a tensor'} on neuron, "
                    f"{'None' if cpu_grad is None else 'a tensor'} on cpu")
            if cpu_grad is None:
                continue
            if n_grad.device.type != "neuron":
                raise DeviceMismatch(f"{where} on {n_grad.device}, expected neuron")
            try:
                compare(n_grad.to(CPU), cpu_grad, run.mode, run.tol)
            except AssertionError as exc:
                raise AssertionError(f"{where}: {_first_line(exc)}") from None
        if run.mode != "values":
            run.seeded.append(_values_equal([g.to(CPU) for g in n_grads if g is not None],
                                            [g for g in cpu_grads if g is not None]))
    return moved


class _Failure(Exception):
    """This sample failed on the device; the message is the one-line reason."""


@contextlib.contextmanager
def _device_errors():
    """Errors of the neuron run (and its comparison) as a one-line _Failure."""
    try:
        yield
    except SampleTimeout:
        raise
    except AssertionError as exc:
        raise _Failure(mismatch_reason(exc)) from None
    except Exception as exc:  # noqa: BLE001 - NeuronRuntimeError included
        raise _Failure(exception_reason(exc)) from None


def run_opinfo(opinfo, max_samples: int = DEFAULT_SAMPLES, time_budget: float = OP_TIME_BUDGET_S,
               hard_timeout: int = SAMPLE_HARD_TIMEOUT_S, dtype: torch.dtype = torch.float32,
               backward: bool = False) -> dict:
    """Run one OpInfo's samples of ``dtype`` on CPU and on ``neuron`` in the current mode,
    forward or (``backward``) gradients; return its record:
    ``{"outcome", "reason", "fallback_ops", ...}``."""
    started = time.perf_counter()
    mode = compare_mode(opinfo)
    record = {
        "outcome": "skip",
        "reason": "",
        "fallback_ops": {},
        "compare": mode,
        "samples_compared": 0,
        "samples_cpu_failed": 0,
        "samples_failed": 0,
        "samples_not_run": 0,
        "samples_no_grad": 0,  # backward: no output or no input requires grad
        "samples_off_device": 0,  # compared, but nothing in the call named the device
        "time_s": 0.0,
    }

    def finish():
        record["time_s"] = round(time.perf_counter() - started, 3)
        return record

    name = _dtype_name(dtype)
    if not opinfo.supports_dtype(dtype, "cpu"):
        record["reason"] = f"no {name} support on CPU"
        return finish()
    if backward:
        if not opinfo.supports_autograd:
            record["reason"] = "no autograd support"
            return finish()
        if dtype not in opinfo.supported_backward_dtypes("cpu"):
            record["reason"] = f"no {name} backward on CPU"
            return finish()
    torch.manual_seed(0)  # reproducible sample inputs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = list(itertools.islice(
                opinfo.sample_inputs("cpu", dtype, requires_grad=backward), max_samples))
    except Exception as exc:  # noqa: BLE001
        record["reason"] = f"sample_inputs raised {exception_reason(exc)}"
        return finish()
    if not samples:
        record["reason"] = f"no {name} samples"
        return finish()

    stale = _settle_device()
    if stale is not None:
        record["stale_error_cleared"] = stale
    adaptive_eager.reset_stats()
    tol = tolerances(opinfo, dtype) if mode == "values" else {}
    if tol:
        record["tolerance"] = tol
    run = _SampleRun(opinfo, record, mode, tol, seeded=[])  # seeded: did a seeded neuron run draw the CPU's values?
    check = _backward_sample if backward else _forward_sample
    first_failure = None

    for index, sample in enumerate(samples):
        if index > 0 and time.perf_counter() - started > time_budget:
            record["samples_not_run"] = len(samples) - index
            record["note"] = f"time budget of {time_budget:g} s reached after {index} samples"
            break
        failure = None
        try:
            with _watchdog(hard_timeout), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                moved = check(run, sample)
            record["samples_compared"] += 1
            if not moved:
                record["samples_off_device"] += 1
        except _Abort:
            pass
        except _Failure as exc:
            failure = str(exc)
        except SampleTimeout as exc:
            failure = f"timeout: {exc}"
        if failure is not None:
            record["samples_failed"] += 1
            if first_failure is None:
                first_failure = failure
                record["failing_sample"] = describe_sample(sample)
                record["failing_sample_index"] = index
            # a deferred error left behind must not be charged to the next sample
            _settle_device()

    record["fallback_ops"] = dict(adaptive_eager.stats()["fallback_ops"])
    if run.seeded:
        record["seeded_values"] = "match" if all(run.seeded) else "differ"
    if first_failure is not None:
        record["outcome"] = "fail"
        record["reason"] = first_failure
    elif record["samples_compared"] == record["samples_off_device"] and record["samples_compared"]:
        record["outcome"] = "skip"
        record["reason"] = "no sample has a tensor or device argument: nothing ran on neuron"
    elif record["samples_compared"] == 0:
        record["outcome"] = "skip"
        if record["samples_cpu_failed"]:
            record["reason"] = "the CPU raised on every sample"
        elif record["samples_no_grad"]:
            record["reason"] = "no sample has a differentiable output and an input that requires grad"
        else:
            record["reason"] = record.get("note", "no sample ran")
    elif record["fallback_ops"]:
        record["outcome"] = "pass_fallback"
        record["reason"] = "fallback: " + ", ".join(sorted(record["fallback_ops"]))
    else:
        record["outcome"] = "pass"
    return finish()


class _Abort(Exception):
    """Leave the current sample (its outcome is already recorded)."""


def _values_equal(a, b) -> bool:
    try:
        torch.testing.assert_close(a, b, equal_nan=True)
        return True
    except Exception:  # noqa: BLE001
        return False


# -- the sweep -------------------------------------------------------------------------
def load_op_db():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db
    return op_db


def select_ops(op_db, names=None, limit=None):
    """OpInfos whose key or name is in ``names`` (all when None), at most ``limit``."""
    chosen = []
    wanted = set(names) if names else None
    for opinfo in op_db:
        if wanted is not None and op_key(opinfo) not in wanted and opinfo.name not in wanted:
            continue
        chosen.append(opinfo)
    if wanted is not None:
        found = {op_key(o) for o in chosen} | {o.name for o in chosen}
        missing = sorted(wanted - found)
        if missing:
            print(f"warning: not in op_db: {', '.join(missing)}", file=sys.stderr)
    if limit is not None:
        chosen = chosen[:limit]
    return chosen


class Config(tuple):
    """One configuration of the sweep: (dtype, mode, direction); ``name`` is
    ``float32/adaptive/forward``."""

    __slots__ = ()

    def __new__(cls, dtype: torch.dtype, mode: str, direction: str):
        assert mode in MODES and direction in DIRECTIONS, (mode, direction)
        return super().__new__(cls, (dtype, mode, direction))

    dtype = property(lambda self: self[0])
    mode = property(lambda self: self[1])
    direction = property(lambda self: self[2])

    @property
    def name(self) -> str:
        return f"{_dtype_name(self.dtype)}/{self.mode}/{self.direction}"


MODES = ("strict", "adaptive")
DIRECTIONS = ("forward", "backward")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def configs(dtypes=("float32", "bfloat16"), modes=MODES, forward=True, backward=True,
            backward_dtypes=("float32",)) -> list:
    """The configurations to run, forward ones first."""
    chosen = []
    if forward:
        chosen += [Config(DTYPES[d], m, "forward") for d in dtypes for m in modes]
    if backward:
        chosen += [Config(DTYPES[d], m, "backward") for d in backward_dtypes for m in modes]
    return chosen


def run_config(opinfos, config: Config, max_samples=DEFAULT_SAMPLES, time_budget=OP_TIME_BUDGET_S,
               progress=None) -> dict:
    """Every OpInfo in one configuration: {op key: record}."""
    ops = {}
    with adaptive_eager.mode(config.mode == "adaptive"):
        for number, opinfo in enumerate(opinfos, 1):
            key = op_key(opinfo)
            if key in ops:  # op_db has no duplicate keys today; keep both if it ever does
                key = f"{key}#{number}"
            try:
                ops[key] = run_opinfo(opinfo, max_samples=max_samples, time_budget=time_budget,
                                      dtype=config.dtype, backward=config.direction == "backward")
            except Exception as exc:  # noqa: BLE001 - a harness bug must not end the sweep
                _settle_device()
                ops[key] = {"outcome": "skip", "reason": f"harness error: {exception_reason(exc)}",
                            "fallback_ops": {}, "compare": compare_mode(opinfo)}
            if progress is not None:
                progress(config, number, len(opinfos), key, ops[key])
        _settle_device()
    return ops


def run_sweep(opinfos, configurations=None, max_samples=DEFAULT_SAMPLES, time_budget=OP_TIME_BUDGET_S,
              progress=None) -> dict:
    """Every OpInfo in every configuration. Returns ``{"summary", "ops"}``: the summary
    per configuration, and per op the record of each configuration."""
    configurations = configs() if configurations is None else configurations
    started = time.perf_counter()
    by_config = {}
    seconds = {}
    for config in configurations:
        began = time.perf_counter()
        by_config[config.name] = run_config(opinfos, config, max_samples, time_budget, progress)
        seconds[config.name] = time.perf_counter() - began
    ops = {}
    for name, records in by_config.items():
        for key, record in records.items():
            ops.setdefault(key, {})[name] = record
    summary = {
        "configs": {name: summarize(records, seconds[name]) for name, records in by_config.items()},
        "ops": len(opinfos),
        "samples_per_op": max_samples,
        "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        "shape_dtype_only": sorted(
            key for key, per_config in ops.items()
            if any(r.get("compare") == "shape_dtype" for r in per_config.values())),
    }
    return {"summary": summary, "ops": ops}


def summarize(ops: dict, elapsed: float) -> dict:
    """Counts and percentages of one configuration (percentages of the ops that ran:
    pass + pass_fallback + fail)."""
    counts = collections.Counter(r["outcome"] for r in ops.values())
    ran = counts["pass"] + counts["pass_fallback"] + counts["fail"]

    def pct(n, total):
        return round(100.0 * n / total, 1) if total else 0.0

    fallback = collections.Counter()
    fallback_op_count = collections.Counter()
    for record in ops.values():
        for name, n in record["fallback_ops"].items():
            fallback[name] += n
            fallback_op_count[name] += 1
    return {
        "ops": len(ops),
        "pass": counts["pass"],
        "pass_fallback": counts["pass_fallback"],
        "fail": counts["fail"],
        "skip": counts["skip"],
        "pass_pct": pct(counts["pass"], ran),
        "pass_or_fallback_pct": pct(counts["pass"] + counts["pass_fallback"], ran),
        "fail_pct": pct(counts["fail"], ran),
        "mismatches": sum(1 for r in ops.values()
                          if r["outcome"] == "fail" and r["reason"].startswith("mismatch")),
        "fallback_ops": {name: {"calls": fallback[name], "opinfos": fallback_op_count[name]}
                         for name, _ in fallback.most_common()},
        "seconds": round(elapsed, 1),
    }


def summary_table(summary: dict) -> list:
    """The one-line-per-configuration table."""
    lines = [f"  {'config':28s} {'pass':>5s} {'fallbk':>6s} {'fail':>5s} {'skip':>5s} {'ran':>5s} "
             f"{'pass%':>6s} {'pass+fb%':>8s} {'mismatch':>8s} {'s':>6s}"]
    for name, s in summary["configs"].items():
        ran = s["pass"] + s["pass_fallback"] + s["fail"]
        lines.append(
            f"  {name:28s} {s['pass']:5d} {s['pass_fallback']:6d} {s['fail']:5d} {s['skip']:5d} {ran:5d} "
            f"{s['pass_pct']:6.1f} {s['pass_or_fallback_pct']:8.1f} {s['mismatches']:8d} {s['seconds']:6.1f}")
    return lines


def format_report(result: dict) -> str:
    summary, ops = result["summary"], result["ops"]
    names = list(summary["configs"])
    lines = [
        f"OpInfo coverage on neuron vs CPU: {summary['ops']} OpInfos, <= {summary['samples_per_op']} "
        f"samples each, {len(names)} configurations (dtype/mode/direction), {summary['seconds']:.1f} s",
        "",
        *summary_table(summary),
        "",
        "(percentages of the OpInfos that ran: pass + pass_fallback + fail; mismatch: failures "
        "that are wrong values, not errors)",
        "",
    ]
    shape_only = summary["shape_dtype_only"]
    if shape_only:
        lines.append(f"Random/uncomparable ops compared by shape and dtype only ({len(shape_only)}); "
                     "outcome, and whether seeded values equal the CPU's (in which configurations):")
        for key in shape_only:
            cells = collections.defaultdict(list)  # "pass, seeded values match" -> configs
            for name in names:
                record = ops[key].get(name)
                if record is None or record["outcome"] == "skip":
                    continue
                cells[f"{record['outcome']}, seeded {record.get('seeded_values', '-')}"].append(name)
            ran = sum(len(configs) for configs in cells.values())
            text = "; ".join(
                f"{cell} ({'all ' + str(ran) + ' that ran' if len(configs) == ran else ', '.join(configs)})"
                for cell, configs in cells.items())
            lines.append(f"  {key:45s} {text}")
        lines.append("")

    sections = {}  # a configuration's failures and fallbacks -> the first configuration with them
    for name in names:
        records = {key: per_config[name] for key, per_config in ops.items() if name in per_config}
        body = _failures_and_fallbacks(records, summary["configs"][name]["fallback_ops"])
        if not body:
            continue
        text = "\n".join(body)
        if text in sections:
            lines += [f"== {name}: the same failures and fallbacks as {sections[text]}", ""]
            continue
        sections[text] = name
        lines += [f"== {name}", *body, ""]

    skips = collections.defaultdict(list)
    for key, per_config in ops.items():
        for name, record in per_config.items():
            if record["outcome"] == "skip":
                skips[(name, record["reason"])].append(key)
    if skips:
        lines.append("Skips by configuration and reason:")
        for (name, reason), keys in sorted(skips.items(), key=lambda item: (names.index(item[0][0]), -len(item[1]))):
            shown = f" ({', '.join(sorted(keys))})" if len(keys) <= 6 else ""
            lines.append(f"  {name:28s} {len(keys):4d}  {reason}{shown}")
    return "\n".join(lines)


def _failures_and_fallbacks(records: dict, fallbacks: dict) -> list:
    """Report lines of one configuration: failures grouped by reason, then fallback ops,
    each with its known cause."""
    lines = []
    failures = {k: r for k, r in records.items() if r["outcome"] == "fail"}
    if failures:
        groups = collections.defaultdict(list)
        for key, record in failures.items():
            groups[group_key(record["reason"])].append((key, record["reason"]))
        lines.append(f"Failures ({len(failures)}), grouped by reason:")
        for _, members in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
            reasons = sorted({reason for _, reason in members})
            lines.append(f"  [{len(members)}] {reasons[0]}")
            for reason in reasons[1:4]:
                lines.append(f"       also: {reason}")
            if len(reasons) > 4:
                lines.append(f"       ... and {len(reasons) - 4} more variants of this reason")
            lines.append("       ops: " + ", ".join(key for key, _ in members))
            for cause in sorted({KNOWN_CAUSES.get(key, "") for key, _ in members}):
                lines.append(f"       why: {cause}" if cause else "       why: UNEXPLAINED (look into it)")
    if fallbacks:
        lines.append("Aten ops that ran on the CPU fallback (calls, OpInfos that hit it):")
        for op_name, info in fallbacks.items():
            users = sorted(k for k, r in records.items() if op_name in r["fallback_ops"])
            shown = ", ".join(users[:4]) + (f" +{len(users) - 4}" if len(users) > 4 else "")
            lines.append(f"  {op_name:40s} {info['calls']:5d} calls {info['opinfos']:4d} OpInfos  ({shown})")
            lines.append(f"       why: {KNOWN_CAUSES.get(op_name, 'UNEXPLAINED (look into it)')}")
    return lines


# What the JSON keeps of a record (the per-sample counters and timings stay in memory).
_JSON_FIELDS = ("outcome", "reason", "fallback_ops", "failing_sample", "seeded_values", "tolerance")


def json_record(record: dict) -> dict:
    kept = {"outcome": record["outcome"], "reason": record.get("reason", ""),
            "fallback_ops": record.get("fallback_ops", {})}
    kept.update((name, record[name]) for name in _JSON_FIELDS if name in record and name not in kept)
    return kept


def write_json(result: dict, path: str) -> None:
    """The summary indented; then one line per op (sorted): ``"key": {config: record, ...}``,
    configurations in run order."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    summary = json.dumps(result["summary"], indent=1, default=str)  # configurations in run order
    op_lines = [
        f" {json.dumps(key)}: "
        + json.dumps({name: json_record(r) for name, r in per_config.items()}, default=str)
        for key, per_config in sorted(result["ops"].items())
    ]
    with open(tmp, "w") as handle:
        handle.write('{\n"summary": ' + summary + ',\n"ops": {\n' + ",\n".join(op_lines) + "\n}\n}\n")
    os.replace(tmp, path)


def _names(text: str) -> list:
    return [n.strip() for n in text.split(",") if n.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated op keys or names (default: all of op_db)")
    parser.add_argument("--limit", type=int, help="at most this many OpInfos")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help=f"forward dtypes, comma-separated ({', '.join(DTYPES)}; default float32,bfloat16)")
    parser.add_argument("--modes", default=",".join(MODES), help="strict,adaptive (default both)")
    parser.add_argument("--forward", action=argparse.BooleanOptionalAction, default=True,
                        help="compare outputs (default on)")
    parser.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                        help="compare gradients of ops that support autograd (default on)")
    parser.add_argument("--backward-dtypes", default="float32", help="dtypes of the backward check (float32)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help=f"samples per op and configuration (default {DEFAULT_SAMPLES})")
    parser.add_argument("--time-budget", type=float, default=OP_TIME_BUDGET_S,
                        help="seconds per op after which its remaining samples are not run")
    parser.add_argument("--json", default=None, help="where to write the results (default: bench/results/latest/"
                                                      "op_coverage.json, or bench/results/op_coverage.json with --save)")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per op as it runs")
    options = parser.parse_args(argv)

    for name in _names(options.dtypes) + _names(options.backward_dtypes):
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    for name in _names(options.modes):
        if name not in MODES:
            parser.error(f"unknown mode {name!r} (strict or adaptive)")
    chosen = configs(_names(options.dtypes), _names(options.modes), options.forward, options.backward,
                     _names(options.backward_dtypes))
    if not chosen:
        parser.error("no configuration selected")
    names = _names(options.ops) if options.ops else None
    opinfos = select_ops(load_op_db(), names, options.limit)

    def progress(config, number, total, key, record):
        if options.verbose:
            print(f"[{config.name} {number}/{total}] {key}: {record['outcome']} {record['reason']} "
                  f"({record.get('time_s', 0):.2f} s)", flush=True)
        elif number == total:
            print(f"... {config.name}: {total} ops", file=sys.stderr, flush=True)

    with _native_warnings_counted(keep=options.verbose) as warned:
        result = run_sweep(opinfos, chosen, max_samples=options.samples, time_budget=options.time_budget,
                           progress=progress)
    result["summary"]["taken"] = provenance()
    print(format_report(result))
    if warned:
        print(f"\n{len(warned)} warnings printed by PyTorch's kernels for the samples' inputs were not shown "
              f"({'; '.join(sorted(set(warned))[:3])}{'; ...' if len(set(warned)) > 3 else ''}); -v shows them")
    path = options.json or results_path("op_coverage.json", options.save)
    write_json(result, path)
    print(f"\nwrote {os.path.relpath(path)}")
    failed = sum(summary["fail"] for summary in result["summary"]["configs"].values())
    if failed:  # the exit status says whether everything passed
        print(f"{failed} failures (op and configuration pairs): exit status 1", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def _native_warnings_counted(keep: bool = False):
    """Warnings PyTorch's C++ kernels print straight to stderr (``[W... Warning: ...]``:
    raised on the device's worker thread, where no Python warning filter applies) are
    collected instead of printed; yields the list of their messages, filled on exit.
    Everything else written to stderr meanwhile is passed through."""
    warned: list = []
    if keep:
        yield warned
        return
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        sys.stderr = open(os.dup(saved), "w", buffering=1)  # Python's own writes (progress) still show at once
        try:
            yield warned
        finally:
            sys.stderr.close()
            sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            for line in capture.read().decode(errors="replace").splitlines(keepends=True):
                found = re.search(r"Warning: (.*?)(?: \(function \w+\))?$", line.strip())
                if line.startswith("[W") and found:
                    warned.append(found.group(1).split(".")[0])
                else:
                    sys.stderr.write(line)
            sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main())
