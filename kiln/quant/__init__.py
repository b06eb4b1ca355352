"""Quantized engines: number formats (``formats``), ``QuantLinear`` (``layers``) and the
model passes (``passes``), build-time quantization (``build``), the CLI's options
(``cli_options``), calibration data and statistics
(``calibration``, ``calib``, ``stats``), AWQ / SmoothQuant (``algorithms``) and the quality
measurements behind ``kiln eval`` and the build's quality gate (``quality``)."""
