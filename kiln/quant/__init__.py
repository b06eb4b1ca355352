"""Quantization support: calibration text and quality measurement (``kiln eval``)."""
