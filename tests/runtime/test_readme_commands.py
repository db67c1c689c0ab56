"""Every shell command in README.md and docs/*.md runs as written, in the order written.

The commands are read from the ```bash blocks of README.md, then of each docs/*.md in
name order (continuation lines joined, comments dropped), and run one after another in a
scratch folder that holds links to the repository's ``bench/`` and ``examples/``, so files
one command writes (strict.json, the traces) are what the next reads, and the checkout
stays clean. To keep this test to a few minutes, some are shrunk and a few are not run:

- shrunk: the demo runs ``--steps 2`` (the README's step counts only lengthen training);
  ``examples/train_ddp.py``, ``train_fsdp2.py``, ``train_tp.py`` and ``finetune_trainer.py`` run ``--steps 3``;
  ``bench/overhead.py`` runs
  ``--ops 100 --repeats 3``; ``torchrun`` runs as ``python -m torch.distributed.run``
  (the same program, from this interpreter's torch);
- not run: see :data:`SKIPPED`, each with its reason; and a command written twice (the
  compare command is in README.md and docs/POLICIES.md) runs once, where it first appears.

They start in the order written, two at a time (this machine's two cores; each command is
mostly one process importing torch), but a command never starts while an earlier one that it
:func:`conflicts` with (a file both name, or torchrun's default port) is still running.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# README first, then the guides: the documents whose commands run, in this order
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]

# A command that starts with one of these is not run; why.
SKIPPED = {
    "python -m pip install": "installs the package: the test runs inside that install already",
    "python -m pytest": "the test suite itself, which runs this test",
    "python -m bench --quick": "takes minutes (every workload in three modes, in fresh processes)",
    "python -m bench.figures": "rewrites the tracked docs/report.png and takes a minute",
    "python -m bench": "takes minutes (adds torch.compile of every workload)",
    "python bench/scaling.py": "takes tens of minutes (three workloads at four widths, three modes, and the "
                               "launch-overhead table); tests/benchmarks/test_scaling_bench.py runs the smallest width",
    "python bench/op_coverage.py": "takes minutes (all of PyTorch's OpInfos in six configurations); "
                                   "tests/conformance/test_op_coverage.py runs it on a few ops",
    "python bench/hf_models.py": "takes minutes (every causal-LM architecture of transformers); "
                                 "tests/integrations/test_hf_models.py runs a few",
    "python bench/module_coverage.py": "takes minutes (every ModuleInfo of module_db in four configurations); "
                                       "tests/conformance/test_module_coverage.py runs a few modules",
    "python bench/torch_suites.py": "needs a PyTorch test/ folder, which is not part of this repository, and takes "
                                    "hours (upstream test files in three runs)",
}

SHRINK = (
    (r"(python -m adaptive_eager\.demo)((?: --\w+ \w+)*)", lambda m: m.group(1) + re.sub(r" --steps \d+", "", m.group(2)) + " --steps 2"),
    (r"(examples/(?:train_(?:ddp|fsdp2|tp)|finetune_trainer)\.py)", r"\1 --steps 3"),
    (r"(bench/overhead\.py)", r"\1 --ops 100 --repeats 3"),
    (r"^torchrun ", "python -m torch.distributed.run "),
)


def document_commands(path: Path) -> list[str]:
    """The shell commands of one document's bash blocks, in order (``a && b`` is two)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in line.split("&&")]
    return commands


def readme_commands() -> list[str]:
    """The commands of README.md, then of docs/*.md, in order."""
    return [command for path in DOCUMENTS for command in document_commands(path)]


def skipped_because(command: str) -> str | None:
    words = shlex.split(command)
    words = [w for w in words if not re.match(r"^[A-Z_]+=", w)]  # VAR=value prefixes
    text = " ".join(words)
    for prefix in sorted(SKIPPED, key=len, reverse=True):
        if text == prefix or text.startswith(prefix + " "):
            return SKIPPED[prefix]
    return None


def shrunk(command: str) -> str:
    for pattern, replacement in SHRINK:
        command = re.sub(pattern, replacement, command)
    return command


def test_the_skip_list_names_only_readme_commands():
    """Each skipped prefix still matches a command of the README or the docs (a stale
    entry would hide nothing), and the README still has commands to run."""
    commands = readme_commands()
    for prefix in SKIPPED:
        assert any(skipped_because(c) == SKIPPED[prefix] for c in commands), prefix
    assert sum(skipped_because(c) is None for c in commands) >= 10
    assert sum(skipped_because(c) is None for c in document_commands(README)) >= 8


LANES = 2  # commands running at once


def named_files(command: str) -> set:
    """The files a command names (``NEURON_FUSION_STATS=strict.json``, ``--html x.html``,
    the script it runs): what it may read or write."""
    words = [word.split("=", 1)[-1] for word in shlex.split(command)]
    return {word for word in words if re.search(r"\.(json|html|py|pt|png|txt)$", word)}


def conflicts(first: str, second: str) -> bool:
    """Whether two commands must not run at the same time: they name a common file, or both
    start torchrun (its default port, 29500)."""
    return bool(named_files(first) & named_files(second)) or (
        "torch.distributed.run" in first and "torch.distributed.run" in second)


def test_commands_that_share_a_file_or_the_port_conflict():
    stats = "NEURON_FUSION_STATS=strict.json NEURON_TRACE=strict_trace.json python -m adaptive_eager.demo --mode strict"
    assert conflicts(stats, "python -m adaptive_eager.stats strict.json adaptive.json")
    assert conflicts("python -m adaptive_eager.report strict.json adaptive.json --trace strict_trace.json", stats)
    assert conflicts(shrunk("torchrun --nproc-per-node 2 examples/train_ddp.py"),
                     shrunk("torchrun --nproc-per-node 2 examples/train_tp.py"))
    assert not conflicts("python -m adaptive_eager.demo --steps 2", "python examples/nki_kernel.py")
    # every command that reads what the demos wrote (the statistics and traces) waits for them
    commands = [shrunk(c) for c in readme_commands() if not skipped_because(c)]
    demos = [c for c in commands if "NEURON_FUSION_STATS=" in c]
    readers = [c for c in commands if "adaptive_eager.stats" in c or "adaptive_eager.report" in c]
    assert len(demos) == 2 and len(readers) == 4
    for reader in readers:
        for name in (name for name in named_files(reader) if name.endswith(".json")):  # (report.html: written)
            assert any(name in named_files(demo) and conflicts(reader, demo) for demo in demos), (reader, name)


def test_readme_commands_run_in_order(tmp_path):
    (tmp_path / "bench").symlink_to(ROOT / "bench")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bin_dir = tmp_path / ".bin"  # `python` is this interpreter
    bin_dir.mkdir()
    # a script, not a symlink: a symlink to a venv's python, found outside the venv's
    # bin/, starts the interpreter the venv was made from, without the venv's packages
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    logs = tmp_path / ".logs"
    logs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEURON_")}
    env["PATH"] = str(bin_dir) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(ROOT)  # `python -m bench...` from the scratch folder
    pending, seen = [], set()
    for command in readme_commands():
        if skipped_because(command) or command in seen:
            continue
        seen.add(command)
        pending.append(shrunk(command))
    ran, seconds, running = [], {}, {}  # running: command -> (process, start time, its log number)
    try:
        while pending or running:
            # start the next commands in order, while a lane is free and no earlier command
            # they conflict with is still running
            while pending and len(running) < LANES and not any(conflicts(pending[0], c) for c in running):
                command = pending.pop(0)
                n = len(ran) + len(running)
                with open(logs / f"{n}.out", "w") as out, open(logs / f"{n}.err", "w") as err:
                    process = subprocess.Popen(command, shell=True, cwd=tmp_path, env=env, stdout=out, stderr=err,
                                               text=True, start_new_session=True)
                running[command] = (process, time.perf_counter(), n)
            time.sleep(0.05)
            for command, (process, started, n) in list(running.items()):
                if process.poll() is None:
                    assert time.perf_counter() - started < 120, f"documented command timed out: {command}"
                    continue
                del running[command]
                out, err = (logs / f"{n}.out").read_text(), (logs / f"{n}.err").read_text()
                assert process.returncode == 0, f"documented command failed: {command}\n{out[-2000:]}\n{err[-3000:]}"
                ran.append(command)
                seconds[command] = round(time.perf_counter() - started, 1)
    finally:
        for process, _, _ in running.values():  # a failure leaves nothing running
            os.killpg(process.pid, 9)
            process.wait()
    print(seconds)  # pytest -s shows where the time goes
    assert (tmp_path / "report.html").stat().st_size > 10_000  # the last command of "Seeing what happened"
    assert any("adaptive_eager.stats strict.json adaptive.json" in c for c in ran)
    for example in ("train_ddp.py", "train_fsdp2.py", "train_tp.py", "finetune_trainer.py"):
        assert any(example in c for c in ran), example
    assert len(ran) == len(seen) >= 10


@pytest.mark.parametrize("command, expected", [
    ("NEURON_FUSION_STATS=a.json python -m adaptive_eager.demo --mode strict --steps 20",
     "NEURON_FUSION_STATS=a.json python -m adaptive_eager.demo --mode strict --steps 2"),
    ("python -m adaptive_eager.demo", "python -m adaptive_eager.demo --steps 2"),
    ("torchrun --nproc-per-node 2 examples/train_ddp.py", "python -m torch.distributed.run --nproc-per-node 2 examples/train_ddp.py --steps 3"),
    ("NEURON_ADAPTIVE_EAGER=1 python examples/finetune_trainer.py", "NEURON_ADAPTIVE_EAGER=1 python examples/finetune_trainer.py --steps 3"),
])
def test_commands_are_shrunk_not_changed(command, expected):
    assert shrunk(command) == expected


def test_the_screenshot_caption_matches_its_record():
    """The README's caption of docs/report.png quotes the figures docs/figures.json
    (written by python -m bench.figures) records, and points there for when and on what
    it was taken."""
    import json

    record = json.loads((ROOT / "docs" / "figures.json").read_text())["docs/report.png"]
    text = " ".join(README.read_text().split())
    figures = record["figures"]
    assert (f"(strict: {figures['strict']['ops_recorded']:,} ops and {figures['strict']['kernels_launched']:,} launches; "
            f"adaptive: {figures['adaptive']['kernels_launched']:,} launches); `docs/figures.json` records") in text


# A date, a commit hash in backticks, an issue number, a work session: provenance and history,
# which belong in bench/results/*.json (or nowhere), not in the prose users read.
PROVENANCE = re.compile(r"\b20\d\d-\d\d-\d\d\b|`(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}`"
                        r"|\b[Ii]ssues? #?\d+|\bthis (?:stop|session)\b|\b(?:first|second|third|fourth) session\b")


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: path.name)
def test_the_docs_hold_no_dated_provenance_or_issue_numbers(path):
    found = [f"{path.name}:{number}: {line.strip()}" for number, line in enumerate(path.read_text().splitlines(), 1)
             if PROVENANCE.search(line)]
    assert not found, "\n".join(found)
