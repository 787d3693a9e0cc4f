"""Inference: `init_inference` -> `InferenceEngine` (DeepSpeed's config, AutoTP sharding with full logits,
transformers' generation loop), a paged KV cache with a continuous-batching server (`zerospeed.inference.
paged`), and ZeRO-Inference through the stage-3 engine. See docs/inference.md."""

from zerospeed.inference.api import init_inference
from zerospeed.inference.config import DeepSpeedInferenceConfig
from zerospeed.inference.engine import InferenceEngine

__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "init_inference"]
