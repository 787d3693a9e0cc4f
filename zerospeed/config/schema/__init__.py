"""Pydantic models of DeepSpeed's JSON config, one file per subsystem; ``root.ZeroSpeedConfig`` is the top."""

from zerospeed.config.schema.root import BATCH_KEYS, ZeroSpeedConfig

__all__ = ["BATCH_KEYS", "ZeroSpeedConfig"]
