"""Whisper's log-mel features, computed by rlx (no feature extractor object, no hub file).

A Whisper encoder reads a fixed window of 10 ms mel frames (30 s: 3000 frames), so every clip is
zero-padded to its window before the transform, as Whisper's own feature extractor does: a 400-
sample Hann STFT (centred, reflect-padded) every 160 samples at 16 kHz, power spectrum, Slaney-style
mel filters from 0 to 8 kHz, log10 floored at 1e-10, clamped to 8 below the window's maximum, then
mapped by (x + 4) / 4. The last STFT frame is dropped, so a window of N samples gives N / 160 frames.

A clip longer than the window is cut into windows (each padded on its own); a mask marks each
window's real frames, `ceil(samples / 160)`, which decide how many audio tokens the window becomes.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

SAMPLING_RATE = 16_000  # Hz: the rate Whisper's filters and hop are defined at
N_FFT = 400  # 25 ms windows
HOP_LENGTH = 160  # 10 ms between frames
MAX_FREQUENCY = 8_000.0
LOG_FLOOR = 1e-10
DYNAMIC_RANGE = 8.0  # log10 units kept below the window's maximum


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = 3.0 * hz / 200.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-12) / 1000.0) * 27.0 / np.log(6.4), linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel - 15.0)), 200.0 * mel / 3.0)


@lru_cache(maxsize=8)
def mel_filters(n_mels: int, n_fft: int = N_FFT, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """[n_fft // 2 + 1, n_mels] triangular filters, evenly spaced in mels over 0..8 kHz, each scaled
    to unit area (Slaney normalisation), as librosa and Whisper build them. Read-only (cached)."""
    fft_hz = np.linspace(0.0, sampling_rate / 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(MAX_FREQUENCY), n_mels + 2))
    rising = (fft_hz[:, None] - edges[None, :-2]) / np.diff(edges)[None, :-1]
    falling = (edges[None, 2:] - fft_hz[:, None]) / np.diff(edges)[None, 1:]
    filters = np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    filters.flags.writeable = False
    return filters


def log_mel(samples: np.ndarray, n_mels: int, frames: int) -> torch.Tensor:
    """[n_mels, frames] float32 Whisper features of mono 16 kHz `samples`, zero-padded (or cut) to
    `frames * HOP_LENGTH` samples first: the window an encoder reads."""
    window_samples = frames * HOP_LENGTH
    padded = np.zeros(window_samples, dtype=np.float64)
    kept = np.asarray(samples, dtype=np.float64)[:window_samples]
    padded[:kept.size] = kept
    stft = torch.stft(torch.from_numpy(padded), N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT, dtype=torch.float64),
                      center=True, pad_mode="reflect", return_complex=True)
    power = stft[:, :-1].abs() ** 2  # [n_fft // 2 + 1, frames]
    mel = torch.from_numpy(np.ascontiguousarray(mel_filters(n_mels).T)) @ power
    logs = mel.clamp(min=LOG_FLOOR).log10()
    logs = torch.maximum(logs, logs.max() - DYNAMIC_RANGE)
    return ((logs + 4.0) / 4.0).float()


def real_frames(samples: int) -> int:
    """The frames of a window that hold audio, not padding: one per started 10 ms."""
    return -(-samples // HOP_LENGTH)


def encoder_tokens(frames: int) -> int:
    """Audio tokens a Whisper encoder with 2x average pooling (Qwen2-Audio, AudioFlamingo3) makes of
    `frames` real mel frames: its stride-2 convolution halves them (rounding up), the pooling halves
    again (rounding down): 25 per second."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def chunked_encoder_tokens(frames: int, n_window: int) -> int:
    """Audio tokens Qwen3-Omni's encoder makes of `frames` real mel frames: it reads chunks of
    2 * n_window frames, each full chunk making 13 tokens (n_window=50: 13 per second), and the rest
    through three stride-2 convolutions (each halving, rounding up)."""
    full, rest = divmod(frames, 2 * n_window)
    for _ in range(3):
        rest = (rest - 1) // 2 + 1
    return rest + 13 * full


def clip_windows(samples: np.ndarray, frames: int) -> list[np.ndarray]:
    """The clip cut into consecutive windows of `frames` frames; a tail too short to make an audio
    token (under 21 ms) is dropped, so a clip that short has no window."""
    size = frames * HOP_LENGTH
    pieces = [samples[start:start + size] for start in range(0, samples.size, size)]
    return [piece for piece in pieces if encoder_tokens(real_frames(piece.size)) > 0]
