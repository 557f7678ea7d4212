"""Triton kernels of minengine: tensors in, tensors out, one contract per kernel.

- ``paged_attention``: mixed chunked-prefill + decode attention over paged KV, one launch.
- ``store_kv``: write this step's K/V into the paged caches.
- ``gather_input_ids``: the mixed-batch input_ids gather of overlap scheduling.
- ``rms_norm``, ``rotary``, ``silu_and_mul``: the decoder's fused elementwise layers (``layers.py``).

Each kernel's file opens with its contract; ``contract.py`` holds the argument checks that
every backend shares. This package imports nothing from ``minengine``.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before importing this package to run
the kernels in Triton's interpreter (slow; small shapes only).
"""

import os

# NOTE: Triton 3.9 warns that FP fusion (FMA contraction) will default to off in 3.10. Our
# kernels are written and tested with it on, as on every earlier Triton; keep it unless the
# user chose otherwise. Set before any kernel compiles.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from triton_kernels.attention import paged_attention  # noqa: E402
from triton_kernels.input_ids import gather_input_ids  # noqa: E402
from triton_kernels.kv_cache import store_kv  # noqa: E402
from triton_kernels.layers import rms_norm, rotary, silu_and_mul  # noqa: E402

__all__ = ["gather_input_ids", "paged_attention", "rms_norm", "rotary", "silu_and_mul", "store_kv"]
