"""Linear layers over a stored QMatrix. On the CPU the matrix stays in its stored
format (I8/I4 codes in the layouts the kernels stream fastest, ops.decode_layout) and
runs through kt's kernels; on a GPU it is dequantized once into the compute dtype and runs
through torch."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kt_weights.layout import Format, QMatrix

from .. import ops
from ..ops import hugepages
from ..ops.linear import GEMM_MIN_TOKENS, runs_on_row8_kernel
from ..errors import ModelError

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Target:
    """Where the torch side of a model runs, and in which dtype."""
    device: torch.device
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in COMPUTE_DTYPES:
            raise ModelError(f"compute dtype {self.dtype} unsupported; use float32, bfloat16 or float16")

    @property
    def on_cpu(self) -> bool:
        return self.device.type == "cpu"

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype)


def decode_acts(fmt: Format) -> str:
    """The activations dense layers give weights of format fmt below GEMM_MIN_TOKENS tokens:
    int8 for I4 weights, int16 for I8 ones, float32 for float formats (kt_linear would
    round them to bf16 for BF16 weights on AVX512-BF16 builds if asked for int8).

    The rule: quantizing activations must add little to the weights' own error. Per
    element, 4-bit codes err by ~1/52 of a group's range (rms), int8 activations by
    ~1/880 of a 32-block's: 17x below, and llama.cpp multiplies its 4-bit formats by
    8-bit activations too. Against 8-bit codes (Q8_0, Q6_K) int8 activations would add
    an error as large as the weights', so those take int16 (within 1/65534 of a block's
    largest value, as two int8 passes: ~1.2-1.3x the int8 time). SmolLM2's answer to
    "What is the capital of France?" hangs on a 0.08-logit near-tie in its first token,
    which its I8 lm_head (Q8_0) keeps on "The" with int16; int8 there flipped it to French."""
    return {Format.I8: "int16", Format.I4: "int8"}.get(fmt, "f32")


def dense_acts(m: int, decode: str, prefill: str = "f32", until: int = GEMM_MIN_TOKENS) -> str:
    """-> the activations for m tokens of a layer whose decode activations are `decode`: those
    below `until` (GEMM_MIN_TOKENS; ops.int16_until raises it where int16 beats the GEMM further),
    `prefill` from there: float32 (the GEMM reuses each dequantized weight
    panel) unless ops.prefill_acts gives the matrix int16. int8 activations for INT4 weights in
    prefill ran the avx2 8-row kernel 1.3-1.4x faster than the GEMM, but moved SmolLM2's logits
    1.2 from llama.cpp's (test_models_smollm2_gguf allows 0.75) and flipped its France answer:
    prefill stays within int16's rounding of float32, or, on pools with AMX tiles, bf16's
    (ops.prefill_acts "bf16"), 5.8x faster there; MoE layers' q/k/v and o_proj take int8 (int8_prefill_fits)."""
    return decode if m < until else prefill


def int8_prefill_fits(linear: "Linear") -> bool:
    """Whether linear may take int8 activations in prefill too, as it does in decode: INT4 weights
    (decode_acts' rule: int8 adds ~1/17 of their own error) on the build's 8-row kernel, and not
    where the AMX tiles take them in bf16 (faster there). Asked for the q/k/v and o_proj
    projections of MoE layers (GQAAttention.int8_prefill), whose experts, most of the model,
    prefill on int8 activations already: the scaled Qwen3-MoE Q4_0 prefilled 1.14x faster with
    int8 q/k/v (pp512, in-process A/B, 2-core Zen 4), and ~1.06x faster again with int8 o_proj
    (2-core Zen 3), whose mean logit cosine to the source on the tiny qwen3_moe_256 int4 moved
    0.951894 -> 0.951792. Dense models keep int16 throughout: on SmolLM2 Q4_1, int8 q/k/v moved
    perplexity 7.1804 -> 7.2067 (llama.cpp, int8 everywhere: 7.2081), its largest logit gap to
    llama.cpp 0.56 -> 0.69 (test bound 0.75), and its answer to "What is the capital of France?"
    from "Paris" to llama.cpp's own French list."""
    w = linear.qweight
    return (w is not None and w.format == Format.I4 and w.row8 and linear.prefill_acts != "bf16"
            and runs_on_row8_kernel(w))


class Linear(torch.nn.Module):
    def __init__(self, weight: QMatrix, bias: torch.Tensor | None, target: Target):
        super().__init__()
        self.rows, self.cols = weight.rows, weight.cols
        self.target = target
        self.qweight = ops.decode_layout(weight) if target.on_cpu else None
        self.decode_acts = decode_acts(weight.format)      # a decode plan may raise it to its layer's
        self.prefill_acts = ops.prefill_acts(self.qweight) if target.on_cpu else "f32"
        self.int16_until = ops.int16_until(self.qweight) if target.on_cpu else GEMM_MIN_TOKENS
        self.kernel = ops.BoundLinear(ops.pool(), self.qweight) if target.on_cpu else None
        if target.on_cpu:       # decode streams these every token, as it does the experts
            hugepages.collapse(self.qweight.tensors())
        self.weight = None if target.on_cpu else target.put(weight.dequantize())
        self.bias = None if bias is None else target.put(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., cols] -> [..., rows]"""
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.cols)
        if flat.dtype != torch.float32:
            flat = flat.float()
        y = self.kernel(flat.contiguous(),
                        dense_acts(flat.shape[0], self.decode_acts, self.prefill_acts, self.int16_until))
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.rows)
        return y if self.bias is None else y + self.bias
