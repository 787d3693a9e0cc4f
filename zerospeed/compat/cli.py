"""`zerospeed-compat install | uninstall | status`: the `deepspeed` shim distribution.

    zerospeed-compat install            # into this Python environment (pip)
    zerospeed-compat install --target D # into directory D (put D on PYTHONPATH; D/bin has the commands)

The shim's source (zerospeed/compat/shim) is copied to a temporary directory with its version filled
in and installed by pip, so pip records it and `pip uninstall deepspeed` works as for any package.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from zerospeed.compat.distribution import DEEPSPEED_API_VERSION, SHIM_TAG, foreign_deepspeeds, is_shim
from zerospeed.version import __version__


def shim_version() -> str:
    return f"{DEEPSPEED_API_VERSION}+{SHIM_TAG}.{__version__}"


def _search_path(target: Path | None) -> list[str]:
    return ([str(target)] if target is not None else []) + sys.path


def _refuse_real_deepspeed(target: Path | None) -> None:
    foreign = foreign_deepspeeds(_search_path(target))
    if foreign:
        where = "; ".join(f"DeepSpeed {d.version} at {d.locate_file('')}" for d in foreign)
        raise SystemExit(
            f"zerospeed-compat: a real DeepSpeed is installed ({where}). Installing the shim would "
            "shadow it. Uninstall it first (`pip uninstall deepspeed`) or use a separate virtual "
            "environment for zerospeed."
        )


def install(target: Path | None = None, quiet: bool = True) -> None:
    _refuse_real_deepspeed(target)
    with tempfile.TemporaryDirectory(prefix="zerospeed-shim-") as tmp:
        src = Path(tmp) / "shim"
        with resources.as_file(resources.files("zerospeed.compat") / "shim") as shim_dir:
            shutil.copytree(shim_dir, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
        project = src / "pyproject.toml"
        project.write_text(project.read_text().replace("@VERSION@", shim_version()))
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check"]
        cmd += ["-q"] if quiet else []
        cmd += ["--target", str(target), "--upgrade"] if target is not None else []
        subprocess.run(cmd + [str(src)], check=True)


def _installed(target: Path | None) -> list[importlib.metadata.Distribution]:
    return list(importlib.metadata.distributions(name="deepspeed", path=_search_path(target)))


def uninstall() -> None:
    dists = _installed(None)
    if not any(is_shim(d) for d in dists):
        print("zerospeed-compat: the deepspeed shim is not installed in this environment")
        return
    if foreign_deepspeeds():
        raise SystemExit(
            "zerospeed-compat: a real DeepSpeed is installed too; uninstall with pip from the "
            "environment you mean, so the wrong one is not removed"
        )
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "deepspeed"], check=True)


def status(target: Path | None = None) -> int:
    dists = _installed(target)
    if not dists:
        print("deepspeed: not installed (`zerospeed-compat install` makes `import deepspeed` run zerospeed)")
        return 1
    for d in dists:
        kind = "zerospeed shim" if is_shim(d) else "real DeepSpeed"
        print(f"deepspeed {d.version}: {kind} at {d.locate_file('')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerospeed-compat", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help="install the `deepspeed` shim (import name and commands)")
    p_install.add_argument("--target", type=Path, default=None, help="install into this directory instead")
    sub.add_parser("uninstall", help="remove the shim from this environment")
    p_status = sub.add_parser("status", help="which deepspeed is installed")
    p_status.add_argument("--target", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "install":
        install(args.target)
        where = args.target if args.target is not None else "this environment"
        print(f"zerospeed-compat: deepspeed {shim_version()} installed in {where}")
        return 0
    if args.command == "uninstall":
        uninstall()
        return 0
    return status(args.target)


if __name__ == "__main__":
    sys.exit(main())
