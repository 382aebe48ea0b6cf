"""`strategy.cluster_resolver` for `HorovodStrategy`: the job as TensorFlow's resolvers describe it.

TensorFlow's multi-worker tutorials pick the chief and per-worker save paths from
`strategy.cluster_resolver.task_type` and `.task_id`. Under `HorovodStrategy` every rank is a
`"worker"` whose `task_id` is its rank, so rank 0 is the chief, as under MWMS with a
`TF_CONFIG` that names only workers:

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

    Args:
        hosts: each rank's host name, in rank order.
        rank: this process's rank.
        accelerators: this rank's accelerator counts, e.g. `{"GPU": 1}`.
    """

    def __init__(self, hosts: list, rank: int, accelerators: dict):
        super().__init__(tf.train.ClusterSpec({"worker": list(hosts)}), master="", task_type="worker",
                         task_id=rank, num_accelerators=dict(accelerators), rpc_layer=None)

    @classmethod
    def for_this_job(cls) -> "HorovodClusterResolver":
        """Gather every rank's host (a collective: all ranks call it, as `HorovodStrategy()` does)."""
        hosts = collectives.allgather_object(host_name(), name="tfdist.cluster_resolver.hosts")
        gpus = len(tf.config.list_logical_devices("GPU"))
        return cls(hosts, collectives.process_rank(), {"GPU": gpus} if gpus else {})

    def __repr__(self):
        spec = self.cluster_spec().as_dict()
        return f"HorovodClusterResolver(task_type='worker', task_id={self.task_id}, workers={spec['worker']})"
