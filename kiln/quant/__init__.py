"""Quantized engines: number formats (``formats``), ``QuantLinear`` and the model pass
(``layers``), calibration data and activation statistics (``calibration``)."""

from kiln.quant.layers import QuantLinear, quant_shells, quantize_model, summarize

__all__ = ["QuantLinear", "quant_shells", "quantize_model", "summarize"]
