"""``python -m zerospeed.launcher``: the same as the ``zerospeed`` command."""

from zerospeed.launcher.cli import main

raise SystemExit(main())
