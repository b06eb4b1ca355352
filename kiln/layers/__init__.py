"""Building blocks of every model. Parallelism and quantization live here (later issues):
model files only declare structure."""

from kiln.layers.attention import Attention
from kiln.layers.embedding import Embedding, LMHead
from kiln.layers.linear import Linear
from kiln.layers.mlp import GatedMLP
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding

__all__ = ["Attention", "Embedding", "GatedMLP", "LMHead", "Linear", "RMSNorm", "RotaryEmbedding"]
