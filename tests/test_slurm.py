"""The Slurm launchers under a real Slurm (tests/slurm_cluster.py: two slurmd posing as two
nodes on this host): scripts/train_slurm.sbatch, the planner's plan.sbatch and
scripts/train_torchrun.sh on two "nodes", pre-emption, requeue, a time-limit warning, a job
resumed on fewer nodes, and bad input. Every loss is compared with a plain torchrun run of the
same flags on this host (no Slurm). docs/slurm.md tells the story; ``make test-slurm`` runs
this file alone. Skipped where Slurm is not installed.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests import slurm_cluster

_WHY = slurm_cluster.missing()
if _WHY:
    pytest.skip(f"Slurm tests: {_WHY}", allow_module_level=True)

from megatron_2bw.logparse import parse_log  # noqa: E402
from megatron_2bw.runtime.ports import free_port  # noqa: E402
from tests import dist as launch  # noqa: E402

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
# without dropout: its masks are drawn per data-parallel rank, so a run resumed at another DP
# would draw others
DP2 = TINY + ["--pipeline-model-parallel-size", "1", "--use-distributed-optimizer",
              "--attention-dropout", "0", "--hidden-dropout", "0"]
# the scripts' variables; the flags above override the defaults they give
SCRIPT_ENV = {"MODEL": "gpt-tiny", "SCHEDULE": "2bw", "CPU": "1", "PRECISION": "fp32",
              "MOCK_DATA": "1", "REPO": str(REPO), "RDZV_TIMEOUT": "30"}
KILL_WAIT = 10  # tests/slurm_cluster.py: the ranks save and exit well within it
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
def cluster(tmp_path_factory):
    """A 2-node cluster for this module; down (nothing left running) also when a test fails.
    Its config, state and daemon logs stay in pytest's temporary directory."""
    up = slurm_cluster.Cluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        up.up()
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    yield up
    up.down()


def losses(text: str) -> dict[int, float]:
    """iteration -> lm loss, from every training log line in ``text``."""
    return {r.iteration: r.loss for r in parse_log(text).iterations}


def torchrun(flags: list[str], procs: int) -> dict[int, float]:
    """The reference: the entry script under plain torchrun on this host, no Slurm."""
    done = launch.torchrun(["pretrain_gpt_2bw.py", *flags, "--cpu", "--mock-data"], procs,
                           timeout=240)
    assert done.returncode == 0, done.tail()
    return losses(done.output)


@pytest.fixture(scope="module")
def references():
    """Both references, run one after the other in the background from the first test that
    asks (they overlap the Slurm jobs' waits: a requeued job pends for a while)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield {"pp2": pool.submit(torchrun, PP2, 2), "dp2": pool.submit(torchrun, DP2, 2)}


@pytest.fixture
def reference_pp2(references):
    return references["pp2"]


@pytest.fixture
def reference_dp2(references):
    return references["dp2"]


class Job:
    """One submitted batch job: its id, its output file (appended to by each start: the
    scripts' --open-mode), its cluster."""

    def __init__(self, cluster, workdir: Path, script: Path, flags: list[str],
                 sbatch: list[str], **env: str):
        self.cluster, self.out = cluster, workdir / "job.out"
        environment = {**_base_env(), **cluster_env(cluster), **SCRIPT_ENV,
                       "MASTER_PORT": str(free_port()), **env}
        done = subprocess.run(["sbatch", "--parsable", "--output", str(self.out), *sbatch,
                               str(script), *flags],
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


def assert_same(got: dict[int, float], reference: concurrent.futures.Future,
                rtol: float = 0.0):
    """Every iteration the job logged has the reference run's loss (``rtol``: relative)."""
    assert got, "the job logged no loss"
    reference = reference.result(timeout=300)
    for iteration, loss in sorted(got.items()):
        expected = reference[iteration]
        assert abs(loss - expected) <= rtol * abs(expected), (iteration, loss, expected)


def ranks_of(path: Path) -> list[int]:
    """The ranks (``python -u pretrain_gpt_2bw.py``, and their data workers) whose command
    line holds ``path`` (a job's --save PATH); not torchrun or srun."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if len(argv) > 2 and argv[2].endswith(b"_2bw.py") and str(path).encode() in argv:
            found.append(int(entry.name))
    return found


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
    ranks = ranks_of(save)
    assert len(ranks) >= 2  # a rank (and its data workers) on each node
    cancelled = time.monotonic()
    assert cluster.run("scancel", first.id).returncode == 0
    while ranks_of(save) and time.monotonic() - cancelled < 3 * KILL_WAIT:
        time.sleep(0.1)
    took = time.monotonic() - cancelled
    assert took < KILL_WAIT, f"ranks still running {took:.1f} s after scancel"  # no SIGKILL
    assert first.wait(60)["JobState"] == "CANCELLED"
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


def plan_script(workdir: Path) -> Path:
    """tools/plan.py's plan.sbatch for the tiny GPT on one CPU node of 2 processes."""
    done = subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), str(REPO / "tools" / "plan.py"),
         "--cluster", "cpu-local", "--nodes", "1", "--gpus-per-node", "2", "--num-layers", "4",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "128", "--global-batch-size", "8", "--precision", "fp32",
         "--schedules", "2bw", "--micro-batch-sizes", "2", "--use-distributed-optimizer",
         "--out", str(workdir / "plan")], env=_base_env(), capture_output=True, text=True,
        timeout=120)
    assert done.returncode == 0, done.stderr
    return workdir / "plan" / "plan.sbatch"


def test_plan_sbatch_on_one_cpu_node_logs_the_losses_of_torchrun(cluster, tmp_path,
                                                                 reference_dp2):
    """The planner's plan.sbatch as written (no GPU request for a CPU plan): its layout
    (DP = 2, distributed optimizer) trains as plain torchrun does."""
    script = plan_script(tmp_path)
    assert "--gpus-per-node" not in script.read_text()
    flags = (tmp_path / "plan" / "flags.txt").read_text().split()
    assert "--use-distributed-optimizer" in flags
    assert flags[flags.index("--pipeline-model-parallel-size") + 1] == "1"
    at = TINY.index("--tensor-model-parallel-size")
    training = TINY[:at] + TINY[at + 2:] + DP2[-4:]  # the layout is the plan's
    job = Job(cluster, tmp_path, script, training, [],
              DATA_ARGS="--mock-data --vocab-size 128")
    fields = job.wait(120)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), job.log()[-3000:]
    assert "TP=1 PP=1 DP=2" in job.log()
    got = losses(job.log())
    assert sorted(got) == list(range(1, ITERS + 1))
    assert_same(got, reference_dp2)


def test_saved_at_dp2_on_two_nodes_resumes_at_dp1_on_one(cluster, tmp_path, reference_dp2):
    """A job that lost a node goes on: cancelled at DP = 2 with the distributed optimizer
    (one rank per node), resubmitted at DP = 1 with the same global batch on one node (the
    optimizer state resharded): the losses are torchrun's at DP = 2 within 1e-5."""
    save = tmp_path / "checkpoints"
    env = {"GPUS_PER_NODE": "1", "PP": "1", "SAVE": str(save), "LOAD": str(save)}
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    first = Job(cluster, tmp_path / "first", SCRIPT, DP2, ["--nodes", "2"], **env)
    first.wait_for(r"iteration\s+3/")
    assert cluster.run("scancel", first.id).returncode == 0
    assert first.wait(60)["JobState"] == "CANCELLED"
    stopped = checkpoint_stop(first.log())
    second = Job(cluster, tmp_path / "second", SCRIPT, DP2, ["--nodes", "1"], **env)
    fields = second.wait(120)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), second.log()[-3000:]
    assert "TP=1 PP=1 DP=1" in second.log()
    assert f"resumed from {save} at iteration {stopped}" in second.log()
    got = {**losses(first.log()), **losses(second.log())}
    assert sorted(got) == list(range(1, ITERS + 1))
    assert_same(got, reference_dp2, rtol=1e-5)


def test_time_limit_warning_saves_before_the_limit_and_requeues(cluster, tmp_path):
    """sbatch --time=2 --signal=B:USR1@10 --requeue, the warning sent as Slurm sends it (to
    the batch shell alone) once training runs (Slurm's own comes at its controller's next
    pass, up to ~30 s early: maybe before the ranks are up): the script forwards it to the
    ranks as SIGTERM, they save and stop, the script exits with the requeue status and
    requeues the job (its resumption is the requeue test's); nothing reaches the limit."""
    save = tmp_path / "checkpoints"
    flags = [*TINY, "--pipeline-model-parallel-size", "1", "--train-iters", "100000"]
    job = Job(cluster, tmp_path, SCRIPT, flags,
              ["--nodes", "1", "--time", "2", "--signal", "B:USR1@10", "--requeue"],
              GPUS_PER_NODE="1", PP="1", SAVE=str(save), LOAD=str(save))
    job.wait_for(r"iteration\s+3/")
    assert cluster.run("scancel", "--batch", "--signal=USR1", job.id).returncode == 0
    job.wait_for(rf"requeueing job {job.id}", timeout=90)
    deadline = time.monotonic() + 30
    while (fields := job.show())["Restarts"] != "1":  # back in the queue, to start anew
        assert time.monotonic() < deadline, fields
        time.sleep(0.3)
    log = job.log()
    assert "time limit near (SIGUSR1)" in log and "DUE TO TIME LIMIT" not in log
    assert "exit 75: resubmit or requeue to resume" in log
    assert (save / f"iter_{checkpoint_stop(log):07d}").is_dir()
    assert cluster.run("scancel", job.id).returncode == 0  # its resumption: the requeue test
    assert job.wait(60)["JobState"] == "CANCELLED"


def one_error_line(log: str, expected: str) -> None:
    """The job says what went wrong in an ``error:`` line naming ``expected``."""
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert any(expected in line for line in errors), log[-3000:]


def node2_wrapper(tmp_path: Path, node2: str) -> str:
    """A TORCHRUN for the job: node 2 runs ``node2`` (bash, "$@" the torchrun arguments)."""
    wrapper = tmp_path / "torchrun-wrapper.sh"
    torchrun_path = REPO / ".venv" / "bin" / "torchrun"
    wrapper.write_text(f'#!/bin/bash\nif [[ $SLURM_NODEID == 1 ]]; then\n    {node2}\nfi\n'
                       f'exec {torchrun_path} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_more_nodes_than_the_partition_has_is_refused_at_submission(cluster, tmp_path):
    done = cluster.run("sbatch", "--nodes", "3", str(SCRIPT), cwd=tmp_path,
                       env={**_base_env(), **cluster_env(cluster)})
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("sbatch: error: ")
    assert cluster.run("squeue", "-h").stdout.strip() == ""


def test_a_rendezvous_address_that_does_not_resolve_is_one_line(cluster, tmp_path):
    job = Job(cluster, tmp_path, SCRIPT, PP2, ["--nodes", "2"], GPUS_PER_NODE="1", PP="2",
              RDZV_ADDR="no-such-host.invalid")
    fields = job.wait(30)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0")
    one_error_line(job.log(), "the rendezvous address no-such-host.invalid does not resolve")
    assert "Traceback" not in job.log() and "srun" not in job.log()


def test_data_missing_on_one_node_ends_the_job_with_its_error(cluster, tmp_path,
                                                              tiny_gpt_data):
    """The data directory is hidden from node 2 (a tmpfs over it in a mount namespace of its
    own): its rank says what is missing in one line and the job ends, nothing hangs."""
    data_dir = Path(tiny_gpt_data.data_prefix).parent
    at = PP2.index("--vocab-size")
    flags = PP2[:at] + PP2[at + 2:] + ["--data-cache-path", tiny_gpt_data.index_cache]
    hide = (f'exec unshare --mount bash -c \'mount -t tmpfs none {data_dir} && exec "$@"\' '
            f'node2 {REPO / ".venv" / "bin" / "torchrun"} "$@"')
    started = time.monotonic()
    job = Job(cluster, tmp_path, SCRIPT, flags, ["--nodes", "2"], GPUS_PER_NODE="1", PP="2",
              MOCK_DATA="0", DATA_PATH=tiny_gpt_data.data_prefix,
              TOKENIZER_MODEL=tiny_gpt_data.tokenizer_model,
              TORCHRUN=node2_wrapper(tmp_path, hide))
    fields = job.wait(120)
    assert fields["JobState"] == "FAILED", job.log()[-3000:]
    one_error_line(job.log(), str(data_dir))
    one_error_line(job.log(), "the training step failed")
    assert time.monotonic() - started < 90


@pytest.mark.parametrize("node2, how", [("kill -KILL $$", "dies"), ("kill -STOP $$", "hangs")])
def test_a_node_lost_at_the_rendezvous_ends_the_job_within_its_timeout(cluster, tmp_path,
                                                                        node2, how):
    """Node 2 dies (or hangs) before it joins the rendezvous: the job fails, in at most
    RDZV_TIMEOUT seconds of rendezvous (srun ends the other node's launcher as soon as one
    fails), with one line from the batch script."""
    started = time.monotonic()
    job = Job(cluster, tmp_path, SCRIPT, PP2, ["--nodes", "2"], GPUS_PER_NODE="1", PP="2",
              RDZV_TIMEOUT="15", TORCHRUN=node2_wrapper(tmp_path, node2))
    fields = job.wait(90)
    assert fields["JobState"] == "FAILED", job.log()[-3000:]
    one_error_line(job.log(), "the training step failed")
    assert time.monotonic() - started < 15 + 45


def test_the_cluster_goes_down_leaving_nothing_running(cluster):
    """Last: every daemon stops on SIGTERM and no job step, launcher or rank is left (none
    had to be killed)."""
    daemons = cluster.daemons()
    assert len(daemons) == 4  # munged, slurmctld, two slurmd
    assert cluster.down() == []
    assert not [pid for pid in daemons if slurm_cluster._alive(pid)]
    assert cluster.strays() == []
