"""`import deepspeed` served by zerospeed: `deepspeed.X.Y` is `zerospeed.X.Y`.

Installed by `zerospeed-compat install`; removed by `zerospeed-compat uninstall` (or pip).
"""

from zerospeed.compat.alias import activate

activate(__name__)
