"""Weight quantization formats: 4-bit AWQ (GEMM packing) and GPTQ checkpoints (`w4.py`: config, packing and
the dequantizing reference) and a round-to-nearest quantizer that writes them (`quantize.py`)."""
