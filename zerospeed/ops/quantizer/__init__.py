"""DeepSpeed's `deepspeed.ops.quantizer`, in pure PyTorch: block quantization of flat tensors (the
ZeRO++ weight and gradient quantizers) and `ds_quantizer`, DeepSpeed's fake-quantization entry point."""
from zerospeed.ops.quantizer.blockwise import (BlockQuantized, dequantize_blocks, dequantize_blocks_into, from_bytes, num_blocks, pack_int4,
                                               quantize_blocks, to_bytes, unpack_int4, wire_bytes)
from zerospeed.ops.quantizer.fake import ds_quantizer

__all__ = ["BlockQuantized", "dequantize_blocks", "dequantize_blocks_into", "ds_quantizer", "from_bytes", "num_blocks", "pack_int4",
           "quantize_blocks", "to_bytes", "unpack_int4", "wire_bytes"]
