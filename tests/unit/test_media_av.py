"""Video and audio decoding: real media encoded here with PyAV and the stdlib `wave` module."""

from __future__ import annotations

import io
import shutil
import struct
import subprocess
import wave
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from rlx.config import MediaLimits, VideoSampling, load_config
from rlx.errors import ConfigError, DataError
from rlx.media.audio import load_audio
from rlx.media.loading import MediaItem
from rlx.media.video import load_video, sample_times

av = pytest.importorskip("av")

WIDTH, HEIGHT, BITS = 64, 48, 6  # a frame shows its index as 6 black/white bars, 10 pixels wide each
TIME_BASE = Fraction(1, 100)


def _bars(index: int) -> np.ndarray:
    frame = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
    for bit in range(BITS):
        if index >> bit & 1:
            frame[:, bit * 10:(bit + 1) * 10] = 255
    return frame


def _index(frame: np.ndarray) -> int:
    """The index `_bars` drew, read back after lossy coding from each bar's middle."""
    return sum(1 << bit for bit in range(BITS) if frame[8:-8, bit * 10 + 3:bit * 10 + 7].mean() > 128)


def _mp4(times: list[float], end: float, time_base: Fraction = TIME_BASE) -> bytes:
    """An mp4 whose frame i, shown from times[i] until the next (the last until `end`), draws i."""
    shown_until = {round(start / time_base): until for start, until in zip(times, [*times[1:], end])}
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.codec_context.time_base = time_base
        for index, start in enumerate(times):
            frame = av.VideoFrame.from_ndarray(_bars(index % 2**BITS), format="rgb24")
            frame.pts, frame.time_base = round(start / time_base), time_base
            for packet in stream.encode(frame):
                start_s = float(packet.pts * packet.time_base)  # the muxer takes the last frame's length from here
                packet.duration = round((shown_until[round(start_s / time_base)] - start_s) / packet.time_base)
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def _zero_mdat(mp4: bytes) -> bytes:
    """The mp4 with every coded frame zeroed and its header (durations, sizes) kept."""
    out, pos = bytearray(mp4), 0
    while pos < len(out):
        size, kind = struct.unpack(">I4s", out[pos:pos + 8])
        if kind == b"mdat":
            out[pos + 8:pos + size] = bytes(size - 8)
        pos += size
    return bytes(out)


CFR = [i / 10 for i in range(30)]  # 3 s at 10 fps


@pytest.fixture
def limits(tmp_path: Path) -> MediaLimits:
    return MediaLimits(root=str(tmp_path))


def _video(data: bytes) -> MediaItem:
    return MediaItem("video", data=data)


def test_sample_times_follow_the_rate_within_min_and_max_frames():
    assert np.allclose(sample_times(3.0, 2.0, 4, 768), [0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert np.allclose(sample_times(1.0, 2.0, 4, 768), [0, 0.25, 0.5, 0.75])  # short: min_frames, denser
    long = sample_times(1000.0, 2.0, 4, 768)  # long: max_frames over the whole video
    assert len(long) == 768 and np.allclose(np.diff(long), 1000 / 768)
    assert len(sample_times(2.3, 2.0, 4, 768)) == 5  # round(4.6)


def test_a_video_file_is_sampled_at_two_frames_per_second(tmp_path, limits):
    path = tmp_path / "clip.mp4"
    path.write_bytes(_mp4(CFR, 3.0))
    video = load_video(MediaItem("video", path=str(path)), limits, "f.jsonl:1")
    assert all(frame.shape == (HEIGHT, WIDTH, 3) and frame.dtype == np.uint8 for frame in video.frames)
    assert [_index(frame) for frame in video.frames] == [0, 5, 10, 15, 20, 25]
    assert video.seconds_per_frame == pytest.approx(0.5)


def test_frames_are_chosen_by_timestamp_not_by_index(limits):
    """20 frames in the first second, then 10 over two seconds: at 0.5 s steps the frames shown are
    not every fifth one."""
    times = [i * 0.05 for i in range(20)] + [1 + i * 0.2 for i in range(10)]
    frames = load_video(_video(_mp4(times, 3.0)), limits, "f.jsonl:1").frames
    assert [_index(frame) for frame in frames] == [0, 10, 20, 22, 25, 27]


def test_bytes_and_a_path_give_the_same_frames(tmp_path, limits):
    data = _mp4(CFR, 3.0)
    (tmp_path / "clip.mp4").write_bytes(data)
    from_path = load_video(MediaItem("video", path=str(tmp_path / "clip.mp4")), limits, "r")
    from_bytes = load_video(_video(data), limits, "r")
    assert all(np.array_equal(a, b) for a, b in zip(from_path.frames, from_bytes.frames, strict=True))


def test_short_and_long_videos_get_min_and_max_frames_and_say_the_rate_they_took(limits):
    one_second = load_video(_video(_mp4(CFR[:10], 1.0)), limits, "r")
    assert [_index(frame) for frame in one_second.frames] == [0, 2, 5, 7]  # min_frames=4 at 0, .25, .5, .75 s
    assert one_second.seconds_per_frame == pytest.approx(0.25), "denser than 2 fps, and it says so"
    capped = load_video(_video(_mp4(CFR, 3.0)), limits, "r", VideoSampling(max_frames=4))
    assert [_index(frame) for frame in capped.frames] == [0, 7, 15, 22]  # 0, .75, 1.5, 2.25 s
    assert capped.seconds_per_frame == pytest.approx(0.75)
    few = MediaLimits(root=limits.root, max_frames=3)  # the limit caps the sampling too
    assert [_index(frame) for frame in load_video(_video(_mp4(CFR, 3.0)), few, "r").frames] == [0, 10, 20]
    frames = load_video(_video(_mp4([0.0], 0.1)), limits, "r").frames  # one frame: shown at every time
    assert len(frames) == 4 and all(_index(frame) == 0 for frame in frames)


def test_a_long_video_is_refused_from_its_header_before_decoding(limits):
    """Two hours at a frame every half hour; its frames are zeroed, so any decoding would fail
    with another message."""
    data = _zero_mdat(_mp4([0.0, 1800.0, 3600.0, 5400.0], 7200.0))
    with pytest.raises(DataError, match=r"^f\.jsonl:3: inline video lasts 7200\.0 s, more than "
                                        r"data\.media_limits\.max_seconds=600; raise data\.media_limits\.max_seconds"):
        load_video(_video(data), limits, "f.jsonl:3")
    patient = MediaLimits(root=limits.root, max_seconds=7200)
    with pytest.raises(DataError, match="inline video is corrupt and cannot be decoded .*re-encode the file"):
        load_video(_video(data), patient, "f.jsonl:3")


def test_corrupt_and_unreadable_videos_are_clear_errors(tmp_path, limits):
    data = _mp4(CFR, 3.0)
    with pytest.raises(DataError, match=r"^r: inline video is corrupt and cannot be decoded \(Invalid data"):
        load_video(_video(_zero_mdat(data)), limits, "r")
    for bad in (data[: len(data) // 2], b"not a video" * 50, b""):
        with pytest.raises(DataError, match=r"^r: inline video is not in a container rlx reads \(FFmpeg demuxers "
                                            r"mov, matroska, avi\)"):
            load_video(_video(bad), limits, "r")
    with pytest.raises(DataError, match=r"^r: inline video has no video stream$"):
        load_video(_video(_encoded_audio("aac", "mp4", 16_000)), limits, "r")


def test_a_concat_list_cannot_open_other_files(tmp_path, limits, monkeypatch):
    """FFmpeg's concat demuxer reads the files a list names (relative ones from the working
    directory): only whitelisted demuxers run, so the list is refused."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.mp4").write_bytes(_mp4(CFR, 3.0))
    monkeypatch.chdir(elsewhere)
    concat = b"ffconcat version 1.0\nfile 'secret.mp4'\n"
    with av.open(io.BytesIO(concat)) as unguarded:  # what PyAV does unasked
        assert len(list(unguarded.decode(video=0))) == 30
    with pytest.raises(DataError, match="^r: inline video is not in a container rlx reads"):
        load_video(_video(concat), MediaLimits(root=str(tmp_path / "root")), "r")


def test_a_stream_denser_than_any_camera_is_refused(limits):
    """1000 frames in half a second (2000 per second): a header that understates the duration."""
    data = _mp4([i / 2000 for i in range(1000)], 0.5, time_base=Fraction(1, 2000))
    with pytest.raises(DataError, match=r"^r: inline video holds more than 480 frames per second of its "
                                        r"stated 0\.5 s"):
        load_video(_video(data), limits, "r")
    dense_but_real = _mp4([i / 200 for i in range(100)], 0.5, time_base=Fraction(1, 200))  # 200 per second
    assert len(load_video(_video(dense_but_real), limits, "r").frames) == 4


def test_video_limits_name_the_row_and_the_field(tmp_path, limits):
    data = _mp4(CFR, 3.0)
    small = MediaLimits(root=limits.root, max_pixels=3000)
    with pytest.raises(DataError, match=r"^f:2: video frame of 64x48 = 3072 pixels is larger than data\.media_limits"
                                        r"\.max_pixels=3000; .* or downscale the video frame$"):
        load_video(_video(data), small, "f:2")
    with pytest.raises(DataError, match=rf"^f:2: inline video has {len(data)} bytes, more than data\.media_limits"
                                        r"\.max_bytes=1000;"):
        load_video(_video(data), MediaLimits(root=limits.root, max_bytes=1000), "f:2")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.mp4"
    outside.write_bytes(data)
    try:
        with pytest.raises(DataError, match=r"^f:2: media path .* outside the media root .*data\.media_limits\.root"):
            load_video(MediaItem("video", path=str(outside)), limits, "f:2")
    finally:
        outside.unlink()


def _growing_mp4(small: tuple[int, int], large: tuple[int, int]) -> bytes:
    """An mp4 whose header (and first 10 frames) say `small` (w, h), then 10 frames of `large` in-band."""
    packets = []
    for width, height in (small, large):
        coder = av.CodecContext.create("mpeg4", "w")
        coder.width, coder.height, coder.pix_fmt, coder.time_base = width, height, "yuv420p", Fraction(1, 10)
        for index in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 128, np.uint8), format="rgb24")
            frame.pts = index
            packets += coder.encode(frame.reformat(format="yuv420p"))
        packets += coder.encode(None)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = *small, "yuv420p"
        for index, packet in enumerate(packets):
            packet.stream, packet.pts, packet.dts, packet.duration = stream, index, index, 1
            packet.time_base = Fraction(1, 10)
            container.mux(packet)
    return buffer.getvalue()


def test_a_video_whose_frames_outgrow_its_header_is_refused_by_the_decoder(limits):
    data = _growing_mp4((64, 48), (1280, 960))
    small = MediaLimits(root=limits.root, max_pixels=64 * 48, max_frames=20)
    with pytest.raises(DataError, match=r"^v: inline video has a frame past data\.media_limits\.max_pixels=3072 "
                                        r"beyond what its header states \(FFmpeg refused to decode it\)"):
        load_video(_video(data), small, "v", VideoSampling(fps=10, max_frames=20))
    assert len(load_video(_video(data), limits, "v", VideoSampling(fps=10, max_frames=20)).frames) == 20


def test_a_frame_array_is_taken_as_already_sampled(limits):
    frames = np.stack([_bars(i) for i in range(5)])
    loaded = load_video(MediaItem("video", array=frames), limits, "r", VideoSampling(fps=4.0))
    assert len(loaded.frames) == 5 and all(np.array_equal(a, b) for a, b in zip(loaded.frames, frames))
    assert loaded.seconds_per_frame == 0.25, "an array is frames already sampled at data.video.fps"
    as_json = load_video(MediaItem("video", array=frames.astype(np.int64)), limits, "r")  # JSON lists load as int64
    assert all(frame.dtype == np.uint8 and np.array_equal(frame, b) for frame, b in zip(as_json.frames, frames))
    with pytest.raises(DataError, match=r"^r: a video array of 5 frames is more than "
                                        r"data\.media_limits\.max_frames=4"):
        load_video(MediaItem("video", array=frames), MediaLimits(max_frames=4), "r")
    with pytest.raises(DataError, match=r"shape \[T, H, W, 3\] .* got \[48, 64, 3\]"):
        load_video(MediaItem("video", array=frames[0]), limits, "r")
    with pytest.raises(DataError, match="must hold uint8"):
        load_video(MediaItem("video", array=frames / 255.0), limits, "r")
    with pytest.raises(DataError, match=r"values in 0\.\.255, got 0\.\.256"):
        load_video(MediaItem("video", array=frames.astype(np.int64) + (frames == 255)), limits, "r")


def test_video_and_audio_settings_in_the_config():
    data = load_config(None, []).data
    assert (data.video.fps, data.video.min_frames, data.video.max_frames, data.audio_sampling_rate) == (
        2.0, 4, 768, 16000)
    assert data.media_limits.max_frames == 768
    assert load_config(None, ["data.video.fps=1", "data.audio_sampling_rate=24000"]).data.video.fps == 1
    with pytest.raises(ConfigError, match="min_frames=9 is more than data.video.max_frames=8"):
        load_config(None, ["data.video.min_frames=9", "data.video.max_frames=8"])


# audio


def _tone(seconds: float, rate: int, hertz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * hertz * np.arange(round(seconds * rate)) / rate)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM; `samples` is [N] (mono) or [N, channels]."""
    samples = samples.reshape(len(samples), -1)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(samples.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.rint(samples * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def _peak_hertz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


def _audio(data: bytes) -> MediaItem:
    return MediaItem("audio", data=data)


def test_a_wav_at_44100_hz_is_resampled_to_16000_hz_keeping_its_tone(tmp_path, limits):
    path = tmp_path / "tone.wav"
    path.write_bytes(_wav(_tone(1.0, 44_100), 44_100))
    samples = load_audio(MediaItem("audio", path=str(path)), limits, "r")
    assert samples.dtype == np.float32 and samples.shape == (16_000,)
    assert abs(_peak_hertz(samples, 16_000) - 440) < 2
    assert 0.48 < np.abs(samples[100:-100]).max() < 0.52  # the amplitude kept


def test_stereo_is_averaged_into_mono(limits):
    left, right = _tone(0.5, 48_000, 440, 0.6), _tone(0.5, 48_000, 1000, 0.2)
    samples = load_audio(_audio(_wav(np.stack([left, right], axis=1), 48_000)), limits, "r")
    expected = (_tone(0.5, 16_000, 440, 0.6) + _tone(0.5, 16_000, 1000, 0.2)) / 2
    assert samples.shape == (8_000,) and np.abs(samples[200:-200] - expected[200:-200]).max() < 0.01


def _encoded_audio(codec: str, container: str, rate: int, samples: np.ndarray | None = None) -> bytes:
    """Mono `samples` (default: one second of a 440 Hz tone), encoded by PyAV."""
    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    samples = (_tone(1.0, rate) if samples is None else samples).astype(np.float32)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        step = stream.codec_context.frame_size or 1024
        for start in range(0, len(samples), step):
            frame = av.AudioFrame.from_ndarray(samples[None, start:start + step], format="flt", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buffer.getvalue()


@pytest.mark.parametrize(("codec", "container", "rate"), [("libmp3lame", "mp3", 44_100), ("libopus", "ogg", 48_000),
                                                          ("aac", "mp4", 22_050)])
def test_compressed_audio_decodes_to_the_tone(codec, container, rate, limits):
    samples = load_audio(_audio(_encoded_audio(codec, container, rate)), limits, "r")
    assert abs(len(samples) - 16_000) < 1_600  # encoder delay and padding add a little
    assert abs(_peak_hertz(samples, 16_000) - 440) < 2


def test_audio_limits_and_errors(limits):
    long = _wav(_tone(3.0, 8_000), 8_000)
    with pytest.raises(DataError, match=r"^f:4: inline audio lasts 3\.0 s, more than "
                                        r"data\.media_limits\.max_seconds=2"):
        load_audio(_audio(long), MediaLimits(max_seconds=2), "f:4")
    with pytest.raises(DataError, match=r"^f:4: inline audio has \d+ bytes, more than "
                                        r"data\.media_limits\.max_bytes=100"):
        load_audio(_audio(long), MediaLimits(max_bytes=100), "f:4")
    with pytest.raises(DataError, match=r"inline audio is not in a container rlx reads \(FFmpeg demuxers wav, mp3"):
        load_audio(_audio(b"RIFF but no wave" * 20), limits, "f:4")
    with pytest.raises(DataError, match=r"inline audio has no audio stream"):
        load_audio(_audio(_mp4(CFR[:5], 0.5)), limits, "f:4")
    with pytest.raises(DataError, match=r"^f:4: inline audio is corrupt and cannot be decoded \(Invalid data"):
        load_audio(_audio(_zero_mdat(_encoded_audio("aac", "mp4", 16_000))), limits, "f:4")


def test_audio_longer_than_its_header_states_is_refused_while_decoding(limits):
    """Raw AAC (ADTS) states no duration; FFmpeg estimates it from the first frames' bit rate. Loud
    noise then a long silence makes it estimate 4 s for 21 s of audio."""
    noise_then_silence = np.concatenate([np.random.default_rng(0).uniform(-1, 1, 16_000), np.zeros(20 * 16_000)])
    data = _encoded_audio("aac", "adts", 16_000, noise_then_silence)
    with av.open(io.BytesIO(data)) as container:
        assert container.duration / 1e6 < 10
    with pytest.raises(DataError, match=r"^r: inline audio decodes to more than data\.media_limits\.max_seconds=10 s "
                                        r"of audio \(its header states less or nothing\)"):
        load_audio(_audio(data), MediaLimits(max_seconds=10), "r")
    assert len(load_audio(_audio(data), MediaLimits(max_seconds=30), "r")) > 20 * 16_000


def test_an_audio_array_is_taken_at_the_sampling_rate(limits):
    tone = _tone(0.5, 16_000)
    samples = load_audio(MediaItem("audio", array=tone), limits, "r")
    assert samples.dtype == np.float32 and np.allclose(samples, tone, atol=1e-7)
    with pytest.raises(DataError, match=r"^r: an audio array of 8000 samples lasts 1\.0 s, more than "
                                        r"data\.media_limits\.max_seconds=0\.5"):
        load_audio(MediaItem("audio", array=tone), MediaLimits(max_seconds=0.5), "r", sampling_rate=8_000)
    with pytest.raises(DataError, match=r"divide int16 PCM by 32768"):
        load_audio(MediaItem("audio", array=np.rint(tone * 32767).astype(np.int16)), limits, "r")
    with pytest.raises(DataError, match=r"1-D mono samples at 16000 Hz, got shape \[8000, 2\]"):
        load_audio(MediaItem("audio", array=np.stack([tone, tone], axis=1)), limits, "r")
    with pytest.raises(DataError, match=r"finite values in \[-1, 1\]"):
        load_audio(MediaItem("audio", array=tone * 3), limits, "r")


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed (apt-get install espeak-ng)")
def test_a_spoken_clip_from_espeak_ng(tmp_path, limits):
    path = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), "seven plus five is twelve"], check=True, timeout=30)
    with wave.open(str(path)) as clip:
        seconds = clip.getnframes() / clip.getframerate()
    samples = load_audio(MediaItem("audio", path=str(path)), limits, "r")
    assert abs(len(samples) / 16_000 - seconds) < 0.01
    assert np.sqrt(np.mean(samples**2)) > 0.01 and np.abs(samples).max() <= 1  # speech, not silence
