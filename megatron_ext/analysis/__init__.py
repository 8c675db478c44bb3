"""Offline analysis of finished runs (above training, never imported by it): per-rank traces merged and analysed
(``traces``, ``trace_analysis`` with HTA's GPU views in ``trace_hta``, ``trace_report``) and runs compared
(``compare``, ``compare_report``). What a run records while it trains lives in ``observability``."""
