"""DeepSpeed's `deepspeed.launcher.runner` names (the launcher itself is zerospeed/launcher/cli.py)."""
from zerospeed.launcher.cli import main
from zerospeed.launcher.multinode import ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]
