"""Launching ranks: who started this process (`prepare()` before `hvd.init()`), Slurm's environment,
clusters that `TF_CONFIG` describes, the Gloo rendezvous, `tfdist-run`, restarts after a failure,
and the one `host[:slots]` parser.

`start` (`detect_launcher`, `prepare()`), `slurm` (Slurm variables, node lists), `tf_config`
(Kubeflow TFJob, Ray Train and cloud trainers' `TF_CONFIG`; the one exported under tfdist's own
launchers), `rendezvous` (the Gloo rendezvous server and check-in), `runner` (`tfdist-run`),
`recovery` (failure analysis, restart decisions, host discovery), `hosts` (host:slots),
`launcher_output`, `job_summary` and `stderr_filter` (the launcher's console). Standard library
only: `tfdist-run` starts fast.

```python
from tfdist.launch import expand_nodelist
expand_nodelist("gpu[01-02],cpu7")  # ['gpu01', 'gpu02', 'cpu7']
```
"""

import importlib

from tfdist.errors import LaunchError

_EXPORTS = {
    "slurm": ("TaskPlacement", "expand_nodelist", "expand_tasks_per_node", "node_names", "rendezvous_address",
              "rendezvous_port", "slurm_topology"),
    "start": ("LaunchInfo", "check_own_hostname", "detect_launcher", "horovod_env", "interface_towards", "prepare",
              "prepared"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LaunchError", *sorted(_MODULE_OF)]
