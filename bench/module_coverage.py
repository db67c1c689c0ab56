"""ModuleInfo coverage of the ``neuron`` device, against CPU PyTorch.

The module-level twin of ``bench/op_coverage.py``: for every ModuleInfo in PyTorch's
``module_db`` (``torch.testing._internal.common_modules``) and every configuration
(dtype x mode), take up to ``--samples`` of its ``module_inputs_func`` samples, in
training and (when the ModuleInfo says they differ) eval mode, and run these checks, each
comparing ``neuron`` with the CPU (``torch.testing.assert_close``, assert_close's
tolerances for the dtype, loosened by the ModuleInfo's own ``toleranceOverride``):

- ``forward``: a module built on the CPU (seeded), deep-copied and moved with
  ``.to('neuron')``; outputs and buffers after the call (BatchNorm's running stats);
- ``backward``: a fixed random cotangent per differentiable output, then
  ``torch.autograd.grad`` with respect to the inputs that require grad and every
  parameter;
- ``to_after_cpu``: a module that already ran a forward on the CPU is moved in place
  with ``.to('neuron')`` and runs again;
- ``state_dict``: neuron -> CPU (the neuron module's ``state_dict`` loaded into a fresh
  CPU module) and CPU -> neuron (the CPU module's ``state_dict`` loaded into a fresh,
  differently seeded neuron module); each must hold the CPU's values and compute the CPU's
  outputs.

Random modules (Dropout, RReLU, ...) are compared by value too: every forward is seeded
identically on both devices, and the device's contract says a seeded run draws the CPU's
numbers. Configurations: ``float32`` and ``bfloat16`` (the module and inputs converted to
it; skipped where the CPU itself raises), ``strict`` and ``adaptive`` eager
(``adaptive_eager.mode``).

Usage::

    python bench/module_coverage.py [--modules Linear,Conv2d] [--dtypes float32,bfloat16]
        [--modes strict,adaptive] [--samples K] [--json PATH] [--save] [-v]

Prints one line per configuration, the headline (the share of ModuleInfos whose forward
and backward pass in both modes) and the failures grouped by reason; writes
``bench/results/latest/module_coverage.json`` (``--save``:
``bench/results/module_coverage.json``). Exit status 1 when any check fails.
"""
from __future__ import annotations

import argparse
import collections
import copy
import itertools
import json
import os
import sys
import time
import warnings

import torch

import adaptive_eager

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:  # `python bench/module_coverage.py`
    sys.path.insert(0, os.path.dirname(_HERE))
from bench import SAVE_HELP, provenance, results_path  # noqa: E402
from bench.op_coverage import (  # noqa: E402
    CPU, NEURON, _DEFAULT_TOLERANCES, SampleTimeout, _Mover, _leaves, _settle_device, _watchdog,
    check_devices, exception_reason, group_key, mismatch_reason, to_cpu)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("strict", "adaptive")
CHECKS = ("forward", "backward", "to_after_cpu", "state_dict")
DEFAULT_SAMPLES = 4
SAMPLE_TIMEOUT_S = 120
_COTANGENT_SEED = 1234


def module_key(info) -> str:
    """``Linear`` for ``nn_Linear``: the class name (ModuleInfo names are unique by it)."""
    return info.module_cls.__name__


def tolerances(info, dtype) -> dict:
    """assert_close's defaults for ``dtype``, loosened by the ModuleInfo's own
    ``toleranceOverride``s for that dtype (any test, CPU or any device)."""
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.common_modules import DecorateInfo

    rtol, atol = _DEFAULT_TOLERANCES[dtype]
    for entry in itertools.chain(info.decorators or (), getattr(info, "skips", ()) or ()):
        if not isinstance(entry, DecorateInfo) or entry.device_type not in (None, "cpu"):
            continue
        for decorator in entry.decorators:
            if isinstance(decorator, toleranceOverride) and dtype in decorator.d:
                rtol, atol = max(rtol, decorator.d[dtype].rtol), max(atol, decorator.d[dtype].atol)
    return {"rtol": rtol, "atol": atol}


class CheckFailed(Exception):
    """One check failed; the message is the one-line reason."""


class CpuRefused(Exception):
    """The CPU itself rejects this sample (in this dtype): not a sample."""


def _on_cpu(fn):
    try:
        return fn()
    except SampleTimeout:
        raise
    except Exception as exc:  # noqa: BLE001
        raise CpuRefused(exception_reason(exc)) from None


def _on_neuron(check: str, fn):
    try:
        result = fn()
        torch.neuron.synchronize()
        return result
    except (SampleTimeout, CheckFailed):
        raise
    except AssertionError as exc:
        raise CheckFailed(f"{check}: {mismatch_reason(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - NeuronRuntimeError included
        raise CheckFailed(f"{check}: {exception_reason(exc)}") from None


def _compare(check: str, got, want, tol: dict) -> None:
    try:
        torch.testing.assert_close(to_cpu(got), want, equal_nan=True, **tol)
    except AssertionError as exc:
        raise CheckFailed(f"{check}: {mismatch_reason(exc)}") from None


class _Sample:
    """One ModuleInput in one dtype and training mode: builds modules and calls them."""

    def __init__(self, info, module_input, dtype, training, tol):
        self.info, self.input, self.dtype, self.training, self.tol = info, module_input, dtype, training, tol

    def build(self, seed: int = 0, device=CPU):
        torch.manual_seed(seed)
        ctor = self.input.constructor_input
        module = self.info.module_cls(*ctor.args, **ctor.kwargs).to(self.dtype)
        return module.to(device).train(self.training)

    def call(self, module, mover=None):
        """``module(*forward args)`` seeded; inputs moved by ``mover`` when given."""
        args, kwargs = self.input.forward_input.args, self.input.forward_input.kwargs
        if mover is not None:
            args, kwargs = mover(args), mover(kwargs)
        torch.manual_seed(7)
        return module(*args, **kwargs)


def _passed(checks: dict, name: str) -> None:
    """Mark a check passed, unless it already failed on an earlier sample."""
    if checks[name] != "fail":
        checks[name] = "pass"


def _state(module) -> dict:
    return {name: value.detach() for name, value in module.state_dict().items() if isinstance(value, torch.Tensor)}


def _check_forward_backward(sample: _Sample, checks: dict) -> None:
    cpu_module = sample.build()
    n_module = _on_neuron("forward", lambda: copy.deepcopy(cpu_module).to(NEURON))
    mover = _Mover(grad=True)
    cpu_out = _on_cpu(lambda: sample.call(cpu_module))
    n_out = _on_neuron("forward", lambda: sample.call(n_module, mover))
    _on_neuron("forward", lambda: check_devices(n_out, cpu_out))
    _compare("forward", n_out, cpu_out, sample.tol)
    _compare("forward (buffers after the call)", dict(n_module.named_buffers()),
             dict(cpu_module.named_buffers()), sample.tol)
    _passed(checks, "forward")

    cpu_outputs = [t for t in _leaves(cpu_out) if t.requires_grad]
    cpu_inputs = [t for t in _leaves((sample.input.forward_input.args, sample.input.forward_input.kwargs))
                  if t.requires_grad]
    cpu_wrt = cpu_inputs + list(cpu_module.parameters())
    if not cpu_outputs or not cpu_wrt:
        checks["backward"] = "skip: no differentiable output"
        return
    torch.manual_seed(_COTANGENT_SEED)
    cotangents = [torch.randn_like(t) for t in cpu_outputs]
    cpu_grads = _on_cpu(lambda: torch.autograd.grad(cpu_outputs, cpu_wrt, cotangents, allow_unused=True))
    n_outputs = [t for t in _leaves(n_out) if t.requires_grad]
    n_wrt = [mover.by_id[id(t)] for t in cpu_inputs] + list(n_module.parameters())
    n_grads = _on_neuron("backward", lambda: torch.autograd.grad(
        n_outputs, n_wrt, [c.to(NEURON) for c in cotangents], allow_unused=True))
    names = [f"input #{i}" for i in range(len(cpu_inputs))] + [n for n, _ in cpu_module.named_parameters()]
    for name, got, want in zip(names, n_grads, cpu_grads):
        if (got is None) != (want is None):
            raise CheckFailed(f"backward: grad of {name} is {'None' if got is None else 'a tensor'} on neuron, "
                              f"{'None' if want is None else 'a tensor'} on cpu")
        if want is not None:
            _compare(f"backward: grad of {name}", got, want, sample.tol)
    _passed(checks, "backward")


def _check_to_after_cpu(sample: _Sample, checks: dict) -> None:
    module = sample.build()
    with torch.no_grad():
        _on_cpu(lambda: sample.call(module))
        reference = copy.deepcopy(module)
        _on_neuron("to_after_cpu", lambda: module.to(NEURON))
        want = _on_cpu(lambda: sample.call(reference))
        got = _on_neuron("to_after_cpu", lambda: sample.call(module, _Mover()))
    _compare("to_after_cpu", got, want, sample.tol)
    _passed(checks, "to_after_cpu")


def _check_state_dict(sample: _Sample, checks: dict) -> None:
    with torch.no_grad():
        cpu_module = sample.build()
        n_module = _on_neuron("state_dict", lambda: copy.deepcopy(cpu_module).to(NEURON))
        want = _on_cpu(lambda: sample.call(cpu_module))
        _on_neuron("state_dict", lambda: sample.call(n_module, _Mover()))
        # neuron -> cpu
        fresh_cpu = sample.build(seed=1)
        _on_neuron("state_dict neuron->cpu", lambda: fresh_cpu.load_state_dict(n_module.state_dict()))
        _compare("state_dict neuron->cpu", _state(fresh_cpu), _state(cpu_module), sample.tol)
        # cpu -> neuron
        fresh_neuron = _on_neuron("state_dict cpu->neuron", lambda: sample.build(seed=1, device=NEURON))
        _on_neuron("state_dict cpu->neuron", lambda: fresh_neuron.load_state_dict(cpu_module.state_dict()))
        _compare("state_dict cpu->neuron", _state(fresh_neuron), _state(cpu_module), sample.tol)
        again_cpu = _on_cpu(lambda: sample.call(cpu_module))
        got = _on_neuron("state_dict cpu->neuron", lambda: sample.call(fresh_neuron, _Mover()))
    del want
    _compare("state_dict cpu->neuron (forward)", got, again_cpu, sample.tol)
    _passed(checks, "state_dict")


def _samples(info, dtype, limit: int):
    """(training, ModuleInput) pairs: training mode, and eval mode too when it differs."""
    modes = (True, False) if info.train_and_eval_differ else (True,)
    for training in modes:
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=training)
        for module_input in [m for m in inputs if m.forward_input is not None][:limit]:
            yield training, module_input


def run_module(info, dtype=torch.float32, max_samples: int = DEFAULT_SAMPLES,
               hard_timeout: int = SAMPLE_TIMEOUT_S) -> dict:
    """One ModuleInfo in the current mode: ``{"outcome", "reason", "checks", ...}``; each
    check ``pass``, ``fail`` or ``skip: why`` (a check passes when it passed on every
    sample it ran on)."""
    started = time.perf_counter()
    checks = {name: "skip: no sample the CPU runs" for name in CHECKS}
    record = {"outcome": "skip", "reason": "", "checks": checks, "samples": 0, "samples_cpu_refused": 0}
    tol = tolerances(info, dtype)
    _settle_device()
    try:
        samples = list(_samples(info, dtype, max_samples))
    except Exception as exc:  # noqa: BLE001
        record["reason"] = f"module_inputs_func raised {exception_reason(exc)}"
        return record
    failures = []
    for training, module_input in samples:
        sample = _Sample(info, module_input, dtype, training, tol)
        where = f"{'train' if training else 'eval'} {module_input.desc or 'sample'}"
        for name, check in (("forward", _check_forward_backward), ("to_after_cpu", _check_to_after_cpu),
                            ("state_dict", _check_state_dict)):
            if name == "forward" and checks["forward"] == "fail":
                continue
            try:
                with _watchdog(hard_timeout), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    check(sample, checks)
                if name == "forward":
                    record["samples"] += 1
            except CpuRefused as exc:
                if name == "forward":
                    record["samples_cpu_refused"] += 1
                    record.setdefault("cpu_refused", str(exc))
                    break
            except (CheckFailed, SampleTimeout) as exc:
                message = str(exc) if isinstance(exc, CheckFailed) else f"{name}: timeout: {exc}"
                failed = message.split(":")[0].split(" ")[0]
                failed = failed if failed in checks else name
                if failed == "forward" and name == "forward":
                    checks["backward"] = "skip: forward failed" if checks["backward"] != "pass" else "pass"
                checks[failed] = "fail"
                failures.append(f"[{where}] {message}")
                _settle_device()
    record["time_s"] = round(time.perf_counter() - started, 2)
    if failures:
        record.update(outcome="fail", reason=failures[0], failures=failures[:5])
    elif any(v == "pass" for v in checks.values()):
        record["outcome"] = "pass"
    else:
        record["reason"] = record.get("cpu_refused", "no samples")
    return record


def select_modules(names=None):
    from torch.testing._internal.common_modules import module_db

    if not names:
        return list(module_db)
    by_name = {module_key(info): info for info in module_db}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown modules: {', '.join(unknown)}")
    return [by_name[n] for n in names]


def run_sweep(infos, dtypes=("float32", "bfloat16"), modes=MODES, max_samples=DEFAULT_SAMPLES, progress=None):
    """``{"summary", "modules"}``: per module, per configuration (``float32-strict``...) its record."""
    modules = collections.defaultdict(dict)
    started = time.perf_counter()
    for dtype_name, mode in itertools.product(dtypes, modes):
        config = f"{dtype_name}-{mode}"
        with adaptive_eager.mode(mode == "adaptive"):
            for number, info in enumerate(infos, 1):
                try:
                    record = run_module(info, DTYPES[dtype_name], max_samples)
                except Exception as exc:  # noqa: BLE001 - a harness bug must not end the sweep
                    record = {"outcome": "fail", "reason": f"harness error: {exception_reason(exc)}", "checks": {}}
                modules[module_key(info)][config] = record
                if progress:
                    progress(config, number, len(infos), module_key(info), record)
            _settle_device()
    return {"summary": summarize(modules, round(time.perf_counter() - started, 1)), "modules": dict(modules)}


def _fwd_bwd_ok(record) -> bool:
    checks = record.get("checks", {})
    return (record.get("outcome") != "skip" and checks.get("forward") == "pass"
            and checks.get("backward") in ("pass", "skip: no differentiable output"))


def summarize(modules: dict, seconds: float) -> dict:
    configs = sorted({c for per in modules.values() for c in per}, key=lambda c: (c.split("-")[0] != "float32", c))
    per_config = {}
    for config in configs:
        counts = collections.Counter(per[config]["outcome"] for per in modules.values() if config in per)
        per_config[config] = dict(counts)
    headline = {}
    for dtype_name in sorted({c.split("-")[0] for c in configs}):
        both = [c for c in configs if c.startswith(dtype_name + "-")]
        ran = [m for m, per in modules.items() if all(per.get(c, {}).get("outcome") != "skip" for c in both)]
        ok = [m for m in ran if all(_fwd_bwd_ok(modules[m][c]) for c in both)]
        headline[dtype_name] = {"modes": [c.split("-")[1] for c in both], "ran": len(ran), "fwd_bwd_pass": len(ok),
                                "pct": round(100.0 * len(ok) / len(ran), 1) if ran else 0.0,
                                "failing": sorted(set(ran) - set(ok))}
    return {"modules": len(modules), "configs": per_config, "fwd_bwd_both_modes": headline, "seconds": seconds,
            "torch": torch.__version__}


def format_report(result: dict) -> str:
    summary, modules = result["summary"], result["modules"]
    lines = [f"ModuleInfo coverage on neuron vs CPU: {summary['modules']} ModuleInfos, {summary['seconds']} s", "",
             f"  {'config':20s} {'pass':>5s} {'fail':>5s} {'skip':>5s}"]
    for config, counts in summary["configs"].items():
        lines.append(f"  {config:20s} {counts.get('pass', 0):5d} {counts.get('fail', 0):5d} {counts.get('skip', 0):5d}")
    lines.append("")
    for dtype_name, h in summary["fwd_bwd_both_modes"].items():
        lines.append(f"forward+backward pass in {' and '.join(h['modes'])} ({dtype_name}): {h['fwd_bwd_pass']}/{h['ran']} "
                     f"= {h['pct']:.1f}% of the ModuleInfos that ran" + (f"; failing: {', '.join(h['failing'])}"
                                                                            if h["failing"] else ""))
    groups = collections.defaultdict(list)
    for name, per in modules.items():
        for config, record in per.items():
            if record["outcome"] == "fail":
                reason = record["reason"].split("] ", 1)[-1]
                groups[group_key(reason)].append((f"{name}[{config}]", reason))
    if groups:
        lines += ["", "Failures, grouped by reason:"]
        for _, members in sorted(groups.items(), key=lambda item: -len(item[1])):
            lines.append(f"  [{len(members)}] {members[0][1][:240]}")
            lines.append("       " + ", ".join(m for m, _ in members))
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    """The summary indented, then one line per module (sorted)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = [f" {json.dumps(name)}: {json.dumps(per, default=str)}" for name, per in sorted(result["modules"].items())]
    with open(path + ".tmp", "w") as handle:
        handle.write('{\n"summary": ' + json.dumps(result["summary"], indent=1, default=str)
                     + ',\n"modules": {\n' + ",\n".join(lines) + "\n}\n}\n")
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modules", help="comma-separated class names (default: all of module_db)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="float32,bfloat16 (default both)")
    parser.add_argument("--modes", default=",".join(MODES), help="strict,adaptive (default both)")
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="samples per module and training mode")
    parser.add_argument("--json", default=None, help="results file (default: see --save)")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per module as it runs")
    options = parser.parse_args(argv)
    split = lambda text: [n.strip() for n in text.split(",") if n.strip()]  # noqa: E731
    for name in split(options.dtypes):
        if name not in DTYPES:
            parser.error(f"unknown dtype {name!r} (one of {', '.join(DTYPES)})")
    for name in split(options.modes):
        if name not in MODES:
            parser.error(f"unknown mode {name!r} (strict or adaptive)")
    infos = select_modules(split(options.modules) if options.modules else None)

    def progress(config, number, total, name, record):
        if options.verbose:
            print(f"[{config} {number}/{total}] {name}: {record['outcome']} {record['reason'][:160]} "
                  f"({record.get('time_s', 0):.2f} s)", flush=True)

    result = run_sweep(infos, split(options.dtypes), split(options.modes), options.samples, progress)
    result["summary"]["taken"] = provenance()
    print(format_report(result))
    path = options.json or results_path("module_coverage.json", options.save)
    write_json(result, path)
    print(f"\nwrote {os.path.relpath(path)}")
    return 1 if any(c.get("fail") for c in result["summary"]["configs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
