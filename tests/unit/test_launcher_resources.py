"""Include/exclude filters, node/GPU limits and local slot detection (DeepSpeed semantics)."""

import pytest

from zerospeed.launcher.errors import LauncherError
from zerospeed.launcher.resources import filter_resources, limit_resources, local_slots, parse_node_specs

POOL = {"a": 2, "b": [0, 1, 2]}
SPEC_FORMAT = (
    "expected NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC = HOST[:SLOT[,SLOT ...]] (e.g. 'worker-0:0,2@worker-1')"
)


def test_no_filter_expands_slot_counts():
    assert filter_resources(POOL, "", "") == {"a": [0, 1], "b": [0, 1, 2]}


def test_deepspeed_help_example():
    pool = {"worker-0": 4, "worker-1": 4}
    assert filter_resources(pool, include="worker-0@worker-1:0,2") == {"worker-0": [0, 1, 2, 3], "worker-1": [0, 2]}
    assert filter_resources(pool, exclude="worker-1:0") == {"worker-0": [0, 1, 2, 3], "worker-1": [1, 2, 3]}


@pytest.mark.parametrize(
    "include, expected",
    [
        ("b", {"b": [0, 1, 2]}),  # a host alone: all its slots
        ("a:1@b:0,2", {"a": [1], "b": [0, 2]}),  # host:slots
        ("b:2,0,2", {"b": [0, 2]}),  # sorted, duplicates dropped
        ("b:1@b:0", {"b": [0, 1]}),  # a host named twice: union
        ("b:1@b", {"b": [0, 1, 2]}),  # ... whole host wins
    ],
)
def test_include(include, expected):
    result = filter_resources(POOL, include=include)
    assert result == expected


def test_include_keeps_pool_host_order():
    assert list(filter_resources(POOL, include="b@a:0")) == ["a", "b"]


@pytest.mark.parametrize(
    "exclude, expected",
    [
        ("a", {"b": [0, 1, 2]}),  # a host alone: the whole host
        ("b:1", {"a": [0, 1], "b": [0, 2]}),  # just those slots
        ("a:0,1@b:2", {"b": [0, 1]}),  # a host left without slots is dropped
        ("b:0@b", {"a": [0, 1]}),
    ],
)
def test_exclude(exclude, expected):
    assert filter_resources(POOL, exclude=exclude) == expected


def test_include_and_exclude_are_mutually_exclusive():
    with pytest.raises(LauncherError) as info:
        filter_resources(POOL, include="a", exclude="b")
    assert str(info.value) == "--include and --exclude are mutually exclusive; use one of them"


@pytest.mark.parametrize("flag", ["include", "exclude"])
def test_unknown_host(flag):
    with pytest.raises(LauncherError) as info:
        filter_resources(POOL, **{flag: "a@c:0"})
    assert str(info.value) == f"--{flag} names host 'c', which is not among the available hosts (a, b)"


@pytest.mark.parametrize("flag", ["include", "exclude"])
def test_unknown_slot(flag):
    with pytest.raises(LauncherError) as info:
        filter_resources(POOL, **{flag: "b:1,3"})
    assert str(info.value) == f"--{flag} names slot 3 on host 'b', whose slots are 0,1,2"


@pytest.mark.parametrize("text, bad", [("a:", "a:"), ("a@", ""), ("@a", ""), ("a:1:2", "a:1:2"), (":1", ":1")])
def test_malformed_spec(text, bad):
    with pytest.raises(LauncherError) as info:
        filter_resources(POOL, include=text)
    assert str(info.value) == f"--include {text!r}: bad node spec {bad!r}; {SPEC_FORMAT}"


def test_non_integer_slot():
    with pytest.raises(LauncherError) as info:
        filter_resources(POOL, exclude="a:one")
    assert str(info.value) == f"--exclude 'a:one': slots in 'a:one' must be integers; {SPEC_FORMAT}"


def test_excluding_everything_is_an_error():
    with pytest.raises(LauncherError) as info:
        filter_resources(POOL, exclude="a@b")
    assert str(info.value) == "--exclude 'a@b' leaves no slots to run on"


def test_parse_node_specs():
    assert parse_node_specs("w0@w1:3,1@w2:0") == {"w0": None, "w1": [1, 3], "w2": [0]}


def test_limit_nodes_and_gpus():
    world = {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3], "c": [0, 1, 2, 3]}
    assert limit_resources(world, None, None) == world
    assert limit_resources(world, 2, None) == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert limit_resources(world, None, 2) == {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
    assert limit_resources(world, 1, 3) == {"a": [0, 1, 2]}


def test_limit_beyond_the_hostfile_is_an_error():
    world = {"a": [0, 1], "b": [0]}
    with pytest.raises(LauncherError) as info:
        limit_resources(world, 3, None)
    assert str(info.value) == "--num_nodes 3 but only 2 host(s) are available (a, b)"
    with pytest.raises(LauncherError) as info:
        limit_resources(world, None, 2)
    assert str(info.value) == "--num_gpus 2 but host 'b' has only 1 slot(s)"


def _no_torch() -> int:
    raise AssertionError("device_count must not be called")


def test_local_slots_from_num_gpus_ignores_devices():
    assert local_slots(3, "5,6", _no_torch) == [0, 1, 2]


def test_local_slots_respect_cuda_visible_devices():
    assert local_slots(None, "2,3", _no_torch) == [2, 3]


def test_local_slots_from_device_count():
    assert local_slots(None, "", lambda: 4) == [0, 1, 2, 3]
    assert local_slots(None, " ", lambda: 2) == [0, 1]


def test_cpu_only_machine_runs_one_process():
    assert local_slots(None, "", lambda: 0) == [0]


def test_uuid_visible_devices_are_rejected():
    with pytest.raises(LauncherError) as info:
        local_slots(None, "GPU-8a1b", _no_torch)
    assert str(info.value) == (
        "CUDA_VISIBLE_DEVICES='GPU-8a1b' is not a list of integer ids; "
        "unset it and select GPUs with --include localhost:0,1"
    )
