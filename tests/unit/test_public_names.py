"""Every public name that worked before the house move still works, under zerospeed's and DeepSpeed's names.

tests/fixtures/public_names.json was recorded from the tree before issue 44's reorganisation (commit
ca27410): the root exports, every package's API (`__all__`, or the names it defines) and every module at
one of DeepSpeed 0.19's paths (`zerospeed.runtime.lr_schedules`, `zerospeed.utils.z3_leaf_module`,
...). Each must still import and carry its names; through the `deepspeed` shim, `deepspeed.X` must be
the very same module object as `zerospeed.X` (Note [the alias layer] in zerospeed/deepspeed_paths.py).
The list may grow; it never shrinks.
"""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

NAMES = json.loads((pathlib.Path(__file__).parents[1] / "fixtures" / "public_names.json").read_text())


@pytest.mark.parametrize("module", sorted(NAMES))
def test_zerospeed_names(module):
    mod = importlib.import_module(module)
    missing = [n for n in NAMES[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lost {missing}"


def _shim():
    from zerospeed.compat import deepspeed_is_shim

    if not deepspeed_is_shim():
        pytest.skip("the deepspeed shim is not installed here (`zerospeed-compat install`)")
    return importlib.import_module("deepspeed")


@pytest.mark.parametrize("module", sorted(NAMES))
def test_deepspeed_names_are_the_same_objects(module):
    _shim()
    ours = importlib.import_module(module)
    theirs = importlib.import_module("deepspeed" + module[len("zerospeed") :])
    if module != "zerospeed":  # the root is the shim's own package, a view of zerospeed
        assert theirs is ours, f"deepspeed{module[len('zerospeed') :]} is a different module object than {module}"
    for name in NAMES[module]:
        if module == "zerospeed" and name == "__version__":
            continue  # DeepSpeed's version number, which transformers checks (compat/alias.py)
        assert getattr(theirs, name) is getattr(ours, name), f"deepspeed's {module}.{name} differs from zerospeed's"


def test_alias_paths_hold_no_code():
    """Note [the alias layer]: a DeepSpeed path that is not its concept's home is a table entry, never a
    file: no module file of the product sits at a path the alias table serves."""
    from zerospeed import deepspeed_paths

    root = pathlib.Path(deepspeed_paths.__file__).parent
    files = [
        key
        for key in deepspeed_paths.MODULES
        if (root / (key.replace(".", "/") + ".py")).exists() or (root / key.replace(".", "/")).is_dir()
    ]
    assert not files, f"implementation files at alias paths: {files}"


def test_alias_targets_resolve():
    """Every table entry names something that exists (a typo would otherwise surface only for the user)."""
    from zerospeed import deepspeed_paths

    for key, target in deepspeed_paths.MODULES.items():
        mod = importlib.import_module(f"zerospeed.{key}")
        if isinstance(target, str):
            assert mod is importlib.import_module(target), key
        elif isinstance(target, dict):
            for name, where in target.items():
                assert getattr(mod, name) is deepspeed_paths.resolve(where), f"zerospeed.{key}.{name}"
    for package, names in deepspeed_paths.NAMES.items():
        mod = importlib.import_module(package)
        for name, where in names.items():
            assert getattr(mod, name) is deepspeed_paths.resolve(where), f"{package}.{name}"
