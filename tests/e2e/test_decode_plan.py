"""Decode steps through the native decoder layer (kt_cli.layers.decode_plan), the native
MoE half (kt_cli.layers.decode_moe) and the whole stack in one call (decode_stack): the
same logits as transformers, within the bounds of the module path, by either the stack or
the per-layer calls; used for every layer of every pure decode step where the layer allows
it; the routed counts kept; bad inputs refused with an error."""

import pytest
import torch

from kt_cli import ops
from kt_cli.layers import fused
from kt_cli.layers.attention import AttentionContext
from kt_cli.layers.decode_moe import MoEDecodePlan
from kt_cli.layers.decode_plan import DecodePlan
from kt_cli.layers.decode_stack import DecodeStack
from kt_cli.models.registry import ModelOptions, build_model
from kt_cli.ops.ffi_args import OpError
from kt_weights.checkpoint import open_checkpoint

from test_models_vs_transformers import assert_close, greedy
from tiny_models import VOCAB, PagedDriver, build_tiny, reference_logits, reference_model

# kind -> layers with a plan: every GQA layer (dense llama layers whole, MoE layers their
# attention half; Qwen2-MoE's q/k/v projections have biases, and its layer 1 is dense), no MLA one
PLANNED = {"llama": "all", "llama_tied": "all", "mixtral": "all", "qwen3_moe": "all", "qwen3_moe_dense1": "all",
           "qwen2_moe": "all", "deepseek_v2_lite": "none"}
# MoE blocks whose whole decode step is native: softmax top-k routing, no shared expert
NATIVE_MOE = {"mixtral", "qwen3_moe", "qwen3_moe_dense1"}
# models whose decode steps are one native call: every layer planned, every MLP native
STACKED = {"llama", "llama_tied", *NATIVE_MOE}


@pytest.fixture(scope="module", params=list(PLANNED))
def tiny(request, tmp_path_factory):
    directory = build_tiny(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, build_model(open_checkpoint(directory), ModelOptions()), reference_model(directory)


def count_calls(monkeypatch, cls) -> list[int]:
    calls = [0]
    original = cls.__call__

    def counted(self, *args):
        calls[0] += 1
        return original(self, *args)
    monkeypatch.setattr(cls, "__call__", counted)
    return calls


def moe_layers(model) -> list:
    return [layer for layer in model.layers if layer.decode_plan is not None and not layer.decode_plan.dense]


def decode_pairs(model, ref, prompts: dict[int, list[int]], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill the prompts, then `steps` decode steps of every sequence (the reference's
    greedy tokens): (kt logits, transformers logits) of each decoded token."""
    driver = PagedDriver(model, seed=5)
    seqs = dict(prompts)
    driver.step(seqs)
    pairs = []
    for _ in range(steps):
        chunks = {sid: [greedy(ref, ids)] for sid, ids in seqs.items()}
        logits = driver.step(chunks)
        for sid, new in chunks.items():
            seqs[sid] = seqs[sid] + new
            pairs.append((logits[sid], reference_logits(ref, seqs[sid])[-1:]))
    return pairs


def prompts(lengths) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(11)
    return {i: torch.randint(0, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate(lengths)}


def test_which_layers_have_a_plan(tiny):
    kind, model, _ = tiny
    planned = [layer.decode_plan is not None for layer in model.layers]
    assert all(planned) if PLANNED[kind] == "all" else not any(planned)
    if kind == "qwen2_moe":
        assert all(layer.decode_plan.desc.qkv_bias != layer.decode_plan.ffi.NULL for layer in model.layers)
    natively = [layer.decode_plan.moe is not None for layer in moe_layers(model)]
    assert all(natively) if kind in NATIVE_MOE else not any(natively)
    assert (model.decode_stack is not None) == (kind in STACKED)
    model.use_decode_plans(False)
    assert not any(layer.decode_plan is not None for layer in model.layers)
    model.use_decode_plans(True)


@pytest.mark.parametrize("path", ["stack", "layers"])
@pytest.mark.parametrize("lengths", [(6,), (3, 9, 1)], ids=["one-sequence", "three-sequences"])
def test_decode_steps_match_transformers(tiny, lengths, path, monkeypatch):
    kind, model, ref = tiny
    if path == "layers":
        monkeypatch.setattr(model, "decode_stack", None)
    calls, moe_calls = count_calls(monkeypatch, DecodePlan), count_calls(monkeypatch, MoEDecodePlan)
    stack_calls = count_calls(monkeypatch, DecodeStack)
    steps = 4
    planned = decode_pairs(model, ref, prompts(lengths), steps)
    stacked = path == "stack" and kind in STACKED
    assert stack_calls[0] == (steps if stacked else 0)
    assert calls[0] == (steps * model.config.num_layers if PLANNED[kind] == "all" and not stacked else 0)
    assert moe_calls[0] == (steps * len(moe_layers(model)) if kind in NATIVE_MOE and not stacked else 0)
    assert_close(planned, f"{kind} decode through the native layer")
    model.use_decode_plans(False)
    try:
        modules = decode_pairs(model, ref, prompts(lengths), steps)
    finally:
        model.use_decode_plans(True)
    assert_close(modules, f"{kind} decode through the modules")
    for (a, _), (b, _) in zip(planned, modules, strict=True):   # the same kernels: equal up to exp's rounding
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5])
def test_native_head_gives_the_modules_logits_and_their_argmax(tiny, rows):
    """The final norm and lm_head in one call: the bits of the modules (RMSNorm, Linear) on the
    same hidden states, and torch.argmax of them; wider batches than the native norm's take the modules"""
    kind, model, _ = tiny
    head = model.decode_head
    assert head is not None
    h = 2.0 * torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    logits, tokens = head(h, argmax=True)
    want = model.lm_head.forward(model.norm.forward(h))
    assert torch.equal(logits, want), kind
    assert torch.equal(tokens, torch.argmax(want, dim=-1))
    assert head(h, argmax=False)[1] is None
    assert not head.applies(torch.randn(65, model.config.hidden_size)) and head.applies(h)
    model.use_decode_plans(False)
    try:
        assert model.decode_head is None
    finally:
        model.use_decode_plans(True)


def test_dense_qwen3_layer_with_qk_norm_runs_whole(tmp_path):
    """Per-head q/k norms with a dense MLP in one native call (Qwen3-MoE's mlp_only_layers);
    its decode logits are checked with the other kinds above."""
    model = build_model(open_checkpoint(build_tiny("qwen3_moe_dense1", tmp_path / "q")), ModelOptions())
    plans = [layer.decode_plan for layer in model.layers]
    assert [plan.dense for plan in plans] == [False, True]
    assert all(plan.desc.qk_norm != plan.ffi.NULL and plan.desc.inter == (96 if plan.dense else 0) for plan in plans)


@pytest.mark.parametrize("path", ["stack", "layers"])
@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_q_k_v_apart_decode_like_transformers(kind, path, tmp_path, monkeypatch):
    """q, k and v as three matrices (GGUF files keep v in another format than q and k where
    they can't fuse, as Q4_K_M's Q6_K beside Q4_K): the native layer joins their rows, biases
    included (Qwen2-MoE); the layer checks each part's shape"""
    directory = build_tiny(kind, tmp_path / kind)
    monkeypatch.setattr(fused, "can_concat_rows", lambda mats: False)
    model, ref = build_model(open_checkpoint(directory), ModelOptions()), reference_model(directory)
    plans = [layer.decode_plan for layer in model.layers]
    assert all(not layer.attn.qkv.fused for layer in model.layers)
    assert all(plan.desc.qkv == plan.ffi.NULL and plan.desc.v_proj != plan.ffi.NULL for plan in plans)
    assert (model.decode_stack is not None) == (kind == "qwen3_moe")
    if path == "layers":
        monkeypatch.setattr(model, "decode_stack", None)
    calls = count_calls(monkeypatch, DecodePlan)
    assert_close(decode_pairs(model, ref, prompts((3, 9)), 3), f"{kind} decode with q, k and v apart")
    assert calls[0] == (0 if model.decode_stack is not None else 3 * model.config.num_layers)
    wrong = plans[0].ffi.new("kt_decode_layer *", plans[0].desc[0])
    wrong.v_proj = wrong.q_proj                   # q's rows where v's belong
    assert plans[0].lib.kt_decode_scratch_floats(wrong, 1) > 0
    ctx, batch = decode_context(model)
    step = plans[0].ws.step_for(ctx, 1, plans[0].head_dim, plans[0].ffi)
    k, v = batch.kv.layers[0]
    h, out, scratch = torch.zeros(1, plans[0].hidden), torch.empty(1, plans[0].hidden), torch.empty(1 << 16)
    p = lambda t: plans[0].ffi.cast("float *", t.data_ptr())
    assert plans[0].lib.kt_decode_layer_f32(ops.pool().handle, wrong, step, p(h), p(out), p(k), p(v), k.shape[0],
                                            p(scratch), scratch.numel()) == plans[0].lib.KT_EINVAL


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    directory = build_tiny("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))
    return build_model(open_checkpoint(directory), ModelOptions()), reference_model(directory)


def routed_counts(model) -> torch.Tensor:
    return torch.stack([layer.mlp.usage.routed.clone() for layer in moe_layers(model)])


def reset_usage(model) -> None:
    for layer in moe_layers(model):
        layer.mlp.usage.reset()


def test_native_moe_half_counts_what_the_modules_count(qwen3_moe, monkeypatch):
    """The routed counts (placement's input) and assignments after native decode steps equal
    those of the same steps through the modules (whose counts test_router checks against
    bincount); a placement hook on a block sends that block back to the module path."""
    model, ref = qwen3_moe
    moe_calls, stack_calls = count_calls(monkeypatch, MoEDecodePlan), count_calls(monkeypatch, DecodeStack)
    reset_usage(model)
    decode_pairs(model, ref, prompts((5, 2)), 3)
    native, assignments = routed_counts(model), [layer.mlp.usage.assignments for layer in moe_layers(model)]
    assert stack_calls[0] == 3 and moe_calls[0] == 0 and int(native.sum()) > 0
    assert all(layer.mlp.times.calls >= 3 for layer in moe_layers(model))
    reset_usage(model)
    model.use_decode_plans(False)
    try:
        decode_pairs(model, ref, prompts((5, 2)), 3)
    finally:
        model.use_decode_plans(True)
    assert torch.equal(routed_counts(model), native)
    assert [layer.mlp.usage.assignments for layer in moe_layers(model)] == assignments

    class Hook:
        seen = 0

        def before_dispatch(self, block, ids):
            Hook.seen += 1
    block = moe_layers(model)[0].mlp
    block.replacer = Hook()
    try:
        before = moe_calls[0]
        decode_pairs(model, ref, prompts((4,)), 2)
    finally:
        block.replacer = None
    assert Hook.seen > 0 and moe_calls[0] - before == 2 * (len(moe_layers(model)) - 1) and stack_calls[0] == 3


def test_native_moe_half_checks_its_sizes(qwen3_moe):
    model, _ = qwen3_moe
    plan = moe_layers(model)[0].decode_plan.moe
    lib, ffi, desc = plan.lib, plan.ffi, plan.desc
    assert lib.kt_decode_moe_scratch_floats(desc, 0) < 0 and lib.kt_decode_moe_scratch_floats(ffi.NULL, 1) < 0
    need = lib.kt_decode_moe_scratch_floats(desc, 2)
    h, scratch = torch.randn(2, desc.hidden), torch.empty(need)
    p = lambda t: ffi.cast("float *", t.data_ptr())

    def call(d=desc, floats=need):
        return lib.kt_decode_moe_f32(ops.pool().handle, d, p(h), 2, p(scratch), floats)
    assert call() == 0
    assert call(floats=need - 1) == lib.KT_EINVAL
    for field, value in (("hidden", desc.hidden + 1), ("n_experts", desc.n_experts + 1), ("top_k", 0),
                         ("top_k", desc.n_experts + 1), ("post_eps", -1.0)):
        wrong = ffi.new("kt_decode_moe *", desc[0])
        setattr(wrong, field, value)
        assert call(d=wrong) == lib.KT_EINVAL, field
    wrong = ffi.new("kt_decode_moe *", desc[0])
    wrong.router = moe_layers(model)[0].decode_plan.desc.o_proj      # (hidden, heads x head_dim): not a router
    assert call(d=wrong) == lib.KT_EINVAL


# ---- refused inputs ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    directory = build_tiny("llama", tmp_path_factory.mktemp("llama"))
    return build_model(open_checkpoint(directory), ModelOptions())


def decode_context(model, slot: int = 9):
    driver = PagedDriver(model)
    batch = driver._batch({0: [3]})
    batch.slot_mapping[0] = slot
    return AttentionContext.build(batch, model.rotary, torch.float32), batch


def test_bad_hidden_states_are_refused(llama):
    plan = llama.layers[0].decode_plan
    ctx, _ = decode_context(llama)
    hidden = plan.hidden
    for bad in (torch.zeros(1, hidden + 1), torch.zeros(1, hidden, dtype=torch.float64), torch.zeros(hidden),
                torch.zeros(hidden, 2).t()):
        with pytest.raises(OpError, match="hidden states"):
            plan(bad, ctx)
    plan(torch.zeros(1, hidden), ctx)
    with pytest.raises(OpError, match="rows in a step"):
        plan(torch.zeros(2, hidden), ctx)


def test_a_slot_outside_the_cache_is_refused(llama):
    plan = llama.layers[0].decode_plan
    ctx, batch = decode_context(llama)
    rows = batch.kv.layers[0][0].shape[0]
    ctx.slot_mapping[0] = rows          # the step's description points at this tensor
    with pytest.raises(OpError, match="kt_decode_layer_f32"):
        plan(torch.zeros(1, plan.hidden), ctx)


def test_native_layer_checks_its_sizes(llama):
    plan = llama.layers[0].decode_plan
    lib, ffi = plan.lib, plan.ffi
    assert lib.kt_decode_scratch_floats(plan.desc, 0) < 0
    assert lib.kt_decode_scratch_floats(ffi.NULL, 1) < 0
    ctx, batch = decode_context(llama)
    step = plan.ws.step_for(ctx, 1, plan.head_dim, ffi)
    k, v = batch.kv.layers[0]
    h, out = torch.zeros(1, plan.hidden), torch.empty(1, plan.hidden)
    need = lib.kt_decode_scratch_floats(plan.desc, 1)
    scratch = torch.empty(need)
    p = lambda t: ffi.cast("float *", t.data_ptr())

    def call(desc=plan.desc, floats=need, rows=k.shape[0]):
        return lib.kt_decode_layer_f32(ops.pool().handle, desc, step, p(h), p(out), p(k), p(v), rows, p(scratch),
                                       floats)
    plan.desc.acts = lib.KT_ACTS_INT16
    assert call() == 0
    assert call(floats=need - 1) == lib.KT_EINVAL
    assert call(rows=9) == lib.KT_EINVAL          # slot 9 is outside a 9-row cache
    wrong = ffi.new("kt_decode_layer *", plan.desc[0])
    wrong.hidden += 1                             # no longer the projections' width
    assert call(desc=wrong) == lib.KT_EINVAL
    wrong = ffi.new("kt_decode_layer *", plan.desc[0])
    wrong.heads = wrong.kv_heads + 1              # not a multiple of the KV heads
    assert call(desc=wrong) == lib.KT_EINVAL


def test_native_stack_checks_its_sizes(qwen3_moe):
    model, _ = qwen3_moe
    stack = model.decode_stack
    lib, ffi, n_layers = stack.lib, stack.ffi, len(stack.plans)
    assert lib.kt_decode_stack_scratch_floats(stack.layers, 0, 1) < 0
    assert lib.kt_decode_stack_scratch_floats(ffi.NULL, n_layers, 1) < 0
    assert lib.kt_decode_stack_scratch_floats(stack.layers, n_layers, 0) < 0
    ctx, _ = decode_context(model)
    step = stack.ws.step_for(ctx, 1, stack.head_dim, ffi)
    stack._bind_caches(ctx)
    need = lib.kt_decode_stack_scratch_floats(stack.layers, n_layers, 1)
    h, scratch, seconds = torch.randn(1, stack.hidden), torch.empty(need), ffi.new("double[]", n_layers)
    p = lambda t: ffi.cast("float *", t.data_ptr())

    def call(layers=stack.layers, floats=need):
        return lib.kt_decode_stack_f32(ops.pool().handle, layers, n_layers, step, p(h), p(scratch), floats, seconds)
    assert call() == 0 and all(seconds[i] > 0 for i in range(n_layers))
    assert call(floats=need - 1) == lib.KT_EINVAL
    layers = ffi.new("kt_decode_stack_layer[]", [stack.layers[i] for i in range(n_layers)])
    layers[n_layers - 1].layer = ffi.NULL
    assert call(layers) == lib.KT_EINVAL
    wider = ffi.new("kt_decode_moe *", stack.layers[0].moe[0])
    wider.hidden += 1
    layers = ffi.new("kt_decode_stack_layer[]", [stack.layers[i] for i in range(n_layers)])
    layers[0].moe = wider
    assert call(layers) == lib.KT_EINVAL
