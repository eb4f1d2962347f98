"""Calibration: measuring a machine into a hardware profile (`ptdp
calibrate`), and the calibration point the built-in profiles are fitted to."""
