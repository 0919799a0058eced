"""The attention backends h3serve knows. Each one is a small class; see ..backend."""

from .flash_attn import FlashAttnBackend
from .flex_attn import FlexAttnBackend
from .sage_attn import SageAttnBackend
from .torch_sdpa import TorchSDPABackend
from .torch_varlen import TorchVarlenBackend

ALL_BACKENDS = (FlashAttnBackend(), TorchVarlenBackend(), TorchSDPABackend(), FlexAttnBackend(), SageAttnBackend())
