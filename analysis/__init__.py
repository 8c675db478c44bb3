"""Offline analysis of finished runs, beside tools/ and outside megatron_ext (it imports megatron_ext, never the
reverse): per-rank traces merged and analysed (``traces``, ``trace_analysis`` with HTA's GPU views in
``trace_hta``, ``trace_report``) and runs compared (``compare``, ``compare_report``). What a run records while it
trains lives in ``megatron_ext.observability``."""
