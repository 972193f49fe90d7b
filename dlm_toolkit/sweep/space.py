"""Search spaces of sweep experiments: one entry per flat policy key (:class:`ParamSpec`) and the
checks that a key exists in the policy schema and its range lies inside the field's allowed range.

Split out of :mod:`dlm_toolkit.sweep.experiment` (which re-exports these names); the semantics are
documented there.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Union

import annotated_types as at
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from dlm_toolkit.config import ROLES, ConfigError, SamplingConfig, describe_range
from dlm_toolkit.strategy.policy_config import PolicyConfig

__all__ = ["CategoricalValue", "MAX_GRID_POINTS", "MAX_GRID_VALUES", "ParamSpec", "check_conditions", "check_key"]

CategoricalValue = Union[None, bool, int, float, str]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ParamSpec(_Frozen):
    """One search-space entry: exactly one of ``float``, ``int``, ``categorical``."""

    float_: tuple[float, float] | None = Field(None, alias="float")
    int_: tuple[int, int] | None = Field(None, alias="int")
    categorical: tuple[CategoricalValue, ...] | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)
    when: dict[str, Union[CategoricalValue, tuple[CategoricalValue, ...]]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_kind(self) -> ParamSpec:
        kinds = [k for k, v in (("float", self.float_), ("int", self.int_), ("categorical", self.categorical))
                 if v is not None]
        if len(kinds) != 1:
            raise ValueError(f"give exactly one of float: [lo, hi], int: [lo, hi], categorical: [...] "
                             f"(got {', '.join(kinds) or 'none'})")
        if self.categorical is not None:
            if not self.categorical:
                raise ValueError("categorical: needs at least one value")
            if len(set(map(repr, self.categorical))) != len(self.categorical):
                raise ValueError(f"categorical: values repeat: {list(self.categorical)}")
            if self.log or self.step is not None:
                raise ValueError("log/step apply to float and int ranges only")
            if all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in self.categorical):
                # numbers in ascending order whatever the YAML's order: the dashboards draw the choices in
                # the distribution's order; names keep the author's order
                object.__setattr__(self, "categorical", tuple(sorted(self.categorical)))
            return self
        lo, hi = self.float_ if self.float_ is not None else self.int_
        if not lo <= hi:
            raise ValueError(f"range [{lo}, {hi}]: low must be <= high")
        if self.log and lo <= 0:
            raise ValueError(f"range [{lo}, {hi}]: log: true needs low > 0")
        if self.log and self.step is not None:
            raise ValueError("log: true and step cannot be combined (Optuna)")
        if self.int_ is not None and self.step is not None and self.step != int(self.step):
            raise ValueError(f"step {self.step}: an int range needs an integer step")
        return self

    @property
    def kind(self) -> str:
        return "float" if self.float_ is not None else "int" if self.int_ is not None else "categorical"

    @property
    def bounds(self) -> tuple[float, float] | None:
        return self.float_ if self.float_ is not None else self.int_

    def conditions(self) -> dict[str, tuple[Any, ...]]:
        """``when`` with every value as a tuple of allowed values."""
        return {k: v if isinstance(v, tuple) else (v,) for k, v in self.when.items()}

    def active(self, values: Mapping[str, Any]) -> bool:
        """Whether this key is sampled, given the values already chosen for other keys."""
        return all(k in values and _same_choice(values[k], allowed) for k, allowed in self.conditions().items())

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is a point of this entry (for enqueuing presets)."""
        if self.categorical is not None:
            return _same_choice(value, self.categorical)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        lo, hi = self.bounds
        if self.int_ is not None and value != int(value):
            return False
        if not lo <= value <= hi:
            return False
        if self.step is not None:
            k = (value - lo) / self.step
            return abs(k - round(k)) < 1e-9
        return True

    def suggest(self, trial: Any, name: str) -> Any:
        """Ask an Optuna trial for this key's value."""
        if self.categorical is not None:
            return trial.suggest_categorical(name, list(self.categorical))
        if self.int_ is not None:
            return trial.suggest_int(name, self.int_[0], self.int_[1], step=int(self.step or 1), log=self.log)
        return trial.suggest_float(name, self.float_[0], self.float_[1], step=self.step, log=self.log)

    def size(self) -> int | None:
        """How many values :meth:`grid_values` would list (computed, not enumerated); None when
        the range is continuous."""
        if self.categorical is not None:
            return len(self.categorical)
        if self.int_ is not None:
            return (self.int_[1] - self.int_[0]) // int(self.step or 1) + 1
        if self.step is None:
            return None
        return int(math.floor((self.float_[1] - self.float_[0]) / self.step + 1e-9)) + 1

    def grid_values(self) -> list[Any] | None:
        """The finite set of values (for the grid sampler), or None for a continuous float."""
        if (self.size() or 0) > MAX_GRID_VALUES:
            raise ConfigError(f"{self.describe()}: {self.size()} values, more than {MAX_GRID_VALUES}")
        if self.categorical is not None:
            return list(self.categorical)
        if self.int_ is not None:
            return list(range(self.int_[0], self.int_[1] + 1, int(self.step or 1)))
        if self.step is None:
            return None
        lo, hi = self.float_
        count = int(math.floor((hi - lo) / self.step + 1e-9)) + 1
        return [round(lo + i * self.step, 12) for i in range(count)]

    def describe(self) -> str:
        if self.categorical is not None:
            return f"categorical {list(self.categorical)}"
        extra = (" log" if self.log else "") + (f" step {self.step}" if self.step is not None else "")
        return f"{self.kind} [{self.bounds[0]}, {self.bounds[1]}]{extra}"


def _same_choice(value: Any, choices: tuple[Any, ...]) -> bool:
    """``value in choices`` without ``True == 1`` / ``1 == 1.0`` confusions across types."""
    return any(value == c and type(value) is type(c) or (_num(value) and _num(c) and value == c)
               for c in choices)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


MAX_GRID_VALUES = 100_000  # values one searched key may take
MAX_GRID_POINTS = 1_000_000  # points of a whole grid (the grid sampler lists them all)


def _rule_class(role: str, name: Any, where: str) -> type:
    from dlm_toolkit.strategy.registry import REGISTRIES

    if not isinstance(name, str):
        raise ConfigError(f"{where}: rule names are strings, got {name!r}")
    try:
        return REGISTRIES[role].get(name)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def check_conditions(exp: Any, key: str) -> None:
    spec = exp.search_space[key]
    where = f"search_space.{key}"
    for cond, allowed in spec.conditions().items():
        parent = exp.search_space.get(cond)
        if parent is None or parent.categorical is None:
            raise ConfigError(f"{where}: when: {cond!r} must be a categorical key of the search space "
                              f"(categorical keys: {', '.join(k for k, s in exp.search_space.items() if s.categorical) or 'none'})")
        bad = [v for v in allowed if not _same_choice(v, parent.categorical)]
        if bad:
            raise ConfigError(f"{where}: when: {cond} = {bad[0]!r} is not one of its choices {list(parent.categorical)}")


def check_key(exp: Any, base: PolicyConfig, key: str) -> None:
    spec = exp.search_space[key]
    where = f"search_space.{key}"
    parts = key.split(".")
    top = parts[0]
    if top not in (*ROLES, "sampling"):
        raise ConfigError(f"{where}: unknown key (top level must be one of {', '.join((*ROLES, 'sampling'))})")
    if top == "sampling":
        if len(parts) != 2 or parts[1] not in SamplingConfig.model_fields:
            raise ConfigError(f"{where}: unknown key; sampling fields: {', '.join(SamplingConfig.model_fields)}")
        _check_field(spec, where, SamplingConfig, parts[1], "sampling")
        return
    if parts[1:] == ["name"]:
        if spec.categorical is None:
            raise ConfigError(f"{where}: a rule name must be categorical, e.g. {{categorical: [none, threshold]}}")
        for name in spec.categorical:
            _rule_class(top, name, where)
        return
    if len(parts) != 3 or parts[1] != "params":
        raise ConfigError(f"{where}: role keys are '{top}.name' or '{top}.params.FIELD'")
    field = parts[2]
    name_key = f"{top}.name"
    if name_key in spec.conditions():
        rules, why = spec.conditions()[name_key], f"allowed by when: {{{name_key}: ...}}"
    elif name_key in exp.search_space:
        rules, why = exp.search_space[name_key].categorical, f"a choice of {name_key}"
    else:
        rules, why = (getattr(base, top).name,), "the base policy's rule"
    for rule_name in rules:
        cls = _rule_class(top, rule_name, where)
        fields = cls.Config.model_fields
        if field not in fields:
            hint = (f"; add when: {{{name_key}: [...]}} to sample it only with rules that have it"
                    if name_key in exp.search_space else "")
            raise ConfigError(f"{where}: {top} rule '{rule_name}' ({why}) has no field '{field}' "
                              f"(its fields: {', '.join(fields) or 'none'}){hint}")
        _check_field(spec, where, cls.Config, field, f"{top} rule '{rule_name}'")


def _check_field(spec: ParamSpec, where: str, config: type[BaseModel], field: str, owner: str) -> None:
    info = config.model_fields[field]
    allowed = describe_range(info)
    if spec.categorical is not None:
        for value in spec.categorical:
            problem = _field_problem(config, field, value)
            if problem:
                raise ConfigError(f"{where}: categorical value {value!r} is not valid for {owner} field "
                                  f"'{field}': {problem}")
        return
    ann = info.annotation
    if ann not in (int, float):
        raise ConfigError(f"{where}: {owner} field '{field}' is {getattr(ann, '__name__', ann)}, not numeric; "
                          "use categorical: [...]")
    if ann is int and spec.float_ is not None:
        raise ConfigError(f"{where}: {owner} field '{field}' is an int; use int: [lo, hi] (got float: "
                          f"{list(spec.float_)})")
    lo, hi = spec.bounds
    if not (_inside(info, lo) and _inside(info, hi)):
        raise ConfigError(f"{where}: range [{lo}, {hi}] is outside the allowed range of {owner} field "
                          f"'{field}' ({allowed or 'unbounded'})")


def _inside(info: FieldInfo, x: float) -> bool:
    for m in info.metadata:
        if isinstance(m, at.Gt) and not x > m.gt:
            return False
        if isinstance(m, at.Ge) and not x >= m.ge:
            return False
        if isinstance(m, at.Lt) and not x < m.lt:
            return False
        if isinstance(m, at.Le) and not x <= m.le:
            return False
    return True


def _field_problem(config: type[BaseModel], field: str, value: Any) -> str | None:
    """Why ``value`` is invalid for ``config.field`` alone ('' errors on other fields ignored)."""
    from pydantic import ValidationError

    try:
        config.model_validate({field: value})
    except ValidationError as err:
        mine = [e for e in err.errors() if e["loc"][:1] == (field,)]
        if mine:
            rng = describe_range(config.model_fields[field])
            return mine[0]["msg"] + (f" (allowed: {rng})" if rng else "")
    return None
