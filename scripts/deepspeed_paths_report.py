#!/usr/bin/env python
"""List every public module path of a DeepSpeed install and say whether zerospeed serves it.

    python scripts/deepspeed_paths_report.py /work/dsvenv/lib/python3.11/site-packages/deepspeed > paths.md

Reads only DeepSpeed's file tree (nothing of it is imported), and asks this interpreter's zerospeed whether
`zerospeed.<path>` (= `deepspeed.<path>` through the shim) exists: a real module, an alias-table entry
(zerospeed/deepspeed_paths.py), or nothing. Prints one Markdown row per DeepSpeed package: its modules
served and not served. Private modules (a leading underscore), C/CUDA sources and the build-time
`git_version_info_installed` are left out.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import zerospeed  # noqa: F401 (installs the alias table)

_SKIP_DIRS = {"csrc", "__pycache__", "includes"}


def deepspeed_modules(root: str) -> dict[str, list[str]]:
    """DeepSpeed package -> its public modules (the package itself first), from the file tree at `root`."""
    packages: dict[str, list[str]] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")) and d not in _SKIP_DIRS)
        rel = os.path.relpath(dirpath, root)
        if "__init__.py" not in files:
            dirs[:] = []
            continue
        package = "deepspeed" if rel == "." else "deepspeed." + rel.replace(os.sep, ".")
        names = sorted(f[:-3] for f in files if f.endswith(".py") and not f.startswith("_"))
        packages[package] = [package] + [f"{package}.{n}" for n in names if n != "git_version_info_installed"]
    return packages


def served(path: str) -> bool:
    ours = "zerospeed" + path[len("deepspeed") :]
    try:
        return importlib.util.find_spec(ours) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _names(package: str, modules: list[str]) -> str:
    return ", ".join(m[len(package) + 1 :] for m in modules) or "-"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    packages = deepspeed_modules(argv[0])
    total = hits = 0
    rows = []
    for package, modules in packages.items():
        yes = [m for m in modules if served(m)]
        total, hits = total + len(modules), hits + len(yes)
        head = "served" if package in yes else "not served"
        inside = _names(package, [m for m in yes if m != package])
        outside = _names(package, [m for m in modules if m not in yes and m != package])
        rows.append(f"| `{package}` | {head} | {inside} | {outside} |")
    print(f"{hits} of {total} DeepSpeed module paths are served.\n")
    print("| DeepSpeed package | the package | its modules served | its modules not served |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
