"""Profiling: ProfileSteps' trace and scalars, step markers on both Keras flavours, tfdist's named
collectives, Horovod's timeline, the per-rank summary naming a straggler, the benchmark's profiles
side by side, and TensorBoard's Profile and Scalars pages in a real (headless Chromium) browser.

The multi-rank tests share one 2-rank Keras 3 job (tests/multirank/profile_checks.py) in which
rank 1's input pipeline sleeps 0.2 s per batch.
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from browser import chromium_or_skip, get_json, page_text, screenshot, tensorboard
from conftest import BIN, ROOT, flavor_env, run_job
from tfdist.benchmark import profile_summary
from tfdist.callbacks import ProfileSteps
from tfdist.callbacks._keras import keras_module

keras = keras_module()
WORKER = ROOT / "tests" / "multirank" / "profile_checks.py"
FIT_STEPS, LOOP_STEPS = 4, 3  # the worker's PROFILED range and LOOP_STEPS


def test_profile_loads_in_the_plugin_and_scalars_are_written(tmp_path):
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((64, 8), np.float32), np.ones((64, 1), np.float32)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[ProfileSteps(str(tmp_path / "run"), steps=(3, 6), batch_size=8)])

    traces = glob.glob(str(tmp_path / "run" / "rank0" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(traces) == 1
    from xprof.convert import raw_to_tool_data

    tools = raw_to_tool_data.xspace_to_tool_names(traces)
    assert "trace_viewer" in tools or "trace_viewer@" in tools
    steps = profile_summary.step_breakdown(profile_summary.trace_events(traces[0]))
    assert steps["steps"] == 3 and [s["step"] for s in steps["per_step"]] == [3, 4, 5]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "rank0"))
    events.Reload()
    tags = events.Tags()["tensors"]
    assert {"loss", "learning_rate", "images_per_second"} <= set(tags)
    assert len(events.Tensors("loss")) == 2


def test_step_range_is_validated():
    with pytest.raises(ValueError, match="ProfileSteps.*start < stop"):
        ProfileSteps("/tmp/x", steps=(5, 5))


def test_straggler_is_the_rank_the_others_wait_for():
    def ms(step, compute, input_wait, communication):
        return {"steps": 3, "step": step, "compute": compute, "input": input_wait, "communication": communication}

    slow, why = profile_summary.straggler({"rank0": ms(210, 8, 1, 201), "rank1": ms(211, 9, 200, 2)})
    assert slow == "rank1" and why.startswith("input: it waits 200.0 ms/step") and "201.0 ms/step" in why
    slow, why = profile_summary.straggler({"rank0": ms(100, 95, 1, 4), "rank1": ms(100, 10, 1, 89)})
    assert slow == "rank0" and why.startswith("compute: it computes 95.0 ms/step")
    assert profile_summary.straggler({"rank0": ms(100, 90, 5, 5), "rank1": ms(100, 90, 6, 4)})[0] is None
    assert profile_summary.straggler({"rank0": None})[1].startswith("no step markers")


def overview(trace):
    """The Overview page's data for one profile, as the profile plugin serves it to the browser."""
    from xprof.convert import raw_to_tool_data

    data, _ = raw_to_tool_data.xspace_to_tool_data([trace], "overview_page", {})
    tables = json.loads(data)
    return next(t["p"] for t in tables if "steptime_ms_average" in t.get("p", {}))


@pytest.fixture(scope="module")
def profiled_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("profiled")
    results = run_job([WORKER, "--slow_rank", "1"], out, env=flavor_env("keras3"), timeout=300)
    return out, results


@pytest.mark.multirank
def test_summary_names_the_slow_rank_and_its_input_wait(profiled_job):
    out, results = profiled_job
    assert [results[r]["size"] for r in (0, 1)] == [2, 2]
    summary = subprocess.run([sys.executable, "-m", "tfdist.benchmark.profile_summary", str(out / "fit")],
                             capture_output=True, text=True, timeout=120)
    assert summary.returncode == 0, summary.stderr[-3000:]
    print(summary.stdout)
    rows = {cells[0]: cells[1:] for cells in
            ([c.strip() for c in line.split("|")[1:-1]] for line in summary.stdout.splitlines()
             if line.startswith("| rank") and "steps" not in line)}
    assert set(rows) == {"rank0", "rank1"}
    rank0, rank1 = ([float(v) for v in rows[r]] for r in ("rank0", "rank1"))  # steps, step, compute, input, comm
    assert rank0[0] == rank1[0] == FIT_STEPS
    assert rank0[1] > 150 and rank1[1] > 150  # both ranks' steps take the slow rank's 200 ms
    assert rank1[3] > 100 and rank0[3] < 50  # rank 1 waits for its input ...
    assert rank0[4] > 100 and rank1[4] < rank0[4]  # ... and rank 0 waits for rank 1 in the allreduce
    assert re.search(r"^slowest rank: rank1, input: it waits [\d.]+ ms/step for its input pipeline",
                     summary.stdout, re.M), summary.stdout


@pytest.mark.multirank
def test_overview_has_step_times_and_the_input_bound_rank(profiled_job):
    out, _ = profiled_job
    pages = {r: overview(profile_summary.newest_trace(str(out / "fit" / f"rank{r}"))) for r in (0, 1)}
    for page in pages.values():
        assert float(page["steptime_ms_average"]) > 150  # "No step marker observed" gives 0.0
    assert float(pages[1]["infeed_time_ms_avg"]) > 100 and "input-bound" in pages[1]["input_conclusion"]
    assert float(pages[0]["infeed_time_ms_avg"]) < 50


@pytest.mark.multirank
def test_trace_names_tfdist_collectives_and_horovod_timeline_is_beside_it(profiled_job):
    out, results = profiled_job
    events = profile_summary.trace_events(profile_summary.newest_trace(str(out / "fit" / "rank0")))
    names = {e["name"] for e in events} | {str(e.get("args", {}).get("name", "")) for e in events}
    for scope in ("tfdist_allreduce/", "tfdist_metric_sync/"):
        assert any(scope in n and "Horovod" in n for n in names), (scope, sorted(n for n in names if "Horovod" in n))
    assert results[0]["timeline"], "rank 0 wrote no Horovod timeline"
    text = (out / "fit" / "horovod_timeline.json").read_text()
    assert "NEGOTIATE_ALLREDUCE" in text and "tfdist_allreduce" in text and "tfdist_metric_sync" in text


@pytest.mark.multirank
def test_custom_loop_steps_carry_step_markers(profiled_job):
    out, _ = profiled_job
    for rank in (0, 1):
        trace = profile_summary.newest_trace(str(out / "loop" / f"rank{rank}"))
        steps = profile_summary.step_breakdown(profile_summary.trace_events(trace))
        assert steps["steps"] == LOOP_STEPS and steps["step"] > 0
        assert [s["step"] for s in steps["per_step"]] == list(range(LOOP_STEPS))


def cli(name, *args):
    """Run one of tfdist's console scripts; its stdout."""
    out = subprocess.run([str(BIN / name), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_benchmark_profiles_are_summarised_by_op_type_and_by_op(tmp_path):
    cli("tfdist-benchmark", "--model", "mnist_cnn", "--image_size", 16, "--num_classes", 10, "--batch_size", 4,
        "--num_warmup_batches", 1, "--num_batches", 4, "--variable_update", "none",
        "--profile_dir", tmp_path / "prof", "--profile_steps", 2)
    assert re.search(r"^\| rank0 \| 2 \| [\d.]+ \|", cli("tfdist-profile", tmp_path / "prof"), re.M)  # 2 steps
    for by, top in (("type", 5), ("op", 8)):
        out = cli("tfdist-profile", tmp_path / "prof", tmp_path / "prof", "--top", top, "--by", by)
        rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()[2:]]
        assert len(rows) == top + 1 and rows[-1][0] == "all ops"  # the top ops, then the total
        assert any("Conv2D" in row[0] for row in rows[:-1])  # the CNN's convolutions are among the top
        assert all(row[1] == row[2] and re.fullmatch(r"\d+\.\d+ \(\d+%\)", row[1]) for row in rows[:-1])
        assert all(("/" in row[0]) == (by == "op") for row in rows[:-1] if row[0] != "IDLE"), rows  # names or types


def test_tf_keras_steps_carry_step_markers(tmp_path):
    run_job([WORKER], tmp_path, np=None, env=flavor_env("tf_keras"), timeout=180)
    trace = profile_summary.newest_trace(str(tmp_path / "fit" / "rank0"))
    steps = profile_summary.step_breakdown(profile_summary.trace_events(trace))
    assert steps["steps"] == FIT_STEPS  # tf-keras' own markers, each wholly inside the profile
    assert float(overview(trace)["steptime_ms_average"]) > 0


@pytest.mark.multirank
def test_profile_overview_and_scalars_in_a_real_browser(profiled_job, tmp_path):
    chromium = chromium_or_skip()
    out, _ = profiled_job
    with tensorboard(out / "fit") as base:
        runs = get_json(f"{base}/data/plugin/profile/runs")
        assert sorted(r.split("/")[0] for r in runs) == ["rank0", "rank1"], runs
        rank1 = next(r for r in runs if r.startswith("rank1/"))
        # The Profile tab's page (TensorBoard shows it in an iframe), on rank 1's profile.
        page = f"{base}/data/plugin/profile/index.html?run={rank1}&tag="
        overview = page_text(chromium, page + "overview_page")
        summary = {name: float(ms) for name, ms in
                   re.findall(r"(Input|Host Compute|All Others) Time \(σ = [\d.]+ ms\) ([\d.]+) ms", overview)}
        assert set(summary) == {"Input", "Host Compute", "All Others"}, overview[:3000]
        assert summary["Input"] > 100 and summary["Input"] > summary["Host Compute"], summary
        inputs = page_text(chromium, page + "input_pipeline_analyzer")
        step = re.search(r"step-time statistics Average: ([\d.]+) ms", inputs)
        assert step and float(step.group(1)) > 150, inputs[:3000]
        assert "HIGHLY input-bound" in inputs, inputs[:3000]
        shots = [screenshot(chromium, page + tool, tmp_path / f"profile_{name}.png", size="1400,1100")
                 for tool, name in (("overview_page", "overview"), ("input_pipeline_analyzer", "input_pipeline"))]
        if os.environ.get("TFDIST_DOCS_SCREENSHOT"):  # refresh the pictures docs/PROFILING.md shows
            for shot in shots:
                shutil.copy(shot, ROOT / "docs" / shot.name)
        scalars = page_text(chromium, f"{base}/#timeseries")  # TensorBoard's scalars view
        for tag in ("accuracy", "images_per_second", "learning_rate", "loss"):
            assert tag in scalars, (tag, scalars[:3000])
        assert re.search(r"rank0 [\d.]+ [\d.]+ 0 0 rank1 [\d.]+", scalars), scalars[:3000]
