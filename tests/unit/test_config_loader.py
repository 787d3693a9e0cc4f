"""Loading configs: dict, JSON file, base64; duplicate keys, invalid JSON, missing files."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from zerospeed.config import ConfigError, load_raw, parse_config

CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 0, "reduce_bucket_size": 2e8}}


def b64(text: str, urlsafe: bool = False) -> str:
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    return encode(text.encode()).decode()


def error_of(config) -> str:
    with pytest.raises(ConfigError) as info:
        load_raw(config)
    return str(info.value)


def test_dict_is_deep_copied():
    original = {"zero_optimization": {"stage": 0}}
    loaded = load_raw(original)
    loaded["zero_optimization"]["stage"] = 3
    assert original == {"zero_optimization": {"stage": 0}}


def test_parse_config_does_not_modify_the_callers_dict():
    original = {"train_batch_size": "auto", "zero_optimization": True, "bfloat16": {"enabled": False}}
    snapshot = json.loads(json.dumps(original))
    with pytest.warns(DeprecationWarning):
        parse_config(original, known={"train_batch_size": 4}, check_features=False)
    assert original == snapshot


def test_file_path_as_str_and_path(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    assert load_raw(str(path)) == CONFIG
    assert load_raw(path) == CONFIG


@pytest.mark.parametrize("urlsafe", [False, True])
def test_base64_input(urlsafe: bool):
    assert load_raw(b64(json.dumps(CONFIG), urlsafe)) == CONFIG


def test_base64_config_parses_end_to_end():
    cfg = parse_config(b64(json.dumps(CONFIG)))
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000


def test_missing_file_string_is_named():
    assert error_of("no/such/ds_config.json") == (
        "config 'no/such/ds_config.json' is neither a file that exists nor base64-encoded JSON; "
        "pass a path to a .json file, a dict, or base64 of a JSON object"
    )


def test_long_string_is_shortened_in_the_message():
    message = error_of("x" * 200 + ".json")
    assert "'" + "x" * 57 + "...'" in message


def test_missing_path_object():
    assert error_of(Path("/nonexistent/ds.json")) == "config file /nonexistent/ds.json does not exist"


def test_base64_of_a_json_array_is_not_an_object():
    assert error_of(b64("[1, 2]")) == "base64 config: the config must be a JSON object at the top level, got list"


def test_base64_of_non_json_is_rejected():
    assert "neither a file that exists nor base64-encoded JSON" in error_of(b64("hello world"))


def test_duplicate_key_in_file_names_dotted_key_and_file(tmp_path: Path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8,\n "zero_optimization": {"stage": 1, "overlap_comm": true, "stage": 2}}')
    assert error_of(path) == (
        f"{path}: duplicate key zero_optimization.stage; a JSON key may appear only once per object"
    )


def test_duplicate_top_level_key_in_file(tmp_path: Path):
    path = tmp_path / "dup.json"
    path.write_text('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}')
    assert error_of(str(path)).startswith(f"{path}: duplicate key fp16;")


def test_duplicate_key_inside_a_list_is_found(tmp_path: Path):
    path = tmp_path / "dup.json"
    path.write_text('{"tensor_parallel": {"partition_config": {"layer_specs": [{"patterns": [], "patterns": []}]}}}')
    assert "duplicate key tensor_parallel.partition_config.layer_specs[0].patterns" in error_of(path)


def test_duplicate_key_in_base64():
    text = '{"optimizer": {"type": "Adam", "params": {"lr": 1, "lr": 2}}}'
    assert error_of(b64(text)) == (
        "base64 config: duplicate key optimizer.params.lr; a JSON key may appear only once per object"
    )


def test_invalid_json_reports_file_line_and_column(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": tru}\n}')
    assert error_of(path) == f"{path}: invalid JSON at line 3, column 23: Expecting value"


def test_invalid_json_in_base64():
    assert error_of(b64('{"a": }')) == "base64 config: invalid JSON at line 1, column 7: Expecting value"


def test_top_level_must_be_an_object(tmp_path: Path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert error_of(path) == f"{path}: the config must be a JSON object at the top level, got list"


def test_unreadable_file_is_a_config_error(tmp_path: Path):
    path = tmp_path / "binary.json"
    path.write_bytes(b"\xff\xfe\x00\x01")
    assert error_of(path).startswith(f"{path}: cannot read the config file:")


def test_deeply_nested_json_is_a_config_error(tmp_path: Path):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert error_of(path) == f"{path}: JSON nested too deeply to read"


def test_uncopyable_dict_value():
    class Uncopyable:
        def __deepcopy__(self, memo):
            raise RuntimeError("no copies")

    assert error_of({"x": Uncopyable()}) == "config dict could not be copied: RuntimeError: no copies"
