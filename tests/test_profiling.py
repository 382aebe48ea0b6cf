"""ProfileSteps writes a trace the TensorBoard profile plugin can read, and epoch scalars."""

import glob
import os

import numpy as np
import pytest

from tfdist.callbacks import ProfileSteps
from tfdist.callbacks._keras import keras_module

keras = keras_module()


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
    data, content_type = raw_to_tool_data.xspace_to_tool_data(traces, "trace_viewer", {})
    assert data and b"traceEvents" in (data if isinstance(data, bytes) else data.encode())

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "rank0"))
    events.Reload()
    tags = events.Tags()["tensors"]
    assert {"loss", "learning_rate", "images_per_second"} <= set(tags)
    assert len(events.Tensors("loss")) == 2


def test_step_range_is_validated():
    with pytest.raises(ValueError, match="start < stop"):
        ProfileSteps("/tmp/x", steps=(5, 5))
