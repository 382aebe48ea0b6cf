"""Slurm's view of a task: rank, local and cross values from an `srun` step, node lists, the port.

Under plain `srun` (no MPI) nothing gives a process what `hvd.init()` needs;
`tfdist.launch.start.prepare()` takes it from here, runs Horovod's Gloo rendezvous and sets the
`HOROVOD_*` variables, so `HorovodStrategy()` under `srun` just works:

```python
from tfdist.launch import slurm as launch
env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
       "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "42"}
topo = launch.slurm_topology(env)
print(topo.rank, topo.local_rank, topo.cross_rank, topo.cross_size, topo.hostname)  # 1 1 0 2 gpu01
```

Environment: `TFDIST_RENDEZVOUS_ADDR` (default: the first node's address), `TFDIST_RENDEZVOUS_PORT`
(default: derived from `SLURM_JOB_ID` and `SLURM_STEP_ID`), `TFDIST_RENDEZVOUS_TIMEOUT` (seconds,
default 120), `TFDIST_LAUNCHER=auto|slurm|tf_config|none`, `HOROVOD_GLOO_IFACE` (default: the interface that
reaches the rendezvous address; `lo` on one node). See docs/LAUNCH.md.
"""

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import zlib

from tfdist.errors import LaunchError

MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
# Inside an srun step, PMI_RANK alone comes from `srun --mpi=pmi2` (a common MpiDefault), and Open
# MPI, which Horovod is normally built with, aborts in MPI_Init_thread there; it starts from PMIx
# (`srun --mpi=pmix`). So in a step only these select MPI, and PMI-2 tasks take the Gloo path.
SRUN_MPI_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK")
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
DEFAULT_TIMEOUT_S = 120
PORT_BASE, PORT_SPAN = 20000, 10000


@dataclasses.dataclass(frozen=True)
class TaskPlacement:
    """Where one task sits in the job: Horovod's rank, local and cross values, plus the node plan."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node_index: int
    nodes: tuple  # node names, in Slurm's order
    tasks_per_node: tuple  # tasks on each node, same order

    @property
    def hostname(self):
        return self.nodes[self.node_index]


def expand_nodelist(text):
    """Expand a Slurm host list: 'node[01-03,07],gpu5' -> ['node01', 'node02', 'node03', 'node07', 'gpu5']."""
    names = []
    for item in _split_top_level(text.strip()):
        names.extend(_expand_item(item, text))
    return names


def _split_top_level(text):
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_item(item, whole):
    match = re.match(r"([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if not match:
        if "[" in item or "]" in item:
            raise LaunchError(f"cannot parse Slurm node list {whole!r} at {item!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    values = []
    for part in ranges.split(","):
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            values.append(bounds[0])
        elif len(bounds) == 2 and all(b.isdigit() for b in bounds) and int(bounds[0]) <= int(bounds[1]):
            width = len(bounds[0])
            values.extend(str(n).zfill(width) for n in range(int(bounds[0]), int(bounds[1]) + 1))
        else:
            raise LaunchError(f"cannot parse Slurm node list {whole!r}: bad range {part!r}")
    return [prefix + value + tail for value in values for tail in _expand_item(rest, whole) or [""]]


def expand_tasks_per_node(text):
    """Expand Slurm's task counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise LaunchError(f"cannot parse Slurm tasks-per-node value {text!r} at {part!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def node_names(nodelist, use_scontrol=True):
    """The nodes of `nodelist`, through `scontrol show hostnames` when present, else parsed here."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError):
            pass  # fall back to our own parser
    return expand_nodelist(nodelist)


def _first(env, names):
    for name in names:
        if env.get(name, "") != "":
            return name, env[name]
    return None, None


def _int(env, name, value=None):
    value = env[name] if value is None else value
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def slurm_topology(env=None, use_scontrol=False):
    """Horovod's rank/local/cross values for this Slurm task, checked for consistency."""
    env = os.environ if env is None else env
    rank = _int(env, "SLURM_PROCID")
    size_var, size = _first(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    if size_var is None:
        raise LaunchError("SLURM_PROCID is set but SLURM_NTASKS is not: cannot tell the job size")
    size = _int(env, size_var, size)
    if not 0 <= rank < size:
        raise LaunchError(f"SLURM_PROCID={rank} is not below {size_var}={size}")
    list_var, nodelist = _first(env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    if list_var is None:
        raise LaunchError("SLURM_JOB_NODELIST is not set: cannot tell which nodes the job has")
    nodes = tuple(node_names(nodelist, use_scontrol))
    if len(set(nodes)) != len(nodes):
        raise LaunchError(f"{list_var}={nodelist!r} names a node twice")
    count_var, counts = _first(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if count_var is not None:
        counts = tuple(expand_tasks_per_node(counts))
        if len(counts) != len(nodes):
            raise LaunchError(f"{count_var}={env[count_var]!r} gives {len(counts)} nodes but "
                              f"{list_var}={nodelist!r} has {len(nodes)}")
        if sum(counts) != size:
            raise LaunchError(f"{count_var}={env[count_var]!r} adds up to {sum(counts)} tasks "
                              f"but {size_var}={size}")
    elif size % len(nodes) == 0:
        counts = (size // len(nodes),) * len(nodes)
    else:
        raise LaunchError(f"{size_var}={size} tasks do not divide evenly over the {len(nodes)} "
                          f"nodes of {list_var}, and SLURM_TASKS_PER_NODE is not set")
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else (0 if len(nodes) == 1 else None)
    if node is None or not 0 <= node < len(nodes):
        raise LaunchError(f"SLURM_NODEID={env.get('SLURM_NODEID')} is not a node index of "
                          f"{list_var}={nodelist!r} ({len(nodes)} nodes)")
    local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
    if local_rank is None or not 0 <= local_rank < counts[node]:
        raise LaunchError(f"SLURM_LOCALID={env.get('SLURM_LOCALID')} is not below the "
                          f"{counts[node]} tasks of node {nodes[node]} (SLURM_NODEID={node})")
    # Horovod's cross communicator joins the tasks with the same local rank, one per node.
    holders = [i for i, n in enumerate(counts) if n > local_rank]
    return TaskPlacement(rank=rank, size=size, local_rank=local_rank, local_size=counts[node],
                    cross_rank=holders.index(node), cross_size=len(holders), node_index=node,
                    nodes=nodes, tasks_per_node=counts)


def rendezvous_port(env=None):
    """`TFDIST_RENDEZVOUS_PORT`, else a port in [20000, 30000) derived from the job and step ids."""
    env = os.environ if env is None else env
    if env.get("TFDIST_RENDEZVOUS_PORT"):
        port = _int(env, "TFDIST_RENDEZVOUS_PORT")
        if not 0 < port < 65536:
            raise LaunchError(f"TFDIST_RENDEZVOUS_PORT={port} is not a TCP port")
        return port
    if not env.get("SLURM_JOB_ID"):
        raise LaunchError("neither TFDIST_RENDEZVOUS_PORT nor SLURM_JOB_ID is set: cannot agree on "
                          "a rendezvous port")
    return PORT_BASE + zlib.crc32(_job_token(env).encode()) % PORT_SPAN


def _job_token(env):
    return f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', ''))}"


def rendezvous_address(topo, env=None):
    """`TFDIST_RENDEZVOUS_ADDR`, else the first node's address (checked to be reachable from others)."""
    env = os.environ if env is None else env
    if env.get("TFDIST_RENDEZVOUS_ADDR"):
        return env["TFDIST_RENDEZVOUS_ADDR"]
    try:
        addr = socket.gethostbyname(topo.nodes[0])
    except OSError as e:
        raise LaunchError(f"cannot resolve the first node {topo.nodes[0]!r} of the job ({e}); "
                          "set TFDIST_RENDEZVOUS_ADDR to its address") from None
    if addr.startswith("127.") and len(topo.nodes) > 1:
        raise LaunchError(f"the first node {topo.nodes[0]!r} resolves to the loopback address {addr}, "
                          f"which the other {len(topo.nodes) - 1} nodes cannot reach; set "
                          "TFDIST_RENDEZVOUS_ADDR to its network address")
    return addr
