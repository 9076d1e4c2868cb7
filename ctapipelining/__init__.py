"""CTA-pipelining: dependent kernels spread over the GPUs of one NVLink domain."""
