"""Weight-only int8 / int4 group-wise quantization for inference (groupwise.py: the math; layer.py: the layer)."""

from zerospeed.compression.weight_quant.groupwise import QuantizedWeight, dequantize, quantize
from zerospeed.compression.weight_quant.layer import QuantizedLinear, quantize_model, settings_from_config

__all__ = ["QuantizedLinear", "QuantizedWeight", "dequantize", "quantize", "quantize_model", "settings_from_config"]
