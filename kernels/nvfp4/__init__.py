"""NVFP4 numerics: the pure-torch reference (the spec), Triton kernels, aligned/grouped linears, backends."""
