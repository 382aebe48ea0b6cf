"""Which of a reference suite's tests are tf.distribute tests, read from their source.

A Keras 3 test is one if its body, or its class's `setUp`, uses `tf.distribute` or a strategy class
by name (an attribute chain or a name in code, not a word in a string or comment); absl's
parameterized copies of a test are picked with it. A tf-keras test is one if the strategy
combination it runs with is the slot with one CPU replica per worker (its generated name says so).
"""

import ast
import inspect
import textwrap

STRATEGY_NAMES = ("MirroredStrategy", "MultiWorkerMirroredStrategy")
TF_KERAS_SLOT = "MultiWorkerMirrored2x1CPU"  # combinations.multi_worker_mirrored_2x1_cpu's name


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def uses_tf_distribute(tree):
    """Whether the code in `tree` refers to tf.distribute or a mirrored strategy class."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name.startswith("tf.distribute") or name.split(".")[-1] in STRATEGY_NAMES:
                return True
        elif isinstance(node, ast.Name) and node.id in STRATEGY_NAMES:
            return True
    return False


def file_may_have_tests(source):
    """Whether a test file has a test function or `setUp` that uses tf.distribute (cheap pre-pick)."""
    if not any(name in source for name in ("tf.distribute", *STRATEGY_NAMES)):
        return False
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                node.name.startswith("test") or node.name in ("setUp", "setUpClass")):
            if uses_tf_distribute(node):
                return True
    return False


def _source_tree(function):
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    except (OSError, TypeError, SyntaxError):
        return None


def is_keras3_distribute_test(item):
    """Whether a collected pytest item is a tf.distribute test (see module)."""
    function = getattr(item, "function", None)
    tree = _source_tree(function) if function is not None else None
    if tree is not None and uses_tf_distribute(tree):
        return True
    cls = getattr(item, "cls", None)
    set_up = getattr(cls, "setUp", None) if cls is not None else None
    if set_up is None or getattr(set_up, "__qualname__", "").split(".")[0] != cls.__name__:
        return False
    tree = _source_tree(set_up)
    return tree is not None and uses_tf_distribute(tree)


def is_tf_keras_slot_test(item):
    return TF_KERAS_SLOT in item.name
