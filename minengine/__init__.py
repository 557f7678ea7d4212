"""minengine: a small LLM serving engine driving hand-written paged-attention kernels."""

__version__ = "0.1.0"
