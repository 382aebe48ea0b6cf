"""tfdist-predict's cost model against hand-computed cases and the seed's published ResNet50 table."""

import pytest

from tfdist.exchange import compression_plan
from tfdist.benchmark import step_model as predict

RESNET50 = predict.Rank(compute_s=0.1982, gradient_bytes=102.2e6)  # seed: 161.45 images/s per GPU at batch 32


def test_ring_allreduce_alpha_beta_cost():
    link = predict.Link(bandwidth_gbit=8, latency_us=10)  # 1 GB/s
    # 4 ranks, one per node: 2*3 latencies + 2*3/4 of 100 MB at 1 GB/s
    assert link.seconds(100e6, 4, 1) == pytest.approx(6 * 10e-6 + 1.5 * 0.1)
    assert link.seconds(100e6, 1, 1) == 0.0
    # all ranks on one node: node-local bandwidth (20x the link by default)
    assert link.seconds(100e6, 4, 4) == pytest.approx(6 * 10e-6 + 1.5 * 0.1 / 20)


def test_one_collective_exposes_everything_buckets_hide_all_but_the_tail():
    link = predict.Link(bandwidth_gbit=25, latency_us=5)
    step1, exposed1, comm1 = predict.step_time(RESNET50, link, 64, 8, bucket_bytes=0)
    assert exposed1 == pytest.approx(comm1) and step1 == pytest.approx(RESNET50.compute_s + comm1)
    step_b, exposed_b, comm_b = predict.step_time(RESNET50, link, 64, 8, bucket_bytes=25e6)
    assert exposed_b < 0.4 * exposed1  # most of the communication overlaps backprop
    last = link.seconds(102.2e6 - 4 * 25e6, 64, 8)
    assert exposed_b >= last - 1e-12  # the last bucket can only start after the last gradient
    assert predict.step_time(RESNET50, link, 1)[0] == RESNET50.compute_s


def test_buckets_follow_backprop_and_cover_every_byte():
    buckets = predict.bucket_schedule(RESNET50, 25e6)
    assert sum(size for _, size in buckets) == pytest.approx(102.2e6)
    times = [t for t, _ in buckets]
    assert times == sorted(times) and times[-1] == pytest.approx(RESNET50.compute_s)
    assert times[0] > RESNET50.compute_s * (1 - RESNET50.backward_fraction)


def test_seed_table_64_gpus_within_10_percent_on_the_stated_link():
    """Seed: 322.9 images/s on 2 GPUs, 9,318 on 64, batch 32 per GPU. Assumed: 8 GPUs per node,
    25 Gbit/s with 10 us latency between nodes (the link of Horovod's own published benchmark),
    Horovod-style fused buckets of 25 MB."""
    rows = predict.table(RESNET50, predict.Link(25, 10), [2, 64], 8, 25e6, 32)
    assert rows[0]["images_per_sec"] == pytest.approx(322.9, rel=0.02)
    assert rows[1]["images_per_sec"] == pytest.approx(9318, rel=0.10)


def test_command_prints_the_table_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert predict.main(["--compute_ms", "198.2", "--gradient_mb", "102.2", "--bandwidth_gbit", "25",
                         "--ranks", "1", "8", "64", "--ranks_per_node", "8", "--batch_per_rank", "32",
                         "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| buckets of 25 MB | 64 |" in out and "| one collective | 64 |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_reproduces_the_measured_one_collective_step(capsys):
    rank = predict.Rank(compute_s=2.9658, gradient_bytes=102.3e6)
    gbit = predict.effective_bandwidth(rank, predict.Link(1.0, 30), 4.3159, 2)
    # 2 ranks: 2 hops, each rank sends and receives the whole gradient once: 102.3 MB in 1.35 s
    assert gbit == pytest.approx(102.3e6 * 8 / (4.3159 - 2.9658 - 2 * 30e-6) / 1e9)
    assert predict.step_time(rank, predict.Link(gbit, 30), 2)[0] == pytest.approx(4.3159)
    with pytest.raises(ValueError, match="leaves no time for communication"):
        predict.effective_bandwidth(rank, predict.Link(1.0, 30), 2.9, 2)
    assert predict.main(["--compute_ms", "2965.8", "--gradient_mb", "102.3", "--calibrate_one_collective_ms",
                         "4315.9", "--latency_us", "30", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "calibrated: 0.636 Gbit/s effective" in out  # 102.3 MB = 102.3 * 2**20 bytes and "| one collective | 2 | 4315.9 |" in out
    with pytest.raises(SystemExit):
        predict.main(["--compute_ms", "100", "--gradient_mb", "10"])  # neither a rate nor a calibration


@pytest.mark.parametrize("flag,value", [("--bandwidth_gbit", "0"), ("--bandwidth_gbit", "-25"),
                                        ("--compute_ms", "0"), ("--ranks", "0"), ("--latency_us", "-1"),
                                        ("--bandwidth_gbit", "nan"), ("--sparse_mb", "-1")])
def test_nonsense_numbers_are_rejected_at_parse_time_naming_the_flag(flag, value, capsys):
    args = {"--compute_ms": "198", "--gradient_mb": "102", "--bandwidth_gbit": "25", flag: value}
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error, not a ZeroDivisionError later
        predict.main([part for item in args.items() for part in item])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and value.lstrip("-") in err


def test_compression_wire_bytes_and_flops_by_hand():
    shapes = [[300, 200], [200], [10, 10]]  # dense kernel, bias, and a matrix too small for rank 4
    assert compression_plan.wire_bytes(shapes, "none", 2) == ((60000 + 200 + 100) * 4, 0.0)
    assert compression_plan.wire_bytes(shapes, "fp16", 2)[0] == (60000 + 200 + 100) * 2
    assert compression_plan.wire_bytes(shapes, "bf16", 2) == ((60000 + 200 + 100) * 2, 0.0)
    # PowerSGD rank 4: (300 + 200) * 4 numbers for the kernel; the bias and 10x10 (100 < 2*20*4) sent whole
    wire, flops = compression_plan.wire_bytes(shapes, "powersgd:4", 2)
    assert wire == (500 * 4 + 200 + 100) * 4 and flops == 6 * 300 * 200 * 4
    # top-k 1%: 600 values + 600 indices from each of N ranks, as an allreduce of 4*N*k bytes
    for ranks in (2, 8):
        wire, _ = compression_plan.wire_bytes(shapes, "topk:0.01", ranks)
        assert wire == ranks * 600 * 8 / 2 + (200 + 100) * 4


def test_prediction_with_compression_sends_less_and_adds_compute(capsys):
    rank = predict.Rank(compute_s=1.8, gradient_bytes=134.1e6)
    link = predict.Link(1, 5)
    shapes = [[3072, 2048], [2048]] + [[2048, 2048], [2048]] * 6 + [[2048, 1000], [1000]]
    plain = predict.table(rank, link, [2], 1, 0, None)[0]
    low_rank = predict.table(rank, link, [2], 1, 0, None, "powersgd:4", shapes)[0]
    assert low_rank["wire_mb"] < plain["wire_mb"] / 100 and low_rank["compress_ms"] > 0
    assert low_rank["step_ms"] < plain["step_ms"]
    assert predict.main(["--compute_ms", "1800", "--gradient_mb", "134.1", "--bandwidth_gbit", "1", "--ranks", "2",
                         "--compression", "none", "topk:0.01", "powersgd:4",
                         "--shapes", "3072x2048", "2048"]) == 0
    out = capsys.readouterr().out
    assert "one collective, powersgd:4 | 2 |" in out and "wire MB" in out


@pytest.mark.parametrize("args,named", [(["--compression", "powersgd:0"], "powersgd:0"),
                                        (["--compression", "topk:0.9"], "topk:0.9"),
                                        (["--shapes", "3x"], "--shapes"),
                                        (["--compression", "powersgd:4"], "--model or --shapes")])
def test_compression_arguments_are_checked_naming_them(args, named, capsys):
    with pytest.raises(SystemExit):
        predict.main(["--compute_ms", "100", "--gradient_mb", "10", "--bandwidth_gbit", "1", *args])
    assert named in capsys.readouterr().err


def test_the_sharded_exchange_sends_an_allreduce_in_two_halves_and_holds_1_nth_of_the_state():
    link = predict.Link(bandwidth_gbit=8, latency_us=10)
    assert 2 * link.seconds(100e6, 4, 1, phases=1) == pytest.approx(link.seconds(100e6, 4, 1))
    rank = predict.Rank(compute_s=1.0, gradient_bytes=100e6)
    plain = predict.step_time(rank, link, 4, 1, bucket_bytes=0)
    sharded = predict.sharded_step_time(rank, link, 4, 1, bucket_bytes=0)
    assert sharded == pytest.approx(plain)  # one collective after backprop: the same bytes, in two halves
    # each rank runs a quarter of a 100 ms update; the allgather waits for it
    step, _, comm = predict.sharded_step_time(rank, link, 4, 1, bucket_bytes=0, update_s=0.1)
    assert step == pytest.approx(1.0 + 0.1 / 4 + comm) and comm == pytest.approx(plain[2])
    assert predict.sharded_step_time(rank, link, 1) == predict.step_time(rank, link, 1)
    assert predict.state_bytes(rank, 2, 4, sharded=True) == pytest.approx(3 * 100e6 / 4)  # 2 slots + the slice
    assert predict.state_bytes(rank, 2, 4, sharded=False) == pytest.approx(2 * 100e6)


def test_command_models_both_exchanges_and_refuses_sharded_with_compressors(capsys):
    assert predict.main(["--compute_ms", "437", "--gradient_mb", "134.1", "--bandwidth_gbit", "1", "--ranks", "2", "4",
                         "--exchange", "allreduce", "sharded", "--update_ms", "30"]) == 0
    out = capsys.readouterr().out
    assert "| buckets of 25 MB, sharded | 4 |" in out and "state MB" in out
    with pytest.raises(SystemExit):
        predict.main(["--compute_ms", "100", "--gradient_mb", "10", "--bandwidth_gbit", "1", "--exchange", "sharded",
                      "--compression", "topk:0.01"])
    assert "--exchange sharded" in capsys.readouterr().err


def test_exchange_cpu_on_a_cpu_node_stretches_the_step_by_its_cores_share(capsys):
    rank = predict.Rank(compute_s=2.0, gradient_bytes=100 * 2**20)
    link = predict.Link(bandwidth_gbit=100, latency_us=0)
    plain = predict.table(rank, link, [1, 2, 4], 2, 0, 8)
    rows = predict.table(rank, link, [1, 2, 4], 2, 0, 8, cpu_ms_per_mb=2.0, cores_per_node=2)
    assert rows[0]["cpu_ms"] == 0 and rows[0]["step_ms"] == plain[0]["step_ms"]
    # 2 ranks on a 2-core node: 2 CPU-ms a MB of 100 MB on one core each, all of it on the step
    assert rows[1]["cpu_ms"] == pytest.approx(200.0)
    assert rows[1]["step_ms"] == pytest.approx(plain[1]["step_ms"] + 200.0)
    # 4 ranks: 2(N-1)/N = 1.5 of it, still one core a rank
    assert rows[2]["cpu_ms"] == pytest.approx(300.0)
    wide = predict.table(rank, link, [2], 2, 0, 8, cpu_ms_per_mb=2.0, cores_per_node=32)
    assert wide[0]["cpu_ms"] == pytest.approx(200.0 / 16)  # 16 cores a rank share it
    assert rows[1]["efficiency"] < wide[0]["efficiency"] < 1
    with pytest.raises(SystemExit):
        predict.main(["--compute_ms", "2000", "--gradient_mb", "100", "--bandwidth_gbit", "100",
                      "--exchange_cpu_ms_per_mb", "2"])
    assert "--exchange_cpu_ms_per_mb needs --cores_per_node" in capsys.readouterr().err


def test_sparse_rows_are_gathered_as_an_allreduce_of_n_over_2_their_bytes_and_never_compressed(capsys):
    rank = predict.Rank(compute_s=0.03, gradient_bytes=0.1 * 2**20)
    link = predict.Link(bandwidth_gbit=10, latency_us=0)
    assert predict.with_sparse(rank, 40, 2).gradient_bytes == rank.gradient_bytes + 40
    assert predict.with_sparse(rank, 40, 8).gradient_bytes == rank.gradient_bytes + 160  # each rank's rows reach 7
    dense = predict.table(rank, link, [2, 8], 1, 0, None)
    rows = predict.table(rank, link, [2, 8], 1, 0, None, sparse_bytes=2**20)
    assert [r["wire_mb"] - d["wire_mb"] for r, d in zip(rows, dense)] == pytest.approx([1.0, 4.0])
    assert all(r["comm_ms"] > d["comm_ms"] for r, d in zip(rows, dense))
    halved = predict.table(rank, link, [2], 1, 0, None, "fp16", sparse_bytes=2**20)[0]
    assert halved["wire_mb"] == pytest.approx(0.05 + 1.0)  # fp16 halves the dense bytes only
    assert predict.main(["--compute_ms", "30", "--gradient_mb", "0.1", "--sparse_mb", "1", "--bandwidth_gbit", "10",
                         "--ranks", "2", "8", "--bucket_mb", "0"]) == 0
    assert "0.1 MB gradients + 1 MB sparse rows, gathered" in capsys.readouterr().out
