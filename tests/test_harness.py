"""The suite's own harness: what the processes a test starts do differently from a user's (tests/site)."""

from conftest import python_results

KERAS_EXTRAS = """
import sys
import keras
from keras.src.wrappers import fixes
print("RESULT keras imported", sorted(m for m in ("sklearn", "matplotlib") if m in sys.modules), fixes.sklearn)
from sklearn.datasets import load_digits
import matplotlib.pyplot
print("RESULT then", load_digits().data.shape, matplotlib.pyplot.__name__)
"""


def test_keras_alone_finds_no_sklearn_or_matplotlib_and_everyone_else_does():
    """Keras' optional imports of scikit-learn and matplotlib (about 2 s of CPU per process) find
    nothing in test processes; the digits loaders and the scaling plot import both as usual."""
    lines = python_results(KERAS_EXTRAS)
    assert lines == ["keras imported [] None", "then (1797, 64) matplotlib.pyplot"], lines
