"""Quantized engines: number formats (``formats``), ``QuantLinear`` and the model pass
(``layers``), build-time quantization (``build``), calibration data and statistics
(``calibration``, ``calib``, ``stats``), AWQ / SmoothQuant (``algorithms``) and the quality
measurements behind ``kiln eval`` and the build's quality gate (``quality``)."""
