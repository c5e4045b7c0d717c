"""Which calling convention a user reward function expects: mrl's or verl's.

mrl calls `score(prompt, response, ground_truth, extra)` positionally. verl calls
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)`
by keyword. A verl function called mrl's way receives the prompt as its `data_source`, so its
dispatch on the data source fails (or scores 0 under `reward.on_error = "zero"`). The convention is
read from the function's parameter names without running it (`reward.signature = "auto"`), or
stated in the job (`"mrl"` / `"verl"`); `mrl validate` refuses a function whose parameters the
chosen convention cannot bind.

A verl-convention call passes each of verl's four arguments the function names (all four when it
takes `**kwargs`), plus `reward.kwargs`:

| verl argument | what mrl passes |
| --- | --- |
| `data_source` | the row's data source (`data.source_key`, default the file's stem) |
| `solution_str` | the response text |
| `ground_truth` | the row's ground truth (`data.answer_key`; verl data: `reward_model.ground_truth`) |
| `extra_info` | the row's `extra_info` column (a table; `{}` when the row has none) |
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Literal, Mapping

Signature = Literal["auto", "mrl", "verl"]
Convention = Literal["mrl", "verl"]

MRL_PARAMS = ("prompt", "response", "ground_truth", "extra")
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)"
MRL_SIGNATURE = "score(prompt, response, ground_truth, extra)"
# Names only verl's convention uses: one of them among a function's parameters makes "auto" pick verl.
_VERL_ONLY = ("data_source", "solution_str", "extra_info")


@dataclass(frozen=True)
class Params:
    """A function's parameters as written (from its source, not by importing it)."""

    positional: tuple[str, ...]  # positional-only and positional-or-keyword, in order
    positional_only: int  # how many of `positional` cannot be passed by name
    required_positional: int  # how many of `positional` have no default
    keyword_only: tuple[str, ...]
    required_keyword_only: tuple[str, ...]
    varargs: bool
    varkw: bool

    @property
    def names(self) -> tuple[str, ...]:
        return self.positional + self.keyword_only

    @classmethod
    def of(cls, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> "Params":
        a = fn.args
        positional = tuple(p.arg for p in (*a.posonlyargs, *a.args))
        required_kw = tuple(p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is None)
        return cls(positional=positional, positional_only=len(a.posonlyargs),
                   required_positional=len(positional) - len(a.defaults),
                   keyword_only=tuple(p.arg for p in a.kwonlyargs), required_keyword_only=required_kw,
                   varargs=a.vararg is not None, varkw=a.kwarg is not None)


def convention(params: Params | None, declared: Signature) -> Convention:
    """The convention to call with: the declared one, else verl's when a parameter has one of
    verl's own names (`data_source`, `solution_str`, `extra_info`), else mrl's. A function whose
    parameters cannot be read (defined dynamically) is called mrl's way unless declared "verl"."""
    if declared != "auto":
        return declared
    if params is not None and any(n in params.names for n in _VERL_ONLY):
        return "verl"
    return "mrl"


def verl_params(params: Params | None) -> tuple[str, ...]:
    """The verl arguments to pass by name: those the function names, all four with `**kwargs` (or
    when its parameters cannot be read)."""
    if params is None or params.varkw:
        return VERL_PARAMS
    return tuple(n for n in VERL_PARAMS if n in params.names)


def binding_problem(params: Params, conv: Convention, kwargs: Mapping[str, Any] = ()) -> str | None:
    """Why the function cannot be called in convention `conv` (with `kwargs` from `reward.kwargs`
    passed by name too), or None when it can."""
    if conv == "mrl":
        positional = len(params.positional)
        if not (params.varargs or params.required_positional <= 4 <= positional) or params.required_keyword_only:
            return f"must accept 4 positional arguments: {MRL_SIGNATURE} (a verl function: reward.signature = 'verl')"
        return None
    bindable = set(VERL_PARAMS) | set(kwargs)
    named = params.positional[params.positional_only:] + params.keyword_only
    required = params.positional[:params.required_positional]   # positional-only ones cannot be passed by name
    unbound = [n for i, n in enumerate(required) if i < params.positional_only or n not in bindable]
    unbound += [n for n in params.required_keyword_only if n not in bindable]
    if unbound:
        return (f"parameter{'s' if len(unbound) > 1 else ''} {', '.join(unbound)} cannot be bound: verl's convention "
                f"passes {', '.join(VERL_PARAMS)} (and reward.kwargs) by name: {VERL_SIGNATURE}")
    if "solution_str" not in named and not params.varkw:
        return f"takes no `solution_str` (the response): {VERL_SIGNATURE}"
    extra = [k for k in kwargs if k not in named and not params.varkw]
    if extra:
        return f"reward.kwargs {', '.join(extra)} match no parameter and it takes no **kwargs"
    return None


def verl_call_kwargs(names: tuple[str, ...], response: str, ground_truth: Any, data_source: str,
                     row_extra: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict:
    """The keyword arguments of a verl-convention call (see the module table), `kwargs` last."""
    extra_info = row_extra.get("extra_info")
    values = {"data_source": data_source, "solution_str": response, "ground_truth": ground_truth,
              "extra_info": dict(extra_info) if isinstance(extra_info, Mapping) else {}}
    return {**{n: values[n] for n in names}, **kwargs}
