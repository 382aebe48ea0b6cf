"""Launch layer: Slurm environment parsing, the Gloo rendezvous, srun-style jobs (loopback and two
network namespaces), tfdist-run, and the sbatch templates."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (BIN, ROOT, JobFailed, _tail, communicate_or_kill, free_port, make_job_env, read_results,
                      run_job, wait_or_kill)
from tfdist import launch
from tfdist.launch import rendezvous
from tfdist.launch import runner as run
from tfdist.errors import LaunchError

WORKER = ROOT / "tests" / "multirank" / "launch_checks.py"
JOB_TIMEOUT = 240


def slurm_env(rank, ntasks, nodelist, local_id, node_id, tasks_per_node=None, **extra):
    env = {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks),
           "SLURM_LOCALID": str(local_id), "SLURM_NODEID": str(node_id), "SLURM_JOB_NODELIST": nodelist,
           "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    if tasks_per_node is not None:
        env["SLURM_TASKS_PER_NODE"] = tasks_per_node
    env.update(extra)
    return env


# ---------------------------------------------------------------- Slurm environment (no processes)

@pytest.mark.parametrize("text, expected", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("r[1-2]-n[08-09]", ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]),
    ("x,y[001-002],z.dom", ["x", "y001", "y002", "z.dom"]),
])
def test_nodelist_expansion(text, expected):
    assert launch.expand_nodelist(text) == expected


@pytest.mark.parametrize("text", ["node[01-", "node[3-1]", "node[a-b]", "n]1"])
def test_bad_nodelist_names_the_list(text):
    with pytest.raises(LaunchError, match=re.escape(repr(text))):
        launch.expand_nodelist(text)


def test_tasks_per_node_expansion():
    assert launch.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert launch.expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchError, match="2x3"):
        launch.expand_tasks_per_node("2x3")


def all_topologies(ntasks, nodelist, tasks_per_node, placement):
    """Topology of every task; placement[rank] = (node, local id) as Slurm would give them."""
    return [launch.slurm_topology(slurm_env(r, ntasks, nodelist, local, node, tasks_per_node))
            for r, (node, local) in enumerate(placement)]


def test_block_placement_two_nodes_two_tasks_each():
    topos = all_topologies(4, "gpu[01-02]", "2(x2)", [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert [(t.rank, t.local_rank, t.local_size, t.cross_rank, t.cross_size, t.hostname) for t in topos] == [
        (0, 0, 2, 0, 2, "gpu01"), (1, 1, 2, 0, 2, "gpu01"), (2, 0, 2, 1, 2, "gpu02"), (3, 1, 2, 1, 2, "gpu02")]


def test_cyclic_placement_and_uneven_nodes():
    # 5 tasks cyclic over 3 nodes with 2,2,1 tasks: ranks 0,3 | 1,4 | 2
    topos = all_topologies(5, "n[1-3]", "2(x2),1", [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)])
    facts = {t.rank: (t.hostname, t.local_rank, t.local_size, t.cross_rank, t.cross_size) for t in topos}
    assert facts == {0: ("n1", 0, 2, 0, 3), 1: ("n2", 0, 2, 1, 3), 2: ("n3", 0, 1, 2, 3),
                     3: ("n1", 1, 2, 0, 2), 4: ("n2", 1, 2, 1, 2)}


def test_even_split_without_tasks_per_node():
    topo = launch.slurm_topology(slurm_env(5, 6, "c[1-3]", 1, 2))
    assert (topo.local_size, topo.cross_rank, topo.cross_size, topo.tasks_per_node) == (2, 2, 3, (2, 2, 2))


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 is not below SLURM_STEP_NUM_TASKS=2"),
    ({"SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3"}, "do not divide evenly.*SLURM_TASKS_PER_NODE is not set"),
    ({"SLURM_TASKS_PER_NODE": "1(x3)"}, "SLURM_TASKS_PER_NODE='1\\(x3\\)' gives 3 nodes"),
    ({"SLURM_TASKS_PER_NODE": "2,1"}, "adds up to 3 tasks"),
    ({"SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not a node index"),
    ({"SLURM_LOCALID": "1"}, "SLURM_LOCALID=1 is not below the 1 tasks of node b"),
    ({"SLURM_LOCALID": "x"}, "SLURM_LOCALID='x' is not an integer"),
    ({"SLURM_JOB_NODELIST": "a,a"}, "names a node twice"),
])
def test_inconsistent_slurm_env_names_the_variable(change, message):
    env = {**slurm_env(1, 2, "a,b", 0, 1), **change}
    with pytest.raises(LaunchError, match=message):
        launch.slurm_topology(env)


def test_missing_variables_are_named():
    env = slurm_env(0, 2, "a", 0, 0)
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        del env[name]
    with pytest.raises(LaunchError, match="SLURM_NTASKS is not"):
        launch.slurm_topology(env)
    with pytest.raises(LaunchError, match="neither TFDIST_RENDEZVOUS_PORT nor SLURM_JOB_ID"):
        launch.rendezvous_port({})


def test_launcher_detection():
    srun_task = slurm_env(0, 2, "a", 0, 0)
    assert launch.detect_launcher(srun_task) == "slurm"
    assert launch.detect_launcher({**srun_task, "HOROVOD_RANK": "0"}) == "horovodrun"
    # srun --mpi=pmi2 sets PMI_RANK, but Open MPI cannot initialise from PMI-2: such tasks take Gloo
    assert launch.detect_launcher({**srun_task, "PMI_RANK": "0"}, mpi_built=True) == "slurm"
    assert launch.detect_launcher({**srun_task, "PMIX_RANK": "0"}, mpi_built=True) == "mpi"
    assert launch.detect_launcher({**srun_task, "OMPI_COMM_WORLD_RANK": "0"}, mpi_built=True) == "mpi"
    assert launch.detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "2"}, mpi_built=True) == "mpi"  # mpiexec
    assert launch.detect_launcher({**srun_task, "PMI_RANK": "0"}, mpi_built=False) == "slurm"
    assert launch.detect_launcher({**srun_task, "TFDIST_LAUNCHER": "none"}) == "none"
    batch_script = {k: v for k, v in srun_task.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert launch.detect_launcher(batch_script) == "none"   # the sbatch script itself: 1 process
    with pytest.raises(LaunchError, match="TFDIST_LAUNCHER='mpich'"):
        launch.detect_launcher({"TFDIST_LAUNCHER": "mpich"})
    with pytest.raises(LaunchError, match="OMPI_COMM_WORLD_SIZE=4.*without MPI"):
        launch.prepare(mpi_built=False, env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"})


def test_port_is_deterministic_per_job_step_and_overridable():
    a = launch.rendezvous_port({"SLURM_JOB_ID": "981", "SLURM_STEP_ID": "0"})
    assert a == launch.rendezvous_port({"SLURM_JOB_ID": "981", "SLURM_STEP_ID": "0"})
    assert 20000 <= a < 30000
    assert a != launch.rendezvous_port({"SLURM_JOB_ID": "981", "SLURM_STEP_ID": "1"})
    assert launch.rendezvous_port({"TFDIST_RENDEZVOUS_PORT": "31000", "SLURM_JOB_ID": "1"}) == 31000
    with pytest.raises(LaunchError, match="TFDIST_RENDEZVOUS_PORT=70000"):
        launch.rendezvous_port({"TFDIST_RENDEZVOUS_PORT": "70000"})


def test_single_node_env_for_horovod():
    env = slurm_env(1, 2, "localhost", 1, 0, TFDIST_RENDEZVOUS_PORT="1")  # 1 task would skip all this
    topo = launch.slurm_topology(env)
    out = launch.horovod_env(topo, "127.0.0.1", 1234, "lo")
    assert out == {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
                   "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
                   "HOROVOD_HOSTNAME": "localhost", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                   "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234", "HOROVOD_CONTROLLER": "gloo",
                   "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "lo"}
    assert launch.interface_towards("127.0.0.1") == "lo"


def test_multi_node_first_node_on_loopback_is_refused():
    topo = launch.slurm_topology(slurm_env(1, 2, "localhost,other", 0, 1))
    with pytest.raises(LaunchError, match="'localhost' resolves to the loopback address 127.0.0.1"):
        launch.rendezvous_address(topo, {})


def test_multi_node_host_whose_name_is_loopback_is_refused(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(LaunchError, match="'localhost' resolves to the loopback address 127.0.0.1.*whatever "
                                          "HOROVOD_GLOO_IFACE says"):
        launch.check_own_hostname()


# ---------------------------------------------------------------- rendezvous (in-process, no Horovod)

def test_unreachable_rendezvous_fails_naming_address_and_port():
    port = free_port()
    topo = launch.slurm_topology(slurm_env(1, 2, "localhost", 1, 0))
    start = time.monotonic()
    with pytest.raises(LaunchError, match=f"task 1 on localhost could not reach the rendezvous server at "
                                          f"127.0.0.1:{port}.*within 1.5 s"):
        rendezvous.check_in(topo, "127.0.0.1", port, "4242.0", timeout=1.5)
    assert time.monotonic() - start < 10


def test_missing_task_is_named_by_the_server():
    port = free_port()
    topo = launch.slurm_topology(slurm_env(0, 3, "localhost", 0, 0))
    server = rendezvous.RendezvousServer(topo, port, "4242.0")
    try:
        with pytest.raises(LaunchError, match=f"rendezvous at 127.0.0.1:{port}.*task\\(s\\) 1, 2 of 3 "
                                              "have not arrived"):
            rendezvous.check_in(topo, "127.0.0.1", port, "4242.0", timeout=1.0, server=server)
        # a server of another job on the port is recognised, not joined
        other = launch.slurm_topology(slurm_env(1, 3, "localhost", 1, 0))
        with pytest.raises(LaunchError, match="belongs to another job \\(4242.0, this is 99.0\\)"):
            rendezvous.check_in(other, "127.0.0.1", port, "99.0", timeout=5)
        # the same port twice: a clear bind error
        with pytest.raises(LaunchError, match=f"cannot start the rendezvous server on port {port}"):
            rendezvous.RendezvousServer(topo, port, "4242.0")
    finally:
        server.stop()



def test_values_are_swapped_through_the_store_and_a_missing_rank_is_named():
    import threading

    port = free_port()
    server = rendezvous.RendezvousServer(launch.slurm_topology(slurm_env(0, 1, "localhost", 0, 0)), port, "1.0")
    try:
        got = {}
        threads = [threading.Thread(target=lambda r: got.update({r: rendezvous.exchange(
            "127.0.0.1", port, "s", r, 2, f"v{r}", timeout=10)}), args=(r,)) for r in (1, 0)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert got == {0: ["v0", "v1"], 1: ["v0", "v1"]}
        with pytest.raises(LaunchError, match=f"rank 0: after 0.5 s rank\\(s\\) 1, 2 of 3 had not published their "
                                              f"t value at the rendezvous 127.0.0.1:{port}"):
            rendezvous.exchange("127.0.0.1", port, "t", 0, 3, "x", timeout=0.5)
    finally:
        server.stop()
    with pytest.raises(LaunchError, match=f"rank 1 could not reach the rendezvous store at 127.0.0.1:{port} within "
                                          "0.5 s to publish its s value"):
        rendezvous.exchange("127.0.0.1", port, "s", 1, 2, "v1", timeout=0.5)


def test_mwms_benchmark_workers_take_ports_the_os_gives(monkeypatch):
    # (TF_CONFIG through monkeypatch.setenv only: delenv of an unset variable records nothing, so
    # the TF_CONFIG this sets leaked into the next test's tfdist-run job)
    """Not the ports after Gloo's rendezvous port, as they once were: another process held one of
    them in CI ("Could not start gRPC server")."""
    from tfdist.benchmark import modes

    port = free_port()
    server = rendezvous.RendezvousServer(launch.slurm_topology(slurm_env(0, 1, "localhost", 0, 0)), port, "1.0")
    held = socket.socket()
    try:
        held.bind(("", port + 1))
        held.listen()
        for name, value in {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1", "HOROVOD_LOCAL_SIZE": "1",
                            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("TF_CONFIG", "")  # unset for tfdist; restored (unset) when the test ends
        modes.mwms_tf_config(timeout=5)
        (worker,) = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
        with socket.socket() as probe:
            probe.bind(("", int(worker.split(":")[1])))  # free, unlike port + 1
        monkeypatch.delenv("HOROVOD_GLOO_RENDEZVOUS_ADDR")
        monkeypatch.setenv("TF_CONFIG", "")
        with pytest.raises(SystemExit, match="launch with horovodrun --gloo or tfdist-run, or set TF_CONFIG"):
            modes.mwms_tf_config()
    finally:
        held.close()
        server.stop()


# ---------------------------------------------------------------- real srun-style jobs

def run_tasks(envs, out_dir, prefixes=None, timeout=JOB_TIMEOUT):
    """Start one plain python process per env (no horovodrun), wait for all; {rank: results}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, extra in enumerate(envs):
        command = [*(prefixes[i] if prefixes else []), sys.executable, str(WORKER), "--out", str(out_dir)]
        with open(out_dir / f"task{i}.log", "w") as log:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=make_job_env(extra), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
    if wait_or_kill(procs, timeout):
        raise JobFailed(f"srun-style job timed out after {timeout}s\n{logs(out_dir)}")
    codes = [proc.returncode for proc in procs]
    if any(codes):
        raise JobFailed(f"srun-style tasks exited with {codes}\n{logs(out_dir)}")
    return read_results(out_dir)


def logs(out_dir):
    return "\n".join(f"--- {p.name}\n{_tail(p.read_text(), 30)}" for p in sorted(out_dir.glob("task*.log")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_job([WORKER, "--reference"], tmp_path_factory.mktemp("launch_ref"), np=None)[0]


def assert_trained_alike(ranks, reference):
    assert sorted(ranks) == [0, 1]
    assert ranks[0]["final"] == ranks[1]["final"]  # bit-identical across ranks
    assert ranks[0]["steps"] == reference["steps"] > 0
    for a, b in zip(ranks[0]["final"], reference["final"]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)


@pytest.mark.multirank
def test_srun_style_two_tasks_on_loopback(tmp_path, reference):
    port = str(free_port())
    envs = [slurm_env(r, 2, "localhost", r, 0, "2", TFDIST_RENDEZVOUS_PORT=port) for r in (0, 1)]
    ranks = run_tasks(envs, tmp_path)
    assert_trained_alike(ranks, reference)
    for r in (0, 1):
        assert ranks[r]["topology"] == {"rank": r, "size": 2, "local_rank": r, "local_size": 2,
                                        "cross_rank": 0, "cross_size": 1}
        assert ranks[r]["horovod_env"]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == port
        assert ranks[r]["horovod_env"]["HOROVOD_GLOO_IFACE"] == "lo"


from emulate_hosts import NetworkNamespaces  # noqa: E402  (tests/emulate_hosts.py, shared with the benchmarks)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (this test runs as uid %d)" % os.geteuid())
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    hosts = NetworkNamespaces()
    try:
        hosts.create()
    except (RuntimeError, OSError) as e:
        hosts.remove()
        pytest.skip(f"cannot create network namespaces here: {e}")
    try:
        yield hosts
    finally:
        hosts.remove()


@pytest.mark.multirank
def test_two_hosts_in_network_namespaces(tmp_path, two_hosts, reference):
    port = str(free_port())
    envs = [slurm_env(r, 2, "hosta,hostb", 0, r, "1(x2)", TFDIST_RENDEZVOUS_ADDR=two_hosts.addresses[0],
                      TFDIST_RENDEZVOUS_PORT=port) for r in (0, 1)]
    prefixes = [["ip", "netns", "exec", ns] for ns in two_hosts.names]
    ranks = run_tasks(envs, tmp_path, prefixes)
    assert_trained_alike(ranks, reference)
    for r in (0, 1):
        assert ranks[r]["topology"] == {"rank": r, "size": 2, "local_rank": 0, "local_size": 1,
                                        "cross_rank": r, "cross_size": 2}
        env = ranks[r]["horovod_env"]
        assert env["HOROVOD_HOSTNAME"] == ("hosta", "hostb")[r]
        assert env["HOROVOD_GLOO_IFACE"] == two_hosts.links[r]  # the veth, not loopback
        assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.77.0.1"


def test_network_namespaces_are_removed_after_use():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    hosts = NetworkNamespaces()
    try:
        hosts.create()
    except RuntimeError as e:
        hosts.remove()
        pytest.skip(f"cannot create network namespaces here: {e}")
    hosts.remove()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in hosts.names)
    assert not any(os.path.exists(f"/etc/netns/{ns}") for ns in hosts.names)
    assert not any(link in links for link in hosts.links)


# ---------------------------------------------------------------- tfdist-run

def test_tfdist_run_builds_each_launchers_command(monkeypatch):
    py = sys.executable
    hvd = str(BIN / "horovodrun")
    assert run.build_command("horovodrun", ["python", "t.py", "--x"], np=2) == [hvd, "-np", "2", "--gloo", py, "t.py", "--x"]
    assert run.build_command("horovodrun", ["python3", "t.py"], hosts="a:2,b:2") == [
        hvd, "-np", "4", "--gloo", "-H", "a:2,b:2", py, "t.py"]
    mpi = run.build_command("mpirun", ["python", "t.py"], np=4, hosts="a:2,b:2", env={"PATH": "/bin"}, as_root=False)
    assert mpi[1:] == ["-np", "4", "-H", "a:2,b:2", "-bind-to", "none", "-map-by", "slot", "-x", "PATH", py, "t.py"]
    assert os.path.basename(mpi[0]) == "mpirun"
    srun = run.build_command("srun", ["python", "t.py"], np=8, hosts="n1:4,n2:4", extra=["--cpus-per-task=2"])
    assert srun[1:] == ["--ntasks=8", "--nodelist=n1,n2", "--ntasks-per-node=4", "--kill-on-bad-exit=1",
                        "--cpus-per-task=2", py, "t.py"]
    # unequal slots: srun has no per-node counts, so tasks are placed one per SLURM_HOSTFILE line
    uneven = run.build_command("srun", ["python", "t.py"], hosts="n1:3,n2:1")
    assert uneven[1:5] == ["--ntasks=4", "--nodelist=n1,n2", "--distribution=arbitrary", "--kill-on-bad-exit=1"]
    assert run.srun_hostfile_lines("n1:3,n2:1") == ["n1", "n1", "n1", "n2"]
    assert run.srun_hostfile_lines("n1:3,n2:1", np=2) == ["n1", "n1"]
    with pytest.raises(run.UsageError, match="-np 5 is more than the 4 slots"):
        run.srun_hostfile_lines("n1:3,n2:1", np=5)
    with pytest.raises(run.UsageError, match="-np is required"):
        run.build_command("horovodrun", ["python", "t.py"])
    with pytest.raises(run.UsageError, match="-H 'a:x'"):
        run.build_command("srun", ["t.py"], hosts="a:x")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert run.resolve_launcher("auto") == "horovodrun"


def tfdist_run(*args, timeout=JOB_TIMEOUT, env=None):
    job_env = make_job_env(env)  # env={"X": None} removes X
    job_env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen([str(BIN / "tfdist-run"), *map(str, args)], cwd=ROOT, env=job_env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out, err, timed_out = communicate_or_kill(proc, timeout)
    if timed_out:
        raise JobFailed(f"tfdist-run {' '.join(map(str, args))} timed out after {timeout}s")
    return proc.returncode, out, err


def test_tfdist_run_dry_run_prints_the_command():
    code, out, _ = tfdist_run("--dry-run", "-np", 2, "python", "train.py", "--epochs", 3)
    assert code == 0
    wrap = f"{sys.executable} -m tfdist --"
    assert out.strip() == f"{BIN / 'horovodrun'} -np 2 --gloo {wrap} {sys.executable} train.py --epochs 3"
    code, out, _ = tfdist_run("--dry-run", "--launcher", "srun", "-np", 4, "python", "train.py")
    assert code == 0 and out.split()[1:] == ["--ntasks=4", "--kill-on-bad-exit=1", *wrap.split(), sys.executable, "train.py"]
    code, out, err = tfdist_run("--dry-run", "--launcher", "srun", "-H", "n1:3,n2:1", "python", "train.py")
    assert code == 0 and "--distribution=arbitrary" in out
    hostfile = err.split("SLURM_HOSTFILE=")[1].split(":")[0]
    assert open(hostfile).read().split() == ["n1", "n1", "n1", "n2"]
    code, out, _ = tfdist_run("--dry-run", "--no-tuning", "-np", 2, "python", "train.py")
    assert code == 0 and out.strip() == f"{BIN / 'horovodrun'} -np 2 --gloo {sys.executable} train.py"


def test_tfdist_run_mpirun_without_mpi_is_refused():
    from tfdist import collectives
    if collectives.horovod().mpi_built():
        pytest.skip("this Horovod has MPI")
    code, out, err = tfdist_run("--launcher", "mpirun", "-np", 2, "python", "train.py")
    assert code == 2 and out == ""
    assert "--launcher mpirun: this Horovod was built without MPI" in err


@pytest.mark.multirank
def test_tfdist_run_launches_a_real_two_rank_job(tmp_path, reference):
    code, out, err = tfdist_run("-np", 2, "python", WORKER, "--out", tmp_path)
    assert code == 0, _tail(out + err)
    assert f"tfdist-run: horovodrun: {BIN / 'horovodrun'} -np 2 --gloo {sys.executable}" in err
    ranks = read_results(tmp_path)
    assert_trained_alike(ranks, reference)
    # each rank got its share of the node before Python started: pinned, threads set, in effect
    from tfdist.tuning import plan as tuning

    cores = len(tuning.detect_topology(with_tf=False).cores)
    for r in (0, 1):
        assert ranks[r]["startup"]["route"] == "tfdist-run" and ranks[r]["startup"]["layout"] == [r, 2]
        assert ranks[r]["intra_op_threads"] == max(cores // 2, 1)
    if cores >= 2:
        assert not set(ranks[0]["cpus"]) & set(ranks[1]["cpus"])
    # code that reads TF_CONFIG at its top finds the ranks as workers (no server listens on them)
    for r in (0, 1):
        at_start = json.loads(ranks[r]["tf_config_at_start"])
        assert at_start["task"] == {"type": "worker", "index": r} and len(at_start["cluster"]["worker"]) == 2
        assert json.loads(ranks[r]["tf_config"])["cluster"] == at_start["cluster"]  # one host: known from the start
    # the exit status of the job is passed through
    code, _, _ = tfdist_run("-np", 2, "python", "-c", "import sys; sys.exit(3)")
    assert code != 0


def test_tfdist_run_refuses_a_missing_script_or_program_at_once(tmp_path):
    host = socket.gethostname()
    for command, named in ((["python", "missing.py"], "script 'missing.py' does not exist in "),
                           (["python", "-u", "-W", "ignore", "missing.py", "--epochs", "2"], "script 'missing.py'"),
                           (["no_such_program", "--flag"], "program 'no_such_program' is not on the PATH"),
                           ([str(tmp_path / "nothing.sh")], f"program '{tmp_path / 'nothing.sh'}' does not exist")):
        start = time.monotonic()
        code, out, err = tfdist_run("-np", 2, *command)
        seconds = time.monotonic() - start
        print(f"\n{' '.join(command)}: refused in {seconds:.2f} s: {err.strip()}")
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert err.startswith("tfdist-run: error: ") and named in err and f"(host {host})" in err, err
        assert "no rank was started" in err and "horovodrun" not in err, err
        assert seconds < 5, seconds  # measured: 0.3 s (no launcher, no TensorFlow)
    # -c and -m run no script file; hosts elsewhere may hold what this one lacks: a warning only
    assert run.script_of([sys.executable, "-c", "print(1)"]) is None
    assert run.script_of([sys.executable, "-m", "pkg.mod", "x.py"]) is None
    assert not run.local_only("horovodrun", "elsewhere:2") and run.local_only("horovodrun", f"{host}:2")
    assert not run.local_only("srun", None) and run.local_only("mpirun", None, env={})
    run.check_command(["python", "missing.py"], local=False)  # no exception
    # there, each rank's `python -m tfdist --` names what it cannot run (127, as a shell)
    done = subprocess.run([sys.executable, "-m", "tfdist", "--", "no_such_program"], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "HOROVOD_RANK": "1"}, timeout=60)
    assert done.returncode == 127 and done.stderr.startswith(
        f"tfdist: rank 1 (host {host}): cannot run 'no_such_program': No such file or directory"), done.stderr


def test_tfdist_run_rejects_abbreviated_options():
    code, out, err = tfdist_run("--max-restart", 1, "-np", 2, "python", "train.py")
    assert code == 2 and out == "" and "unrecognized arguments: --max-restart" in err, err
    # options after the command are the command's
    code, out, _ = tfdist_run("--dry-run", "-np", 2, "python", "train.py", "--max-restart", 1)
    assert code == 0 and out.strip().endswith("train.py --max-restart 1"), out


# What TensorFlow's C++ code logs at start-up: absl's and TF's own line formats, and the
# continuation of the CPU-instructions notice.
TF_CPP_LINE = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ |\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] "
                         r"|WARNING: All log messages before absl::InitializeLog|To enable the following instructions)")


# The start-up lines that escape TF_CPP_MIN_LOG_LEVEL (tfdist.launch.stderr_filter.START_UP).
START_UP_LINE = re.compile(r"^(?:WARNING: All log messages before absl::InitializeLog"
                           r"|[IW]\d{4} .*(?:Could not find cuda drivers|oneDNN custom operations are on))")


def rank_lines(text, rank, stream):
    """The lines rank `rank` wrote to `stream`, horovodrun's tag removed (also where lines were interleaved)."""
    tag = f"[{rank}]<{stream}>:"
    return [line.split(tag, 1)[1] for line in text.splitlines() if tag in line]


VERBOSITY = ROOT / "tests" / "multirank" / "verbosity_checks.py"

RANK_STDERR = b"""WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795820765.781009   21363 port.cc:153] oneDNN custom operations are on. You may see ...
I0000 00:00:1795820765.793886   21363 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1795820766.095701   21363 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use ...
To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
E0000 00:00:1795820793.682881   21363 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error
I0000 00:00:1795820796.864497   21363 generator_dataset_op.cc:213] Memory patch applied: M_TRIM_THRESHOLD=128 kb was set.
W0000 00:00:1795820796.895839   21363 dataset.cc:997] Input of GeneratorDatasetOp::Dataset will not be optimized ...
tfdist preemption: SIGTERM on rank 0 (host vm): every rank stopped together; ...
"""


def test_unit_stderr_filter_drops_tensorflows_start_up_lines():
    """Every rank's filter (rank 0's too) drops the start-up lines; TF_CPP_MIN_LOG_LEVEL adds the
    lines below it; TFDIST_TF_STARTUP_LINES=1 (start_up=False) with no level: no filter at all."""
    from tfdist.launch import stderr_filter as sf

    def kept(level, start_up=True):
        out, rest = sf.split(RANK_STDERR, sf.patterns(level, start_up))
        return [(line.split(b"] ")[0].split()[-1] if b"] " in line else line[:18]).decode()
                for line in out.splitlines()]

    assert kept(None) == kept("0") == ["cuda_platform.cc:52", "generator_dataset_op.cc:213", "dataset.cc:997",
                                       "tfdist preemption:"], kept(None)
    assert kept("2") == ["cuda_platform.cc:52", "tfdist preemption:"]
    assert kept("3") == ["tfdist preemption:"]
    assert sf.patterns(None, start_up=False) == () and sf.patterns("1", start_up=False) == sf.noise("1")
    assert set(sf.IGNORED) >= {"SIGTERM", "SIGUSR1"}  # Slurm signals every process: the filter outlives the rank


@pytest.mark.multirank
@pytest.mark.parametrize("flavor", ["keras3", "tf_keras"])
def test_only_the_chief_prints_progress_and_start_up_lines(tmp_path, flavor):
    """At Keras' default verbosity, at verbose=2 and at verbose=1, one voice (rank 0's); no
    TensorFlow C++ line and no Keras warning from rank 1, and none of TensorFlow's start-up lines
    from rank 0. TFDIST_QUIET_RANKS=0 brings rank 1's output back (Keras 3: with verbose=1 passed
    to the first fit too), and TFDIST_TF_STARTUP_LINES=1 rank 0's start-up lines."""
    env = {"TF_CPP_MIN_LOG_LEVEL": None, "TF_USE_LEGACY_KERAS": "1" if flavor == "tf_keras" else "0"}
    code, out, err = tfdist_run("-np", 2, "python", VERBOSITY, "--out", tmp_path / "default", env=env)
    assert code == 0, _tail(out + err)
    text = out + err
    assert rank_lines(text, 1, "stdout") == [], rank_lines(text, 1, "stdout")
    assert sum("Epoch 1/2" in line for line in rank_lines(text, 0, "stdout")) == 1, _tail(out)
    assert sum("Epoch 1/2" in line for line in text.splitlines()) == 1, _tail(out)
    for epochs in (3, 4):  # verbose=2, then verbose=1: rank 0's lines only
        assert sum(f"Epoch {epochs}/{epochs}" in line for line in text.splitlines()) == 1, _tail(out)
    assert sum(" - loss: " in line and "/step" in line for line in rank_lines(text, 0, "stdout")) >= 3, _tail(out)
    rank1_tf = [line for line in rank_lines(text, 1, "stderr") if TF_CPP_LINE.match(line)]
    rank0_tf = [line for line in rank_lines(text, 0, "stderr") if TF_CPP_LINE.match(line)]
    print(f"\n{flavor}: {len(text.splitlines())} lines; TensorFlow C++ start-up lines: rank 0 {len(rank0_tf)}, "
          f"rank 1 {len(rank1_tf)}")
    assert rank1_tf == [], rank1_tf
    assert not [line for line in rank_lines(text, 0, "stderr") if START_UP_LINE.match(line)], rank0_tf
    assert not [line for line in rank_lines(text, 1, "stderr") if "will be ignored" in line]
    if flavor == "keras3":  # Keras 3 warns that shuffle=True is ignored for a tf.data dataset: once
        assert sum("will be ignored" in line for line in rank_lines(text, 0, "stderr")) == 1, _tail(err)
    ranks = read_results(tmp_path / "default")
    assert ranks[0]["tf_cpp_min_log_level"] is None and ranks[1]["tf_cpp_min_log_level"] in ("2", "3")

    extra = (["--verbose", 1] if flavor == "keras3" else [], {"TFDIST_QUIET_RANKS": "0"})
    code, out, err = tfdist_run("-np", 2, "python", VERBOSITY, "--out", tmp_path / "loud", *extra[0],
                                env={**env, **extra[1], "TFDIST_TF_STARTUP_LINES": "1"})
    assert code == 0, _tail(out + err)
    text = out + err
    assert text.count("Epoch 1/2") == text.count("Epoch 3/3") == 2 and rank_lines(text, 1, "stdout"), _tail(out)
    rank1_tf = [line for line in rank_lines(text, 1, "stderr") if TF_CPP_LINE.match(line)]
    asked = [line for line in rank_lines(text, 0, "stderr") if START_UP_LINE.match(line)]
    assert rank1_tf, rank1_tf  # TFDIST_QUIET_RANKS=0: as rank 0
    # TFDIST_TF_STARTUP_LINES=1: rank 0 prints them as TensorFlow does (its two libraries each once;
    # with a GPU driver, TensorFlow has no CUDA-driver line to print)
    if not os.path.exists("/proc/driver/nvidia/version"):
        assert sum("absl::InitializeLog" in line for line in asked) == 2, asked
        assert sum("Could not find cuda drivers" in line for line in asked) == 2, asked


# ---------------------------------------------------------------- sbatch templates

SBATCH = {name: ROOT / "scripts" / "slurm" / f"{name}.sbatch" for name in ("gpu_nodes", "cpu_nodes")}


def sbatch_options(path):
    options = {}
    for line in path.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].strip().partition("=")
            options[key] = value
        elif line.strip() and not line.startswith("#"):
            break  # sbatch stops reading directives at the first command
    return options


@pytest.mark.parametrize("name", sorted(SBATCH))
def test_sbatch_template_parses_and_asks_for_what_it_says(name):
    path = SBATCH[name]
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    opts = sbatch_options(path)
    assert {"--nodes", "--ntasks-per-node", "--cpus-per-task", "--time"} <= set(opts)
    if name == "gpu_nodes":  # one rank per GPU
        assert opts["--gres"] == f"gpu:{opts['--ntasks-per-node']}"
    else:
        assert "--gres" not in opts
    text = path.read_text()
    assert "stage_dataset(sys.argv[1], local_rank=0)" in text and '--ntasks-per-node=1' in text
    # training through tfdist-run (srun --kill-on-bad-exit=1, and --max-restarts from MAX_RESTARTS)
    assert re.search(r'^"\$PY" -m tfdist.launch.runner --launcher srun -np "\$SLURM_NTASKS" --max-restarts "\$\{MAX_RESTARTS:-0\}"', text, re.M)
    assert re.search(r'"\$\{run\[@\]\}" "\$\{args\[@\]\}" "\$@" &$', text, re.M)
    assert "--no-kill" in opts  # a lost node leaves the rest of the allocation for a relaunch
    # preemption: the early signal, requeue on exit 75 (tests/test_slurm.py runs it for real)
    assert opts["--signal"] == "B:USR1@120" and "--requeue" in opts and opts["--open-mode"] == "append"
    assert 'trap \'kill -USR1 "$trainer"' in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert 'run=("$PY" -m tfdist.benchmark.train_benchmark)' in text and "PYTHONPATH" not in text  # an installed tfdist


def test_sbatch_templates_run_commands_that_exist():
    from tfdist.pipelines import stage_dataset  # noqa: F401  (the staging step's import)
    from tfdist.pipelines.staging import default_local_dir  # noqa: F401
    help_text = subprocess.run([sys.executable, "-m", "tfdist.benchmark.train_benchmark", "--help"],
                               capture_output=True, text=True, cwd="/", timeout=120).stdout
    for path in SBATCH.values():
        used = set(re.findall(r"(--[a-z_]+) ", re.search(r"^args=\((.*)\)$", path.read_text(), re.M).group(1) + " "))
        assert used and all(option in help_text for option in used | {"--data_dir"}), used
