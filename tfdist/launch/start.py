"""Who started this process, and what `hvd.init()` then needs: `prepare()`.

`horovodrun` and `mpirun` already give every process what `hvd.init()` needs. Under plain `srun`
(`tfdist.launch.slurm`) and in a cluster that `TF_CONFIG` describes (`tfdist.launch.tf_config`:
Kubeflow's TFJob, Ray Train, cloud trainers) nothing does, so `prepare()` (called by
`tfdist.collectives.init()` before `hvd.init()`) works out this task's rank, local and cross
values, starts Horovod's Gloo rendezvous server in task 0 (a daemon thread), waits until every
task has checked in, and sets the `HOROVOD_*` variables Horovod's Gloo controller reads.

```python
from tfdist.launch import start
start.detect_launcher({"HOROVOD_RANK": "0"})                                             # 'horovodrun'
start.detect_launcher({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}'})
# 'tf_config'
```

Environment: `TFDIST_RENDEZVOUS_ADDR`, `TFDIST_RENDEZVOUS_PORT`, `TFDIST_RENDEZVOUS_TIMEOUT`,
`TFDIST_LAUNCHER=auto|slurm|tf_config|none`, `HOROVOD_GLOO_IFACE` (default: the interface that
reaches the rendezvous address; `lo` on one node). See docs/LAUNCH.md.
"""

import dataclasses
import logging
import os
import socket

from tfdist.errors import LaunchError
from tfdist.launch import tf_config
from tfdist.launch.slurm import (DEFAULT_TIMEOUT_S, MPI_RANK_VARIABLES, MPI_SIZE_VARIABLES, SRUN_MPI_RANK_VARIABLES,
                                 TaskPlacement, _first, _job_token, rendezvous_address, rendezvous_port,
                                 slurm_topology)

log = logging.getLogger("tfdist")


def detect_launcher(env=None, mpi_built=False):
    """'horovodrun', 'mpi', 'slurm', 'tf_config' or 'none': who started this process, as far as Horovod cares.

    MPI counts only when this Horovod has MPI (`mpi_built`); otherwise an srun task with PMI
    variables is still a Slurm task. A Slurm task is one `srun` started (`SLURM_STEP_NUM_TASKS`);
    in one, MPI needs `PMIX_RANK` (`srun --mpi=pmix`) or `OMPI_COMM_WORLD_RANK`, since `PMI_RANK`
    alone (`--mpi=pmi2`) does not start Open MPI. `TFDIST_LAUNCHER=none` turns the Slurm path off
    (Horovod then initialises on its own, e.g. an MPICH build from PMI-2), `TFDIST_LAUNCHER=slurm`
    forces it. A process no launcher started, whose `TF_CONFIG` names 2+ tasks, is 'tf_config'
    (`tfdist.launch.tf_config`); `TFDIST_LAUNCHER=tf_config` prefers TF_CONFIG over a launcher's variables.

    >>> detect_launcher({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "PMI_RANK": "0"}, mpi_built=True)
    'slurm'
    """
    env = os.environ if env is None else env
    choice = env.get("TFDIST_LAUNCHER", "auto")
    if choice not in ("auto", "slurm", "tf_config", "none"):
        raise LaunchError(f"TFDIST_LAUNCHER={choice!r}; expected auto, slurm, tf_config or none")
    if choice == "none":
        return "none"
    if choice == "tf_config" or (choice == "auto" and not tf_config.launched(env)):
        if tf_config.joining(env) is not None:  # raises on a TF_CONFIG it cannot use: never a silent 1-rank job
            return "tf_config"
    if choice == "auto":
        if "HOROVOD_RANK" in env:
            return "horovodrun"
        in_step = "SLURM_STEP_NUM_TASKS" in env
        if mpi_built and any(v in env for v in (SRUN_MPI_RANK_VARIABLES if in_step else MPI_RANK_VARIABLES)):
            return "mpi"
    # srun sets SLURM_STEP_NUM_TASKS for its tasks; the batch script itself (also SLURM_PROCID=0)
    # has none and runs as a 1-process job.
    if "SLURM_PROCID" in env and ("SLURM_STEP_NUM_TASKS" in env or choice == "slurm"):
        return "slurm"
    return "none"


def interface_towards(addr):
    """Name of the local network interface whose address is used to reach `addr`."""
    import psutil  # a Horovod dependency

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((addr, 9))  # UDP: picks a route and source address, sends nothing
        except OSError as e:
            raise LaunchError(f"no route from this host to the rendezvous address {addr}: {e}") from None
        source = probe.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source for a in addrs):
            return name
    raise LaunchError(f"no network interface holds {source}, the address that reaches {addr}; "
                      "set HOROVOD_GLOO_IFACE")


def check_own_hostname():
    """Refuse a multi-node job on a host whose name resolves to loopback.

    Horovod 0.28.1 creates the Gloo contexts of its process sets (the global set included) without
    `HOROVOD_GLOO_IFACE` (gloo_context.cc, InitializeForProcessSet), so Gloo binds to the address
    of this host's name; on loopback, other nodes' connections are refused and Gloo aborts.
    """
    name = socket.gethostname()
    try:
        addr = socket.gethostbyname(name)
    except OSError as e:
        raise LaunchError(f"this host's name {name!r} does not resolve ({e}); Horovod's Gloo needs it "
                          "to resolve to the address other nodes reach this one at") from None
    if addr.startswith("127."):
        raise LaunchError(f"this host's name {name!r} resolves to the loopback address {addr} (see "
                          "/etc/hosts), but the job spans several nodes: Horovod's Gloo binds to that "
                          "address whatever HOROVOD_GLOO_IFACE says, and other nodes could not connect. "
                          "Make the name resolve to the node's network address.")


def horovod_env(topo, addr, port, iface):
    """The variables Horovod's Gloo controller reads in `hvd.init()` (as horovodrun sets them)."""
    env = {
        "HOROVOD_RANK": topo.rank, "HOROVOD_SIZE": topo.size,
        "HOROVOD_LOCAL_RANK": topo.local_rank, "HOROVOD_LOCAL_SIZE": topo.local_size,
        "HOROVOD_CROSS_RANK": topo.cross_rank, "HOROVOD_CROSS_SIZE": topo.cross_size,
        "HOROVOD_HOSTNAME": topo.hostname,
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": port,
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
    }
    return {k: str(v) for k, v in env.items()}


@dataclasses.dataclass
class LaunchInfo:
    """What `prepare()` found and did."""

    launcher: str
    topology: TaskPlacement = None
    address: str = None
    port: int = None
    env: dict = dataclasses.field(default_factory=dict)
    server: object = None  # the RendezvousServer, in the task that hosts it
    cluster: object = None  # the tf_config.Cluster this process joined (launcher 'tf_config')
    note: str = None  # for the chief's start-up line: a TF_CONFIG that the launcher's ranks overrode

    def describe(self):
        if self.topology is None:
            return f"tfdist launch: {self.launcher}"
        t = self.topology
        what = self.cluster.describe() if self.cluster is not None else "slurm"
        return (f"tfdist launch: {what}, {t.size} tasks on {len(t.nodes)} node(s) "
                f"({', '.join(t.nodes[:4])}{', ...' if len(t.nodes) > 4 else ''}), rendezvous {self.address}:{self.port}, "
                f"interface {self.env.get('HOROVOD_GLOO_IFACE')}")


_prepared = []  # the LaunchInfo of this process's prepare(), for the chief's start-up line


def prepared():
    """What `prepare()` found in this process (None before it ran)."""
    return _prepared[-1] if _prepared else None


def prepare(mpi_built=False, env=None):
    """Make `hvd.init()` work for the launcher that started this process; returns a `LaunchInfo`.

    Under Slurm without horovodrun/MPI, and in a cluster that TF_CONFIG describes (more than one
    task each), this runs the rendezvous and sets the `HOROVOD_*` variables in `env` (default
    `os.environ`). Other launchers are left alone, except mpirun when this Horovod has no MPI,
    which raises (each process would be rank 0 of 1).
    """
    env = os.environ if env is None else env
    launcher = detect_launcher(env, mpi_built)
    if launcher == "none" and not mpi_built:
        size_var, size = _first(env, MPI_SIZE_VARIABLES)
        if size_var and "SLURM_PROCID" not in env and size.isdigit() and int(size) > 1:
            raise LaunchError(f"started by mpirun ({size_var}={size}), but this Horovod was built "
                              "without MPI, so every process would train alone as rank 0. Launch "
                              "with `tfdist-run` / `horovodrun --gloo`, or rebuild Horovod with MPI.")
    if launcher == "tf_config":
        cluster = tf_config.joining(env)
        topo = TaskPlacement(**cluster.placement())
        port = rendezvous_port(env) if env.get("TFDIST_RENDEZVOUS_PORT") else cluster.port(0)
        info = _join(LaunchInfo(launcher, topo, rendezvous_address(topo, env), port, cluster=cluster),
                     cluster.token, tf_config.DEFAULT_TIMEOUT_S, env)
    elif launcher == "slurm":
        topo = slurm_topology(env, use_scontrol=env is os.environ)
        info = LaunchInfo(launcher, topo)
        if topo.size > 1:
            info = _join(LaunchInfo(launcher, topo, rendezvous_address(topo, env), rendezvous_port(env)),
                         _job_token(env), DEFAULT_TIMEOUT_S, env)
    else:
        info = LaunchInfo(launcher)
    info.note = tf_config.ignored_note({"mpi": "mpirun"}.get(launcher, launcher), env)
    _prepared.append(info)
    return info


def _join(info, token, default_timeout, env):
    """Check in with every task at the rendezvous (task 0 hosts it) and set Horovod's Gloo variables."""
    from tfdist.launch.rendezvous import RendezvousServer, check_in

    topo, addr, port = info.topology, info.address, info.port
    iface = env.get("HOROVOD_GLOO_IFACE") or ("lo" if len(topo.nodes) == 1 else interface_towards(addr))
    if len(topo.nodes) > 1:
        check_own_hostname()
    try:
        timeout = float(env.get("TFDIST_RENDEZVOUS_TIMEOUT") or default_timeout)
    except ValueError:
        raise LaunchError(f"TFDIST_RENDEZVOUS_TIMEOUT={env['TFDIST_RENDEZVOUS_TIMEOUT']!r} is not "
                          "a number of seconds") from None
    is_server = topo.node_index == 0 and topo.local_rank == 0
    server = RendezvousServer(topo, port, token) if is_server else None
    try:
        check_in(topo, addr, port, token, timeout, server)
    except BaseException:
        if server is not None:
            server.stop()
        raise
    info.env, info.server = horovod_env(topo, addr, port, iface), server
    if len(topo.nodes) > 1 and "NCCL_SOCKET_IFNAME" not in env:
        info.env["NCCL_SOCKET_IFNAME"] = iface
    env.update(info.env)
    if is_server:
        log.debug("%s", info.describe())  # the chief's start-up line carries it
    return info


def startup_fact():
    """For the chief's start-up line: the TF_CONFIG cluster this job joined, or the note that a
    launcher's ranks overrode the user's TF_CONFIG; None otherwise."""
    info = prepared()
    if info is None:
        return None
    if info.cluster is not None:
        first = info.cluster.tasks[0]
        return (f"TF_CONFIG cluster: {info.cluster.counts()} as {info.topology.size} ranks ({first[0]}:{first[1]} "
                f"is rank 0) on {len(info.topology.nodes)} host(s), rendezvous {info.address}:{info.port}")
    return info.note
