"""docs/config_reference.md: generated from the schema, complete, and in step with the features table.

If the first test fails, the reference is stale: run `python scripts/gen_config_reference.py` and
commit docs/config_reference.md.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import BeforeValidator

from zerospeed.config import ConfigError, parse_config
from zerospeed.config.features import ROWS
from zerospeed.config.reference import (
    COMMAND,
    GATES,
    NO_EFFECT,
    REFERENCE_PATH,
    REFUSED_ELSEWHERE,
    field_type,
    key_status,
    leaf_keys,
    render_reference,
)
from zerospeed.config.schema.base import StrictModel
from zerospeed.config.schema.root import ZeroSpeedConfig

ROOT = Path(__file__).resolve().parents[2]
ROW_RE = re.compile(r"^\| `([^`]+)` \| (.*?) \| `(.*?)` \| (.*) \| (.*) \|$")


@pytest.fixture(scope="module")
def rendered() -> str:
    return render_reference()


@pytest.fixture(scope="module")
def table(rendered) -> dict[str, tuple[str, str, str, str]]:
    rows: dict[str, tuple[str, str, str, str]] = {}
    for line in rendered.splitlines():
        match = ROW_RE.match(line)
        if match:
            key, *cells = match.groups()
            assert key not in rows, f"{key} has two rows"
            rows[key] = tuple(cells)
    return rows


def test_checked_in_reference_is_current(rendered):
    current = (ROOT / REFERENCE_PATH).read_text(encoding="utf-8")
    assert current == rendered, f"{REFERENCE_PATH} is stale: run {COMMAND}"


def test_every_leaf_key_appears_exactly_once(rendered):
    keys = leaf_keys()
    assert len(keys) == len(set(keys)) and len(keys) > 300
    row_keys = [m.group(1) for line in rendered.splitlines() if (m := ROW_RE.match(line))]
    for key in keys:
        assert row_keys.count(key) == 1, f"{key} appears {row_keys.count(key)} times in the reference"
    # Examples from the three levels of nesting, including a list of objects.
    for key in (
        "train_batch_size",
        "zero_optimization.offload_optimizer.ratio",
        "tensor_parallel.partition_config.layer_specs[].patterns",
        "timers.throughput.synchronized",
    ):
        assert key in keys


def test_features_rows_show_not_yet(table):
    assert ROWS, "features.ROWS is empty; pick another not-yet example"
    for row in ROWS:
        covered = [k for k in table if k == row.key or k.startswith(row.key + ".")]
        assert covered, f"features.ROWS key {row.key} is not in the reference"
        for key in covered:
            assert table[key][3].startswith("not yet: "), (key, table[key][3])
        feature = row.feature if isinstance(row.feature, str) else row.key
        assert f"not yet: {feature} (allowed: {row.default})" in table[row.key][3]


def test_no_effect_example_and_works_example(table):
    assert table["zero_optimization.round_robin_gradients"][3].startswith("accepted, no effect (")
    assert (
        table["zero_optimization.contiguous_gradients"][3]
        == "accepted, no effect (stage-2 gradient chunks are always contiguous)"
    )
    assert table["gradient_clipping"][3] == "works"


@pytest.mark.parametrize("prefix", sorted({*NO_EFFECT, *GATES, *GATES.values(), *REFUSED_ELSEWHERE}))
def test_status_tables_name_real_keys(prefix):
    keys = leaf_keys()
    assert any(k == prefix or k.startswith(prefix + ".") for k in keys), (
        f"{prefix} (in zerospeed/config/reference.py) is not a config key; fix or remove it"
    )


def _schema_field(key: str):
    model: Any = ZeroSpeedConfig
    *parents, leaf = key.replace("[]", "").split(".")
    for part in parents:
        annotation = model.model_fields[part].annotation
        model = next(
            a
            for a in (getattr(annotation, "__args__", None) or (annotation,))
            if isinstance(a, type) and issubclass(a, StrictModel)
        )
    return model.model_fields[leaf]


# key -> (type text, a config value the type text says is rejected, one it says is accepted)
SPOT = {
    "zero_optimization.stage": ("one of {0, 1, 2, 3}", 4, 3),
    "zero_optimization.reduce_bucket_size": (
        'int >= 0; "auto" allowed (filled from the model\'s hidden size)',
        -1,
        2e8,
    ),
    "fp16.min_loss_scale": ("float > 0", 0, 0.5),
    "zero_optimization.offload_optimizer.ratio": ("float in [0, 1]", 1.5, 0.25),
    "train_micro_batch_size_per_gpu": ('int >= 1 or null; "auto" allowed (derived by the batch-size rules)', 0, 2),
    "zero_optimization.leaf_module.classes": ("list[str] (or one str)", 3, "a.B"),
    "compile.passes": ('list[one of {"z1", "z3", "autosp", "autotp"}] or null', ["z2"], ["Z1"]),
}


def _config_with(key: str, value: Any) -> dict:
    *parents, leaf = key.split(".")
    config: dict = {"train_batch_size": 2} if key != "train_micro_batch_size_per_gpu" else {}
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return config


@pytest.mark.parametrize("key", sorted(SPOT))
def test_spot_check_types_and_defaults_against_the_schema(table, key):
    type_text, rejected, accepted = SPOT[key]
    assert table[key][0] == type_text
    field = _schema_field(key)
    default = field.default_factory() if field.default_factory is not None else field.default
    assert table[key][1] == json.dumps(default)
    # The type text is what validation enforces.
    with pytest.raises(ConfigError, match=re.escape(key)):
        parse_config(_config_with(key, rejected), check_features=False)
    parse_config(_config_with(key, accepted), check_features=False)


def test_links_point_at_headings(rendered):
    anchors = {
        re.sub(r"[^a-z0-9_\- ]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^## (.+)$", rendered, flags=re.M)
    }
    links = re.findall(r"\]\(#([^)]+)\)", rendered)
    assert links and set(links) <= anchors


def test_unknown_field_type_is_an_error_naming_the_key():
    class Odd(StrictModel):
        weird: Annotated[Any, BeforeValidator(lambda v: v)] = None

    with pytest.raises(TypeError, match="odd.weird: .*reference.py does not know"):
        field_type("odd.weird", Odd.model_fields["weird"])


def test_status_precedence_and_gates():
    keys = leaf_keys()
    # A features row on a block marks every key under it "not yet", pointing at the row.
    block_row = next((r for r in ROWS if any(k.startswith(r.key + ".") for k in keys)), None)
    if block_row is not None:  # (while some row refuses a whole block)
        child = next(k for k in keys if k.startswith(block_row.key + "."))
        assert key_status(child).startswith(f"not yet: {block_row.feature} (see {block_row.key})")
    assert key_status("comms_logger.debug").startswith("not yet: naming the calling function")


def _read_outside_schema(name: str) -> bool:
    pattern = re.compile(rf"(\.{name}\b|[\"']{name}[\"'])")
    for path in (ROOT / "zerospeed").rglob("*.py"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("zerospeed/config/schema/") or rel == "zerospeed/config/reference.py":
            continue
        if pattern.search(path.read_text(encoding="utf-8")):
            return True
    return False


def test_works_claims_are_read_by_some_code():
    """A key documented as "works" must at least be read somewhere outside the schema.

    A heuristic (generic names such as `enabled` always pass), but it catches a block whose
    features row was deleted while some of its keys are still read by nothing.
    """
    unread = [
        k
        for k in leaf_keys()
        if key_status(k) == "works" and not _read_outside_schema(k.rsplit(".", 1)[-1].replace("[]", ""))
    ]
    assert not unread, (
        f"documented as works but read by no code: {unread}; add them to NO_EFFECT (with why) "
        "or GATES in zerospeed/config/reference.py, or a row to zerospeed/config/features.py"
    )


def test_check_mode_fails_on_a_stale_file(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts/gen_config_reference.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.ROOT = tmp_path
    (tmp_path / "docs").mkdir()
    (tmp_path / REFERENCE_PATH).write_text("old\n")
    assert script.main(["--check"]) == 1
    assert "docs/config_reference.md is stale: run python scripts/gen_config_reference.py" in capsys.readouterr().err
    assert script.main([]) == 0
    assert script.main(["--check"]) == 0
    assert (tmp_path / REFERENCE_PATH).read_text() == render_reference()
