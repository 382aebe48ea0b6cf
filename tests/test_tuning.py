"""Tuning decisions on synthetic topologies (pure), and applying them in a fresh process."""

import subprocess
import sys

import pytest

from tfdist.tuning.plan import Topology, make_plan


def node(sockets, cores_per_socket, smt=False):
    cores, cpu = [], 0
    threads = 2 if smt else 1
    total = sockets * cores_per_socket
    for s in range(sockets):
        for c in range(cores_per_socket):
            logical = s * cores_per_socket + c
            cores.append((s, c, tuple(logical + t * total for t in range(threads))))
    return tuple(cores)


def plans(topology_cores, local_size, **kwargs):
    return [make_plan(Topology(topology_cores, r, local_size, **kwargs)) for r in range(local_size)]


def test_two_sockets_28_cores_4_ranks_get_disjoint_half_sockets():
    result = plans(node(2, 28), 4)
    assert [p.intra_op_threads for p in result] == [14] * 4
    assert [p.inter_op_threads for p in result] == [None] * 4  # TensorFlow's default: measured not to lose
    assert [p.env["TF_NUM_INTRAOP_THREADS"] for p in result] == ["14"] * 4 and "TF_NUM_INTEROP_THREADS" not in result[0].env
    cpus = [set(p.cpu_affinity) for p in result]
    assert all(len(c) == 14 for c in cpus) and len(set().union(*cpus)) == 56
    assert cpus[0] == set(range(14)) and cpus[3] == set(range(42, 56))


def test_smt_siblings_are_pinned_but_not_counted_as_threads():
    result = plans(node(1, 8, smt=True), 2)
    assert [p.intra_op_threads for p in result] == [4, 4]
    assert set(result[0].cpu_affinity) == {0, 1, 2, 3, 8, 9, 10, 11}
    assert "SMT" in result[0].summary()


def test_one_rank_spanning_two_sockets_gets_all_cores_and_tf_inter_op_default():
    (plan,) = plans(node(2, 4), 1)
    assert (plan.intra_op_threads, plan.inter_op_threads) == (8, None)
    assert "inter_op=TF default" in plan.summary()


def test_a_rank_on_one_cpu_gets_two_inter_op_threads_not_tensorflows_one():
    # TensorFlow's default pool is the rank's cpu count: 1 deadlocks a tf.function that makes an
    # iterator over a distributed dataset (issue 35; tests/multirank/conformance_checks.py runs one).
    result = plans(node(1, 2), 2)
    assert [p.inter_op_threads for p in result] == [2, 2]
    assert [p.env["TF_NUM_INTEROP_THREADS"] for p in result] == ["2", "2"]
    assert "inter_op 2, not TF's default 1 for 1 cpu" in result[0].summary()
    (asked,) = [make_plan(Topology(node(1, 8), 0, 1), inter_op_threads=1)]
    assert asked.inter_op_threads == 2 and "not 1 asked for" in asked.summary()
    (two_siblings,) = plans(node(1, 2, smt=True), 2)[:1]  # one core, two SMT siblings: TF's default is 2
    assert two_siblings.inter_op_threads is None


def test_more_ranks_than_cores_is_reported():
    result = plans(node(1, 2), 4)
    assert [p.intra_op_threads for p in result] == [1] * 4
    assert "oversubscribed" in result[0].summary()


def test_one_gpu_per_local_rank_on_an_8_gpu_node():
    result = plans(node(2, 16), 8, gpus=8)
    assert [p.visible_gpu for p in result] == list(range(8))
    assert [p.intra_op_threads for p in result] == [4] * 8
    assert "one GPU per local rank" in result[0].summary()


def test_each_local_rank_sees_only_its_gpu_with_memory_growth():
    result = plans(node(2, 16), 4, gpus=4)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in result] == ["0", "1", "2", "3"]
    assert all(p.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true" for p in result)
    # the ids the scheduler gave (indices or UUIDs), round-robin when ranks outnumber GPUs
    result = plans(node(1, 8), 4, gpu_ids=("GPU-aa", "GPU-bb"))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in result] == ["GPU-aa", "GPU-bb", "GPU-aa", "GPU-bb"]
    assert "4 local ranks share 2 GPUs" in result[0].summary()
    # a rank already narrowed to one GPU (srun --gpus-per-task=1) keeps it; no GPU: nothing set
    (one,) = plans(node(1, 8), 1, gpu_ids=("5",))
    assert "CUDA_VISIBLE_DEVICES" not in one.env and one.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    (cpu,) = plans(node(1, 8), 1)
    assert "CUDA_VISIBLE_DEVICES" not in cpu.env and "TF_FORCE_GPU_ALLOW_GROWTH" not in cpu.env


def test_visible_gpu_ids_without_tensorflow():
    from tfdist.tuning import gpu

    assert gpu.visible_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ("2", "3")
    assert gpu.visible_ids({"CUDA_VISIBLE_DEVICES": ""}) == ()
    assert gpu.visible_ids({"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ("1",)  # CUDA stops at -1
    assert gpu.visible_ids({}, device_files=["/dev/nvidia1", "/dev/nvidia0", "/dev/nvidiactl"]) == ("0", "1")
    assert gpu.is_gpu_request("gpu") and gpu.is_gpu_request("/job:worker/device:GPU:0")
    assert not gpu.is_gpu_request(None) and not gpu.is_gpu_request("/cpu:0")


def test_gpu_phrase_reports_tensorflows_view():
    from tfdist.tuning import gpu

    effect = {"gpus": [{"name": "/physical_device:GPU:0", "device_name": "NVIDIA H100 80GB HBM3",
                        "compute_capability": [9, 0], "memory_growth": True}],
              "cuda_visible_devices": "3", "cuda_libraries": "CUDA 12.9.79, cuDNN 9.28.0.42"}
    assert gpu.describe(effect) == "GPU 3 = NVIDIA H100 80GB HBM3 (cc 9.0), memory growth on"
    assert gpu.describe({**effect, "gpus": []}) == "" and gpu.absence(effect) == ""
    assert gpu.absence({**effect, "gpus": []}) == "no GPU visible (CUDA 12.9.79, cuDNN 9.28.0.42 installed)"
    assert gpu.absence({**effect, "gpus": [], "cuda_libraries": None}) == ""


def test_openmp_settings_only_for_openmp_builds():
    (plain,) = plans(node(1, 4), 1)
    (openmp,) = plans(node(1, 4), 1, openmp_build=True)
    assert "OMP_NUM_THREADS" not in plain.env and plain.env["TF_ENABLE_ONEDNN_OPTS"] == "1"
    assert openmp.env["OMP_NUM_THREADS"] == "4"
    assert openmp.env["KMP_AFFINITY"] == "granularity=fine,compact,1,0"


def test_overrides_win():
    plan = make_plan(Topology(node(1, 8), 0, 1), intra_op_threads=3, inter_op_threads=2, pin=False)
    assert (plan.intra_op_threads, plan.inter_op_threads, plan.cpu_affinity) == (3, 2, ())
    assert plan.env["TF_NUM_INTEROP_THREADS"] == "2"
    assert "TF_ENABLE_ONEDNN_OPTS" not in make_plan(Topology(node(1, 8), 0, 1), onednn=None).env
    assert make_plan(Topology(node(1, 8), 0, 1), onednn=False).env["TF_ENABLE_ONEDNN_OPTS"] == "0"


@pytest.mark.parametrize("late", [False, True])
def test_apply_sets_threads_or_says_it_is_too_late(late):
    code = (
        "import os, tensorflow as tf\n"
        "from tfdist import tuning\n"
        + ("tf.constant(1.0) + 1\n" if late else "")
        + "plan = tuning.make_plan(tuning.detect_topology(0, 1), intra_op_threads=1, inter_op_threads=1)\n"
        "late = tuning.apply(plan)\n"
        "print('LATE', late)\n"
        "print('THREADS', tf.config.threading.get_intra_op_parallelism_threads())\n"
        "print('AFFINITY', sorted(os.sched_getaffinity(0)) == sorted(plan.cpu_affinity))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "AFFINITY True" in out.stdout, out.stderr[-2000:]
    if late:
        assert "intra/inter-op threads" in out.stdout
    else:
        assert "LATE []" in out.stdout and "THREADS 1" in out.stdout


def test_cpu_jobs_get_a_slower_horovod_cycle_started_on_enqueue_gpu_jobs_keep_the_default(monkeypatch):
    from tfdist.tuning import horovod_env as tuning

    on_enqueue = tuning.CYCLE_ON_ENQUEUE
    assert tuning.horovod_defaults(gpus=0)["HOROVOD_CYCLE_TIME"][0] == "10"
    assert tuning.horovod_defaults(gpus=0)[on_enqueue][0] == "1"
    assert tuning.horovod_defaults(gpus=8) == {}
    assert tuning.horovod_defaults(gpus=0, choice={"cycle_time_ms": 1})["HOROVOD_CYCLE_TIME"][0] == "1"
    monkeypatch.delenv("TFDIST_TUNING_CHOICE", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    monkeypatch.setenv("TFDIST_CACHE_DIR", "/nonexistent-tfdist-cache")
    # what the user set wins, and is not reported as tfdist's choice
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    monkeypatch.setenv(on_enqueue, "0")
    assert tuning.set_horovod_defaults() == {}
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    monkeypatch.delenv(on_enqueue)
    defaults = tuning.horovod_defaults(0)
    assert tuning.set_horovod_defaults() == {"HOROVOD_CYCLE_TIME": ("10", defaults["HOROVOD_CYCLE_TIME"][1]),
                                             on_enqueue: ("1", defaults[on_enqueue][1])}
    import os

    assert os.environ["HOROVOD_CYCLE_TIME"] == "10" and os.environ[on_enqueue] == "1"
    # only tfdist's own CPU default follows the steps later: not the user's, not a measured one
    assert tuning.cycle_is_cpu_default({"HOROVOD_CYCLE_TIME": tuning.horovod_defaults(0)["HOROVOD_CYCLE_TIME"]})
    assert not tuning.cycle_is_cpu_default({})
    assert not tuning.cycle_is_cpu_default(tuning.horovod_defaults(0, choice={"cycle_time_ms": 10}))


def test_the_cycle_for_a_step_is_its_square_root_rule_clamped_and_rounded():
    from tfdist.tuning.cycle import cycle_for_step_ms

    assert cycle_for_step_ms(2000) == cycle_for_step_ms(60_000) == 10.0   # ResNet50 on CPU: kept
    assert cycle_for_step_ms(40) == 1.5                                    # sqrt(0.05 * 40) = 1.41
    assert cycle_for_step_ms(500) == 5.0
    assert cycle_for_step_ms(5) == cycle_for_step_ms(0.1) == 0.5           # the floor
    steps = [1, 3, 10, 30, 100, 300, 1000, 3000]
    assert [cycle_for_step_ms(s) for s in steps] == sorted(cycle_for_step_ms(s) for s in steps)


def test_open_mpi_yields_on_cpu_jobs_it_started_unless_the_user_said(monkeypatch):
    from tfdist.tuning import horovod_env

    yield_variable = horovod_env.OPEN_MPI_YIELD
    assert horovod_env.horovod_defaults(gpus=0, open_mpi=True)[yield_variable][0] == "1"
    assert yield_variable not in horovod_env.horovod_defaults(gpus=0)          # Gloo or MPICH: not Open MPI's
    assert yield_variable not in horovod_env.horovod_defaults(gpus=4, open_mpi=True)   # GPU: Horovod's own choice
    monkeypatch.setenv("TFDIST_CACHE_DIR", "/nonexistent-tfdist-cache")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "10")
    monkeypatch.setenv(horovod_env.CYCLE_ON_ENQUEUE, "1")
    monkeypatch.delenv(yield_variable, raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    assert horovod_env.set_horovod_defaults() == {}
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv(yield_variable, "0")   # mpirun --mca mpi_yield_when_idle 0
    assert horovod_env.set_horovod_defaults() == {}
    monkeypatch.delenv(yield_variable)
    assert list(horovod_env.set_horovod_defaults()) == [yield_variable]
    import os

    assert os.environ[yield_variable] == "1"
