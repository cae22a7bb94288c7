"""Pure queueing models for sizing prefill and decode pools (no I/O, no clocks)."""

from queueing.erlang import erlang_b, erlang_c, mmc_wait_quantile

__all__ = ["erlang_b", "erlang_c", "mmc_wait_quantile"]
