"""Observing a run: metrics and throughput/MFU, memory, communication, profiles, traces, routing,
plots and the HTML report."""
