"""Weight quantization: the checkpoint formats' configs, checked without torch (`formats.py`); 4-bit AWQ
(GEMM packing) and GPTQ (`w4.py`: packing and the dequantizing reference) and FP8 (`fp8.py`); quantizers
that write them (`quantize.py`, `gptq.py`)."""
