"""A cluster that `TF_CONFIG` describes: Kubeflow's TFJob, Ray Train, Vertex AI, SageMaker.

These start one plain process per worker and describe the cluster in `TF_CONFIG`, as
MultiWorkerMirroredStrategy (MWMS) reads it. A process that no Horovod launcher started, whose
`TF_CONFIG` names more than one task, runs `HorovodStrategy()` as one rank of that cluster: the
ranks in MWMS's order (the chief first where there is one, then the workers by index, so MWMS's
chief is rank 0), Horovod's Gloo rendezvous on the first task's host and port
(`tfdist.launch.start.prepare`, as under plain `srun`).

```python
from tfdist.launch import tf_config
cluster = tf_config.parse('{"cluster": {"chief": ["a:2222"], "worker": ["b:2222", "b:2223"]},'
                          ' "task": {"type": "worker", "index": 1}}')
where = cluster.placement()
print(cluster.rank, where["size"], where["local_rank"], where["nodes"])   # 2 3 1 ('a', 'b')
```

Under tfdist's own launchers (horovodrun, mpirun, srun) the opposite: `export_for_launcher()`
writes a `TF_CONFIG` naming the ranks as workers, for code that reads it (TensorFlow's
multi-worker tutorial counts its workers that way). No TensorFlow server listens on its ports.
Standard library only: `tfdist-run` and the early tuning read it before TensorFlow loads.
"""

import dataclasses
import json
import os
import socket
import zlib

from tfdist.errors import LaunchError

VARIABLE = "TF_CONFIG"
EXPORTED_VARIABLE = "TFDIST_EXPORTED_TF_CONFIG"  # the TF_CONFIG tfdist wrote itself (not the user's)
DEFAULT_TIMEOUT_S = 300  # pods and Ray workers start minutes apart (image pulls); TFDIST_RENDEZVOUS_TIMEOUT
TASK_TYPES = ("chief", "worker")  # in MWMS's order
UNSUPPORTED = {
    "ps": "parameter-server tasks (ParameterServerStrategy is not supported: tfdist is data-parallel, "
          "as MultiWorkerMirroredStrategy)",
    "evaluator": "an evaluator task (a side-car evaluation job, which tfdist does not run: evaluate "
                 "inside fit with validation_data, or in a separate 1-process job without TF_CONFIG)",
    "master": "a 'master' task (TensorFlow 1's name for the chief)",
}
LAUNCHER_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_STEP_NUM_TASKS")
_UNKNOWN = ".tfdist.invalid"  # a host not known yet: .invalid never resolves (RFC 2606)
_FIX = "Fix the TF_CONFIG your launcher writes, or unset it (TFDIST_LAUNCHER=none ignores it)."


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The tasks of a `TF_CONFIG` in rank order, and this process's place among them."""

    tasks: tuple  # ((type, index, "host:port"), ...) in rank order: chief, then workers by index
    rank: int
    text: str  # the TF_CONFIG as given

    @property
    def size(self):
        return len(self.tasks)

    @property
    def task_type(self):
        return self.tasks[self.rank][0]

    @property
    def task_index(self):
        return self.tasks[self.rank][1]

    @property
    def spec(self):
        """The cluster as a dict of lists (`tf.train.ClusterSpec`'s form)."""
        spec = {}
        for task_type, _, address in self.tasks:
            spec.setdefault(task_type, []).append(address)
        return spec

    @property
    def token(self):
        """The same on every task of this cluster, different for another: names the rendezvous."""
        return f"tf_config.{zlib.crc32(json.dumps(self.spec, sort_keys=True).encode()):08x}"

    def host(self, rank):
        return split_address(self.tasks[rank][2], self._field(rank))[0]

    def port(self, rank):
        return split_address(self.tasks[rank][2], self._field(rank))[1]

    def _field(self, rank):
        task_type, index, _ = self.tasks[rank]
        return f"cluster.{task_type}[{index}]"

    def counts(self):
        """'1 chief + 2 workers'."""
        return " + ".join(f"{len(v)} {k}{'s' if len(v) > 1 else ''}" for k, v in self.spec.items())

    def describe(self):
        return f"TF_CONFIG cluster ({self.counts()}; this task {self.task_type}:{self.task_index})"

    def placement(self):
        """Horovod's rank, local and cross values (`slurm.TaskPlacement`'s fields): tasks whose
        addresses name the same host share a node."""
        hosts = [self.host(r) for r in range(self.size)]
        nodes = tuple(dict.fromkeys(hosts))  # in order of first appearance: rank 0's host first
        counts = tuple(hosts.count(n) for n in nodes)
        node = nodes.index(hosts[self.rank])
        local_rank = hosts[:self.rank].count(hosts[self.rank])
        holders = [i for i, n in enumerate(counts) if n > local_rank]
        return dict(rank=self.rank, size=self.size, local_rank=local_rank, local_size=counts[node],
                    cross_rank=holders.index(node), cross_size=len(holders), node_index=node,
                    nodes=nodes, tasks_per_node=counts)


def split_address(address, field):
    """('host', port) of a TF_CONFIG address 'host:port' ('[v6]:port' too); raises naming `field`."""
    host, sep, port = str(address).rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"TF_CONFIG {field} = {address!r} is not 'host:port'. {_FIX}")
    return host, int(port)


def parse(text):
    """The `Cluster` that a TF_CONFIG text describes; None where it names no cluster ('{}')."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise LaunchError(f"TF_CONFIG is not valid JSON ({e}): {text[:200]!r}. {_FIX}") from None
    if not isinstance(config, dict):
        raise LaunchError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task', not {text[:200]!r}. {_FIX}")
    cluster = config.get("cluster") or {}
    if not isinstance(cluster, dict):
        raise LaunchError(f"TF_CONFIG cluster must map task types to address lists, not {cluster!r}. {_FIX}")
    if not cluster:
        return None
    for task_type, addresses in cluster.items():
        if task_type in UNSUPPORTED:
            raise LaunchError(f"TF_CONFIG cluster.{task_type} names {UNSUPPORTED[task_type]}; tfdist joins "
                              f"clusters of 'chief' and 'worker' tasks only. {_FIX}")
        if task_type not in TASK_TYPES:
            raise LaunchError(f"TF_CONFIG cluster.{task_type}: unknown task type (expected chief and worker). {_FIX}")
        if isinstance(addresses, dict):  # TensorFlow's sparse form {index: address}
            addresses = [addresses[k] for k in sorted(addresses, key=int)] if all(
                str(k).isdigit() for k in addresses) and sorted(map(int, addresses)) == list(range(len(addresses))) else None
        if not isinstance(addresses, list) or not addresses:
            raise LaunchError(f"TF_CONFIG cluster.{task_type} must be a non-empty list of 'host:port', "
                              f"not {cluster[task_type]!r}. {_FIX}")
        cluster[task_type] = addresses
    if len(cluster.get("chief", [])) > 1:
        raise LaunchError(f"TF_CONFIG cluster.chief names {len(cluster['chief'])} tasks; a cluster has one chief. {_FIX}")
    tasks = tuple((t, i, a) for t in TASK_TYPES for i, a in enumerate(cluster.get(t, [])))
    for task_type, index, address in tasks:
        split_address(address, f"cluster.{task_type}[{index}]")
    if len({a for _, _, a in tasks}) != len(tasks):
        raise LaunchError(f"TF_CONFIG cluster names an address twice: {cluster}. {_FIX}")
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise LaunchError(f"TF_CONFIG has no task {{'type': ..., 'index': ...}} saying which of its "
                          f"{len(tasks)} tasks this process is (it has task={task!r}). {_FIX}")
    task_type, index = task["type"], task["index"]
    if task_type in UNSUPPORTED:
        raise LaunchError(f"TF_CONFIG task.type is {task_type!r}: {UNSUPPORTED[task_type]}. {_FIX}")
    if task_type not in cluster:
        raise LaunchError(f"TF_CONFIG task.type {task_type!r} is not in its cluster (which has "
                          f"{', '.join(cluster)}). {_FIX}")
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[task_type]):
        raise LaunchError(f"TF_CONFIG task.index {task['index']!r} is out of range: cluster.{task_type} has "
                          f"{len(cluster[task_type])} task(s), indices 0 to {len(cluster[task_type]) - 1}. {_FIX}")
    rank = next(r for r, (t, i, _) in enumerate(tasks) if (t, i) == (task_type, index))
    return Cluster(tasks, rank, text)


def is_exported(env=None):
    """Whether TF_CONFIG is the one tfdist exported for its launcher's ranks (not the user's)."""
    env = os.environ if env is None else env
    return bool(env.get(VARIABLE)) and env.get(VARIABLE) == env.get(EXPORTED_VARIABLE)


def given(env=None):
    """The user's TF_CONFIG text, or None (unset, empty, or the one tfdist exported)."""
    env = os.environ if env is None else env
    text = env.get(VARIABLE, "").strip()
    return text if text and not is_exported(env) else None


def launched(env=None):
    """Whether a Horovod launcher's variables are here (then they decide the ranks, not TF_CONFIG)."""
    env = os.environ if env is None else env
    return any(env.get(name, "") != "" for name in LAUNCHER_VARIABLES)


def joining(env=None):
    """The `Cluster` this process joins as a rank, or None: TF_CONFIG names 2+ tasks and no launcher
    started it (`TFDIST_LAUNCHER=none` or `slurm` turn it off). Raises on a TF_CONFIG it cannot use."""
    env = os.environ if env is None else env
    if env.get("TFDIST_LAUNCHER", "auto") not in ("auto", "tf_config") or given(env) is None:
        return None
    if launched(env) and env.get("TFDIST_LAUNCHER") != "tf_config":
        return None
    cluster = parse(given(env))
    return cluster if cluster is not None and cluster.size > 1 else None


def peek(env=None):
    """`joining()` without its errors (None for a bad TF_CONFIG): for the early tuning, which must
    not fail before the strategy can name the problem."""
    try:
        return joining(env)
    except LaunchError:
        return None


def ignored_note(launcher, env=None):
    """The chief's note where a launcher started the job and a TF_CONFIG of the user's is here too."""
    env = os.environ if env is None else env
    if launcher in ("none", "tf_config") or given(env) is None:
        return None
    return f"TF_CONFIG ignored: {launcher} started this job, its ranks decide (TFDIST_LAUNCHER=tf_config to use TF_CONFIG)"


def worker_addresses(size, rank, env=None):
    """Each rank's 'host:port' for the exported TF_CONFIG. Hosts known before Horovod starts:
    this rank's, and every rank's on one node; others read `rank<i>.tfdist.invalid` (a name that
    never resolves) until `HorovodStrategy()` writes them in. Ports follow the rendezvous port."""
    env = os.environ if env is None else env
    own = env.get("HOROVOD_HOSTNAME") or socket.gethostname()
    local_size = next((int(env[n]) for n in ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
                       if str(env.get(n, "")).isdigit()), None)
    one_node = local_size == size or env.get("SLURM_JOB_NUM_NODES") == "1"
    base = int(env.get("HOROVOD_GLOO_RENDEZVOUS_PORT") or env.get("TFDIST_RENDEZVOUS_PORT") or 2221) + 1
    return [f"{own if (i == rank or one_node) else f'rank{i}{_UNKNOWN}'}:{base + i}" for i in range(size)]


def export_for_launcher(size, rank, hosts=None, env=None):
    """Write TF_CONFIG for a launcher's rank `rank` of `size` (all workers, this task's index),
    unless the user's own is here; `hosts`: every rank's host, once known (fills in the hosts not
    known before). Returns it, or None."""
    env = os.environ if env is None else env
    if size < 1 or (env.get(VARIABLE) and not is_exported(env)):
        return None
    addresses = worker_addresses(size, rank, env)
    if hosts is not None:  # the hosts not known before Horovod started
        addresses = [f"{h}:{a.rpartition(':')[2]}" if a.split(":")[0].endswith(_UNKNOWN) else a
                     for h, a in zip(hosts, addresses)]
    text = json.dumps({"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}})
    env[VARIABLE] = env[EXPORTED_VARIABLE] = text
    return text


_RANK_AND_SIZE = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"))


def export_early(env=None):
    """At `import tfdist`: under a launcher, export this rank's TF_CONFIG (`export_for_launcher`)."""
    env = os.environ if env is None else env
    if not launched(env):
        return None
    for rank_name, size_name in _RANK_AND_SIZE:
        rank, size = str(env.get(rank_name, "")), str(env.get(size_name, ""))
        if rank.isdigit() and size.isdigit() and int(rank) < int(size):
            return export_for_launcher(int(size), int(rank), env=env)
    return None
