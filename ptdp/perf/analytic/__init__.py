"""Analytic counts of a training run: parameters, the paper's FLOPs, the
pipeline bubble, microbatches in flight, communication volume and memory
per device, as pure functions of a workload and a layout."""
