"""Learning-rate scaling, warmup schedule and warmup callback against reference formulas."""

import math

import numpy as np
import pytest

from tfdist.callbacks import LearningRateWarmup, WarmupSchedule, polynomial_decay, scale_learning_rate, step_decay
from tfdist.callbacks._keras import keras_module

keras = keras_module()


def test_scaling_rules():
    assert scale_learning_rate(0.1, 1024) == pytest.approx(0.4)
    assert scale_learning_rate(0.1, 1024, rule="sqrt") == pytest.approx(0.2)
    assert scale_learning_rate(0.1, 64, reference_batch_size=32) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="rule='cube'"):
        scale_learning_rate(0.1, 64, rule="cube")


def test_warmup_then_step_decay_matches_reference():
    spe = 10
    schedule = WarmupSchedule(step_decay(0.4, [3, 6], spe), warmup_steps=2 * spe, start_learning_rate=0.04)
    for step in [0, 5, 10, 19, 20, 29, 30, 59, 60, 80]:
        if step < 20:
            expected = 0.04 + (0.4 - 0.04) * step / 20
        else:
            expected = 0.4 * 0.1 ** sum(step >= b for b in (30, 60))
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6), step


def test_warmup_hands_over_to_cosine_and_polynomial_continuously():
    cosine = keras.optimizers.schedules.CosineDecay(1.0, decay_steps=100)
    schedule = WarmupSchedule(cosine, warmup_steps=10)
    at_w = 0.5 * (1 + math.cos(math.pi * 10 / 100))
    assert float(schedule(9)) == pytest.approx(at_w * 0.9, rel=1e-5)
    assert float(schedule(10)) == pytest.approx(at_w, rel=1e-5)
    assert float(schedule(50)) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-5)
    poly = WarmupSchedule(polynomial_decay(2.0, 100, power=2.0), warmup_steps=0)
    assert float(poly(30)) == pytest.approx(2.0 * (1 - 0.3) ** 2, rel=1e-5)


def test_schedule_serialises_with_its_after_schedule():
    schedule = WarmupSchedule(step_decay(0.4, [3], 10), warmup_steps=7, start_learning_rate=0.1)
    restored = WarmupSchedule.from_config(schedule.get_config())
    for step in (0, 3, 7, 29, 30, 31):
        assert float(restored(step)) == pytest.approx(float(schedule(step)))
    optimizer = keras.optimizers.SGD(schedule, momentum=0.9)
    again = keras.optimizers.SGD.from_config(optimizer.get_config())
    assert float(again.learning_rate) == pytest.approx(0.1)  # step 0 of the warmup


def train(callback, epochs, initial_epoch=0, lr=0.2):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    x, y = np.ones((8, 2), np.float32), np.ones((8, 1), np.float32)
    lrs = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: lrs.append(float(np.asarray(model.optimizer.learning_rate))))
    history = model.fit(x, y, batch_size=2, epochs=epochs, initial_epoch=initial_epoch, verbose=0,
                        callbacks=[callback, record])
    return lrs, history


def test_warmup_callback_ramps_per_step_logs_lr_and_resumes():
    lrs, history = train(LearningRateWarmup(2, steps_per_epoch=4, start_learning_rate=0.02), epochs=3)
    expected = [0.02 + (0.2 - 0.02) * (i / 8) for i in range(8)] + [0.2] * 4
    np.testing.assert_allclose(lrs, expected, rtol=1e-5)
    # the rate used by the last step of each epoch
    np.testing.assert_allclose(history.history["learning_rate"], [expected[3], expected[7], 0.2], rtol=1e-5)
    # resumed at epoch 1: continues the ramp at epoch 1, not from the start
    lrs, _ = train(LearningRateWarmup(2, steps_per_epoch=4, start_learning_rate=0.02), epochs=2, initial_epoch=1)
    np.testing.assert_allclose(lrs, expected[4:8], rtol=1e-5)


def test_momentum_correction_rescales_velocity():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    model.fit(np.ones((2, 1)), np.zeros((2, 1)), batch_size=2, epochs=1, verbose=0)
    velocity = float(np.asarray(model.optimizer.momentums[0]).ravel()[0])
    assert velocity != 0
    callback = LearningRateWarmup(1, steps_per_epoch=2, start_learning_rate=0.05, target_learning_rate=0.1)
    callback.set_model(model)
    callback.on_epoch_begin(0)
    callback.on_train_batch_begin(0)  # 0.1 -> 0.05
    assert float(np.asarray(model.optimizer.momentums[0]).ravel()[0]) == pytest.approx(velocity * 0.5)


def test_logger_records_the_scheduled_rate_each_epoch():
    from tfdist.callbacks import LearningRateLogger

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(WarmupSchedule(0.1, warmup_steps=8)), loss="mse")
    history = model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=2, epochs=3, verbose=0,
                        callbacks=[LearningRateLogger()])
    # the rate of each epoch's last step: steps 3, 7, 11 of an 8-step warmup to 0.1
    np.testing.assert_allclose(history.history["learning_rate"], [0.0375, 0.0875, 0.1], rtol=1e-5)
