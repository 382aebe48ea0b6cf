"""A private one-node Slurm cluster (munged, slurmctld, slurmd) for tests, in a temporary directory.

    with SlurmCluster() as cluster:          # raises ClusterUnavailable with the reason
        job = cluster.sbatch(["--wrap", "srun hostname"], output="hello.out")
        info = cluster.wait(job, timeout=60)  # {'JobState': 'COMPLETED', 'ExitCode': '0:0', ...}

Everything lives under one temporary directory: a fresh munge key and munged on a private socket
(so nothing clashes with a system-wide munge), a generated slurm.conf (this machine's name, CPUs
and memory, free ports, state and spool directories), and the daemons' logs. The daemons run in
the foreground (`-D`, `-F`) as children of this process; `stop()` cancels the jobs, ends every
process that still carries this cluster's SLURM_CONF, then the daemons, and removes the
directory. Cgroups are not needed: proctrack/linuxproc and task/none. There is no slurmdbd, so
no `sacct`: finished jobs stay visible to `scontrol show job` for MinJobAge=600 s, and
jobcomp/filetxt keeps one line per finished job in `jobcomp.txt`.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "salloc", "scontrol", "sinfo", "scancel")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE"}
CLI_TIMEOUT = 30


class ClusterUnavailable(RuntimeError):
    """This machine cannot host the test cluster; the message says why (for pytest.skip)."""


def unavailable_reason():
    """Why no cluster can start here (not root, a binary missing), or None."""
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root (SlurmUser=root); not root"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        return (f"Slurm/munge binaries missing: {', '.join(missing)} (Debian: apt-get install "
                "slurm-wlm munge, as scripts/bootstrap.sh --with-slurm does)")
    return None


def memory_mb():
    with open("/proc/meminfo") as f:
        kb = int(re.search(r"MemTotal:\s+(\d+) kB", f.read()).group(1))
    return int(kb / 1024 * 0.9)  # slurmd drains a node that has less than RealMemory


class SlurmCluster:
    """One-node Slurm cluster on this machine; a context manager (start on enter, stop on exit)."""

    def __init__(self, start_timeout=60):
        self.start_timeout = start_timeout
        self.dir = None
        self.procs = {}
        self.hostname = socket.gethostname()
        self.cpus = len(os.sched_getaffinity(0))

    # ------------------------------------------------------------------ set-up and tear-down

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self.dir = Path(tempfile.mkdtemp(prefix="tfdist-slurm-"))
        try:
            os.chmod(self.dir, 0o711)  # munged refuses a socket in a directory others cannot enter
            for sub in ("state", "spool", "tmp"):
                (self.dir / sub).mkdir()
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf)])
            self._wait_idle()
        except (ClusterUnavailable, OSError, subprocess.SubprocessError) as e:
            logs = self.log_tail()
            self.stop()
            raise ClusterUnavailable(f"{type(e).__name__}: {e}\n{logs}") from None
        except BaseException:
            self.stop()
            raise

    def _start_munge(self):
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = self.dir / "munge.sock"
        self._spawn("munged", [
            "munged", "-F", "-f", f"--key-file={key}", f"--socket={self.munge_socket}",
            f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
            f"--seed-file={self.dir / 'munged.seed'}"])
        self._poll(lambda: self.munge_socket.exists(), 15, "munged did not create its socket")

    def _write_conf(self):
        d = self.dir
        self.ctld_port, self.slurmd_port = free_ports(2, "")  # the daemons listen on every address
        self.conf = d / "slurm.conf"
        self.conf.write_text(f"""\
ClusterName=tfdisttest
SlurmctldHost={self.hostname}
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
CredType=cred/munge
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
TmpFS={d / 'tmp'}
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={d / 'jobcomp.txt'}
MpiDefault=none
MinJobAge=600
KillWait=5
ReturnToService=2
SchedulerType=sched/backfill
NodeName={self.hostname} CPUs={self.cpus} RealMemory={memory_mb()} State=UNKNOWN
PartitionName=debug Nodes={self.hostname} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name, command):
        log = open(self.dir / f"{name}.out", "w")
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env(), start_new_session=True)
        log.close()

    def _wait_idle(self):
        def idle():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise ClusterUnavailable(f"{name} exited with status {proc.returncode} at start-up")
            out = self.cli(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
            return out.returncode == 0 and out.stdout.split() == [self.hostname, "idle"]

        self._poll(idle, self.start_timeout, f"node {self.hostname} not idle in sinfo after "
                   f"{self.start_timeout}s")

    @staticmethod
    def _poll(ready, timeout, message):
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise ClusterUnavailable(message)
            time.sleep(0.5)

    def stop(self):
        """Cancel jobs, end their processes, then the daemons; remove the directory. Idempotent."""
        if self.dir is None:
            return
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                self.cli(["scancel", "--full", "--quiet", "--partition=debug"], check=False)
                self._poll(lambda: not self.cli(["squeue", "-h"], check=False).stdout.strip(), 15, "")
            except (ClusterUnavailable, OSError, subprocess.SubprocessError):
                pass  # the processes are killed below anyway
        self._kill_job_processes()
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:  # slurmctld can wait forever on its slurmscriptd
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None

    def _kill_job_processes(self):
        """SIGKILL what this cluster's jobs left behind: slurmstepd and job tasks whose environment
        names this cluster's slurm.conf (not a shell that merely exported SLURM_CONF)."""
        mark = f"SLURM_CONF={self.dir / 'slurm.conf'}".encode()
        daemons = {p.pid for p in self.procs.values()}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in daemons or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                stepd = (entry / "comm").read_text().strip() == "slurmstepd"
            except OSError:
                continue
            if mark in environ and (stepd or any(v.startswith(b"SLURM_JOB_ID=") for v in environ)):
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ using it

    def env(self, extra=None):
        """os.environ with SLURM_CONF pointing at this cluster (and no outer Slurm job's variables)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.dir / "slurm.conf")
        env.update(extra or {})
        return env

    def cli(self, command, timeout=CLI_TIMEOUT, check=True, env=None, cwd=None):
        """Run a Slurm command against this cluster; returns the CompletedProcess (text)."""
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                             env=env or self.env(), cwd=cwd)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, command))} failed ({out.returncode}):\n"
                               f"{out.stdout}{out.stderr}\n{self.log_tail()}")
        return out

    def sbatch(self, args, env=None, cwd=None):
        """Submit `sbatch --parsable ARGS`; returns the job id."""
        out = self.cli(["sbatch", "--parsable", *map(str, args)], env=self.env(env), cwd=cwd)
        return out.stdout.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job` as a dict: {'JobState': 'COMPLETED', 'ExitCode': '0:0', ...}."""
        text = self.cli(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\S+?)=(\S*)", text))

    def wait(self, job_id, timeout):
        """Wait until the job has ended; returns `job()`. On timeout, cancels it and raises."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINISHED:
                return info
            if time.monotonic() > deadline:
                self.cli(["scancel", str(job_id)], check=False)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout}s\n"
                                   f"{self.log_tail()}")
            time.sleep(1)

    def log_tail(self, lines=25):
        """The last lines of every daemon's log, for error messages."""
        if self.dir is None:
            return ""
        parts = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out",
                     "munged.out"):
            path = self.dir / name
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {name}\n" + "\n".join(text))
        return "\n".join(parts)
