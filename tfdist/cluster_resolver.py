"""`strategy.cluster_resolver` for `HorovodStrategy`: the job as TensorFlow's resolvers describe it.

TensorFlow's multi-worker tutorials pick the chief and per-worker save paths from
`strategy.cluster_resolver.task_type` and `.task_id`. Under `HorovodStrategy` every rank is a
`"worker"` whose `task_id` is its rank, so rank 0 is the chief, as under MWMS with a
`TF_CONFIG` that names only workers (in a job that joined a `TF_CONFIG` cluster, that cluster's
own task types and ids):

```python
strategy = tfdist.HorovodStrategy()
resolver = strategy.cluster_resolver
is_chief = resolver.task_type == "worker" and resolver.task_id == 0   # the tutorials' _is_chief
print(resolver.cluster_spec().num_tasks("worker"))                     # the number of ranks
```

The cluster spec lists each rank's host name, in rank order (no TensorFlow server runs: Horovod
talks over Gloo or MPI, so an address carries no port). `rpc_layer` is None, as it is for MWMS
when `TF_CONFIG` names none, and `num_accelerators()` counts the accelerators this rank's
TensorFlow sees (one GPU per rank on GPU nodes, `{}` on CPU nodes).
"""

import tensorflow as tf

from tfdist import collectives
from tfdist.faults.watchdog_support import host_name


class HorovodClusterResolver(tf.distribute.cluster_resolver.SimpleClusterResolver):
    """Every rank a `"worker"` task, `task_id` = rank; hosts from every rank, gathered once.

    In a cluster that `TF_CONFIG` describes (Kubeflow's TFJob, Ray Train) it is that cluster, as
    MWMS's `TFConfigClusterResolver` reads it: the chief is `("chief", 0)` (rank 0) and worker
    `i` is `("worker", i)`.

    Args:
        hosts: each rank's host name, in rank order.
        rank: this process's rank.
        accelerators: this rank's accelerator counts, e.g. `{"GPU": 1}`.
        cluster: a `tfdist.launch.tf_config.Cluster` this job joined, or None.
    """

    def __init__(self, hosts: list, rank: int, accelerators: dict, cluster=None):
        spec, task = {"worker": list(hosts)}, ("worker", rank)
        if cluster is not None:
            spec, task = cluster.spec, (cluster.task_type, cluster.task_index)
        super().__init__(tf.train.ClusterSpec(spec), master="", task_type=task[0], task_id=task[1],
                         num_accelerators=dict(accelerators), rpc_layer=None)

    @classmethod
    def for_this_job(cls) -> "HorovodClusterResolver":
        """Gather every rank's host (a collective: all ranks call it, as `HorovodStrategy()` does).

        Under a launcher, the `TF_CONFIG` tfdist exported names every rank's host from now on."""
        from tfdist.launch import start, tf_config

        hosts = collectives.allgather_object(host_name(), name="tfdist.cluster_resolver.hosts")
        gpus = len(tf.config.list_logical_devices("GPU"))
        launch = start.prepared()
        cluster = launch.cluster if launch is not None else None
        if cluster is None and tf_config.launched():
            tf_config.export_for_launcher(collectives.process_size(), collectives.process_rank(),
                                          [h.split(" ")[0] for h in hosts])
        return cls(hosts, collectives.process_rank(), {"GPU": gpus} if gpus else {}, cluster)

    def __repr__(self):
        tasks = ", ".join(f"{task_type}={addresses}" for task_type, addresses in self.cluster_spec().as_dict().items())
        return f"HorovodClusterResolver(task_type={self.task_type!r}, task_id={self.task_id}, {tasks})"
