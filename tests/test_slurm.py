"""The Slurm launchers under a real Slurm (tests/slurm_cluster.py: two slurmd posing as two
nodes on this host): scripts/train_slurm.sbatch, the planner's plan.sbatch and
scripts/train_torchrun.sh on two "nodes", pre-emption, requeue, a time-limit warning, a job
resumed on fewer nodes, and bad input. Every loss is compared with a plain torchrun run of the
same flags on this host (no Slurm). docs/slurm.md tells the story; ``make test-slurm`` runs
this file alone. Skipped where Slurm is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests import slurm_cluster

_WHY = slurm_cluster.missing()
if _WHY:
    pytest.skip(f"Slurm tests: {_WHY}", allow_module_level=True)

from megatron_2bw.logparse import parse_log  # noqa: E402
from megatron_2bw.runtime.ports import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_slurm.sbatch"
ITERS = 24
TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(ITERS),
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", "2", "--weight-decay", "0.01", "--clip-grad", "1.0",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "1234", "--pipeline-schedule",
        "2bw", "--tensor-model-parallel-size", "1"]
PP2 = TINY + ["--pipeline-model-parallel-size", "2"]
DP2 = TINY + ["--pipeline-model-parallel-size", "1", "--use-distributed-optimizer"]
# the scripts' variables; the flags above override the defaults they give
SCRIPT_ENV = {"MODEL": "gpt-tiny", "SCHEDULE": "2bw", "CPU": "1", "PRECISION": "fp32",
              "MOCK_DATA": "1", "REPO": str(REPO), "RDZV_TIMEOUT": "30"}
KILL_WAIT = 5
_DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def _base_env() -> dict[str, str]:
    """This environment without the test suite's strict-mode hooks (jobs are killed mid-way)
    nor a caller's launcher variables."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "MEGATRON_2BW_STRICT"))
           and k not in ("NODES", "NNODES", "NODE_RANK", "GPUS_PER_NODE", "TP", "PP")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and Path(p).name != "strict"]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *paths])
    env["MEGATRON_2BW_STRICT"] = "0"
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def cluster():
    """A 2-node cluster for this module; down (nothing left running) also when a test fails."""
    root = Path(tempfile.mkdtemp(prefix="megatron-2bw-slurm-"))
    up = slurm_cluster.Cluster(root, nodes=2)
    try:
        up.up()
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    yield up
    up.down()


def losses(text: str) -> dict[int, float]:
    """iteration -> lm loss, from every training log line in ``text``."""
    return {r.iteration: r.loss for r in parse_log(text).iterations}


def torchrun(flags: list[str], procs: int, timeout: float = 240) -> dict[int, float]:
    """The reference: the entry script under plain torchrun on this host, no Slurm."""
    command = [str(REPO / ".venv" / "bin" / "python"), "-m", "torch.distributed.run",
               "--nproc-per-node", str(procs), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(REPO / "pretrain_gpt_2bw.py"),
               *flags, "--cpu", "--mock-data"]
    done = subprocess.run(command, env=_base_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses(done.stdout)


@pytest.fixture(scope="module")
def reference_pp2():
    return torchrun(PP2, 2)


@pytest.fixture(scope="module")
def reference_dp2():
    return torchrun(DP2, 2)


class Job:
    """One submitted batch job: its id, its output file, its cluster."""

    def __init__(self, cluster, workdir: Path, script: Path, flags: list[str],
                 sbatch: list[str], **env: str):
        self.cluster, self.out = cluster, workdir / "job.out"
        environment = {**_base_env(), **cluster_env(cluster), **SCRIPT_ENV,
                       "MASTER_PORT": str(free_port()), **env}
        done = subprocess.run(["sbatch", "--parsable", "--output", str(self.out),
                               "--open-mode=append", *sbatch, str(script), *flags],
                              cwd=workdir, env=environment, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        self.id = done.stdout.strip().split(";")[0]

    def show(self) -> dict[str, str]:
        """scontrol show job, as name -> value."""
        text = self.cluster.run("scontrol", "show", "job", self.id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, timeout: float = 120) -> dict[str, str]:
        """Poll until the job has ended (sbatch --wait polls slowly); its scontrol fields."""
        deadline = time.monotonic() + timeout
        while (fields := self.show()).get("JobState") not in _DONE:
            assert time.monotonic() < deadline, f"job {self.id} still {fields.get('JobState')}"
            time.sleep(0.3)
        return fields

    def log(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        """The first match of ``pattern`` in the job's output, once it is there."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.log(), re.M)):
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.out}:\n{self.log()}"
            assert self.show().get("JobState") not in _DONE, self.log()[-3000:]
            time.sleep(0.2)
        return found


def cluster_env(cluster) -> dict[str, str]:
    return {"SLURM_CONF": str(cluster.conf)}


def assert_same(got: dict[int, float], reference: dict[int, float], rtol: float = 0.0):
    """Every iteration the job logged has the reference run's loss (``rtol``: relative)."""
    assert got, "the job logged no loss"
    for iteration, loss in sorted(got.items()):
        expected = reference[iteration]
        assert abs(loss - expected) <= rtol * abs(expected), (iteration, loss, expected)


def no_processes_of(cluster) -> list[str]:
    """Processes started under this cluster's SLURM_CONF still running (ranks, torchrun)."""
    marker = f"SLURM_CONF={cluster.conf}".encode()
    left = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    left.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
            except OSError:
                pass
    return left


def checkpoint_stop(log: str) -> int:
    """The iteration a signalled run saved and stopped at (both lines, in that order)."""
    found = re.search(r"saved checkpoint at iteration (\d+) .*\n(?:.*\n)*? stopping at "
                      r"iteration \1 \(SIGTERM\)", log)
    assert found, log[-3000:]
    return int(found[1])


def pp2_job(cluster, workdir: Path, save: Path, nodes: int, *sbatch: str) -> Job:
    """PP = 2 on ``nodes`` nodes (2 / nodes ranks each) through train_slurm.sbatch."""
    workdir.mkdir(exist_ok=True)
    return Job(cluster, workdir, SCRIPT, PP2, ["--nodes", str(nodes), *sbatch],
               GPUS_PER_NODE=str(2 // nodes), PP="2", SAVE=str(save), LOAD=str(save))


def test_the_cluster_has_two_nodes(cluster):
    done = cluster.run("srun", "--nodes", "2", "--label", "printenv", "SLURM_NODEID",
                       timeout=30)
    assert done.returncode == 0, done.stderr
    assert sorted(line.split(":")[-1].strip() for line in done.stdout.splitlines()) == ["0", "1"]


def test_requeued_two_node_pp2_job_logs_the_uninterrupted_losses(cluster, tmp_path,
                                                                 reference_pp2):
    """sbatch --requeue, PP = 2 with one rank per node; scontrol requeue mid-run: the ranks
    save before KillWait, the requeued job resumes with the same flags and logs, over both
    parts, exactly the losses of plain torchrun."""
    save = tmp_path / "checkpoints"
    job = pp2_job(cluster, tmp_path / "job", save, 2, "--requeue")
    job.wait_for(r"iteration\s+3/")
    assert cluster.run("scontrol", "requeue", job.id).returncode == 0
    fields = job.wait(180)
    log = job.log()
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1",
                                                                            "0:0"), log[-3000:]
    assert "SLURM_RESTART_COUNT=0," in log and "SLURM_RESTART_COUNT=1," in log
    stopped = checkpoint_stop(log)
    assert f"resumed from {save} at iteration {stopped}" in log
    got = losses(log)
    assert sorted(got) == list(range(1, ITERS + 1))
    assert_same(got, reference_pp2)


def test_cancelled_on_two_nodes_resubmitted_on_one_goes_on_exactly(cluster, tmp_path,
                                                                  reference_pp2):
    """scancel of a running 2-node job (pre-emption): every rank saves and exits before
    KillWait; resubmitted on one node with the same layout (PP = 2, both ranks there) it
    resumes and the losses of both jobs are plain torchrun's."""
    save = tmp_path / "checkpoints"
    first = pp2_job(cluster, tmp_path / "first", save, 2)
    first.wait_for(r"iteration\s+3/")
    cancelled = time.monotonic()
    assert cluster.run("scancel", first.id).returncode == 0
    assert first.wait(60)["JobState"] == "CANCELLED"
    assert time.monotonic() - cancelled < KILL_WAIT + 8
    stopped = checkpoint_stop(first.log())
    assert (save / f"iter_{stopped:07d}").is_dir()
    second = pp2_job(cluster, tmp_path / "second", save, 1)
    fields = second.wait(120)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), second.log()[-3000:]
    assert f"resumed from {save} at iteration {stopped}" in second.log()
    got = {**losses(first.log()), **losses(second.log())}
    assert sorted(got) == list(range(1, ITERS + 1))
    assert_same(got, reference_pp2)


def test_train_torchrun_on_two_nodes_of_one_host(tmp_path, reference_pp2):
    """scripts/train_torchrun.sh with NNODES=2 and NODE_RANK=0/1 (one rank each, PP = 2)."""
    env = {**_base_env(), **SCRIPT_ENV, "NNODES": "2", "GPUS_PER_NODE": "1", "PP": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    nodes = [subprocess.Popen(["bash", str(REPO / "scripts" / "train_torchrun.sh"), *PP2],
                              env={**env, "NODE_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    got = losses(outputs[1])  # the last stage logs: rank 1, on node 1
    assert sorted(got) == list(range(1, ITERS + 1))
    assert_same(got, reference_pp2)
