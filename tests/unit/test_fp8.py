"""DeepSeek-style FP8 checkpoints: float8_e4m3fn weights with one float32
`weight_scale_inv` per 128x128 block; read back dequantized."""

import json

import pytest
import torch
from safetensors.torch import save_file

from kt_weights.checkpoint import open_checkpoint
from kt_weights.errors import WeightsError
from kt_weights.layout import Format

BLOCK = 128
SHAPES = {"gate": (200, 300), "up": (200, 300), "down": (300, 200)}  # partial edge blocks
N_EXPERTS = 2


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    n_r, n_c = -(-rows // BLOCK), -(-cols // BLOCK)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(n_r, n_c)
    for i in range(n_r):
        for j in range(n_c):
            tile = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = tile.abs().max() / 448.0
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fp8")
    gen = torch.Generator().manual_seed(0)
    tensors, reference = {}, {}
    for e in range(N_EXPERTS):
        for proj, shape in SHAPES.items():
            name = f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"
            q, scale = quantize_blocks(torch.randn(shape, generator=gen) * 0.05)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            reference[name] = reference_dequantize(q, scale)
    tensors["model.norm.weight"] = torch.ones(300, dtype=torch.bfloat16)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 300,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                      "weight_block_size": [BLOCK, BLOCK]}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, reference


def test_names_hide_the_scales(fp8_dir):
    directory, reference = fp8_dir
    with open_checkpoint(directory) as ckpt:
        assert set(ckpt.names()) == {*reference, "model.norm.weight"}


def test_tensor_dequantizes_per_block(fp8_dir):
    directory, reference = fp8_dir
    with open_checkpoint(directory) as ckpt:
        for name, expected in reference.items():
            got = ckpt.tensor(name)
            assert got.dtype == torch.float32 and got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


def test_matrix_and_experts_are_bf16_dequantized(fp8_dir):
    directory, reference = fp8_dir
    with open_checkpoint(directory) as ckpt:
        for proj, (rows, cols) in SHAPES.items():
            experts = ckpt.experts(1, proj)
            assert len(experts) == N_EXPERTS
            for e, m in enumerate(experts):
                expected = reference[f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight"]
                assert (m.format, m.rows, m.cols) == (Format.BF16, rows, cols)
                assert torch.equal(m.data, expected.to(torch.bfloat16))


def test_dequantization_is_close_to_the_original_weights():
    w = torch.randn(130, 260) * 0.05
    q, scale = quantize_blocks(w)
    # e4m3 has a 3-bit mantissa: relative error <= 2^-4 per element (plus subnormals)
    err = (reference_dequantize(q, scale) - w).abs()
    assert (err <= w.abs() * 2 ** -4 + scale.max() * 2 ** -9).all()


def test_wrong_scale_shape_is_a_weights_error(tmp_path):
    q, _ = quantize_blocks(torch.randn(200, 300))
    save_file({"w.weight": q, "w.weight_scale_inv": torch.ones(1, 3)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with open_checkpoint(tmp_path) as ckpt, pytest.raises(WeightsError, match="weight_scale_inv has shape"):
        ckpt.tensor("w.weight")


def test_missing_scale_is_a_weights_error(tmp_path):
    q, _ = quantize_blocks(torch.randn(128, 128))
    save_file({"w.weight": q}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"]}))
    with open_checkpoint(tmp_path) as ckpt, pytest.raises(WeightsError, match="has no 'w.weight_scale_inv'"):
        ckpt.matrix("w.weight")
