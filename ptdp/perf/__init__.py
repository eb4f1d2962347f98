"""The performance model: analytic counts and memory (analytic/), hardware
pricing (price/), a schedule priced in simulated time and its timelines
(simulate/), the layout search (plan/) and calibration (calibrate/); the
layout and workload they share (layout.py), and the checks a run meets before
its processes start (fits.py, local_processes.py)."""
