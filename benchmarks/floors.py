"""The H200 floors every benchmark divides by: DESIGN.md's "Performance floors", measured on the device machine."""

PEAK_FLOPS = {"bf16": 788e12, "fp8": 1425e12}  # flop/s at 8192^3: bf16 matmul, FP8 torch._scaled_mm tensorwise
PEAK_TFLOPS = {name: flops / 1e12 for name, flops in PEAK_FLOPS.items()}
COPY_BYTES_PER_S = 4.24e12  # a device copy, bytes read + written
NCCL_ALL_GATHER_BYTES_PER_S = 250e9  # NCCL all-gather on 2 GPUs
