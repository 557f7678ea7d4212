"""Prefill/decode disaggregation: KV transfer (``transfer``) and the scheduler-loop drivers (``servers``)."""
