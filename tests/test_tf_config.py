"""Clusters that TF_CONFIG describes (Kubeflow's TFJob, Ray Train, cloud trainers): the parse and
its errors, who wins beside a launcher, the TF_CONFIG exported under launchers, and real jobs of
plain processes that join as Horovod ranks and train to one process's weights."""

import json
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, make_job_env, run_job
from test_launch import WORKER, assert_trained_alike, run_tasks, two_hosts  # noqa: F401  (a fixture)
from tfdist import launch
from tfdist.errors import LaunchError
from tfdist.launch import tf_config


def config(cluster, task_type="worker", index=0, **extra):
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}, **extra})


def kubeflow_tf_config(hosts, task_type, index, port=2222):
    """TF_CONFIG as Kubeflow's training operator writes it for a TFJob with one Chief and Workers."""
    return json.dumps({"cluster": {"chief": [f"{hosts[0]}:{port}"], "worker": [f"{h}:{port}" for h in hosts[1:]]},
                       "task": {"type": task_type, "index": index}, "environment": "cloud"})


# ---------------------------------------------------------------- parse, order, errors (no processes)

def test_rank_order_is_mwms_chief_first_then_workers_by_index():
    cluster = {"worker": ["b:1", "b:2", "c:1"], "chief": ["a:1"]}
    ranks = [tf_config.parse(config(cluster, t, i)).rank for t, i in
             [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]]
    assert ranks == [0, 1, 2, 3]
    where = tf_config.parse(config(cluster, "worker", 1)).placement()
    assert where == {"rank": 2, "size": 4, "local_rank": 1, "local_size": 2, "cross_rank": 0, "cross_size": 1,
                     "node_index": 1, "nodes": ("a", "b", "c"), "tasks_per_node": (1, 2, 1)}
    workers_only = tf_config.parse(config({"worker": ["[::1]:5", "[::1]:6"]}, "worker", 1))
    assert (workers_only.rank, workers_only.host(1), workers_only.port(0)) == (1, "::1", 5)
    assert tf_config.parse("{}") is None and tf_config.parse('{"cluster": {}}') is None


@pytest.mark.parametrize("text, message", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ('["a:1"]', "must be a JSON object"),
    (config({"worker": ["a:1"], "ps": ["b:1"]}), "cluster.ps names parameter-server tasks.*not supported"),
    (config({"worker": ["a:1"], "evaluator": ["b:1"]}), "cluster.evaluator names an evaluator task"),
    (config({"worker": ["a:1", "b:1"]}, "evaluator", 0), "task.type is 'evaluator'"),
    (config({"master": ["a:1"], "worker": ["b:1"]}), "cluster.master names a 'master' task"),
    (config({"worker": ["a:1"], "boss": ["b:1"]}), "cluster.boss: unknown task type"),
    (config({"worker": ["a:1", "b:1"]}, "worker", 2), "task.index 2 is out of range: cluster.worker has 2"),
    (config({"worker": ["a:1", "b:1"]}, "worker", -1), "task.index -1 is out of range"),
    (config({"worker": ["a:1", "b:1"]}, "chief", 0), "task.type 'chief' is not in its cluster"),
    (json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}), "TF_CONFIG has no task"),
    (config({"worker": ["a", "b:1"]}), r"cluster.worker\[0\] = 'a' is not 'host:port'"),
    (config({"worker": ["a:1", "a:1"]}), "names an address twice"),
    (config({"chief": ["a:1", "b:1"]}, "chief", 0), "cluster.chief names 2 tasks"),
    (config({"worker": []}), "cluster.worker must be a non-empty list"),
])
def test_a_tf_config_it_cannot_use_names_the_field(text, message):
    with pytest.raises(LaunchError, match=message) as caught:
        tf_config.parse(text)
    assert "\n" not in str(caught.value) and "Fix" in str(caught.value)
    assert tf_config.peek({"TF_CONFIG": text}) is None  # the early tuning never fails on it


def test_a_launcher_wins_and_its_chief_says_tf_config_was_ignored():
    two = config({"worker": ["a:1", "b:1"]}, "worker", 1)
    assert launch.detect_launcher({"TF_CONFIG": two}) == "tf_config"
    assert launch.detect_launcher({"TF_CONFIG": config({"worker": ["a:1"]})}) == "none"  # one task: one process
    assert launch.detect_launcher({"TF_CONFIG": two, "HOROVOD_RANK": "0"}) == "horovodrun"
    assert launch.detect_launcher({"TF_CONFIG": two, "OMPI_COMM_WORLD_RANK": "0"}, mpi_built=True) == "mpi"
    srun = {"TF_CONFIG": two, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    assert launch.detect_launcher(srun) == "slurm"
    assert launch.detect_launcher({**srun, "TFDIST_LAUNCHER": "tf_config"}) == "tf_config"
    assert launch.detect_launcher({"TF_CONFIG": two, "TFDIST_LAUNCHER": "none"}) == "none"
    assert "TF_CONFIG ignored: horovodrun started this job" in tf_config.ignored_note("horovodrun", {"TF_CONFIG": two})
    # the TF_CONFIG tfdist exported itself is not the user's: no note
    env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_HOSTNAME": "n1",
           "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000"}
    tf_config.export_early(env)
    assert tf_config.ignored_note("horovodrun", env) is None and tf_config.given(env) is None
    # a bad TF_CONFIG in a plain process is an error at the strategy's start, never a 1-rank job
    with pytest.raises(LaunchError, match="task.index 5"):
        launch.prepare(env={"TF_CONFIG": config({"worker": ["a:1", "b:1"]}, "worker", 5)})


def test_launchers_export_their_ranks_as_workers():
    one_node = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_HOSTNAME": "n1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": "4000"}
    assert json.loads(tf_config.export_early(one_node)) == {
        "cluster": {"worker": ["n1:4001", "n1:4002"]}, "task": {"type": "worker", "index": 1}}
    srun = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "TFDIST_RENDEZVOUS_PORT": "5000"}
    workers = json.loads(tf_config.export_early(srun))["cluster"]["worker"]
    assert workers[0] == "rank0.tfdist.invalid:5001" and workers[2].endswith(":5003")  # other hosts: unknown yet
    tf_config.export_for_launcher(3, 2, ["x", "y", "z"], env=srun)  # HorovodStrategy() knows every host
    assert json.loads(srun["TF_CONFIG"])["cluster"]["worker"] == ["x:5001", "y:5002", f"{socket.gethostname()}:5003"]
    users = {**one_node, "TF_CONFIG": config({"worker": ["u:1", "v:1"]})}
    assert tf_config.export_early(users) is None and users["TF_CONFIG"] == config({"worker": ["u:1", "v:1"]})
    assert tf_config.export_early({"TF_CONFIG": ""}) is None  # no launcher: nothing exported


# ---------------------------------------------------------------- real jobs of plain processes

@pytest.fixture(scope="module", params=["keras3", "tf_keras"])
def flavour(request, tmp_path_factory):
    """(the flavour's environment, one process's results at the global batch)."""
    env = {"TF_USE_LEGACY_KERAS": "1" if request.param == "tf_keras" else None}
    return env, run_job([WORKER, "--reference"], tmp_path_factory.mktemp(f"tf_config_ref_{request.param}"),
                        np=None, env=env)[0]


def assert_one_job(ranks, types):
    assert [ranks[r]["replicas"] for r in (0, 1)] == [2, 2]
    assert [ranks[r]["is_chief"] for r in (0, 1)] == [True, False]
    assert [tuple(ranks[r]["resolver"]) for r in (0, 1)] == types
    assert [ranks[r]["startup"]["layout"] for r in (0, 1)] in ([[0, 2], [1, 2]], [[0, 1], [0, 1]])


@pytest.mark.multirank
def test_two_plain_processes_with_a_workers_tf_config_train_as_one_job(tmp_path, flavour):
    env, reference = flavour
    ports = [free_port(), free_port()]
    text = [config({"worker": [f"localhost:{p}" for p in ports]}, "worker", i) for i in (0, 1)]
    ranks = run_tasks([{**env, "TF_CONFIG": t} for t in text], tmp_path)
    assert_trained_alike(ranks, reference)
    assert_one_job(ranks, [("worker", 0), ("worker", 1)])
    assert [ranks[r]["startup"]["layout"] for r in (0, 1)] == [[0, 2], [1, 2]]  # one node: its cores split
    assert ranks[0]["horovod_env"]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == str(ports[0])
    assert ranks[1]["tf_config"] == text[1]  # the user's TF_CONFIG is left as it was
    assert "TF_CONFIG cluster: 2 workers as 2 ranks (worker:0 is rank 0) on 1 host(s)" in (tmp_path / "task0.log").read_text()


@pytest.mark.multirank
def test_a_kubeflow_tfjob_chief_and_worker_on_two_hosts(tmp_path, two_hosts):
    """The TF_CONFIG a TFJob's pods get (one Chief, one Worker, port 2222 on each pod), each task in
    a network namespace of its own (its own address, as a pod has)."""
    reference = run_job([WORKER, "--reference"], tmp_path / "reference", np=None)[0]
    hosts = two_hosts.addresses
    envs = [{"TF_CONFIG": kubeflow_tf_config(hosts, "chief", 0)}, {"TF_CONFIG": kubeflow_tf_config(hosts, "worker", 0)}]
    prefixes = [["ip", "netns", "exec", ns] for ns in two_hosts.names]
    ranks = run_tasks(envs, tmp_path / "job", prefixes)
    assert_trained_alike(ranks, reference)
    assert_one_job(ranks, [("chief", 0), ("worker", 0)])
    assert ranks[1]["horovod_env"]["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == hosts[0]
    assert ranks[1]["horovod_env"]["HOROVOD_GLOO_RENDEZVOUS_PORT"] == "2222"
    assert ranks[1]["horovod_env"]["HOROVOD_GLOO_IFACE"] == two_hosts.links[1]


@pytest.mark.multirank
@pytest.mark.parametrize("text, message", [
    (config({"chief": ["localhost:1"], "worker": ["localhost:2"], "ps": ["localhost:3"]}, "worker", 0),
     "TF_CONFIG cluster.ps names parameter-server tasks"),
    (config({"worker": ["localhost:1", "localhost:2"]}, "worker", 7), "TF_CONFIG task.index 7 is out of range"),
])
def test_a_bad_tf_config_stops_the_process_naming_the_field(tmp_path, text, message):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, env=make_job_env({"TF_CONFIG": text}), timeout=180)
    assert proc.returncode != 0 and time.monotonic() - start < 120
    assert f"tfdist.errors.LaunchError: {message}" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("rank*.json"))


def test_ray_trains_legacy_keras_setting_without_tf_keras_names_both_fixes(monkeypatch):
    from tfdist.errors import KerasHookError
    from tfdist.keras import flavour

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # as where tf-keras is not installed
    with pytest.raises(KerasHookError, match=r"TF_USE_LEGACY_KERAS=1 asks for tf-keras, which is not installed.*"
                                             r"Ray Train sets.*pip install tf-keras.*TF_USE_LEGACY_KERAS=0"):
        flavour.keras_module()
