"""conftest.py of a scratch copy of Keras 3's tests (tests/reference/suite.py writes it there).

Keras' repository has a root conftest.py that its sdist leaves out; some test modules import
`skip_if_backend` from it, and its markers say which tests need a trainable backend. This is
tfdist's own stand-in for what those tests use of it (the TensorFlow backend is trainable).
"""

import pytest
from keras.src.backend import backend


def pytest_configure(config):
    for marker in ("requires_trainable_backend", "requires_jax", "requires_torch", "requires_tensorflow"):
        config.addinivalue_line("markers", f"{marker}: a marker of Keras' own test configuration")


def skip_if_backend(given_backend, reason):
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
