"""kt's weight formats: readers for safetensors and GGUF, the kt on-disk layout,
quantizers and the streaming converter."""
