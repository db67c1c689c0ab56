"""Real time: the wall clock a user waits on ``neuron``, against CPU eager on the same CPU.

    python bench/realtime.py [--workloads generate,gpt2-train,llama-train] [--modes strict,adaptive,compiled,inductor]
                             [--steps N] [--warmup W] [--runs R] [--quick] [--size full|tiny] [--save]
    python bench/realtime.py --first-step          # GPT-2-small-sized: time to the first step, then steady steps
    python -m bench --realtime ...                 # the same

The models are Hugging Face's own (``transformers.LlamaForCausalLM`` and
``GPT2LMHeadModel``), built from a config with random weights under ``torch.manual_seed(0)``
(no downloads): hidden 256, 4 layers, 4 heads, vocabulary 4096 (Llama: MLP 1024, 4 KV
heads; GPT-2: dropout off; the MLP width and the prompt length are this bench's choice, the
issue gives neither). Attention is transformers' default, SDPA. The workloads:

- ``generate``: Llama, greedy ``generate`` of 32 new tokens after a 16-token prompt, batch 1;
- ``gpt2-train``, ``llama-train``: one training step on a fixed batch of 4 x 128 tokens
  (``model(input_ids, labels=input_ids).loss``, ``backward``, ``AdamW.step``, ``zero_grad``);
- ``first-step`` (only with ``--first-step``, it is slow): the GPT-2 step at GPT-2-small
  size (hidden 768, 12 layers, 12 heads, vocabulary 4096), batch 4 x 128, AdamW.

The modes, each against CPU eager (the same model on the CPU, from the same weights):

- ``strict``: the model ``.to("neuron")``, strict eager (the device's default);
- ``adaptive``: the same after ``adaptive_eager.enable()``;
- ``compiled``: ``torch.compile(..., backend="neuron")`` of the neuron model, with strict
  eager between graphs (the default). For ``generate``, what transformers documents for fast
  decoding: ``model.forward = torch.compile(model.forward, backend="neuron")`` and
  ``generate(..., cache_implementation="static")`` (on ``neuron`` transformers then also
  compiles ``model.__call__`` for the decoding steps by itself; Dynamo inlines the inner
  compiled forward, so each token is one graph call); for training, ``torch.compile(model)``;
- ``inductor``: the peer, the same recipe on a CPU copy of the model with PyTorch's default
  backend (Inductor; its compile cache on disk is whatever this machine has);
- ``cpu`` (``first-step`` only): CPU eager alone in its process, for its own first step.

How each figure is taken. Every (workload, mode) pair runs in a fresh process (``--runs R``:
R fresh processes each, in turn), with one intra-op thread (``torch.set_num_threads(1)``)
and the process's CPU affinity as inherited (run under ``taskset -c 0`` to pin it to one
core; the JSON records the cores). In that process the CPU eager model and the mode's
model are built from the same weights, then steps alternate: one step of the mode, then
one CPU eager step, ``warmup + steps`` times. Each step ends with its result copied to the
host (the generated ids, or the loss after the optimizer step: a sync point, so the
device's queue is drained and the step's whole work is in its wall time).

- ``first step ms``: the wall time of the mode's first step, the first thing timed in the
  process (compile time included for the compiled modes);
- ``x cpu``: the median over the ``steps`` timed pairs of (mode step wall / CPU eager step
  wall), the pairs after the ``warmup`` ones; the interquartile range is in the JSON, and
  with ``--runs`` the table gives the median over the runs and their range;
- ``cpu ms``: the median wall time of the interleaved CPU eager steps (for a workload, the
  median over its processes);
- correctness: ``generate``'s token ids equal the CPU eager ids of the same pair (and 32
  new tokens came out); a training step's loss is within ``rtol 1e-4, atol 1e-5`` of the
  CPU eager loss of the same pair (both models take the same steps from the same weights).
  A mismatch is printed loudly and makes the exit status 1;
- neuron modes also record, per step, ``adaptive_eager.stats()``'s kernel launches, ops
  and compiled graph calls and replays (the public statistics; best effort).

Results go to ``bench/results/latest/realtime.json`` (``realtime_first_step.json`` for
``--first-step``), or to ``bench/results/`` with ``--save``, with :func:`bench.provenance`.
``--quick`` takes 1 warmup and 3 timed pairs and leaves out ``inductor`` (a cold Inductor
compile is minutes on two cores); ``--size tiny`` shrinks every model and ``--in-process``
runs every pair in this one process (the test's path; not for figures). The JSON records the
machine's load average (at the start and end of the run, and of each process): on a shared
machine the absolute times move with it, the interleaved ratios much less. For profiling,
``bench/realtime_profile.py`` runs one workload and mode alone. This file uses only public
API (torch, transformers, ``adaptive_eager``'s functions).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import SAVE_HELP, describe, provenance, results_path  # noqa: E402

WORKLOADS = ["generate", "gpt2-train", "llama-train"]
FIRST_STEP_WORKLOADS = ["first-step"]
MODES = ["strict", "adaptive", "compiled", "inductor"]
FIRST_STEP_MODES = ["cpu", "strict", "adaptive", "compiled", "inductor"]
NEURON_MODES = ("strict", "adaptive", "compiled")
LOSS_RTOL, LOSS_ATOL = 1e-4, 1e-5

DESCRIPTIONS = {
    "generate": "Llama generate, 32 new tokens after 16, batch 1",
    "gpt2-train": "GPT-2 training step, batch 4 x 128, AdamW",
    "llama-train": "Llama training step, batch 4 x 128, AdamW",
    "first-step": "GPT-2-small-sized (hidden 768, 12 layers) training step, batch 4 x 128, AdamW",
}

# Sizes: the models ("full"), and a tiny one for the test (same code paths).
SIZES = {
    "full": {
        "llama": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                  "num_attention_heads": 4, "num_key_value_heads": 4},
        "gpt2": {"vocab_size": 4096, "n_embd": 256, "n_layer": 4, "n_head": 4},
        "gpt2-small": {"vocab_size": 4096, "n_embd": 768, "n_layer": 12, "n_head": 12},
        "prompt": 16, "new_tokens": 32, "batch": 4, "seq": 128,
    },
    "tiny": {
        "llama": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 4},
        "gpt2": {"vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4},
        "gpt2-small": {"vocab_size": 128, "n_embd": 48, "n_layer": 2, "n_head": 4},
        "prompt": 6, "new_tokens": 4, "batch": 2, "seq": 16,
    },
}
STEPS = {"generate": (3, 15), "gpt2-train": (3, 15), "llama-train": (3, 15), "first-step": (1, 5)}  # (warmup, steps)
QUICK_STEPS = (1, 3)


# -- the workloads: (mode step, CPU eager step, how to compare their results) --------------


def _llama(size: dict):
    import transformers

    config = transformers.LlamaConfig(**size["llama"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _gpt2(size: dict, key: str = "gpt2"):
    import transformers

    config = transformers.GPT2Config(**size[key], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _generate_steps(size: dict, mode: str):
    """Greedy ``generate``: CPU eager with the default (dynamic) cache; the compiled modes
    with the static cache and ``model.forward`` compiled, as transformers documents."""
    cpu_model = _llama(size).eval()
    prompt = torch.randint(0, size["llama"]["vocab_size"], (1, size["prompt"]), generator=torch.Generator().manual_seed(1))
    new = size["new_tokens"]

    @torch.no_grad()
    def cpu_step():
        return cpu_model.generate(prompt, max_new_tokens=new, do_sample=False)

    if mode == "cpu":
        return cpu_step, cpu_step
    device = "cpu" if mode == "inductor" else "neuron"
    model = copy.deepcopy(cpu_model).to(device)
    kwargs = {}
    if mode in ("compiled", "inductor"):
        model.forward = torch.compile(model.forward, **({"backend": "neuron"} if mode == "compiled" else {}))
        kwargs["cache_implementation"] = "static"
    device_prompt = prompt.to(device)

    @torch.no_grad()
    def step():
        return model.generate(device_prompt, max_new_tokens=new, do_sample=False, **kwargs).cpu()

    return step, cpu_step


def _train_steps(size: dict, mode: str, build):
    """One training step: HF's loss with ``labels``, backward, AdamW (its default
    implementation for the device), ``zero_grad``; the loss back on the host at the end."""
    cpu_model = build(size).train()
    vocab = cpu_model.config.vocab_size
    batch = torch.randint(0, vocab, (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(1))

    def make_step(model, device):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        call = model
        if mode in ("compiled", "inductor") and model is not cpu_model:
            call = torch.compile(model, **({"backend": "neuron"} if mode == "compiled" else {}))
        ids = batch.to(device)

        def step():
            loss = call(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().cpu()

        return step

    cpu_step = make_step(cpu_model, "cpu")
    if mode == "cpu":
        return cpu_step, cpu_step
    device = "cpu" if mode == "inductor" else "neuron"
    return make_step(copy.deepcopy(cpu_model).to(device), device), cpu_step


def build(workload: str, mode: str, size: dict):
    if workload == "generate":
        return _generate_steps(size, mode)
    if workload == "gpt2-train":
        return _train_steps(size, mode, _gpt2)
    if workload == "llama-train":
        return _train_steps(size, mode, _llama)
    if workload == "first-step":
        return _train_steps(size, mode, lambda s: _gpt2(s, "gpt2-small"))
    raise ValueError(f"unknown workload {workload!r}")


def compare(workload: str, got, expected, size: dict) -> tuple[bool, str]:
    """(equal?, what differs) for one pair of step results, both on the host."""
    if workload == "generate":
        if got.shape != expected.shape:
            return False, f"shapes differ: {tuple(got.shape)} vs the CPU's {tuple(expected.shape)}"
        if not torch.equal(got, expected):
            where = (got != expected).nonzero()[0].tolist()
            return False, f"token ids differ first at {where}: {got.tolist()} vs the CPU's {expected.tolist()}"
        new = expected.shape[-1] - size["prompt"]
        if new != size["new_tokens"]:
            return False, f"{new} new tokens, not {size['new_tokens']} (an end-of-sequence token?)"
        return True, ""
    diff = abs(float(got) - float(expected))
    if diff > LOSS_ATOL + LOSS_RTOL * abs(float(expected)):
        return False, f"loss {float(got):.7g} vs the CPU's {float(expected):.7g} (|diff| {diff:.3g})"
    return True, ""


# -- one (workload, mode) in this process --------------------------------------------------


def _neuron_stats() -> dict:
    """Counters from adaptive_eager's public statistics (best effort: empty if they moved)."""
    try:
        import adaptive_eager

        stats = adaptive_eager.stats()
        compiled = stats.get("compiled", {})
        return {"kernels_launched": stats.get("kernels_launched"), "ops_recorded": stats.get("ops_recorded"),
                "fallback_ops": sum((stats.get("fallback_ops") or {}).values()),
                "graph_calls": compiled.get("graph_calls"), "replays": compiled.get("replays"),
                "recompiles": (compiled.get("recompiles") or {}).get("total")}
    except Exception as error:  # noqa: BLE001 - the figures above do not depend on it
        return {"unavailable": repr(error)[:200]}


def _timed(step):
    started = time.perf_counter()
    out = step()
    return out, time.perf_counter() - started


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]] if values else []
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def measure(workload: str, mode: str, steps: int, warmup: int, size_name: str = "full") -> dict:
    """Run ``warmup + steps`` pairs (the mode's step, then a CPU eager step) in this
    process; return the figures as a dict (see the module docstring)."""
    torch.set_num_threads(1)
    size = SIZES[size_name]
    if mode in NEURON_MODES:
        import adaptive_eager

        adaptive_eager.enable() if mode == "adaptive" else adaptive_eager.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notices (the auto-compile's Inductor request on neuron ...)
        step, cpu_step = build(workload, mode, size)
        walls, cpu_walls, failures = [], [], []
        first_ms = None
        for i in range(warmup + steps):
            if i == warmup and mode in NEURON_MODES:
                import adaptive_eager

                adaptive_eager.reset_stats()
            out, wall = _timed(step)
            if i == 0:
                first_ms = wall * 1000
            if mode == "cpu":  # CPU eager alone: its own steps, no pair
                if i >= warmup:
                    walls.append(wall)
                continue
            expected, cpu_wall = _timed(cpu_step)
            ok, why = compare(workload, out, expected, size)
            if not ok:
                failures.append(f"step {i}: {why}")
            if i >= warmup:
                walls.append(wall)
                cpu_walls.append(cpu_wall)
    result = {"workload": workload, "mode": mode, "size": size_name, "warmup": warmup, "steps": steps,
              "first_step_ms": first_ms, "ms": statistics.median(walls) * 1000,
              "cpus": sorted(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
              "load_average_1min_at_end": os.getloadavg()[0]}
    if mode == "cpu":
        result.update(cpu_ms=result["ms"], x_cpu=1.0, x_cpu_iqr=[1.0, 1.0], ratios=[1.0] * len(walls))
    else:
        ratios = [w / c for w, c in zip(walls, cpu_walls)]
        result.update(cpu_ms=statistics.median(cpu_walls) * 1000, x_cpu=statistics.median(ratios),
                      x_cpu_iqr=_quartiles(ratios), ratios=ratios)
    result["check"] = {
        "ok": not failures,
        "what": ("generated token ids equal the CPU eager ids" if workload == "generate" else
                 f"loss within rtol {LOSS_RTOL:g}, atol {LOSS_ATOL:g} of the CPU eager loss"),
        "pairs": 0 if mode == "cpu" else warmup + steps,
        "failures": failures[:5],
    }
    if mode in NEURON_MODES:
        stats = _neuron_stats()
        result["neuron_per_step"] = {k: (v / steps if isinstance(v, (int, float)) and k != "recompiles" else v)
                                     for k, v in stats.items()}
    return result


# -- the runs, the table, the JSON ---------------------------------------------------------


def run_child(workload: str, mode: str, steps: int, warmup: int, size: str, timeout: float) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--child", workload, mode,
               "--steps", str(steps), "--warmup", str(warmup), "--size", size]
    env = dict(os.environ, NEURON_ADAPTIVE_EAGER="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"workload": workload, "mode": mode, "error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"workload": workload, "mode": mode, "error": last[:400]}
    return json.loads(lines[-1])


def merge_runs(runs: list[dict]) -> dict:
    """One (workload, mode) from its runs: the first run's record, with the median of the
    runs' medians and their range; an error in any run wins."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    merged = dict(runs[0])
    if len(runs) > 1:
        for key in ("x_cpu", "ms", "cpu_ms", "first_step_ms"):
            merged[key] = statistics.median(r[key] for r in runs)
            merged[f"{key}_runs"] = [r[key] for r in runs]
        merged["check"] = {**runs[0]["check"], "ok": all(r["check"]["ok"] for r in runs),
                           "failures": [f for r in runs for f in r["check"]["failures"]][:5]}
        merged.pop("ratios", None)
        merged["ratios_runs"] = [r["ratios"] for r in runs]
    return merged


def table(results: dict, modes: list[str], first_step: bool) -> list[str]:
    columns = [m for m in modes if m != "cpu"]
    head = f"{'workload':<13}{'cpu ms':>9}" + "".join(f"{m:>21}" for m in columns)
    lines = [head, "-" * len(head)]
    for workload, by_mode in results.items():
        cpus = [r["cpu_ms"] for r in by_mode.values() if "cpu_ms" in r and r["mode"] != "cpu"]
        cpu_ms = statistics.median(cpus) if cpus else by_mode.get("cpu", {}).get("ms")
        cells = []
        for mode in columns:
            r = by_mode.get(mode, {})
            if "error" in r:
                cells.append("error")
            elif "x_cpu" not in r:
                cells.append("-")
            else:
                runs = r.get("x_cpu_runs")
                text = f"{r['x_cpu']:.2f}x" + (f" ({min(runs):.2f}-{max(runs):.2f})" if runs else "")
                cells.append(text + ("" if r["check"]["ok"] else " MISMATCH"))
        lines.append(f"{workload:<13}{cpu_ms if cpu_ms is None else format(cpu_ms, '.1f'):>9}"
                     + "".join(f"{c:>21}" for c in cells))
    lines.append("x cpu: median of per-pair wall ratios to CPU eager steps interleaved in the same process"
                 " (with --runs: median over runs, and their range)")
    if first_step or any("first_step_ms" in r for m in results.values() for r in m.values()):
        lines.append("")
        lines.append("first step (s, fresh process, compile included): " + "; ".join(
            f"{w}: " + ", ".join(f"{m} {r['first_step_ms'] / 1000:.2f}" for m, r in by_mode.items()
                                 if r.get("first_step_ms") is not None)
            for w, by_mode in results.items()))
    stats_lines = []
    for workload, by_mode in results.items():
        for mode, r in by_mode.items():
            s = r.get("neuron_per_step") or {}
            if s.get("kernels_launched") is not None:
                stats_lines.append(f"  {workload:<13}{mode:<10} launches {s['kernels_launched']:.0f}, ops {s['ops_recorded']:.0f}, "
                                   f"graph calls {s['graph_calls'] or 0:.0f} (replays {s['replays'] or 0:.0f}), "
                                   f"recompiles {s['recompiles'] or 0}, fallback ops {s['fallback_ops']:.0f}")
    if stats_lines:
        lines += ["", "neuron, per step (adaptive_eager.stats()):"] + stats_lines
    errors = [f"  {w} / {m}: {r['error']}" for w, by in results.items() for m, r in by.items() if "error" in r]
    mismatches = [f"  {w} / {m}: {f}" for w, by in results.items() for m, r in by.items()
                  if "check" in r and not r["check"]["ok"] for f in r["check"]["failures"]]
    if errors:
        lines += ["", "ERRORS:"] + errors
    if mismatches:
        lines += ["", "!!! RESULTS DIFFER FROM CPU EAGER !!!"] + mismatches
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/realtime.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=None, help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--modes", default=None, help=f"comma-separated, of {', '.join(FIRST_STEP_MODES)}")
    parser.add_argument("--first-step", action="store_true",
                        help="the GPT-2-small-sized first-step workload (slow): modes cpu,strict,adaptive,compiled,inductor")
    parser.add_argument("--steps", type=int, default=None, help="timed pairs per process (default 15; first-step 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed pairs first (default 3; first-step 1)")
    parser.add_argument("--runs", type=int, default=1, help="fresh processes per workload and mode, in turn")
    parser.add_argument("--quick", action="store_true", help="1 warmup + 3 timed pairs, no inductor (a smoke test)")
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help="tiny: shrunk models, for the test")
    parser.add_argument("--in-process", action="store_true",
                        help="run every pair in this process (tests; figures are then not from fresh processes)")
    parser.add_argument("--save", action="store_true", help=SAVE_HELP)
    parser.add_argument("--out", default=None, help="write the JSON here instead")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per process")
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, steps=args.steps, warmup=args.warmup, size_name=args.size)))
        return 0
    known_workloads = FIRST_STEP_WORKLOADS if args.first_step else WORKLOADS
    known_modes = FIRST_STEP_MODES if args.first_step else MODES
    workloads = args.workloads.split(",") if args.workloads else known_workloads
    modes = args.modes.split(",") if args.modes else [m for m in known_modes if not (args.quick and m == "inductor")]
    for name, values, known in (("workloads", workloads, WORKLOADS + FIRST_STEP_WORKLOADS), ("modes", modes, FIRST_STEP_MODES)):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"unknown {name}: {', '.join(unknown)} (known: {', '.join(known)})")
    started = time.perf_counter()
    load_before = os.getloadavg()
    results: dict = {}
    total, done = len(workloads) * len(modes) * args.runs, 0
    for workload in workloads:
        warmup, steps = QUICK_STEPS if args.quick else STEPS[workload]
        warmup = args.warmup if args.warmup is not None else warmup
        steps = args.steps if args.steps is not None else steps
        runs: dict = {mode: [] for mode in modes}
        for _ in range(args.runs):  # the modes in turn, so a slow spell of the machine hits them alike
            for mode in modes:
                done += 1
                print(f"[{done}/{total}] {workload} / {mode} ({time.perf_counter() - started:.0f} s)",
                      file=sys.stderr, flush=True)
                if args.in_process:
                    runs[mode].append(measure(workload, mode, steps, warmup, args.size))
                else:
                    runs[mode].append(run_child(workload, mode, steps, warmup, args.size, args.timeout))
        results[workload] = {mode: merge_runs(runs[mode]) for mode in modes}
    ok = all("error" not in r and r["check"]["ok"] for by in results.values() for r in by.values())
    report = {
        "taken": provenance(),
        "how": ("median of per-pair wall ratios (mode step / CPU eager step just after it, same process); "
                "one fresh process per workload, mode and run; torch.set_num_threads(1)"
                + ("" if not args.in_process else "; --in-process: all pairs in one process")),
        "size": args.size, "sizes": SIZES[args.size], "runs": args.runs, "quick": args.quick,
        "cpus": sorted(os.sched_getaffinity(0)),
        "load_average_1_5_15_min": {"start": load_before, "end": os.getloadavg()},  # a shared machine's other work
        "descriptions": {w: DESCRIPTIONS[w] for w in workloads},
        "all_checks_ok": ok,
        "results": results,
    }
    name = "realtime_first_step.json" if args.first_step else "realtime.json"
    path = args.out or results_path(name, args.save)
    with open(path, "w") as handle:
        json.dump(report, handle, indent=2)
    print("\n".join(table(results, modes, args.first_step)))
    print(f"\n{describe(report['taken'])}; cores {report['cpus']}; load average {load_before[0]:.1f} at the start, "
          f"{report['load_average_1_5_15_min']['end'][0]:.1f} at the end; {time.perf_counter() - started:.0f} s; {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
