"""The strict base model and the scalar types every config section is built from.

DeepSpeed configs are JSON, so numbers such as ``2e8`` arrive as floats even where an
integer is meant. The ``int_type`` family accepts a float only when it is a whole number and
otherwise fails with a message that names what was expected. Every type here raises a
``PydanticCustomError`` of kind ``"zs_value"`` whose message reads ``expected ..., got ...``;
``zerospeed.config.validation`` prefixes it with the dotted key.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

ERROR_KIND = "zs_value"
_MAX_SHOWN = 80


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, field names are the JSON keys."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_default=False)


def show(value: Any) -> str:
    """Render a config value the way it is written in JSON (strings quoted), shortened."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (bool, int, float)) or value is None:
        text = json.dumps(value)
    else:
        try:
            text = json.dumps(value, default=repr)
        except (TypeError, ValueError):
            text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def fail(expected: str, value: Any, note: str = "") -> PydanticCustomError:
    """Build the one error kind used by all validators here."""
    suffix = f" ({note})" if note else ""
    return PydanticCustomError(
        ERROR_KIND,
        "expected {expected}, got {got}{suffix}",
        {"expected": expected, "got": show(value), "suffix": suffix},
    )


def ds_field(default: Any, meaning: str, **kwargs: Any) -> Any:
    """A field whose default is DeepSpeed's; the description says so."""
    return Field(default, description=f"{meaning} Default {show(default)} is DeepSpeed's.", **kwargs)


def ds_section(factory: Callable[[], Any], meaning: str) -> Any:
    """A nested section that defaults to its own all-default model, as in DeepSpeed."""
    return Field(default_factory=factory, description=f"{meaning} Defaults are DeepSpeed's.")


# --- numbers -------------------------------------------------------------------------------


def _range_label(kind: str, minimum: float | None, maximum: float | None, exclusive: bool) -> str:
    if minimum is None and maximum is None:
        return "an integer" if kind == "int" else "a number"
    if maximum is not None and minimum is not None:
        return f"{'an integer' if kind == 'int' else 'a number'} between {minimum:g} and {maximum:g}"
    if minimum == 0:
        word = "positive" if exclusive else "non-negative"
        return f"a {word} {'integer' if kind == 'int' else 'number'}"
    if minimum == 1 and kind == "int":
        return "a positive integer"
    sign = ">" if exclusive else ">="
    return f"{'an integer' if kind == 'int' else 'a number'} {sign} {minimum:g}"


def _in_range(value: float, minimum: float | None, maximum: float | None, exclusive: bool) -> bool:
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        return False
    return maximum is None or value <= maximum


def _is_number(value: Any) -> bool:
    # bool is an int subclass, but `true` where a number belongs is a mistake.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _coerce_int(value: Any, label: str, minimum: int | None, maximum: int | None, nullable: bool) -> Any:
    if value is None and nullable:
        return None
    if not _is_number(value):
        raise fail(label + (" or null" if nullable else ""), value)
    if isinstance(value, float):
        if not value.is_integer():
            raise fail(label, value, "not a whole number")
        value = int(value)
    if not _in_range(value, minimum, maximum, False):
        raise fail(label, value)
    return value


def int_type(minimum: int | None = None, maximum: int | None = None, nullable: bool = False) -> Any:
    """An integer field type that also accepts whole-number floats such as ``2e8``."""
    label = _range_label("int", minimum, maximum, False)
    check = BeforeValidator(lambda v: _coerce_int(v, label, minimum, maximum, nullable))
    return Annotated[int | None, check] if nullable else Annotated[int, check]


def _coerce_float(
    value: Any, label: str, minimum: float | None, maximum: float | None, exclusive: bool, nullable: bool
) -> Any:
    if value is None and nullable:
        return None
    if not _is_number(value):
        raise fail(label + (" or null" if nullable else ""), value)
    number = float(value)
    if not math.isfinite(number):
        raise fail(label, value, "not finite")
    if not _in_range(number, minimum, maximum, exclusive):
        raise fail(label, value)
    return number


def float_type(
    minimum: float | None = None, maximum: float | None = None, exclusive: bool = False, nullable: bool = False
) -> Any:
    """A finite float field type; integers are accepted and converted."""
    label = _range_label("float", minimum, maximum, exclusive)
    check = BeforeValidator(lambda v: _coerce_float(v, label, minimum, maximum, exclusive, nullable))
    return Annotated[float | None, check] if nullable else Annotated[float, check]


# --- booleans, strings, choices ----------------------------------------------------------------


def _coerce_bool(value: Any, nullable: bool) -> Any:
    if value is None and nullable:
        return None
    # Strict on purpose: DeepSpeed's dict-based readers treat the string "false" as truthy. The integers
    # 0 and 1 are unambiguous and common in DeepSpeed configs (`"zero_allow_untested_optimizer": 1`): taken.
    if type(value) is int and value in (0, 1):
        return bool(value)
    if not isinstance(value, bool):
        raise fail("true or false" + (" or null" if nullable else ""), value)
    return value


def bool_type(nullable: bool = False) -> Any:
    """A boolean field type that accepts only JSON ``true`` / ``false``."""
    check = BeforeValidator(lambda v: _coerce_bool(v, nullable))
    return Annotated[bool | None, check] if nullable else Annotated[bool, check]


def _coerce_str(value: Any, nullable: bool) -> Any:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        raise fail("a string" + (" or null" if nullable else ""), value)
    return value


def str_type(nullable: bool = False) -> Any:
    """A string field type (no number-to-string conversion)."""
    check = BeforeValidator(lambda v: _coerce_str(v, nullable))
    return Annotated[str | None, check] if nullable else Annotated[str, check]


def _choice_label(values: Iterable[Any], nullable: bool) -> str:
    shown = ", ".join(show(v) for v in values)
    return f"one of {shown}" + (" (or null)" if nullable else "")


def _coerce_choice(value: Any, table: Mapping[Any, Any], label: str, nullable: bool) -> Any:
    if value is None and nullable:
        return None
    key = value.lower() if isinstance(value, str) else value
    if isinstance(key, float) and key.is_integer():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, (str, int)) or key not in table:
        raise fail(label, value)
    return table[key]


def choice_type(*values: Any, synonyms: Mapping[str, Any] | None = None, nullable: bool = False) -> Any:
    """A field limited to ``values``; strings match case-insensitively and are normalised.

    ``synonyms`` maps extra accepted spellings (lower case) to one of ``values``.
    """
    table: dict[Any, Any] = {v.lower() if isinstance(v, str) else v: v for v in values}
    table.update(synonyms or {})
    label = _choice_label(values, nullable)
    check = BeforeValidator(lambda v: _coerce_choice(v, table, label, nullable))
    return Annotated[Any, check]


# --- containers -------------------------------------------------------------------------------


def _coerce_list(value: Any, item_ok: Callable[[Any], bool], label: str, nullable: bool, single_ok: bool) -> Any:
    if value is None and nullable:
        return None
    if single_ok and item_ok(value):
        value = [value]
    if not isinstance(value, list) or not all(item_ok(v) for v in value):
        raise fail(label + (" or null" if nullable else ""), value)
    return [int(v) if isinstance(v, float) else v for v in value]


def _is_int_like(value: Any) -> bool:
    return _is_number(value) and float(value).is_integer()


def list_type(item: str, nullable: bool = False, single_ok: bool = False) -> Any:
    """A list of ``"str"`` or ``"int"`` items; ``single_ok`` also accepts one bare item."""
    item_ok = (lambda v: isinstance(v, str)) if item == "str" else _is_int_like
    label = f"a list of {'strings' if item == 'str' else 'integers'}"
    check = BeforeValidator(lambda v: _coerce_list(v, item_ok, label, nullable, single_ok))
    inner = list[str] if item == "str" else list[int]
    return Annotated[inner | None, check] if nullable else Annotated[inner, check]


def _coerce_dict(value: Any, nullable: bool) -> Any:
    if value is None and nullable:
        return None
    if not isinstance(value, dict):
        raise fail("an object ({...})" + (" or null" if nullable else ""), value)
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise fail("an object with string keys", value)
    return value


def dict_type(nullable: bool = False) -> Any:
    """A free-form JSON object (passed through unchanged, e.g. optimizer params)."""
    check = BeforeValidator(lambda v: _coerce_dict(v, nullable))
    return Annotated[dict[str, Any] | None, check] if nullable else Annotated[dict[str, Any], check]


def _coerce_json(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float, list, dict)):
        return value
    raise fail("a JSON value", value)


JsonValue = Annotated[Any, BeforeValidator(_coerce_json)]

# Ready-made aliases for the common cases.
Bool = bool_type()
OptBool = bool_type(nullable=True)
Str = str_type()
OptStr = str_type(nullable=True)
Int = int_type()
OptInt = int_type(nullable=True)
NonNegInt = int_type(minimum=0)
OptNonNegInt = int_type(minimum=0, nullable=True)
PosInt = int_type(minimum=1)
OptPosInt = int_type(minimum=1, nullable=True)
Num = float_type()
NonNegNum = float_type(minimum=0.0)
PosNum = float_type(minimum=0.0, exclusive=True)
Fraction = float_type(minimum=0.0, maximum=1.0)
Dict = dict_type()
OptDict = dict_type(nullable=True)
StrList = list_type("str")
OptStrList = list_type("str", nullable=True)
IntList = list_type("int")
OptIntList = list_type("int", nullable=True)

# DeepSpeed's DtypeEnum spellings, normalised to the short names used across zerospeed.
DTYPE_SYNONYMS: dict[str, str] = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "bfp16": "bf16",
    "torch.bfloat16": "bf16",
}
OptDtype = choice_type("fp32", "fp16", "bf16", synonyms=DTYPE_SYNONYMS, nullable=True)
