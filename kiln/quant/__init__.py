"""Weight quantization: formats, calibration statistics, AWQ and SmoothQuant."""
