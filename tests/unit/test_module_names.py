"""push_module's checkpoint names: wrapper components dropped, real module names kept."""

from orchestrator.trainer.module import hf_name


def test_wrapper_components_are_dropped():
    assert hf_name("_orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert hf_name("module.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert (
        hf_name("model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight")
        == "model.layers.1.self_attn.q_proj.weight"
    )
    assert hf_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"


def test_names_that_only_contain_a_wrapper_word_are_kept():
    assert hf_name("model.vision_module.proj.weight") == "model.vision_module.proj.weight"
    assert hf_name("model.submodule.weight") == "model.submodule.weight"
    assert hf_name("encoder.module.weight") == "encoder.module.weight"  # not DDP's front prefix
