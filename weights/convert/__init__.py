"""`kt convert`: HF checkpoints (BF16/FP16/FP32, FP8 e4m3 block- or channel-scaled)
to the kt directory format (int8/int4/bf16) or to GGUF, streamed one layer at a time.

  convert(ConvertOptions(...), progress_sink) -> ConvertSummary
  summary_table_rows(summary) -> [(label, value)]
  python -m kt_weights.convert SRC DST --to ...   (see __main__.py)
"""

from .options import GGUF_TYPES, GROUP_SIZES, TARGETS, ConvertOptions
from .pipeline import convert
from .progress import ConvertStart, ConvertSummary, NullSink, ProgressSink, TextSink, UnitDone, summary_table_rows

__all__ = ["ConvertOptions", "ConvertStart", "ConvertSummary", "GGUF_TYPES", "GROUP_SIZES", "NullSink",
           "ProgressSink", "TARGETS", "TextSink", "UnitDone", "convert", "summary_table_rows"]
