"""Launching ranks: Slurm's environment, the Gloo rendezvous under plain `srun`, `tfdist-run`,
restarts after a failure, and the one `host[:slots]` parser.

`slurm` (Slurm variables, node lists, `prepare()` before `hvd.init()`), `rendezvous` (the Gloo
rendezvous server and check-in), `runner` (`tfdist-run`), `recovery` (failure analysis, restart
decisions, host discovery), `hosts` (host:slots), `launcher_output`, `job_summary` and
`stderr_filter` (the launcher's console). Standard library only: `tfdist-run` starts fast.

```python
from tfdist.launch import expand_nodelist
expand_nodelist("gpu[01-02],cpu7")  # ['gpu01', 'gpu02', 'cpu7']
```
"""

import importlib

from tfdist.errors import LaunchError

_SLURM_EXPORTS = frozenset({
    "LaunchInfo", "TaskPlacement", "detect_launcher", "expand_nodelist", "expand_tasks_per_node",
    "horovod_env", "interface_towards", "node_names", "prepare", "rendezvous_address", "rendezvous_port",
    "slurm_topology", "check_own_hostname",
})


def __getattr__(name):
    if name in _SLURM_EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.slurm"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LaunchError", *sorted(_SLURM_EXPORTS)]
