"""TailorKV (issue #14): quantization-friendly layers KIVI-quantized on the GPU pages,
sparsity-friendly layers offloaded to the host store with critical-channel top-k at decode."""
