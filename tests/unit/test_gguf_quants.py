"""GGUF storage types -> kt QMatrix: the repack must be lossless, i.e. dequantize to
exactly what gguf's own numpy dequantization gives for the same bytes."""

import gguf
import numpy as np
import pytest
import torch

from kt_weights.checkpoint import open_checkpoint
from kt_weights.layout import Format

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512
NAME = "blk.0.ffn_up.weight"
HF_NAME = "model.layers.0.mlp.up_proj.weight"

# type -> (kt format, group, has min)
EXPECTED_LAYOUT = {
    "F32": (Format.F32, 0, False), "F16": (Format.F16, 0, False), "BF16": (Format.BF16, 0, False),
    "Q8_0": (Format.I8, 32, False), "Q4_0": (Format.I4, 32, False), "Q4_1": (Format.I4, 32, True),
    "Q4_K": (Format.I4, 32, True), "Q5_K": (Format.I8, 32, True), "Q6_K": (Format.I8, 16, False),
}


def write_llama_gguf(path, tensors: dict, n_layers: int = 1):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(n_layers)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_feed_forward_length(COLS)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid K-quant bytes: every bit pattern of the packed quants and
    scales is valid; only the f16 super-block scales must be finite."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    halves = rng.uniform(1e-4, 2e-2, size=(rows, cols // block_weights, 2)).astype(np.float16)
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = halves[..., :1].view(np.uint8)
    else:
        blocks[..., 0:4] = halves.view(np.uint8).reshape(rows, -1, 4)
    return blocks.reshape(rows, -1)


def stored_bytes(type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, Q]:
    qtype = Q[type_name]
    weights = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        return random_k_blocks(qtype, ROWS, COLS, rng), qtype
    if type_name == "F32":
        return weights, qtype
    if type_name == "F16":
        return weights.astype(np.float16), qtype
    return gguf.quants.quantize(weights, qtype), qtype


@pytest.fixture(scope="module", params=list(EXPECTED_LAYOUT))
def quantized(request, tmp_path_factory):
    rng = np.random.default_rng(sum(map(ord, request.param)))
    data, qtype = stored_bytes(request.param, rng)
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf",
                            {NAME: (data, qtype), "output_norm.weight": (np.ones(64, np.float32), Q.F32)})
    reference = gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS)
    with open_checkpoint(path) as ckpt:
        yield request.param, ckpt, reference


def test_matrix_dequantizes_exactly_like_gguf(quantized):
    type_name, ckpt, reference = quantized
    m = ckpt.matrix(HF_NAME)
    assert (m.rows, m.cols) == (ROWS, COLS)
    np.testing.assert_array_equal(m.dequantize().numpy(), reference)


def test_tensor_is_float32_in_hf_shape(quantized):
    _, ckpt, reference = quantized
    t = ckpt.tensor(HF_NAME)
    assert t.dtype == torch.float32 and tuple(t.shape) == (ROWS, COLS)
    np.testing.assert_array_equal(t.numpy(), reference)


def test_layout_matches_the_storage_type(quantized):
    type_name, ckpt, _ = quantized
    fmt, group, has_min = EXPECTED_LAYOUT[type_name]
    m = ckpt.matrix(HF_NAME)
    assert m.format == fmt
    if fmt.quantized:
        assert m.group == group and (m.min is not None) == has_min


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_matrices_are_views_of_the_file(type_name, tmp_path):
    data, qtype = stored_bytes(type_name, np.random.default_rng(2))
    path = write_llama_gguf(tmp_path / "f.gguf", {NAME: (data, qtype)})
    with open_checkpoint(path) as ckpt:
        a, b = ckpt.matrix(HF_NAME), ckpt.matrix(HF_NAME)
        assert a.data.data_ptr() == b.data.data_ptr()


def test_one_dimensional_tensor(quantized):
    _, ckpt, _ = quantized
    assert torch.equal(ckpt.tensor("model.norm.weight"), torch.ones(64))


def test_k_quant_bytes_from_gguf_reference_not_all_trivial():
    rng = np.random.default_rng(0)
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        blocks = random_k_blocks(Q[name], 2, 256, rng)
        values = gguf.quants.dequantize(blocks, Q[name])
        assert np.isfinite(values).all() and np.unique(values).size > 100, name


def test_unsupported_gguf_type_is_a_weights_error(tmp_path):
    from kt_weights.errors import WeightsError

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(2, 84), dtype=np.uint8)
    blocks[:, 80:84] = np.array([0.01, 0.01], np.float16).view(np.uint8)
    path = write_llama_gguf(tmp_path / "q2k.gguf", {NAME: (blocks, Q.Q2_K)})
    with open_checkpoint(path) as ckpt, pytest.raises(WeightsError, match="unsupported GGUF type Q2_K"):
        ckpt.matrix(HF_NAME)
