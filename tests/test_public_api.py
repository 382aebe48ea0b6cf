"""Every public name of tfdist's API namespaces has type hints and a Google-style docstring.

The namespaces are `tfdist`, `tfdist.callbacks`, `tfdist.exchange`, `tfdist.optimizers` and
`tfdist.pipelines`; their public names are their `__all__` (lazily exported names resolved with
`getattr`). A module listed there (`tfdist.pipelines.preprocessing`) is checked through the public
functions and classes it defines. For each function and class:

- a docstring whose first line is a one-sentence summary (ending with a period), alone on its line;
- every parameter annotated (for a class: its `__init__`'s, `self` aside), and a function's return;
- an `Args:` section naming exactly the parameters (`*args` / `**kwargs` with their stars), each
  entry on its own line and continuation lines indented, as Griffe (mkdocstrings, strict) reads it;
- a `Returns:` section for a function that returns something (its return annotation is not None).

An exception class without an `__init__` of its own needs the summary only. Names that cannot
comply go in `EXEMPT`, with the reason; none do today.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import types

import pytest

NAMESPACES = ("tfdist", "tfdist.callbacks", "tfdist.exchange", "tfdist.optimizers", "tfdist.pipelines")

# "namespace.name" (or "module.name" inside a listed module) -> why it cannot comply.
EXEMPT: dict[str, str] = {}

SECTION = re.compile(
    r"(Args|Arguments|Parameters|Keyword Args|Returns|Yields|Raises|Example|Examples|Note|Notes|"
    r"Attributes|Warning|Warnings|See Also|References|Todo):\s*$")
ARG_ENTRY = re.compile(r"(\*{0,2}[A-Za-z_]\w*)\s*(\([^)]*\))?:(\s|$)")


def _public_names():
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        for name in module.__all__:
            yield namespace, name


def _checked_objects(namespace, name):
    """[(label, object)] to check for `namespace.name`: itself, or a listed module's own members."""
    value = getattr(importlib.import_module(namespace), name)
    label = f"{namespace}.{name}"
    if isinstance(value, types.ModuleType):
        return [(f"{value.__name__}.{member}", obj) for member, obj in vars(value).items()
                if not member.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                and obj.__module__ == value.__name__]
    if inspect.isfunction(value) or inspect.isclass(value):
        defined = f"{value.__module__}.{value.__qualname__}"
        return [(label if defined.endswith(f".{name}") else f"{label} ({defined})", value)]
    return []  # constants: no signature or docstring of their own to check


def _own_docstring(obj):
    # A class's __doc__ is its own (None when it has none), never its base class's.
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc) if doc else ""


def _sections(doc, problems):
    """{section title: [its body lines, indentation kept]} of a cleaned Google-style docstring.

    A section ends at a blank line followed by an unindented line (prose after it); an unindented
    line straight after a section's lines is added to `problems`.
    """
    sections, current, previous = {}, None, ""
    for line in doc.splitlines():
        header = SECTION.fullmatch(line)
        if header:
            current = sections.setdefault(header[1], [])
        elif current is not None and line.strip() and not line[0].isspace():
            if previous.strip():
                problems.append(f"line {line!r} continues a section without indentation")
            current = None
        elif current is not None:
            current.append(line)
        previous = line
    return sections


def _documented_args(lines, problems):
    """The names an `Args:` section documents; malformed lines are added to `problems`."""
    body = [line for line in lines if line.strip()]
    if not body:
        return []
    indent = min(len(line) - len(line.lstrip()) for line in body)
    names = []
    for line in body:
        if len(line) - len(line.lstrip()) > indent:
            continue  # a continuation line
        entry = ARG_ENTRY.match(line.strip())
        if entry is None:
            problems.append(f"Args: line {line.strip()!r} is neither `name: description` nor an indented "
                            "continuation line")
        else:
            names.append(entry[1])
    return names


def _is_plain_exception(cls):
    """An exception class that takes its base's arguments (no `__init__` of its own in tfdist)."""
    return issubclass(cls, BaseException) and not any(
        "__init__" in vars(base) for base in cls.__mro__ if base.__module__ != "builtins")


def _signature(obj):
    """(parameters to check, the return annotation or None when not required)."""
    if inspect.isclass(obj):
        init = obj.__init__
        if init is object.__init__:
            return [], None
        parameters = list(inspect.signature(init).parameters.values())[1:]  # self
        return parameters, None
    signature = inspect.signature(obj)
    return list(signature.parameters.values()), signature.return_annotation


def _annotation_problem(annotation):
    if annotation is inspect.Parameter.empty:
        return "no type annotation"
    if isinstance(annotation, str):  # `from __future__ import annotations`: the source text
        try:
            ast.parse(annotation, mode="eval")
        except SyntaxError:
            return f"annotation {annotation!r} is not a Python expression"
    return None


def _display_name(parameter):
    return {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(
        parameter.kind, "") + parameter.name


def check(obj):
    """What `obj` lacks (sentences; empty when it complies)."""
    problems = []
    doc = _own_docstring(obj)
    if not doc:
        return ["no docstring"]
    lines = doc.splitlines()
    summary = lines[0].strip()
    if not summary or SECTION.fullmatch(summary):
        problems.append("the docstring does not start with a summary line")
    elif len(lines) > 1 and lines[1].strip():
        problems.append(f"the summary {summary!r} runs on to a second line (one line, then a blank line)")
    elif not summary.endswith("."):
        problems.append(f"the summary {summary!r} does not end with a period")
    if inspect.isclass(obj) and _is_plain_exception(obj):
        return problems
    parameters, returns = _signature(obj)
    for parameter in parameters:
        problem = _annotation_problem(parameter.annotation)
        if problem:
            problems.append(f"parameter {_display_name(parameter)}: {problem}")
    if inspect.isfunction(obj):
        problem = _annotation_problem(returns)
        if problem:
            problems.append(f"return value: {problem}")
    sections = _sections(doc, problems)
    if parameters:
        if "Args" not in sections:
            problems.append(f"no Args: section (parameters: {', '.join(map(_display_name, parameters))})")
        else:
            documented = _documented_args(sections["Args"], problems)
            wanted = [_display_name(p) for p in parameters]
            missing = [name for name in wanted if name not in documented]
            unknown = [name for name in documented if name not in wanted]
            if missing:
                problems.append(f"Args: does not document {', '.join(missing)}")
            if unknown:
                problems.append(f"Args: documents {', '.join(unknown)}, which the signature does not have "
                                "(a strict docs build fails on it)")
    elif "Args" in sections:
        problems.append("Args: section, but the signature takes no parameters")
    returns_something = returns not in (None, inspect.Signature.empty, "None") and returns is not type(None)
    if inspect.isfunction(obj) and returns_something and "Returns" not in sections:
        problems.append(f"no Returns: section (it returns {returns})")
    return problems


@pytest.mark.parametrize("namespace, name", list(_public_names()), ids=lambda value: value)
def test_public_name_is_annotated_and_documented(namespace, name):
    if f"{namespace}.{name}" in EXEMPT:
        pytest.skip(EXEMPT[f"{namespace}.{name}"])
    problems = [f"{label}: {problem}"
                for label, obj in _checked_objects(namespace, name) if label not in EXEMPT
                for problem in check(obj)]
    assert not problems, "\n".join(problems)


def test_exemptions_are_still_public_names():
    """An exemption outlives its reason silently unless it must name a current public name."""
    known = {f"{namespace}.{name}" for namespace, name in _public_names()}
    known |= {label for namespace, name in _public_names() for label, _ in _checked_objects(namespace, name)}
    assert not set(EXEMPT) - known, f"EXEMPT names what is no longer public: {sorted(set(EXEMPT) - known)}"


def test_the_checker_finds_what_is_missing():
    """`check` itself: each kind of lapse is reported, naming the piece."""
    def unannotated(a, *args, b=1, **kwargs):
        """Summary line.

        Args:
            a: one.
            c: not a parameter.
        continued without indentation
        """

    def fine(a: int, *args: int, **kwargs: str) -> int:
        """Summary line.

        Args:
            a: one,
                continued.
            *args: more.
            **kwargs: the rest.

        Returns:
            A number.
        """
        return a

    def wrapped_summary() -> None:
        """A summary that
        runs on."""

    class Plain(ValueError):
        """An error."""

    class NoArgs:
        """A class.

        Args:
            x: x.
        """

        def __init__(self, x):
            pass

    problems = "\n".join(check(unannotated))
    for piece in ("parameter a: no type annotation", "parameter *args", "parameter **kwargs",
                  "return value: no type annotation", "does not document *args, b, **kwargs",
                  "documents c", "continued without indentation"):
        assert piece in problems, (piece, problems)
    assert check(fine) == []
    assert "runs on to a second line" in check(wrapped_summary)[0]
    assert check(Plain) == []
    assert check(NoArgs) == ["parameter x: no type annotation"]

    def silent(a: int) -> int:
        """Summary."""
        return a

    assert check(silent) == ["no Args: section (parameters: a)", "no Returns: section (it returns int)"]
