"""Reference TTT layers written the way their authors write them; the recognizer's test material."""
from .delta_memory import DeltaMemoryLayer
from .delta_product import DeltaProductLayer
from .fla_chunk_reference import FlaChunkReferenceLayer
from .fla_reference import FlaReferenceLayer
from .folded_delta import FoldedDeltaLayer
from .fused_styles import (BaddbmmMuonLayer, LerpMomentumLayer, ListedChunksLayer, SplitZipLayer,
                           UnbindDeltaLayer)
from .gated_memory import GatedChunkMemory
from .lact_folded import LaCTFoldedLayer
from .lact_heads import LaCTHeadsLayer
from .lact_published import LaCTPublishedLayer
from .lact_rotary import LaCTRotaryLayer, RotaryEmbedding
from .lm import LACT_STYLES, TinyLaCTLM
from .mlstm import MLSTMLayer
from .muon_step import MuonStepLayer
from .per_token import PerTokenTTTLayer
from .per_token_inline import PerTokenInlineTTTLayer
from .schedule import ScheduleTTTLayer
from .titans import MemoryState, TitansLinearMemory, TitansMLPMemory
from .trained import trained_char_lm
from .ttt_scan import ScanEtaTTTLayer, ScanLinearTTTLayer, ScanTTTLinearLayer, ScanTTTMLPLayer
from .variants import STEPS, variant_switches, with_variant
from .vittt import ViTTTBlock
from .vittt_closed_form import ViTTTClosedFormBlock


def lact_layer(style: str = "folded", *, variant: int | None = None, **kw):
    """Build a LaCT layer in the given coding style ("folded", "heads" or "published"); ``kw`` go to
    its constructor. ``variant=k`` sets the switches of steps 1..k off (0: LaCT as published,
    6: block-causal linear attention)."""
    if style not in LACT_STYLES:
        raise ValueError(f"unknown LaCT style {style!r}; choose one of {sorted(LACT_STYLES)}")
    return LACT_STYLES[style](**with_variant(variant, kw))


__all__ = ["BaddbmmMuonLayer", "DeltaMemoryLayer", "DeltaProductLayer", "FlaChunkReferenceLayer", "FlaReferenceLayer", "FoldedDeltaLayer", "LerpMomentumLayer", "ListedChunksLayer", "SplitZipLayer",
           "UnbindDeltaLayer", "GatedChunkMemory", "LaCTFoldedLayer", "LaCTHeadsLayer",
           "LaCTPublishedLayer", "LaCTRotaryLayer", "MLSTMLayer", "MuonStepLayer", "PerTokenTTTLayer", "PerTokenInlineTTTLayer", "ScanEtaTTTLayer", "ScanLinearTTTLayer",
           "ScanTTTLinearLayer", "ScanTTTMLPLayer", "ScheduleTTTLayer", "TinyLaCTLM", "ViTTTBlock",
           "ViTTTClosedFormBlock", "MemoryState", "RotaryEmbedding", "TitansLinearMemory", "TitansMLPMemory",
           "lact_layer", "trained_char_lm", "STEPS", "variant_switches"]
