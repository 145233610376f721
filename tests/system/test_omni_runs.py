"""Images, audio and video in one prompt, end to end on tiny Qwen2.5-Omni and Qwen3-Omni thinkers: a
JSONL dataset points to PNG, WAV and MP4 files; rlx's processor reads them (the video at 2 fps, the
audio at 16 kHz), the engine and the trainer see the same media and positions (Qwen3-Omni's language
model is a mixture of experts: its routes are replayed too), and the trained thinker exports to a
folder transformers' Auto classes reload. One run processes its media in a pool of processes."""

from __future__ import annotations

import io
import json
import wave

import numpy as np
import pytest

from rlx.cli import main
from rlx.config import build_config
from rlx.models import load_pretrained
from rlx.models.tiny_omni import OMNI_FAMILIES, build_tiny_omni
from rlx.obs.metrics import read_metrics
from rlx.orchestration.colocate import run_colocate

av = pytest.importorskip("av")


def _png(path, digit: int) -> None:
    from PIL import Image

    image = np.zeros((28, 28, 3), np.uint8)
    image[:, : 5 * (digit + 1)] = 200
    Image.fromarray(image).save(path)


def _wav(path, digit: int, seconds: float = 0.6) -> None:
    t = np.arange(int(seconds * 16_000)) / 16_000
    samples = 0.3 * np.sin(2 * np.pi * 220 * (digit + 1) * t)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(np.rint(samples * 32767).astype("<i2").tobytes())


def _mp4(path, digit: int, seconds: float = 2.0, rate: int = 8) -> None:
    frame = np.zeros((56, 56, 3), np.uint8)
    frame[: 10 * (digit + 1)] = 220
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for _ in range(int(seconds * rate)):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("family", OMNI_FAMILIES)
def test_a_qwen_omni_run_reads_images_audio_and_video_files_and_exports(family, tmp_path, capsys):
    model_path = build_tiny_omni(tmp_path / "tiny-omni", family)
    rows = []
    for i in range(8):
        digit = i % 3
        _png(tmp_path / f"image{i}.png", digit)
        _wav(tmp_path / f"clip{i}.wav", digit)
        _mp4(tmp_path / f"video{i}.mp4", digit)
        rows.append({"prompt": "<image><audio><video>\nsum:", "label": str(3 * (digit + 1)),
                     "images": [f"image{i}.png"], "audios": [f"clip{i}.wav"], "videos": [f"video{i}.mp4"]})
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = {"source": "jsonl", "path": str(tmp_path / "rows.jsonl"), "eval_path": str(tmp_path / "rows.jsonl"),
            "eval_size": 4, "apply_chat_template": False,
            "media_keys": {"image": "images", "audio": "audios", "video": "videos"},
            # Qwen3-Omni's media are processed in a pool of two processes, Qwen2.5-Omni's on the rollout's thread
            "processor_workers": 2 if family == "qwen3_omni" else 0}
    config = build_config({
        "model": {"path": str(model_path)}, "data": data,
        "rollout": {"n": 4, "prompts_per_step": 2, "max_new_tokens": 4},
        "reward": {"name": "exact_match", "extract": "last_number"}, # a random model rarely answers right: every group trains (on its KL term) even with equal rewards
        "algorithm": {"kl_coef": 0.05, "filter_zero_std_groups": False},
        "train": {"steps": 2, "lr": 1e-3, "micro_batch_size": 4, "eval_every": 2, "checkpoint_every": 2},
        "logging": {"run_dir": str(tmp_path / "run"), "progress_bar": False},
    })
    run_dir = run_colocate(config, echo=lambda _: None)
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    # the trainer's log-probs equal the engine's only if both saw the same image, clip and frames at the
    # same 3-D positions; the Reference agrees with the first step's policy only with them too
    assert len(steps) == 2 and all(r["rollout_logprob_abs_diff"] < 1e-4 for r in steps)
    assert abs(steps[0]["kl"]) < 1e-5
    if family == "qwen3_omni":  # R3 resolved from `auto` for a MoE: the trainer replayed the engine's routes
        assert all("route_mismatch_fraction" in r for r in steps)
    assert [r["step"] for r in records if "eval_accuracy" in r] == [0, 2]

    assert main(["export", str(run_dir), str(tmp_path / "hf")]) == 0
    model, _ = load_pretrained(tmp_path / "hf")
    assert type(model).__name__ == {"qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
                                    "qwen3_omni": "Qwen3OmniMoeThinkerForConditionalGeneration"}[family]
    capsys.readouterr()
    assert main(["eval", str(run_dir)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["eval_accuracy"] == [r for r in records if "eval_accuracy" in r][-1]["eval_accuracy"]
