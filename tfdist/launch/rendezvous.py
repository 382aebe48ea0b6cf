"""Horovod's Gloo rendezvous server on an agreed port, and a check-in barrier over all tasks.

Under `srun` no launcher process exists to host the rendezvous, so the first task on the first
node hosts it in a daemon thread, and every task checks in before `hvd.init()`: no task enters
Horovod's Gloo setup (whose timeout is short, 30 s) while another has not started, and a task that
never comes is named, as is an address nobody can reach.

```python
from tfdist.launch import slurm as launch
from tfdist.launch import rendezvous
topo = launch.slurm_topology({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
                              "SLURM_JOB_NODELIST": "localhost", "SLURM_LOCALID": "0"})
server = rendezvous.RendezvousServer(topo, port=29123, token="job.0")
rendezvous.check_in(topo, "127.0.0.1", 29123, "job.0", timeout=5, server=server)   # 1 task: returns
server.stop()
```
"""

import threading
import time
import urllib.error
import urllib.request

from tfdist import _compat
from tfdist.errors import LaunchError

_SCOPE = "tfdist"  # scope of tfdist's own check-in keys, apart from Gloo's scopes
_POLL_S = 0.2


class RendezvousServer:
    """Horovod's HTTP rendezvous store on a fixed port, in a daemon thread of this process."""

    def __init__(self, topo, port, token):
        SlotInfo, RendezvousHandler, RendezvousHTTPServer = _compat.rendezvous_classes()

        try:
            self._httpd = RendezvousHTTPServer(("", port), RendezvousHandler, 0)
        except OSError as e:
            raise LaunchError(f"cannot start the rendezvous server on port {port} of "
                              f"{topo.hostname}: {e}; choose another with TFDIST_RENDEZVOUS_PORT") from None
        # Gloo's scopes (global, local_<host>, cross_<local rank>) are cleared once all members
        # finish; the server learns their sizes from a slot plan, as in horovodrun.
        plan = []
        for node, count in enumerate(topo.tasks_per_node):
            for local in range(count):
                holders = [i for i, n in enumerate(topo.tasks_per_node) if n > local]
                plan.append(SlotInfo(hostname=topo.nodes[node], rank=len(plan), local_rank=local,
                                     cross_rank=holders.index(node), size=topo.size,
                                     local_size=count, cross_size=len(holders)))
        self._httpd.init(plan)
        self.put("job", token)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="tfdist-rendezvous",
                                        daemon=True)
        self._thread.start()

    def put(self, key, value):
        with self._httpd.cache_lock:
            self._httpd.cache.setdefault(_SCOPE, {})[key] = value.encode()

    def arrived(self):
        with self._httpd.cache_lock:
            keys = list(self._httpd.cache.get(_SCOPE, {}))
        return {int(k.split(".")[1]) for k in keys if k.startswith("arrived.")}

    def stop(self):
        self._httpd.shutdown()
        self._httpd.server_close()


def check_in(topo, addr, port, token, timeout, server=None):
    """Barrier over all tasks through the rendezvous server, so that no task enters `hvd.init()`
    (whose Gloo timeout is short) while another has not started yet. Raises naming who is missing."""
    where = f"{addr}:{port}"
    deadline = time.monotonic() + timeout
    if server is not None:
        server.put(f"arrived.{topo.rank}", topo.hostname)
        while True:
            missing = sorted(set(range(topo.size)) - server.arrived())
            if not missing:
                server.put("go", "1")
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"rendezvous at {where} (task {topo.rank} on {topo.hostname}): after {timeout:g} s "
                    f"task(s) {_short(missing)} of {topo.size} have not arrived. They did not start, "
                    f"or cannot reach {where} (check TFDIST_RENDEZVOUS_ADDR / TFDIST_RENDEZVOUS_PORT, "
                    "firewalls); raise TFDIST_RENDEZVOUS_TIMEOUT for slow starts.")
            time.sleep(_POLL_S)
    url = f"http://{_url_host(addr)}:{port}/{_SCOPE}/"
    reached, last_error = False, None
    while time.monotonic() < deadline:
        try:
            job = _http("GET", url + "job")
            if job is not None and job.decode() != token:
                raise LaunchError(f"the server at {where} belongs to another job ({job.decode()}, this "
                                  f"is {token}); set TFDIST_RENDEZVOUS_PORT to a free port")
            if job is not None and not reached:
                _http("PUT", url + f"arrived.{topo.rank}", topo.hostname.encode())
                reached = True
            if reached and _http("GET", url + "go") is not None:
                return
        except (OSError, urllib.error.URLError) as e:
            if reached:
                raise LaunchError(f"the rendezvous server at {where} went away while task "
                                  f"{topo.rank} waited for the others (task 0 failed?): {e}") from None
            last_error = e
        time.sleep(_POLL_S)
    if reached:
        raise LaunchError(f"task {topo.rank} reached the rendezvous at {where}, but not every task "
                          f"arrived within {timeout:g} s (see task 0's error)")
    raise LaunchError(f"task {topo.rank} on {topo.hostname} could not reach the rendezvous server at "
                      f"{where} (started by the first task on {topo.nodes[0]}) within {timeout:g} s: "
                      f"{last_error}. Check that task 0 started, TFDIST_RENDEZVOUS_ADDR / "
                      "TFDIST_RENDEZVOUS_PORT, and firewalls.")


# Never through http_proxy: on clusters that set one, compute nodes are rarely in no_proxy, and
# Horovod's own C++ client connects directly.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(method, url, body=None):
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with _DIRECT.open(request, timeout=5) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def _url_host(addr):
    return f"[{addr}]" if ":" in addr else addr


def _short(ranks, limit=8):
    return ", ".join(map(str, ranks[:limit])) + (f" ... ({len(ranks)} in all)" if len(ranks) > limit else "")


def exchange(addr, port, scope, rank, size, value, timeout):
    """Every rank's `value` (a str), in rank order, through the rendezvous store at addr:port (Horovod's
    Gloo rendezvous under horovodrun --gloo and tfdist-run): this rank's is published under `scope`."""
    url = f"http://{_url_host(addr)}:{port}/{scope}/"
    deadline = time.monotonic() + timeout
    values, published, last_error = {}, False, None
    while True:
        try:
            if not published:
                _http("PUT", url + str(rank), value.encode())
                published = True
            for other in set(range(size)) - set(values):
                got = _http("GET", url + str(other))
                if got is not None:
                    values[other] = got.decode()
        except (OSError, urllib.error.URLError) as e:
            last_error = e
        if len(values) == size:
            return [values[r] for r in range(size)]
        if time.monotonic() > deadline:
            if not published:
                raise LaunchError(f"rank {rank} could not reach the rendezvous store at {addr}:{port} within "
                                  f"{timeout:g} s to publish its {scope} value: {last_error}")
            missing = sorted(set(range(size)) - set(values))
            raise LaunchError(f"rank {rank}: after {timeout:g} s rank(s) {_short(missing)} of {size} had not "
                              f"published their {scope} value at the rendezvous {addr}:{port} (did they start?)")
        time.sleep(_POLL_S)
