"""Write docs/config_reference.md from the config schema; ``--check`` fails when the file is stale.

python scripts/gen_config_reference.py          # regenerate
python scripts/gen_config_reference.py --check  # exit 1 if the checked-in file differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from zerospeed.config.reference import COMMAND, REFERENCE_PATH, render_reference  # noqa: E402

STALE = f"{REFERENCE_PATH} is stale: run {COMMAND}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is stale")
    args = parser.parse_args(argv)
    path = ROOT / REFERENCE_PATH
    text = render_reference()
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current != text:
            print(STALE, file=sys.stderr)
            return 1
        print(f"{REFERENCE_PATH} is up to date")
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE_PATH} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
