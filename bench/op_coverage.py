"""OpInfo op coverage of the ``neuron`` device, against CPU PyTorch.

For every OpInfo in PyTorch's ``op_db``, take up to ``--samples`` float32 sample inputs,
run the op on the CPU, then on ``neuron`` (every tensor of the sample moved with
``.to('neuron')``; a ``device='cpu'`` keyword becomes ``device='neuron'``), and compare
with ``torch.testing.assert_close(..., equal_nan=True)``.

Outcome of each op:

- ``pass``: every compared sample matched, and no aten op ran on the CPU fallback;
- ``pass_fallback``: every compared sample matched, but some aten op ran on the CPU
  fallback (``adaptive_eager.stats()['fallback_ops']``);
- ``fail``: a sample gave a wrong result, a result on the wrong device, or raised on
  ``neuron`` although the CPU ran it (first failure's one-line reason is kept);
- ``skip``: no float32 samples, the CPU itself raised on every sample, or no sample has
  a tensor or device argument (``broadcast_shapes``: nothing would run on ``neuron``).

Random ops (a fixed name list, plus the ops OpInfo itself marks "output is
non-deterministic" or "not comparable", such as ``empty``) are compared by shape and dtype
only. For them, the values of a run seeded identically on both devices are also
compared, as information only (``seeded_values`` in the JSON): the device's contract says
a seeded run draws the CPU's numbers.

Usage::

    python bench/op_coverage.py [--ops add,mul] [--limit N] [--samples K] [--json PATH]

Prints the counts, failures grouped by reason, fallback ops, and writes
``bench/results/op_coverage.json``.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import re
import signal
import sys
import time
import warnings

import torch

import adaptive_eager

_HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_JSON = os.path.join(_HERE, "results", "op_coverage.json")
DEFAULT_SAMPLES = 4
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


# -- tolerances ----------------------------------------------------------------------
_TOLERANCE_TESTS = {None, "test_compare_cpu", "test_variant_consistency_eager", "test_noncontiguous_samples"}


def tolerances(opinfo, dtype=torch.float32) -> dict:
    """The OpInfo's own float32 tolerance overrides that apply to a CPU comparison
    (``toleranceOverride`` on the whole op or on the eager-consistency tests, for any
    device or the CPU); the loosest of them, never tighter than assert_close's default.
    Empty when there is none (assert_close's defaults)."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    atol = rtol = None
    for info in itertools.chain(opinfo.decorators or (), getattr(opinfo, "skips", ()) or ()):
        if not isinstance(info, DecorateInfo) or info.test_name not in _TOLERANCE_TESTS:
            continue
        if info.device_type not in (None, "cpu"):
            continue
        for decorator in info.decorators:
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                tol = decorator.d[dtype]
                atol = max(atol or 0.0, tol.atol)
                rtol = max(rtol or 0.0, tol.rtol)
    if atol is None:
        return {}
    default_rtol, default_atol = 1.3e-6, 1e-5  # assert_close's float32 defaults
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

    def __init__(self) -> None:
        self.by_id: dict = {}
        self.by_storage: dict = {}

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        moved = self.by_id.get(id(t))
        if moved is None:
            moved = self.by_id[id(t)] = self._move(t)
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
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, list):
            return [self(v) for v in value]
        if isinstance(value, tuple):
            items = [self(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, dict):
            return {k: self(v) for k, v in value.items()}
        return value


def to_neuron(value):
    """``value`` with every tensor moved to ``neuron`` (recursively through lists,
    tuples and dicts; non-tensors left alone)."""
    return _Mover()(value)


def to_cpu(value):
    """``value`` with every tensor copied to the CPU (recursively), for comparison."""
    if isinstance(value, torch.Tensor):
        return value.to(CPU)
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if isinstance(value, tuple):
        items = [to_cpu(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def _is_cpu_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cpu"
    return isinstance(value, str) and value == "cpu"


def neuron_call_args(sample, key: str = ""):
    """(input, args, kwargs, on_device) for the neuron run of ``sample``.

    Tensors move to ``neuron``; a CPU device argument (``device='cpu'`` of factories,
    ``x.to('cpu', ...)``) becomes ``neuron``: the sample was built for the CPU as "the
    device under test". ``on_device`` says whether anything now names the device, i.e.
    whether tensor results must come back on ``neuron``."""
    mover = _Mover()
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
    extra = next((line for line in lines[1:] if line.startswith("Mismatched elements")), None)
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
def run_opinfo(opinfo, max_samples: int = DEFAULT_SAMPLES, time_budget: float = OP_TIME_BUDGET_S,
               hard_timeout: int = SAMPLE_HARD_TIMEOUT_S) -> dict:
    """Run one OpInfo's float32 samples on CPU and on ``neuron``; return its record:
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
        "samples_off_device": 0,  # compared, but nothing in the call named the device
        "time_s": 0.0,
    }

    def finish():
        record["time_s"] = round(time.perf_counter() - started, 3)
        return record

    if not opinfo.supports_dtype(torch.float32, "cpu"):
        record["reason"] = "no float32 support on CPU"
        return finish()
    torch.manual_seed(0)  # reproducible sample inputs
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = list(itertools.islice(opinfo.sample_inputs("cpu", torch.float32), max_samples))
    except Exception as exc:  # noqa: BLE001
        record["reason"] = f"sample_inputs raised {exception_reason(exc)}"
        return finish()
    if not samples:
        record["reason"] = "no float32 samples"
        return finish()

    stale = _settle_device()
    if stale is not None:
        record["stale_error_cleared"] = stale
    adaptive_eager.reset_stats()
    tol = tolerances(opinfo) if mode == "values" else {}
    if tol:
        record["tolerance"] = tol
    seeded = []  # random ops: did a seeded neuron run draw the CPU's values?
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
                # 1. the neuron inputs, before the CPU run can change the sample in place
                try:
                    n_input, n_args, n_kwargs, moved = neuron_call_args(sample, op_key(opinfo))
                    torch.neuron.synchronize()
                except adaptive_eager.NeuronRuntimeError as exc:
                    failure = "moving inputs to neuron: " + exception_reason(exc)
                    raise _Abort from None
                except SampleTimeout:
                    raise
                except Exception as exc:  # noqa: BLE001
                    failure = "moving inputs to neuron: " + exception_reason(exc)
                    raise _Abort from None
                # 2. the CPU reference
                try:
                    torch.manual_seed(0)
                    cpu_result = opinfo.op(sample.input, *sample.args, **sample.kwargs)
                except SampleTimeout:
                    raise
                except Exception:  # noqa: BLE001 - the CPU rejects this sample: skip it
                    record["samples_cpu_failed"] += 1
                    raise _Abort from None
                cpu_inputs_after = (sample.input, tuple(sample.args), dict(sample.kwargs))
                # 3. the device
                try:
                    torch.manual_seed(0)
                    n_result = opinfo.op(n_input, *n_args, **n_kwargs)
                    torch.neuron.synchronize()
                    if moved:
                        check_devices(n_result, cpu_result)
                    host_result = to_cpu(n_result)
                    host_inputs_after = to_cpu((n_input, n_args, n_kwargs))
                    process = getattr(sample, "output_process_fn_grad", None) or (lambda x: x)
                    compare(process(host_result), process(cpu_result), mode, tol)
                    if mode == "values":
                        # in-place ops: the mutated inputs must match as well
                        try:
                            compare(list(_leaves(host_inputs_after)), list(_leaves(cpu_inputs_after)), mode, tol)
                        except AssertionError as exc:
                            raise AssertionError(f"mutated input differs: {_first_line(exc)}") from None
                    else:
                        seeded.append(_values_equal(process(host_result), process(cpu_result)))
                    record["samples_compared"] += 1
                    if not moved:
                        record["samples_off_device"] += 1
                except AssertionError as exc:
                    failure = mismatch_reason(exc)
                except adaptive_eager.NeuronRuntimeError as exc:
                    failure = exception_reason(exc)
                except SampleTimeout:
                    raise
                except Exception as exc:  # noqa: BLE001
                    failure = exception_reason(exc)
        except _Abort:
            pass
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
    if seeded:
        record["seeded_values"] = "match" if all(seeded) else "differ"
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


def run_sweep(opinfos, max_samples=DEFAULT_SAMPLES, time_budget=OP_TIME_BUDGET_S, progress=None) -> dict:
    ops = {}
    started = time.perf_counter()
    for number, opinfo in enumerate(opinfos, 1):
        key = op_key(opinfo)
        if key in ops:  # op_db has no duplicate keys today; keep both if it ever does
            key = f"{key}#{number}"
        try:
            ops[key] = run_opinfo(opinfo, max_samples=max_samples, time_budget=time_budget)
        except Exception as exc:  # noqa: BLE001 - a harness bug must not end the sweep
            _settle_device()
            ops[key] = {"outcome": "skip", "reason": f"harness error: {exception_reason(exc)}",
                        "fallback_ops": {}, "compare": compare_mode(opinfo)}
        if progress is not None:
            progress(number, len(opinfos), key, ops[key])
    return {"summary": summarize(ops, time.perf_counter() - started, max_samples), "ops": ops}


def summarize(ops: dict, elapsed: float, max_samples: int) -> dict:
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
        "shape_dtype_only": sorted(k for k, r in ops.items() if r["compare"] == "shape_dtype"),
        "fallback_ops": {name: {"calls": fallback[name], "opinfos": fallback_op_count[name]}
                         for name, _ in fallback.most_common()},
        "samples_per_op": max_samples,
        "seconds": round(elapsed, 1),
        "torch": torch.__version__,
        "mode": adaptive_eager.stats()["mode"],
    }


def format_report(result: dict) -> str:
    summary, ops = result["summary"], result["ops"]
    ran = summary["pass"] + summary["pass_fallback"] + summary["fail"]
    lines = [
        f"OpInfo coverage on neuron vs CPU: {summary['ops']} OpInfos, float32, "
        f"<= {summary['samples_per_op']} samples each, {summary['mode']} mode, "
        f"{summary['seconds']:.1f} s",
        "",
        f"  pass           {summary['pass']:5d}  {summary['pass_pct']:5.1f}%  (of {ran} that ran)",
        f"  pass_fallback  {summary['pass_fallback']:5d}  "
        f"{(100.0 * summary['pass_fallback'] / ran if ran else 0):5.1f}%",
        f"  fail           {summary['fail']:5d}  {summary['fail_pct']:5.1f}%",
        f"  skip           {summary['skip']:5d}",
        f"  pass + pass_fallback: {summary['pass_or_fallback_pct']:.1f}%",
        "",
    ]
    shape_only = summary["shape_dtype_only"]
    if shape_only:
        lines.append(f"Random/uncomparable ops compared by shape and dtype only ({len(shape_only)}):")
        for key in shape_only:
            record = ops[key]
            seeded = record.get("seeded_values")
            info = f"seeded values vs CPU: {seeded}" if seeded else "no seeded comparison"
            lines.append(f"  {key:45s} {record['outcome']:14s} {info}")
        lines.append("")

    failures = {k: r for k, r in ops.items() if r["outcome"] == "fail"}
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
        lines.append("")

    if summary["fallback_ops"]:
        lines.append("Aten ops that ran on the CPU fallback (calls, OpInfos that hit it):")
        for name, info in summary["fallback_ops"].items():
            lines.append(f"  {name:45s} {info['calls']:5d} calls  {info['opinfos']:4d} OpInfos")
        lines.append("")

    skips = collections.Counter(r["reason"] for r in ops.values() if r["outcome"] == "skip")
    if skips:
        lines.append("Skips by reason:")
        for reason, n in skips.most_common():
            lines.append(f"  {n:4d}  {reason}")
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True, default=str)
        handle.write("\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated op keys or names (default: all of op_db)")
    parser.add_argument("--limit", type=int, help="at most this many OpInfos")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="float32 samples per op")
    parser.add_argument("--time-budget", type=float, default=OP_TIME_BUDGET_S,
                        help="seconds per op after which its remaining samples are not run")
    parser.add_argument("--json", default=DEFAULT_JSON, help="where to write the results")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per op as it runs")
    options = parser.parse_args(argv)

    names = [n.strip() for n in options.ops.split(",") if n.strip()] if options.ops else None
    opinfos = select_ops(load_op_db(), names, options.limit)

    def progress(number, total, key, record):
        if options.verbose:
            print(f"[{number}/{total}] {key}: {record['outcome']} {record['reason']} ({record['time_s']:.2f} s)",
                  flush=True)
        elif number % 50 == 0 or number == total:
            print(f"... {number}/{total} ops", file=sys.stderr, flush=True)

    result = run_sweep(opinfos, max_samples=options.samples, time_budget=options.time_budget, progress=progress)
    print(format_report(result))
    write_json(result, options.json)
    print(f"\nwrote {os.path.relpath(options.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
