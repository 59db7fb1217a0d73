"""The coverage rules of `tpcheck hf` (tpcheck.adapters.transformers): which class is checked for
an architecture, how its config is reduced when the first reduction does not build, and the
modules kept in float32 in the float64 truth. Rules are tested on configs (fast); a few newly
covered architectures run end to end.

Needs the extra `tpcheck[transformers]` (transformers==5.24.0): skipped with the reason without it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="the extra tpcheck[transformers] is not installed"
)
from tpcheck.adapters import transformers as hf  # noqa: E402
from tpcheck.adapters.transformers import (  # noqa: E402
    build,
    common,
    configs,
    probe,
    reduction,
    sweep,
)
from tpcheck.adapters.transformers import inputs as hf_inputs  # noqa: E402
from tpcheck.checker.pool.session import run_specs  # noqa: E402
from tpcheck.resolve import launcher  # noqa: E402

pytestmark = pytest.mark.skipif(
    transformers.__version__ != hf.PINNED,
    reason=f"rules measured on transformers {hf.PINNED}, found {transformers.__version__}",
)


# ------------------------------------------------------------------ the class checked


def test_the_class_checked_for_each_kind_of_architecture():
    assert hf.model_class("llama") == hf.ModelChoice(transformers.LlamaForCausalLM, hf.LOGITS)
    # a causal LM its modeling module defines but AutoModelForCausalLM does not register
    assert hf.model_class("mistral4").cls.__name__ == "Mistral4ForCausalLM"
    assert hf.model_class("mistral4").kind == hf.LOGITS
    # no causal LM: the base model, on its last hidden state
    assert hf.model_class("qwen2_vl_text") == hf.ModelChoice(
        transformers.Qwen2VLTextModel, hf.HIDDEN
    )
    assert hf.model_class("eurobert").cls.__name__ == "EuroBertModel"


def test_an_encoder_of_another_modality_is_skipped_naming_its_inputs(monkeypatch):
    monkeypatch.setattr(hf_inputs, "_METADATA", {})  # no rule makes its pixel_position_ids
    build.model_class.cache_clear()
    try:
        with pytest.raises(hf.Skip, match=r"no token ids.*pixel_values"):
            hf.model_class("gemma4_vision")
    finally:
        build.model_class.cache_clear()


# ------------------------------------------------------------------ the reduction rules


def test_a_none_size_is_filled_only_in_the_fallback():
    defaults = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": None}
    assert "num_key_value_heads" not in hf.small_overrides(defaults, {}, 2)
    assert hf.small_overrides(defaults, {}, 2, fill=True)["num_key_value_heads"] == 4


def test_a_zero_size_stays_zero_and_per_layer_sizes_shrink_each():
    defaults = {
        "qk_rope_head_dim": 0,
        "qk_nope_head_dim": 256,
        "moe_intermediate_size": [1536, 512],
    }
    out = hf.small_overrides(defaults, {}, 2)
    assert "qk_rope_head_dim" not in out and out["qk_nope_head_dim"] == 8
    assert out["moe_intermediate_size"] == [32, 32]


@pytest.mark.parametrize(
    "rope, field",
    [({"rope_type": "default", "mrope_section": [16, 24, 24]}, "rope_parameters"), (None, "m")],
)
def test_rope_sections_sum_to_half_the_reduced_rotated_dims(rope, field):
    defaults = {"hidden_size": 8192, "num_attention_heads": 64, "head_dim": 128}
    if rope is None:
        defaults["mrope_section"] = [16, 24, 24]
        field = "mrope_section"
    else:
        defaults["rope_parameters"] = rope
    out = hf.small_overrides(defaults, {}, 2)
    sections = out[field]["mrope_section"] if field == "rope_parameters" else out[field]
    assert sum(sections) == out["head_dim"] // 2 and len(sections) == 3


def test_a_rope_left_to_the_model_gets_sections_where_the_class_allows_the_key():
    defaults = {"hidden_size": 8192, "num_attention_heads": 64, "head_dim": 128}
    defaults["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    assert "rope_parameters" not in hf.small_overrides(defaults, {}, 2)
    out = hf.small_overrides(defaults, {}, 2, rope_keys=("mrope_section",))
    assert sum(out["rope_parameters"]["mrope_section"]) == 4


def test_a_prefix_cut_scales_the_other_layer_counts_to_the_kept_depth():
    types = ["sliding_attention"] * 3 + ["full_attention"]
    defaults = {
        "num_hidden_layers": 36,
        "layer_types": types * 9,
        "n_input_layers": 8,
        "n_recurrent_layers": 20,
        "n_output_layers": 8,
        "intermediate_size": [4096] * 36,
    }
    out = hf.small_overrides(defaults, {}, 2, prefix=4)
    assert out["layer_types"] == types and out["num_hidden_layers"] == 4
    counts = [out[f] for f in ("n_input_layers", "n_recurrent_layers", "n_output_layers")]
    assert sum(counts) == 4 and all(c >= 0 for c in counts)
    assert out["intermediate_size"] == [128] * 4


def test_fallbacks_cut_to_a_prefix_holding_every_layer_kind():
    types = ["sliding_attention"] * 4 + ["full_attention"]
    prefixes = [
        o["prefix"] for o in configs._fallbacks({"layer_types": types * 7}) if "prefix" in o
    ]
    assert prefixes[0] == 5 and prefixes[-1] == 16


def test_sub_configs_are_reduced_by_the_same_rules():
    sub = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "vocab_size": 32000,
    }
    out = hf.small_overrides({"text_config": sub}, {}, 2, nested=True)
    assert out["text_config"]["hidden_size"] == 64 and out["text_config"]["vocab_size"] == 128
    assert out["text_config"]["model_type"] == "llama"
    assert "text_config" not in hf.small_overrides({"text_config": sub}, {}, 2)


def test_a_field_the_config_lacks_gets_the_rules_value():
    assert configs._missing_value("dropout_rate", 2) == 0.0
    assert configs._missing_value("shared_expert_intermediate_size", 2) == 32
    assert configs._missing_value("something_else", 2) is None


@pytest.mark.parametrize(
    "model_type, check",
    [
        (
            "dory",
            lambda c: (
                c.n_input_layers + c.n_recurrent_layers + c.n_output_layers == c.num_hidden_layers
            ),
        ),  # validate_layer_type holds
        ("gemma3n_text", lambda c: c.num_hidden_layers > c.num_kv_shared_layers),
        ("nemotron", lambda c: c.num_key_value_heads == 4),
        ("deepseek_v4", lambda c: c.o_lora_rank == 16),
        ("longcat_flash", lambda c: c.zero_expert_num == 4),
    ],
)
def test_formerly_unbuildable_configs_build_small(model_type, check):
    prep = hf.prepare(model_type, 2)
    meta = hf.build_lm(model_type, prep.config, torch.float32, device="meta")
    assert sum(p.numel() for p in meta.parameters()) < hf.MAX_PARAMS
    assert check(prep.config), prep.config


# ------------------------------------------------------------------ float32-pinned modules


class CastingRouter(nn.Module):
    """A router computing in float32 whatever its input's dtype (the idiom of MoE code that pins
    its routing precision: `F.linear(hidden.float(), self.weight)`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return torch.nn.functional.linear(x.float(), self.weight).softmax(-1).to(x.dtype)


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.router = CastingRouter()
        self.proj = nn.Linear(8, 4)

    def forward(self, input_ids, **_):
        h = self.embed(input_ids)
        return self.proj(h) * self.router(h)


def test_the_module_that_runs_only_in_float32_is_found_by_running(monkeypatch):
    monkeypatch.setattr(probe, "wrap", lambda model, kind: model)
    model = Toy()
    assert probe._float32_pinned(model, hf.HIDDEN, "cpu") == ("router",)
    assert model.router.weight.dtype == torch.float32  # left as found


def test_inkling2_routers_are_pinned_and_named_in_the_case_label():
    prep = hf.prepare("inkling2_text", 2)
    assert prep.pinned and all(p.endswith("mlp.gate") for p in prep.pinned)
    assert "float32-truth" in hf.hf_spec("inkling2_text", 2).name
    truth = hf.hf_case(hf.hf_spec("inkling2_text", 2)).build_dense(torch.float64)
    dtypes = {n: p.dtype for n, p in truth.named_parameters()}
    assert all(dtypes[n] == torch.float32 for n in dtypes if ".mlp.gate." in n)
    assert dtypes["model.embed_tokens.weight"] == torch.float64


# ------------------------------------------------------------------ the hidden-state loss


def unreached(case) -> list[str]:
    """The dense model's parameters with an element the case's loss gives no gradient (an
    embedding: no gradient at all; its rows of tokens not drawn get none)."""
    model = case.build_dense(torch.float32)
    gen = torch.Generator().manual_seed(0)
    case.init(model, gen)
    inputs, target = case.make_batch(gen, torch.float32)
    case.loss(model(**inputs), target).backward()
    embeddings = {
        f"{m}.{n}".lstrip(".")
        for m, mod in model.named_modules()
        if isinstance(mod, nn.Embedding)
        for n, _ in mod.named_parameters(recurse=False)
    }
    return [
        n
        for n, p in model.named_parameters()
        if p.grad is None or not (p.grad.any() if n in embeddings else p.grad.ne(0).all())
    ]


@pytest.mark.parametrize("model_type", ["eurobert", "qwen2_vl_text"])
def test_the_hidden_state_loss_reaches_every_parameter(model_type):
    case = hf.hf_case(hf.hf_spec(model_type, 2))
    assert unreached(case) == []


def test_a_loss_that_misses_a_parameter_is_caught(monkeypatch):
    """The mutant: a loss on one hidden feature only (the final norm's other gains get no
    gradient): the test above would fail on it."""
    monkeypatch.setattr(sweep, "hidden_loss", lambda h, t: (h[..., 0] - t[..., 0]).pow(2).mean())
    case = hf.hf_case(hf.hf_spec("eurobert", 2))
    assert "norm.weight" in unreached(case)


# ------------------------------------------------------------------ end to end


def run(*specs) -> dict[str, dict]:
    with launcher(60) as pool:
        return {r.name: r.to_json() for r in run_specs(list(specs), pool)}


@pytest.mark.slow
def test_newly_covered_architectures_run_end_to_end():
    """A base model (hidden states), a causal LM found in its modeling module, float32-pinned
    routers, a prefix-cut layer pattern: each checked, every path."""
    names = ("eurobert", "mistral4", "inkling2_text", "dory")
    # a None layer pattern filled, an audio head, a model run from embeddings
    names += ("lfm2_moe", "higgs_audio_v2", "qwen3_omni_moe_talker_text")
    results = run(*(hf.hf_spec(a, 2, steps=1) for a in names))
    for name, r in results.items():
        assert r["verdict"] in ("equivalent", "not equivalent", "error"), (name, r["summary"])
    for name in ("eurobert", "lfm2_moe", "higgs_audio_v2"):
        assert results[f"hf:{name}/tp2/float32"]["verdict"] == "equivalent", name
    # given embeddings, it hits the documented q_norm/k_norm gradient defect, nothing else
    talker = results["hf:qwen3_omni_moe_talker_text/tp2/float32"]
    assert talker["verdict"] == "not equivalent"
    assert "self_attn.q_norm.weight" in talker["summary"]


def test_an_mla_query_head_stays_the_sum_of_its_parts():
    defaults = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "qk_head_dim": 192}
    out = hf.small_overrides(defaults, {}, 2)
    assert out["qk_head_dim"] == out["qk_nope_head_dim"] + out["qk_rope_head_dim"] == 12


# ------------------------------------------------------------------ fields the defaults leave open


def test_audio_codebooks_and_leading_dense_layers_shrink_by_name():
    out = hf.small_overrides({"codebook_size": 1024, "num_dense_layers": 2}, {}, 2)
    assert out["codebook_size"] == hf.VOCAB and out["num_dense_layers"] == 1


def test_the_kinds_of_a_layer_pattern_are_read_from_the_modeling_code():
    lfm2 = transformers.Lfm2MoeConfig
    assert reduction._layer_kinds(lfm2)["layer_types"] == ["full_attention", "conv"]
    ocr2 = common.CONFIG_MAPPING["deepseek_ocr2_text"]
    assert reduction._layer_kinds(ocr2)["mlp_layer_types"] == ["sparse"]


def test_a_none_layer_pattern_gets_one_layer_of_each_kind_only_in_the_fallback():
    defaults = {"num_hidden_layers": 32, "layer_types": None}
    kinds = {"layer_types": ["full_attention", "conv"]}
    assert "layer_types" not in hf.small_overrides(defaults, {}, 2, layer_kinds=kinds)
    out = hf.small_overrides(defaults, {}, 2, fill=True, layer_kinds=kinds)
    assert out["layer_types"] == ["full_attention", "conv"] and out["num_hidden_layers"] == 2


def test_an_empty_rope_gets_a_default_rope_per_layer_type():
    defaults = {
        "num_hidden_layers": 40,
        "layer_types": ["full_attention"] * 40,
        "rope_parameters": {},
    }
    out = hf.small_overrides(defaults, {}, 2, fill=True)
    assert out["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0}
    }
    assert "rope_parameters" not in hf.small_overrides(defaults, {}, 2)


def test_a_value_a_validator_requires_is_set():
    from dataclasses import dataclass

    @dataclass
    class Config:
        kv_heads: int = 4
        heads: int = 8

        def __post_init__(self):
            if self.kv_heads != 1:
                raise ValueError("QSA requires kv_heads=1.")

    assert configs._validated(Config, {"kv_heads": 4}).kv_heads == 1

    @dataclass
    class Stubborn(Config):
        def __post_init__(self):
            raise ValueError("QSA requires kv_heads=1.")

    with pytest.raises(hf.Skip, match="requires kv_heads=1"):
        configs._validated(Stubborn, {"kv_heads": 4})


def test_a_sum_a_validator_states_is_set_from_the_reduced_terms():
    """dots3_note_text's validator: "SWA head_dim must equal qk_nope_head_dim + qk_rope_head_dim";
    the reduced terms' sum is set (a term the overrides do not set: the class's default). A
    message stating a sum of terms that are not numbers leaves it a Skip."""
    from dataclasses import dataclass

    @dataclass
    class Config:
        head_dim: int = 256
        qk_nope_head_dim: int = 128
        qk_rope_head_dim: int = 64
        name: str = "x"

        def __post_init__(self):
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError("SWA head_dim must equal qk_nope_head_dim + qk_rope_head_dim")

    made = configs._validated(Config, {"head_dim": 16, "qk_nope_head_dim": 8})
    assert made.head_dim == 8 + 64
    stated = configs._required(Config, {}, "head_dim must equal name + qk_rope_head_dim")
    assert stated == (None, None)
    prep = hf.prepare("dots3_note_text", 2)
    cfg = prep.config
    assert cfg.head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


def test_sections_left_to_the_model_keep_height_and_width_equal():
    defaults = {"hidden_size": 2560, "num_attention_heads": 20, "head_dim": 128}
    defaults["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    out = hf.small_overrides(defaults, {}, 2, rope_keys=("mrope_section",))
    t, h, w = out["rope_parameters"]["mrope_section"]
    assert t == h and t + h + w == out["head_dim"] // 2


# ------------------------------------------------------------------ inputs besides token ids


def test_a_vision_encoder_is_run_from_pixels_of_its_config_s_image_size():
    choice = hf.model_class("llama4_vision_model")
    assert choice.kind == hf.HIDDEN and choice.cls.__name__ == "Llama4VisionModel"
    cfg = common.CONFIG_MAPPING["llama4_vision_model"]()
    inputs, *masked = hf_inputs._input_sets(choice.cls, cfg)
    assert inputs == (("pixel_values", (hf.BATCH, 3, 448, 448), "float"),)
    assert [m[:1] for m in masked] == [inputs]  # then with a mask, where the first fails


def test_an_encoder_needing_metadata_is_skipped_naming_that_input(monkeypatch):
    """Without the rules that make them (the mutant: none), the encoders needing metadata are
    skipped naming the input."""
    monkeypatch.setattr(hf_inputs, "_METADATA", {})
    build.model_class.cache_clear()
    try:
        with pytest.raises(hf.Skip, match=r"`grid_thw` that no generic rule makes"):
            hf.model_class("dots3_note_vision_encoder")
        with pytest.raises(hf.Skip, match=r"`num_patches`"):
            hf.model_class("deepseek_ocr2_encoder")
    finally:
        build.model_class.cache_clear()


def test_token_ids_come_first_then_embeddings_then_encoder_states():
    cls = hf.model_class("t5gemma2_decoder").cls
    sets = hf_inputs._input_sets(cls, hf.small_config("t5gemma2_decoder", 2))
    names = [tuple(n for n, _, _ in s) for s in sets]
    assert names == [
        ("input_ids",),
        ("inputs_embeds",),
        ("input_ids", "encoder_hidden_states"),
        ("inputs_embeds", "encoder_hidden_states"),
    ]


@pytest.mark.parametrize(
    "model_type, inputs",
    [
        ("llama", ("input_ids",)),  # runs from token ids: only they are tried
        ("t5gemma2_decoder", ("input_ids", "encoder_hidden_states")),
        ("qwen3_omni_moe_talker_text", ("inputs_embeds",)),
        ("qwen3_omni_moe_talker_code_predictor", ("inputs_embeds",)),
    ],
)
def test_the_first_input_set_that_runs_is_the_case_s(model_type, inputs):
    prep = hf.prepare(model_type, 2)
    assert tuple(n for n, _, _ in prep.inputs) == inputs
    batch, target = hf.hf_case(hf.hf_spec(model_type, 2)).make_batch(
        torch.Generator().manual_seed(0), torch.float64
    )
    assert tuple(batch) == inputs
    assert all(v.dtype == torch.float64 for k, v in batch.items() if k != "input_ids")


def test_token_id_batches_draw_what_they_drew_before():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    batch, labels = hf.batch_maker(hf.IDS)(g1, torch.float32)
    assert torch.equal(batch["input_ids"], torch.randint(0, hf.VOCAB, (2, 8), generator=g2))
    assert torch.equal(labels, torch.randint(0, hf.VOCAB, (2, 8), generator=g2))


def test_a_head_registered_as_the_base_model_is_seen_through_its_first_output():
    out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=torch.ones(2, 8, 4))
    assert build._last_hidden_state(out).shape == (2, 8, 4)


def test_the_hidden_state_loss_reaches_every_parameter_from_embeddings():
    """Given `inputs_embeds`, a model runs every parameter but its token embedding (it is given
    the embeddings instead): that one has no gradient on either side."""
    case = hf.hf_case(hf.hf_spec("qwen3_omni_moe_talker_text", 2))
    assert unreached(case) == ["codec_embedding.weight"]


@pytest.mark.parametrize(
    "model_type",
    [
        "higgs_audio_v2",
        "lfm2_moe",
        "deepseek_ocr2_text",
        "qwen4_exp_text",
        "cohere_compass_text",
        "ernie4_5_vl_moe_text",
        "dots3_note_text",
    ],
)
def test_formerly_skipped_architectures_prepare(model_type):
    prep = hf.prepare(model_type, 2)
    assert prep.tp_plan and prep.output_shape


def test_per_layer_overrides_are_reduced_and_moved_to_the_kept_layer_of_their_kind():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    wide = {"head_dim": 512, "num_key_value_heads": 1}
    defaults = {
        "num_hidden_layers": 24,
        "layer_types": types * 4,
        "hidden_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "per_layer_config": {"05": wide, "11": wide, "17": wide, "23": wide},
    }
    out = hf.small_overrides(defaults, {}, 2)
    assert out["layer_types"] == ["sliding_attention", "full_attention"]
    # twice the default head stays twice the reduced one; a single KV head gets the rules' count
    assert out["per_layer_config"] == {"01": {"head_dim": 16, "num_key_value_heads": 4}}


def test_a_reduced_per_layer_head_builds_consistent_layers():
    prep = hf.prepare("embedding_gemma2_text", 2)
    meta = hf.build_lm("embedding_gemma2_text", prep.config, torch.float32, device="meta")
    for layer in meta.layers:
        attn = layer.self_attn
        assert attn.k_proj.out_features % (2 * attn.head_dim) == 0  # KV heads shard over 2 ranks
