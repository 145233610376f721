"""Media encoded once per distinct media object: the same logits and gradients as the model's own
forward (which encodes every row's media), with the encoder run once per object, for each family
on the fast path (LLaVA, Qwen2-VL, Qwen2.5-VL, AudioFlamingo3; Qwen3-VL and Qwen3-Omni through
precomputed vision outputs, deepstack features included)."""

from __future__ import annotations

import pytest
import torch

from rlx.engines.training import collate
from rlx.media import encode
from rlx.media.encode import forward_inputs
from rlx.media.inputs import concat_media
from rlx.media.positions import position_ids
from rlx.models import load_pretrained
from rlx.models.tiny_omni import tiny_omni_model
from rlx.models.tiny_vl import tiny_vl_model
from tests.integration import test_audio_model, test_qwen_omni_engine, test_qwen_vl_engine, test_vision_model


def _llava(paths):
    model, tokenizer = load_pretrained(paths["vision"])
    return model, test_vision_model._requests(tokenizer, model, test_vision_model.PROMPTS[:2]), tokenizer.pad_token_id


def _qwen(family):
    def build(_):
        model, _spec = tiny_vl_model(family)
        return model, test_qwen_vl_engine.requests_for(model, test_qwen_vl_engine.PROMPTS[:2]), 0
    return build


def _omni(family):
    def build(_):
        model = tiny_omni_model(family)
        return model, test_qwen_omni_engine.requests_for(model, test_qwen_omni_engine.PROMPTS[:2]), 0
    return build


def _audio(paths):
    model, tokenizer = load_pretrained(paths["audio"])
    return model, test_audio_model._requests(model, tokenizer, test_audio_model.PROMPTS[:2]), tokenizer.pad_token_id


@pytest.fixture(params=["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni",
                        "audioflamingo3"])
def family(request, tiny_vision_path, tiny_audio_path):
    torch.manual_seed(0)
    builders = {"llava": _llava, "qwen2_vl": _qwen("qwen2_vl"), "qwen2_5_vl": _qwen("qwen2_5_vl"),
                "qwen3_vl": _qwen("qwen3_vl"), "qwen2_5_omni": _omni("qwen2_5_omni"),
                "qwen3_omni": _omni("qwen3_omni"), "audioflamingo3": _audio}
    return builders[request.param]({"vision": tiny_vision_path, "audio": tiny_audio_path})


def test_one_encoding_per_shared_object_gives_the_models_own_logits_and_gradients(family, monkeypatch):
    model, (first, second), pad = family
    # rows 0-2 share the first prompt's media object (a group), row 3 has the second prompt's
    rows = [first, first, first, second]
    batch = collate([r.prompt_ids for r in rows], [[5, 6, 7]] * 4, pad, media=[r.media for r in rows])
    calls = []
    model_type = model.config.model_type
    registry = encode.VISION_ENCODERS if model_type in encode.VISION_ENCODERS else encode.ENCODERS
    own_encoder = registry[model_type]
    monkeypatch.setitem(registry, model_type, lambda m, media: (calls.append(1), own_encoder(m, media))[1])
    position = position_ids(model, batch.input_ids, batch.attention_mask, concat_media(batch.media))
    kwargs = {"attention_mask": batch.attention_mask, "use_cache": False}
    fast = model(position_ids=position, **kwargs, **forward_inputs(model, batch.input_ids, batch.media)).logits
    assert len(calls) == 2  # once per distinct object, not once per row
    own = model(input_ids=batch.input_ids, position_ids=position, **kwargs, **concat_media(batch.media)).logits
    torch.testing.assert_close(fast, own, rtol=0, atol=1e-5)
    grads = []
    for logits in (fast, own):
        model.zero_grad()
        logits[:, -3:].logsumexp(-1).sum().backward(retain_graph=True)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("tower" in n or "visual" in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-6)
