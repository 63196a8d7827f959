"""CausalLM: the decoder-only skeleton every architecture shares.

forward(ForwardBatch): embed input_ids [N] -> per layer h += attn(norm(h)), h += mlp(norm(h))
-> final norm on batch.logits_rows -> lm_head -> logits [R, vocab] float32; greedy_tokens(batch)
-> their argmax [R].
Each architecture subclass parses its config and builds its attention and MLP per layer."""

import torch

from ..engine.forward_batch import ForwardBatch, KVSpec
from ..errors import ModelError
from ..layers.attention import AttentionContext, GQAAttention
from ..layers.decode_head import head_for
from ..layers.decode_plan import DecodePlan, DecodeWorkspace, plan_for
from ..layers.decode_stack import stack_for
from ..layers.embedding import Embedding
from ..layers.linear import Linear
from ..layers.moe import MoEBlock
from ..layers.rope import RopeSpec, Rotary
from .config import ModelConfig
from .loader import Weights
from .options import ModelOptions


class DecoderLayer(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module, mlp: torch.nn.Module, input_norm, post_norm):
        super().__init__()
        self.attn, self.mlp, self.input_norm, self.post_norm = attn, mlp, input_norm, post_norm
        self.decode_plan: DecodePlan | None = None     # set by CausalLM where the layer allows one

    def forward(self, h: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if self.decode_plan is not None and ctx.decode is not None:
            return self.decode_plan(h, ctx)
        h = h + self.attn.forward(self.input_norm.forward(h), ctx)
        return h + self.mlp.forward(self.post_norm.forward(h))


class CausalLM(torch.nn.Module):
    def __init__(self, config: ModelConfig, options: ModelOptions, w: Weights):
        super().__init__()
        self.config, self.options = config, options
        self.rotary = Rotary(self.rope_spec(config), options.target().device)
        self.embed = Embedding(w.matrix("model.embed_tokens.weight"), w.target)
        self.layers = torch.nn.ModuleList(self._layer(w, i) for i in range(config.num_layers))
        self.norm = w.norm("model.norm", config.rms_norm_eps)
        self.lm_head = self._lm_head(w)
        self.use_decode_plans(True)

    def streamed_weights(self) -> list[torch.Tensor]:
        """The CPU-resident matrices a decode step streams: the dense layers' kernel layouts and
        the routed experts' (those on a GPU are not here)"""
        tensors = []
        for module in self.modules():
            if isinstance(module, Linear) and module.qweight is not None:
                tensors += module.qweight.tensors()
            elif isinstance(module, MoEBlock):
                tensors += module.cpu.tensors()
        return tensors

    def use_decode_plans(self, on: bool) -> None:
        """Decode steps of float32 CPU models run each plain GQA layer as straight native calls
        (kt_cli.layers.decode_plan), all layers in one call where every layer allows it
        (kt_cli.layers.decode_stack), and the final norm and lm_head as one more
        (kt_cli.layers.decode_head); off, every step goes through the modules."""
        workspace = DecodeWorkspace()
        eligible = on and self.options.device == "cpu" and self.options.dtype == torch.float32
        for layer in self.layers:
            layer.decode_plan = plan_for(layer, workspace) if eligible else None
        self.decode_stack = stack_for([layer.decode_plan for layer in self.layers], workspace) if eligible else None
        self.decode_head = head_for(self.norm, self.lm_head, workspace) if eligible else None

    @classmethod
    def from_checkpoint(cls, ckpt, options: ModelOptions) -> "CausalLM":
        config = cls.parse_config(ckpt.config)
        return cls(config, options, Weights(ckpt, options.target(), config.architecture))

    @classmethod
    def parse_config(cls, hf: dict) -> ModelConfig:
        raise NotImplementedError

    def rope_spec(self, config: ModelConfig) -> RopeSpec:
        return config.rope

    def build_attention(self, w: Weights, layer: int) -> torch.nn.Module:
        raise NotImplementedError

    def build_mlp(self, w: Weights, layer: int) -> torch.nn.Module:
        raise NotImplementedError

    def kv_specs(self) -> list[KVSpec]:
        return [layer.attn.kv_spec(self.options.dtype) for layer in self.layers]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> logits [R, vocab] float32 for batch.logits_rows"""
        return self._head(self._last_hidden(batch), argmax=False)[0]

    @torch.inference_mode()
    def greedy_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """-> [R] int64 on the cpu: the argmax of forward(batch)'s rows as the sampler takes it
        (torch.argmax: the first largest; a NaN counts as the largest)"""
        logits, tokens = self._head(self._last_hidden(batch), argmax=True)
        return tokens if tokens is not None else logits.float().cpu().argmax(dim=-1)

    def _last_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """-> the last layer's output at batch.logits_rows [R, hidden]"""
        self._check(batch)
        ctx = AttentionContext.build(batch, self.rotary, self.options.dtype)
        h = self.embed.forward(batch.input_ids)
        if self.decode_stack is not None and ctx.decode is not None and self.decode_stack.applies():
            h = self.decode_stack(h, ctx)
        else:
            for layer in self.layers:
                h = layer.forward(h, ctx)
        if not batch.logits_every_row:
            h = h.index_select(0, batch.logits_rows.to(h.device))
        return h

    def _head(self, h: torch.Tensor, argmax: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (logits [R, vocab] float32, their argmax or None where the modules ran)"""
        if self.decode_head is not None and self.decode_head.applies(h):
            return self.decode_head(h, argmax)
        logits = self.lm_head.forward(self.norm.forward(h))
        return (logits if logits.dtype == torch.float32 else logits.float()), None

    def _layer(self, w: Weights, i: int) -> DecoderLayer:
        eps, prefix = self.config.rms_norm_eps, f"model.layers.{i}"
        attn, mlp = self.build_attention(w, i), self.build_mlp(w, i)
        if isinstance(mlp, MoEBlock) and isinstance(attn, GQAAttention):
            attn.int8_prefill()
        return DecoderLayer(attn, mlp, w.norm(f"{prefix}.input_layernorm", eps),
                            w.norm(f"{prefix}.post_attention_layernorm", eps))

    def _lm_head(self, w: Weights) -> Linear:
        if self.config.tie_word_embeddings or not w.has("lm_head.weight"):
            return Linear(w.matrix("model.embed_tokens.weight"), None, w.target)
        return w.linear("lm_head")

    def _check(self, batch: ForwardBatch) -> None:
        if len(batch.kv.layers) != self.config.num_layers:
            raise ModelError(f"KV cache has {len(batch.kv.layers)} layers, model has {self.config.num_layers}")
        if len(batch.q_start) != batch.num_seqs + 1 or batch.q_start[-1] != batch.input_ids.numel():
            raise ModelError(f"q_start {batch.q_start[:4]}... does not cover {batch.input_ids.numel()} tokens")
