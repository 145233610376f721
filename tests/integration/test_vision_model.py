"""A LLaVA model through rlx's engines: the `hf` engine prefills with images and decodes with its
KV cache and continuous batching, the trainer scores the same tokens with the same images, and
the two agree; the engine never samples the image placeholder; `train.trainable` freezes the rest."""

from __future__ import annotations

import pytest
import torch

from rlx.config import TrainConfig
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import TrainingEngine, collate, token_logprobs
from rlx.engines.training.forward import forward_logits
from rlx.models import eos_token_ids, load_pretrained
from rlx.models.vision import IMAGE_TOKEN, VISION_PARAMETERS


@pytest.fixture()
def vision(tiny_vision_path):
    torch.manual_seed(0)
    return load_pretrained(tiny_vision_path)


def _requests(tokenizer, model, prompts: list[tuple[str, int]]) -> list[GenerationRequest]:
    """Each prompt's `<image>` expanded to the model's image tokens, with that many random images."""
    generator = torch.Generator().manual_seed(0)
    per_image = model.config.image_seq_length
    out = []
    for i, (text, images) in enumerate(prompts):
        ids = tokenizer(text.replace(IMAGE_TOKEN, IMAGE_TOKEN * per_image), add_special_tokens=False)["input_ids"]
        media = {"pixel_values": torch.randn(images, 3, 8, 8, generator=generator)} if images else None
        out.append(GenerationRequest(i, ids, media))
    return out


PROMPTS = [("<image>what digit?", 1), ("compare <image> and <image>:", 2), ("no image here, a longer prompt", 0),
           ("<image>", 1), ("see <image> then say", 1), ("two: <image><image>", 2)]


def _trainer_logprobs(model, tokenizer, requests, results, temperature):
    media = {r.request_id: r.media for r in requests}
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id,
                    media=[media[r.request_id] for r in results])
    with torch.no_grad():
        return token_logprobs(model, batch, temperature)[0]


def test_engine_and_trainer_agree_with_images_through_refills(vision):
    model, tokenizer = vision
    requests = _requests(tokenizer, model, PROMPTS)
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer,
                                max_batch_size=4)  # 6 requests through 4 slots: refills merge into the cache
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
    trained = _trainer_logprobs(model, tokenizer, requests, results, 1.0)
    gap = max((trained[row, :len(r.logprobs)] - torch.tensor(r.logprobs)).abs().max().item()
              for row, r in enumerate(results))
    assert gap < 1e-4, gap
    assert all(r.prompt_ids == q.prompt_ids for r, q in zip(results, requests))


def test_the_image_changes_what_the_model_sees(vision):
    model, tokenizer = vision
    first, second = _requests(tokenizer, model, [("<image>what digit?", 1)] * 2)
    assert not torch.equal(first.media["pixel_values"], second.media["pixel_values"])
    batch = collate([first.prompt_ids, second.prompt_ids], [[5, 6], [5, 6]], tokenizer.pad_token_id,
                    media=[first.media, second.media])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch)
    assert (logprobs[0] - logprobs[1]).abs().max() > 1e-3


def test_the_engine_never_samples_the_placeholder_and_keeps_its_mass_in_the_logprobs(vision):
    model, tokenizer = vision
    image_token = model.config.image_token_id
    requests = _requests(tokenizer, model, PROMPTS[:3])
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer)
    probe = collate([requests[0].prompt_ids], [[5]], tokenizer.pad_token_id, media=[requests[0].media])
    with torch.no_grad():  # point the placeholder's output row along the final hidden state: a favourite token
        hidden = model(input_ids=probe.input_ids, pixel_values=requests[0].media["pixel_values"],
                       output_hidden_states=True).hidden_states[-1][0, -2]
        model.lm_head.weight[image_token] = 10 * hidden / hidden.norm()
        # the distribution of the first response token: unbanned, the placeholder would be sampled
        assert forward_logits(model, probe, bf16=False)[0, -2].softmax(-1)[image_token] > 0.3
    for params in (SamplingParams(temperature=1.0, max_new_tokens=16, seed=2), SamplingParams(0.0, max_new_tokens=8)):
        results = engine.generate(requests, params)
        assert all(image_token not in r.response_ids for r in results)
        trained = _trainer_logprobs(model, tokenizer, requests, results, params.temperature)
        for row, r in enumerate(results):
            assert torch.allclose(trained[row, :len(r.logprobs)], torch.tensor(r.logprobs), atol=1e-4)


def test_trainable_patterns_train_the_vision_side_of_a_frozen_language_model(vision):
    model, tokenizer = vision
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = TrainingEngine(model, tokenizer, TrainConfig(lr=1e-2, trainable=list(VISION_PARAMETERS)), temperature=1.0)
    (request,) = _requests(tokenizer, model, PROMPTS[:1])
    batch = collate([request.prompt_ids], [[5, 6, 7]], tokenizer.pad_token_id, media=[request.media])
    logprobs, _ = engine.forward(model, batch)
    logprobs.sum().backward()
    engine.update()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for name in changed)
    assert {"model.multi_modal_projector.linear_1.weight", "model.vision_tower.embeddings.patch_embedding.weight"} <= changed
    frozen = engine.frozen_weights()  # what DCS puts into the object store once
    assert frozen <= set(engine.weights()) and not frozen & changed
    assert frozen == {name for name in before if not name.startswith(("model.vision_tower.", "model.multi_modal"))}
    with pytest.raises(ValueError, match="matches no parameter"):
        TrainingEngine(model, tokenizer, TrainConfig(trainable=["vision.*"]), temperature=1.0)


def test_a_frozen_head_tied_to_a_trained_embedding_is_not_frozen():
    from rlx.models.tiny import char_tokenizer, tiny_model
    from rlx.weights.buckets import flatten_parameters

    tokenizer = char_tokenizer()
    model = tiny_model(len(tokenizer))
    model.config.tie_word_embeddings = True
    model.tie_weights()
    flatten_parameters(model, 1 << 30)  # as the Actor's are: every parameter in one storage
    engine = TrainingEngine(model, tokenizer, TrainConfig(trainable=["model.embed_tokens.*"]), temperature=1.0)
    frozen = engine.frozen_weights()
    assert "lm_head.weight" in engine.weights() and not {"lm_head.weight", "model.embed_tokens.weight"} & frozen
    assert "model.layers.0.mlp.up_proj.weight" in frozen
    assert TrainingEngine(model, tokenizer, TrainConfig(), temperature=1.0).frozen_weights() == frozenset()


@pytest.mark.parametrize("tied", [False, True])
def test_the_text_models_weights_are_taken_over_exactly(tied):
    from rlx.models.audio import add_audio_tower
    from rlx.models.tiny import char_tokenizer, tiny_model
    from rlx.models.vision import add_vision_tower

    for add_tower in (add_vision_tower, add_audio_tower):
        tokenizer = char_tokenizer()
        text = tiny_model(len(tokenizer))
        if tied:
            text.config.tie_word_embeddings = True
            text.tie_weights()
        vocab = len(tokenizer)
        model = add_tower(text, tokenizer)
        embeddings, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        assert torch.equal(embeddings[:vocab], text.get_input_embeddings().weight)
        assert torch.equal(head[:vocab], text.get_output_embeddings().weight)
        assert torch.allclose(embeddings[vocab], text.get_input_embeddings().weight.mean(0))  # the new token
        layer = "layers.0.self_attn.q_proj.weight"
        assert torch.equal(model.model.language_model.state_dict()[layer], text.model.state_dict()[layer])
