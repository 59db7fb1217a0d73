"""The architectures with a plan the sweep once skipped: the inputs no rule made (`grid_thw`,
`pixel_position_ids`, `num_patches`, `context_hidden_states` of several layers) made by rules keyed
by the input's name and read from the config, and the sub-configs the reduction did not reach
(projector widths, a conformer's channels, per-layer lists longer than the depth) reduced by rules
keyed by field names. Rules are tested on the configs (fast); each newly checked architecture
runs end to end.

Needs the extra `tpcheck[transformers]` (transformers==5.24.0): skipped with the reason without it.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the extra tpcheck[transformers] is not installed"
)
from tpcheck.adapters import transformers as hf  # noqa: E402
from tpcheck.adapters.transformers import build, common, configs, probe, reduction  # noqa: E402
from tpcheck.adapters.transformers import inputs as hf_inputs  # noqa: E402
from tpcheck.checker.pool.session import run_specs  # noqa: E402
from tpcheck.resolve import launcher  # noqa: E402

pytestmark = pytest.mark.skipif(
    transformers.__version__ != hf.PINNED,
    reason=f"rules measured on transformers {hf.PINNED}, found {transformers.__version__}",
)


def _inputs(model_type: str) -> dict:
    cfg = hf.small_config(model_type, 2)
    (inputs, *_) = hf_inputs._input_sets(hf.model_class(model_type).cls, cfg)
    return {name: (shape, kind) for name, shape, kind in inputs}, cfg


# ------------------------------------------------------------------ the metadata inputs


@pytest.mark.parametrize(
    "model_type, pixels",
    [
        ("dots3_note_vision_encoder", "pixel_values"),
        ("ernie4_5_vl_moe_vision", "hidden_states"),  # the patches, under another name
        ("muse_glimmer_vision", "pixel_values"),
    ],
)
def test_grid_thw_is_one_frame_of_whole_merged_tokens_and_its_patches(model_type, pixels):
    made, cfg = _inputs(model_type)
    (grid_shape, (t, h, w)) = made["grid_thw"]
    merge = max(getattr(cfg, f, 1) or 1 for f in ("spatial_merge_size", "merge_size"))
    assert grid_shape == (1, 3) and t == 1 and h == w and h % merge == 0 and h // merge >= 2
    shape, kind = made[pixels]
    channels = getattr(cfg, "num_channels", None) or getattr(cfg, "in_channels", None) or 3
    frames = getattr(cfg, "temporal_patch_size", None) or getattr(cfg, "patch_temporal", 1)
    assert kind == "float" and shape == (t * h * w, channels * frames * cfg.patch_size**2)


def test_the_grid_s_patch_width_is_what_the_patch_embedding_takes():
    """The rule's width against each model's own first layer (a wrong channel or frame count
    would fail here before any forward)."""
    for model_type in (
        "dots3_note_vision_encoder",
        "ernie4_5_vl_moe_vision",
        "muse_glimmer_vision",
    ):
        made, cfg = _inputs(model_type)
        pixels = next(s for n, (s, k) in made.items() if k == "float")
        model = hf.build_lm(model_type, cfg, torch.float32, device="meta")
        first = next(
            m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))
        )
        width = (
            first.in_features
            if isinstance(first, torch.nn.Linear)
            else (first.in_channels * first.kernel_size[0] * first.kernel_size[1])
        )
        assert pixels[-1] == width, model_type


def test_pixel_position_ids_are_the_processor_s_xy_grid_of_whole_pooling_kernels():
    made, cfg = _inputs("gemma4_vision")
    shape, values = made["pixel_position_ids"]
    k = cfg.pooling_kernel_size
    side = 2 * k
    assert shape == (hf.BATCH, side * side, 2)
    xy = hf_inputs.fixed(shape, values)[0]
    assert xy[:, 0].max() == side - 1 and xy[:, 1].max() == side - 1
    assert xy[1].tolist() == [1, 0]  # x runs fastest, as the image processor's meshgrid("xy")
    assert made["pixel_values"] == ((hf.BATCH, side * side, 3 * cfg.patch_size**2), "float")


def test_num_patches_counts_half_the_embeddings():
    made, cfg = _inputs("deepseek_ocr2_encoder")
    assert made["num_patches"] == ((), (common.SEQ // 2,))
    assert made["inputs_embeds"] == ((hf.BATCH, common.SEQ, cfg.hidden_size), "float")


def test_context_states_are_the_listed_layers_side_by_side():
    made, cfg = _inputs("muse_glimmer_assistant")
    width = len(cfg.target_layer_ids) * cfg.hidden_size
    assert made["context_hidden_states"][0] == (hf.BATCH, common.SEQ, width)
    assert made["noise_embeds"][0] == (hf.BATCH, common.SEQ, cfg.hidden_size)


def test_a_forward_attending_over_two_inputs_gets_a_mask_of_ones_over_both():
    cfg = hf.small_config("muse_glimmer_assistant", 2)
    first, masked = hf_inputs._input_sets(hf.model_class("muse_glimmer_assistant").cls, cfg)
    name, shape, values = masked[-1]
    assert name == "attention_mask" and shape == (hf.BATCH, 2 * common.SEQ)
    assert set(values) == {1}
    meta = hf.build_lm("muse_glimmer_assistant", cfg, torch.float32, device="meta")
    _, _, inputs, _ = probe._running("muse_glimmer_assistant", cfg, meta)
    assert inputs == masked  # its default mask covers the block only: the first set fails


def test_metadata_inputs_are_made_and_an_unknown_one_is_not():
    class Encoder:
        def forward(self, pixel_values, grid_thw, segment_map):
            pass

    assert hf_inputs._unmade_inputs(Encoder) == ["segment_map"]
    assert build.model_class("deepseek_ocr2_encoder").kind == hf.HIDDEN


def test_a_batch_keeps_the_metadata_values_and_draws_the_rest():
    inputs = (("x", (2, 3), "float"), ("grid_thw", (1, 3), (1, 4, 4)))
    make = hf_inputs.batch_maker(inputs, hf.HIDDEN, (2, 3))
    a, _ = make(torch.Generator().manual_seed(0), torch.float32)
    b, _ = make(torch.Generator().manual_seed(1), torch.float32)
    assert a["grid_thw"].tolist() == b["grid_thw"].tolist() == [[1, 4, 4]]
    assert a["grid_thw"].dtype == torch.long and not torch.equal(a["x"], b["x"])


# ------------------------------------------------------------------ the reduction


def test_projector_widths_and_the_shuffled_width_are_reduced_and_tied():
    cfg = hf.small_config("llama4_vision_model", 2)
    hidden = cfg.hidden_size
    assert cfg.projector_input_dim == cfg.projector_output_dim == cfg.vision_output_dim == hidden
    assert cfg.intermediate_size == round(hidden / cfg.pixel_shuffle_ratio**2)


def test_a_validator_tying_two_fields_is_followed():
    cls = common.CONFIG_MAPPING["dots3_note_vision_encoder"]
    field, value = configs._required(
        cls, {"hidden_size": 64}, "ValueError: adapter_in_dim must match hidden_size"
    )
    assert (field, value) == ("adapter_in_dim", 64)
    assert configs._required(cls, {}, "adapter_in_dim must match hidden_size") == (None, None)


def test_per_layer_lists_keep_one_layer_of_each_kind_with_their_overrides():
    cfg = hf.small_config("dots3_note_vision_encoder", 2)
    assert cfg.mlp_layer_types == ["dense", "sparse"] and cfg.num_hidden_layers == 2
    assert configs._consistent(cfg)
    defaults = {
        "num_hidden_layers": 6,
        "mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
        "layer_rope_theta": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        "per_layer_config": {"2": {"num_local_experts": 64}, "3": {"num_local_experts": 32}},
    }
    out = hf.small_overrides(defaults, {}, 2, patterns=True)
    assert out["num_hidden_layers"] == 2 and out["mlp_layer_types"] == ["dense", "sparse"]
    assert out["layer_rope_theta"] == [1.0, 3.0]
    assert out["per_layer_config"] == {"1": {"num_local_experts": 4}}


def test_per_stage_sizes_are_cut_with_the_depth():
    defaults = {
        "num_hidden_layers": 4,
        "depths": [2, 2, 2, 2],
        "hidden_sizes": [256, 512, 1024, 2048],
    }
    out = hf.small_overrides(defaults, {}, 2, patterns=True)
    assert out["num_hidden_layers"] == 2 and out["depths"] == [2, 2]
    assert out["hidden_sizes"] == [64, 64]


def test_channels_of_the_hidden_width_follow_it_and_a_conformer_s_blocks_are_cut():
    audio = common.CONFIG_MAPPING["phi4_multimodal"]().audio_config.to_dict()
    out = hf.small_overrides(audio, {}, 2)
    hidden = out["hidden_size"]
    for field in ("ext_pw_out_channel", "depthwise_separable_out_channel", "nemo_conv_channels"):
        assert out[field] == hidden, field
    assert out["num_blocks"] == 2


def test_the_reduced_composites_are_within_the_cap():
    for model_type in ("llama4_vision_model", "phi4_multimodal", "muse_spark"):
        cfg = hf.small_config(model_type, 2)
        model = hf.build_lm(model_type, cfg, torch.float32, device="meta")
        assert sum(p.numel() for p in model.parameters()) <= hf.MAX_PARAMS, model_type
    spark = hf.small_config("muse_spark", 2)
    assert len(spark.text_config.mlp_layer_types) == spark.text_config.num_hidden_layers


def test_the_remaining_skips_say_why():
    with pytest.raises(hf.Skip, match="no model class is built from its config class"):
        hf.model_class("t5_gemma_module")
    with pytest.raises(hf.Skip, match=r"VoxtralRealtimeTextModel does not run .*linear\(\)"):
        hf.prepare("voxtral_realtime_text", 2)


def test_reduction_rules_leave_unrelated_fields_alone():
    out = reduction.small_overrides({"num_channels": 3, "hidden_size": 768}, {}, 2)
    assert "num_channels" not in out


# ------------------------------------------------------------------ end to end

FAST = ["dots3_note_vision_encoder", "ernie4_5_vl_moe_vision", "muse_glimmer_assistant"]
SLOW = [
    "muse_glimmer_vision",
    "gemma4_vision",
    "deepseek_ocr2_encoder",
    "llama4_vision_model",
    "phi4_multimodal",
    "muse_spark",
]


def _run(names) -> dict[str, dict]:
    specs = [hf.hf_spec(a, 2, steps=1) for a in names]
    with launcher(60) as pool:
        return {r.name: r.to_json() for r in run_specs(specs, pool)}


def test_the_grid_encoders_and_the_drafter_run():
    results = _run(FAST)
    for name in ("dots3_note_vision_encoder", "ernie4_5_vl_moe_vision"):
        assert results[f"hf:{name}/tp2/float32"]["verdict"] == "equivalent", name
    drafter = results["hf:muse_glimmer_assistant/tp2/float32"]
    assert drafter["verdict"] == "not equivalent"  # its q_norm has no rule: a finding
    assert "self_attn.q_norm.weight" in drafter["summary"]


@pytest.mark.slow
def test_the_other_newly_checked_architectures_run():
    results = _run(SLOW)
    for name, r in results.items():
        assert r["verdict"] in ("equivalent", "not equivalent", "error"), (name, r["summary"])
    for name in ("muse_glimmer_vision", "deepseek_ocr2_encoder", "llama4_vision_model"):
        assert results[f"hf:{name}/tp2/float32"]["verdict"] == "equivalent", name
    assert results["hf:phi4_multimodal/tp2/float32"]["verdict"] == "equivalent"


def test_an_image_of_many_patches_is_reduced_to_eight_per_side():
    """llama4's vision encoder (448 / 14: 32 x 32 patches, 1,025 tokens) is reduced to 8 x 8; an
    image of at most 16 patches per side keeps its size (siglip's 224 / 16)."""
    from tpcheck.adapters.transformers.reduction import _image_grid

    assert _image_grid({"image_size": 448, "patch_size": 14}) == {"image_size": 112}
    assert _image_grid({"image_size": 224, "patch_size": 16}) == {}
    assert _image_grid({"image_size": [448, 448], "patch_size": 14}) == {}
    prep = hf.prepare("llama4_vision_model", 2)
    assert prep.config.image_size == 8 * prep.config.patch_size
