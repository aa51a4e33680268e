"""A throwaway Slurm cluster on this host: munged, slurmctld and one slurmd per node, each
node a ``slurmd -N nodeK`` on its own port (Slurm's multiple-slurmd mode), config and state in
a temporary directory, every daemon recorded in a pidfile there.

    python -m tests.slurm_cluster up [--nodes 2] [--dir DIR]   # prints the SLURM_CONF to export
    python -m tests.slurm_cluster down --dir DIR

Needs root and the distribution's slurmctld, slurmd, slurm-client and munge packages (22.05).
The node names do not resolve: each node's NodeAddr (127.0.0.1) does. docs/slurm.md tells the
story; ``tests/test_slurm.py`` runs the scripts on it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_2bw.runtime.ports import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
FIRST_SLURMD_PORT = 17001


def missing() -> str | None:
    """Why no cluster can run here (one line), or None."""
    found = [name for name in DAEMONS if shutil.which(name, path="/usr/sbin:/usr/bin")]
    if len(found) < len(DAEMONS) or not shutil.which("sbatch"):
        return "slurmctld, slurmd, slurm-client or munge is not installed"
    if os.geteuid() != 0:
        return "a throwaway Slurm cluster needs root"
    return None


def _free_range(count: int) -> int:
    """The first of ``count`` consecutive free ports (one per slurmd) from FIRST_SLURMD_PORT."""
    for base in range(FIRST_SLURMD_PORT, FIRST_SLURMD_PORT + 2000, count):
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {count} free consecutive ports from {FIRST_SLURMD_PORT}")


def slurm_conf(root: Path, nodes: int, ctld_port: int, first_port: int) -> str:
    """slurm.conf for ``nodes`` slurmd on this host (no cgroups, accounting or mail)."""
    host = socket.gethostname()
    names = "node1" if nodes == 1 else f"node[1-{nodes}]"
    ports = str(first_port) if nodes == 1 else f"[{first_port}-{first_port + nodes - 1}]"
    return "\n".join([
        "ClusterName=localhost", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}", "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={root}/munge.socket,cred_expire=10",
        f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool-%n",
        f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log", f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "MailProg=/bin/true", "MpiDefault=none", "EnforcePartLimits=ALL",
        "ReturnToService=2", "KillWait=10", "MinJobAge=300",
        "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "MessageTimeout=10",
        "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=1",
        f"NodeName={names} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports} "
        f"CPUs={os.cpu_count()} State=UNKNOWN",
        f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


class Cluster:
    """The daemons of one throwaway cluster; :meth:`down` leaves none running."""

    def __init__(self, root: Path, nodes: int = 2):
        self.root, self.nodes = Path(root), nodes
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def _start(self, name: str, command: list[str]) -> None:
        """Start one daemon in the foreground in a session of its own; record its pid."""
        log = open(self.root / f"{name}.out", "wb")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        (self.root / f"{name}.daemon.pid").write_text(str(process.pid))

    def _munge(self) -> None:
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._start("munged", ["munged", "--foreground", "--force", f"--key-file={key}",
                               f"--socket={self.root}/munge.socket",
                               f"--pid-file={self.root}/munged.pid",
                               f"--log-file={self.root}/munged.log",
                               f"--seed-file={self.root}/munge.seed"])
        self._wait(lambda: (self.root / "munge.socket").exists(), "munged")

    def up(self, timeout: float = 30.0) -> "Cluster":
        """Write the config and start munged, slurmctld and the slurmd; wait until every
        node is idle. Raises RuntimeError (one line) otherwise, after tearing down."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "state").mkdir(exist_ok=True)
            self.conf.write_text(slurm_conf(self.root, self.nodes, free_port(),
                                            _free_range(self.nodes)))
            self._munge()
            self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for k in range(1, self.nodes + 1):
                self._start(f"slurmd-node{k}", ["slurmd", "-D", "-N", f"node{k}",
                                                "-f", str(self.conf)])
            self._wait(self._all_idle, "the nodes to be idle", timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _all_idle(self) -> bool:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env,
                              capture_output=True, text=True)
        states = [line.split()[1] for line in done.stdout.splitlines() if line.strip()]
        return len(states) == self.nodes and all(s == "idle" for s in states)

    def _wait(self, ready, what: str, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurm cluster in {self.root}: no {what} after {timeout:g} s")
            time.sleep(0.2)

    def down(self) -> list[int]:
        """Cancel every job and wait for them (up to KillWait and a little), stop every daemon
        recorded (SIGTERM, then SIGKILL), then SIGKILL any process still running under this
        cluster's config (job steps outlive slurmd); return the pids that had to be killed."""
        if self.daemons():
            self._cancel_all()
        killed = []
        for pidfile in sorted(self.root.glob("*.daemon.pid"), reverse=True):
            killed += _stop_session(int(pidfile.read_text()))
            pidfile.unlink()
        for pid in self.strays():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def _cancel_all(self, wait: float = 15.0) -> None:
        try:
            subprocess.run(["scancel", "--full", "--user", "root"], env=self.env,
                           capture_output=True, timeout=10)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.run(
                    "squeue", "-h", timeout=10).stdout.strip():
                time.sleep(0.3)
        except subprocess.TimeoutExpired:  # no controller answers: the daemons go anyway
            pass

    def strays(self) -> list[int]:
        """Processes started under this cluster's config (its environment's SLURM_CONF) other
        than this one: daemons, job steps, launchers, ranks."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
                except OSError:
                    pass
        return found

    def daemons(self) -> list[int]:
        """The pids of the daemons started and not yet stopped."""
        return [int(p.read_text()) for p in self.root.glob("*.daemon.pid")]

    def run(self, *command: str, **kwargs) -> subprocess.CompletedProcess:
        """A client command (sbatch, squeue, scontrol...) against this cluster."""
        kwargs.setdefault("env", self.env)
        return subprocess.run(list(command), capture_output=True, text=True, **kwargs)


def _session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (job steps of slurmd run in sessions of their own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _stop_session(pid: int, grace: float = 10.0) -> list[int]:
    """SIGTERM the daemon ``pid``; SIGKILL it and its session after ``grace`` seconds."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return []
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    left = [p for p in _session_pids(pid)] if _alive(pid) else []
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a child of this process that ended is reaped here)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    why = missing()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if args.action == "down":
        Cluster(args.dir or parser.error("down needs --dir")).down()
        return 0
    cluster = Cluster(args.dir or Path(tempfile.mkdtemp(prefix="slurm-")), args.nodes).up()
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
