"""The SLURM scripts of experiments/slurm/ (the paper's throughput studies on a GPU cluster),
checked here without SLURM or GPUs.

* Read: the ``#SBATCH`` directives, and the ``launch LABEL SYSTEM GPUS [flags]`` lines against
  experiments/paper_data/runs.csv (every run of the figure exactly once, in an allocation big
  enough for its largest run).
* Dry-run end to end: bash runs each script with fake ``srun``, ``scontrol``, ``torchrun`` and
  ``python`` first on PATH. The fake srun records its options and runs its command (once: the
  head node's task); the fake torchrun records its options and runs the workers' command,
  ``python -m MODULE ARGS --dry-run`` with WORLD_SIZE = nnodes x nproc_per_node. The test then
  checks every srun against the run of runs.csv it launched (node count, node list, rendezvous,
  world size = the paper's GPU count, the plan's model and batch) and that every dry run exited 0.

Importing torch takes about 2.5 s and the figures have 41 runs, so the dry runs go through a
small fork server that imports torch and experiments.throughput once and forks a child per
run, which executes the module as ``python -m`` does (runpy, ``__main__``, the run's argv, cwd
and environment); test_dry_run_server_matches_python_m checks it against a real ``python -m``.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.paper_values import paper_runs

ROOT = Path(__file__).resolve().parents[1]
SLURM = ROOT / "experiments" / "slurm"
GPUS_PER_NODE = 16
FIGURES = {"fig2_megatron.sbatch": ("Fig 2", "fig2"), "fig3_superlinear.sbatch": ("Fig 3", "fig3"),
           "fig4_no_mp.sbatch": ("Fig 4", "fig4"), "fig8_configs.sbatch": ("Fig 8", "fig8")}
JOB_ID = "4242"

# ----------------------------------------------------------------------------------- the fakes
RECORD = '''
import json, os

def record(entry):
    with open(os.environ["FAKE_RECORDS"], "a") as f:
        f.write(json.dumps(entry, default=str) + "\\n")
'''

FAKE_SCONTROL = '''
import os, re, sys
args = sys.argv[1:]
if args[:2] != ["show", "hostnames"]:
    sys.exit(f"fake scontrol: only `scontrol show hostnames` is expected, got {args}")
nodelist = args[2] if len(args) > 2 else os.environ["SLURM_JOB_NODELIST"]
match = re.fullmatch(r"(.*)\\[(\\d+)-(\\d+)\\]", nodelist)
if match:
    prefix, first, last = match.groups()
    print("\\n".join(f"{prefix}{i:0{len(first)}d}" for i in range(int(first), int(last) + 1)))
else:
    print("\\n".join(nodelist.split(",")))
'''

FAKE_SRUN = RECORD + '''
import subprocess, sys
VALUE = {"--nodes": "nodes", "-N": "nodes", "--ntasks": "ntasks", "-n": "ntasks",
         "--ntasks-per-node": "ntasks_per_node", "--nodelist": "nodelist", "-w": "nodelist",
         "--gpus-per-node": "gpus_per_node", "--cpus-per-task": "cpus_per_task", "-c": "cpus_per_task",
         "--export": "export", "--job-name": "job_name", "-J": "job_name"}
FLAG = {"--kill-on-bad-exit": "kill_on_bad_exit", "-K": "kill_on_bad_exit", "--exact": "exact",
        "--overlap": "overlap", "--label": "label", "-l": "label", "--unbuffered": "unbuffered", "-u": "unbuffered"}
argv, opts = sys.argv[1:], {}
while argv and argv[0].startswith("-"):
    key, eq, value = argv.pop(0).partition("=")
    if key in VALUE:
        opts[VALUE[key]] = value if eq else argv.pop(0)
    elif key in FLAG:
        opts[FLAG[key]] = value if eq else "1"
    else:
        sys.exit(f"fake srun: unknown option {key!r}")
if not argv:
    sys.exit("fake srun: no command")
with open(os.environ["FAKE_RECORDS"]) as f:
    index = sum(json.loads(line)["kind"] == "srun" for line in f)
record({"kind": "srun", "index": index, "opts": opts, "command": argv})
nodes = int(opts.get("nodes", os.environ["SLURM_JOB_NUM_NODES"]))
hosts = opts.get("nodelist")
if not hosts:
    listed = subprocess.run(["scontrol", "show", "hostnames"], capture_output=True, text=True, check=True).stdout
    hosts = ",".join(listed.split()[:nodes])
# one task runs here: the first node's (a real srun starts --ntasks of them)
env = dict(os.environ, SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NODELIST=hosts, SLURM_NNODES=str(nodes),
           SLURM_PROCID="0", SLURM_NODEID="0", SLURMD_NODENAME=hosts.split(",")[0], FAKE_SRUN_INDEX=str(index))
try:
    sys.exit(subprocess.run(argv, env=env).returncode)
except FileNotFoundError:
    sys.exit(f"fake srun: {argv[0]}: command not found")
'''

FAKE_TORCHRUN = RECORD + '''
import socket, sys
VALUE = ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts",
         "node_rank", "master_addr", "master_port", "monitor_interval")
argv, opts = sys.argv[1:], {}
while argv and argv[0] not in ("-m", "--module"):
    key, eq, value = argv.pop(0).partition("=")
    name = key.lstrip("-").replace("-", "_")
    if not key.startswith("--") or name not in VALUE:
        sys.exit(f"fake torchrun: unknown option {key!r}")
    opts[name] = value if eq else argv.pop(0)
if len(argv) < 2:
    sys.exit("fake torchrun: expected -m MODULE [ARGS]")
module, args = argv[1], argv[2:]
for name in ("nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id"):
    if name not in opts:
        sys.exit(f"fake torchrun: --{name} is missing")
nnodes, nproc = int(opts["nnodes"]), int(opts["nproc_per_node"])
world = nnodes * nproc
step_nodes = int(os.environ["SLURM_STEP_NUM_NODES"])
if nnodes != step_nodes:
    sys.exit(f"fake torchrun: --nnodes {nnodes}, but srun started {step_nodes} agents (one per node)")
host = opts["rdzv_endpoint"].rsplit(":", 1)[0]
if host not in os.environ["SLURM_STEP_NODELIST"].split(","):
    sys.exit(f"fake torchrun: the rendezvous host {host} is not a node of this step")
entry = {"kind": "torchrun", "srun": int(os.environ.get("FAKE_SRUN_INDEX", -1)), "opts": opts, "module": module,
         "args": args, "world_size": world}
if os.environ.get("FAKE_TORCHRUN_FAIL") == str(world):      # a crashed run, for the test of the script's failures
    record(entry | {"rc": 1})
    sys.exit("fake torchrun: failing as asked")
# the workers' command, once: python -m MODULE ARGS --dry-run (through the dry-run server)
work = os.environ["FAKE_WORK"]
stdout, stderr = (os.path.join(work, f"dry-run.{stream}") for stream in ("out", "err"))
env = dict(os.environ, WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(nproc))
request = {"module": module, "args": [*args, "--dry-run"], "env": env, "cwd": os.getcwd(),
           "stdout": stdout, "stderr": stderr}
with socket.socket(socket.AF_UNIX) as connection:
    connection.connect(os.environ["FAKE_DRYRUN_SOCKET"])
    connection.sendall((json.dumps(request) + "\\n").encode())
    rc = json.loads(connection.makefile().readline())["rc"]
out, err = open(stdout).read(), open(stderr).read()
sys.stdout.write(out)
sys.stderr.write(err)
record(entry | {"rc": rc, "stdout": out, "stderr": err})
sys.exit(rc)
'''

FAKE_PYTHON = RECORD + '''
import argparse, sys
argv = sys.argv[1:]
if argv[:2] != ["-m", "experiments.reproduce"]:
    sys.exit(f"fake python: only `python -m experiments.reproduce` is expected here, got {argv}")
from experiments import reproduce

class Parsed(Exception):
    pass

parse_args = argparse.ArgumentParser.parse_args

def parse_only(self, args=None, namespace=None):   # parse (exit 2 on a bad argument), then stop
    raise Parsed(parse_args(self, args, namespace))

argparse.ArgumentParser.parse_args = parse_only
try:
    reproduce.main(argv[2:])
except Parsed as parsed:
    record({"kind": "python", "module": argv[1], "argv": argv[2:], "parsed": vars(parsed.args[0])})
else:
    sys.exit("fake python: experiments.reproduce.main ran without parsing its arguments")
'''

DRYRUN_SERVER = '''
import json, os, runpy, socket, sys, traceback
import torch  # noqa: F401  (the slow import, once)
import experiments.paper_values, experiments.throughput  # noqa: F401

path = sys.argv[1]
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(4)
server.settimeout(600)   # idle for 10 minutes: the test is gone, so go too
open(path + ".ready", "w").close()
while True:
    try:
        connection, _ = server.accept()
    except TimeoutError:
        break
    connection.settimeout(None)
    request = json.loads(connection.makefile().readline())
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:      # the child: `python -m MODULE ARGS` in the run's cwd and environment
        code = 1
        try:
            server.close()
            connection.close()
            os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.argv = [request["module"], *request["args"]]
            sys.modules.pop(request["module"], None)    # as `python -m` finds it: not imported yet
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    connection.sendall((json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\\n").encode())
    connection.close()
'''


class Harness:
    """A folder of fakes on PATH and the dry-run server; ``run`` executes one script with bash."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.bin = folder / "bin"
        self.bin.mkdir()
        for name, source in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("torchrun", FAKE_TORCHRUN),
                             ("python", FAKE_PYTHON)):
            code = folder / f"fake_{name}.py"
            code.write_text(source)
            wrapper = self.bin / name
            wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(code))} \"$@\"\n")
            wrapper.chmod(0o755)
        self.socket = str(folder / "dry-run.sock")
        (folder / "server.py").write_text(DRYRUN_SERVER)
        self.server_log = open(folder / "server.log", "w")  # noqa: SIM115  (closed by close())
        self.server = subprocess.Popen([sys.executable, str(folder / "server.py"), self.socket], cwd=ROOT,
                                       stdout=self.server_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket + ".ready"):
            assert self.server.poll() is None, (folder / "server.log").read_text()
            assert time.monotonic() < deadline, "the dry-run server did not start"
            time.sleep(0.05)
        self.runs = 0

    def env(self, work: Path, nodes: int, **extra: str) -> dict:
        return {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
                "HOME": os.environ.get("HOME", str(work)), "LANG": "C.UTF-8",
                "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": f"dgx[001-{nodes:03d}]",
                "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes), "SLURM_CPUS_ON_NODE": "96",
                "SLURM_SUBMIT_DIR": str(work), "FAKE_RECORDS": str(work / "records.jsonl"), "FAKE_WORK": str(work),
                "FAKE_DRYRUN_SOCKET": self.socket} | extra

    def workdir(self, name: str) -> Path:
        self.runs += 1
        work = self.folder / f"{self.runs}-{name}"
        work.mkdir()
        (work / "records.jsonl").touch()
        return work

    def run(self, script: Path, **extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
        """bash SCRIPT in a fresh folder, as sbatch would on an allocation of its --nodes."""
        work = self.workdir(script.stem)
        nodes = int(directives(script)["nodes"])
        proc = subprocess.run(["bash", str(script)], cwd=work, env=self.env(work, nodes, **extra),
                              capture_output=True, text=True, timeout=120, check=False)
        records = [json.loads(line) for line in (work / "records.jsonl").read_text().splitlines()]
        return proc, records

    def close(self) -> None:
        self.server.terminate()
        self.server.wait(timeout=10)
        self.server_log.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    harness = Harness(tmp_path_factory.mktemp("slurm"))
    yield harness
    harness.close()


# ------------------------------------------------------------------------ reading the scripts
def directives(path: Path) -> dict[str, str | None]:
    """The ``#SBATCH`` options (``--exclusive`` -> None); sbatch reads them only above the first
    command, so one below it is an error here."""
    found: dict[str, str | None] = {}
    commands = False
    for number, line in enumerate(path.read_text().splitlines()[1:], start=2):
        if line.startswith("#SBATCH"):
            assert not commands, f"{path.name}:{number}: #SBATCH below the first command is ignored by sbatch"
            for option in shlex.split(line[len("#SBATCH"):]):
                key, eq, value = option.partition("=")
                assert key.startswith("--"), f"{path.name}:{number}: write #SBATCH options as --name=value"
                found[key[2:]] = value if eq else None
        elif line.strip() and not line.startswith("#"):
            commands = True
    return found


def launched(path: Path) -> list[tuple[str, str, str, int]]:
    """(label, system, ZeRO config or "", GPUs) of each ``launch LABEL SYSTEM GPUS [flags]`` line."""
    runs = []
    for line in re.findall(r"^launch\s+(.*)$", path.read_text(), re.MULTILINE):
        label, system, gpus, *flags = shlex.split(line, comments=True)
        config = flags[flags.index("--config") + 1] if "--config" in flags else ""
        runs.append((label, system, config, int(gpus)))
    return runs


def paper(figure: str) -> dict[tuple[str, str, str, int], dict]:
    """The runs of ``figure`` in runs.csv by (label, system, ZeRO config or "", GPUs)."""
    rows = [r for r in paper_runs() if r["figure"] == figure]
    keyed = {(r["label"], r["system"], r["zero_config"], r["gpus"]): r for r in rows}
    assert len(keyed) == len(rows) > 0, f"runs.csv: {figure}'s runs are not told apart by label, system, config, GPUs"
    return keyed


def check_directives(path: Path, figure: str) -> None:
    found = directives(path)
    for key in ("nodes", "ntasks-per-node", "gpus-per-node", "exclusive", "time", "output"):
        assert key in found, f"{path.name}: no #SBATCH --{key}"
    assert int(found["gpus-per-node"]) == GPUS_PER_NODE and int(found["ntasks-per-node"]) == 1, found
    assert found["output"] == "results/cluster/slurm-%j.out", found["output"]
    text = path.read_text()
    assert "set -euo pipefail" in text
    per_node = re.search(r"^GPUS_PER_NODE=(\d+)$", text, re.MULTILINE)
    assert per_node and per_node[1] == found["gpus-per-node"], "GPUS_PER_NODE differs from #SBATCH --gpus-per-node"
    runs = launched(path)
    expected = paper(figure)
    missing = set(expected) - set(runs)
    extra = collections.Counter(runs) - collections.Counter(expected.keys())
    assert not missing and not extra, f"{path.name}: runs of runs.csv not launched: {sorted(missing)}; launched " \
                                      f"but not in runs.csv, or more than once: {sorted(extra)}"
    largest = max(gpus for *_, gpus in runs)
    nodes = int(found["nodes"])
    assert nodes * GPUS_PER_NODE >= largest, f"{path.name}: --nodes={nodes} cannot hold the run on {largest} GPUs"
    assert (nodes - 1) * GPUS_PER_NODE < largest, f"{path.name}: --nodes={nodes} is more than its largest run needs"


def check_dry_run(proc: subprocess.CompletedProcess, records: list[dict], path: Path, figure: str, tag: str) -> None:
    """Every srun launched one run of ``figure`` of runs.csv, on its GPU count, and its dry run
    exited 0; every run was launched exactly once."""
    from experiments import throughput
    from zero_ref.analysis.presets import PAPER_CONFIGS

    log = f"\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}{log}"
    allocation = int(directives(path)["nodes"])
    hosts = [f"dgx{i:03d}" for i in range(1, allocation + 1)]
    sruns = [r for r in records if r["kind"] == "srun"]
    torchruns = {r["srun"]: r for r in records if r["kind"] == "torchrun"}
    assert sorted(torchruns) == list(range(len(sruns))), f"not one torchrun per srun{log}"
    expected = paper(figure)
    seen: collections.Counter = collections.Counter()
    rendezvous = set()
    for srun in sruns:
        opts, torchrun = srun["opts"], torchruns[srun["index"]]
        where = f"{path.name}, srun {srun['index']} ({shlex.join(srun['command'])})"
        nodes = int(opts["nodes"])
        assert int(opts["ntasks"]) == nodes and int(opts.get("ntasks_per_node", 1)) == 1, f"{where}: one task per node"
        assert nodes <= allocation, f"{where}: {nodes} nodes, the allocation has {allocation}"
        assert opts.get("nodelist", "").split(",") == hosts[:nodes], f"{where}: node list {opts.get('nodelist')}"
        t = torchrun["opts"]
        assert (int(t["nnodes"]), int(t["nproc_per_node"])) == (nodes, GPUS_PER_NODE), f"{where}: {t}"
        assert t["rdzv_backend"] == "c10d" and t["rdzv_endpoint"] == f"{hosts[0]}:29500", f"{where}: {t}"
        assert t["rdzv_id"].startswith(f"{JOB_ID}-") and t["rdzv_id"] not in rendezvous, f"{where}: {t['rdzv_id']}"
        rendezvous.add(t["rdzv_id"])
        assert torchrun["module"] == "experiments.throughput", where
        assert torchrun["rc"] == 0, f"{where}: the dry run exited {torchrun['rc']}:\n{torchrun.get('stderr')}"
        args = throughput.parse(torchrun["args"])
        world = torchrun["world_size"]
        key = (args.label, args.system, args.config or "", world)
        assert args.paper == figure and key in expected, f"{where}: {key} on {world} GPUs is no run of {figure}"
        seen[key] += 1
        row = expected[key]
        assert nodes * GPUS_PER_NODE >= row["gpus"] == world, where
        plan = json.loads(torchrun["stdout"].strip().splitlines()[-1])
        assert plan["world_size"] == row["gpus"] and plan["out"] == f"results/cluster/{tag}", f"{where}: {plan}"
        spec = plan["spec"]
        assert (spec["layers"], spec["hidden"], spec["heads"], spec["mp"], spec["batch"]) == \
            (row["layers"], row["hidden"], row["heads"], row["mp"], row["batch_per_gpu"]), f"{where}: {spec} vs {row}"
        if row["zero_config"]:
            preset = PAPER_CONFIGS[row["zero_config"]]
            assert (spec["stage"], spec["checkpoints"], spec["md"]) == (preset.stage, preset.checkpoints, preset.md)
        else:
            assert spec["stage"] == (2 if row["system"] == "ZeRO" else 0), f"{where}: {spec}"
    twice = [key for key, n in seen.items() if n > 1]
    missing = sorted(set(expected) - set(seen))
    assert not twice and not missing, f"{path.name}: launched more than once: {twice}; never launched: {missing}"


# ---------------------------------------------------------------------------------------- tests
def test_every_script_is_covered():
    assert sorted(p.name for p in SLURM.glob("*.sbatch")) == sorted([*FIGURES, "memory.sbatch"])


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_directives_and_runs_match_the_paper(name):
    check_directives(SLURM / name, FIGURES[name][0])


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_dry_run_launches_every_run(harness, name):
    path = SLURM / name
    figure, tag = FIGURES[name]
    proc, records = harness.run(path)
    check_dry_run(proc, records, path, figure, tag)


def test_a_missing_run_fails_both_checks(harness, tmp_path):
    path = tmp_path / "fig4_no_mp.sbatch"
    path.write_text((SLURM / "fig4_no_mp.sbatch").read_text().replace("launch 13B ZeRO 128\n", ""))
    with pytest.raises(AssertionError, match="13B"):
        check_directives(path, "Fig 4")
    proc, records = harness.run(path)
    with pytest.raises(AssertionError, match="13B"):
        check_dry_run(proc, records, path, "Fig 4", "fig4")


def test_a_failed_run_does_not_stop_the_others(harness):
    proc, records = harness.run(SLURM / "fig3_superlinear.sbatch", FAKE_TORCHRUN_FAIL="256")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [r["rc"] for r in records if r["kind"] == "torchrun"] == [0, 0, 1, 0]
    assert "failed: 60B ZeRO on 256 GPUs" in proc.stdout


def test_dry_run_server_matches_python_m(harness):
    """The fake torchrun's dry run (through the fork server) prints what `python -m` prints."""
    args = ["--paper", "Fig 3", "--label", "60B", "--system", "ZeRO", "--batch", "48", "--out", "results/cluster/fig3"]
    real = subprocess.run([sys.executable, "-m", "experiments.throughput", *args, "--dry-run"], cwd=ROOT,
                          env=dict(os.environ, WORLD_SIZE="128"), capture_output=True, text=True, timeout=60,
                          check=False)
    assert real.returncode == 0, real.stderr
    work = harness.workdir("server-check")
    env = harness.env(work, 8, SLURM_STEP_NUM_NODES="8", SLURM_STEP_NODELIST="dgx001,dgx002")
    torchrun = ["torchrun", "--nnodes", "8", "--nproc_per_node", "16", "--rdzv_backend", "c10d",
                "--rdzv_endpoint", "dgx001:29500", "--rdzv_id", "x", "-m", "experiments.throughput"]
    fake = subprocess.run([*torchrun, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert fake.returncode == 0, fake.stderr
    assert json.loads(fake.stdout) == json.loads(real.stdout) and fake.stderr == real.stderr
    # and a bad argument fails the same way
    bad = subprocess.run([*torchrun, "--paper", "Fig 3", "--label", "61B"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "no run '61B'" in bad.stderr


def test_memory_script(harness):
    path = SLURM / "memory.sbatch"
    found = directives(path)
    assert found.get("nodes") == "1" and found.get("ntasks-per-node") == "1", found
    assert "gpus-per-node" not in found and "time" in found and found.get("output") == "results/cluster/slurm-%j.out"
    proc, records = harness.run(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sruns = [r for r in records if r["kind"] == "srun"]
    pythons = [r for r in records if r["kind"] == "python"]
    assert len(sruns) == 1 and (sruns[0]["opts"]["nodes"], sruns[0]["opts"]["ntasks"]) == ("1", "1"), sruns
    assert len(pythons) == 1 and pythons[0]["module"] == "experiments.reproduce", pythons
    assert pythons[0]["parsed"]["only"] == ["memory"], pythons


def test_fake_python_rejects_what_reproduce_rejects(harness):
    work = harness.workdir("fake-python")
    env = harness.env(work, 1)
    bad = subprocess.run(["python", "-m", "experiments.reproduce", "--only", "memoryy"], cwd=work, env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr, bad.stderr
