"""User reward functions named as `path/to/file.py:function` or `package.module:function`.

`static_problem` checks a reference without running the user's code (it parses the file), so
`mrl validate` can catch a missing file, a misspelt function name or a wrong signature before any
compute starts. The reward stage loads and runs the function in isolated worker processes.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
from pathlib import Path

from mrl.reward.signature import Convention, Params, Signature, binding_problem, convention, verl_params

SIGNATURE = "score(prompt, response, ground_truth, extra)"


def split_ref(ref: str) -> tuple[str, str] | None:
    """('file.py' or 'module', 'function'), or None when `ref` is malformed."""
    target, sep, func = ref.rpartition(":")
    if not sep or not target or not func.isidentifier():
        return None
    return target, func


def source_file(target: str) -> Path | None:
    """The .py file behind a path or an importable module name (without importing it)."""
    if target.endswith(".py"):
        return Path(target)
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def _accepts(fn: ast.FunctionDef | ast.AsyncFunctionDef, n: int) -> bool:
    a = fn.args
    positional = len(a.posonlyargs) + len(a.args)
    required = positional - len(a.defaults)
    return a.vararg is not None or required <= n <= positional


def _definition(ref: str) -> tuple[str | None, ast.FunctionDef | ast.AsyncFunctionDef | None]:
    """(why `ref` cannot be a function, None) or (None, its definition; None when it is assigned or
    imported, so only loading it can tell its parameters)."""
    parts = split_ref(ref)
    if parts is None:
        return f"{ref!r} is not 'path/to/file.py:function' or 'module:function'", None
    target, func = parts
    path = source_file(target)
    if path is None:
        what = "file" if target.endswith(".py") else "module"
        return f"{what} {target!r} not found", None
    if not path.is_file():
        return f"file {target!r} not found", None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except UnicodeDecodeError as e:
        return f"{target} is not UTF-8 text (byte {e.start})", None
    except SyntaxError as e:
        return f"{target} does not parse: line {e.lineno}: {e.msg}", None
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assigned = {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    imported = {(a.asname or a.name).split(".")[0] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    if func not in defs:
        if func in assigned or func in imported:
            return None, None  # defined dynamically; checked when loaded
        close = difflib.get_close_matches(func, list(defs), n=1)
        return f"{target} has no function {func!r}" + (f"; did you mean {close[0]!r}?" if close else ""), None
    return None, defs[func]


def static_problem(ref: str, n_args: int | None = 4, signature: str = SIGNATURE) -> str | None:
    """Why `ref` cannot be the named function, or None if it looks right (`n_args=None`: any
    arity, for functions called with keyword arguments such as tools)."""
    problem, fn = _definition(ref)
    if problem is not None or fn is None:
        return problem
    if n_args is not None and not _accepts(fn, n_args):
        return f"{split_ref(ref)[0]}:{fn.lineno}: {fn.name} must accept {n_args} positional arguments: {signature}"
    return None


def reward_call(ref: str, declared: Signature = "auto", kwargs: dict | None = None) -> tuple[str | None, Convention, tuple[str, ...]]:
    """(problem or None, calling convention, verl arguments to pass) for reward function `ref`
    under `reward.signature = declared` (see `mrl.reward.signature`), without running it."""
    problem, fn = _definition(ref)
    params = Params.of(fn) if fn is not None else None
    conv = convention(params, declared)
    if problem is None and params is not None:
        why = binding_problem(params, conv, kwargs or {})
        if why is not None:
            problem = f"{split_ref(ref)[0]}:{fn.lineno}: {fn.name} {why}"
    return problem, conv, verl_params(params)


def load_function(ref: str, what: str = "reward.function"):
    """Import and return the callable named by `ref` ('path/to/file.py:function' or 'module:function').

    Runs the user's module. Problems are `UserError`s naming `what` (the job key) and the reference.
    """
    import importlib
    import sys

    from mrl.errors import UserError

    parts = split_ref(ref)
    if parts is None:
        raise UserError(f"{what}: {ref!r} is not 'path/to/file.py:function' or 'module:function'")
    target, func = parts
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise UserError(f"{what}: file {target!r} not found (paths are relative to the working directory)")
        name = f"mrl_user_{path.stem}_{abs(hash(str(path))):x}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError:
            raise UserError(f"{what}: module {target!r} not found") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise UserError(f"{what}: {target} has no function {func!r}")
    return awaited(fn)


def awaited(fn):
    """`fn` itself, or for an `async def` function a plain one that runs its coroutine to the end
    (each call in a fresh event loop): callers call user functions synchronously, and an
    un-awaited coroutine is not a score."""
    import asyncio
    import functools
    import inspect

    if not inspect.iscoroutinefunction(fn):
        return fn

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return run
