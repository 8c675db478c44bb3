"""Observability for every training run: model FLOPs and MFU (``flops``), memory and timing (``metrics``), the
labelled and timed parts of a step (``regions``), traces (``profiler``; read offline by the top-level ``analysis``)
and the metric sinks (``loggers``). Import the submodules: this package stays torch-free for the flag checks."""
